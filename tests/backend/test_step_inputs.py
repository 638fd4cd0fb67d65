"""A step's inputs packed (backend/model/step_inputs.py) and the rows scheduled (backend/engine/scheduler.py),
each on its own: the pack's order and kept logits, its invariants, and the budget's split between rows."""

from __future__ import annotations

import collections
from dataclasses import dataclass

import pytest
import torch

from backend.engine.prefill_budget import PrefillBudget
from backend.engine.prefix_cache import PrefixIndex
from backend.engine.row import Row
from backend.engine.scheduler import PRESENT_SECONDS, Scheduler, plan_chunks
from backend.messages import SamplingParams, Submit
from backend.model.step_inputs import check, pack
from tests.backend.models import MarkerTokenizer

CPU = torch.device("cpu")


@dataclass
class Decoding:
    index: int
    position: int
    next_input: int
    draft: tuple[int, ...] = ()


@dataclass
class Prefilling:
    index: int
    cached: int
    chunk_end: int
    prompt_ids: tuple[int, ...]
    scores_prompt: bool = False
    as_queries: bool = False


def test_a_pack_is_decode_queries_then_chunks_and_keeps_what_samples():
    decoding = [Decoding(0, 7, 70), Decoding(2, 3, 30)]
    prefilling = [
        Prefilling(1, 0, 3, (11, 12, 13)),  # a whole prompt: its last token samples
        Prefilling(3, 2, 4, (21, 22, 23, 24, 25, 26)),  # a middle chunk: nothing kept
        Prefilling(4, 0, 2, (31, 32), scores_prompt=True),  # every token kept, the last samples
    ]
    inputs = pack(decoding, prefilling, CPU, torch.float32, reads_own_positions=True)
    assert inputs.token_ids.tolist() == [70, 30, 11, 12, 13, 23, 24, 31, 32]
    assert inputs.positions.tolist() == [7, 3, 0, 1, 2, 2, 3, 0, 1]
    assert inputs.keep.tolist() == [0, 1, 4, 7, 8]
    assert inputs.sample_from.tolist() == [0, 1, 2, 4]  # the two decoding rows, row 1, row 4
    assert inputs.completing == (1, 4)
    assert [(s.row, s.first, s.count) for s in inputs.prompt_scores] == [(4, 3, 1)]
    layout = inputs.layout
    assert layout.decode_rows == 3 and layout.decode_index.tolist() == [0, 2] and layout.span == 8
    assert [(c.row, c.start, c.length, c.past) for c in layout.prompts] == [
        (1, 2, 3, 0),
        (3, 5, 2, 2),
        (4, 7, 2, 0),
    ]
    assert layout.prompts[0].visible is None and layout.prompts[1].visible.shape == (2, 4)


def test_without_scored_prompts_every_kept_logit_samples():
    inputs = pack([Decoding(0, 4, 9)], [Prefilling(1, 0, 2, (5, 6))], CPU, torch.float32, True)
    assert inputs.keep.tolist() == [0, 2] and inputs.sample_from is None


def test_drafts_are_more_queries_of_their_row_where_each_reads_its_own_positions_else_chunks():
    """A row's draft follows its token at the next positions: as decode queries of the same row for the
    CPU's loop; as a chunk of the row, after the decode queries, where those attend as a batch, one a
    row. Either way the row samples at each, in row order, before the completing prompts."""
    decoding = [Decoding(0, 7, 70, draft=(71, 72)), Decoding(2, 3, 30)]
    prefilling = [Prefilling(1, 0, 3, (11, 12, 13))]
    by_loop = pack(decoding, prefilling, CPU, torch.float32, reads_own_positions=True)
    assert by_loop.token_ids.tolist() == [70, 71, 72, 30, 11, 12, 13]
    assert by_loop.positions.tolist() == [7, 8, 9, 3, 0, 1, 2]
    assert by_loop.layout.decode_index.tolist() == [0, 0, 0, 2] and by_loop.layout.span == 10
    assert by_loop.keep.tolist() == [0, 1, 2, 3, 6] and by_loop.sample_from is None
    batch = pack(decoding, prefilling, CPU, torch.float32, reads_own_positions=False)
    assert batch.token_ids.tolist() == [30, 70, 71, 72, 11, 12, 13]
    assert batch.positions.tolist() == [3, 7, 8, 9, 0, 1, 2]
    assert batch.layout.decode_index.tolist() == [2]
    assert [(c.row, c.start, c.length, c.past) for c in batch.layout.prompts] == [(0, 1, 3, 7), (1, 4, 3, 0)]
    assert batch.layout.prompts[0].visible.shape == (3, 10)  # the row's 7 positions and itself causally
    assert batch.keep.tolist() == [0, 1, 2, 3, 6]
    assert batch.sample_from.tolist() == [1, 2, 3, 0, 4]  # row 0's three, row 2's, row 1's


