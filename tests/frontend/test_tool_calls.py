"""Reading tool calls out of an answer as it streams (inference_api/tool_calls.py), in each format."""

import json
from dataclasses import replace
from typing import Any

import pytest

from inference_api.tokenizer import ByteTokenizer
from inference_api.tool_calls import ToolCallReader, ToolRequest
from tests.frontend.test_structured_output import follows

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def read(request: ToolRequest, pieces: list[str]) -> tuple[list[str], list[dict]]:
    """What each piece released as content (the rest at the end), and the calls."""
    reader = ToolCallReader(request)
    released = [reader.feed(piece) for piece in pieces]
    rest, calls = reader.finish()
    return [*released, rest], calls


def test_hermes_text_streams_until_a_call_which_is_held_back_and_parsed():
    pieces = [
        "Let me check. <tool",
        '_call>{"name": "get_weather", ',
        '"arguments": {"city": "Paris"}}</tool_call>',
    ]
    released, [call] = read(ToolRequest(TOOLS, "auto"), pieces)
    assert "".join(released) == "Let me check. "
    assert released[1] == ""  # "<tool" might have begun a call: held back, then the call
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_a_held_back_start_that_is_not_a_call_is_sent_after_all():
    released, calls = read(ToolRequest(TOOLS, "auto"), ["a <to", "y> b"])
    assert released == ["a ", "<toy> b", ""] and calls == []


def test_a_call_that_does_not_parse_is_text():
    released, calls = read(ToolRequest(TOOLS, "auto"), ["<tool_call>{not json"])
    assert "".join(released) == "<tool_call>{not json" and calls == []


def test_llama3_json_is_a_call_only_when_the_answer_is_one():
    request = ToolRequest(TOOLS, "auto", parser="llama3_json")
    released, [call] = read(request, [' {"name": "get_weather",', ' "parameters": {"city": "Oslo"}}'])
    assert "".join(released) == " "
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    released, calls = read(request, ["The weather ", "is fine."])
    assert "".join(released) == "The weather is fine." and calls == []


def test_named_and_required_answers_are_the_call():
    _, [named] = read(ToolRequest(TOOLS, "function", "get_weather"), ['{"city": ', '"Rome"}'])
    assert named["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    _, [required] = read(
        ToolRequest(TOOLS, "required"), ['{"name": "get_weather", "arguments": {"city": "Rome"}}']
    )
    assert json.loads(required["function"]["arguments"]) == {"city": "Rome"}


def test_a_forced_call_cut_by_max_tokens_is_still_a_call_never_content():
    released, [named] = read(ToolRequest(TOOLS, "function", "get_weather"), ['{"city": "Ro'])
    assert "".join(released) == "" and named["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Ro',
    }
    cut = ['{"name": "get_weather", ', '"arguments": {"city": "Ro']
    released, [required] = read(ToolRequest(TOOLS, "required"), cut)
    assert "".join(released) == "" and required["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Ro',
    }
    released, calls = read(ToolRequest(TOOLS, "required"), ['{"na'])  # cut before a name: no call to make
    assert "".join(released) == '{"na' and calls == []


WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def test_auto_is_free_text_or_calls_and_a_started_call_must_be_one_of_the_tools():
    grammar = ToolRequest(WEATHER_TOOLS, "auto").grammar
    assert follows(grammar, "It is sunny in Paris, <b>often</b>.")
    assert follows(grammar, f"Let me check. <tool_call>{PARIS}</tool_call>")
    assert follows(grammar, f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>{PARIS}</tool_call>")
    assert not follows(grammar, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert not follows(grammar, '<tool_call>{"name": "get_weather", "arguments": {"city": "P", "x": 1}}')
    assert not follows(grammar, f"<tool_call>{PARIS}</tool_call> and some text after")
    assert not follows(grammar, f"<tool_call>{PARIS}")  # a call cannot be left open


def test_auto_without_parallel_calls_takes_one_call_and_the_reader_keeps_one():
    single = ToolRequest(WEATHER_TOOLS, "auto", parallel=False)
    assert follows(single.grammar, f"<tool_call>{PARIS}</tool_call>")
    assert not follows(single.grammar, f"<tool_call>{PARIS}</tool_call><tool_call>{PARIS}</tool_call>")
    _, calls = read(single, [f"<tool_call>{PARIS}</tool_call><tool_call>{PARIS}</tool_call>"])
    assert len(calls) == 1  # a format read without the grammar (with a response_format) keeps the first


def test_auto_in_llama3s_format_is_text_or_one_whole_call():
    grammar = ToolRequest(WEATHER_TOOLS, "auto", parser="llama3_json").grammar
    assert follows(grammar, "The weather is fine.")
    assert follows(grammar, '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert not follows(grammar, '{"name": "get_weather", "parameters": {"town": "Oslo"}}')
    assert not follows(grammar, "{ not a call")


def test_an_auto_call_cut_by_max_tokens_in_its_arguments_is_a_call_with_what_was_written():
    _, [call] = read(
        ToolRequest(WEATHER_TOOLS, "auto"), ['Sure. <tool_call>{"name": "get_weather", "arguments": {"ci']
    )
    assert call["function"]["name"] == "get_weather"
    released, calls = read(ToolRequest(WEATHER_TOOLS, "auto"), ['Sure. <tool_call>{"na'])
    assert calls == [] and "".join(released) == 'Sure. <tool_call>{"na'  # no name: nothing to call


def test_none_is_text_that_opens_no_call():
    grammar = ToolRequest(WEATHER_TOOLS, "none").grammar
    assert follows(grammar, "It is sunny in Paris.") and follows(grammar, "")
    assert not follows(grammar, f"Let me check. <tool_call>{PARIS}</tool_call>")


# Qwen3-Coder's and Qwen3.5's XML calls (xml_tool_calls.py): a string parameter as text, the others JSON
FORECAST_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_forecast",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                },
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]
XML = ToolRequest(FORECAST_TOOLS, "auto", parser="qwen3_coder")


def xml_call(function: str, **parameters: str) -> str:
    written = "".join(f"<parameter={name}>\n{value}\n</parameter>\n" for name, value in parameters.items())
    return f"<tool_call>\n<function={function}>\n{written}</function>\n</tool_call>"


def test_the_xml_format_is_found_in_a_template_that_writes_it():
    from inference_api.tool_calls import tool_parser

    template = "{{- '<tool_call>\\n<function=' + call.name + '>\\n' }}{{- '<parameter=' + name + '>' }}"
    assert tool_parser(template, False, ByteTokenizer()) == "qwen3_coder"
    assert tool_parser("{{- '<tool_call>\\n' + call | tojson }}", False, ByteTokenizer()) == "hermes"


def test_xml_calls_stream_after_text_and_read_each_value_as_its_schema_says():
    call = xml_call("get_forecast", city="San\nFrancisco", days="3", unit="celsius", hours="[9, 12]")
    pieces = [
        "Let me look. <tool",
        "_call>\n<function=get_forecast>",
        call.removeprefix("<tool_call>\n<function=get_forecast>"),
    ]
    released, [forecast] = read(XML, pieces)
    assert "".join(released) == "Let me look. " and released[1] == ""
    assert forecast["function"]["name"] == "get_forecast"
    arguments = json.loads(forecast["function"]["arguments"])
    assert arguments == {"city": "San\nFrancisco", "days": 3, "unit": "celsius", "hours": [9, 12]}
    _, calls = read(XML, [call + "\n" + xml_call("get_time")])
    assert [c["function"]["name"] for c in calls] == ["get_forecast", "get_time"]
    assert calls[1]["function"]["arguments"] == "{}"


def test_auto_in_the_xml_format_is_text_or_whole_calls_of_the_tools_with_their_required_parameters():
    grammar = XML.grammar
    assert follows(grammar, "It is sunny, <b>often</b>.")
    assert follows(grammar, "Let me look.\n" + xml_call("get_forecast", city="Paris", days="2"))
    assert follows(grammar, xml_call("get_forecast", city="Oslo\nNorway", days="1", unit="fahrenheit"))
    assert follows(grammar, xml_call("get_time") + "\n" + xml_call("get_time"))
    assert not follows(grammar, xml_call("get_date"))  # not a tool
    assert not follows(grammar, xml_call("get_forecast", city="Paris"))  # days is required
    assert not follows(grammar, xml_call("get_forecast", city="Paris", days="two"))  # an integer
    assert not follows(grammar, xml_call("get_forecast", city="Paris", days="2", unit="kelvin"))
    assert not follows(grammar, xml_call("get_time") + " and some text after")
    assert not follows(grammar, "<tool_call>\n<function=get_time>\n")  # a call cannot be left open
    single = ToolRequest(FORECAST_TOOLS, "auto", parser="qwen3_coder", parallel=False)
    assert not follows(single.grammar, xml_call("get_time") + xml_call("get_time"))
    assert not follows(
        ToolRequest(FORECAST_TOOLS, "none", parser="qwen3_coder").grammar, xml_call("get_time")
    )


def test_an_xml_call_cut_by_max_tokens_keeps_what_was_written_and_one_cut_before_its_name_is_text():
    _, [cut] = read(XML, ["<tool_call>\n<function=get_forecast>\n<parameter=city>\nPar"])
    assert cut["function"]["name"] == "get_forecast" and json.loads(cut["function"]["arguments"]) == {
        "city": "Par"
    }
    released, calls = read(XML, ["Sure. <tool_call>\n<func"])
    assert calls == [] and "".join(released) == "Sure. <tool_call>\n<func"


GLM = ToolRequest(FORECAST_TOOLS, "auto", parser="glm45")


def glm_call(function: str, **parameters: str) -> str:
    written = "".join(
        f"<arg_key>{name}</arg_key>\n<arg_value>{value}</arg_value>\n" for name, value in parameters.items()
    )
    return f"<tool_call>{function}\n{written}</tool_call>"


def test_glm_4_5s_xml_calls_are_found_in_its_template_read_and_held_to_the_tools():
    from inference_api.tool_calls import tool_parser

    template = "{{- '<tool_call>' + name }}{{- '<arg_key>' + key + '</arg_key>\\n<arg_value>' }}"
    assert tool_parser(template, False, ByteTokenizer()) == "glm45"
    call = glm_call("get_forecast", city="San\nFrancisco", days="3", hours="[9, 12]")
    released, [forecast] = read(GLM, ["Let me look. <tool", call.removeprefix("<tool")])
    assert "".join(released) == "Let me look. "
    assert forecast["function"]["name"] == "get_forecast"
    arguments = json.loads(forecast["function"]["arguments"])
    assert arguments == {"city": "San\nFrancisco", "days": 3, "hours": [9, 12]}
    grammar = GLM.grammar
    assert follows(grammar, "Let me look.\n" + call) and follows(grammar, glm_call("get_time"))
    assert follows(grammar, glm_call("get_forecast", city="Oslo", days="1", unit="celsius"))
    assert not follows(grammar, glm_call("get_date"))
    assert not follows(grammar, glm_call("get_forecast", city="Paris"))  # days is required
    assert not follows(grammar, glm_call("get_forecast", city="Paris", days="two"))
    assert not follows(grammar, glm_call("get_forecast", city="Paris", days="2", unit="kelvin"))


def test_glm_4_7s_calls_its_name_straight_before_its_first_key_are_glm_4_5s_under_vllms_glm47_too():
    from inference_api.tool_calls import tool_parser

    for alias, name in {"glm47": "glm45", "qwen3_xml": "qwen3_coder", "llama4_json": "llama3_json"}.items():
        assert tool_parser("", False, ByteTokenizer(), forced=alias) == name
    glm_4_7 = (
        "<tool_call>get_forecast<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key>"
    )
    glm_4_7 += "<arg_value>2</arg_value></tool_call>"
    _, [forecast] = read(GLM, [glm_4_7])
    assert forecast["function"]["name"] == "get_forecast"
    assert json.loads(forecast["function"]["arguments"]) == {"city": "Oslo", "days": 2}
    _, [bare] = read(GLM, ["<tool_call>get_time</tool_call>"])  # no arguments
    assert (bare["function"]["name"], json.loads(bare["function"]["arguments"])) == ("get_time", {})
    assert follows(GLM.grammar, glm_4_7) and follows(GLM.grammar, "<tool_call>get_time</tool_call>")


# GLM-4.5's tags as its tokenizer has them: tokens of their own, not marked special, which llguidance takes
# as special all the same (tokenizer.are_grammar_tokens); its end of turn last
GLM_TAGS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


def follows_in(tokenizer: Any, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole, token by token, in this (transformers') tokenizer."""
    import llguidance.hf

    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer), grammar)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def follows_with_tags(grammar: str, text: str, tags: tuple[str, ...]) -> bool:
    """Whether the grammar takes `text` whole, in a tokenizer with `tags` as tokens not marked special."""
    from tests.backend.models import byte_tokenizer

    return follows_in(byte_tokenizer((*tags, "<|endoftext|>"), tags), grammar, text)


def test_glm_4_5s_tags_are_named_as_tokens_where_they_are_ones():
    """Its string values run up to the closing tag's token; a grammar that spelled the tags out would
    refuse every call the model writes with its own tokens."""
    from inference_api.tool_calls import BlockTokens

    call = glm_call("get_forecast", city="San\nFrancisco", days="3", unit="celsius")
    spelled, tokens = GLM.grammar, replace(GLM, call_tags=BlockTokens(frozenset(GLM_TAGS))).grammar
    assert not follows_with_tags(spelled, "Let me look.\n" + call, GLM_TAGS)
    assert follows_with_tags(tokens, "Let me look.\n" + call, GLM_TAGS)
    assert follows_with_tags(tokens, call + "\n" + glm_call("get_time"), GLM_TAGS)
    assert follows_with_tags(tokens, glm_call("get_forecast", city="", days="1"), GLM_TAGS)
    assert not follows_with_tags(tokens, glm_call("get_forecast", city="Paris"), GLM_TAGS)  # days required
    assert not follows_with_tags(tokens, glm_call("get_forecast", city="Paris", days="2", unit="K"), GLM_TAGS)


def seed_call(function: str, **parameters: str) -> str:
    return xml_call(function, **parameters).replace("tool_call>", "seed:tool_call>")


def minimax_call(function: str, **parameters: str) -> str:
    written = "".join(f'<parameter name="{name}">{value}</parameter>\n' for name, value in parameters.items())
    return f'<minimax:tool_call>\n<invoke name="{function}">\n{written}</invoke>\n</minimax:tool_call>'


@pytest.mark.parametrize(
    "parser, template, call",
    [
        ("seed_oss", "{{- '<seed:tool_call>\\n<function=' + name + '>\\n<parameter=' }}", seed_call),
        ("minimax_m2", "{{- '<minimax:tool_call>\\n<invoke name=\"' + name + '\">' }}", minimax_call),
    ],
)
def test_seed_oss_and_minimax_m2_write_xml_calls_in_blocks_of_their_own(parser, template, call):
    """Seed-OSS's calls are Qwen3-Coder's (its template writes `<function=` too) in `<seed:tool_call>`
    blocks; MiniMax-M2's `<invoke name=...>` in `<minimax:tool_call>` ones: found, read and held to the
    tools."""
    from inference_api.tool_calls import tool_parser

    assert tool_parser(template, False, ByteTokenizer()) == parser
    forecast = call("get_forecast", city="San\nFrancisco", days="3", hours="[9, 12]")
    request = ToolRequest(FORECAST_TOOLS, "auto", parser=parser)
    released, [read_back] = read(request, ["Let me look. <", forecast[1:]])
    assert "".join(released) == "Let me look. "
    arguments = json.loads(read_back["function"]["arguments"])
    assert (read_back["function"]["name"], arguments) == (
        "get_forecast",
        {"city": "San\nFrancisco", "days": 3, "hours": [9, 12]},
    )
    grammar = request.grammar
    assert follows(grammar, "Let me look.\n" + forecast)
    assert follows(grammar, forecast + "\n" + call("get_time"))
    assert not follows(grammar, call("get_forecast", city="Paris"))  # days is required
    assert not follows(grammar, call("get_date"))
    none = ToolRequest(FORECAST_TOOLS, "none", parser=parser).grammar
    assert follows(none, "Sunny.") and not follows(none, forecast)


def nested_tool(name: str, item: dict) -> dict:
    """A tool whose parameters refer to a definition, as pydantic writes a nested model's schema."""
    parameters = {
        "type": "object",
        "$defs": {"Item": item},
        "properties": {"item": {"$ref": "#/$defs/Item"}, "note": {"type": "string"}},
        "required": ["item"],
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# Two tools that each define "Item", their own way
NESTED = [
    nested_tool("add", {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
    nested_tool("tag", {"type": "string"}),
]


def test_tools_whose_parameters_refer_to_definitions_are_enforced_in_every_format():
    """A call's grammar puts each tool's parameters inside a schema of its own, where `#/$defs/Item` would
    point at that one's root: the definitions go with them, each tool's kept apart."""

    def hermes(name: str, item: str) -> str:
        return f'<tool_call>{{"name": "{name}", "arguments": {{"item": {item}}}}}</tool_call>'

    grammar = ToolRequest(NESTED, "auto").grammar
    assert follows(grammar, hermes("add", '{"n": 1}')) and follows(grammar, hermes("tag", '"red"'))
    assert not follows(grammar, hermes("add", '"red"')) and not follows(grammar, hermes("tag", '{"n": 1}'))
    required = ToolRequest(NESTED, "required").grammar
    assert follows(required, '{"name": "add", "arguments": {"item": {"n": 2}}}')
    assert not follows(required, '{"name": "add", "arguments": {"item": {"n": "two"}}}')
    xml = ToolRequest(NESTED, "auto", parser="qwen3_coder").grammar
    assert follows(xml, xml_call("add", item='{"n": 1}')) and follows(xml, xml_call("tag", item="red"))
    assert not follows(xml, xml_call("add", item='{"n": "a"}'))


# Gemma 4's and FunctionGemma's tags as special tokens (as tests/openai/test_gemma4_format.py's and
# test_functiongemma_format.py's tokenizers have them), each end of turn last
NOTATION_TOKENS = {
    "gemma4": ("<|turn>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|tool_response>", "<turn|>"),
    "functiongemma": (
        "<start_of_turn>",
        "<start_function_call>",
        "<end_function_call>",
        "<escape>",
        "<start_function_response>",
        "<end_of_turn>",
    ),
}
NOTATION_FORMATS = pytest.mark.parametrize("parser", list(NOTATION_TOKENS))


def notation_call(parser: str, function: str, arguments: str) -> str:
    """A call in the parser's notation, each `§` in `arguments` its string tag."""
    from inference_api.notation_tool_calls import NOTATIONS

    notation = NOTATIONS[parser]
    written = arguments.replace("§", notation.quote)
    return f"{notation.open}call:{function}{{{written}}}{notation.close}"


def follows_notation(parser: str, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole, in a tokenizer whose notation tags are special tokens."""
    from tests.backend.models import byte_tokenizer

    return follows_in(byte_tokenizer(NOTATION_TOKENS[parser]), grammar, text)


@NOTATION_FORMATS
def test_gemma_4s_and_functiongemmas_calls_are_found_where_their_tags_are_tokens_read_and_held_to_the_tools(
    parser: str,
):
    from inference_api.tool_calls import tool_parser
    from tests.backend.models import byte_tokenizer

    opening = NOTATION_TOKENS[parser][1]
    template = "{{- '" + opening + "call:' + call.name + '{' }}"
    for tokens_of, tokens in NOTATION_TOKENS.items():  # each found only with its own tags as tokens
        assert tool_parser(template, False, byte_tokenizer(tokens)) == (
            parser if tokens_of == parser else "hermes"
        )
    assert tool_parser(template, False, ByteTokenizer()) == "hermes"  # its tags spelled out
    call = notation_call(parser, "get_forecast", "city:§San Francisco, {CA}§,days:3,hours:[9,12]")
    request = ToolRequest(FORECAST_TOOLS, "auto", parser=parser)
    released, [forecast] = read(request, ["Let me look. " + call[:3], call[3:]])
    assert "".join(released) == "Let me look. "
    assert forecast["function"]["name"] == "get_forecast"
    arguments = json.loads(forecast["function"]["arguments"])
    assert arguments == {"city": "San Francisco, {CA}", "days": 3, "hours": [9, 12]}
    grammar = request.grammar
    assert follows_notation(parser, grammar, "It is sunny, <b>often</b>.")
    assert follows_notation(parser, grammar, "Let me look.\n" + call)
    assert follows_notation(
        parser, grammar, notation_call(parser, "get_forecast", "city:§Oslo§,days:1,unit:§celsius§")
    )
    twice = notation_call(parser, "get_time", "") + notation_call(parser, "get_time", "")
    assert follows_notation(parser, grammar, twice)
    response = NOTATION_TOKENS[parser][4]  # the tag results follow, which the model writes after its calls
    assert follows_notation(parser, grammar, twice + response)
    assert not follows_notation(parser, grammar, twice + response + notation_call(parser, "get_time", ""))
    assert not follows_notation(parser, grammar, "Sunny." + response)  # only after calls
    _, calls = read(request, [call + response])
    assert [found["function"]["name"] for found in calls] == ["get_forecast"]
    assert not follows_notation(parser, grammar, notation_call(parser, "get_date", ""))  # not a tool
    for arguments in (
        "city:§Paris§",  # days required
        "city:§Paris§,days:two",
        "days:2,city:§Paris§",  # order
        "city:§Paris§,days:2,unit:§kelvin§",
    ):
        assert not follows_notation(parser, grammar, notation_call(parser, "get_forecast", arguments))
    assert not follows_notation(
        parser, grammar, notation_call(parser, "get_time", "") + " and some text after"
    )
    left_open = notation_call(parser, "get_time", "").removesuffix("}" + NOTATION_TOKENS[parser][2])
    assert not follows_notation(parser, grammar, left_open)  # a call cannot be left open


@NOTATION_FORMATS
def test_a_notations_call_cut_by_max_tokens_keeps_what_was_written_and_its_tags_are_kept_in_the_text(
    parser: str,
):
    from backend.messages import SamplingParams
    from inference_api.tool_calls import with_tool_grammar

    request = ToolRequest(FORECAST_TOOLS, "auto", parser=parser)
    call = notation_call(parser, "get_forecast", "city:§Paris§,days:1")
    _, [cut] = read(request, [call[: call.index("Paris") + 3]])
    assert cut["function"]["name"] == "get_forecast"
    assert json.loads(cut["function"]["arguments"]) == {"city": "Par"}
    _, [bare] = read(request, [call.removesuffix("}" + NOTATION_TOKENS[parser][2])])
    assert json.loads(bare["function"]["arguments"]) == {"city": "Paris"}  # a number cut short: left out
    released, calls = read(request, ["Sure. " + call[: call.index("call:") + 3]])
    assert calls == [] and "".join(released) == "Sure. " + call[: call.index("call:") + 3]
    params = with_tool_grammar(SamplingParams(), request, "response_format")
    assert params.skip_special_tokens is False and params.grammar == request.grammar
    none = with_tool_grammar(SamplingParams(), ToolRequest(FORECAST_TOOLS, "none", parser=parser), "x")
    assert none.skip_special_tokens is True


def test_a_tool_turn_gets_the_name_of_the_function_whose_call_it_answers():
    """Templates that write a result by its function's name (FunctionGemma's, Gemma 4's) get it, though
    OpenAI's tool messages carry only the call's id; a name the request gave is kept, one given through
    Ollama's `tool_name` too."""
    from inference_api.apis.ollama.request import _openai_messages
    from inference_api.prompts import read_messages
    from inference_api.tool_calls import template_messages

    calls = [
        {"id": "c1", "type": "function", "function": {"name": "get_forecast", "arguments": "{}"}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    messages = read_messages(
        [
            {"role": "user", "content": "Weather and time?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c2", "content": "noon"},
            {"role": "tool", "tool_call_id": "c1", "content": "rain", "name": "forecast"},
            {"role": "tool", "tool_call_id": "c9", "content": "?"},  # answers no call: no name
        ]
    )
    shaped = template_messages(messages, "{{ message.tool_calls }}")
    assert [turn.get("name") for turn in shaped[2:]] == ["get_time", "forecast", None]
    ollama = read_messages(_openai_messages([{"role": "tool", "content": "noon", "tool_name": "get_time"}]))
    assert ollama[0]["name"] == "get_time"
