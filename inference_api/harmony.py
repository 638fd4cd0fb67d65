"""gpt-oss's answers in OpenAI's harmony format: messages on channels, read apart as thoughts, content
and tool calls, and the grammars that put a constrained answer on the right channel.

After a prompt that ends with `<|start|>assistant`, gpt-oss writes messages such as

    <|channel|>analysis<|message|>The user asks for the weather.<|end|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

or ends with a call: `<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
{"city": "Paris"}<|call|>` (the recipient may be in the role's part of the header too, as the chat
template writes earlier calls: `<|start|>assistant to=functions.get_weather<|channel|>commentary json`).
`analysis` is the thoughts, `final` the answer, `commentary` the calls and the preambles a user may see.
The markers are special tokens: the text is read with them (skip_special_tokens false), and they go.
`<|return|>` and `<|call|>` are the model's end tokens, so the text never holds them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from backend.messages import SamplingParams
from inference_api.structured_output import grammar_around, json_lark
from inference_api.tokenizer import PromptTokenizer, are_tokens

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
CALL, RETURN = "<|call|>", "<|return|>"
# What ends a message's text: its end marker, an end token the stop did not take (ignore_eos), or a
# next message's start the model wrote without ending this one.
MESSAGE_ENDS = (END, CALL, RETURN, START)
FUNCTIONS = "functions."  # the recipient's prefix of a call to one of the request's tools
# A header longer than this is not one: the model writes no harmony (another model under this
# template), and its text is the content as written.
MAX_HEADER = 256
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
RECIPIENT = re.compile(r"\bto=([^\s<]+)")

# Lark, for llguidance: the markers are the special tokens' names. Thoughts are any number of analysis
# messages before the answer's own message (a grammar that constrains an answer must let the model
# think first, as it was trained to).
THOUGHTS = r"""thoughts: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant"
THOUGHT: /(?s:.*)/
"""
FINAL_THEN = 'start: thoughts* <|channel|> "final" <|message|> @ANSWER\n' + THOUGHTS
FINAL_TEXT = 'start: thoughts* <|channel|> "final" <|message|> TEXT?\nTEXT: /(?s:.+)/\n' + THOUGHTS
GRAMMAR_NAME = "harmony_messages"  # marks a grammar that already places the answer in its message
# What opens the answer's own message after the prompt's `<|start|>assistant`: a prefill follows it.
ANSWER_OPENED = CHANNEL + "final" + MESSAGE


def writes_harmony(tokenizer: PromptTokenizer, template_source: str) -> bool:
    """Whether the model writes harmony messages: its template writes channels, and its tokenizer has
    the markers as tokens of their own (gpt-oss's)."""
    return CHANNEL in template_source and are_tokens((START, CHANNEL, MESSAGE, END), tokenizer)


@dataclass(frozen=True)
class Header:
    """What a message's header says of its text: the channel it is on and who it is for."""

    channel: str | None
    recipient: str | None

    @classmethod
    def read(cls, text: str) -> Header:
        channel, recipient = CHANNEL_NAME.search(text), RECIPIENT.search(text)
        return cls(channel and channel[1], recipient and recipient[1])

    @property
    def function(self) -> str | None:
        """The function called, for a message to one of the request's tools."""
        if self.recipient is None or not self.recipient.startswith(FUNCTIONS):
            return None
        return self.recipient[len(FUNCTIONS) :]


def prefilled_answer(prefill: str) -> str:
    """A prefill (text the answer goes on from) as gpt-oss writes an answer: in the final message, which
    the prompt opens. Right after `<|start|>assistant` it would be read as the message's header."""
    return ANSWER_OPENED + prefill


def harmony_params(
    params: SamplingParams, answer_grammar: bool, tokenizer: PromptTokenizer
) -> SamplingParams:
    """`params` for a harmony answer: decoded with its markers, ended at `<|return|>` and `<|call|>`
    whatever the model's end tokens are (a GGUF file's may lack `<|call|>`: the model would go on to
    write the call's result itself), and the answer's grammar, if it constrains the answer (a JSON
    format), the final message's (`final_answer`; the tools' grammars place theirs)."""
    ends = tuple(token for token in map(tokenizer.special_token_id, (RETURN, CALL)) if token is not None)
    params = replace(params, skip_special_tokens=False, stop_token_ids=(*params.stop_token_ids, *ends))
    if answer_grammar and params.grammar is not None and not places_answer(params.grammar):
        params = replace(params, grammar=final_answer(params.grammar))
    return params


def places_answer(grammar: str) -> bool:
    """Whether a grammar is one of this module's: it says which message the answer is in."""
    return json.loads(grammar)["grammars"][0].get("name") == GRAMMAR_NAME


def final_answer(grammar: str | None) -> str:
    """A grammar for the final message, after any thoughts: the answer's own grammar (a JSON schema's),
    or None for free text (no call: tool_choice none)."""
    if grammar is None:
        return _named_lark(FINAL_TEXT)
    return grammar_around(grammar, FINAL_THEN, GRAMMAR_NAME)


def call_grammar(functions: dict[str, dict[str, Any]]) -> str:
    """A grammar for a call, after any thoughts, to one of these functions (name: parameters' schema),
    its arguments valid: for tool_choice `required`, or a named function (one)."""
    calls, rules = [], []
    for i, (name, schema) in enumerate(functions.items()):
        calls.append(f"call_{i}")
        header = json.dumps(f"commentary to={FUNCTIONS}{name} ")
        rules.append(f'call_{i}: {header} <|constrain|> "json" <|message|> arguments_{i}')
        rules.append(f"arguments_{i}: {json_lark(schema)}")
    lark = "start: thoughts* <|channel|> call\ncall: " + " | ".join(calls) + "\n" + "\n".join(rules)
    return _named_lark(lark + "\n" + THOUGHTS)


def _named_lark(lark: str) -> str:
    return json.dumps({"grammars": [{"name": GRAMMAR_NAME, "lark_grammar": lark}]})
