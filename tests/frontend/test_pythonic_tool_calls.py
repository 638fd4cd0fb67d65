"""LFM2's Python calls (inference_api/pythonic_tool_calls.py): found in a template that writes them where
the tokenizer has their tags, read back with Python's parser (literals only, JSON's constants too), whole,
several, or cut by max_tokens, and held to the tools by the `auto` grammar; and vLLM's `pythonic` format,
the same list as the whole answer with no tags."""

from __future__ import annotations

import json

import pytest

from inference_api.pythonic_tool_calls import CLOSE, OPEN, PythonicTags, read_calls, read_list
from inference_api.tokenizer import ByteTokenizer, ModelTokenizer
from inference_api.tool_calls import ToolRequest, tool_parser
from tests.backend.models import byte_tokenizer
from tests.frontend.test_tool_calls import follows_in, read

TOKENIZER = byte_tokenizer(("<|im_start|>", OPEN, CLOSE, "<|endoftext|>"))
FORECAST = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "hourly": {"type": "boolean"},
                "options": {"type": "object"},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def request(parallel: bool = True) -> ToolRequest:
    tags = PythonicTags(TOKENIZER.convert_tokens_to_ids(OPEN), TOKENIZER.convert_tokens_to_ids(CLOSE))
    return ToolRequest([FORECAST, TIME], "auto", parser="lfm2", parallel=parallel, call_tags=tags)


def follows(grammar: str, text: str) -> bool:
    return follows_in(TOKENIZER, grammar, text)


def test_the_format_is_read_from_the_template_where_the_tokenizer_has_the_tags(tmp_path):
    TOKENIZER.save_pretrained(tmp_path)
    template = '{{- "<|tool_call_start|>[" + calls | join(", ") + "]<|tool_call_end|>" }}'
    assert tool_parser(template, False, ModelTokenizer(str(tmp_path))) == "lfm2"
    assert tool_parser(template, False, ByteTokenizer()) == "hermes"  # its tags spelled out: not LFM2's
    assert PythonicTags.of(ModelTokenizer(str(tmp_path))) == request().call_tags


def test_calls_stream_after_text_and_are_read_as_python_literals():
    answer = f"Let me look.{OPEN}[get_forecast(city='São Paulo', days=3, options={{\"metric\": true}}), "
    answer += f'get_time(), get_forecast(city="Oslo", days=1, hourly=False)]{CLOSE}'
    released, calls = read(request(), [answer[:15], answer[15:50], answer[50:]])
    assert "".join(released) == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_forecast", {"city": "São Paulo", "days": 3, "options": {"metric": True}}),
        ("get_time", {}),
        ("get_forecast", {"city": "Oslo", "days": 1, "hourly": False}),
    ]


@pytest.mark.parametrize(
    "written, expected",
    [
        ("[get_forecast(city='Par", [("get_forecast", {"city": "Par"})]),  # cut in a string
        ("[get_forecast(city='Paris', da", [("get_forecast", {"city": "Paris"})]),  # cut in a keyword
        ("[get_time(), get_fore", [("get_time", {})]),  # a call cut in its name: left out
        ("[get_forecast(city=paris)]", None),  # a name is not a literal
        ("[get_forecast('Paris')]", None),  # no keyword
        ("[get_forecast(city={1, 2})]", None),  # a set, which JSON has not
        (
            "[get_forecast(city='\x00\r')",
            [("get_forecast", {"city": "\x00\r"})],
        ),  # which Python's parser refuses
        ("[", None),
        (
            "[get_forecast(city='Oslo', options={'a': [1",
            [("get_forecast", {"city": "Oslo", "options": {"a": [1]}})],
        ),
        ("[get_time()] and more", None),  # text after the list
    ],
)
def test_calls_cut_by_max_tokens_or_not_literals(written, expected):
    calls = read_calls(OPEN + written)
    got = None if calls is None else [(name, json.loads(arguments)) for name, arguments in calls]
    assert got == expected


