"""Every class of bad input of SPEC §4.1, through the real gunicorn server: its status, a message
naming the field, nothing reaching the backend, and a server that serves normally afterwards."""

from __future__ import annotations

import copy
import json

import pytest
import requests

from tests.server_fixture import RunningServer

GOOD = {"text": "hello", "max_tokens": 4, "stream": False}


def with_field(**fields: object) -> bytes:
    return json.dumps({**GOOD, **fields}).encode()


# (body, field the message must name)
BAD_BODIES = [
    pytest.param(b'{"text": "hello", ', "JSON", id="malformed-json"),
    pytest.param(b"\xff\xfe not utf-8", "JSON", id="not-utf8"),
    pytest.param(b"[1, 2]", "body", id="not-an-object"),
    pytest.param(b"[" * 50_000, "JSON", id="deeply-nested"),
    pytest.param(b"", "JSON", id="empty-body"),
    pytest.param(json.dumps({"max_tokens": 4}).encode(), "text", id="text-missing"),
    pytest.param(with_field(text=""), "text", id="text-empty"),
    pytest.param(with_field(text=123), "text", id="text-number"),
    pytest.param(with_field(text=["a"]), "text", id="text-list"),
    pytest.param(b'{"text": "\\ud800"}', "text", id="text-lone-surrogate"),
    pytest.param(b'{"text": "\xed\xa0\x80"}', "text", id="text-surrogate-bytes"),  # json reads them too
    pytest.param(with_field(stop_sequence=["ok", "\udc00"]), "stop_sequence[1]", id="stop-lone-surrogate"),
    pytest.param(with_field(**{"\ud800": 1}), "request body has a key", id="key-lone-surrogate"),
    pytest.param(with_field(temperature="hot"), "temperature", id="temperature-word"),
    pytest.param(with_field(temperature=10.5), "temperature", id="temperature-over"),
    pytest.param(with_field(temperature=-0.1), "temperature", id="temperature-negative"),
    pytest.param(with_field(temperature=True), "temperature", id="temperature-bool"),
    pytest.param(b'{"text": "a", "temperature": NaN}', "temperature", id="temperature-nan"),
    pytest.param(with_field(temperature="inf"), "temperature", id="temperature-inf-string"),
    pytest.param(with_field(top_k=0), "top_k", id="top_k-zero"),
    pytest.param(with_field(top_k=1001), "top_k", id="top_k-over"),
    pytest.param(with_field(top_k=1.5), "top_k", id="top_k-fraction"),
    pytest.param(with_field(top_k="many"), "top_k", id="top_k-word"),
    pytest.param(with_field(top_k=False), "top_k", id="top_k-bool"),
    pytest.param(with_field(top_k={"a": 1}), "top_k", id="top_k-object"),
    pytest.param(with_field(top_p=0), "top_p", id="top_p-zero"),
    pytest.param(with_field(top_p=1.01), "top_p", id="top_p-over"),
    pytest.param(with_field(top_p=[0.5]), "top_p", id="top_p-list"),
    pytest.param(with_field(max_tokens=0), "max_tokens", id="max_tokens-zero"),
    pytest.param(with_field(max_tokens=2049), "max_tokens", id="max_tokens-over"),
    pytest.param(with_field(max_tokens="ten"), "max_tokens", id="max_tokens-word"),
    pytest.param(with_field(stop_sequence=["a", "b", "c", "d", "e"]), "stop_sequence", id="stop-five"),
    pytest.param(with_field(stop_sequence=[1]), "stop_sequence", id="stop-number-item"),
    pytest.param(with_field(stop_sequence=3), "stop_sequence", id="stop-number"),
    pytest.param(with_field(stop_sequence=[""]), "stop_sequence", id="stop-empty-string"),
    pytest.param(with_field(seed="abc"), "seed", id="seed-word"),
    pytest.param(with_field(seed=-1), "seed", id="seed-negative"),
    pytest.param(with_field(seed=0.5), "seed", id="seed-fraction"),
    pytest.param(with_field(stream="yes"), "stream", id="stream-string"),
    pytest.param(with_field(stream=1), "stream", id="stream-number"),
    pytest.param(with_field(return_prompt="true"), "return_prompt", id="return_prompt-string"),
    # The mock's context is 4096 tokens, one per UTF-8 byte of the prompt.
    pytest.param(with_field(text="x" * 4000, max_tokens=128), "text", id="prompt-too-long"),
]


def prompt_tokens_submitted(server: RunningServer) -> float:
    return server.metric("inference_prompt_tokens_total")


@pytest.mark.parametrize("body, field", BAD_BODIES)
def test_bad_input_is_a_400_naming_the_field(fast_server: RunningServer, body: bytes, field: str) -> None:
    before = prompt_tokens_submitted(fast_server)
    response = requests.post(f"{fast_server.url}/predictions/mock", data=body, timeout=10)
    assert response.status_code == 400, response.text
    assert response.headers["Content-Type"] == "application/json"
    assert response.headers["X-Request-ID"]
    error = response.json()
    assert error["status_code"] == 400
    assert field in error["message"]
    assert prompt_tokens_submitted(fast_server) == before, "bad input reached the backend"


