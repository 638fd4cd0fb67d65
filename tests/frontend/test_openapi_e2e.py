"""GET /openapi.json (SPEC §4.4) held to the truth: a valid OpenAPI 3.1 document naming every route,
real responses of the server and the proxy (each success, each class of error) that match its schemas,
and the ranges it documents, which are what the server enforces (the cases come from the document)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import requests
from jsonschema import Draft202012Validator
from openapi_spec_validator import OpenAPIV31SpecValidator, validate

from backend.messages import BackendConfig
from inference_api import create_app
from inference_api.config import ServerConfig
from inference_api.openapi import DOCUMENT_PATH
from tests.proxy.conftest import RunningProxy, bearer, running_proxy, token
from tests.server_fixture import RunningServer, free_port, running_server

DOCUMENT = json.loads(DOCUMENT_PATH.read_text())
HOLD_CHOICES = 16  # the most choices of one request: with --rows 2 --max-queue 14 they fill the server


def resolve(node: Any) -> Any:
    """The document with every local $ref replaced by what it points to (it has no cycles).

    A $ref with siblings ({"$ref": ..., "minItems": 1}) means both, as in JSON Schema 2020-12.
    """
    if isinstance(node, dict):
        if "$ref" in node:
            target: Any = DOCUMENT
            for part in node["$ref"].removeprefix("#/").split("/"):
                target = target[part]
            siblings = {key: resolve(value) for key, value in node.items() if key != "$ref"}
            return {"allOf": [resolve(target)], **siblings} if siblings else resolve(target)
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
        events = server_sent_events(response.text)
        if "x-last-data" in content:  # OpenAI's [DONE], which is not JSON
            assert events.pop() == (None, content["x-last-data"])
        chunks = [json.loads(data) for _, data in events]
        for (name, _), chunk in zip(events, chunks, strict=True):
            Draft202012Validator(content["x-event-data"]).validate(chunk)
            assert name is None or name == chunk["type"], (name, chunk)  # a typed event is named by its type
        return chunks
    if media_type == "application/x-ndjson":  # Ollama's streams: a JSON object a line
        lines = [json.loads(line) for line in response.text.splitlines()]
        for line in lines:
            Draft202012Validator(content["x-line-data"]).validate(line)
        return lines
    return response.text


def server_sent_events(body: str) -> list[tuple[str | None, str]]:
    """(event name or None, data) of each event; every event has one data line, and at most an event line."""
    events = []
    for block in filter(None, body.split("\n\n")):
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        assert set(fields) <= {"event", "data"}, block
        events.append((fields.get("event"), fields["data"]))
    return events


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    options = "--mock --rows 2 --max-queue 14 --mock-tokens-per-second 1000 --max-body-bytes 65536"
    options += " --allow-runtime-lora"  # the mock loads and unloads adapters by name
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
LORA_ADAPTER = {"lora_name": "sql", "lora_path": "/adapters/sql"}
COMPLETION = {"model": "mock", "prompt": "hello", "max_tokens": 4}
CHAT = {"model": "mock", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
STREAMED = {"stream": True, "stream_options": {"include_usage": True}, "n": 2}
# What steers sampling on both OpenAI endpoints (the mock backend takes them and ignores them).
STEERED = {
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.2,
    "min_p": 0.05,
    "logit_bias": {"104": 5, "0": -100},
    "min_tokens": 2,
    "stop_token_ids": [10],
}
# The logprobs of each (the mock backend gives no entries: their lists come back empty).
COMPLETION_LOGPROBS = {"logprobs": 3, "echo": True}
CHAT_LOGPROBS = {"logprobs": True, "top_logprobs": 3}
# What the server takes of the fields it does not implement: values that ask for nothing.
NOTHING_ASKED = {
    "completions": {"suffix": "", "best_of": 2, "n": 2},
    "chat": {
        "response_format": {"type": "text"},
        "tools": [],
        "tool_choice": "none",
        "functions": [],
        "function_call": "none",
        "modalities": ["text"],
        "audio": None,
        "prediction": None,
        "web_search_options": None,
    },
}
NATIVE_STEERED = {"presence_penalty": "0.5", "frequency_penalty": 1, "repetition_penalty": 1.1, "min_p": 0.1}
TOKENIZE = {"model": "mock", "prompt": "héllo", "return_token_strs": True}
MESSAGES = {"model": "mock", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}
MESSAGES_IN_FULL = {
    **MESSAGES,
    "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hello"}]},
        {"role": "assistant", "content": "Well,"},
    ],
    "stop_sequences": ["tempor"],
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "metadata": {"user_id": "u-1"},
}
# What the server takes of the Messages fields it does not implement: values that ask for nothing.
MESSAGES_NOTHING_ASKED = {
    "tools": [],
    "tool_choice": {"type": "none"},
    "thinking": {"type": "disabled"},
    "mcp_servers": [],
    "output_config": {},
    "container": None,
}
# Tool use: the tools, a call of one and its result (the mock answers in text: it keeps to no grammar).
MESSAGES_TOOLS = {
    "tools": [
        {
            "name": "get_weather",
            "description": "The weather in a city.",
            "input_schema": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
        {"type": "custom", "name": "get_time", "input_schema": {"type": "object"}},
    ],
    "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "18 C"}],
                },
                {"type": "text", "text": "Thanks."},
            ],
        },
    ],
}
COUNT_TOKENS = {"model": "mock", "messages": MESSAGES["messages"]}
RESPONSES = {"model": "mock", "input": "hello", "max_output_tokens": 4}
RESPONSES_IN_FULL = {
    **RESPONSES,
    "instructions": "Be brief.",
    "input": [
        {"role": "developer", "content": "Answer in English."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
        {"role": "user", "content": "Again."},
    ],
    "temperature": 0.5,
    "top_p": 0.9,
    "metadata": {"k": "v"},
    "user": "u-1",
    "parallel_tool_calls": False,
}
RESPONSES_NOTHING_ASKED = {
    "store": False,
    "previous_response_id": None,
    "background": False,
    "tools": [],
    "tool_choice": "none",
    "reasoning": {"effort": None},
    "text": {"format": {"type": "text"}},
    "include": [],
    "top_logprobs": 0,
    "truncation": "disabled",
}
# Tool use: a call and its output sent back, and a JSON format (the mock answers in text: it keeps to no
# grammar, so its answer holds no calls).
RESPONSES_TOOLS = {
    "tools": [
        {
            "type": "function",
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
            "strict": True,
        },
        {"type": "function", "name": "get_time"},
    ],
    "tool_choice": {
        "type": "allowed_tools",
        "mode": "auto",
        "tools": [{"type": "function", "name": "get_time"}],
    },
    "parallel_tool_calls": False,
    "text": {"format": {"type": "json_object"}},
    "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me look."}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
            "status": "completed",
        },
        {
            "type": "function_call_output",
            "call_id": "call_1",
            "output": [{"type": "input_text", "text": "18 C"}],
        },
    ],
}
LLAMA_COMPLETION = {"model_id": "mock", "content": "hello", "sampling_params": {"max_tokens": 4}}
LLAMA_CHAT = {
    "model_id": "mock",
    "messages": [{"role": "user", "content": "hello"}],
    "sampling_params": {"max_tokens": 4},
}
LLAMA_SAMPLED = {
    "strategy": {"type": "top_p", "temperature": 0.7, "top_p": 0.9},
    "max_tokens": 4,
    "repetition_penalty": 1.1,
    "stop": ["tempor"],
}
LLAMA_EMBEDDINGS = {
    "model_id": "mock",
    "contents": ["hello", {"type": "text", "text": "hi"}],
    "text_truncation": "none",
}
TOKENIZE_CHAT = {"messages": CHAT["messages"], "add_generation_prompt": False, "add_special_tokens": True}
TOKENIZE_CONTINUED = {
    "messages": [*CHAT["messages"], {"role": "assistant", "content": "Once"}],
    "continue_final_message": True,
    "add_generation_prompt": False,
}

OLLAMA_OPTIONS = {"temperature": 0.5, "top_k": 20, "num_predict": 4, "stop": ["x"], "num_ctx": 4096}
OLLAMA_GENERATE = {"model": "mock", "prompt": "hello", "system": "Be brief.", "options": OLLAMA_OPTIONS}
OLLAMA_CHAT = {
    "model": "mock",
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "w", "arguments": {"c": "P"}}}],
        },
        {"role": "tool", "content": "18 C", "tool_name": "w"},
    ],
    "options": OLLAMA_OPTIONS,
    "keep_alive": "5m",
}
OLLAMA_EMBED = {"model": "mock", "input": ["hello", "hi"]}

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
    "llamacpp-completion": ("post", "/completion", {"json": {"prompt": "hello", "n_predict": 4}}),
    "llamacpp-apply-template": ("post", "/apply-template", {"json": {"messages": CHAT["messages"]}}),
    "llamacpp-props": ("get", "/props", {}),
    "llamacpp-tokenize": ("post", "/tokenize", {"json": {"content": "héllo", "with_pieces": True}}),
    "llamacpp-tokenize-ids": ("post", "/tokenize", {"json": {"content": "hi", "add_special": True}}),
    "llamacpp-embedding": ("post", "/embedding", {"json": {"content": "hello"}}),
    "llamacpp-embeddings": ("post", "/embeddings", {"json": {"input": ["hello", [104, 105]]}}),
    "ollama-version": ("get", "/api/version", {}),
    "ollama-tags": ("get", "/api/tags", {}),
    "ollama-ps": ("get", "/api/ps", {}),
    "ollama-show": ("post", "/api/show", {"json": {"model": "mock:latest"}}),
    "ollama-generate": ("post", "/api/generate", {"json": {**OLLAMA_GENERATE, "stream": False}}),
    "ollama-generate-stream": ("post", "/api/generate", {"json": OLLAMA_GENERATE}),
    "ollama-generate-load": ("post", "/api/generate", {"json": {"model": "mock"}}),
    "ollama-chat": ("post", "/api/chat", {"json": {**OLLAMA_CHAT, "stream": False}}),
    "ollama-chat-stream": ("post", "/api/chat", {"json": OLLAMA_CHAT}),
    "ollama-chat-json": ("post", "/api/chat", {"json": {**OLLAMA_CHAT, "format": "json", "stream": False}}),
    "ollama-chat-logprobs": (
        "post",
        "/api/chat",
        {"json": {**OLLAMA_CHAT, "logprobs": True, "top_logprobs": 2, "stream": False}},
    ),
    "ollama-logprobs-stream": ("post", "/api/generate", {"json": {**OLLAMA_GENERATE, "logprobs": True}}),
    "ollama-embed": ("post", "/api/embed", {"json": OLLAMA_EMBED}),
    "ollama-embeddings": ("post", "/api/embeddings", {"json": {"model": "mock", "prompt": "hello"}}),
    "llamacpp-completion-stream": (
        "post",
        "/completion",
        {"json": {"prompt": "hello", "n_predict": 4, "stop": ["x"], "stream": True}},
    ),
    "native": ("post", "/predictions/mock", {"json": {**NATIVE, "stream": False}}),
    "completion": ("post", "/v1/completions", {"json": COMPLETION}),
    "completion-stream": ("post", "/v1/completions", {"json": {**COMPLETION, **STREAMED}}),
    "chat": ("post", "/v1/chat/completions", {"json": CHAT}),
    "chat-stream": ("post", "/v1/chat/completions", {"json": {**CHAT, **STREAMED}}),
    "native-steered": ("post", "/predictions/mock", {"json": {**NATIVE, **NATIVE_STEERED, "min_tokens": 4}}),
    "completion-steered": ("post", "/v1/completions", {"json": {**COMPLETION, **STEERED}}),
    "completion-logprobs": ("post", "/v1/completions", {"json": {**COMPLETION, **COMPLETION_LOGPROBS}}),
    "completion-logprobs-stream": (
        "post",
        "/v1/completions",
        {"json": {**COMPLETION, **COMPLETION_LOGPROBS, **STEERED, **STREAMED}},
    ),
    "completion-scoring": (
        "post",
        "/v1/completions",
        {"json": {**COMPLETION, "echo": True, "logprobs": 2, "max_tokens": 0}},
    ),
    "completion-nothing-asked": (
        "post",
        "/v1/completions",
        {"json": {**COMPLETION, **NOTHING_ASKED["completions"]}},
    ),
    "chat-steered": ("post", "/v1/chat/completions", {"json": {**CHAT, **STEERED}}),
    "chat-logprobs": ("post", "/v1/chat/completions", {"json": {**CHAT, **CHAT_LOGPROBS}}),
    "chat-logprobs-stream": (
        "post",
        "/v1/chat/completions",
        {"json": {**CHAT, **CHAT_LOGPROBS, **STEERED, **STREAMED}},
    ),
    "chat-nothing-asked": ("post", "/v1/chat/completions", {"json": {**CHAT, **NOTHING_ASKED["chat"]}}),
    "tokenize": ("post", "/tokenize", {"json": TOKENIZE}),
    "embeddings": ("post", "/v1/embeddings", {"json": {"model": "mock", "input": ["hello", [104, 105]]}}),
    "embeddings-base64": (
        "post",
        "/v1/embeddings",
        {"json": {"model": "mock", "input": "hello", "encoding_format": "base64"}},
    ),
    "tokenize-chat": ("post", "/tokenize", {"json": TOKENIZE_CHAT}),
    "tokenize-continued": ("post", "/tokenize", {"json": TOKENIZE_CONTINUED}),
    "detokenize": ("post", "/detokenize", {"json": {"model": "mock", "tokens": [104, 105, 255]}}),
    "detokenize-nothing": ("post", "/detokenize", {"json": {"tokens": []}}),
    "messages": ("post", "/v1/messages", {"json": MESSAGES}),
    "messages-stream": ("post", "/v1/messages", {"json": {**MESSAGES, "stream": True}}),
    "messages-in-full": ("post", "/v1/messages", {"json": {**MESSAGES_IN_FULL, "max_tokens": 8}}),
    "messages-in-full-stream": (
        "post",
        "/v1/messages",
        {"json": {**MESSAGES_IN_FULL, "max_tokens": 8, "stream": True}},
    ),
    "messages-nothing-asked": ("post", "/v1/messages", {"json": {**MESSAGES, **MESSAGES_NOTHING_ASKED}}),
    "messages-tools": ("post", "/v1/messages", {"json": {**MESSAGES, **MESSAGES_TOOLS}}),
    "messages-tools-stream": (
        "post",
        "/v1/messages",
        {"json": {**MESSAGES, **MESSAGES_TOOLS, "stream": True}},
    ),
    "count-tokens": ("post", "/v1/messages/count_tokens", {"json": COUNT_TOKENS}),
    "count-tokens-tools": ("post", "/v1/messages/count_tokens", {"json": {**COUNT_TOKENS, **MESSAGES_TOOLS}}),
    "responses": ("post", "/v1/responses", {"json": RESPONSES}),
    "responses-stream": ("post", "/v1/responses", {"json": {**RESPONSES, "stream": True}}),
    "responses-in-full": ("post", "/v1/responses", {"json": RESPONSES_IN_FULL}),
    "responses-in-full-stream": ("post", "/v1/responses", {"json": {**RESPONSES_IN_FULL, "stream": True}}),
    "responses-nothing-asked": ("post", "/v1/responses", {"json": {**RESPONSES, **RESPONSES_NOTHING_ASKED}}),
    "responses-tools": ("post", "/v1/responses", {"json": {**RESPONSES, **RESPONSES_TOOLS}}),
    "responses-tools-stream": (
        "post",
        "/v1/responses",
        {"json": {**RESPONSES, **RESPONSES_TOOLS, "stream": True}},
    ),
    "llama-completion": ("post", "/inference/completion", {"json": LLAMA_COMPLETION}),
    "llama-completion-stream": (
        "post",
        "/inference/completion",
        {"json": {**LLAMA_COMPLETION, "stream": True}},
    ),
    "llama-chat": ("post", "/inference/chat_completion", {"json": LLAMA_CHAT}),
    "llama-chat-stream": ("post", "/inference/chat_completion", {"json": {**LLAMA_CHAT, "stream": True}}),
    "llama-completion-v1": (
        "post",
        "/v1/inference/completion",
        {"json": {**LLAMA_COMPLETION, "sampling_params": LLAMA_SAMPLED, "stream": True}},
    ),
    "llama-chat-v1": (
        "post",
        "/v1/inference/chat-completion",
        {"json": {**LLAMA_CHAT, "sampling_params": LLAMA_SAMPLED}},
    ),
    "llama-embeddings": ("post", "/inference/embeddings", {"json": {"model": "mock", "contents": ["hello"]}}),
    "llama-embeddings-v1": ("post", "/v1/inference/embeddings", {"json": LLAMA_EMBEDDINGS}),
    "model": ("get", "/v1/models/mock", {}),
    "llama-openai-models": ("get", "/v1/openai/v1/models", {}),
    "llama-openai-model": ("get", "/v1/openai/v1/models/mock", {}),
    "llama-openai-completion-stream": (
        "post",
        "/v1/openai/v1/completions",
        {"json": {**COMPLETION, **STREAMED}},
    ),
    "llama-openai-chat": ("post", "/v1/openai/v1/chat/completions", {"json": CHAT}),
    "llama-openai-chat-stream": ("post", "/v1/openai/v1/chat/completions", {"json": {**CHAT, **STREAMED}}),
    "llama-openai-embeddings": (
        "post",
        "/v1/openai/v1/embeddings",
        {"json": {"model": "mock", "input": "hi"}},
    ),
    # In this order: the adapter loaded, then unloaded.
    "load-lora-adapter": ("post", "/v1/load_lora_adapter", {"json": LORA_ADAPTER}),
    "unload-lora-adapter": ("post", "/v1/unload_lora_adapter", {"json": {"lora_name": "sql"}}),
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
    "native-min-tokens-over-max-tokens": (
        "post",
        "/predictions/mock",
        {"json": {**NATIVE, "min_tokens": 5}},
        400,
    ),
    "completion-min-tokens-over-max-tokens": (
        "post",
        "/v1/completions",
        {"json": {**COMPLETION, "min_tokens": 5}},
        400,
    ),
    "completion-best-of-over-n": ("post", "/v1/completions", {"json": {**COMPLETION, "best_of": 2}}, 400),
    # The mock's vocabulary (bytes) has no fill-in-the-middle tokens.
    "completion-suffix-unfillable": (
        "post",
        "/v1/completions",
        {"json": {**COMPLETION, "suffix": "end"}},
        400,
    ),
    "infill-unfillable": ("post", "/infill", {"json": {"input_prefix": "a", "input_suffix": "b"}}, 400),
    "infill-wrong-method": ("get", "/infill", {}, 405),
    "llamacpp-embedding-wrong-method": ("get", "/embedding", {}, 405),
    "llamacpp-embeddings-too-large": ("post", "/embeddings", {"data": TOO_BIG}, 413),
    "chat-logit-bias-past-vocab": (
        "post",
        "/v1/chat/completions",
        {"json": {**CHAT, "logit_bias": {"256": 1}}},
        400,
    ),
    "chat-stop-token-past-vocab": (
        "post",
        "/v1/chat/completions",
        {"json": {**CHAT, "stop_token_ids": [256]}},
        400,
    ),
    "tokenize-malformed-json": ("post", "/tokenize", {"data": b"{"}, 400),
    "tokenize-nothing": ("post", "/tokenize", {"json": {"model": "mock"}}, 400),
    "tokenize-continued-and-opened": (
        "post",
        "/tokenize",
        {"json": {**TOKENIZE_CONTINUED, "add_generation_prompt": True}},
        400,
    ),
    "detokenize-past-vocab": ("post", "/detokenize", {"json": {"tokens": [104, 256]}}, 400),
    "tokenize-unknown-model": ("post", "/tokenize", {"json": {**TOKENIZE, "model": "x"}}, 404),
    "detokenize-unknown-model": ("post", "/detokenize", {"json": {"model": "x", "tokens": [104]}}, 404),
    "tokenize-wrong-method": ("get", "/tokenize", {}, 405),
    "detokenize-wrong-method": ("put", "/detokenize", {}, 405),
    "tokenize-too-large": ("post", "/tokenize", {"data": TOO_BIG}, 413),
    "detokenize-too-large": ("post", "/detokenize", {"data": TOO_BIG}, 413),
    "messages-no-max-tokens": ("post", "/v1/messages", {"json": {**MESSAGES, "max_tokens": None}}, 400),
    "messages-over-context": ("post", "/v1/messages", {"json": {**MESSAGES, "max_tokens": 4096}}, 400),
    "messages-unknown-model": ("post", "/v1/messages", {"json": {**MESSAGES, "model": "x"}}, 404),
    "messages-wrong-method": ("get", "/v1/messages", {}, 405),
    "messages-too-large": ("post", "/v1/messages", {"data": TOO_BIG}, 413),
    "count-tokens-no-messages": ("post", "/v1/messages/count_tokens", {"json": {"model": "mock"}}, 400),
    "count-tokens-unknown-model": (
        "post",
        "/v1/messages/count_tokens",
        {"json": {**COUNT_TOKENS, "model": "x"}},
        404,
    ),
    "count-tokens-wrong-method": ("get", "/v1/messages/count_tokens", {}, 405),
    "count-tokens-too-large": ("post", "/v1/messages/count_tokens", {"data": TOO_BIG}, 413),
    "responses-stored": ("post", "/v1/responses", {"json": {**RESPONSES, "store": True}}, 400),
    "responses-unknown-model": ("post", "/v1/responses", {"json": {**RESPONSES, "model": "x"}}, 404),
    "responses-wrong-method": ("get", "/v1/responses", {}, 405),
    "responses-too-large": ("post", "/v1/responses", {"data": TOO_BIG}, 413),
    "llama-malformed-json": ("post", "/inference/completion", {"data": b"{"}, 400),
    "llama-no-content": ("post", "/inference/completion", {"json": {"model_id": "mock"}}, 400),
    "llama-unknown-model": (
        "post",
        "/inference/chat_completion",
        {"json": {**LLAMA_CHAT, "model_id": "x"}},
        404,
    ),
    "llama-wrong-method": ("get", "/v1/inference/chat-completion", {}, 405),
    "llama-too-large": ("post", "/v1/inference/completion", {"data": TOO_BIG}, 413),
    "llama-embeddings-image": (
        "post",
        "/v1/inference/embeddings",
        {"json": {**LLAMA_EMBEDDINGS, "contents": [{"type": "image", "image": {"url": {"uri": "a.png"}}}]}},
        400,
    ),
    "llama-embeddings-truncated": (
        "post",
        "/v1/inference/embeddings",
        {"json": {**LLAMA_EMBEDDINGS, "text_truncation": "middle"}},
        400,
    ),
    "llama-embeddings-truncated-by-a-list": (
        "post",
        "/v1/inference/embeddings",
        {"json": {**LLAMA_EMBEDDINGS, "text_truncation": ["end"]}},
        400,
    ),
    "llama-embeddings-unknown-model": (
        "post",
        "/inference/embeddings",
        {"json": {**LLAMA_EMBEDDINGS, "model_id": "x"}},
        404,
    ),
    "ollama-unknown-model": ("post", "/api/chat", {"json": {**OLLAMA_CHAT, "model": "x"}}, 404),
    "ollama-show-unknown-model": ("post", "/api/show", {"json": {"model": "x"}}, 404),
    "ollama-bad-option": (
        "post",
        "/api/generate",
        {"json": {**OLLAMA_GENERATE, "options": {"top_p": 0}}},
        400,
    ),
    "ollama-malformed-json": ("post", "/api/chat", {"data": b"{"}, 400),
    "ollama-unfillable": ("post", "/api/generate", {"json": {**OLLAMA_GENERATE, "suffix": "x"}}, 400),
    "ollama-think-without-thoughts": ("post", "/api/chat", {"json": {**OLLAMA_CHAT, "think": True}}, 400),
    "ollama-embed-dimensions": (
        "post",
        "/api/embed",
        {"json": {"model": "mock", "input": "a", "dimensions": 8}},
        400,
    ),
    "ollama-wrong-method": ("get", "/api/chat", {}, 405),
    "ollama-tags-wrong-method": ("post", "/api/tags", {}, 405),
    "ollama-too-large": ("post", "/api/generate", {"data": TOO_BIG}, 413),
    "model-unknown": ("get", "/v1/models/x", {}, 404),
    "rerank-no-rerank-model": ("post", "/v1/rerank", {"json": {"query": "a", "documents": ["b"]}}, 404),
    "rerank-at-root-no-rerank-model": ("post", "/rerank", {"json": {"query": "a", "documents": ["b"]}}, 404),
    "rerank-wrong-method": ("get", "/v2/rerank", {}, 405),
    "score-no-rerank-model": ("post", "/v1/score", {"json": {"text_1": "a", "text_2": "b"}}, 404),
    "score-wrong-method": ("get", "/score", {}, 405),
    "llama-openai-chat-unknown-model": (
        "post",
        "/v1/openai/v1/chat/completions",
        {"json": {**CHAT, "model": "x"}},
        404,
    ),
    "llama-openai-chat-wrong-method": ("get", "/v1/openai/v1/chat/completions", {}, 405),
    "load-lora-adapter-named-as-the-model": (
        "post",
        "/v1/load_lora_adapter",
        {"json": {**LORA_ADAPTER, "lora_name": "mock"}},
        400,
    ),
    "unload-lora-adapter-not-loaded": ("post", "/v1/unload_lora_adapter", {"json": {"lora_name": "x"}}, 404),
}


@pytest.mark.parametrize("method, path, arguments, status", list(ERRORS.values()), ids=list(ERRORS))
def test_each_error_is_as_documented(server: RunningServer, method, path, arguments, status) -> None:
    response = requests.request(method, f"{server.url}{path}", timeout=10, **arguments)
    assert response.status_code == status, response.text
    documented(response, method, path)


def test_tokenize_detokenize_and_echo_answer_what_the_document_says(server: RunningServer) -> None:
    """The mock's tokenizer is one id per UTF-8 byte, with a vocabulary of 256."""
    tokenized = documented(
        requests.post(f"{server.url}/tokenize", json=TOKENIZE, timeout=10), "post", "/tokenize"
    )
    assert tokenized["tokens"] == list("héllo".encode()) and tokenized["count"] == 6
    assert tokenized["token_strs"] == ["h", "\ufffd", "\ufffd", "l", "l", "o"]
    assert (
        tokenized["max_model_len"]
        == requests.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    )
    chat = requests.post(f"{server.url}/tokenize", json={"messages": CHAT["messages"]}, timeout=10)
    assert documented(chat, "post", "/tokenize")["token_strs"] is None
    detokenized = requests.post(f"{server.url}/detokenize", json={"tokens": tokenized["tokens"]}, timeout=10)
    assert documented(detokenized, "post", "/detokenize") == {"prompt": "héllo", "content": "héllo"}
    # llama-server's shape: a piece is text, or bytes where the token is part of a character
    pieces = requests.post(f"{server.url}/tokenize", json={"content": "hé", "with_pieces": True}, timeout=10)
    assert documented(pieces, "post", "/tokenize") == {
        "tokens": [{"id": 104, "piece": "h"}, {"id": 195, "piece": [195]}, {"id": 169, "piece": [169]}]
    }

    scored = requests.post(
        f"{server.url}/v1/completions",
        json={**COMPLETION, "echo": True, "max_tokens": 0, "logprobs": 0},
        timeout=10,
    )
    choice = documented(scored, "post", "/v1/completions")["choices"][0]
    assert choice["text"] == "hello" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    echoed = requests.post(
        f"{server.url}/v1/completions", json={**COMPLETION, "prompt": [104, 105], "echo": True}, timeout=10
    )
    choice = documented(echoed, "post", "/v1/completions")["choices"][0]
    assert choice["text"].startswith("hi") and len(choice["text"]) > 2 and choice["logprobs"] is None


