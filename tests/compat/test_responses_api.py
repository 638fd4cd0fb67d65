"""OpenAI's Responses API (/v1/responses), stateless, with the official openai client, unchanged: on the
real default model, and on the mock for what it refuses."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.compat.conftest import MODEL, template_tokens

INSTRUCTIONS = "You tell stories."
STORY = "Write a story about a dragon who learns to bake bread."
SHORT = "Reply with one word: yes or no. Is the sky blue?"  # answered in 2 tokens


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="not-needed", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server) -> Iterator[openai.OpenAI]:
    with client_of(server.url) as client:  # closed after: no idle keep-alive holds the server's shutdown
        yield client


@pytest.fixture(scope="module")
def mock_client(mock_server) -> Iterator[openai.OpenAI]:
    with client_of(mock_server.url) as client:
        yield client


OPENING = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
CLOSING = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def test_created_and_streamed_give_the_same_greedy_answer_cut_at_max_output_tokens(client, tokenizer):
    asked = {
        "model": MODEL,
        "instructions": INSTRUCTIONS,
        "input": STORY,
        "max_output_tokens": 10,
        "temperature": 0,
    }
    whole = client.responses.create(**asked)
    events = list(client.responses.create(**asked, stream=True))

    assert whole.object == "response" and whole.id.startswith("resp_") and whole.store is False
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in whole.output] == ["message"] and whole.output[0].role == "assistant"
    assert [part.type for part in whole.output[0].content] == ["output_text"]
    names = [event.type for event in events]
    assert names[:4] == OPENING and names[-4:] == [*CLOSING, "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) == len(events) - 8 > 3  # it really streamed, in pieces
    assert "".join(deltas) == whole.output_text == events[-4].text == events[-1].response.output_text
    expected = template_tokens(
        tokenizer, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": STORY}]
    )
    for usage in (whole.usage, events[-1].response.usage):
        assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (expected, 10, expected + 10)
    assert events[0].response.status == "in_progress" and events[0].response.usage is None


def test_an_answer_that_ends_by_itself_is_completed(client):
    asked = {"model": MODEL, "input": SHORT, "max_output_tokens": 50, "temperature": 0}
    whole = client.responses.create(**asked)
    last = list(client.responses.create(**asked, stream=True))[-1]
    assert whole.status == "completed" and whole.incomplete_details is None
    assert last.type == "response.completed" and last.response.output_text == whole.output_text
    assert 0 < whole.usage.output_tokens < 50


def test_input_items_go_through_the_chat_template_as_messages(client, tokenizer):
    items = [
        {"role": "developer", "content": "Answer briefly."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello. How can I help?"}]},
        {"role": "user", "content": "Name a colour."},
    ]
    response = client.responses.create(model=MODEL, input=items, max_output_tokens=1)
    as_messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Name a colour."},
    ]
    assert response.usage.input_tokens == template_tokens(tokenizer, as_messages)


ASKS_FOR_MORE = {
    "store": {"store": True},
    "previous_response_id": {"previous_response_id": "resp_0123"},
    "tools[0].type": {"tools": [{"type": "web_search"}]},
    "reasoning": {"reasoning": {"effort": "high"}},  # the mock writes no thoughts
    "reasoning.summary": {"reasoning": {"effort": "none", "summary": "detailed"}},
    "text.format.type": {"text": {"format": {"type": "grammar"}}},
    "include": {"include": ["message.output_text.logprobs"]},
    "input[0].content[1]": {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {"type": "input_image", "image_url": "https://example.com/a.png"},
                ],
            }
        ]
    },
    "input[1].type": {
        "input": [
            {"role": "user", "content": "What is 2 + 2?"},
            {"type": "item_reference", "id": "rs_0123"},
        ]
    },
    "temperature": {"temperature": 2.5},
    "max_output_tokens": {"max_output_tokens": 0},
    "input[0].arguments": {  # nested past Python's recursion limit: once a 500
        "input": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "[" * 100_000},
            {"type": "function_call_output", "call_id": "c1", "output": "x"},
        ]
    },
}


@pytest.mark.parametrize("param", list(ASKS_FOR_MORE))
def test_what_is_not_built_or_out_of_range_is_a_400_naming_it(mock_client, param):
    asked = {"model": "mock", "input": "hi", "max_output_tokens": 4, **ASKS_FOR_MORE[param]}
    with pytest.raises(openai.BadRequestError) as refused:
        mock_client.responses.create(**asked)
    assert refused.value.status_code == 400 and refused.value.param == param
    assert refused.value.type == "invalid_request_error"


def test_nothing_is_stored_so_the_refusals_say_so(mock_client):
    with pytest.raises(openai.BadRequestError) as stored:
        mock_client.responses.create(model="mock", input="hi", store=True)
    with pytest.raises(openai.BadRequestError) as continued:
        mock_client.responses.create(model="mock", input="hi", previous_response_id="resp_0123")
    for refused in (stored, continued):
        assert "keeps no responses" in refused.value.message
    answered = mock_client.responses.create(model="mock", input="hi", max_output_tokens=2, store=False)
    assert answered.store is False and answered.output_text
