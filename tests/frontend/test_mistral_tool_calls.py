"""Mistral's tool calls (inference_api/mistral_tool_calls.py): found where the template writes its
`[TOOL_CALLS]` token and the tokenizer has it, read in both of its tokenizers' layouts, held to the tools
by a grammar that names its tags by id (through llguidance, with a tokenizer that has them as special
tokens), and histories' call ids made as Mistral's templates take them. Granite 3's calls, the same list
after its `<|tool_call|>` token."""

import json
from pathlib import Path

import llguidance.hf
import pytest

from backend.messages import SamplingParams
from inference_api.mistral_tool_calls import (
    ARGS,
    GRANITE_OPEN,
    OPEN,
    CallTags,
    history_id,
    history_ids,
    is_mistral_id,
)
from inference_api.tokenizer import ByteTokenizer, ModelTokenizer
from inference_api.tool_calls import (
    ToolCallReader,
    ToolRequest,
    template_messages,
    tool_parser,
    with_tool_grammar,
)
from tests.backend.models import byte_tokenizer
from tests.frontend.test_tool_calls import FORECAST_TOOLS

# Mistral's tags as special tokens (v11 and later have [ARGS] and [CALL_ID]), the EOS last
NAMED_TOKENS = (
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    OPEN,
    ARGS,
    "[CALL_ID]",
    "</s>",
)
LISTED_TOKENS = ("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", OPEN, "</s>")


def tags(special_tokens: tuple[str, ...]) -> CallTags:
    tokenizer = byte_tokenizer(special_tokens)
    args = tokenizer.convert_tokens_to_ids(ARGS) if ARGS in special_tokens else None
    return CallTags(OPEN, tokenizer.convert_tokens_to_ids(OPEN), args)


NAMED = ToolRequest(FORECAST_TOOLS, "auto", parser="mistral", call_tags=tags(NAMED_TOKENS))
LISTED = ToolRequest(FORECAST_TOOLS, "auto", parser="mistral", call_tags=tags(LISTED_TOKENS))


def follows(grammar: str, text: str, special_tokens: tuple[str, ...]) -> bool:
    """Whether the grammar takes `text` whole, in a tokenizer whose Mistral tags are special tokens."""
    tokenizer = byte_tokenizer(special_tokens)
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer), grammar)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def read(request: ToolRequest, pieces: list[str]) -> tuple[str, list[dict]]:
    """The content the answer released, and its calls."""
    reader = ToolCallReader(request)
    released = "".join(reader.feed(piece) for piece in pieces)
    rest, calls = reader.finish()
    return released + rest, calls


def saved(special_tokens: tuple[str, ...], directory: Path) -> ModelTokenizer:
    byte_tokenizer(special_tokens).save_pretrained(directory)
    return ModelTokenizer(str(directory))


def test_the_format_is_found_where_the_template_writes_its_token_and_the_tokenizer_has_it(tmp_path):
    template = "{{- '[TOOL_CALLS]' + tool_call.function.name + '[ARGS]' + arguments }}"
    named = saved(NAMED_TOKENS, tmp_path / "named")
    assert tool_parser(template, False, named) == "mistral"
    assert CallTags.of(named) == CallTags(OPEN, named.special_token_id(OPEN), named.special_token_id(ARGS))
    assert CallTags.of(named).named_calls
    listed = CallTags.of(saved(LISTED_TOKENS, tmp_path / "listed"))
    assert listed is not None and not listed.named_calls
    assert tool_parser(template, False, ByteTokenizer()) == "hermes"  # the tag spelled out: not Mistral's
    assert CallTags.of(ByteTokenizer()) is None


def test_named_calls_v11_and_later_are_read_and_held_to_the_tools():
    forecast = OPEN + "get_forecast" + ARGS + '{"city": "Paris", "days": 2}'
    content, [call] = read(
        NAMED, ["Let me look. [TOOL", "_CALLS]get_forecast[ARGS]", '{"city": "Paris", "days": 2}']
    )
    assert content == "Let me look. "
    assert call["function"]["name"] == "get_forecast"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}
    assert is_mistral_id(call["id"])  # as Mistral's templates take it back
    _, calls = read(NAMED, [forecast + OPEN + "get_time" + ARGS + "{}"])
    assert [call["function"]["name"] for call in calls] == ["get_forecast", "get_time"]
    _, [with_id] = read(NAMED, [OPEN + "get_time[CALL_ID]a1b2c3d4e[ARGS]{}"])  # as a history writes it
    assert with_id["function"]["name"] == "get_time"

    grammar = NAMED.grammar
    assert follows(grammar, "It is sunny, [often].", NAMED_TOKENS)
    assert follows(grammar, "Let me look. " + forecast, NAMED_TOKENS)
    assert follows(grammar, forecast + OPEN + "get_time" + ARGS + "{}", NAMED_TOKENS)
    assert not follows(grammar, OPEN + "get_date" + ARGS + "{}", NAMED_TOKENS)  # not a tool
    assert not follows(grammar, OPEN + "get_forecast" + ARGS + '{"city": "Paris"}', NAMED_TOKENS)  # days
    assert not follows(grammar, forecast + " and text after", NAMED_TOKENS)
    assert not follows(grammar, OPEN + "get_forecast" + ARGS + '{"city": ', NAMED_TOKENS)  # left open
    single = ToolRequest(FORECAST_TOOLS, "auto", parser="mistral", parallel=False, call_tags=NAMED.call_tags)
    assert follows(single.grammar, forecast, NAMED_TOKENS)
    assert not follows(single.grammar, forecast + OPEN + "get_time" + ARGS + "{}", NAMED_TOKENS)


