"""Anthropic's Messages API (/v1/messages) with the official anthropic client, unchanged: on the real
default model, straight and through the proxy with the token as its api_key; on the mock for the errors
and for a stop sequence's row being freed."""

from __future__ import annotations

import time
from collections.abc import Iterator

import anthropic
import pytest
import requests

from tests.compat.conftest import MODEL, template_tokens
from tests.proxy.conftest import token

# temperature, top_p and top_k are no longer arguments of the client's create(): they go as extra_body.
GREEDY = {"extra_body": {"temperature": 0}}
STORY = [{"role": "user", "content": "Write a story about a dragon who learns to bake bread."}]
SHORT = [
    {"role": "user", "content": "Reply with one word: yes or no. Is the sky blue?"}
]  # answered in 2 tokens


def client_of(url: str, api_key: str = "not-needed") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server) -> Iterator[anthropic.Anthropic]:
    with client_of(server.url) as client:  # closed after: no idle keep-alive holds the server's shutdown
        yield client


@pytest.fixture(scope="module")
def mock_client(mock_server) -> Iterator[anthropic.Anthropic]:
    with client_of(mock_server.url) as client:
        yield client


def text_of(message) -> str:
    assert [block.type for block in message.content] == ["text"]
    return message.content[0].text


def test_create_create_streamed_and_the_stream_helper_give_the_same_greedy_answer(client, tokenizer):
    asked = {"model": MODEL, "max_tokens": 10, "system": "You tell stories.", "messages": STORY, **GREEDY}
    whole = client.messages.create(**asked)
    events = list(client.messages.create(**asked, stream=True))
    with client.messages.stream(**asked) as stream:
        helper_text = "".join(stream.text_stream)
        final = stream.get_final_message()

    names = [event.type for event in events]  # the client passes no ping on
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = [event.delta.text for event in events if event.type == "content_block_delta"]
    assert len(deltas) == len(names) - 5 > 3  # it really streamed, in pieces
    assert "".join(deltas) == text_of(whole) == helper_text == text_of(final)
    assert whole.stop_reason == events[-2].delta.stop_reason == final.stop_reason == "max_tokens"
    assert whole.stop_sequence is None and whole.role == "assistant" and whole.id.startswith("msg_")
    system_and_story = [{"role": "system", "content": "You tell stories."}, *STORY]
    assert (
        whole.usage.input_tokens
        == events[0].message.usage.input_tokens
        == template_tokens(tokenizer, system_and_story)
    )
    assert whole.usage.output_tokens == events[-2].usage.output_tokens == final.usage.output_tokens == 10


def test_an_answer_that_ends_by_itself_ends_its_turn(client):
    message = client.messages.create(model=MODEL, max_tokens=50, messages=SHORT, **GREEDY)
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert 0 < message.usage.output_tokens < 50 and text_of(message)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_ends_the_answer_and_is_named(client, stream):
    full = text_of(client.messages.create(model=MODEL, max_tokens=16, messages=STORY, **GREEDY))
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    assert stop.strip(), full
    asked = {
        "model": MODEL,
        "max_tokens": 16,
        "messages": STORY,
        "stop_sequences": ["§never§", stop],
        **GREEDY,
    }
    if stream:
        with client.messages.stream(**asked) as answer:
            text = "".join(answer.text_stream)
            message = answer.get_final_message()
    else:
        message = client.messages.create(**asked)
        text = text_of(message)
    assert text == full[: full.index(stop)]
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert 0 < message.usage.output_tokens < 16


def test_system_blocks_and_a_prefill_go_through_the_chat_template(client, tokenizer):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    system = "You answer in one word. Be precise."
    as_string = client.messages.create(model=MODEL, max_tokens=1, system=system, messages=question)
    blocks = [{"type": "text", "text": "You answer in one word."}, {"type": "text", "text": " Be precise."}]
    as_blocks = client.messages.create(model=MODEL, max_tokens=1, system=blocks, messages=question)
    with_system = [{"role": "system", "content": system}, *question]
    assert (
        as_string.usage.input_tokens
        == as_blocks.usage.input_tokens
        == template_tokens(tokenizer, with_system)
    )

    prefill = "The capital of France is"
    prefilled = client.messages.create(
        model=MODEL, max_tokens=3, messages=[*question, {"role": "assistant", "content": prefill}], **GREEDY
    )
    # The answer goes on from the prefill, which is in the prompt and not in the answer.
    assert prefilled.usage.input_tokens == template_tokens(tokenizer, question, prefill)
    assert not text_of(prefilled).startswith(prefill)


