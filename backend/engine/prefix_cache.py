"""Reusing cached prefixes: where a new prompt goes so that the least of it is computed again.

A row keeps its tokens' keys and values after its request ends, until the
row is taken again. A new prompt that starts with tokens some row holds at
the same positions (an application's system prompt, the earlier turns of a
chat) needs only the rest prefilled: in that row if it is free, or, if the
row is busy, in a free row the prefix is first copied into (one device copy
per layer). Only keys and values of identical tokens at identical positions
are shared, never sampling state, and only between requests of the same
cache scope (`Submit.cache_scope`: a team, narrowed by a request's
cache_salt): a prefix another team left is never reused, so neither the
count of cached tokens a response reports nor its time to first token can
tell one team what another sent. Without a useful prefix, the prompt takes
the lowest free row, as it did before rows kept anything: the decode
queries attend over rows 0..n-1 of the cache, free ones included (see
layers/attention.py), so a single stream pushed to row 31 would pay for 32 rows'
attention each step. Keeping old prefixes longer by spreading requests
over the rows (least recently used first) would cost every step that.
A state-space model's row (and a hybrid's) keeps the state of its whole
history, not of each prefix: it is reused whole or not at all (`whole_only`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Shorter common prefixes are not worth a copy from a busy row (and are mostly chat-template tokens).
MIN_COPIED_PREFIX = 16


@dataclass(frozen=True)
class Placement:
    row: int  # the free row the request takes
    reused: int  # prompt tokens whose keys and values are there already (after the copy)
    source: int | None = None  # a busy row to copy them from first


class PrefixIndex:
    """What each free row still holds, and for whom, and the choice of a row for each new prompt."""

    def __init__(self, rows: int, enabled: bool = True, whole_only: bool = False):
        """`whole_only`: a row's tokens are reused all or none, and never copied from a busy row: a
        state-space model's row keeps a recurrent state of its whole history, not of each prefix
        (layers/row_states.py), so only a prompt that extends it (a chat's next turn) finds it."""
        self.enabled = enabled
        self.whole_only = whole_only
        # A free row's cached tokens, and the scope of the request that left them.
        self.retained: list[tuple[str, Sequence[int]]] = [("", ()) for _ in range(rows)]

    def release(self, row: int, scope: str, tokens: Sequence[int]) -> None:
        """A row was freed holding the keys and values of these tokens (none after a failure), which
        requests of this scope alone may reuse."""
        self.retained[row] = (scope, tokens if self.enabled else ())

    def place(
        self,
        prompt: Sequence[int],
        scope: str,
        free: list[int],
        busy: dict[int, tuple[str, Sequence[int]]],
        reuse: bool = True,
    ) -> Placement:
        """The free row for `prompt` and how much of it needs no prefill; `busy` maps each busy row to
        its request's scope and the tokens it has cached. Only rows of the same scope are looked at.
        At least the prompt's last token is always computed: its logits give the first new token."""
        if self.enabled and reuse:
            longest = len(prompt) - 1

            def shared(held: tuple[str, Sequence[int]]) -> int:
                common = common_prefix(held[1], prompt, longest) if held[0] == scope else 0
                return 0 if self.whole_only and common < len(held[1]) else common

            best_free = max(free, key=lambda row: shared(self.retained[row]))
            free_match = shared(self.retained[best_free])
            if self.whole_only:
                busy = {}
            best_busy = max(busy, key=lambda row: shared(busy[row]), default=None)
            busy_match = 0 if best_busy is None else shared(busy[best_busy])
            if busy_match > max(free_match, MIN_COPIED_PREFIX - 1):
                return self._take(Placement(min(free), busy_match, best_busy))
            if free_match:
                return self._take(Placement(best_free, free_match))
        return self._take(Placement(min(free), 0))

    def _take(self, placement: Placement) -> Placement:
        self.retained[placement.row] = ("", ())  # busy now: the row's own tokens say what it holds
        return placement


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading tokens a and b share, at most `limit`."""
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
