"""Tool use on Anthropic's Messages API: `tools` and `tool_choice` in, `tool_use` blocks out, through chat
completions' tool calling (tool_calls.py), so that calls are prompted, decoded and read as chat's are.

The request's tools ({name, description, input_schema}, `type` absent or "custom") and tool_choice
({"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}) are checked in
Anthropic's names (a 400 names `tools[i].input_schema`, not chat's `tools[i].function.parameters`), then
put in chat's shapes for read_tool_request: `any` is chat's `required`, `tool` a named function,
`disable_parallel_tool_use` parallel_tool_calls false. Anthropic's server tools (web search, bash, the
text editor...) run on Anthropic's side: nothing here could run them, so they are a 400 naming
`tools[i].type`.
"""

from __future__ import annotations

import uuid
from typing import Any

from backend.messages import InvalidParams
from inference_api.json_text import object_written
from inference_api.structured_output import json_schema_grammar
from inference_api.tool_calls import (
    FormatTags,
    ToolRequest,
    name_and_description,
    read_tool_list,
    read_tool_request,
)

SHAPE = "{name, description, input_schema}"
CHAT_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
CHOICE_SHAPES = (
    'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} or {"type": "none"}'
)


def read_tools(
    data: dict[str, Any],
    parser: str,
    call_tags: FormatTags | None = None,
) -> ToolRequest | None:
    """The request's `tools` and `tool_choice`, checked (a 400 naming Anthropic's field), as chat's
    ToolRequest (`parser` and `call_tags` as read_tool_request takes them); None without tools."""
    tools = data.get("tools")
    choice, parallel = _tool_choice(data.get("tool_choice"))
    chat = {"tools": None if tools is None else _tools(tools), "tool_choice": choice}
    return read_tool_request(chat, parser, parallel, call_tags)


def _tools(value: Any) -> list[dict[str, Any]]:
    return read_tool_list(value, _tool, lambda tool: tool["function"]["name"], SHAPE + " objects")


def _tool(tool: Any, param: str) -> dict[str, Any]:
    """One custom tool, in chat's shape: {"type": "function", "function": {name, description, parameters}}."""
    if not isinstance(tool, dict):
        raise InvalidParams(param, f"{param} must be an object {SHAPE}")
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise InvalidParams(
            f"{param}.type",
            f"{param}.type {kind!r} is one of Anthropic's server tools, which this server does not run: "
            'only tools the client runs (type "custom", or none) are served',
        )
    name, description = name_and_description(tool, param)
    schema = tool.get("input_schema")
    # Anthropic's input is an object: a schema of anything else could not give one.
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise InvalidParams(
            f"{param}.input_schema", f'{param}.input_schema must be a JSON schema of "type": "object"'
        )
    json_schema_grammar(schema, f"{param}.input_schema")  # a 400 if it cannot be enforced
    function = {"name": name, "parameters": schema}
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> tuple[Any, bool]:
    """Chat's tool_choice for Anthropic's, and whether more than one call is allowed."""
    if choice is None:
        return None, True
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("tool", *CHAT_CHOICES):
        raise InvalidParams("tool_choice", CHOICE_SHAPES)
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        param = "tool_choice.disable_parallel_tool_use"
        raise InvalidParams(param, f"{param} must be a boolean (true or false)")
    if kind != "tool":
        return CHAT_CHOICES[kind], not disable
    name = choice.get("name")
    if not isinstance(name, str):
        raise InvalidParams("tool_choice.name", 'tool_choice.name is required with {"type": "tool"}')
    return {"type": "function", "function": {"name": name}}, not disable


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """A call (chat's shape, tool_calls.new_call) as Anthropic's tool_use block."""
    function = call["function"]
    return {
        "type": "tool_use",
        "id": "toolu_" + uuid.uuid4().hex[:24],
        "name": function["name"],
        "input": object_written(function["arguments"]),
    }