def test_a_short_prompts_chunk_as_queries_goes_in_row_order_and_keeps_its_last_tokens_logits():
    """Chunks marked `as_queries` (engine._prompts_as_queries) are decode queries of their rows, among
    the decoding rows' in row order, at their positions; a chunk that ends its prompt keeps its last
    token's logits, one in the middle none, and the step has no prompt chunk left."""
    decoding = [Decoding(0, 7, 70), Decoding(3, 3, 30)]
    prefilling = [
        Prefilling(2, 0, 3, (11, 12, 13), as_queries=True),
        Prefilling(1, 2, 4, (21, 22, 23, 24, 25, 26), as_queries=True),
    ]
    inputs = pack(decoding, prefilling, CPU, torch.float32, reads_own_positions=True)
    assert inputs.token_ids.tolist() == [70, 23, 24, 11, 12, 13, 30]
    assert inputs.positions.tolist() == [7, 2, 3, 0, 1, 2, 3]
    assert inputs.layout.decode_index.tolist() == [0, 1, 1, 2, 2, 2, 3] and inputs.layout.prompts == ()
    assert inputs.keep.tolist() == [0, 5, 6]
    assert inputs.sample_from.tolist() == [0, 2, 1] and inputs.completing == (2,)  # rows 0, 3, then 2
    by_batch = pack(decoding, prefilling, CPU, torch.float32, reads_own_positions=False)
    assert [chunk.row for chunk in by_batch.layout.prompts] == [2, 1]  # no loop: chunks, as before


def test_queries_out_of_order_or_apart_are_refused():
    with pytest.raises(ValueError, match="in row order"):
        check([2, 1], [1, 1], [0, 1], [0, 1])
    with pytest.raises(ValueError, match="consecutive positions"):
        check([1, 1], [1, 1], [0, 1], [0, 1])  # one row's queries at one position
    check([1, 1, 3], [4, 5, 1], [0, 1, 2], [0, 1, 2])  # a row's draft: consecutive, then the next row
    check([0, 0, 0], [0, 1, 2], [2], [0])  # a prompt's chunk as queries: its last token's logits kept
    with pytest.raises(ValueError, match="must ascend"):
        check([0, 1], [1, 1], [1, 0], [0])
    with pytest.raises(ValueError, match="among the kept"):
        check([0], [1], [0], [0, 1])


def test_a_long_row_reads_alone_where_the_batch_is_padded_and_not_by_the_loop():
    decoding = [Decoding(i, 2, 1) for i in range(7)] + [Decoding(7, 1500, 1)]
    batch = pack(decoding, [], CPU, torch.float32, reads_own_positions=False)
    assert [r.row for r in batch.layout.long_rows] == [7] and batch.layout.span == 3
    by_loop = pack(decoding, [], CPU, torch.float32, reads_own_positions=True)
    assert by_loop.layout.long_rows == () and by_loop.layout.span == 1501


def row(index: int, prompt: tuple[int, ...], cached: int = 0) -> Row:
    params = SamplingParams(temperature=0, max_tokens=4)
    return Row(index, Submit(f"r{index}", prompt, params), MarkerTokenizer(), frozenset(), 64, cached=cached)


def test_the_budget_goes_to_rows_prefilling_then_to_waiting_requests_in_order():
    rows: list[Row | None] = [row(0, (5, 6), cached=2), row(1, tuple(range(2, 12)), cached=4), None, None]
    rows[0].generated.append(7)  # decoding
    waiting = collections.OrderedDict(
        (f"w{i}", Submit(f"w{i}", tuple(range(3, 9)), SamplingParams(max_tokens=2))) for i in range(3)
    )
    scheduler = Scheduler(PrefillBudget(fixed=10), PrefixIndex(4, enabled=False), 64)

    def take_row(request, place):
        return Row(place.row, request, MarkerTokenizer(), frozenset(), 64, cached=place.reused)

    schedule = scheduler.schedule(rows, waiting, take_row)
    assert schedule.decoding == [rows[0]]
    assert [(r.index, r.cached, r.chunk_end) for r in schedule.prefilling] == [(1, 4, 10), (2, 0, 4)]
    assert schedule.admitted == [rows[2]] and rows[3] is None  # the budget ran out after w0's first chunk
    assert list(waiting) == ["w1", "w2"] and schedule.prompt_tokens == 10


