"""The Kubernetes manifests under deploy/k8s say what the deploy issue asks (read, not applied)."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import urllib.parse
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from prometheus_client import generate_latest

from inference_api.__main__ import parse_args as parse_api_args
from inference_api.metrics import Metrics
from proxy.__main__ import parse_args as parse_proxy_args
from proxy.limits import TeamLimits, parse_team_limits
from proxy.revoked import parse_revoked
from tests.conftest import ROOT

K8S = ROOT / "deploy" / "k8s"
INGRESS = ROOT / "deploy" / "k8s-ingress"
PROXY_TLS = ROOT / "deploy" / "k8s-proxy-tls"
SETS = (K8S, INGRESS, PROXY_TLS)


def manifests() -> dict[tuple[str, str], dict]:
    found = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") != "Kustomization":
                found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(
        p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"
    )


def test_inference_replicas_have_a_gpu_each_and_the_three_probes():
    inference = container(manifests()[("Deployment", "inference")])
    assert inference["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert inference["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert inference["livenessProbe"]["httpGet"]["path"] == "/health"
    startup = inference["startupProbe"]
    assert startup["httpGet"]["path"] == "/ready"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # minutes to load a model
    api = parse_api_args(inference["command"][3:])
    assert inference["ports"][0]["containerPort"] == api.port and api.host == "0.0.0.0"


def test_only_the_proxy_is_exposed_and_it_balances_over_the_discovered_replicas():
    found = manifests()
    # Internal by default: plain HTTP carries bearer tokens, so the way in is an overlay with TLS.
    assert found[("Service", "proxy")]["spec"].get("type", "ClusterIP") == "ClusterIP"
    for (kind, name), doc in found.items():
        if kind == "Service":
            assert doc["spec"].get("type", "ClusterIP") == "ClusterIP", name
    inference_service = found[("Service", "inference")]["spec"]
    assert inference_service["clusterIP"] == "None"  # headless: DNS gives every replica
    assert inference_service.get("type", "ClusterIP") == "ClusterIP"
    proxy = parse_proxy_args(container(found[("Deployment", "proxy")])["command"][3:])
    assert proxy.discover
    (upstream,) = proxy.upstreams
    parts = urllib.parse.urlsplit(upstream)
    assert parts.hostname == "inference" and parts.port == inference_service["ports"][0]["port"]


def test_the_jwt_secret_comes_from_a_kubernetes_secret():
    env = {e["name"]: e for e in container(manifests()[("Deployment", "proxy")])["env"]}
    assert env["JWT_SECRET"]["valueFrom"]["secretKeyRef"] == {"name": "inference-jwt", "key": "JWT_SECRET"}
    assert "value" not in env["JWT_SECRET"]


def test_a_network_policy_lets_only_the_proxy_reach_the_replicas():
    found = manifests()
    policy = found[("NetworkPolicy", "inference-only-from-proxy")]["spec"]
    inference_labels = found[("Deployment", "inference")]["spec"]["template"]["metadata"]["labels"]
    proxy_labels = found[("Deployment", "proxy")]["spec"]["template"]["metadata"]["labels"]
    assert policy["policyTypes"] == ["Ingress"]
    assert policy["podSelector"]["matchLabels"].items() <= inference_labels.items()
    (rule,) = policy["ingress"]
    pod_sources = [source["podSelector"]["matchLabels"] for source in rule["from"] if "podSelector" in source]
    assert pod_sources == [{"app.kubernetes.io/name": "proxy"}]
    assert pod_sources[0].items() <= proxy_labels.items()
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]


def test_replicas_scale_on_a_queue_depth_the_server_really_exports():
    hpa = manifests()[("HorizontalPodAutoscaler", "inference")]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "inference"
    (metric,) = hpa["metrics"]
    name = metric["pods"]["metric"]["name"]
    exported = generate_latest(Metrics().registry).decode()
    assert f"\n{name} " in exported
    inference = manifests()[("Deployment", "inference")]["spec"]["template"]["metadata"]["annotations"]
    assert inference["prometheus.io/path"] == "/metrics" and inference["prometheus.io/port"] == "8000"


def test_the_proxy_runs_its_own_image_and_reads_the_teams_files_from_a_config_map():
    found = manifests()
    deployment = found[("Deployment", "proxy")]["spec"]["template"]
    proxy = container(found[("Deployment", "proxy")])
    assert proxy["image"].endswith(":proxy")  # docker build --target proxy: no torch
    config = parse_proxy_args(proxy["command"][3:])
    (mount,) = proxy["volumeMounts"]
    (volume,) = [v for v in deployment["spec"]["volumes"] if v["name"] == mount["name"]]
    files = found[("ConfigMap", volume["configMap"]["name"])]["data"]
    folder = mount["mountPath"].rstrip("/") + "/"
    assert config.revoked_tokens.startswith(folder) and config.team_limits.startswith(folder)
    # As shipped: nothing revoked, no limits, and both files parse as the proxy parses them.
    assert parse_revoked(files[config.revoked_tokens.removeprefix(folder)]) == frozenset()
    assert parse_team_limits(files[config.team_limits.removeprefix(folder)]) == TeamLimits()
    # Prometheus scrapes each team's usage from the probe port.
    annotations = deployment["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(config.health_port)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_the_ingress_overlay_terminates_tls_in_front_of_an_internal_proxy_service():
    kustomization = yaml.safe_load((INGRESS / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../k8s", "ingress.yaml"]
    assert "patches" not in kustomization
    assert built(INGRESS)[("Service", "proxy")]["spec"]["type"] == "ClusterIP"
    ingress = yaml.safe_load((INGRESS / "ingress.yaml").read_text())
    assert ingress["kind"] == "Ingress"
    (tls,) = ingress["spec"]["tls"]
    (rule,) = ingress["spec"]["rules"]
    assert tls["secretName"] and tls["hosts"] == [rule["host"]]
    (path,) = rule["http"]["paths"]
    backend = path["backend"]["service"]
    service = manifests()[("Service", backend["name"])]
    assert backend["port"]["name"] in [port["name"] for port in service["spec"]["ports"]]
    annotations = ingress["metadata"]["annotations"]
    assert "cert-manager.io/cluster-issuer" in annotations
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"  # streams as generated


def test_the_proxy_tls_overlay_publishes_only_https_from_the_proxy_itself():
    found = built(PROXY_TLS)
    service = found[("Service", "proxy")]["spec"]
    assert service["type"] == "LoadBalancer"
    assert service["ports"] == [{"name": "https", "port": 443, "targetPort": "http"}]
    deployment = found[("Deployment", "proxy")]["spec"]["template"]["spec"]
    proxy = container(found[("Deployment", "proxy")])
    config = parse_proxy_args(proxy["command"][3:])
    (http,) = [port for port in proxy["ports"] if port["name"] == "http"]
    assert http["containerPort"] == config.port  # the traffic port, the one with TLS
    mounts = {mount["mountPath"].rstrip("/") + "/": mount for mount in proxy["volumeMounts"]}
    for path in (config.certfile, config.keyfile):
        folder = os.path.dirname(path) + "/"
        (volume,) = [v for v in deployment["volumes"] if v["name"] == mounts[folder]["name"]]
        assert volume["secret"]["secretName"] == "proxy-tls"  # kubectl create secret tls: tls.crt, tls.key
        assert os.path.basename(path) in ("tls.crt", "tls.key")
    assert proxy["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"  # the traffic port speaks TLS now
    assert "scheme" not in proxy["livenessProbe"]["httpGet"]  # the probe port stays plain HTTP


# The model: named in a ConfigMap, downloaded once into a volume by an init step, served offline.


def substitute(command: list[str], env: list[dict], found: dict) -> list[str]:
    """The command as the kubelet runs it: $(NAME) replaced by the container's variable NAME."""
    values = {}
    for variable in env:
        if "value" in variable:
            values[variable["name"]] = variable["value"]
        elif "configMapKeyRef" in variable["valueFrom"]:
            ref = variable["valueFrom"]["configMapKeyRef"]
            values[variable["name"]] = found[("ConfigMap", ref["name"])]["data"][ref["key"]]
    return [re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), m.group(0)), arg) for arg in command]


