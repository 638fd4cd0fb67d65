"""A chat answer's text, read as it streams into what the APIs give apart: a reasoning model's thoughts,
the content, and the tool calls (at the end).

    reader = answer_reader(thinking, tools)     # thinking: Serving.prompt_thinking; tools: a ToolRequest
    reasoning, content = reader.read(piece.text, piece.finished)
    ...  reader.reasoning, reader.tool_calls    # whole, once the last piece is read

Most models write thought blocks (`<think>`) and calls in the text (AnswerReader); gpt-oss writes harmony
messages, each on its channel (HarmonyReader).
"""

from __future__ import annotations

from typing import Any

from backend.engine.stop_matcher import longest_partial_match
from inference_api.harmony import MAX_HEADER, MESSAGE, MESSAGE_ENDS, START, Header
from inference_api.reasoning import HARMONY, HARMONY_PREFILLED, OPENED, Blocks, ReasoningReader, Thinking
from inference_api.tool_calls import ToolCallReader, ToolRequest, new_call


def answer_reader(thinking: Thinking | None, tools: ToolRequest | None) -> AnswerReader | HarmonyReader:
    """The reader for an answer to a prompt whose thoughts are `thinking` (None: not read apart)."""
    if thinking in (HARMONY, HARMONY_PREFILLED):
        return HarmonyReader(tools, prefilled=thinking == HARMONY_PREFILLED)
    return AnswerReader(thinking, tools)


class AnswerReader:
    """Thoughts in a block (reasoning.ReasoningReader), then calls in the content
    (tool_calls.ToolCallReader): what may be a call is held back until the end."""

    def __init__(self, thinking: Blocks | None, tools: ToolRequest | None):
        opened = thinking is not None and thinking.where == OPENED
        self._thoughts = None if thinking is None else ReasoningReader(opened, thinking.tags)
        self._calls = None if tools is None else ToolCallReader(tools)
        self.reasoning = ""  # the thoughts so far
        self.tool_calls: list[dict[str, Any]] = []  # set at the last text

    def read(self, text: str, last: bool) -> tuple[str, str]:
        """The thoughts and the content this text adds (`last`: the answer's last text)."""
        reasoning = ""
        if self._thoughts is not None:
            reasoning, text = self._thoughts.read(text, last)
            self.reasoning += reasoning
        if self._calls is None:
            return reasoning, text
        text = self._calls.feed(text)
        if last:
            rest, self.tool_calls = self._calls.finish()
            text += rest
        return reasoning, text


class HarmonyReader:
    """Harmony messages (harmony.py): `analysis` is the thoughts, `final` and the preambles on
    `commentary` the content, a message to `functions.NAME` a call of the request's tools (a message to
    another recipient, a tool of the model's own, is thoughts too). A header is held back until its
    `<|message|>`; a message's text goes out as it comes. Two messages of one kind are set apart by a
    blank line. `prefilled`: the prompt opened the final message (a prefill), and the text goes on in it."""

    def __init__(self, tools: ToolRequest | None, prefilled: bool = False):
        self._calls_offered = tools is not None and tools.choice != "none"
        self._parallel = tools is None or tools.parallel
        self._held = ""  # text not read yet: a header, or what may be the start of a message's end
        # the message being read; None between messages
        self._header: Header | None = Header("final", None) if prefilled else None
        self._first_text = True  # whether the message has given no text yet
        self._no_harmony = False  # the model writes none: its text is the content, as written
        self._kinds_said: set[str] = set()  # the kinds of text given so far
        self._arguments = ""  # of the call being read
        self._calls: list[dict[str, Any]] = []
        self.reasoning = ""  # the thoughts so far
        self.tool_calls: list[dict[str, Any]] = []  # set at the last text

    def read(self, text: str, last: bool) -> tuple[str, str]:
        """The thoughts and the content this text adds (`last`: the answer's last text)."""
        self._held += text
        said = {"reasoning": "", "content": ""}
        while self._held and self._read_on(said):
            pass
        if last:
            self._finish(said)
        self.reasoning += said["reasoning"]
        return said["reasoning"], said["content"]

    def _read_on(self, said: dict[str, str]) -> bool:
        """Read what the held text allows into `said`; whether there may be more to read."""
        if self._no_harmony:
            said["content"] += self._held
            self._held = ""
            return False
        if self._header is None:
            at = self._held.find(MESSAGE)
            if at < 0:
                self._no_harmony = len(self._held) > MAX_HEADER
                return self._no_harmony
            self._header = Header.read(self._held[:at])
            self._held = self._held[at + len(MESSAGE) :]
            self._first_text = True
            return True
        end, marker = _message_end(self._held)
        if end < 0:
            sure = len(self._held) - longest_partial_match(self._held, MESSAGE_ENDS)
            self._give(self._held[:sure], said)
            self._held = self._held[sure:]
            return False
        self._give(self._held[:end], said)
        self._close()
        self._held = self._held[end if marker == START else end + len(marker) :]  # a start is the header's
        return True

    def _give(self, text: str, said: dict[str, str]) -> None:
        """A message's text, to its kind: the call's arguments, the thoughts or the content."""
        kind = self._kind
        if kind == "call":
            self._arguments += text
            return
        if not text:
            return
        if self._first_text and kind in self._kinds_said:
            text = "\n\n" + text
        self._first_text = False
        self._kinds_said.add(kind)
        said[kind] += text

    @property
    def _kind(self) -> str:
        header = self._header
        if header.function is not None and self._calls_offered:
            return "call"
        if header.recipient is not None or header.channel == "analysis":
            return "reasoning"
        return "content"

    def _close(self) -> None:
        """The message ends: a call's is whole (or cut short, as written)."""
        if self._kind == "call" and (self._parallel or not self._calls):
            self._calls.append(new_call(self._header.function, self._arguments.strip()))
        self._header, self._arguments = None, ""

    def _finish(self, said: dict[str, str]) -> None:
        """The answer ended: a message cut short is what it holds; text that began no message (a model
        that writes none) is content, and a header cut short is nothing."""
        if self._header is not None:
            self._give(self._held, said)
            self._close()
        elif "<|" not in self._held:
            said["content"] += self._held
        self._held = ""
        self.tool_calls = self._calls


def _message_end(text: str) -> tuple[int, str]:
    """Where the first marker that ends a message is in `text`, and which (-1 and "" for none)."""
    found = [(text.find(marker), marker) for marker in MESSAGE_ENDS if marker in text]
    return min(found) if found else (-1, "")
