"""Which rows a step runs: the rows decoding, and prompt chunks within the step's prefill budget.

A prompt chunk makes every decoding row wait for it, so a step prefills
at most the budget of prompt tokens its measured step times allow
(prefill_budget.py); with no row decoding nobody waits, and a step
prefills up to a whole row's worth (chunks would only delay the first
token). The budget goes to the rows still prefilling, oldest first, then
to waiting requests, each admitted into the free row where most of its
prompt is cached already (prefix_cache.py). A request is admitted at the
next step after a row frees up: it never waits for other requests to
finish.

Rows are shared fairly between teams (`Submit.team`, the team the proxy
vouches for): the next request admitted is the oldest of the team that
holds the fewest rows, so that a team that queued a hundred requests does
not hold every row while another waits; and while more than one team is
present (holding rows, waiting, or seen in the last `PRESENT_SECONDS`),
no team takes a free row past all but `reserved_places` of them, so that
another team's next request finds a row free instead of waiting for one
of the flooding team's generations to end. A team alone, or a server with
no teams, fills every row; a team that comes to such a server after
`PRESENT_SECONDS` away waits once, for the next row to free up (rows are
never taken back from a request).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

from backend.engine.prefill_budget import PrefillBudget
from backend.engine.prefix_cache import Placement, PrefixIndex
from backend.engine.row import Row
from backend.messages import Submit, reserved_places

# Binds a request to the free row its placement names (its row state, its cached prefix); the engine's.
TakeRow = Callable[[Submit, Placement], Row]

# A team counts as present this long after its last request ended or waited: a client between two turns
# (reading an answer, a tool call, a user typing) is still there, and its next turn should find a row.
# With 2 s, a team back after a pause met a flood holding every row and waited for a row to free up: 27 s
# when the flood's 32 generations of 250 tokens had started together (scripts/bench_teams.py).
PRESENT_SECONDS = 600.0


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

    def __init__(
        self,
        prefill_budget: PrefillBudget,
        prefixes: PrefixIndex,
        max_seq_len: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.prefill_budget = prefill_budget
        self.prefixes = prefixes
        self.max_seq_len = max_seq_len
        self.clock = clock
        self.last_seen: dict[str, float] = {}  # each team's last moment with a row or a waiting request

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
        """Put waiting requests into free rows, fairly between teams (`next_request`), while the
        step's prefill budget lasts; each gets its first chunk, after what of its prompt is cached
        already."""
        admitted: list[Row] = []
        # What each busy row holds, built once for the burst (with reuse off, nothing to look at).
        enabled = self.prefixes.enabled
        busy = {row.index: row.prefix for row in rows if row is not None} if enabled else {}
        held = collections.Counter(row.request.team for row in rows if row is not None)
        most = self.most_rows_a_team(rows, waiting)
        while waiting and budget > 0 and None in rows:
            request = next_request(waiting, held, most)
            if request is None:  # every waiting team holds its most
                break
            del waiting[request.request_id]
            held[request.team] += 1
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

    def most_rows_a_team(self, rows: list[Row | None], waiting: collections.OrderedDict[str, Submit]) -> int:
        """How many rows a team may hold now: all of them while it is the only team present, else all
        but the reserved ones."""
        now = self.clock()
        busy = {row.request.team for row in rows if row is not None}
        for team in busy | {request.team for request in waiting.values()}:
            self.last_seen[team] = now
        for team in [team for team, seen in self.last_seen.items() if now - seen >= PRESENT_SECONDS]:
            del self.last_seen[team]  # gone: and the map never grows past the teams present
        return len(rows) - (reserved_places(len(rows)) if len(self.last_seen) > 1 else 0)


def next_request(
    waiting: collections.OrderedDict[str, Submit], held: collections.Counter[str], most: int
) -> Submit | None:
    """The oldest waiting request of the team holding the fewest rows, among those under `most`."""
    chosen = None
    for request in waiting.values():  # oldest first: a team's first is its oldest
        rows = held[request.team]
        if rows < most and (chosen is None or rows < held[chosen.team]):
            chosen = request
    return chosen


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
