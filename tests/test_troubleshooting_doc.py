"""docs/troubleshooting.md quotes the messages the code really gives: each is made here by the code that
gives it (or, for log lines and HTTP errors, found in it), and must appear on the page as written."""

from __future__ import annotations

import importlib.util
import re
import socket
import time

import jwt
import pytest
import torch
from transformers import LlamaConfig, LlavaConfig, RwkvConfig

from backend.model import resources
from backend.model.architectures import UnsupportedModel, check_supported
from backend.quant.group_wise import GroupWiseFormat, UnsupportedCheckpoint, checkpoint_format, unpack_layer
from inference_api.errors import RETRY_AFTER_NOT_READY, RETRY_AFTER_QUEUE_FULL
from proxy.auth import AuthError, authenticate
from tests.conftest import ROOT

DOC = ROOT / "docs" / "troubleshooting.md"
SECRET = "s" * 64
_spec = importlib.util.spec_from_file_location("run_stack", ROOT / "scripts" / "run_stack.py")
run_stack = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_stack)


def page() -> str:
    return DOC.read_text()


def token(claims: dict, secret: str = SECRET, algorithm: str = "HS256") -> str:
    return jwt.encode({"team_id": "t", "token_id": "x", **claims}, secret, algorithm=algorithm)


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "Basic dXNlcjpwYXNz",
        f"Bearer {token({'exp': int(time.time()) - 60})}",
        f"Bearer {token({}, secret='another secret of at least 32 bytes')}",
        f"Bearer {token({'nbf': int(time.time()) + 3600})}",
        f"Bearer {jwt.encode({'token_id': 'x'}, SECRET, algorithm='HS256')}",
        f"Bearer {token({'team_id': ''})}",
        f"Bearer {token({}, algorithm='HS512')}",
        "Bearer not-a-jwt",
    ],
    ids=["missing", "scheme", "expired", "secret", "nbf", "claim", "empty", "alg", "malformed"],
)
def test_each_401_reason_is_on_the_page(authorization):
    with pytest.raises(AuthError) as refused:
        authenticate(authorization, SECRET)
    assert f"`{refused.value}`" in page()


def test_the_proxys_revocation_and_429_messages_are_on_the_page():
    from proxy.auth import Caller
    from proxy.config import ProxyConfig
    from proxy.limits import Limits
    from proxy.team_gate import Refused, TeamGate
    from proxy.teams import Teams

    teams = Teams(ProxyConfig())
    teams.revoked = ["x"]  # a revoked list, without a file
    with pytest.raises(AuthError) as refused:
        teams.admit(Caller("t", "x"))
    assert f"`{refused.value}`" in page()
    gate = TeamGate()
    for limits in (Limits(concurrent_streams=3), Limits(requests_per_minute=3)):
        with pytest.raises(Refused) as refused:
            for _ in range(4):
                gate.admit(f"team {limits}", limits)
        assert f"`{without_figures(refused.value.message)}`" in page()
    with pytest.raises(Refused) as refused:
        gate.admit("wide", Limits(concurrent_streams=3), streams=96)
    assert f"`{without_figures(refused.value.message)}`" in page()


def test_the_port_in_use_message_is_make_runs():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with pytest.raises(run_stack.PieceFailed) as failed:
            run_stack.check_free("127.0.0.1", port, "the proxy", "--proxy-port")
    assert f"run: {failed.value}".replace(str(port), "8080") in page()


def test_the_refusals_of_models_are_the_engines():
    llava = LlavaConfig(text_config=LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4))
    for config in (RwkvConfig(hidden_size=64, num_hidden_layers=2), llava):
        with pytest.raises(UnsupportedModel) as refused:
            check_supported(config)
        assert str(refused.value) in page()


@pytest.mark.parametrize(
    "quantization_config",
    [{"quant_method": "gptq", "bits": 3, "group_size": 128}],
)
def test_the_refusals_of_quantized_checkpoints_are_the_engines(quantization_config):
    with pytest.raises(UnsupportedCheckpoint) as refused:
        checkpoint_format(quantization_config)
    assert str(refused.value) in page()