def test_a_step_with_nothing_decoding_prefills_a_whole_row():
    rows: list[Row | None] = [None]
    waiting = collections.OrderedDict([("a", Submit("a", tuple(range(2, 50)), SamplingParams(max_tokens=2)))])
    scheduler = Scheduler(PrefillBudget(fixed=8), PrefixIndex(1), 64)
    schedule = scheduler.schedule(rows, waiting, lambda request, place: row(place.row, request.prompt_ids))
    assert [(r.cached, r.chunk_end) for r in schedule.prefilling] == [(0, 48)]


def test_chunks_are_planned_until_the_budget_is_spent():
    rows = [row(0, tuple(range(2, 12))), row(1, tuple(range(2, 12)))]
    planned, left = plan_chunks(rows, 13)
    assert [(r.cached, r.chunk_end) for r in planned] == [(0, 10), (0, 3)] and left == 0
    assert plan_chunks(rows, 0) == ([], 0)


def test_a_row_refuses_to_decode_at_its_last_position():
    """Decode graphs pad with queries at a row's last position (model/decode_graphs.py): a row there is
    an error, not a silent overwrite."""
    at_end = row(0, (5, 6), cached=63)
    with pytest.raises(RuntimeError, match="its last or past it"):
        _ = at_end.position
    assert row(0, (5, 6), cached=62).position == 62


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def submit(team: str, i: int, prompt_tokens: int = 3) -> Submit:
    return Submit(f"{team}-{i}", tuple(range(3, 3 + prompt_tokens)), SamplingParams(max_tokens=2), team=team)


def take(request, place):
    return Row(place.row, request, MarkerTokenizer(), frozenset(), 64, cached=place.reused)


def test_a_team_alone_fills_every_row():
    rows: list[Row | None] = [None] * 8
    waiting = collections.OrderedDict((s.request_id, s) for s in (submit("flood", i) for i in range(12)))
    Scheduler(PrefillBudget(fixed=1000), PrefixIndex(8), 64, Clock()).schedule(rows, waiting, take)
    assert all(row is not None for row in rows) and len(waiting) == 4


def test_while_two_teams_are_present_the_next_row_goes_to_the_one_holding_fewer_and_none_takes_the_last():
    """One team queued first and many; another's requests still go first to free rows, and the flooding
    team stops short of the last row (reserved_places: 1 of 8) while the other is present, so that the
    other's next request finds it free."""
    clock = Clock()
    scheduler = Scheduler(PrefillBudget(fixed=1000), PrefixIndex(8), 64, clock)
    rows: list[Row | None] = [None] * 8
    waiting = collections.OrderedDict((s.request_id, s) for s in (submit("flood", i) for i in range(12)))
    waiting.update((s.request_id, s) for s in (submit("chat", i) for i in range(2)))
    admitted = scheduler.schedule(rows, waiting, take).admitted
    teams = [row.request.team for row in admitted]
    assert teams[:4] == ["flood", "chat", "flood", "chat"]  # the fewest rows first, each team's oldest
    assert teams.count("flood") == 6 and teams.count("chat") == 2
    assert list(waiting)[0] == "flood-6"

    for index in (1, 3):  # chat's two rows end; its user reads the answer for a minute
        rows[index] = None
    clock.now += 60.0
    again = scheduler.schedule(rows, waiting, take).admitted
    assert [row.request.team for row in again] == ["flood"]  # chat still present: flood holds 7 of 8
    assert rows.count(None) == 1
    waiting["chat-9"] = submit("chat", 9)
    assert [row.request.team for row in scheduler.schedule(rows, waiting, take).admitted] == ["chat"]


def test_a_team_gone_quiet_leaves_every_row_to_the_one_still_there():
    clock = Clock()
    scheduler = Scheduler(PrefillBudget(fixed=1000), PrefixIndex(8), 64, clock)
    rows: list[Row | None] = [None] * 8
    waiting = collections.OrderedDict([("chat-0", submit("chat", 0))])
    scheduler.schedule(rows, waiting, take)
    rows[0] = None  # chat's request ended
    waiting.update((s.request_id, s) for s in (submit("flood", i) for i in range(12)))
    clock.now += 60.0
    assert len(scheduler.schedule(rows, waiting, take).admitted) == 7  # chat still counts as present
    clock.now += PRESENT_SECONDS
    rows[1] = None
    assert len(scheduler.schedule(rows, waiting, take).admitted) == 2  # gone quiet: all 8 to flood
    assert all(row is not None for row in rows)
