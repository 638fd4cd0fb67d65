"""Tool calling on /v1/chat/completions: `tools` and `tool_choice` in, `message.tool_calls` out.

The tools go into the prompt through the model's chat template (`tools=`, as transformers'
`apply_chat_template` passes them); a template that takes no tools gets them in a system message
instead. How the answer becomes calls depends on `tool_choice`:

- a named function: the answer is decoded under that function's parameters schema, so it *is* the
  call's arguments, valid for any model (cut by max_tokens, a call all the same, with what was written);
- `required`: decoded under "one of the tools as {"name", "arguments"}", so it is one valid call (cut
  by max_tokens once its name is written, the same);
- `auto`: the model chooses; its text is read in the format its template teaches (`PARSERS`): the
  Hermes/Qwen `<tool_call>{...}</tool_call>` blocks, or Llama 3's bare JSON `{"name", "parameters"}`.
  Text that does not parse as a call stays text.
- `none`: the tools are in the prompt, and the answer is text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from backend.engine.stop_matcher import longest_partial_match
from backend.messages import InvalidParams
from inference_api.structured_output import json_schema_grammar

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# `required`'s answer as its grammar writes it (JSON_LAYOUT's spacing, the name first), cut short.
REQUIRED_CALL_CUT = re.compile(
    r'\{"name": (?P<name>"[A-Za-z0-9_-]{1,64}"), "arguments": (?P<arguments>.*)\Z', re.S
)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA3_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # as sent ({"type": "function", "function": {...}}), for the template
    choice: str  # "none", "auto", "required", or "function" (a named one)
    function: str | None = None  # the named function
    parser: str = "hermes"  # how `auto` reads calls in the text (PARSERS)

    @property
    def grammar(self) -> str | None:
        """What the answer is decoded under: the call itself for `required` and a named function."""
        schemas = {tool["function"]["name"]: parameters(tool) for tool in self.tools}
        if self.choice == "function":
            return json_schema_grammar(schemas[self.function], "tool_choice")
        if self.choice == "required":
            one_call = {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"name": {"const": name}, "arguments": schema},
                        "required": ["name", "arguments"],
                        "additionalProperties": False,
                    }
                    for name, schema in schemas.items()
                ]
            }
            return json_schema_grammar(one_call, "tools")
        return None


def read_tool_request(data: dict[str, Any], template_source: str) -> ToolRequest | None:
    """`tools` and `tool_choice`, checked (a 400 naming what is wrong); None without tools."""
    tools = data.get("tools")
    choice = data.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise InvalidParams("tool_choice", "tool_choice needs tools")
        return None
    if not isinstance(tools, list):
        raise InvalidParams("tools", "tools must be a list of {type: function, function: {...}} objects")
    tools = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) < len(names):
        raise InvalidParams("tools", "tools must have different function names")
    parser = "llama3_json" if LLAMA3_PYTHON_TAG in template_source else "hermes"
    if choice is None or choice in ("none", "auto", "required"):
        return ToolRequest(tools, choice or "auto", parser=parser)
    function = (
        choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    )
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidParams(
            "tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", ...}'
        )
    if name not in names:
        raise InvalidParams("tool_choice", f"tool_choice names {name!r}, which is not one of the tools")
    return ToolRequest(tools, "function", name, parser)


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _tool(tool: Any, param: str) -> dict[str, Any]:
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or not isinstance(tool.get("function"), dict)
    ):
        raise InvalidParams(param, f'{param} must be {{"type": "function", "function": {{"name", ...}}}}')
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise InvalidParams(
            f"{param}.function.name", f"{param}.function.name must be 1 to 64 of a-z, A-Z, 0-9, _ -"
        )
    schema = function.get("parameters")
    if schema is not None:
        if not isinstance(schema, dict):
            raise InvalidParams(
                f"{param}.function.parameters", f"{param}.function.parameters must be a JSON schema"
            )
        json_schema_grammar(schema, f"{param}.function.parameters")  # a 400 if it cannot be enforced
    return tool


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """For a template that takes no tools: the Hermes instructions, in a system message."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You may call one or more functions to answer. The functions are, one JSON object a line:\n"
        f"<tools>\n{listing}\n</tools>\n"
        f'To call one, answer with {HERMES_OPEN}{{"name": <function name>, "arguments": <arguments '
        f"object>}}{HERMES_CLOSE}"
    )


