"""Tool calls as a JSON list between two tags (inference_api/listed_tool_calls.py): Jamba's and Hunyuan's
`<tool_calls>`, Nemotron Nano 2's `<TOOLCALL>`, found in a template that writes them where the tokenizer
has the tags, read back whole, several, or cut by max_tokens, and held to the tools by `auto`'s grammar."""

from __future__ import annotations

import json

import pytest

from inference_api.listed_tool_calls import LISTS, ListTags
from inference_api.tokenizer import ByteTokenizer, ModelTokenizer
from inference_api.tool_calls import ToolRequest, tool_parser
from tests.backend.models import byte_tokenizer
from tests.frontend.test_tool_calls import FORECAST_TOOLS, follows_in, read

TAGS = tuple(tag for tags in LISTS.values() for tag in tags)
TOKENIZER = byte_tokenizer((*TAGS, "<|endoftext|>"))
FORMATS = sorted(LISTS)


def request(parser: str, parallel: bool = True) -> ToolRequest:
    ids = (TOKENIZER.convert_tokens_to_ids(tag) for tag in LISTS[parser])
    tags = ListTags(*LISTS[parser], *ids)
    return ToolRequest(FORECAST_TOOLS, "auto", parser=parser, parallel=parallel, call_tags=tags)


def follows(grammar: str, text: str) -> bool:
    return follows_in(TOKENIZER, grammar, text)


def listed(parser: str, *calls: dict) -> str:
    opening, closing = LISTS[parser]
    return opening + "[" + ", ".join(json.dumps(call) for call in calls) + "]" + closing


FORECAST = {"name": "get_forecast", "arguments": {"city": "Oslo", "days": 2}}
TIME = {"name": "get_time", "arguments": {}}


@pytest.mark.parametrize("parser", FORMATS)
def test_the_format_is_read_from_the_template_where_the_tokenizer_has_the_tags(parser, tmp_path):
    TOKENIZER.save_pretrained(tmp_path)
    tokenizer = ModelTokenizer(str(tmp_path))
    template = "{{- '" + LISTS[parser][0] + "' + message.tool_calls | tojson + '" + LISTS[parser][1] + "' }}"
    assert tool_parser(template, False, tokenizer) == parser
    assert tool_parser(template, False, ByteTokenizer()) == "hermes"  # its tags spelled out
    assert ListTags.of(tokenizer, parser) == request(parser).call_tags


@pytest.mark.parametrize("parser", FORMATS)
def test_calls_stream_after_text_and_are_read_back_whole_or_cut(parser):
    answer = "Let me look." + listed(parser, FORECAST, TIME)
    released, calls = read(request(parser), [answer[:14], answer[14:]])
    assert "".join(released) == "Let me look."
    read_back = [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls]
    assert read_back == [("get_forecast", FORECAST["arguments"]), ("get_time", {})]
    cut = listed(parser, FORECAST).split('"days"')[0]
    _, [forecast] = read(request(parser), [cut])
    assert forecast["function"]["name"] == "get_forecast"
    assert forecast["function"]["arguments"].startswith('{"city": "Oslo"')


@pytest.mark.parametrize("parser", FORMATS)
def test_auto_is_text_or_text_then_a_list_of_calls_of_the_tools(parser):
    grammar = request(parser).grammar
    assert follows(grammar, "It is sunny in [Oslo].")
    assert follows(grammar, "Let me look.\n" + listed(parser, FORECAST))
    assert follows(grammar, listed(parser, FORECAST, TIME))
    assert not follows(grammar, listed(parser, {"name": "get_date", "arguments": {}}))
    assert not follows(grammar, listed(parser, {"name": "get_forecast", "arguments": {"city": "Oslo"}}))
    assert not follows(grammar, listed(parser, FORECAST) + " Done.")
    assert not follows(request(parser, parallel=False).grammar, listed(parser, FORECAST, TIME))


def test_phi4_minis_template_which_takes_the_tools_in_the_system_message_is_read_as_its_format(tmp_path):
    """Phi-4-mini's own template writes no tag: it reads the system message's `tools`. Granite 3's
    `<|tool_call|>` opens Phi-4-mini's calls too: a tokenizer without `<|/tool_call|>` is Granite's."""
    phi = "{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] }}"
    TOKENIZER.save_pretrained(tmp_path / "phi")
    assert tool_parser(phi, False, ModelTokenizer(str(tmp_path / "phi"))) == "phi4_mini"
    assert tool_parser(phi, False, ByteTokenizer()) == "hermes"
    byte_tokenizer(("<|tool_call|>", "<|endoftext|>")).save_pretrained(tmp_path / "granite")
    granite = "{{- '<|tool_call|>' + message.tool_calls | tojson }}"
    assert tool_parser(granite, False, ModelTokenizer(str(tmp_path / "granite"))) == "granite"
