"""A request the backend refuses as the request's own fault (Piece.invalid) is a 400 at every API, in its
API's error shape, naming the API's own field for what was refused (a failure of the server's stays a
503: tests/compat/test_mid_stream_failures.py).

The frontend checks prompts before they reach the backend, so here the mock backend is handed each prompt
emptied, which it refuses as the engine does (backend/mock.py, `refusal`).
"""

from __future__ import annotations

import pytest
from flask import Flask

CHAT = {"model": "mock", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.fixture
def refusing(app: Flask, monkeypatch: pytest.MonkeyPatch) -> Flask:
    """The app, its backend handed every prompt emptied: refused as the request's fault."""
    backend = app.extensions["router"]._backend
    submit = backend.submit

    def submit_emptied(request_id, prompt_ids, params, cache_scope="", team="", adapter=""):
        submit(request_id, (), params, cache_scope, team, adapter)

    monkeypatch.setattr(backend, "submit", submit_emptied)
    return app


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"model": "mock", "prompt": "Hi", "max_tokens": 4}, "prompt"),
        ("/v1/completions", {"model": "mock", "prompt": "Hi", "max_tokens": 4, "stream": True}, "prompt"),
        ("/v1/completions", {"model": "mock", "prompt": "Hi", "max_tokens": 4, "n": 2}, "prompt"),
        ("/v1/chat/completions", CHAT, "messages"),
        ("/v1/responses", {"model": "mock", "input": "Hi"}, "input"),
        ("/v1/embeddings", {"model": "mock", "input": ["a", "b"]}, "input"),
    ],
    ids=["completions", "completions-streamed", "completions-n", "chat", "responses", "embeddings"],
)
def test_openai_paths_answer_a_400_naming_the_field(
    refusing: Flask, path: str, body: dict, param: str
) -> None:
    response = refusing.test_client().post(path, json=body)
    assert response.status_code == 400, response.get_data(as_text=True)
    assert "Retry-After" not in response.headers
    error = response.get_json()["error"]
    assert error == {
        "message": f"{param}: the prompt is empty",
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }


def test_anthropic_messages_answer_its_400(refusing: Flask) -> None:
    response = refusing.test_client().post("/v1/messages", json=CHAT)
    assert response.status_code == 400
    assert response.get_json()["error"] == {
        "type": "invalid_request_error",
        "message": "messages: the prompt is empty",
    }


def test_llama_stack_answers_its_400(refusing: Flask) -> None:
    body = {"model_id": "mock", "content": "Hi", "sampling_params": {"max_tokens": 4}}
    response = refusing.test_client().post("/v1/inference/completion", json=body)
    assert response.status_code == 400
    assert response.get_json() == {"detail": "content: the prompt is empty"}


@pytest.mark.parametrize("stream", [False, True])
def test_the_native_api_answers_its_400(refusing: Flask, stream: bool) -> None:
    response = refusing.test_client().post("/predictions/mock", json={"text": "Hi", "stream": stream})
    assert response.status_code == 400
    assert response.get_json() == {"status_code": 400, "message": "text: the prompt is empty"}


def test_unrefused_requests_are_served(app: Flask) -> None:
    response = app.test_client().post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200 and response.get_json()["choices"][0]["finish_reason"] == "length"
