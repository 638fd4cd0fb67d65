"""The Kubernetes manifests under deploy/k8s say what the deploy issue asks (read, not applied)."""

from __future__ import annotations

import shutil
import subprocess
import urllib.parse

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
    assert found[("Service", "proxy")]["spec"]["type"] == "LoadBalancer"
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


INGRESS = ROOT / "deploy" / "k8s-ingress"


def test_the_ingress_overlay_terminates_tls_in_front_of_an_internal_proxy_service():
    kustomization = yaml.safe_load((INGRESS / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../k8s", "ingress.yaml"]
    (patch,) = kustomization["patches"]
    assert patch["target"] == {"kind": "Service", "name": "proxy"}
    assert yaml.safe_load(patch["patch"]) == [{"op": "replace", "path": "/spec/type", "value": "ClusterIP"}]
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


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (kustomize builds offline)")
def test_kustomize_builds_both_sets():
    for folder, proxy_service in ((K8S, "LoadBalancer"), (INGRESS, "ClusterIP")):
        built = subprocess.run(
            ["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60, check=True
        )
        documents = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(built.stdout)}
        assert documents[("Service", "proxy")]["spec"]["type"] == proxy_service
        assert (("Ingress", "proxy") in documents) == (folder == INGRESS)
