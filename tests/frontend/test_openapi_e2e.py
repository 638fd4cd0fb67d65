"""GET /openapi.json (SPEC §4.4) held to the truth: a valid OpenAPI 3.1 document naming every route,
real responses of the server and the proxy (each success, each class of error) that match its schemas,
and the ranges it documents, which are what the server enforces (the cases come from the document)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from jsonschema import Draft202012Validator
from openapi_spec_validator import OpenAPIV31SpecValidator, validate

from backend.messages import BackendConfig
from inference_api import create_app
from inference_api.config import ServerConfig
from inference_api.openapi import DOCUMENT_PATH
from tests.proxy.conftest import RunningProxy, bearer, running_proxy
from tests.server_fixture import RunningServer, free_port, running_server

DOCUMENT = json.loads(DOCUMENT_PATH.read_text())
HOLD_CHOICES = 16  # the most choices of one request: with --rows 2 --max-queue 14 they fill the server


def resolve(node: Any) -> Any:
    """The document with every local $ref replaced by what it points to (it has no cycles)."""
    if isinstance(node, dict):
        if "$ref" in node:
            target: Any = DOCUMENT
            for part in node["$ref"].removeprefix("#/").split("/"):
                target = target[part]
            return resolve(target)
        return {key: resolve(value) for key, value in node.items()}
    if isinstance(node, list):
        return [resolve(item) for item in node]
    return node


SPEC = resolve(DOCUMENT)


def template_of(path: str) -> str:
    """The document's path template that a concrete path falls under."""
    for template in DOCUMENT["paths"]:
        if re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", template), path):
            return template
    raise AssertionError(f"{path} is not in the document")


def documented(response: requests.Response, method: str, path: str) -> Any:
    """Check a response against its documented operation; return its body.

    A 405 answers a method the path does not have: it is documented on the one it has.
    """
    item = SPEC["paths"][template_of(path)]
    responses = (item.get(method) or next(iter(item.values())))["responses"]
    status = str(response.status_code)
    assert status in responses, f"{method.upper()} {path} answered {status}, which is not documented"
    return matches(response, responses[status])


def matches(response: requests.Response, spec: dict) -> Any:
    """Its headers, media type and body against one documented response."""
    for header in spec.get("headers", {}):
        assert header in response.headers, f"no {header} header"
    media_type = response.headers["Content-Type"].split(";")[0].strip()
    assert media_type in spec["content"], f"{media_type} is not documented here"
    content = spec["content"][media_type]
    if media_type == "application/json":
        body = response.json()
        Draft202012Validator(content["schema"]).validate(body)
        return body
    if media_type == "text/event-stream":
        events = [event.removeprefix("data: ") for event in response.text.split("\n\n") if event]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        for chunk in chunks:
            Draft202012Validator(content["x-event-data"]).validate(chunk)
        return chunks
    return response.text


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    options = "--mock --rows 2 --max-queue 14 --mock-tokens-per-second 1000 --max-body-bytes 65536"
    with running_server(*options.split()) as running:
        yield running


@pytest.fixture(scope="module")
def proxy(server: RunningServer) -> Iterator[RunningProxy]:
    with running_proxy(server.url) as running:
        yield running


def test_the_document_is_valid_openapi_3_1() -> None:
    validate(DOCUMENT, cls=OpenAPIV31SpecValidator)
    assert DOCUMENT["openapi"].startswith("3.1")


def test_every_route_is_documented_and_every_documented_route_exists() -> None:
    app = create_app(ServerConfig(backend=BackendConfig(mock=True, rows=1)))
    router = app.extensions["router"]
    try:
        router.wait_ready(30)  # a backend stopped while it starts takes longer to stop
        routes = {
            (re.sub(r"<(?:[^:>]+:)?([^>]+)>", r"{\1}", rule.rule), method.lower())
            for rule in app.url_map.iter_rules()
            for method in rule.methods - {"HEAD", "OPTIONS"}
        }
    finally:
        router.stop()
    operations = {(path, method) for path, item in DOCUMENT["paths"].items() for method in item}
    assert routes == operations


def test_the_server_serves_this_document(server: RunningServer) -> None:
    response = requests.get(f"{server.url}/openapi.json", timeout=10)
    assert documented(response, "get", "/openapi.json") == DOCUMENT


