"""Cohere's answers (inference_api/cohere_tool_calls.py, reasoning.COHERE_TAGS): found in Command R7B's
template where the tokenizer has the tags, actions read back whole, several or cut by max_tokens, the
plan apart from the response, and the grammars of `auto` and `none` holding answers to the tags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference_api import cohere_tool_calls as cohere
from inference_api.cohere_tool_calls import TAGS, ActionTags, read_calls
from inference_api.reasoning import COHERE_TAGS, COHERE_THOUGHTS, ReasoningReader, reasoning_format
from inference_api.tokenizer import ByteTokenizer, ModelTokenizer
from inference_api.tool_calls import ToolRequest, tool_parser
from tests.backend.models import byte_tokenizer
from tests.frontend.test_tool_calls import FORECAST_TOOLS, follows_in, read

TEMPLATE = (
    Path(__file__).parent / "chat_templates/CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja"
).read_text()
TOKENIZER = byte_tokenizer((*TAGS, "<|END_OF_TURN_TOKEN|>"))
TAG_IDS = ActionTags(*TOKENIZER.convert_tokens_to_ids(list(TAGS)))


def actions(*calls: dict) -> str:
    listed = ",\n    ".join(
        json.dumps({"tool_call_id": str(i), "tool_name": call["name"], "parameters": call["arguments"]})
        for i, call in enumerate(calls)
    )
    return f"<|START_ACTION|>[\n    {listed}\n]<|END_ACTION|>"


FORECAST = {"name": "get_forecast", "arguments": {"city": "Oslo", "days": 2}}
TIME = {"name": "get_time", "arguments": {}}


def test_the_format_and_the_plans_are_read_from_command_r7bs_template_where_the_tokenizer_has_the_tags(
    tmp_path,
):
    TOKENIZER.save_pretrained(tmp_path)
    tokenizer = ModelTokenizer(str(tmp_path))
    assert tool_parser(TEMPLATE, False, tokenizer) == "cohere_command4"
    assert reasoning_format("auto", tokenizer, TEMPLATE) == COHERE_THOUGHTS
    assert ActionTags.of(tokenizer) == TAG_IDS
    assert tool_parser(TEMPLATE, False, ByteTokenizer()) == "hermes"  # the tags spelled out
    assert reasoning_format("auto", ByteTokenizer(), TEMPLATE) is None


def test_actions_are_read_back_whole_several_or_cut():
    assert read_calls(actions(FORECAST, TIME)) == [
        ("get_forecast", '{"city": "Oslo", "days": 2}'),
        ("get_time", "{}"),
    ]
    cut = actions(FORECAST).split('"days"')[0]
    assert read_calls(cut) == [("get_forecast", '{"city": "Oslo",')]  # as written, to the cut
    assert read_calls(actions(FORECAST).split('"tool_name"')[0]) is None  # cut before the name
    assert read_calls('<|START_ACTION|>[{"name": "get_time"}]<|END_ACTION|>') is None
    assert read_calls("<|START_ACTION|>[" + "[" * 5_000) is None


def test_the_plan_is_apart_from_the_response_whose_tags_go_as_it_streams():
    answer = "<|START_THINKING|>I know it.<|END_THINKING|><|START_RESPONSE|>Sunny.<|END_RESPONSE|>"
    reader = ReasoningReader(tags=COHERE_TAGS)
    pieces = [reader.feed(piece) for piece in answer.replace("|><|", "|>\0<|").split("\0")]
    rest = reader.finish()
    reasoning = "".join(piece[0] for piece in [*pieces, rest])
    content = "".join(piece[1] for piece in [*pieces, rest])
    assert (reasoning, content) == ("I know it.", "Sunny.")
    assert cohere.answer_text("<|START_RESPONSE|>Sunny.<|END_RESPONSE|>") == "Sunny."


def test_the_call_reader_takes_the_response_as_content_and_the_actions_as_calls():
    request = ToolRequest(FORECAST_TOOLS, "auto", parser="cohere_command4", call_tags=TAG_IDS)
    released, calls = read(request, ["<|START_RESPONSE|>", "Sunny.", "<|END_RESPONSE|>"])
    assert ("".join(released), calls) == ("Sunny.", [])
    released, calls = read(request, [actions(FORECAST)[:30], actions(FORECAST)[30:]])
    assert "".join(released) == "" and [call["function"]["name"] for call in calls] == ["get_forecast"]


@pytest.mark.parametrize(
    "answer, auto, none",
    [
        ("<|START_RESPONSE|>Sunny.<|END_RESPONSE|>", True, True),
        ("<|START_THINKING|>Easy.<|END_THINKING|><|START_RESPONSE|>Sunny.<|END_RESPONSE|>", True, True),
        (actions(FORECAST), True, False),
        ("<|START_THINKING|>Look it up.<|END_THINKING|>" + actions(FORECAST, TIME), True, False),
        ("Sunny.", False, False),  # text outside a response
        (actions({"name": "get_weather", "arguments": {}}), False, False),  # not one of the tools
        (actions({"name": "get_forecast", "arguments": {"days": 2}}), False, False),  # city required
    ],
)
def test_auto_takes_a_response_or_actions_and_none_a_response(answer, auto, none):
    request = ToolRequest(FORECAST_TOOLS, "auto", parser="cohere_command4", call_tags=TAG_IDS)
    grammar = request.grammar
    assert follows_in(TOKENIZER, grammar, answer) == auto
    none_grammar = ToolRequest(FORECAST_TOOLS, "none", parser="cohere_command4", call_tags=TAG_IDS).grammar
    assert follows_in(TOKENIZER, none_grammar, answer) == none


def test_one_action_only_without_parallel_calls():
    request = ToolRequest(FORECAST_TOOLS, "auto", parser="cohere_command4", parallel=False, call_tags=TAG_IDS)
    assert follows_in(TOKENIZER, request.grammar, actions(FORECAST))
    assert not follows_in(TOKENIZER, request.grammar, actions(FORECAST, TIME))