def template_messages(messages: list[dict[str, Any]], template_source: str) -> list[dict[str, Any]]:
    """Assistant turns with tool calls as the template takes them: `tool_calls` with their arguments as
    objects (transformers' templates expect them so); for a template that knows no tool calls, the
    calls written into the content in the Hermes format."""
    knows_tool_calls = "tool_calls" in template_source
    shaped = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls:
            shaped.append(message)
        elif knows_tool_calls:
            shaped.append({**message, "tool_calls": calls})
        else:
            written = "".join(hermes_call(call["function"]) for call in calls)
            shaped.append({"role": message["role"], "content": message["content"] + written})
    return shaped


def hermes_call(function: dict[str, Any]) -> str:
    call = {"name": function["name"], "arguments": function["arguments"]}
    return f"{HERMES_OPEN}{json.dumps(call, ensure_ascii=False)}{HERMES_CLOSE}"


def read_tool_calls(value: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` (OpenAI's shape, arguments a JSON string), arguments parsed."""
    if not isinstance(value, list):
        raise InvalidParams(param, f"{param} must be a list of tool calls")
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise InvalidParams(
                f"{param}[{i}]", f"{param}[{i}] must be {{id, type, function: {{name, arguments}}}}"
            )
        try:
            parsed = json.loads(arguments)
        except ValueError:
            raise InvalidParams(
                f"{param}[{i}].function.arguments", "the arguments must be a JSON string"
            ) from None
        calls.append(
            {"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": parsed}}
        )
    return calls


def new_call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class ToolCallReader:
    """One choice's answer read as text and tool calls: `feed` the text as it comes and get back what
    can go out as content now; `finish` gives what is left of the content and the calls.

    A call's text is held back from where it starts: at once for `required` and a named function, at
    the first `<tool_call>` (Hermes; a possible start of it is held back too), or when the answer's
    first character opens a JSON object (Llama 3). Text that then does not parse as calls is content.
    """

    def __init__(self, request: ToolRequest):
        self.request = request
        self.text = ""  # all the answer so far
        self.sent = 0  # how much of it went out as content
        self.call_start: int | None = 0 if request.choice in ("function", "required") else None
        self.no_call = request.choice == "none"

    def feed(self, text: str) -> str:
        self.text += text
        if self.call_start is None and not self.no_call:
            self._find_call_start()
        if self.call_start is not None:
            end = self.call_start
        elif self.no_call:
            end = len(self.text)
        else:
            end = len(self.text) - self._held_back()
        released, self.sent = self.text[self.sent : max(end, self.sent)], max(end, self.sent)
        return released

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content not yet sent, the tool calls)."""
        calls = None if self.call_start is None else self._calls(self.text[self.call_start :])
        if calls is None:
            return self.text[self.sent :], []
        return self.text[self.sent : self.call_start], calls

    def _find_call_start(self) -> None:
        if self.request.parser == "hermes":
            at = self.text.find(HERMES_OPEN)
            self.call_start = at if at >= 0 else None
            return
        stripped = self.text.lstrip()
        if stripped:  # Llama 3: a call is the whole answer, or there is none
            if stripped.startswith(("{", LLAMA3_PYTHON_TAG[: len(stripped)])):
                self.call_start = len(self.text) - len(stripped)
            else:
                self.no_call = True

    def _held_back(self) -> int:
        """How much of the end might begin a call (not sent until the next text says)."""
        if self.request.parser != "hermes":  # Llama 3, undecided: the answer is only whitespace so far
            return len(self.text)
        return longest_partial_match(self.text, (HERMES_OPEN,))

    def _calls(self, text: str) -> list[dict[str, Any]] | None:
        choice = self.request.choice
        if choice == "function":  # the answer is the arguments, whole or cut by max_tokens: a call either way
            return [new_call(self.request.function, text)]
        if choice == "required":
            return _required_call(text)
        try:
            if self.request.parser == "hermes":
                pattern = re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|$)"
                calls = [json.loads(block) for block in re.findall(pattern, text, re.S)]
                if not calls:
                    return None
                return [
                    new_call(c["name"], json.dumps(c.get("arguments", {}), ensure_ascii=False)) for c in calls
                ]
            call = json.loads(text.strip().removeprefix(LLAMA3_PYTHON_TAG))
            return [new_call(call["name"], json.dumps(call.get("parameters", {}), ensure_ascii=False))]
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def _required_call(text: str) -> list[dict[str, Any]] | None:
    """`required`'s answer as the call it is; cut by max_tokens after the name, the call with what was
    written of its arguments; cut before it, none."""
    try:
        call = json.loads(text)
        return [new_call(call["name"], json.dumps(call["arguments"], ensure_ascii=False))]
    except (ValueError, KeyError, TypeError):  # not whole JSON (a JSONDecodeError is a ValueError)
        cut = REQUIRED_CALL_CUT.match(text)
        return [new_call(json.loads(cut["name"]), cut["arguments"])] if cut else None
