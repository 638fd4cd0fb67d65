"""Tool calling on /v1/chat/completions: `tools` and `tool_choice` in, `message.tool_calls` out.

The tools go into the prompt through the model's chat template (`tools=`, as transformers'
`apply_chat_template` passes them); a template that takes no tools gets them in a system message
instead. How the answer becomes calls depends on `tool_choice`:

- a named function: the answer is decoded under that function's parameters schema, so it *is* the
  call's arguments, valid for any model (cut by max_tokens, a call all the same, with what was written);
- `required`: decoded under "one of the tools as {"name", "arguments"}", so it is one valid call (cut
  by max_tokens once its name is written, the same);
- `auto`: the model chooses; its text is read in the format its template teaches (`tool_parser`): the
  Hermes/Qwen `<tool_call>{...}</tool_call>` blocks, Qwen3-Coder's, Qwen3.5's or GLM-4.5's XML in those
  blocks (xml_tool_calls.py), Gemma 4's and FunctionGemma's notation between their tags
  (notation_tool_calls.py), Mistral's after its `[TOOL_CALLS]` token and Granite 3's after its
  `<|tool_call|>` (mistral_tool_calls.py), DeepSeek's between its `<｜tool▁calls▁begin｜>` tags
  (deepseek_tool_calls.py), Llama 3's bare JSON `{"name", "parameters"}`, or a bare Python list of calls
  (`pythonic`, pythonic_tool_calls.py).
  The answer is decoded under "free text, or calls in that format" (`AUTO_TAGGED`, `AUTO_LLAMA3`): text
  is free until the model opens a call, and from there the call is one of the tools with valid
  arguments, so that no half-written call comes back as text. A request that also sets a
  `response_format` keeps that grammar, and its calls are read from the text as written.
- `none`: the tools are in the prompt, and the answer is text: in the Hermes format, decoded under
  "text with no `<tool_call>`" (`NONE_HERMES`).

gpt-oss writes its calls as harmony messages to `functions.NAME` (harmony.py): a named function and
`required` are decoded under "thoughts, then a call's message", `none` under "thoughts, then the final
message", and `auto` is free (the model was trained on the format); answers.HarmonyReader reads them.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from backend.engine.stop_matcher import longest_partial_match
from backend.messages import InvalidParams, SamplingParams
from inference_api import cohere_tool_calls as cohere
from inference_api import deepseek_tool_calls as deepseek
from inference_api import json_text, notation_tool_calls
from inference_api import listed_tool_calls as listed
from inference_api import mistral_tool_calls as mistral
from inference_api import pythonic_tool_calls as pythonic
from inference_api.cohere_tool_calls import ActionTags
from inference_api.deepseek_tool_calls import DeepSeekTags
from inference_api.harmony import call_grammar, final_answer
from inference_api.listed_tool_calls import ListTags
from inference_api.mistral_tool_calls import CallTags
from inference_api.pythonic_tool_calls import PythonicTags
from inference_api.structured_output import definitions_under, json_lark, json_schema_grammar, lark_grammar
from inference_api.tokenizer import PromptTokenizer
from inference_api.xml_tool_calls import (
    GLM45,
    MINIMAX_M2,
    QWEN3_CODER,
    SEED_OSS,
    call_lark,
    read_call,
    template_format,
)

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128  # as OpenAI's: every tool is in the prompt and in the calls' grammar
# `required`'s answer as its grammar writes it (JSON_LAYOUT's spacing, the name first), cut short.
REQUIRED_CALL_CUT = re.compile(
    r'\{"name": (?P<name>"[A-Za-z0-9_-]{1,64}"), "arguments": (?P<arguments>.*)\Z', re.S
)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA3_PYTHON_TAG = "<|python_tag|>"
# `auto` in the Hermes format: text with no `<tool_call>` in it; or text, then calls, and nothing after
# them (one call only, unless parallel). The text and the first `<tool_call>` are one lexeme (OPEN):
# llguidance's lexer is greedy, so a TEXT lexeme followed by the literal would end before the tag's last
# byte and refuse it. {open} and {close} are the blocks' tags (an XML format's may be its own, as
# Seed-OSS's `<seed:tool_call>`) as Lark literals, {open_regex} the opening one in a regex.
AUTO_TAGGED = """start: TEXT | OPEN call_body{more}
more: (WS? {open} call_body)*
call_body: WS? call WS? {close}
WS: /[ \\n]+/
TEXT: /(?s:.+)/ & ~/(?s:.*){open_regex}(?s:.*)/
OPEN: /(?s:.*){open_regex}/ & ~/(?s:.*){open_regex}(?s:.+)/
"""
# The same where the blocks' tags are tokens that llguidance takes as special (Qwen's `<tool_call>`,
# though its tokenizers do not mark them: tokenizer.are_grammar_tokens), which no text lexeme or string
# holds: named as tokens, the text not spelling them out either. Qwen's calls are `<tool_call>\n{...}\n
# </tool_call>`: two spaces or line breaks at most around them (a run of them would be free for a model to
# spend its tokens on).
AUTO_TAG_TOKENS = """start: TEXT | TEXT? {open} call_body{more}
more: (WS? {open} call_body)*
call_body: WS? call WS? {close}
WS: /[ \\n]{{1,2}}/
TEXT: /(?s:.+)/ & ~/(?s:.*){open_regex}(?s:.*)/
"""
# The formats whose calls are `<tool_call>` blocks: Hermes's JSON in them, or XML (xml_tool_calls.py).
XML_FORMATS = {form.name: form for form in (QWEN3_CODER, GLM45, SEED_OSS, MINIMAX_M2)}
TAGGED = ("hermes", *XML_FORMATS)
MISTRAL, GRANITE = "mistral", "granite"
NOTATIONS = notation_tool_calls.NOTATIONS  # Gemma 4's and FunctionGemma's notation (notation_tool_calls.py)
# The formats whose calls follow a special token (mistral_tool_calls.CallTags), and its text.
CALL_TAG_FORMATS = {MISTRAL: mistral.OPEN, GRANITE: mistral.GRANITE_OPEN}
DEEPSEEK_FORMATS = (deepseek.V3, deepseek.V31)
LFM2 = "lfm2"  # pythonic_tool_calls.py
PYTHONIC = pythonic.BARE  # a Python list of calls as the whole answer (pythonic_tool_calls.py)
# The formats whose calls are the whole answer, no tags, and how such an answer opens.
BARE_OPENINGS = {"llama3_json": ("{", LLAMA3_PYTHON_TAG), PYTHONIC: ("[",)}
COHERE = cohere.NAME  # cohere_tool_calls.py
LIST_FORMATS = tuple(listed.LISTS)  # a JSON list between tags of their own (listed_tool_calls.py)
# The formats whose calls are a list after an opening tag, read as Mistral's are, and that tag.
LISTED_OPENINGS = CALL_TAG_FORMATS | {name: tags[0] for name, tags in listed.LISTS.items()}
# The formats with readers of their own, and the tag that opens their calls.
OWN_READERS = {
    deepseek.V3: (deepseek.CALLS_BEGIN, partial(deepseek.read_calls, fenced=True)),
    deepseek.V31: (deepseek.CALLS_BEGIN, partial(deepseek.read_calls, fenced=False)),
    LFM2: (pythonic.OPEN, pythonic.read_calls),
    COHERE: (cohere.ACTION_OPEN, cohere.read_calls),
}
# The formats whose tags are special tokens (DeepSeek's may be): an answer that may call keeps them in its
# text.
SPECIAL_TAGS = (*NOTATIONS, *CALL_TAG_FORMATS, *DEEPSEEK_FORMATS, LFM2, *LIST_FORMATS, COHERE)
# vLLM's other names for formats read here under the names below, so that its command lines start: its
# glm47 reads GLM-4.7's calls, GLM-4.5's but for the name written straight before the first <arg_key> and
# a call with no arguments (which glm45's grammar and reader take too); qwen3_xml Qwen3-Coder's XML;
# llama4_json Llama 3's JSON.
PARSER_ALIASES = {"glm47": "glm45", "qwen3_xml": "qwen3_coder", "llama4_json": "llama3_json"}
# --tool-call-parser's choices, vLLM's names: auto reads the chat template for the format (tool_parser).
TOOL_CALL_PARSERS = (
    "auto",
    "hermes",
    "llama3_json",
    PYTHONIC,
    *XML_FORMATS,
    *NOTATIONS,
    MISTRAL,
    GRANITE,
    *DEEPSEEK_FORMATS,
    LFM2,
    *LIST_FORMATS,
    COHERE,
    *PARSER_ALIASES,
)
# `auto` in Gemma 4's or FunctionGemma's notation (notation_tool_calls.py): text, or text then calls between
# its tags, which are special tokens (named as such: no text lexeme can hold them, so TEXT needs no
# exclusion); after the calls, the tag its results would follow, which ends the answer where the model
# writes it, as it learnt to.
AUTO_NOTATION = """start: TEXT | TEXT? tagged_call{more} results?
more: (WS? tagged_call)*
tagged_call: {open} call {close}
results: {response}
WS: /[ \\n]+/
TEXT: /(?s:.+)/
"""
# `none` in a format whose calls open with a special token: text, which cannot hold one.
NONE_SPECIAL = """start: TEXT?
TEXT: /(?s:.+)/
"""
# `none` in the Hermes format: text that opens no call (the tools are in the prompt, and a small model
# offered them writes `<tool_call>` blocks whatever tool_choice says).
NONE_HERMES = """start: TEXT?
TEXT: /(?s:.+)/ & ~/(?s:.*){open_regex}(?s:.*)/
"""
# `auto` in Llama 3's: a call is the whole answer, a JSON object; text is anything that does not open one.
AUTO_LLAMA3 = """start: TEXT | WS? call
call: {call}
WS: /[ \\n]+/
TEXT: /(?s:.+)/ & ~/[ \\n\\t]*\\{{(?s:.*)/
"""


@dataclass(frozen=True)
class BlockTokens:
    """The tags of the `<tool_call>` formats that are tokens llguidance takes as special
    (tokenizer.are_grammar_tokens), which their grammars name as tokens: the blocks' own (AUTO_TAG_TOKENS),
    GLM-4.5's `<arg_key>` and the like (xml_tool_calls.call_lark). `special`: the tokenizer marks the
    blocks' tags so too, and a decoded answer leaves them out unless it keeps them."""

    tags: frozenset[str]
    special: bool = False

    def has(self, *tags: str) -> bool:
        return all(tag in self.tags for tag in tags)


# A format's tags as a tokenizer has them, which its grammar names (Serving.call_tags).
FormatTags = CallTags | DeepSeekTags | PythonicTags | ListTags | ActionTags | BlockTokens


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # as sent ({"type": "function", "function": {...}}), for the template
    choice: str  # "none", "auto", "required", or "function" (a named one)
    function: str | None = None  # the named function
    parser: str = "hermes"  # how the answer holds calls (tool_parser)
    parallel: bool = True  # whether an answer may hold more than one call (parallel_tool_calls)
    # the `mistral`, `granite`, DeepSeek, LFM2, JSON lists' or Cohere's formats' tags as this tokenizer has
    # them, or which of the `<tool_call>` formats' are tokens
    call_tags: FormatTags | None = None

    @property
    def grammar(self) -> str | None:
        """What the answer is decoded under: the call itself for `required` and a named function, free
        text or calls in the template's format for `auto`, text that opens no call for `none`."""
        if self.parser == "harmony":
            return self._harmony_grammar()
        if self.choice == "function":
            return json_schema_grammar(parameters(self._tool(self.function)), "tool_choice")
        if self.choice == "required":
            return json_schema_grammar(self._one_call("arguments"), "tools")
        more = " more" if self.parallel else ""  # the calls after the first
        if self.choice == "auto" and self.parser == "hermes":
            lark = self._auto_tagged(more) + f"call: {json_lark(self._one_call('arguments'))}\n"
            return lark_grammar(lark, "tools")
        if self.choice == "auto" and self.parser in NOTATIONS:
            notation = NOTATIONS[self.parser]
            tags = dict(open=notation.open, close=notation.close, response=notation.response)
            auto = AUTO_NOTATION.format(more=more, **tags)
            return lark_grammar(auto + notation_tool_calls.call_lark(self.tools, notation), "tools")
        if self.choice == "auto" and isinstance(self.call_tags, CallTags):
            lark = self.call_tags.auto_lark(self.tools, self._one_call("arguments"), self.parallel)
            return lark_grammar(lark, "tools")
        if self.choice == "auto" and isinstance(self.call_tags, DeepSeekTags | PythonicTags | ActionTags):
            return lark_grammar(self.call_tags.auto_lark(self.tools, self.parallel), "tools")
        if self.choice == "auto" and isinstance(self.call_tags, ListTags):
            return lark_grammar(self.call_tags.auto_lark(self._one_call("arguments"), self.parallel), "tools")
        if self.choice == "auto" and self.parser in XML_FORMATS:
            tokens = self.call_tags.tags if isinstance(self.call_tags, BlockTokens) else frozenset()
            calls = call_lark(self.tools, XML_FORMATS[self.parser], tokens)
            return lark_grammar(self._auto_tagged(more) + calls, "tools")
        if self.choice == "auto" and self.parser == PYTHONIC:
            return lark_grammar(pythonic.bare_auto_lark(self.tools, self.parallel), "tools")
        if self.choice == "auto":
            return lark_grammar(AUTO_LLAMA3.format(call=json_lark(self._one_call("parameters"))), "tools")
        if self.parser in TAGGED:  # none
            return lark_grammar(NONE_HERMES.format(open_regex=_in_regex(block_tags(self.parser)[0])), "tools")
        if self.parser in DEEPSEEK_FORMATS:
            return lark_grammar(deepseek.NONE, "tools")
        if isinstance(self.call_tags, ActionTags):  # a response, which opens with a tag of its own
            return lark_grammar(self.call_tags.none_lark(), "tools")
        if self.parser in SPECIAL_TAGS:
            return lark_grammar(NONE_SPECIAL, "tools")
        return None  # none in Llama 3's format: a call would be a JSON answer, which text may be

    def _auto_tagged(self, more: str) -> str:
        """`auto`'s rules around the format's blocks: their tags named as tokens where they are ones."""
        opening, closing = block_tags(self.parser)
        tagged = dict(more=more, open_regex=_in_regex(opening))
        if isinstance(self.call_tags, BlockTokens) and self.call_tags.has(opening, closing):
            return AUTO_TAG_TOKENS.format(open=opening, close=closing, **tagged)
        return AUTO_TAGGED.format(open=json.dumps(opening), close=json.dumps(closing), **tagged)

    def _harmony_grammar(self) -> str | None:
        if self.choice == "none":
            return final_answer(None)
        if self.choice == "auto":
            return None
        names = [self.function] if self.choice == "function" else [_name(tool) for tool in self.tools]
        return call_grammar({name: parameters(self._tool(name)) for name in names})

    def _tool(self, name: str) -> dict[str, Any]:
        return next(tool for tool in self.tools if tool["function"]["name"] == name)

    def _one_call(self, arguments: str) -> dict[str, Any]:
        """One call of any of the tools, as `{"name": ..., arguments: {...}}` (the name first); the
        definitions each tool's parameters refer to moved to this schema's root (definitions_under)."""
        calls, definitions = [], {}
        for i, tool in enumerate(self.tools):
            schema, moved = definitions_under(parameters(tool), f"tool{i}_")
            definitions |= moved
            calls.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": tool["function"]["name"]}, arguments: schema},
                    "required": ["name", arguments],
                    "additionalProperties": False,
                }
            )
        return {"anyOf": calls, **({"$defs": definitions} if definitions else {})}


