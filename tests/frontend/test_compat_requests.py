"""Anthropic's, the Responses API's and Llama Stack's requests parsed without a server (the mock's byte
tokenizer and plain `role: content` template), and the stop matcher that names the stop sequence."""

from __future__ import annotations

import pytest

from backend.engine.stop_matcher import StopMatcher
from backend.messages import BackendReady, InvalidParams
from inference_api.apis.anthropic.request import parse_messages_request
from inference_api.apis.llama_stack.request import parse_chat_completion, parse_completion
from inference_api.apis.responses.request import parse_responses_request
from inference_api.chat_template import load_chat_template
from inference_api.router import Serving
from inference_api.tokenizer import ByteTokenizer

SERVING = Serving(
    BackendReady("mock", rows=2, max_seq_len=512, tokenizer_path=None, device="cpu", dtype="-"),
    ByteTokenizer(),
    load_chat_template(None),
)


def prompt(ids: list[int]) -> str:
    return bytes(ids).decode()


def test_the_stop_sequence_named_is_the_one_that_cut_the_text_across_pieces():
    matcher = StopMatcher(("lazy dog", "brown"))
    released = [matcher.feed(piece) for piece in ("The quick br", "o", "wn fox")]
    assert released == ["The quick ", "", ""] and matcher.stopped and matcher.matched == "brown"
    first_of_two = StopMatcher(("ab", "abc"))  # both start where the text is cut: the first listed
    assert first_of_two.feed("xxabc") == "xx" and first_of_two.matched == "ab"
    never = StopMatcher(("zz",))
    assert never.feed("buzz") == "bu" and never.matched == "zz"


def test_messages_put_the_system_first_and_a_last_assistant_message_after_the_generation_prompt():
    parsed = parse_messages_request(
        {
            "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}],
                },
                {"role": "assistant", "content": "Hello, I am"},
            ],
            "max_tokens": "7",
            "stop_sequences": ["\n\n", "<|im_end|>"],
            "top_k": 5,
        },
        SERVING,
    )
    assert prompt(parsed.prompt_ids) == "system: Be brief.\nuser: Hi\nassistant:Hello, I am"
    assert (parsed.params.max_tokens, parsed.params.top_k, parsed.params.temperature) == (7, 5, 1.0)
    assert parsed.params.stop == ("\n\n", "<|im_end|>") and not parsed.stream


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 600}, "max_tokens"),  # over the context
        ({"max_tokens": 500}, "messages"),  # fits the context, but not with the prompt
        ({"temperature": 1.01}, "temperature"),
        ({"system": [{"type": "image"}]}, "system[0]"),
        ({"messages": []}, "messages"),
    ],
)
def test_messages_errors_name_the_field(fields, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    with pytest.raises(InvalidParams) as failure:
        parse_messages_request(body, SERVING)
    assert failure.value.param == param


def test_responses_put_the_instructions_first_and_a_string_input_as_the_user():
    parsed = parse_responses_request({"instructions": "Be brief.", "input": "Hi"}, SERVING)
    assert prompt(parsed.prompt_ids) == "system: Be brief.\nuser: Hi\nassistant:"
    # Without max_output_tokens, the chat default, as far as the context leaves room after the prompt.
    assert parsed.params.max_tokens == 512 - len(parsed.prompt_ids)
    assert parsed.echoed["instructions"] == "Be brief." and parsed.echoed["max_output_tokens"] is None


@pytest.mark.parametrize(
    "sampling, expected",
    [
        (None, (0.0, 1.0, 0)),  # greedy by default
        ({"strategy": {"type": "top_p", "temperature": 0.7}}, (0.7, 0.95, 0)),  # Llama Stack's default top_p
        ({"strategy": {"type": "top_k", "top_k": 3}}, (1.0, 1.0, 3)),
        ({"strategy": "top_p", "temperature": 0.5, "top_p": 0.8}, (0.5, 0.8, 0)),  # its first releases' form
    ],
)
def test_the_llama_stack_strategies(sampling, expected):
    parsed = parse_completion({"content": "Hi", "sampling_params": sampling}, SERVING)
    assert (parsed.params.temperature, parsed.params.top_p, parsed.params.top_k) == expected
    assert (
        prompt(parsed.prompt_ids) == "Hi" and parsed.params.max_tokens == 512 - 2
    )  # max_tokens 0: the default


def test_llama_stack_content_may_be_one_item_or_a_list_and_errors_name_nested_fields():
    one = [{"role": "user", "content": {"type": "text", "text": "Hi"}}]
    listed = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]
    assert parse_chat_completion({"messages": one}, SERVING) == parse_chat_completion(
        {"messages": listed}, SERVING
    )
    with pytest.raises(InvalidParams) as failure:
        parse_completion(
            {"content": "Hi", "sampling_params": {"strategy": {"type": "top_k", "top_k": 0}}}, SERVING
        )
    assert failure.value.param == "sampling_params.strategy.top_k"
    assert str(failure.value).startswith("sampling_params.strategy.top_k must be an integer from 1")
