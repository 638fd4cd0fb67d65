"""`--served-model-name` (vLLM's): the model answers to each name given, reports the first, and lists
every one in /v1/models; any other name, the backend's own included, is a 404. Through real HTTP on a mock."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import requests
from huggingface_hub import InferenceClient

from tests.server_fixture import RunningServer, running_server

# "dummy": the name huggingface_hub's InferenceClient sends a URL's chat when it is given no model
NAMES = ("SmolLM2-135M-Instruct", "team/smol", "dummy")


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    options = ["--mock", "--rows", "2", "--mock-tokens-per-second", "1000", "--served-model-name", *NAMES]
    with running_server(*options) as running:
        yield running


def test_v1_models_lists_every_name_the_first_first(server):
    models = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert [model["id"] for model in models] == list(NAMES)
    assert {model["root"] for model in models} == {"mock"}  # what each name stands for
    assert requests.get(f"{server.url}/ready", timeout=10).json()["model"] == NAMES[0]


@pytest.mark.parametrize("name", NAMES)
def test_the_native_api_answers_to_each_name(server, name):
    response = requests.post(
        f"{server.url}/predictions/{name}",
        json={"text": "Hello", "max_tokens": 3, "stream": False},
        timeout=10,
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("name", NAMES)
def test_openai_requests_naming_either_report_the_first(server, name):
    completion = requests.post(
        f"{server.url}/v1/completions", json={"model": name, "prompt": "Hello", "max_tokens": 3}, timeout=10
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["model"] == NAMES[0]
    body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    with requests.post(f"{server.url}/v1/chat/completions", json=body, stream=True, timeout=10) as stream:
        assert stream.status_code == 200
        events = [line.removeprefix(b"data: ") for line in stream.iter_lines() if line]
    chunks = [json.loads(event) for event in events[:-1]]
    assert events[-1] == b"[DONE]" and chunks and {chunk["model"] for chunk in chunks} == {NAMES[0]}


def test_tgis_client_given_no_model_is_answered_through_a_name_given_for_it(server):
    """TGI ignores `model`; this server 404s a name it does not serve, so a TGI user names the client's
    (docs/frontend.md, TGI's chat)."""
    client = InferenceClient(base_url=server.url, timeout=10)
    answer = client.chat_completion(messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert answer.model == NAMES[0] and answer.usage.completion_tokens == 3
    for name, hinted in (("tgi", True), ("smol", False)):
        body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        refused = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=10)
        message = refused.json()["error"]["message"]
        assert refused.status_code == 404 and ("--served-model-name adding this one" in message) == hinted


@pytest.mark.parametrize("name", ["mock", "smol", "SmolLM2-135M-Instruct-x"])
def test_any_other_name_is_the_usual_404(server, name):
    native = requests.post(f"{server.url}/predictions/{name}", json={"text": "Hello"}, timeout=10)
    assert native.status_code == 404
    assert native.json()["message"] == (
        f"model {name!r} not found; this server serves 'SmolLM2-135M-Instruct' or 'team/smol' or 'dummy'"
    )
    openai = requests.post(
        f"{server.url}/v1/completions", json={"model": name, "prompt": "Hello", "max_tokens": 3}, timeout=10
    )
    assert openai.status_code == 404
    assert openai.json()["error"]["code"] == "model_not_found" and openai.json()["error"]["param"] == "model"


def test_without_the_option_the_model_keeps_its_own_name(fast_server):
    models = requests.get(f"{fast_server.url}/v1/models", timeout=10).json()["data"]
    assert [(model["id"], model["root"]) for model in models] == [("mock", "mock")]