@dataclass
class Answered:
    """A Flask test client's response, read as `documented` reads those of requests."""

    status_code: int
    headers: Any
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


def test_a_model_not_loaded_is_the_documented_503() -> None:
    app = create_app(ServerConfig(backend=BackendConfig(mock=True, rows=1)))
    router = app.extensions["router"]
    assert router.wait_ready(30)
    router.stop()  # as if the backend were loading or restarting
    client = app.test_client()
    for path, body in [
        ("/tokenize", TOKENIZE),
        ("/detokenize", {"tokens": [104]}),
        ("/v1/completions", COMPLETION),
        ("/predictions/mock", NATIVE),
        ("/v1/messages", MESSAGES),
        ("/v1/messages/count_tokens", COUNT_TOKENS),
        ("/v1/responses", RESPONSES),
        ("/inference/completion", LLAMA_COMPLETION),
        ("/v1/inference/chat-completion", LLAMA_CHAT),
    ]:
        response = client.post(path, json=body)
        assert response.status_code == 503, (path, response.get_data(as_text=True))
        documented(Answered(503, response.headers, response.get_data(as_text=True)), "post", path)


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
        messages = requests.post(f"{server.url}/v1/messages", json=MESSAGES, timeout=10)
        llama = requests.post(f"{server.url}/inference/chat_completion", json=LLAMA_CHAT, timeout=10)
    assert native.status_code == chat.status_code == messages.status_code == llama.status_code == 503
    # The held choices are cancelled: wait for their rows and places, so the next tests find room.
    wait_until_idle(server)
    documented(native, "post", "/predictions/mock")
    documented(chat, "post", "/v1/chat/completions")
    documented(messages, "post", "/v1/messages")
    documented(llama, "post", "/inference/chat_completion")


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
        ("post", "/tokenize", {"headers": bearer(), "json": TOKENIZE}, 200),
        ("post", "/detokenize", {"headers": bearer(), "data": too_big}, 413),
        ("post", "/v1/messages", {"headers": {"x-api-key": token()}, "json": MESSAGES}, 200),
        ("post", "/v1/messages", {"headers": {"x-api-key": "garbage"}, "json": MESSAGES}, 401),
        ("post", "/v1/responses", {"headers": bearer(), "json": RESPONSES}, 200),
        ("post", "/inference/completion", {"headers": {"x-api-key": token()}, "data": too_big}, 413),
        ("post", "/v1/load_lora_adapter", {"headers": bearer(), "json": LORA_ADAPTER}, 403),
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