def model_env(env: list[dict]) -> dict:
    (model,) = [variable for variable in env if variable["name"] == "MODEL"]
    return model["valueFrom"]["configMapKeyRef"]


def test_the_replicas_serve_the_config_map_model_from_the_volume_with_the_hub_off():
    found = manifests()
    pod = found[("Deployment", "inference")]["spec"]["template"]["spec"]
    inference = container(found[("Deployment", "inference")])
    assert model_env(inference["env"]) == {"name": "inference-model", "key": "MODEL"}
    model = found[("ConfigMap", "inference-model")]["data"]["MODEL"]
    assert model
    api = parse_api_args(substitute(inference["command"], inference["env"], found)[3:])
    (mount,) = [m for m in inference["volumeMounts"] if api.backend.model.startswith(m["mountPath"] + "/")]
    assert api.backend.model == f"{mount['mountPath']}/{model}"
    assert api.served_model_names == (model,)  # called by its hub id, as with --model HUB_ID
    assert mount.get("readOnly") is True
    env = {variable["name"]: variable for variable in inference["env"]}
    assert env["HF_HUB_OFFLINE"]["value"] == "1"
    assert "HF_TOKEN" not in env  # it needs none: only the init step reaches the hub
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = found[("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])]["spec"]
    # Every replica mounts the one claim: with several, it must be shared.
    replicas = found[("Deployment", "inference")]["spec"]["replicas"]
    most = max(replicas, found[("HorizontalPodAutoscaler", "inference")]["spec"]["maxReplicas"])
    assert most == 1 or claim["accessModes"] == ["ReadWriteMany"]
    assert claim["resources"]["requests"]["storage"]


def test_an_init_step_downloads_the_model_into_the_volume_with_an_optional_token():
    found = manifests()
    pod = found[("Deployment", "inference")]["spec"]["template"]["spec"]
    inference = container(found[("Deployment", "inference")])
    (init,) = pod["initContainers"]
    assert init["image"] == inference["image"]  # the server's image has the hf command
    assert model_env(init["env"]) == model_env(inference["env"])
    env = {variable["name"]: variable for variable in init["env"]}
    token = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token == {"name": "hf-token", "key": "HF_TOKEN", "optional": True}  # only for gated models
    assert "HF_HUB_OFFLINE" not in env
    (served,) = inference["volumeMounts"]
    (written,) = init["volumeMounts"]
    assert written["name"] == served["name"] and written["mountPath"] == served["mountPath"]
    assert not written.get("readOnly")
    assert init["command"][:2] == ["sh", "-c"]
    assert f'dir="{written["mountPath"]}/$MODEL"' in init["command"][2]
    # Pods run as uid 10001: the volume must be theirs to write.
    security = pod["securityContext"]
    assert security["runAsUser"] == 10001 and security["fsGroup"] == 10001


def run_download(script: str, tmp_path: Path, model: str, hf_exit: int = 0) -> tuple[int, list[str]]:
    """Runs a download script with /models in tmp_path and a stand-in `hf` that logs its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "hf.log"
    hf = bin_dir / "hf"
    hf.write_text(
        f'#!/bin/sh\necho "$*" >> {log}\nmkdir -p "$4" && echo {{}} > "$4/config.json"\nexit {hf_exit}\n'
    )
    hf.chmod(0o755)
    env = dict(os.environ, MODEL=model, PATH=f"{bin_dir}:{os.environ['PATH']}")
    script = script.replace("/models/", f"{tmp_path}/models/")
    result = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    return result.returncode, log.read_text().splitlines() if log.exists() else []


def test_the_init_step_downloads_once_and_a_failed_download_stops_the_pod(tmp_path):
    (init,) = manifests()[("Deployment", "inference")]["spec"]["template"]["spec"]["initContainers"]
    assert_downloads_once(init["command"][2], tmp_path)


def assert_downloads_once(script: str, tmp_path: Path) -> None:
    model = "Qwen/Qwen2.5-1.5B-Instruct"
    call = f"download {model} --local-dir {tmp_path}/%s/models/{model}"
    # A failed download fails the step (the server does not start), and the next start tries again.
    assert run_download(script, tmp_path / "failing", model, hf_exit=1) == (1, [call % "failing"])
    assert run_download(script, tmp_path / "failing", model, hf_exit=1) == (1, [call % "failing"] * 2)
    # A download that succeeds is the last one: later starts find it in the volume.
    assert run_download(script, tmp_path / "good", model) == (0, [call % "good"])
    assert (tmp_path / "good" / "models" / model / ".complete").is_file()
    assert run_download(script, tmp_path / "good", model) == (0, [call % "good"])


# Schemas: every object as the API server would check it, offline, for fixed Kubernetes versions.

KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc and doc.get("kind") != "Kustomization"]


def built(folder: Path) -> dict[tuple[str, str], dict]:
    """What `kubectl kustomize folder` gives for the features these sets use: resources (files and
    folders) and inline JSON patches (add, replace) on targets named by kind and name."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(kustomization) <= {"apiVersion", "kind", "resources", "patches"}, kustomization
    found = {}
    for resource in kustomization["resources"]:
        path = folder / resource
        docs = built(path).values() if path.is_dir() else documents(path)
        found |= {(d["kind"], d["metadata"]["name"]): d for d in docs}
    found = copy.deepcopy(found)
    for patch in kustomization.get("patches", []):
        target = found[(patch["target"]["kind"], patch["target"]["name"])]
        for operation in yaml.safe_load(patch["patch"]):
            *parents, last = operation["path"].lstrip("/").split("/")
            node = target
            for key in parents:
                node = node[int(key)] if isinstance(node, list) else node[key]
            if operation["op"] == "add" and last == "-":
                node.append(operation["value"])
            elif operation["op"] in ("add", "replace"):
                key = int(last) if isinstance(node, list) else last
                if operation["op"] == "replace":
                    assert key < len(node) if isinstance(node, list) else key in node, operation
                node[key] = operation["value"]
            else:
                raise AssertionError(f"unexpected patch {operation}")
    return found


SCHEMA_FILES = sorted(p for folder in SETS for p in folder.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", SCHEMA_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_manifest_passes_the_kubernetes_schema(path, version):
    docs = documents(path)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # strict: no unknown fields either


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("folder", SETS, ids=lambda p: p.name)
def test_every_set_as_kustomize_assembles_it_passes_the_kubernetes_schema(folder, version):
    for doc in built(folder).values():
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_schema_check_refuses_a_misspelt_field():
    broken = copy.deepcopy(manifests()[("Deployment", "inference")])
    container(broken)["volumeMount"] = container(broken).pop("volumeMounts")
    with pytest.raises(kubernetes_validate.ValidationError, match="volumeMount"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (kustomize builds offline)")
@pytest.mark.parametrize("folder", SETS, ids=lambda p: p.name)
def test_kubectl_kustomize_gives_each_set_as_the_tests_read_it(folder):
    result = subprocess.run(
        ["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60, check=True
    )
    documents = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(result.stdout)}
    assert documents == built(folder)