def test_auto_is_text_or_text_then_calls_of_the_tools_with_their_parameters():
    grammar = request().grammar
    forecast = "get_forecast(city='Oslo', days=2, unit='celsius')"
    assert follows(grammar, "It is sunny in 'Oslo' (2 days).")
    assert follows(grammar, f"Let me look.{OPEN}[{forecast}]{CLOSE}")
    assert follows(grammar, f"{OPEN}[{forecast}, get_time()]{CLOSE}")
    everything = 'get_forecast(city="Oslo", days=7, hourly=True, options={"a": [1, None]})'
    assert follows(grammar, f"{OPEN}[{everything}]{CLOSE}")
    assert not follows(grammar, f"{OPEN}[get_date()]{CLOSE}")  # not a tool
    assert not follows(grammar, f"{OPEN}[get_forecast(city='Oslo')]{CLOSE}")  # days required
    assert not follows(grammar, f"{OPEN}[get_forecast(city='Oslo', days=9)]{CLOSE}")  # at most 7
    assert not follows(grammar, f"{OPEN}[get_forecast(days=2, city='Oslo')]{CLOSE}")  # the schema's order
    assert not follows(grammar, f"{OPEN}[get_forecast(city='Oslo', days=2, unit='kelvin')]{CLOSE}")
    assert not follows(request(parallel=False).grammar, f"{OPEN}[{forecast}, get_time()]{CLOSE}")


BARE = ToolRequest([FORECAST, TIME], "auto", parser="pythonic")


def test_bare_calls_are_the_whole_answer_and_an_answer_that_opens_no_list_is_text_at_once():
    answer = "  [get_forecast(city='Oslo', days=2, hourly=true), get_time()]"
    released, calls = read(BARE, [answer[:1], answer[1:3], answer[3:30], answer[30:]])
    assert "".join(released).strip() == ""  # the whitespace before the list, never the list
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_forecast", {"city": "Oslo", "days": 2, "hourly": True}),
        ("get_time", {}),
    ]
    released, calls = read(BARE, ["It is ", "[sunny] in Oslo."])  # text first: all of it text, at once
    assert released[:2] == ["It is ", "[sunny] in Oslo."] and calls == []
    released, calls = read(BARE, ["[sunny] in Oslo."])  # a list, but not of calls: text
    assert ("".join(released), calls) == ("[sunny] in Oslo.", [])
    assert [(name, json.loads(arguments)) for name, arguments in read_list("[get_forecast(city='Par")] == [
        ("get_forecast", {"city": "Par"})
    ]
    assert tool_parser("{{- tools | tojson }}", False, ByteTokenizer(), forced="pythonic") == "pythonic"


def test_bare_auto_is_text_that_opens_no_list_or_a_list_of_calls_of_the_tools():
    grammar = BARE.grammar
    forecast = "get_forecast(city='Oslo', days=2, unit='celsius')"
    assert follows(grammar, "It is sunny in 'Oslo' [2 days].")
    assert follows(grammar, f"[{forecast}]") and follows(grammar, f"\n[{forecast}, get_time()]")
    assert not follows(grammar, "[sunny]")  # an answer that opens a list is calls
    later = f"Let me look. [{forecast}]"  # calls are the whole answer: a list after text is text
    released, calls = read(BARE, [later])
    assert follows(grammar, later) and ("".join(released), calls) == (later, [])
    assert not follows(grammar, f"[{forecast}] Done.")
    assert not follows(grammar, "[get_date()]")  # not a tool
    assert not follows(grammar, "[get_forecast(city='Oslo', days=9)]")  # at most 7
    single = ToolRequest([FORECAST, TIME], "auto", parser="pythonic", parallel=False).grammar
    assert follows(single, f"[{forecast}]") and not follows(single, f"[{forecast}, get_time()]")


def test_names_that_are_no_python_names_are_written_and_read_back_as_the_grammar_has_them():
    """OpenAI's names take `-` and a leading digit, and a schema's properties any name (`from`, a Python
    keyword): the grammar writes them as they are, so the reader must read them so, not as Python."""
    tool = {
        "type": "function",
        "function": {
            "name": "get-user",
            "parameters": {
                "type": "object",
                "properties": {"user-id": {"type": "integer"}, "from": {"type": "string"}},
                "required": ["user-id", "from"],
            },
        },
    }
    tool["function"]["parameters"]["properties"]["first name"] = {"type": "string"}  # spaces too
    call = "[get-user(user-id=7, from='the team', first name='Ada')]"
    assert follows_in(TOKENIZER, ToolRequest([tool], "auto", parser="pythonic").grammar, call)
    for parser, answer in (("pythonic", call), ("lfm2", OPEN + call + CLOSE)):
        tags = request().call_tags if parser == "lfm2" else None
        _, [read_back] = read(ToolRequest([tool], "auto", parser=parser, call_tags=tags), [answer])
        assert read_back["function"]["name"] == "get-user"
        arguments = json.loads(read_back["function"]["arguments"])
        assert arguments == {"user-id": 7, "from": "the team", "first name": "Ada"}