def request_schema(path: str) -> dict:
    return SPEC["paths"][template_of(path)]["post"]["requestBody"]["content"]["application/json"]["schema"]


def properties(schema: dict, body: dict) -> dict[str, dict]:
    """A request's fields as they stand for this body: its allOf parts merged, with the branch of each
    if (then or else) that the body takes ("max_tokens": 0 only with echo and logprobs)."""
    merged: dict[str, dict] = {}
    parts = [schema]
    while parts:
        part = parts.pop(0)
        for name, prop in part.get("properties", {}).items():
            merged[name] = {**merged.get(name, {}), **prop}
        parts += part.get("allOf", [])
        if "if" in part:
            branch = "then" if Draft202012Validator(part["if"]).is_valid(body) else "else"
            parts += [part[branch]] if branch in part else []
    return merged


def takes_numeric_strings(prop: dict) -> bool:
    """SPEC §4.1: "top_k": "40" is a number too (the document's NumericString branch)."""
    return any(branch.get("type") == "string" and "pattern" in branch for branch in prop.get("anyOf", []))


def range_cases(fields: dict[str, dict]) -> Iterator[tuple[str, float, bool]]:
    """(field, value, in range) at and just past every documented bound."""
    for field, prop in fields.items():
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


def varied(base: dict, fields: dict[str, dict], field: str, value: Any) -> dict:
    """base with one field changed; min_tokens, which may not pass max_tokens, gets max_tokens to match
    (as far as max_tokens's own range goes, so that a min_tokens past its range is still the error)."""
    body = {**base, field: value}
    if field == "min_tokens" and float(value) > base["max_tokens"]:
        highest = (numeric_bounds(fields["max_tokens"]) or {}).get("maximum", float(value))
        body["max_tokens"] = int(min(float(value), highest))
    return body


