"""Prompt lookup: a row's next tokens guessed from its own text, with no second model.

Text that repeats what came before (an edited file, a quoted passage, a
list of similar lines) has its continuation earlier in the row: after the
last few tokens' latest earlier occurrence come the tokens that followed
them then. `PromptLookup` proposes those, longest match first (vLLM's
`ngram` method, llama.cpp's lookup decoding); the engine verifies them in
one step (speculation.py). The index is built as the row's tokens grow,
a few dictionary writes per token, so a proposal is a lookup, not a scan.
"""

from __future__ import annotations

from collections.abc import Sequence


class PromptLookup:
    """An index of a row's n-grams (`shortest` to `longest` tokens) to where each last ended."""

    def __init__(self, shortest: int, longest: int):
        if not 1 <= shortest <= longest:
            raise ValueError(f"n-gram sizes must be 1 <= shortest <= longest, got {shortest}, {longest}")
        self.sizes = range(longest, shortest - 1, -1)  # longest first: a longer match guesses better
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram: the place after its latest indexed occurrence
        self.indexed = 0  # n-grams ending before this place are in `ends`

    def propose(self, tokens: Sequence[int], count: int) -> tuple[int, ...]:
        """Up to `count` tokens to follow `tokens` (the row's prompt and generated tokens so far): what
        followed the latest earlier occurrence of its longest suffix found; () where none is."""
        self._index(tokens)
        for size in self.sizes:
            if size >= len(tokens):
                continue
            end = self.ends.get(tuple(tokens[-size:]))
            if end is not None:
                return tuple(tokens[end : end + count])
        return ()

    def _index(self, tokens: Sequence[int]) -> None:
        """Index every n-gram that a later token follows: those ending before the last token. The
        suffix itself stays out, so that a lookup finds an earlier occurrence, never itself."""
        for end in range(self.indexed + 1, len(tokens)):
            for size in self.sizes:
                if size <= end:
                    self.ends[tuple(tokens[end - size : end])] = end
        self.indexed = max(self.indexed, len(tokens) - 1)
