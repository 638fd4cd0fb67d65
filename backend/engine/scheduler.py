"""Which rows a step runs: the rows decoding, and prompt chunks within the step's prefill budget.

A prompt chunk makes every decoding row wait for it, so a step prefills
at most the budget of prompt tokens its measured step times allow
(prefill_budget.py); with no row decoding nobody waits, and a step
prefills up to a whole row's worth (chunks would only delay the first
token). The budget goes to the rows still prefilling, oldest first, then
to waiting requests, oldest first, each admitted into the free row where
most of its prompt is cached already (prefix_cache.py). A request is
admitted at the next step after a row frees up: it never waits for other
requests to finish.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

from backend.engine.prefill_budget import PrefillBudget
from backend.engine.prefix_cache import Placement, PrefixIndex
from backend.engine.row import Row
from backend.messages import Submit

# Binds a request to the free row its placement names (its row state, its cached prefix); the engine's.
TakeRow = Callable[[Submit, Placement], Row]


@dataclass(frozen=True)
class Schedule:
    """One step's rows. `prefilling` rows have this step's chunk set (`Row.chunk_end`): the rows
    continuing their prompt first, then those admitted in this step."""

    decoding: list[Row]  # one token each, in row order
    prefilling: list[Row]
    admitted: list[Row]

    def __bool__(self) -> bool:
        return bool(self.decoding or self.prefilling)

    @property
    def prompt_tokens(self) -> int:
        return sum(row.chunk_end - row.cached for row in self.prefilling)


class Scheduler:
    """Plans each step over the engine's rows and waiting requests."""

    def __init__(self, prefill_budget: PrefillBudget, prefixes: PrefixIndex, max_seq_len: int):
        self.prefill_budget = prefill_budget
        self.prefixes = prefixes
        self.max_seq_len = max_seq_len

    def schedule(
        self,
        rows: list[Row | None],
        waiting: collections.OrderedDict[str, Submit],
        take_row: TakeRow,
    ) -> Schedule:
        """This step's rows; admitted requests leave `waiting` and take their place in `rows`."""
        active = [row for row in rows if row is not None]
        decoding = [row for row in active if row.prefilled]
        ceiling = self.prefill_budget.ceiling
        budget = self.prefill_budget.tokens(len(decoding)) if decoding else max(ceiling, self.max_seq_len)
        continuing, budget = plan_chunks([row for row in active if not row.prefilled], budget)
        admitted = self.admit(rows, waiting, budget, take_row)
        return Schedule(decoding, continuing + admitted, admitted)

    def admit(
        self,
        rows: list[Row | None],
        waiting: collections.OrderedDict[str, Submit],
        budget: int,
        take_row: TakeRow,
    ) -> list[Row]:
        """Put waiting requests into free rows, oldest request first, while the step's prefill
        budget lasts; each gets its first chunk, after what of its prompt is cached already."""
        admitted: list[Row] = []
        # What each busy row holds, built once for the burst (with reuse off, nothing to look at).
        enabled = self.prefixes.enabled
        busy = {row.index: row.prefix for row in rows if row is not None} if enabled else {}
        while waiting and budget > 0 and None in rows:
            request = waiting.pop(next(iter(waiting)))
            free = [index for index, slot in enumerate(rows) if slot is None]
            # A prompt to be scored reuses nothing: it needs the logits of every position.
            reuse = request.params.prompt_logprobs is None
            place = self.prefixes.place(request.prompt_ids, request.cache_scope, free, busy, reuse)
            row = take_row(request, place)
            rows[row.index] = row
            if enabled:
                busy[row.index] = row.prefix
            planned, budget = plan_chunks([row], budget)
            admitted += planned
        return admitted


def plan_chunks(rows: list[Row], budget: int) -> tuple[list[Row], int]:
    """This step's chunk of each row still prefilling, in order, within the budget: the rows that got
    one (their `chunk_end` set) and the budget left."""
    planned = []
    for row in rows:
        if budget <= 0:
            break
        row.chunk_end = min(len(row.prompt_ids), row.cached + budget)
        budget -= row.chunk_end - row.cached
        planned.append(row)
    return planned, budget
