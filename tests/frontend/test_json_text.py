"""JSON text the server did not write (inference_api/json_text.py), and the call readers on a model's
output nested past Python's recursion limit: bad JSON, read as such, never a RecursionError (a 500)."""

from __future__ import annotations

import json

import pytest

from inference_api import json_text
from inference_api import mistral_tool_calls as mistral
from inference_api import notation_tool_calls as notation
from inference_api.tool_calls import ToolCallReader, ToolRequest
from inference_api.xml_tool_calls import QWEN3_CODER, read_call

DEEP = "[" * 5_000
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_json_nested_too_deeply_is_a_value_error_as_other_bad_json_is():
    for text in (DEEP, DEEP + "]" * 5_000, '{"a": ' * 5_000):
        with pytest.raises(ValueError, match="too deeply"):
            json_text.loads(text)
        with pytest.raises(ValueError, match="too deeply"):
            json_text.raw_decode("x" + text, 1)
    assert json_text.loads('{"a": [1]}') == {"a": [1]}
    assert json_text.raw_decode("x[1] tail", 1) == ([1], 4)
    with pytest.raises(ValueError):
        json_text.loads("{not json")


@pytest.mark.parametrize(
    "arguments, members",
    [
        ('{"city": "Paris", "days": 3}', {"city": "Paris", "days": 3}),
        ('{"city": "Paris", "days": 3', {"city": "Paris"}),  # 3 could have been 30
        ('{"city": "Paris", "days": 3,', {"city": "Paris", "days": 3}),
        ('{"city": "Par', {}),
        ('{"city": "Paris"', {"city": "Paris"}),
        ('{"tags": ["a", "b"], "more": {"x": nul', {"tags": ["a", "b"]}),
        ("[1, 2]", {}),  # whole, but not an object
        ("", {}),
        ('{"a": ' + DEEP, {}),
        ('{"a": 1, "b": ' + DEEP, {"a": 1}),
    ],
)
def test_a_calls_arguments_as_an_object_are_the_members_written_whole(arguments, members):
    assert json_text.object_written(arguments) == members


def finished(request: ToolRequest, text: str) -> tuple[str, list[dict]]:
    reader = ToolCallReader(request)
    released = reader.feed(text)
    rest, calls = reader.finish()
    return released + rest, calls


@pytest.mark.parametrize(
    "request_, text",
    [
        (ToolRequest(TOOLS, "auto"), '<tool_call>{"name": "f", "arguments": ' + DEEP + "</tool_call>"),
        (ToolRequest(TOOLS, "auto", parser="llama3_json"), '{"name": "f", "parameters": ' + DEEP),
        (ToolRequest(TOOLS, "required"), '[{"name": "f", "arguments": ' + DEEP),
        (ToolRequest(TOOLS, "function", "f"), DEEP),
    ],
    ids=["hermes", "llama3_json", "required", "named"],
)
def test_a_call_nested_too_deeply_is_read_as_written_or_left_as_text(request_, text):
    """A looping model's `[[[[...` inside a call: the call keeps its arguments as written (as a call that
    max_tokens cut does), or the answer stays text; the reader never raises."""
    content, calls = finished(request_, text)
    assert [call["function"]["arguments"] for call in calls] in ([DEEP], []), calls
    assert content == ("" if calls else text)


def test_the_own_notations_readers_keep_a_call_nested_too_deeply_as_written_or_as_no_call():
    assert mistral.read_calls('[TOOL_CALLS] [{"name": "f", "arguments": ' + DEEP) == [("f", DEEP)]
    assert mistral.read_calls("[TOOL_CALLS]f[ARGS]" + DEEP) == [("f", DEEP)]
    assert mistral.json_arguments(DEEP) == DEEP
    xml_call = read_call(
        f"<function=f>\n<parameter=a>\n{DEEP}\n</parameter>\n</function>", TOOLS, QWEN3_CODER
    )
    assert xml_call == ("f", json.dumps({"a": DEEP}))
    assert notation.read_call("call:f{a:" + DEEP, notation.GEMMA4) is None