def block_tags(parser: str) -> tuple[str, str]:
    """The tags around each call of a `<tool_call>` format (TAGGED): Hermes's, or an XML format's own."""
    form = XML_FORMATS.get(parser)
    return (form.block_open, form.block_close) if form is not None else (HERMES_OPEN, HERMES_CLOSE)


def _in_regex(tag: str) -> str:
    """A tag as it stands in a Lark regex (between slashes)."""
    return re.escape(tag).replace("/", "\\/")


def tool_parser(template_source: str, harmony: bool, tokenizer: PromptTokenizer, forced: str = "auto") -> str:
    """How a model's answers hold calls: gpt-oss's harmony messages (`harmony`: the server reads them,
    answers.HarmonyReader), else the `forced` one of TOOL_CALL_PARSERS (--tool-call-parser), else the
    format the template teaches: Gemma 4's or FunctionGemma's notation where it writes its `<|tool_call>` or
    `<start_function_call>` token (notation_tool_calls.py); Jamba's, Nemotron Nano 2's or Phi-4-mini's where
    it writes `<tool_calls>`, `<TOOLCALL>` or `<|tool_call|>` with a tokenizer that has `<|/tool_call|>`
    too, or takes the tools in the system message (listed_tool_calls.py); Mistral's or Granite 3's where it
    writes their `[TOOL_CALLS]` or `<|tool_call|>` token (mistral_tool_calls.py); LFM2's where it writes its
    `<|tool_call_start|>` (pythonic_tool_calls.py); DeepSeek's where it writes its `<｜tool▁calls▁begin｜>`
    (deepseek_tool_calls.py); Cohere's where it writes its `<|START_ACTION|>` (cohere_tool_calls.py); XML
    where it writes Qwen3-Coder's `<function=...>` or GLM-4.5's `<arg_key>` (xml_tool_calls.py); Llama 3's
    JSON where it has the python tag; else Hermes blocks."""
    if harmony:
        return "harmony"
    if forced != "auto":
        return PARSER_ALIASES.get(forced, forced)
    for notation in NOTATIONS.values():
        if notation.is_taught(template_source, tokenizer):
            return notation.name
    list_format = listed.template_format(template_source, tokenizer)  # before Granite's: Phi's opens as it
    if list_format is not None:
        return list_format
    for name, opening in CALL_TAG_FORMATS.items():
        if mistral.writes_calls(opening, template_source, tokenizer):
            return name
    if pythonic.writes_lfm2(template_source, tokenizer):
        return LFM2
    deepseek_format = deepseek.template_format(template_source, tokenizer)
    if deepseek_format is not None:
        return deepseek_format
    if cohere.writes_actions(template_source, tokenizer):
        return COHERE
    xml = template_format(template_source)
    if xml is not None:
        return xml.name
    return "llama3_json" if LLAMA3_PYTHON_TAG in template_source else "hermes"


