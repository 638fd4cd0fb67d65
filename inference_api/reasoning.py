"""A reasoning model's thoughts apart from its answer: chat's `reasoning_content`, Anthropic's thinking
blocks, the Responses API's reasoning items.

Qwen3, DeepSeek-R1 and SmolLM3 think between `<think>` and `</think>`, then answer. Left in the text,
the thoughts reach a chat client's user and the next turn's prompt; so, as vLLM's `--reasoning-parser`
and llama.cpp's `--reasoning-format` do, the chat APIs give them apart from the answer (chat
completions as `reasoning_content` beside `content`; in a stream, deltas of either). A template may
open the block itself (DeepSeek-R1's later ones end the prompt with `<think>`), or close it at once to
turn thinking off (Qwen3's `enable_thinking: false` ends it with `<think>\n\n</think>`): the prompt's
end says where the answer starts. The whitespace around the thoughts is the tags' layout, not the
text's: it goes. gpt-oss writes its thoughts as harmony messages on a channel of their own (harmony.py):
its prompt's thinking is HARMONY, and answers.HarmonyReader reads them. Gemma 4 writes
`<|channel>thought\n...<channel|>`, and Mistral's reasoning models (Magistral, Ministral 3's) `[THINK]...
[/THINK]`, their tags special tokens: the answer is decoded with them kept (skip_special_tokens false,
as for harmony), and a grammar names them as tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from backend.engine.stop_matcher import longest_partial_match
from backend.messages import SamplingParams
from inference_api.harmony import harmony_params, places_answer, writes_harmony
from inference_api.structured_output import grammar_around
from inference_api.tokenizer import PromptTokenizer, are_tokens


@dataclass(frozen=True)
class ThoughtTags:
    """How a model sets its thoughts apart: `opening` and `close` around them, and `name`, text after
    the opening tag that names them (Gemma 4's channel, `thought`). `special`: the tags are special
    tokens, which a decoded answer leaves out unless it keeps them. `answer`: special tokens of the model's
    around its answer (Cohere's response tags), which the answer kept for the thoughts' tags leaves out."""

    opening: str
    close: str
    special: bool = False
    name: str = ""
    answer: tuple[str, ...] = ()

    @property
    def open(self) -> str:
        return self.opening + self.name


THINK_TAGS = ThoughtTags("<think>", "</think>")
GEMMA4_TAGS = ThoughtTags("<|channel>", "<channel|>", special=True, name="thought")
MISTRAL_TAGS = ThoughtTags("[THINK]", "[/THINK]", special=True)
# Command R7B's and Command A's plan (cohere_tool_calls.py), before a response between tags of its own.
COHERE_TAGS = ThoughtTags(
    "<|START_THINKING|>", "<|END_THINKING|>", special=True, answer=("<|START_RESPONSE|>", "<|END_RESPONSE|>")
)
# vLLM's names: `deepseek_r1` and `qwen3` read `<think>` blocks (and `glm45`, `olmo3` and `deepseek_v3`,
# its names for GLM-4.5's, OLMo 3's and DeepSeek-V3.1's, which write them too), `gemma4` Gemma 4's thought
# channel, `mistral` Mistral's [THINK] blocks, `openai_gptoss` gpt-oss's harmony messages; SGLang's
# `cohere_command4` Cohere's plans.
REASONING_PARSERS = (
    "auto", "none", "deepseek_r1", "qwen3", "glm45", "olmo3", "deepseek_v3", "gemma4", "mistral",
    "openai_gptoss", "cohere_command4",
)  # fmt: skip
# How a model writes its thoughts (reasoning_format): in blocks between tags, or as harmony messages.
THINK_BLOCKS, GEMMA4_THOUGHTS, MISTRAL_THOUGHTS = "think_blocks", "gemma4_thoughts", "mistral_thoughts"
COHERE_THOUGHTS = "cohere_thoughts"
HARMONY = "harmony"
BLOCK_TAGS = {
    THINK_BLOCKS: THINK_TAGS,
    GEMMA4_THOUGHTS: GEMMA4_TAGS,
    MISTRAL_THOUGHTS: MISTRAL_TAGS,
    COHERE_THOUGHTS: COHERE_TAGS,
}
NAMED_FORMATS = {
    "none": None, "gemma4": GEMMA4_THOUGHTS, "mistral": MISTRAL_THOUGHTS, "cohere_command4": COHERE_THOUGHTS
}  # fmt: skip
PROMPT_END_TOKENS = 8  # the prompt's last tokens, decoded, tell whether it opened the block
OPENED, CLOSED, NEITHER = "opened", "closed", "neither"  # where a prompt leaves the thoughts (prompt_end)
# A harmony prompt that a prefill ends inside the final message (harmony.prefilled_answer): the answer
# goes on in that message, past any thoughts.
HARMONY_PREFILLED = "harmony_prefilled"
# Lark, for llguidance: the thoughts are any text up to the first `</think>`, then the answer's grammar
# (`@ANSWER`, a grammar of its own, with its own lexer). The whitespace between is the tags' layout.
THOUGHTS_THEN = r"""start: THOUGHTS WS? @ANSWER
THOUGHTS: /(?s:.*)<\/think>/ & ~/(?s:.*)<\/think>(?s:.+)/
WS: /[ \n]+/
"""
MAYBE_THOUGHTS_THEN = r"""start: (WS? BLOCK WS?)? @ANSWER
BLOCK: /<think>(?s:.*)<\/think>/ & ~/(?s:.*)<\/think>(?s:.+)/
WS: /[ \n]+/
"""
# The same where the tags are tokens llguidance takes as special (tokenizer.are_grammar_tokens: Gemma 4's
# and Mistral's, and `<think>` where it is a token, as in Qwen3's and DeepSeek-R1's tokenizers), which it
# matches by the vocabulary: text, which holds none, up to the closing tag. {opening} and {close} are the
# tags as tokens (token_name), {name} the thoughts' name, if they have one.
SPECIAL_THOUGHTS_THEN = r"""start: THOUGHTS? {close} WS? @ANSWER
THOUGHTS: /(?s:.+)/
WS: /[ \n]+/
"""
SPECIAL_MAYBE_THOUGHTS_THEN = r"""start: (WS? {opening}{name} THOUGHTS? {close} WS?)? @ANSWER
THOUGHTS: /(?s:.+)/
WS: /[ \n]+/
"""


@dataclass(frozen=True)
class Blocks:
    """Where a chat prompt leaves the thought blocks of a model that writes them between `tags`:
    `where` is OPENED, CLOSED or NEITHER (prompt_end). `tokens`: the tags are tokens that llguidance
    takes as special (tokenizer.are_grammar_tokens), which a grammar names as tokens and no text of a
    grammar holds."""

    tags: ThoughtTags
    where: str
    tokens: bool = False


# A chat prompt's thinking (Serving.prompt_thinking): Blocks, or HARMONY / HARMONY_PREFILLED.
Thinking = Blocks | str


def reasoning_format(parser: str, tokenizer: PromptTokenizer, template_source: str) -> str | None:
    """How chat answers are read for thoughts: THINK_BLOCKS, GEMMA4_THOUGHTS, HARMONY, or None (not
    read). `auto` reads harmony where the model writes it (harmony.writes_harmony), and blocks where the
    model has their tags as tokens of their own and its chat template writes one of them (a reasoning
    model's opens or closes a block, or takes one out of an earlier turn); vLLM's names always read their
    format, `none` nothing."""
    if parser == "openai_gptoss":
        return HARMONY
    if parser != "auto":
        return NAMED_FORMATS.get(parser, THINK_BLOCKS)
    if writes_harmony(tokenizer, template_source):
        return HARMONY
    for kind, tags in BLOCK_TAGS.items():
        written = tags.opening in template_source or tags.close in template_source
        if written and are_tokens((tags.opening, tags.close), tokenizer):
            return kind
    return None


def prompt_end(prompt_ids: list[int], tokenizer: PromptTokenizer, tags: ThoughtTags = THINK_TAGS) -> str:
    """Where a chat prompt leaves the thoughts: OPENED, it ends inside a block (the answer starts with
    thoughts); CLOSED, right after a block's closing tag (as Qwen3's template closes an empty one to turn
    thinking off: the answer is all answer); else NEITHER (the model may open one)."""
    end = tokenizer.decode(prompt_ids[-PROMPT_END_TOKENS:], skip_special_tokens=False).rstrip()
    if end.endswith(tags.open):
        return OPENED
    return CLOSED if end.endswith(tags.close) else NEITHER


def thought_tokens(thoughts: str, tokenizer: PromptTokenizer) -> int:
    """The thoughts' tokens for `usage`: their text encoded again (the tags and the whitespace around
    them, which the text leaves out, not counted)."""
    return len(tokenizer.encode(thoughts, add_special_tokens=False)) if thoughts else 0


def thoughts_first(
    params: SamplingParams, thinking: Thinking | None, answer_grammar: bool, tokenizer: PromptTokenizer
) -> SamplingParams:
    """`params` whose grammar, if it constrains the answer (`answer_grammar`: a JSON format or a forced
    tool call, not a raw regex or grammar that constrains the text as written), waits for a reasoning
    model's thoughts to end (`after_thoughts`), unless the prompt closed them (`thinking`: Blocks, or
    HARMONY, harmony.harmony_params; None: not read). Where the tags are special tokens, which no grammar
    of the text could name, every grammar waits, and the answer keeps them. A prefilled harmony prompt
    is already in the final message, where a grammar that places the answer in a message (tool_choice
    none's) could not start: it goes, and a grammar of the text as written stays (a forced one is the
    API's 400). Where the tags are tokens that llguidance takes as special (Blocks.tokens: Qwen3's
    `<think>` too, which the tokenizer does not mark special), no grammar's text could hold them either:
    every grammar waits, naming them as tokens."""
    if thinking == HARMONY_PREFILLED:
        if params.grammar is not None and places_answer(params.grammar):
            params = replace(params, grammar=None)
        return harmony_params(params, False, tokenizer)
    if thinking == HARMONY:
        return harmony_params(params, answer_grammar, tokenizer)
    if thinking is None:
        return params
    if thinking.tags.special:
        params = replace(params, skip_special_tokens=False)
    if thinking.where == CLOSED or params.grammar is None or not (answer_grammar or thinking.tokens):
        return params
    grammar = after_thoughts(
        params.grammar, thinking.where == OPENED, thinking.tags, tokenizer, thinking.tokens
    )
    return replace(params, grammar=grammar)


def after_thoughts(
    grammar: str,
    opened: bool,
    tags: ThoughtTags = THINK_TAGS,
    tokenizer: PromptTokenizer | None = None,
    tokens: bool | None = None,
) -> str:
    """A grammar that constrains an answer (a JSON schema, a forced tool call), with a reasoning model's
    thoughts free before it, as vLLM applies structured outputs once the reasoning ends: the rest of an
    opened block, up to its closing tag, or (`opened` False) a block the model may open first. Without
    it, the answer's first token would be the grammar's, in the thoughts of a prompt that opened them.
    `tokenizer`: the one whose ids name special tags that are not `<...>` (token_name). `tokens`: the
    tags are tokens llguidance takes as special (Blocks.tokens; by default, where they are special)."""
    if tags.special if tokens is None else tokens:
        lark = SPECIAL_THOUGHTS_THEN if opened else SPECIAL_MAYBE_THOUGHTS_THEN
        name = f" {json.dumps(tags.name)}" if tags.name else ""
        opening, close = (token_name(tag, tokenizer) for tag in (tags.opening, tags.close))
        lark = lark.format(opening=opening, close=close, name=name)
    else:
        lark = THOUGHTS_THEN if opened else MAYBE_THOUGHTS_THEN
    return grammar_around(grammar, lark, "thoughts_then_answer")


def token_name(tag: str, tokenizer: PromptTokenizer | None) -> str:
    """A special token as a Lark grammar names it for llguidance: `<|channel>` by its text, which
    llguidance takes where it is between angle brackets; any other (Mistral's `[THINK]`) by its id,
    `<[id]>`."""
    if tag.startswith("<") and tag.endswith(">"):
        return tag
    token_id = None if tokenizer is None else tokenizer.token_id(tag)
    if token_id is None:
        raise ValueError(f"{tag} is not a token of this tokenizer")  # Serving.unreadable refused it at start
    return f"<[{token_id}]>"


class ReasoningReader:
    """One answer's text, fed as it comes, as (reasoning, content) that can go out now; `finish` gives
    the rest. Text that could still be a tag, or whitespace the tags' layout may drop, is held back."""

    def __init__(self, opened: bool = False, tags: ThoughtTags = THINK_TAGS):
        self._state = "thoughts_start" if opened else "answer_start"  # opened: by the prompt
        self._open, self._close = tags.open, tags.close
        self._answer_tags = tags.answer
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning = content = ""
        while True:
            if self._state == "answer_start":  # a block opens here, or there is none
                start = self._held.lstrip()
                if not start or self._open.startswith(start):
                    return reasoning, content
                if not start.startswith(self._open):
                    self._state = "content"
                    continue
                self._held, self._state = start[len(self._open) :], "thoughts_start"
            elif self._state == "thoughts_start":
                self._held = self._held.lstrip()
                if not self._held:
                    return reasoning, content
                self._state = "thoughts"
            elif self._state == "thoughts":
                end = self._held.find(self._close)
                if end < 0:
                    sure = self._held[: len(self._held) - longest_partial_match(self._held, (self._close,))]
                    sure = sure.rstrip()  # whitespace before the closing tag would go
                    reasoning, self._held = reasoning + sure, self._held[len(sure) :]
                    return reasoning, content
                reasoning += self._held[:end].rstrip()
                self._held, self._state = self._held[end + len(self._close) :], "answer_after_thoughts"
            elif self._state == "answer_after_thoughts":
                self._held = self._held.lstrip()
                if not self._held:
                    return reasoning, content
                self._state = "content"
            else:
                content, self._held = content + self._answer(self._held), ""
                return reasoning, content

    def read(self, text: str, last: bool) -> tuple[str, str]:
        """`feed`, and `finish` too with the answer's last text."""
        reasoning, content = self.feed(text)
        if not last:
            return reasoning, content
        more, rest = self.finish()
        return reasoning + more, content + rest

    def finish(self) -> tuple[str, str]:
        """What is held back at the answer's end: an unfinished tag is text, as written."""
        held, self._held = self._held, ""
        if self._state == "thoughts":
            return held.rstrip(), ""
        if self._state == "answer_start":
            return "", self._answer(held)
        return "", ""

    def _answer(self, text: str) -> str:
        """Text of the answer without the tags the model writes around it (ThoughtTags.answer), each a
        token of its own, whose text comes whole."""
        for tag in self._answer_tags:
            text = text.replace(tag, "")
        return text
