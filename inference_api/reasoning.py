"""A reasoning model's thoughts apart from its answer: chat's `reasoning_content`.

Qwen3, DeepSeek-R1 and SmolLM3 think between `<think>` and `</think>`, then answer. Left in the text,
the thoughts reach a chat client's user and the next turn's prompt; so, as vLLM's `--reasoning-parser`
and llama.cpp's `--reasoning-format` do, chat completions give them as `reasoning_content`, beside
`content` (in a stream, deltas of either). A template may open the block itself (DeepSeek-R1's later
ones end the prompt with `<think>`), or close it at once to turn thinking off (Qwen3's
`enable_thinking: false` ends it with `<think>\n\n</think>`): the prompt's end says where the answer
starts. The whitespace around the thoughts is the tags' layout, not the text's: it goes.
"""

from __future__ import annotations

from typing import Any

from backend.engine.stop_matcher import longest_partial_match

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("auto", "none", "deepseek_r1", "qwen3")  # vLLM's names for `<think>` blocks
PROMPT_END_TOKENS = 8  # the prompt's last tokens, decoded, tell whether it opened the block


def reads_reasoning(parser: str, tokenizer: Any, template_source: str) -> bool:
    """Whether chat answers are read for `<think>` blocks: `auto` where the model has the tags as tokens
    of their own and its chat template writes them (a reasoning model), vLLM's names always, `none` never."""
    if parser != "auto":
        return parser != "none"
    if THINK_CLOSE not in template_source:
        return False
    return all(len(tokenizer.encode(tag, add_special_tokens=False)) == 1 for tag in (THINK_OPEN, THINK_CLOSE))


def opened_in_prompt(prompt_ids: list[int], tokenizer: Any) -> bool:
    """Whether the prompt ends inside a `<think>` block, so that the answer starts with thoughts."""
    end = tokenizer.decode(prompt_ids[-PROMPT_END_TOKENS:], skip_special_tokens=False).rstrip()
    return end.endswith(THINK_OPEN)


class ReasoningReader:
    """One answer's text, fed as it comes, as (reasoning, content) that can go out now; `finish` gives
    the rest. Text that could still be a tag, or whitespace the tags' layout may drop, is held back."""

    def __init__(self, opened_in_prompt: bool = False):
        self._state = "thoughts_start" if opened_in_prompt else "answer_start"
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning = content = ""
        while True:
            if self._state == "answer_start":  # a block opens here, or there is none
                start = self._held.lstrip()
                if not start or THINK_OPEN.startswith(start):
                    return reasoning, content
                if not start.startswith(THINK_OPEN):
                    self._state = "content"
                    continue
                self._held, self._state = start[len(THINK_OPEN) :], "thoughts_start"
            elif self._state == "thoughts_start":
                self._held = self._held.lstrip()
                if not self._held:
                    return reasoning, content
                self._state = "thoughts"
            elif self._state == "thoughts":
                end = self._held.find(THINK_CLOSE)
                if end < 0:
                    sure = self._held[: len(self._held) - longest_partial_match(self._held, (THINK_CLOSE,))]
                    sure = sure.rstrip()  # whitespace before `</think>` would go
                    reasoning, self._held = reasoning + sure, self._held[len(sure) :]
                    return reasoning, content
                reasoning += self._held[:end].rstrip()
                self._held, self._state = self._held[end + len(THINK_CLOSE) :], "answer_after_thoughts"
            elif self._state == "answer_after_thoughts":
                self._held = self._held.lstrip()
                if not self._held:
                    return reasoning, content
                self._state = "content"
            else:
                content, self._held = content + self._held, ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back at the answer's end: an unfinished tag is text, as written."""
        held, self._held = self._held, ""
        if self._state == "thoughts":
            return held.rstrip(), ""
        if self._state == "answer_start":
            return "", held
        return "", ""