def read_tool_request(
    data: dict[str, Any],
    parser: str,
    parallel: bool = True,
    call_tags: FormatTags | None = None,
) -> ToolRequest | None:
    """`tools` and `tool_choice` in OpenAI chat's shapes, checked (a 400 naming what is wrong); None
    without tools. The other APIs put theirs in these shapes. `parser`: how the answer holds calls
    (tool_parser). `parallel`: more than one call allowed. `call_tags`: the tokenizer's tags for the
    format (Serving.call_tags)."""
    tools = data.get("tools")
    choice = data.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise InvalidParams("tool_choice", "tool_choice needs tools")
        return None
    tools = read_tool_list(tools, _tool, _name, "{type: function, function: {...}} objects")
    names = [_name(tool) for tool in tools]
    if choice is None or choice in ("none", "auto", "required"):
        return ToolRequest(tools, choice or "auto", parser=parser, parallel=parallel, call_tags=call_tags)
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
    return ToolRequest(tools, "function", name, parser, parallel, call_tags)


def with_tool_grammar(params: SamplingParams, tools: ToolRequest | None, format_param: str) -> SamplingParams:
    """`params` decoded under the tools' grammar (ToolRequest.grammar). A request that also asks for an
    output format (`format_param`, which set params.grammar): a 400 if the call is forced, which cannot
    be both; with `auto`, the format's grammar, and calls are read from the text as written."""
    if tools is None:
        return params
    special_blocks = isinstance(tools.call_tags, BlockTokens) and tools.call_tags.special
    if (tools.parser in SPECIAL_TAGS or special_blocks) and tools.choice == "auto":  # special tags: kept
        params = replace(params, skip_special_tokens=False)
    if params.grammar is not None:
        if tools.choice in ("function", "required"):
            raise InvalidParams(
                "tool_choice", f"a required or named tool_choice cannot be combined with {format_param}"
            )
        return params
    grammar = tools.grammar
    return params if grammar is None else replace(params, grammar=grammar)