# The fields SPEC §4.1 and §4.2 give ranges to, and those of the penalties and filters after them:
# the document must keep a range for each.
STEERING_RANGED = {
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "typical_p",
    "min_tokens",
}
OPENAI_RANGED = {"temperature", "top_k", "top_p", "max_tokens", "max_completion_tokens", "seed", "n"}
OPENAI_RANGED |= {"truncate_prompt_tokens", "prompt_logprobs"}
OPENAI_RANGED |= STEERING_RANGED
# (path, a good body to vary one field of, the fields with ranges)
RANGE_CHECKS = {
    "native": (
        "/predictions/mock",
        {**NATIVE, "stream": False},
        {"temperature", "top_k", "top_p", "max_tokens", "seed"} | STEERING_RANGED,
    ),
    "completions": ("/v1/completions", COMPLETION, OPENAI_RANGED | {"logprobs"}),
    # With echo and logprobs, max_tokens may be 0: the prompt is only scored.
    "completions-scoring": (
        "/v1/completions",
        {**COMPLETION, "echo": True, "logprobs": 0},
        OPENAI_RANGED | {"logprobs"},
    ),
    # top_logprobs only with logprobs true (CHECKED_BODIES has it without).
    "chat": ("/v1/chat/completions", {**CHAT, "logprobs": True}, OPENAI_RANGED | {"top_logprobs"}),
    "messages": ("/v1/messages", MESSAGES, {"max_tokens", "temperature", "top_p", "top_k"}),
    "responses": ("/v1/responses", RESPONSES, {"max_output_tokens", "temperature", "top_p"}),
}