NATIVE = {"text": "hello", "max_tokens": 4}
COMPLETION = {"model": "mock", "prompt": "hello", "max_tokens": 4}
CHAT = {"model": "mock", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
STREAMED = {"stream": True, "stream_options": {"include_usage": True}, "n": 2}

# (method, path, request arguments), each answered 200 straight from the server
SUCCESSES = {
    "health": ("get", "/health", {}),
    "ready": ("get", "/ready", {}),
    "metrics": ("get", "/metrics", {}),
    "page": ("get", "/", {}),
    "script": ("get", "/static/chat.js", {}),
    "style": ("get", "/static/chat.css", {}),
    "models": ("get", "/v1/models", {}),
    "native-stream": ("post", "/predictions/mock", {"json": NATIVE}),
    "native": ("post", "/predictions/mock", {"json": {**NATIVE, "stream": False}}),
    "completion": ("post", "/v1/completions", {"json": COMPLETION}),
    "completion-stream": ("post", "/v1/completions", {"json": {**COMPLETION, **STREAMED}}),
    "chat": ("post", "/v1/chat/completions", {"json": CHAT}),
    "chat-stream": ("post", "/v1/chat/completions", {"json": {**CHAT, **STREAMED}}),
}


@pytest.mark.parametrize("method, path, arguments", list(SUCCESSES.values()), ids=list(SUCCESSES))
def test_each_success_is_as_documented(server: RunningServer, method, path, arguments) -> None:
    response = requests.request(method, f"{server.url}{path}", timeout=10, **arguments)
    assert response.status_code == 200, response.text
    documented(response, method, path)


TOO_BIG = b"x" * 70_000  # over the server's --max-body-bytes 65536

# (method, path, request arguments, status)
ERRORS = {
    "native-malformed-json": ("post", "/predictions/mock", {"data": b"{"}, 400),
    "native-prompt-too-long": ("post", "/predictions/mock", {"json": {"text": "x" * 4090}}, 400),
    "completion-n-zero": ("post", "/v1/completions", {"json": {**COMPLETION, "n": 0}}, 400),
    "completion-over-context": ("post", "/v1/completions", {"json": {**COMPLETION, "max_tokens": 4096}}, 400),
    "chat-no-messages": ("post", "/v1/chat/completions", {"json": {"model": "mock"}}, 400),
    "native-unknown-model": ("post", "/predictions/other", {"json": NATIVE}, 404),
    "chat-unknown-model": ("post", "/v1/chat/completions", {"json": {**CHAT, "model": "x"}}, 404),
    "missing-file": ("get", "/static/missing.js", {}, 404),
    "native-wrong-method": ("get", "/predictions/mock", {}, 405),
    "models-wrong-method": ("post", "/v1/models", {}, 405),
    "chat-wrong-method": ("get", "/v1/chat/completions", {}, 405),
    "native-too-large": ("post", "/predictions/mock", {"data": TOO_BIG}, 413),
    "completion-too-large": ("post", "/v1/completions", {"data": TOO_BIG}, 413),
}


@pytest.mark.parametrize("method, path, arguments, status", list(ERRORS.values()), ids=list(ERRORS))
def test_each_error_is_as_documented(server: RunningServer, method, path, arguments, status) -> None:
    response = requests.request(method, f"{server.url}{path}", timeout=10, **arguments)
    assert response.status_code == status, response.text
    documented(response, method, path)


def test_an_unknown_path_is_the_documented_404(server: RunningServer) -> None:
    native = requests.get(f"{server.url}/nowhere", timeout=10)
    openai = requests.get(f"{server.url}/v1/nowhere", timeout=10)
    assert native.status_code == openai.status_code == 404
    matches(native, SPEC["components"]["responses"]["NativeNotFound"])
    matches(openai, SPEC["components"]["responses"]["OpenAINotFound"])


def test_a_full_server_is_the_documented_503(server: RunningServer) -> None:
    hold = {**COMPLETION, "max_tokens": 4000, "n": HOLD_CHOICES, "stream": True}
    with requests.post(f"{server.url}/v1/completions", json=hold, stream=True, timeout=30) as held:
        chunks = held.iter_content(chunk_size=None)  # kept: a dropped generator closes the connection
        next(chunks)
        native = requests.post(f"{server.url}/predictions/mock", json=NATIVE, timeout=10)
        chat = requests.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=10)
    assert native.status_code == chat.status_code == 503
    # The held choices are cancelled: wait for their rows and places, so the next tests find room.
    wait_until_idle(server)
    documented(native, "post", "/predictions/mock")
    documented(chat, "post", "/v1/chat/completions")