def read_tool_list(
    value: Any,
    read_tool: Callable[[Any, str], dict[str, Any]],
    name_of: Callable[[dict[str, Any]], str],
    shape: str,
) -> list[dict[str, Any]]:
    """A `tools` list in an API's shape: each tool read by `read_tool` (a 400 naming `tools[i]...`), at
    most MAX_TOOLS, no two of one name (`name_of`). `shape`: what the 400 says a tool is."""
    if not isinstance(value, list):
        raise InvalidParams("tools", f"tools must be a list of {shape}")
    if len(value) > MAX_TOOLS:
        raise InvalidParams("tools", f"tools takes at most {MAX_TOOLS} tools, got {len(value)}")
    tools = [read_tool(tool, f"tools[{i}]") for i, tool in enumerate(value)]
    names = [name_of(tool) for tool in tools]
    if len(set(names)) < len(names):
        raise InvalidParams("tools", "tools must have different names")
    return tools


def name_and_description(fields: dict[str, Any], param: str) -> tuple[str, str | None]:
    """A function's `name` (1 to 64 of a-z, A-Z, 0-9, _ -, as OpenAI's and Anthropic's) and `description`
    (a string, or none), from `fields` at `param` in its API's terms; a 400 naming the one that is bad."""
    name = fields.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise InvalidParams(f"{param}.name", f"{param}.name must be 1 to 64 of a-z, A-Z, 0-9, _ -")
    description = fields.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidParams(f"{param}.description", f"{param}.description must be a string")
    return name, description


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _name(tool: dict[str, Any]) -> str:
    return tool["function"]["name"]


