"""Cohere's tool calls (tool_calls.py's `cohere_command4` format, SGLang's name for it): Command R7B's and
Command A's answers are marked out by special tokens, a plan first if the model makes one, then either
actions or a response:

    <|START_THINKING|>I will look up the weather.<|END_THINKING|><|START_ACTION|>[
        {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}
    ]<|END_ACTION|>

    <|START_RESPONSE|>It is sunny in Paris.<|END_RESPONSE|>

The plan is the model's thoughts (reasoning.COHERE_TAGS: `reasoning_content`), the actions the calls,
and the response the answer, its two tags left out of the text (`answer_text`). The tags are tokens of
their own in Cohere's tokenizers; the grammars name them by id, so a format is made for one tokenizer
(`ActionTags`). Under `auto` the answer is a response or actions, under `none` a response: a grammar of
free text would refuse the response's own opening tag, which every answer of these models starts with.
The template takes the tools and writes calls and results itself.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from inference_api.mistral_tool_calls import listed_calls
from inference_api.structured_output import json_lark
from inference_api.tokenizer import PromptTokenizer, are_tokens

NAME = "cohere_command4"
ACTION_OPEN, ACTION_CLOSE = "<|START_ACTION|>", "<|END_ACTION|>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<|START_RESPONSE|>", "<|END_RESPONSE|>"
PLAN_OPEN, PLAN_CLOSE = "<|START_THINKING|>", "<|END_THINKING|>"
TAGS = (ACTION_OPEN, ACTION_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE, PLAN_OPEN, PLAN_CLOSE)
# An action cut by max_tokens in its parameters: its name, and the parameters as written.
CUT_ACTION = re.compile(
    r'\A\{\s*"tool_call_id":\s*"\d*",\s*"tool_name":\s*("(?:[^"\\]|\\.)*"),\s*"parameters":\s*(.*)\Z', re.S
)


def writes_actions(template_source: str, tokenizer: PromptTokenizer) -> bool:
    """Whether a chat template writes Cohere's actions, and the tokenizer has all its tags as tokens."""
    return ACTION_OPEN in template_source and are_tokens(TAGS, tokenizer)


def answer_text(text: str) -> str:
    """An answer's text without the response's tags around it."""
    return text.replace(RESPONSE_OPEN, "").replace(RESPONSE_CLOSE, "")


@dataclass(frozen=True)
class ActionTags:
    """The ids of the tags (TAGS, in that order) in a tokenizer."""

    action_open: int
    action_close: int
    response_open: int
    response_close: int
    plan_open: int
    plan_close: int

    @classmethod
    def of(cls, tokenizer: PromptTokenizer) -> ActionTags | None:
        """The tokenizer's tags; None where they are not tokens of its own."""
        if not are_tokens(TAGS, tokenizer):
            return None
        return cls(*(tokenizer.token_id(tag) for tag in TAGS))

    def auto_lark(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar of `auto`'s answers: a plan or not, then a response or a list of actions (one
        only unless `parallel`), each a call of one of the tools with parameters its schema takes, laid out
        as the template writes them."""
        more = ' ("," WS? action)*' if parallel else ""
        names = " | ".join(f"function_{i}" for i in range(len(tools)))
        rules = [
            "start: plan? (response | actions)",
            f'actions: <[{self.action_open}]> WS? "[" WS? action{more} WS? "]" WS? <[{self.action_close}]>',
            f'action: "{{\\"tool_call_id\\": \\"" ID "\\", \\"tool_name\\": " ({names}) "}}"',
            *(_function(i, tool["function"]) for i, tool in enumerate(tools)),
            "ID: /[0-9]{1,3}/",
        ]
        return "\n".join(rules) + "\n" + self._text_rules()

    def none_lark(self) -> str:
        """A Lark grammar of `none`'s answers: a plan or not, then a response."""
        return "start: plan? response\n" + self._text_rules()

    def _text_rules(self) -> str:
        return (
            f"plan: <[{self.plan_open}]> TEXT? <[{self.plan_close}]>\n"
            f"response: <[{self.response_open}]> TEXT? <[{self.response_close}]>\n"
            "TEXT: /(?s:.+)/\n"
            "WS: /[ \\n]{1,12}/\n"
        )


def _function(i: int, function: dict[str, Any]) -> str:
    name, schema = json.dumps(function["name"]), function.get("parameters") or {"type": "object"}
    return f'function_{i}: {json.dumps(name + ", ")} "\\"parameters\\": " {json_lark(schema)}'


def read_calls(text: str) -> list[tuple[str, str]] | None:
    """The actions in `text` from its first ACTION_OPEN on, as (name, parameters as a JSON string); an
    action cut by max_tokens keeps what was written of its parameters. None where they do not read as
    actions."""
    listed = text.split(ACTION_OPEN, 1)[1].split(ACTION_CLOSE, 1)[0]
    return listed_calls(listed, "tool_name", "parameters", CUT_ACTION)
