"""Llama Stack's inference API (completion and chat completion), from a small client written from its
published API: JSON requests, answers as JSON or as server-sent `data:` events. On the real default
model, and on the mock for what it refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests

from tests.compat.conftest import MODEL, template_tokens

STORY = [{"role": "user", "content": "Write a story about a dragon who learns to bake bread."}]
SHORT = [
    {"role": "user", "content": "Reply with one word: yes or no. Is the sky blue?"}
]  # answered in 2 tokens
GREEDY = {"strategy": {"type": "greedy"}}


class LlamaStack:
    """What a Llama Stack client does: POST a JSON body; read one JSON answer, or with `stream: true`
    the events of a text/event-stream body, one JSON object per `data:` line."""

    def __init__(self, base_url: str):
        self.base_url = base_url

    def call(self, route: str, **body: Any) -> dict[str, Any]:
        response = requests.post(f"{self.base_url}{route}", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    def stream(self, route: str, **body: Any) -> list[dict[str, Any]]:
        with requests.post(
            f"{self.base_url}{route}", json={**body, "stream": True}, stream=True, timeout=120
        ) as response:
            assert response.status_code == 200, response.text
            assert response.headers["Content-Type"].startswith("text/event-stream")
            lines = [line for line in response.iter_lines(decode_unicode=True) if line]
        assert all(line.startswith("data: ") for line in lines), lines
        return [json.loads(line.removeprefix("data: ")) for line in lines]


def metrics_of(answer: dict[str, Any]) -> dict[str, int]:
    assert all(metric["unit"] == "tokens" for metric in answer["metrics"])
    return {metric["metric"]: metric["value"] for metric in answer["metrics"]}


@pytest.fixture(scope="module")
def llama(server) -> LlamaStack:
    return LlamaStack(server.url)


def test_a_completion_streamed_equals_the_one_answered_whole(llama, tokenizer):
    asked = {
        "model_id": MODEL,
        "content": "The three laws of robotics are",
        "sampling_params": {"max_tokens": 10},
    }
    whole = llama.call("/inference/completion", **asked)
    chunks = llama.stream("/inference/completion", **asked)
    assert len(chunks) > 4 and all(chunk["stop_reason"] is None for chunk in chunks[:-1])
    assert "".join(chunk["delta"] for chunk in chunks) == whole["content"] and chunks[-1]["delta"] == ""
    assert chunks[-1]["stop_reason"] == whole["stop_reason"] == "out_of_tokens"
    prompt_tokens = len(tokenizer(asked["content"]).input_ids)
    expected = {"prompt_tokens": prompt_tokens, "completion_tokens": 10, "total_tokens": prompt_tokens + 10}
    assert metrics_of(whole) == metrics_of(chunks[-1]) == expected


def test_a_chat_completion_streams_start_progress_and_complete_events(llama, tokenizer):
    asked = {"model_id": MODEL, "messages": STORY, "sampling_params": {**GREEDY, "max_tokens": 10}}
    whole = llama.call("/inference/chat_completion", **asked)
    chunks = llama.stream("/inference/chat_completion", **asked)
    events = [chunk["event"] for chunk in chunks]
    kinds = [event["event_type"] for event in events]
    assert kinds == ["start", *["progress"] * (len(events) - 2), "complete"] and len(events) > 5
    assert all(event["delta"]["type"] == "text" for event in events)
    message = whole["completion_message"]
    assert message["role"] == "assistant" and message["tool_calls"] == []
    assert "".join(event["delta"]["text"] for event in events) == message["content"]
    assert events[-1]["stop_reason"] == message["stop_reason"] == "out_of_tokens"
    assert metrics_of(whole)["prompt_tokens"] == template_tokens(tokenizer, STORY)
    assert metrics_of(whole) == metrics_of(chunks[-1])


def test_an_answer_that_ends_by_itself_ends_its_turn(llama):
    answer = llama.call("/inference/chat_completion", model_id=MODEL, messages=SHORT)
    assert answer["completion_message"]["stop_reason"] == "end_of_turn"
    assert 0 < metrics_of(answer)["completion_tokens"] < 10


def test_a_stop_string_ends_the_answer_before_it(llama):
    asked = {"model_id": MODEL, "messages": STORY, "sampling_params": {"max_tokens": 16}}
    full = llama.call("/inference/chat_completion", **asked)["completion_message"]["content"]
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    assert stop.strip(), full
    asked["sampling_params"]["stop"] = [stop]
    message = llama.call("/inference/chat_completion", **asked)["completion_message"]
    assert message["content"] == full[: full.index(stop)] and message["stop_reason"] == "end_of_turn"


def test_the_strategies_sample_as_named_and_the_first_releases_form_is_read(llama):
    """top_k 1 and a tiny top_p keep only the most likely token: the greedy answer again. So does the
    first releases' request: `model`, and the strategy's name with its values beside it."""
    asked = {"model_id": MODEL, "messages": STORY}
    greedy = llama.call("/inference/chat_completion", **asked, sampling_params={**GREEDY, "max_tokens": 6})
    greedy_text = greedy["completion_message"]["content"]
    for strategy in ({"type": "top_k", "top_k": 1}, {"type": "top_p", "temperature": 0.9, "top_p": 1e-9}):
        sampled = llama.call(
            "/v1/inference/chat-completion", **asked, sampling_params={"strategy": strategy, "max_tokens": 6}
        )
        assert sampled["completion_message"]["content"] == greedy_text, strategy
    first_releases = llama.call(
        "/inference/chat_completion",
        model=MODEL,
        messages=[{"role": "user", "content": {"type": "text", "text": STORY[0]["content"]}}],
        sampling_params={"strategy": "top_k", "top_k": 1, "temperature": 0.5, "max_tokens": 6},
    )
    assert first_releases["completion_message"]["content"] == greedy_text


REFUSED = {
    "messages[0].content[1]": {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image", "image": {"url": "a.png"}},
                ],
            }
        ]
    },
    "response_format": {"response_format": {"type": "json_schema", "json_schema": {"type": "object"}}},
    "tools": {"tools": [{"tool_name": "get_weather", "description": "The weather"}]},
    "sampling_params.strategy.type": {"sampling_params": {"strategy": {"type": "beam"}}},
    "sampling_params.strategy.top_k": {"sampling_params": {"strategy": {"type": "top_k"}}},
    "sampling_params.max_tokens": {"sampling_params": {"max_tokens": "many"}},
    "sampling_params.stop": {"sampling_params": {"stop": 5}},
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_what_is_not_built_or_wrong_is_a_400_whose_detail_names_it(mock_server, field):
    body = {"model_id": "mock", "messages": SHORT, **REFUSED[field]}
    response = requests.post(f"{mock_server.url}/inference/chat_completion", json=body, timeout=10)
    assert response.status_code == 400
    assert list(response.json()) == ["detail"] and response.json()["detail"].startswith(f"{field} ")


def test_another_model_is_a_404_and_a_model_is_required(mock_server):
    other = requests.post(
        f"{mock_server.url}/v1/inference/completion", json={"model_id": "llama", "content": "hi"}, timeout=10
    )
    assert other.status_code == 404 and "'llama'" in other.json()["detail"]
    none = requests.post(f"{mock_server.url}/inference/completion", json={"content": "hi"}, timeout=10)
    assert none.status_code == 400 and none.json()["detail"].startswith("model_id is required")