def _tool(tool: Any, param: str) -> dict[str, Any]:
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or not isinstance(tool.get("function"), dict)
    ):
        raise InvalidParams(param, f'{param} must be {{"type": "function", "function": {{"name", ...}}}}')
    function = tool["function"]
    name_and_description(function, f"{param}.function")
    schema = function.get("parameters")
    if schema is not None:
        if not isinstance(schema, dict):
            raise InvalidParams(
                f"{param}.function.parameters", f"{param}.function.parameters must be a JSON schema"
            )
        json_schema_grammar(schema, f"{param}.function.parameters")  # a 400 if it cannot be enforced
    return tool


def tools_system_prompt(tools: list[dict[str, Any]], parser: str = "hermes") -> str:
    """For a template that takes no tools: the instructions of the format the answer is read in
    (`parser`), in a system message: DeepSeek's model card's for its formats, else the Hermes ones."""
    if parser in DEEPSEEK_FORMATS:
        return deepseek.tools_system_prompt(tools, fenced=parser == deepseek.V3)
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You may call one or more functions to answer. The functions are, one JSON object a line:\n"
        f"<tools>\n{listing}\n</tools>\n"
        f'To call one, answer with {HERMES_OPEN}{{"name": <function name>, "arguments": <arguments '
        f"object>}}{HERMES_CLOSE}"
    )


