"""DeepSeek's tool calls (inference_api/deepseek_tool_calls.py): found in a template that writes them where
the tokenizer has their tags, read back in both layouts, whole, several, or cut by max_tokens, and held to
the tools by the `auto` grammar; a call's arguments reach a template that adds them to
text as their JSON."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest

from inference_api.chat_template import ChatTemplate
from inference_api.deepseek_tool_calls import TAGS, V3, V31, DeepSeekTags
from inference_api.tokenizer import ByteTokenizer, ModelTokenizer
from inference_api.tool_calls import ToolRequest, read_tool_calls, template_messages, tool_parser
from tests.backend.models import byte_tokenizer
from tests.frontend.test_tool_calls import follows_in, read
from tests.openai.test_deepseek_format import SPECIAL_TOKENS, THOUGHT_TAGS

TOKENIZER = byte_tokenizer(SPECIAL_TOKENS, THOUGHT_TAGS)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def v31_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{arguments}{CALL_END}"


def v3_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def request(parser: str, parallel: bool = True) -> ToolRequest:
    tags = DeepSeekTags(*(TOKENIZER.convert_tokens_to_ids(tag) for tag in TAGS), fenced=parser == V3)
    return ToolRequest([WEATHER, TIME], "auto", parser=parser, parallel=parallel, call_tags=tags)


def follows(grammar: str, text: str) -> bool:
    return follows_in(TOKENIZER, grammar, text)


def test_the_layout_is_read_from_the_template_where_the_tokenizer_has_the_tags(tmp_path):
    TOKENIZER.save_pretrained(tmp_path)
    tokenizer = ModelTokenizer(str(tmp_path))
    v31 = "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>'}}"
    v3 = "{{'<｜tool▁calls▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n' + '```json'}}"
    assert tool_parser(v31, False, tokenizer) == V31
    assert tool_parser(v3, False, tokenizer) == V3
    assert tool_parser(v31, False, ByteTokenizer()) == "hermes"  # its tags spelled out: not DeepSeek's
    assert DeepSeekTags.of(tokenizer, V3) == request(V3).call_tags
    assert DeepSeekTags.of(ByteTokenizer(), V31) is None


@pytest.mark.parametrize("parser, call", [(V31, v31_call), (V3, v3_call)])
def test_text_streams_until_the_calls_which_are_read_back(parser, call):
    answer = "Let me look." + CALLS_BEGIN + call("get_weather", '{"city": "Oslo"}')
    answer += call("get_time", "{}") + CALLS_END
    released, calls = read(request(parser), [answer[:14], answer[14:40], answer[40:]])
    assert "".join(released) == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]


@pytest.mark.parametrize("parser, call", [(V31, v31_call), (V3, v3_call)])
def test_a_call_cut_by_max_tokens_keeps_what_was_written_of_its_arguments(parser, call):
    cut = (CALLS_BEGIN + call("get_weather", '{"city": "Oslo"}')).split("slo")[0]
    _, [weather] = read(request(parser), [cut])
    assert weather["function"] == {"name": "get_weather", "arguments": '{"city": "O'}


def test_a_call_cut_in_v3s_closing_fence_has_its_whole_arguments():
    cut = (CALLS_BEGIN + v3_call("get_weather", '{"city": "Oslo"}')).removesuffix("`" + CALL_END)
    _, [weather] = read(request(V3), [cut])
    assert json.loads(weather["function"]["arguments"]) == {"city": "Oslo"}


def test_calls_that_do_not_read_are_text():
    answer = CALLS_BEGIN + CALL_BEGIN + "get_weather" + CALL_END + CALLS_END  # no separator
    released, calls = read(request(V31), [answer])
    assert "".join(released) == answer and calls == []


@pytest.mark.parametrize("parser, call", [(V31, v31_call), (V3, v3_call)])
def test_auto_is_text_or_text_then_whole_calls_of_the_tools(parser, call):
    grammar = request(parser).grammar
    weather = call("get_weather", '{"city": "Oslo", "days": 2}')
    between = "\n" if parser == V3 else ""  # V3's templates put a line break between two calls
    assert follows(grammar, "It is sunny in <b>Oslo</b>.")
    assert follows(grammar, "Let me look.\n" + CALLS_BEGIN + weather + CALLS_END)
    assert follows(grammar, CALLS_BEGIN + weather + between + call("get_time", "{}") + CALLS_END)
    assert not follows(grammar, CALLS_BEGIN + call("get_date", "{}") + CALLS_END)  # not a tool
    assert not follows(grammar, CALLS_BEGIN + call("get_weather", '{"days": 2}') + CALLS_END)  # city
    assert not follows(grammar, CALLS_BEGIN + weather + CALLS_END + " Done.")  # nothing after the calls
    one = request(parser, parallel=False).grammar
    assert follows(one, CALLS_BEGIN + weather + CALLS_END)
    assert not follows(one, CALLS_BEGIN + weather + between + weather + CALLS_END)


def test_the_opening_tag_cannot_be_spelled_out_in_the_text():
    """Where a tokenizer does not mark the tags special, text could hold them, and a call in it would
    escape the grammar: the text may not spell the opening tag, in any tokens."""
    spelled = "a" + CALLS_BEGIN
    grammar = request(V31).grammar
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(TOKENIZER), grammar)
    by_bytes = byte_tokenizer(("<|endoftext|>",)).encode(spelled, add_special_tokens=False)
    assert len(by_bytes) > 2 and matcher.try_consume_tokens(by_bytes) < len(by_bytes)
    assert not follows(ToolRequest([WEATHER], "none", parser=V31).grammar, spelled)


def test_arguments_reach_a_template_as_an_object_and_added_to_text_as_their_json():
    [call] = read_tool_calls(
        [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Zürich"}'}}], "x"
    )
    source = (
        "{% for m in messages %}{% for c in m.tool_calls %}{% set a = c.function.arguments %}"
        "{{ '[' + a + ']' }}|{{ a | tojson }}|{{ a }}|{{ a.city }}|{{ a + '!' }}{% endfor %}{% endfor %}"
    )
    turns = template_messages([{"role": "assistant", "content": "", "tool_calls": [call]}], source)
    rendered = ChatTemplate(source).render(turns, False)
    assert rendered == '[{"city": "Zürich"}]|{"city": "Zürich"}|{"city": "Zürich"}|Zürich|{"city": "Zürich"}!'