def test_the_damaged_g_idx_refusal_is_the_engines():
    """The page's example: a layer of 4096 inputs in 32 groups of 128 whose g_idx names group 1000."""
    g_idx = torch.arange(4096, dtype=torch.int32) // 128
    g_idx[7] = 1000
    layer = {
        "qweight": torch.zeros(4096 // 8, 16, dtype=torch.int32),
        "qzeros": torch.zeros(32, 2, dtype=torch.int32),
        "scales": torch.ones(32, 16, dtype=torch.float16),
        "g_idx": g_idx,
    }
    fmt = GroupWiseFormat("gptq", 4, 128, True)
    with pytest.raises(UnsupportedCheckpoint) as refused:
        unpack_layer(layer, fmt, "model.layers.0.mlp.down_proj")
    assert str(refused.value).removeprefix("model.layers.0.mlp.down_proj: ") in page()


def without_figures(text: str) -> str:
    return re.sub(r"\d+(?:\.\d+)?", "N", text)


def resource_message(tmp_path, rows: int, max_seq_len: int, **load) -> str:
    """The start-up check's message for a tiny Llama, on the machine `measure_available` describes."""
    tiny = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(resources.InsufficientResources) as short:
        resources.check_resources(
            tiny,
            dtype=torch.bfloat16,
            cache_dtype=torch.float32,
            device=torch.device("cpu"),
            rows=rows,
            max_seq_len=max_seq_len,
            disk_path=tmp_path,
            **load,
        )
    return str(short.value)


@pytest.mark.parametrize(
    "rows, max_seq_len, load",
    [
        (1000, 2048, {"converting": False}),  # the KV cache the most of it
        (1, 64, {"converting": True, "quantizing": "gguf", "gguf_bytes": 2**20}),  # the load the most
        (1, 64, {"converting": True, "converting_whole": True, "gguf_bytes": 2**20}),  # in memory
    ],
    ids=["serving", "quantizing-load", "whole-conversion"],
)
def test_the_resource_messages_are_the_start_up_checks(rows, max_seq_len, load, monkeypatch, tmp_path):
    disk = 2**40  # only the RAM short: the message quoted has one line
    monkeypatch.setattr(
        resources, "measure_available", lambda device, path: resources.Available(0, disk, None)
    )
    message = resource_message(tmp_path, rows, max_seq_len, **load)
    assert ("weights as they load and are quantized" in message) == ("quantizing" in load)
    assert ("converted in float32, in memory" in message) == ("converting_whole" in load)
    quoted = "\n".join(line.removeprefix("    ") for line in page().splitlines())
    assert without_figures(message) in without_figures(quoted)


@pytest.mark.parametrize(
    "path, fragment",
    [
        ("inference_api/generation.py", "the model is not loaded yet"),
        ("inference_api/generation.py", "the server is busy: "),
        ("inference_api/router.py", "every row is busy and the queue is full"),
        ("inference_api/router.py", " places for requests; "),
        ("inference_api/ops.py", "the backend is loading or restarting"),
        ("proxy/forward.py", "no inference server is ready"),
        ("proxy/forward.py", "the inference server did not answer in time"),
        ("backend/process.py", "backend process exited with code"),
        ("inference_api/router.py", "the backend died while starting: "),
        ("inference_api/router.py", "; restarting it in "),
        ("backend/model/gguf_conversion.py", "saved the converted model to"),
        ("backend/model/loader.py", "from its converted copy in"),
        ("backend/model/loader.py", "keep no copies for many rows, which fit: "),
        ("backend/model/gguf_conversion.py", "could not cache the converted model in"),
        ("backend/model/source.py", "does not exist"),
        ("backend/model/source.py", "has no config.json: not a transformers model's"),
        ("scripts/run_stack.py", "before it was ready"),
        ("backend/model/cache_size.py", "a row needs"),
        ("inference_api/apis/lora_adapters.py", "only on a server started with --allow-runtime-lora"),
        ("proxy/app.py", "is the operator's, not forwarded by the proxy: call the inference server directly"),
        ("inference_api/generation.py", " does not exist; this server serves "),
        ("inference_api/apis/native/routes.py", " not found; this server serves "),
        (
            "inference_api/generation.py",
            "(a client written for Text Generation Inference, which ignores the model",
        ),
    ],
)
def test_each_quoted_fragment_is_in_the_code(path, fragment):
    assert fragment in (ROOT / path).read_text()
    assert fragment in " ".join(page().split())


def test_the_retry_after_figures_are_the_servers():
    assert f"`Retry-After: {RETRY_AFTER_NOT_READY}`" in page()
    assert f"`Retry-After: {RETRY_AFTER_QUEUE_FULL}`" in page()


def test_the_lora_refusals_are_the_engines(tmp_path):
    from huggingface_hub import constants

    from backend.model.lora import AdapterError, LoraBatch, LoraLinear, LoraWeights, check_shapes
    from backend.utils.hub import DownloadFailed, download_adapter

    layer = LoraLinear(torch.nn.Linear(576, 576, bias=False), LoraBatch())
    wider = LoraWeights(torch.zeros(16, 2048), torch.zeros(2048, 16), 2.0)
    with pytest.raises(AdapterError) as shapes:
        check_shapes("model.layers.0.self_attn.q_proj", layer, wider)
    assert f"LoRA adapter 'sql' (/adapters/sql): {shapes.value}" in page()
    with pytest.MonkeyPatch.context() as hub, pytest.raises(DownloadFailed) as hub_id:
        hub.setattr(constants, "HF_HUB_OFFLINE", True)
        hub.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # empty
        download_adapter("team/sql-lora", None)
    why = str(hub_id.value).partition(": ")[0]  # then huggingface_hub's own words
    assert f"LoRA adapter 'sql' (team/sql-lora): {why}: ..." in page()
