"""Stop sequences matched on text across token boundaries, with hold-back.

Text that could be the beginning of a stop sequence is held back until the
next piece shows whether it is one; the stop sequence itself is sent only
where the request asks (`include`), as the text's last characters.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...] | list[str], include: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.include = include  # the stop sequence ends the text sent (else the text ends before it)
        self.held = ""  # text received but not yet released
        self.stopped = False
        self.matched: str | None = None  # the stop sequence that ended the text (Piece.stop_sequence)

    def feed(self, text: str) -> str:
        """Take new text; return what is safe to send. Sets `stopped` on a match."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self.held += text
        found = [(at, stop) for stop in self.stops if (at := self.held.find(stop)) >= 0]
        if found:
            # The earliest; of several at the same place, the one listed first (min keeps the first).
            match_at, self.matched = min(found, key=lambda match: match[0])
            end = match_at + len(self.matched) if self.include else match_at
            released, self.held = self.held[:end], ""
            self.stopped = True
            return released
        keep = longest_partial_match(self.held, self.stops)
        released = self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep :]
        return released

    def flush(self) -> str:
        """The request ended for another reason: release what was held back."""
        released, self.held = self.held, ""
        return released


def longest_partial_match(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `stops`: what must be
    held back until the next text shows whether it is one."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