def test_through_the_proxy_the_token_is_the_api_key(client, proxy):
    asked = {"model": MODEL, "max_tokens": 6, "messages": STORY, **GREEDY}
    through = client_of(proxy.url, api_key=token())
    events = list(through.messages.create(**asked, stream=True))
    text = "".join(event.delta.text for event in events if event.type == "content_block_delta")
    assert text == text_of(client.messages.create(**asked))
    with pytest.raises(anthropic.AuthenticationError):
        client_of(proxy.url, api_key="not-a-token").messages.create(**asked)


ASKS_FOR_MORE = {
    "thinking": {"thinking": {"type": "enabled", "budget_tokens": 1024}},
    "thinking.budget_tokens": {"thinking": {"type": "enabled", "budget_tokens": 10}},
    "messages[0].content[1]": {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
                ],
            }
        ]
    },
    "messages[1].content[0]": {
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [{"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}],
            },
        ]
    },
    "messages[0].role": {"messages": [{"role": "system", "content": "Be brief."}]},
    "temperature": {"extra_body": {"temperature": 1.5}},
    "top_k": {"extra_body": {"top_k": -1}},
    "max_tokens": {"max_tokens": 0},
}


@pytest.mark.parametrize("field", list(ASKS_FOR_MORE))
def test_what_is_not_built_or_out_of_range_is_a_400_naming_the_field(mock_client, field):
    asked = {"model": "mock", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(anthropic.BadRequestError) as refused:
        mock_client.messages.create(**{**asked, **ASKS_FOR_MORE[field]})
    assert refused.value.status_code == 400
    error = refused.value.body["error"]
    assert refused.value.body["type"] == "error" and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{field} "), error["message"]


def test_another_model_is_a_404_and_a_missing_max_tokens_a_400(mock_client, mock_server):
    with pytest.raises(anthropic.NotFoundError) as missing:
        mock_client.messages.create(
            model="claude", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert missing.value.body["error"]["type"] == "not_found_error"
    assert "'claude'" in missing.value.body["error"]["message"]
    # The client will not send a request without max_tokens: a plain one does.
    response = requests.post(
        f"{mock_server.url}/v1/messages",
        json={"model": "mock", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status_code == 400
    assert response.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": response.json()["error"]["message"]},
    }
    assert response.json()["error"]["message"].startswith("max_tokens is required")


def test_a_max_tokens_past_the_context_says_what_fits_and_how_claude_code_asks_for_less(mock_client):
    # Claude Code sends max_tokens 32000 on every request; the mock's rows hold 4096 positions.
    with pytest.raises(anthropic.BadRequestError) as refused:
        mock_client.messages.create(
            model="mock", max_tokens=32000, messages=[{"role": "user", "content": "hi"}]
        )
    message = refused.value.body["error"]["message"]
    prompt_tokens = mock_client.messages.count_tokens(
        model="mock", messages=[{"role": "user", "content": "hi"}]
    ).input_tokens
    assert f"max_tokens may be at most {4096 - prompt_tokens}; the request asks for 32000" in message
    assert (
        f"set it to {4096 - prompt_tokens} or less" in message and "CLAUDE_CODE_MAX_OUTPUT_TOKENS" in message
    )


def test_the_row_of_an_answer_ended_by_a_stop_sequence_is_freed_at_once(mock_client, mock_server):
    """The backend matches the stop sequence and names it: the row ends there, it does not go on to
    max_tokens (4,000 tokens would take the mock 20 s)."""
    started = time.monotonic()
    message = mock_client.messages.create(
        model="mock", max_tokens=4000, messages=[{"role": "user", "content": "hi"}], stop_sequences=["amet"]
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "amet"
    assert "amet" not in text_of(message) and message.usage.output_tokens < 20  # 19 words a round
    deadline = started + 5
    while mock_server.metric("inference_active_rows"):
        assert time.monotonic() < deadline, "the row still generates"
        time.sleep(0.05)