def wait_until_idle(server: RunningServer, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while server.metric("inference_active_rows") or server.metric("inference_queue_depth"):
        assert time.monotonic() < deadline, "the cancelled requests still hold the server"
        time.sleep(0.05)


def test_the_proxys_answers_are_as_documented(proxy: RunningProxy) -> None:
    too_big = b"x" * (1024 * 1024 + 1)  # over the proxy's own limit
    cases = [
        ("get", "/v1/models", {}, 401),
        ("get", "/ready", {"headers": bearer("garbage")}, 401),
        ("get", "/v1/models", {"headers": bearer()}, 200),
        ("get", "/health", {}, 200),
        ("get", "/", {}, 200),
        ("post", "/predictions/mock", {"headers": bearer(), "data": too_big}, 413),
        ("post", "/v1/completions", {"headers": bearer(), "data": too_big}, 413),
    ]
    for method, path, arguments, status in cases:
        response = requests.request(method, f"{proxy.url}{path}", timeout=10, **arguments)
        assert response.status_code == status, (path, response.text)
        documented(response, method, path)
    with running_proxy(f"http://127.0.0.1:{free_port()}") as nowhere:
        response = requests.get(f"{nowhere.url}/v1/models", headers=bearer(), timeout=10)
    assert response.status_code == 502
    documented(response, "get", "/v1/models")


def test_the_proxy_asks_a_token_exactly_where_the_document_does(proxy: RunningProxy) -> None:
    examples = {"{model}": "mock", "{filename}": "chat.js"}
    for template, item in DOCUMENT["paths"].items():
        url = proxy.url + re.sub(r"\{[^}]+\}", lambda m: examples[m.group()], template)
        for method, operation in item.items():
            public = operation.get("security", DOCUMENT["security"]) == []
            response = requests.request(method, url, json=NATIVE, timeout=10)
            assert (response.status_code != 401) == public, (method, template, response.status_code)


BOUNDS = {"minimum", "maximum", "exclusiveMinimum"}


def numeric_bounds(schema: dict) -> dict | None:
    """The bounds of a numeric property: the property itself, or the number branch of its anyOf."""
    for branch in [schema, *schema.get("anyOf", [])]:
        if branch.get("type") in ("number", "integer") and BOUNDS & set(branch):
            return branch
    return None


def properties(schema: dict) -> dict[str, dict]:
    """A request's fields, its allOf parts merged."""
    merged: dict[str, dict] = {}
    for part in [schema, *schema.get("allOf", [])]:
        for name, prop in part.get("properties", {}).items():
            merged[name] = {**merged.get(name, {}), **prop}
    return merged


def takes_numeric_strings(prop: dict) -> bool:
    """SPEC §4.1: "top_k": "40" is a number too (the document's NumericString branch)."""
    return any(branch.get("type") == "string" and "pattern" in branch for branch in prop.get("anyOf", []))


def range_cases(schema: dict) -> Iterator[tuple[str, float, bool]]:
    """(field, value, in range) at and just past every documented bound."""
    for field, prop in properties(schema).items():
        bounds = numeric_bounds(prop)
        if bounds is None:
            continue
        step = 1 if bounds["type"] == "integer" else 0.01
        if "minimum" in bounds:
            yield field, bounds["minimum"], True
            yield field, bounds["minimum"] - step, False
        if "maximum" in bounds:
            yield field, bounds["maximum"], True
            yield field, bounds["maximum"] + step, False
        if "exclusiveMinimum" in bounds:
            yield field, bounds["exclusiveMinimum"], False
            yield field, bounds["exclusiveMinimum"] + step, True


# The fields SPEC §4.1 and §4.2 give ranges to: the document must keep a range for each.
OPENAI_RANGED = {"temperature", "top_k", "top_p", "max_tokens", "max_completion_tokens", "seed", "n"}
# (path, a good body to vary one field of, the fields with ranges)
RANGE_CHECKS = {
    "native": (
        "/predictions/mock",
        {**NATIVE, "stream": False},
        {"temperature", "top_k", "top_p", "max_tokens", "seed"},
    ),
    "completions": ("/v1/completions", COMPLETION, OPENAI_RANGED),
    "chat": ("/v1/chat/completions", CHAT, OPENAI_RANGED),
}


@pytest.mark.parametrize("path, base, ranged", list(RANGE_CHECKS.values()), ids=list(RANGE_CHECKS))
def test_the_documented_ranges_are_the_servers(server: RunningServer, path, base, ranged) -> None:
    schema = SPEC["paths"][template_of(path)]["post"]["requestBody"]["content"]["application/json"]["schema"]
    cases = list(range_cases(schema))
    assert {field for field, _, _ in cases} == ranged
    for field, value, in_range in cases:
        body = {**base, field: value}
        assert Draft202012Validator(schema).is_valid(body) == in_range, (field, value)
        response = requests.post(f"{server.url}{path}", json=body, timeout=30)
        assert response.status_code == (200 if in_range else 400), (field, value, response.text)
        answer = documented(response, "post", path)
        if not in_range:
            assert field in (answer.get("message") or answer["error"]["message"])
        elif takes_numeric_strings(properties(schema)[field]):
            body = {**base, field: str(value)}
            assert Draft202012Validator(schema).is_valid(body), (field, body[field])
            response = requests.post(f"{server.url}{path}", json=body, timeout=30)
            assert response.status_code == 200, (field, body[field], response.text)
