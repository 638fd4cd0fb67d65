"""A backend that fails while answers stream: each stream ends with its API's error event, which its
client sees as an error, never as a clean end (on a mock that stalls for good at one prompt, which the
router's watchdog then kills)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import ollama
import openai
import pytest
import requests

from tests.server_fixture import RunningServer, running_server

STALL = "stall for good"
LONG = {"model": "mock", "messages": [{"role": "user", "content": "a long answer"}]}


@pytest.fixture(scope="module")
def stalling_server() -> Iterator[RunningServer]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("INFERENCE_MOCK_STALL_TEXT", STALL)
        options = "--mock --rows 6 --mock-tokens-per-second 20 --step-timeout 2 --restart-delay 0.5"
        with running_server(*options.split()) as server:
            yield server


def test_each_stream_ends_with_its_apis_error_event(stalling_server: RunningServer) -> None:
    url = stalling_server.url
    with (
        anthropic.Anthropic(base_url=url, api_key="-", max_retries=0) as claude,
        openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0) as gpt,
    ):
        messages = iter(claude.messages.create(**LONG, max_tokens=2000, stream=True))
        assert next(messages).type == "message_start"
        responses = iter(gpt.responses.create(model="mock", input="a long answer", stream=True))
        assert next(responses).type == "response.created"
        llama = requests.post(
            f"{url}/inference/chat_completion",
            json={**LONG, "model_id": "mock", "sampling_params": {"max_tokens": 2000}, "stream": True},
            stream=True,
            timeout=30,
        )
        llama_lines = llama.iter_lines(decode_unicode=True)
        assert json.loads(next(llama_lines).removeprefix("data: "))["event"]["event_type"] == "start"
        llamacpp = requests.post(
            f"{url}/completion",
            json={"prompt": "a long answer", "n_predict": 2000, "stream": True},
            stream=True,
        )
        llamacpp_lines = llamacpp.iter_lines(decode_unicode=True)
        assert json.loads(next(llamacpp_lines).removeprefix("data: "))["stop"] is False
        ollama_parts = iter(ollama.Client(host=url).chat(**LONG, options={"num_predict": 2000}, stream=True))
        assert next(ollama_parts).done is False

        stalled = requests.post(f"{url}/v1/completions", json={"model": "mock", "prompt": STALL}, timeout=30)
        assert stalled.status_code == 503

        with pytest.raises(anthropic.APIStatusError) as failed:  # the client raises the error event
            for _ in messages:
                pass
        assert failed.value.body["error"]["type"] == "api_error"
        assert "no step" in failed.value.body["error"]["message"]
        last = list(responses)[-1]
        assert last.type == "response.failed" and last.response.status == "failed"
        assert "no step" in last.response.error.message
        last_line = [line for line in llama_lines if line][-1]
        assert "no step" in json.loads(last_line.removeprefix("data: "))["error"]["message"]
        llamacpp_error = json.loads([line for line in llamacpp_lines if line][-1].removeprefix("data: "))[
            "error"
        ]
        assert llamacpp_error["code"] == 503 and "no step" in llamacpp_error["message"]
        with pytest.raises(ollama.ResponseError) as ended:  # the client raises the {"error"} line
            for _ in ollama_parts:
                pass
        assert "no step" in ended.value.error