@pytest.mark.parametrize("path, base, ranged", list(RANGE_CHECKS.values()), ids=list(RANGE_CHECKS))
def test_the_documented_ranges_are_the_servers(server: RunningServer, path, base, ranged) -> None:
    schema = request_schema(path)
    fields = properties(schema, base)
    cases = list(range_cases(fields))
    assert {field for field, _, _ in cases} == ranged
    for field, value, in_range in cases:
        body = varied(base, fields, field, value)
        assert Draft202012Validator(schema).is_valid(body) == in_range, (field, value)
        response = requests.post(f"{server.url}{path}", json=body, timeout=30)
        assert response.status_code == (200 if in_range else 400), (field, value, response.text)
        answer = documented(response, "post", path)
        if not in_range:
            assert field in (answer.get("message") or answer["error"]["message"])
        elif takes_numeric_strings(fields[field]):
            body = varied(base, fields, field, str(value))
            assert Draft202012Validator(schema).is_valid(body), (field, body[field])
            response = requests.post(f"{server.url}{path}", json=body, timeout=30)
            assert response.status_code == 200, (field, body[field], response.text)


# (path, body, the field its 400 names, or None where it is taken): beyond ranges, the request schemas
# take what the server takes, the fields it does not implement included.
CHECKED_BODIES = {
    "completion-scoring": (
        "/v1/completions",
        {**COMPLETION, "echo": True, "logprobs": 0, "max_tokens": 0},
        None,
    ),
    # max_tokens 0 with echo returns the prompt alone (and scores it with logprobs); without echo a 400.
    "completion-echo-only": ("/v1/completions", {**COMPLETION, "echo": True, "max_tokens": 0}, None),
    "completion-no-echo-zero": ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
    "completion-logit-bias-unicode-digit": (
        "/v1/completions",
        {**COMPLETION, "logit_bias": {"²": 1}},
        "logit_bias",
    ),
    "completion-logprobs-null": ("/v1/completions", {**COMPLETION, "logprobs": None}, None),
    "completion-logprobs-boolean": ("/v1/completions", {**COMPLETION, "logprobs": True}, "logprobs"),
    "completion-echo-number": ("/v1/completions", {**COMPLETION, "echo": 1}, "echo"),
    "completion-truncate-to-nothing": (
        "/v1/completions",
        {**COMPLETION, "truncate_prompt_tokens": 0},
        "truncate_prompt_tokens",
    ),
    "completion-truncate-to-fit": ("/v1/completions", {**COMPLETION, "truncate_prompt_tokens": -1}, None),
    "completion-prompt-logprobs-streamed": (
        "/v1/completions",
        {**COMPLETION, "prompt_logprobs": 1, "stream": True},
        "prompt_logprobs",
    ),
    "completion-allowed-token-ids": ("/v1/completions", {**COMPLETION, "allowed_token_ids": [5, 9]}, None),
    "completion-bad-words": ("/v1/completions", {**COMPLETION, "bad_words": ["hello", "big world"]}, None),
    "completion-bad-words-blank": ("/v1/completions", {**COMPLETION, "bad_words": [" "]}, "bad_words"),
    "completion-allowed-token-ids-empty": (
        "/v1/completions",
        {**COMPLETION, "allowed_token_ids": []},
        "allowed_token_ids",
    ),
    "completion-guided-regex": ("/v1/completions", {**COMPLETION, "guided_regex": "[a-z]+"}, None),
    "completion-guided-json-text": (
        "/v1/completions",
        {**COMPLETION, "guided_json": '{"type": "object"}'},
        None,
    ),
    "completion-logit-bias": (
        "/v1/completions",
        {**COMPLETION, "logit_bias": {"255": -100.0, "007": 100}},
        None,
    ),
    "completion-logit-bias-key": ("/v1/completions", {**COMPLETION, "logit_bias": {"a": 1}}, "logit_bias"),
    "completion-logit-bias-over": (
        "/v1/completions",
        {**COMPLETION, "logit_bias": {"1": 100.5}},
        "logit_bias",
    ),
    "completion-logit-bias-under": (
        "/v1/completions",
        {**COMPLETION, "logit_bias": {"1": -101}},
        "logit_bias",
    ),
    "completion-logit-bias-boolean": (
        "/v1/completions",
        {**COMPLETION, "logit_bias": {"1": True}},
        "logit_bias",
    ),
    "completion-logit-bias-list": ("/v1/completions", {**COMPLETION, "logit_bias": [1]}, "logit_bias"),
    "completion-logit-bias-301": (
        "/v1/completions",
        {**COMPLETION, "logit_bias": {str(i): 1 for i in range(301)}},
        "logit_bias",
    ),
    "completion-stop-token-ids-none": ("/v1/completions", {**COMPLETION, "stop_token_ids": []}, None),
    "completion-stop-token-ids-negative": (
        "/v1/completions",
        {**COMPLETION, "stop_token_ids": [-1]},
        "stop_token_ids",
    ),
    "completion-stop-token-ids-number": (
        "/v1/completions",
        {**COMPLETION, "stop_token_ids": 10},
        "stop_token_ids",
    ),
    "chat-logprobs": ("/v1/chat/completions", {**CHAT, "logprobs": True}, None),
    "chat-logprobs-number": ("/v1/chat/completions", {**CHAT, "logprobs": 1}, "logprobs"),
    "chat-top-logprobs-alone": ("/v1/chat/completions", {**CHAT, "top_logprobs": 0}, "top_logprobs"),
    "chat-top-logprobs-no-logprobs": (
        "/v1/chat/completions",
        {**CHAT, "logprobs": False, "top_logprobs": 2},
        "top_logprobs",
    ),
    "chat-top-logprobs-null": ("/v1/chat/completions", {**CHAT, "top_logprobs": None}, None),
    "chat-json-mode": ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, None),
    "chat-json-schema": (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {}}}},
        None,
    ),
    "chat-json-schema-missing": (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "o"}}},
        "response_format.json_schema.schema",
    ),
    "chat-format-xml": (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "xml"}},
        "response_format",
    ),
    "chat-guided-choice": ("/v1/chat/completions", {**CHAT, "guided_choice": ["yes", "no"]}, None),
    "chat-guided-choice-empty": ("/v1/chat/completions", {**CHAT, "guided_choice": []}, "guided_choice"),
    "chat-guided-regex-empty": ("/v1/chat/completions", {**CHAT, "guided_regex": ""}, "guided_regex"),
    "chat-structured-choice": (
        "/v1/chat/completions",
        {**CHAT, "structured_outputs": {"choice": ["yes", "no"], "disable_fallback": True}},
        None,
    ),
    "chat-structured-nothing": (
        "/v1/chat/completions",
        {**CHAT, "structured_outputs": {}},
        "structured_outputs",
    ),
    "chat-structured-json-object-string": (
        "/v1/chat/completions",
        {**CHAT, "structured_outputs": {"json_object": "yes"}},
        "structured_outputs.json_object",
    ),
    "chat-structured-tag": (
        "/v1/chat/completions",
        {**CHAT, "structured_outputs": {"structural_tag": "{}"}},
        "structured_outputs.structural_tag",
    ),
    "chat-tools": (
        "/v1/chat/completions",
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
        None,
    ),
    "chat-tools-bad-name": (
        "/v1/chat/completions",
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f g"}}]},
        "tools[0].function.name",
    ),
    "chat-tool-choice": ("/v1/chat/completions", {**CHAT, "tool_choice": "auto"}, "tool_choice"),
    "chat-functions": ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    "chat-function-call": ("/v1/chat/completions", {**CHAT, "function_call": "auto"}, "function_call"),
    "chat-audio": ("/v1/chat/completions", {**CHAT, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    "chat-modalities": ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities"),
    "chat-prediction": (
        "/v1/chat/completions",
        {**CHAT, "prediction": {"type": "content", "content": "x"}},
        None,
    ),
    "chat-prediction-parts": (
        "/v1/chat/completions",
        {**CHAT, "prediction": {"type": "content", "content": [{"type": "text", "text": "x"}]}},
        None,
    ),
    "chat-prediction-type": (
        "/v1/chat/completions",
        {**CHAT, "prediction": {"type": "text", "content": "x"}},
        "prediction",
    ),
    "chat-prediction-text": ("/v1/chat/completions", {**CHAT, "prediction": "x"}, "prediction"),
    "chat-prediction-no-content": (
        "/v1/chat/completions",
        {**CHAT, "prediction": {"type": "content"}},
        "prediction.content",
    ),
    "chat-prediction-image": (
        "/v1/chat/completions",
        {**CHAT, "prediction": {"type": "content", "content": [{"type": "image_url", "image_url": {}}]}},
        "prediction.content[0]",
    ),
    "chat-web-search": ("/v1/chat/completions", {**CHAT, "web_search_options": {}}, "web_search_options"),
    "chat-special-tokens": ("/v1/chat/completions", {**CHAT, "add_special_tokens": True}, None),
    "chat-special-tokens-word": (
        "/v1/chat/completions",
        {**CHAT, "add_special_tokens": "yes"},
        "add_special_tokens",
    ),
    "completion-special-tokens": ("/v1/completions", {**COMPLETION, "add_special_tokens": False}, None),
    "completion-special-tokens-number": (
        "/v1/completions",
        {**COMPLETION, "add_special_tokens": 0},
        "add_special_tokens",
    ),
    "tokenize-empty-prompt": ("/tokenize", {"prompt": ""}, None),
    "tokenize-messages-win": ("/tokenize", {"prompt": 5, "messages": CHAT["messages"]}, None),
    "tokenize-prompt-number": ("/tokenize", {"prompt": 5}, "prompt"),
    "tokenize-no-messages": ("/tokenize", {"messages": []}, "messages"),
    "tokenize-flag-string": ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    "tokenize-strs-number": ("/tokenize", {"prompt": "x", "return_token_strs": 1}, "return_token_strs"),
    "tokenize-generation-prompt-string": (
        "/tokenize",
        {"messages": CHAT["messages"], "add_generation_prompt": "no"},
        "add_generation_prompt",
    ),
    "tokenize-content": ("/tokenize", {"content": "hi", "parse_special": False, "with_pieces": True}, None),
    "tokenize-content-number": ("/tokenize", {"content": 5}, "content"),
    "tokenize-pieces-string": ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
    "embedding-content": ("/embedding", {"content": ["a", [104, 105]]}, None),
    "embedding-nothing": ("/embedding", {"model": "mock"}, "content"),
    "embeddings-empty-input": ("/embeddings", {"input": [], "content": "a"}, "input"),
    "detokenize-negative": ("/detokenize", {"tokens": [-1]}, "tokens"),
    "detokenize-string": ("/detokenize", {"tokens": "hi"}, "tokens"),
    "detokenize-nothing": ("/detokenize", {"model": "mock"}, "tokens"),
    "messages-image": (
        "/v1/messages",
        {
            **MESSAGES,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url"}}]}],
        },
        "messages[0].content[0]",
    ),
    "messages-system-role": (
        "/v1/messages",
        {**MESSAGES, "messages": [{"role": "system", "content": "Be brief."}]},
        "messages[0].role",
    ),
    "messages-tools": ("/v1/messages", {**MESSAGES, **MESSAGES_TOOLS}, None),
    "messages-tool-schema-not-an-object": (
        "/v1/messages",
        {**MESSAGES, "tools": [{"name": "f", "input_schema": {}}]},
        "tools[0].input_schema",
    ),
    "messages-server-tool": (
        "/v1/messages",
        {**MESSAGES, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        "tools[0].type",
    ),
    "messages-tool-bad-name": (
        "/v1/messages",
        {**MESSAGES, "tools": [{"name": "f g", "input_schema": {"type": "object"}}]},
        "tools[0].name",
    ),
    "messages-tool-choice": ("/v1/messages", {**MESSAGES, "tool_choice": {"type": "auto"}}, "tool_choice"),
    "messages-tool-choice-unnamed": (
        "/v1/messages",
        {**MESSAGES, **MESSAGES_TOOLS, "tool_choice": {"type": "tool"}},
        "tool_choice.name",
    ),
    "messages-tool-use-from-the-user": (
        "/v1/messages",
        {**MESSAGES, "messages": [{"role": "user", "content": MESSAGES_TOOLS["messages"][1]["content"]}]},
        "messages[0].content[1]",
    ),
    "count-tokens-tools": ("/v1/messages/count_tokens", {**COUNT_TOKENS, **MESSAGES_TOOLS}, None),
    "count-tokens-server-tool": (
        "/v1/messages/count_tokens",
        {**COUNT_TOKENS, "tools": [{"type": "bash_20250124", "name": "bash"}]},
        "tools[0].type",
    ),
    "messages-thinking": (
        "/v1/messages",
        {**MESSAGES, "thinking": {"type": "enabled"}},
        "thinking.budget_tokens",
    ),
    "messages-output-format": (
        "/v1/messages",
        {**MESSAGES, "output_config": {"format": {"type": "json_schema", "schema": {}}}},
        "output_config",
    ),
    "messages-stop-string": ("/v1/messages", {**MESSAGES, "stop_sequences": "tempor"}, None),
    "messages-stop-17": ("/v1/messages", {**MESSAGES, "stop_sequences": ["x"] * 17}, "stop_sequences"),
    "responses-previous-id": (
        "/v1/responses",
        {**RESPONSES, "previous_response_id": "resp_1"},
        "previous_response_id",
    ),
    "responses-conversation": ("/v1/responses", {**RESPONSES, "conversation": "conv_1"}, "conversation"),
    "responses-tools": ("/v1/responses", {**RESPONSES, "tools": [{"type": "web_search"}]}, "tools[0].type"),
    "responses-reasoning": (
        "/v1/responses",
        {**RESPONSES, "reasoning": {"effort": "none", "summary": "concise"}},
        "reasoning.summary",
    ),
    "responses-json": (
        "/v1/responses",
        {**RESPONSES, "text": {"format": {"type": "json_schema", "name": "x"}}},
        "text.format.schema",
    ),
    "responses-background": ("/v1/responses", {**RESPONSES, "background": True}, "background"),
    "responses-truncation": ("/v1/responses", {**RESPONSES, "truncation": "auto"}, "truncation"),
    "responses-include": (
        "/v1/responses",
        {**RESPONSES, "include": ["reasoning.encrypted_content", "message.output_text.logprobs"]},
        "include",
    ),
    "responses-top-logprobs": ("/v1/responses", {**RESPONSES, "top_logprobs": 2}, "top_logprobs"),
    "responses-image": (
        "/v1/responses",
        {**RESPONSES, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0]",
    ),
    "responses-tool-output": (
        "/v1/responses",
        {**RESPONSES, "input": [{"type": "item_reference", "id": "rs_0123"}]},
        "input[0].type",
    ),
    "responses-empty-input": ("/v1/responses", {**RESPONSES, "input": ""}, "input"),
    "llama-image": (
        "/inference/chat_completion",
        {**LLAMA_CHAT, "messages": [{"role": "user", "content": [{"type": "image", "image": {"url": "x"}}]}]},
        "messages[0].content[0]",
    ),
    "llama-context": (
        "/inference/chat_completion",
        {**LLAMA_CHAT, "messages": [{"role": "user", "content": "hi", "context": "a document"}]},
        "messages[0].context",
    ),
    "llama-response-format": (
        "/inference/completion",
        {**LLAMA_COMPLETION, "response_format": {"type": "json_schema", "json_schema": {}}},
        "response_format",
    ),
    "llama-logprobs": ("/inference/completion", {**LLAMA_COMPLETION, "logprobs": {"top_k": 1}}, "logprobs"),
    "llama-tools": ("/inference/chat_completion", {**LLAMA_CHAT, "tools": [{"tool_name": "f"}]}, "tools"),
    "llama-strategy-unknown": (
        "/inference/completion",
        {**LLAMA_COMPLETION, "sampling_params": {"strategy": {"type": "beam"}}},
        "sampling_params.strategy.type",
    ),
    "llama-top-k-missing": (
        "/inference/completion",
        {**LLAMA_COMPLETION, "sampling_params": {"strategy": {"type": "top_k"}}},
        "sampling_params.strategy.top_k",
    ),
    "llama-temperature-zero": (
        "/inference/completion",
        {**LLAMA_COMPLETION, "sampling_params": {"strategy": {"type": "top_p", "temperature": 0}}},
        "sampling_params.strategy.temperature",
    ),
    "llama-stop-5": (
        "/inference/completion",
        {**LLAMA_COMPLETION, "sampling_params": {"stop": ["a", "b", "c", "d", "e"]}},
        "sampling_params.stop",
    ),
    "llama-max-tokens-negative": (
        "/inference/completion",
        {**LLAMA_COMPLETION, "sampling_params": {"max_tokens": -1}},
        "sampling_params.max_tokens",
    ),
    "llama-first-releases": (
        "/inference/completion",
        {
            "model": "mock",
            "content": "hi",
            "sampling_params": {"strategy": "top_k", "top_k": 5, "max_tokens": 4},
        },
        None,
    ),
    "llama-text-item": (
        "/inference/completion",
        {**LLAMA_COMPLETION, "content": {"type": "text", "text": "hello"}},
        None,
    ),
}


@pytest.mark.parametrize("path, body, param", list(CHECKED_BODIES.values()), ids=list(CHECKED_BODIES))
def test_the_request_schemas_take_what_the_server_takes(server: RunningServer, path, body, param) -> None:
    assert Draft202012Validator(request_schema(path)).is_valid(body) == (param is None)
    response = requests.post(f"{server.url}{path}", json=body, timeout=30)
    assert response.status_code == (200 if param is None else 400), response.text
    answer = documented(response, "post", path)
    if param is not None:
        assert named_field(answer) == param


def named_field(answer: dict) -> str:
    """The field a 400 names: OpenAI's param, else the start of Anthropic's message or Llama Stack's
    detail (every message starts with the field's name)."""
    error = answer.get("error", {})
    if "param" in error:
        return error["param"]
    message = error.get("message") or answer["detail"]
    return message.split(" ", 1)[0]