def test_prompt_too_long_gives_the_token_counts(fast_server: RunningServer) -> None:
    body = with_field(text="x" * 4093, max_tokens=4)  # one token over the mock's 4096
    response = requests.post(f"{fast_server.url}/predictions/mock", data=body, timeout=10)
    assert response.status_code == 400
    message = response.json()["message"]
    assert "4093" in message and "4097" in message and "4096" in message


def test_unknown_model_is_404(fast_server: RunningServer) -> None:
    response = requests.post(f"{fast_server.url}/predictions/gpt-5", data=with_field(), timeout=10)
    assert response.status_code == 404
    assert response.json() == {"status_code": 404, "message": response.json()["message"]}
    assert "gpt-5" in response.json()["message"] and "mock" in response.json()["message"]


def test_unknown_path_is_404(fast_server: RunningServer) -> None:
    response = requests.get(f"{fast_server.url}/no/such/path", timeout=10)
    assert response.status_code == 404
    assert response.json()["status_code"] == 404
    assert "/no/such/path" in response.json()["message"]
    assert response.headers["X-Request-ID"]


def test_wrong_method_is_405(fast_server: RunningServer) -> None:
    response = requests.get(f"{fast_server.url}/predictions/mock", timeout=10)
    assert response.status_code == 405
    assert response.json()["status_code"] == 405
    assert "GET" in response.json()["message"]
    assert "POST" in response.headers["Allow"]


def test_body_over_the_limit_is_413(fast_server: RunningServer) -> None:
    body = with_field(text="x" * 70_000)  # the fast server's limit is 64 KiB
    before = prompt_tokens_submitted(fast_server)
    with requests.Session() as session:  # one kept-alive connection
        response = session.post(f"{fast_server.url}/predictions/mock", data=body, timeout=10)
        assert response.status_code == 413
        assert response.json()["status_code"] == 413
        assert "65536" in response.json()["message"]
        # The connection it came on still works.
        assert session.post(f"{fast_server.url}/predictions/mock", data=with_field(), timeout=10).ok
    assert prompt_tokens_submitted(fast_server) == before + len(b"hello")


def test_numbers_may_be_numeric_strings_and_unknown_fields_are_ignored(fast_server: RunningServer) -> None:
    body = {
        "text": "hello",
        "temperature": "0.5",
        "top_k": "40",
        "top_p": "0.95",
        "max_tokens": "3",
        "seed": "7",
        "stream": False,
        "no_such_field": {"x": 1},
        "stop_sequence": None,
    }
    response = requests.post(f"{fast_server.url}/predictions/mock", json=body, timeout=10)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def test_server_serves_normally_after_bad_input(fast_server: RunningServer) -> None:
    for body in (b"{", b"[]", with_field(top_k=0), with_field(text="")):
        assert requests.post(f"{fast_server.url}/predictions/mock", data=body, timeout=10).status_code == 400
    response = requests.post(f"{fast_server.url}/predictions/mock", data=with_field(), timeout=10)
    assert response.status_code == 200
    assert response.json()["finish_reason"] == "length"
    assert requests.get(f"{fast_server.url}/ready", timeout=10).status_code == 200


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
# A lone surrogate nested where no field reader looks at each string (a tool's schema, an item of the
# Responses input) once failed to encode deep in a template or grammar: a 500, or a stream cut short.
NESTED_LONE_SURROGATES = [
    pytest.param(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "tool_choice": "required"},
        ("tools", 0, "function", "parameters", "properties"),
        id="chat-tool-schema",
    ),
    pytest.param(
        "/v1/responses",
        {
            "input": "hi",
            "stream": True,
            "text": {"format": {"type": "json_schema", "name": "n", "schema": {}}},
        },
        ("text", "format", "schema"),
        id="responses-text-format-schema",
    ),
    pytest.param(
        "/v1/responses",
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
        ("input", 0, "name"),
        id="responses-input-call-name",
    ),
    pytest.param(
        "/v1/messages",
        {
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {}}}],
        },
        ("tools", 0, "input_schema", "properties"),
        id="anthropic-tool-schema",
    ),
    pytest.param(
        "/api/chat",
        {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "stream": False},
        ("tools", 0, "function", "description"),
        id="ollama-tool-description",
    ),
]


@pytest.mark.parametrize("path, body, where", NESTED_LONE_SURROGATES)
def test_a_lone_surrogate_anywhere_in_the_body_is_a_400_naming_where(
    fast_server: RunningServer, path: str, body: dict, where: tuple
) -> None:
    *outer, last = where
    body = copy.deepcopy(body)  # the cases share TOOL
    container = body
    for step in outer:
        container = container[step]
    container[last] = "\ud800" if last in ("name", "description") else {"\ud800": {"type": "string"}}
    named = ".".join(str(step) for step in outer).replace(".0", "[0]")
    named = f"{named}.{last}" if last in ("name", "description") else f"{named}.{last} has a key"
    before = prompt_tokens_submitted(fast_server)
    response = requests.post(
        f"{fast_server.url}{path}", data=json.dumps({"model": "mock", **body}), timeout=10
    )
    assert response.status_code == 400, response.text
    assert named in response.text and "lone surrogate" in response.text
    assert prompt_tokens_submitted(fast_server) == before, "bad input reached the backend"