def test_listed_calls_before_v11_are_read_and_held_to_the_tools():
    forecast = '{"name": "get_forecast", "arguments": {"city": "Oslo", "days": 1}}'
    time = '{"name": "get_time", "arguments": {}}'
    content, calls = read(LISTED, ["Sure.", OPEN + " [" + forecast + ", " + time + "]"])
    assert content == "Sure."
    assert [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls] == [
        ("get_forecast", {"city": "Oslo", "days": 1}),
        ("get_time", {}),
    ]
    grammar = LISTED.grammar
    assert follows(grammar, "No call needed.", LISTED_TOKENS)
    assert follows(grammar, OPEN + " [" + forecast + ", " + time + "]", LISTED_TOKENS)
    assert follows(grammar, OPEN + "[" + time + "]", LISTED_TOKENS)
    assert not follows(grammar, OPEN + " [" + time.replace("get_time", "get_date") + "]", LISTED_TOKENS)
    assert not follows(
        grammar, OPEN + " [" + forecast.replace('"days": 1', '"days": "one"') + "]", LISTED_TOKENS
    )
    assert not follows(grammar, OPEN + " " + time, LISTED_TOKENS)  # not a list


def test_a_call_cut_by_max_tokens_keeps_what_was_written():
    _, [named] = read(NAMED, [OPEN + "get_forecast" + ARGS + '{"city": "Par'])
    assert (named["function"]["name"], named["function"]["arguments"]) == ("get_forecast", '{"city": "Par')
    cut = OPEN + ' [{"name": "get_time", "arguments": {}}, {"name": "get_forecast", "arguments": {"ci'
    _, listed = read(LISTED, [cut])
    assert [call["function"]["name"] for call in listed] == ["get_time", "get_forecast"]
    assert listed[1]["function"]["arguments"] == '{"ci'
    content, calls = read(NAMED, ["Sure. " + OPEN + "get_fore"])  # cut before its arguments: no call
    assert calls == [] and content == "Sure. " + OPEN + "get_fore"


def test_an_answer_that_may_call_keeps_the_tags_and_one_that_may_not_cannot_write_them():
    params = with_tool_grammar(SamplingParams(), NAMED, "response_format")
    assert params.skip_special_tokens is False and params.grammar == NAMED.grammar
    none = ToolRequest(FORECAST_TOOLS, "none", parser="mistral", call_tags=NAMED.call_tags)
    params = with_tool_grammar(SamplingParams(), none, "response_format")
    assert params.skip_special_tokens is True
    assert follows(params.grammar, "Just text.", NAMED_TOKENS)
    assert not follows(params.grammar, "Just text." + OPEN + "get_time" + ARGS + "{}", NAMED_TOKENS)


@pytest.mark.parametrize(
    "call_id", ["call_9f8e7d6c5b4a39281706f5e4", "toolu_01A09q90qw90lq917835lq9", "a-b", "é12345678"]
)
def test_another_servers_call_ids_become_nine_letters_and_digits_the_same_for_the_call_and_its_result(
    call_id,
):
    made = history_id(call_id)
    assert is_mistral_id(made) and history_id(call_id) == made and history_id("other") != made
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": call_id, "type": "function", "function": {}}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "Sunny"},
    ]
    shaped = history_ids(messages)
    assert shaped[1]["tool_calls"][0]["id"] == shaped[2]["tool_call_id"] == made
    assert messages[2]["tool_call_id"] == call_id  # the request's own messages are left as they were
    assert history_id("a1b2c3d4e") == "a1b2c3d4e"  # one of Mistral's own: kept
    assert template_messages(messages, "tool_calls", "mistral")[2]["tool_call_id"] == made
    assert template_messages(messages, "tool_calls", "hermes")[2]["tool_call_id"] == call_id


GRANITE_TOKENS = ("<|start_of_role|>", "<|end_of_role|>", GRANITE_OPEN, "<|end_of_text|>")


def test_granite_3s_calls_are_the_list_after_its_own_token(tmp_path):
    template = "{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' + message.content }}"
    tokenizer = saved(GRANITE_TOKENS, tmp_path)
    assert tool_parser(template, False, tokenizer) == "granite"
    assert tool_parser(template, False, ByteTokenizer()) == "hermes"  # the tag spelled out: not Granite's
    tags = CallTags.of(tokenizer, GRANITE_OPEN)
    assert tags == CallTags(GRANITE_OPEN, tokenizer.special_token_id(GRANITE_OPEN)) and not tags.named_calls
    granite = ToolRequest(FORECAST_TOOLS, "auto", parser="granite", call_tags=tags)
    time = '{"name": "get_time", "arguments": {}}'
    content, [call] = read(granite, ["Sure.", GRANITE_OPEN + "[" + time + "]"])
    assert content == "Sure." and call["function"]["name"] == "get_time"
    assert call["id"].startswith("call_")  # Granite's templates take any id
    assert follows(granite.grammar, GRANITE_OPEN + "[" + time + "]", GRANITE_TOKENS)
    assert follows(granite.grammar, "No call needed.", GRANITE_TOKENS)
    assert not follows(
        granite.grammar, GRANITE_OPEN + '[{"name": "get_date", "arguments": {}}]', GRANITE_TOKENS
    )
    assert not follows(granite.grammar, GRANITE_OPEN + "[" + time + "] and text after", GRANITE_TOKENS)
    params = with_tool_grammar(SamplingParams(), granite, "response_format")
    assert params.skip_special_tokens is False
