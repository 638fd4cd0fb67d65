"""Predicted Outputs (OpenAI's `prediction`): drafts from the text a client expects the answer to be.

A client asking for an edit of a file sends the file as the prediction: most
of the answer will be that text, in that order, with the edit somewhere in it.
`Prediction` keeps the place in the prediction where the answer stands. While
the answer's new tokens are the prediction's next ones it drafts the tokens
after them; where the answer departs (the edit), it looks for the answer's
last few tokens in the prediction, first from where it stood on (the answer
goes forward through the file), and drafts on from there once they come back.
Prompt lookup (prompt_lookup.py) finds the latest earlier occurrence of those
tokens, which in a file of similar lines is often the wrong one; the place
kept here is the right one while the answer follows the prediction.

The engine verifies these drafts as it verifies any (speculation.py): the
answer is token for token what it would have been without a prediction; a
good one only makes it come sooner.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence


class Prediction:
    """The predicted tokens, and where in them the answer stands."""

    def __init__(self, tokens: Sequence[int], shortest: int, longest: int):
        self.tokens = tuple(tokens)
        self.sizes = range(longest, shortest - 1, -1)  # longest first: a longer match places better
        self.place: int | None = 0  # the answer's next token is expected at tokens[place]; None: lost
        self.last_place = 0  # where the answer last stood in the prediction (a lost one looks from there)
        self.followed = 0  # the answer's tokens compared so far
        self._ends: dict[tuple[int, ...], list[int]] | None = None  # made when the answer first departs

    def propose(self, generated: Sequence[int], count: int) -> tuple[int, ...]:
        """Up to `count` tokens to follow the answer so far (`generated`): the prediction's next ones
        from where the answer stands in it; () where it stands nowhere or at its end."""
        for token in generated[self.followed :]:
            if self.place is not None and self.place < len(self.tokens) and self.tokens[self.place] == token:
                self.place += 1
            else:
                self.place = None
        self.followed = len(generated)
        if self.place is not None:
            self.last_place = self.place
        else:
            self.place = self._found(generated)
        if self.place is None:
            return ()
        return self.tokens[self.place : self.place + count]

    def _found(self, generated: Sequence[int]) -> int | None:
        """Where the answer's longest suffix found in the prediction ends: its first occurrence past the
        place the answer last stood at, else its last one up to there; None where none is."""
        ends = self._index()
        for size in self.sizes:
            if size > len(generated):
                continue
            places = ends.get(tuple(generated[-size:]))
            if places:
                after = bisect_right(places, self.last_place)
                return places[after] if after < len(places) else places[-1]
        return None

    def _index(self) -> dict[tuple[int, ...], list[int]]:
        """Each n-gram of the prediction that a token follows: the places after its occurrences, in
        order."""
        if self._ends is None:
            self._ends = {}
            for size in self.sizes:
                for end in range(size, len(self.tokens)):
                    self._ends.setdefault(self.tokens[end - size : end], []).append(end)
        return self._ends