def template_messages(
    messages: list[dict[str, Any]], template_source: str, parser: str = "hermes"
) -> list[dict[str, Any]]:
    """Assistant turns with tool calls as the template takes them: `tool_calls` with their arguments as
    objects (transformers' templates expect them so), their ids as Mistral's take them in its format;
    for a template that knows no tool calls, the calls written into the content in the Hermes format (in
    a JSON list format's, Phi-4-mini's, its own). A tool turn without a `name` gets that of the function
    whose call it answers (by `tool_call_id`): templates that write results by name (FunctionGemma's,
    Gemma 4's; transformers' convention) need it, and OpenAI's tool messages carry only the id."""
    if parser == MISTRAL:
        messages = mistral.history_ids(messages)
    knows_tool_calls = "tool_calls" in template_source
    called: dict[str, str] = {}  # each call's id, and the function it called
    shaped = []
    for message in messages:
        calls = message.get("tool_calls")
        called |= {call["id"]: call["function"].get("name") for call in calls or () if call.get("id")}
        if message["role"] == "tool" and "name" not in message and called.get(message.get("tool_call_id")):
            shaped.append({**message, "name": called[message["tool_call_id"]]})
        elif not calls:
            shaped.append(message)
        elif knows_tool_calls:
            shaped.append({**message, "tool_calls": [_arguments_object(call) for call in calls]})
        else:
            written = (
                listed.written_calls(calls, parser)
                if parser in LIST_FORMATS
                else "".join(hermes_call(call["function"]) for call in calls)
            )
            shaped.append({"role": message["role"], "content": message["content"] + written})
    return shaped


