"""Reading tool calls out of an answer as it streams (inference_api/tool_calls.py), in each format."""

import json

from inference_api.tool_calls import ToolCallReader, ToolRequest

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