def _arguments_object(call: dict[str, Any]) -> dict[str, Any]:
    """A call with its arguments, where they are an object, as ArgumentsObject (whichever API sent it)."""
    function = call["function"]
    if not isinstance(function.get("arguments"), dict):
        return call
    return {**call, "function": {**function, "arguments": ArgumentsObject(function["arguments"])}}


def hermes_call(function: dict[str, Any]) -> str:
    call = {"name": function["name"], "arguments": function["arguments"]}
    return f"{HERMES_OPEN}{json.dumps(call, ensure_ascii=False)}{HERMES_CLOSE}"


class ArgumentsObject(dict):
    """A call's arguments as chat templates take them: an object, whose items transformers' templates read
    or which they write `| tojson`; DeepSeek's, which add it to text, get its JSON (a plain dict there
    would fail the template), as does one that writes it as it is (rather than as Python's repr)."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other: Any) -> Any:
        return str(self) + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other: Any) -> Any:
        return other + str(self) if isinstance(other, str) else NotImplemented


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
            parsed = json_text.loads(arguments)
        except ValueError:
            raise InvalidParams(
                f"{param}[{i}].function.arguments", "the arguments must be a JSON string"
            ) from None
        calls.append(
            {"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": parsed}}
        )
    return calls


def new_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {
        "id": call_id or "call_" + uuid.uuid4().hex[:24],
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
        return self._content(released)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content not yet sent, the tool calls)."""
        calls = None if self.call_start is None else self._calls(self.text[self.call_start :])
        if not calls:
            return self._content(self.text[self.sent :]), []
        rest = self._content(self.text[self.sent : self.call_start])
        return rest, calls if self.request.parallel else calls[:1]

    def _content(self, text: str) -> str:
        """Text as content: Cohere's without its response's tags (kept in the text, as the format's are)."""
        return cohere.answer_text(text) if self.request.parser == COHERE else text

    @property
    def _tags(self) -> tuple[str, str] | None:
        """The tags a call is between (Hermes's, also the XML formats', or a notation's); None for Mistral's,
        which has no closing tag, and Llama 3's bare JSON."""
        notation = NOTATIONS.get(self.request.parser)
        if notation is not None:
            return notation.open, notation.close
        return block_tags(self.request.parser) if self.request.parser in TAGGED else None

    @property
    def _opening(self) -> str | None:
        """The tag that opens the calls; None for Llama 3's bare JSON and `pythonic`'s bare list."""
        if self.request.parser in OWN_READERS:
            return OWN_READERS[self.request.parser][0]
        return LISTED_OPENINGS.get(self.request.parser) or (self._tags or (None,))[0]

    def _find_call_start(self) -> None:
        if self._opening is not None:
            at = self.text.find(self._opening)
            self.call_start = at if at >= 0 else None
            return
        stripped = self.text.lstrip()
        if stripped:  # Llama 3, `pythonic`: the calls are the whole answer, or there are none
            openings = BARE_OPENINGS.get(self.request.parser, BARE_OPENINGS["llama3_json"])
            if stripped.startswith(tuple(opening[: len(stripped)] for opening in openings)):
                self.call_start = len(self.text) - len(stripped)
            else:
                self.no_call = True

    def _held_back(self) -> int:
        """How much of the end might begin a call (not sent until the next text says)."""
        if self._opening is None:  # Llama 3, `pythonic`, undecided: only whitespace so far
            return len(self.text)
        return longest_partial_match(self.text, (self._opening,))

    def _calls(self, text: str) -> list[dict[str, Any]] | None:
        choice = self.request.choice
        if choice == "function":  # the answer is the arguments, whole or cut by max_tokens: a call either way
            return [new_call(self.request.function, text)]
        if choice == "required":
            return _required_call(text)
        if self.request.parser in OWN_READERS:
            calls = OWN_READERS[self.request.parser][1](text)
            return None if calls is None else [new_call(*call) for call in calls]
        opening = LISTED_OPENINGS.get(self.request.parser)
        if opening is not None:
            calls = mistral.read_calls(text, opening)
            if calls is None:
                return None
            if self.request.parser == MISTRAL:  # ids as Mistral's templates take them back
                return [new_call(*call, mistral.new_call_id()) for call in calls]
            return [new_call(*call) for call in calls]
        if self._tags is not None:
            opening, closing = self._tags
            pattern = re.escape(opening) + r"(.*?)(?:" + re.escape(closing) + r"|$)"
            calls = [self._tagged_call(block) for block in re.findall(pattern, text, re.S)]
            return None if None in calls else [call for found in calls for call in found]
        if self.request.parser == PYTHONIC:
            calls = pythonic.read_list(text)
            return None if calls is None else [new_call(*call) for call in calls]
        try:
            call = json_text.loads(text.strip().removeprefix(LLAMA3_PYTHON_TAG))
            return [new_call(call["name"], json.dumps(call.get("parameters", {}), ensure_ascii=False))]
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def _tagged_call(self, block: str) -> list[dict[str, Any]] | None:
        """A block's call: in JSON (Hermes), XML, or Gemma 4's or FunctionGemma's notation."""
        form = XML_FORMATS.get(self.request.parser)
        if self.request.parser in NOTATIONS:
            found = notation_tool_calls.read_call(block, NOTATIONS[self.request.parser])
        elif form is not None:
            found = read_call(block, self.request.tools, form)
        else:
            return _hermes_call(block)
        return None if found is None else [new_call(*found)]


def _hermes_call(block: str) -> list[dict[str, Any]] | None:
    """A `<tool_call>` block's call: whole, or cut by max_tokens after its name (as `required`'s)."""
    try:
        call = json_text.loads(block)
        return [new_call(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False))]
    except (ValueError, KeyError, TypeError, AttributeError):
        return _required_call(block.strip())


def _required_call(text: str) -> list[dict[str, Any]] | None:
    """`required`'s answer as the call it is; cut by max_tokens after the name, the call with what was
    written of its arguments; cut before it, none."""
    try:
        call = json_text.loads(text)
        return [new_call(call["name"], json.dumps(call["arguments"], ensure_ascii=False))]
    except (ValueError, KeyError, TypeError):  # not whole JSON (a JSONDecodeError is a ValueError)
        cut = REQUIRED_CALL_CUT.match(text)
        return [new_call(json.loads(cut["name"]), cut["arguments"])] if cut else None
