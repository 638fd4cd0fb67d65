"""Decode steps as CUDA graphs: a few static shapes, each captured once and replayed (issue 13).

On a GPU an eager decode step is hundreds of small kernels launched one by
one from Python (an H100 trial: 815 a step on a 1B Llama, 1,582 on an 8B,
the GPU idle over 80% of the step), and every step attends over one more
position, so each step is a shape never run before. A CUDA graph launches a
whole step's kernels at once, but only for the shapes it was captured with.
So a decode step takes its shapes from a small fixed set:

- its queries padded to a row bucket (`ROW_BUCKETS`: 1, 2, 4, 8, 16, 24, 32
  for the default 32 rows). A padding query takes a row that is not
  decoding and writes its key and value at that row's last position, which
  no query ever reads: a row ends when it holds max_seq_len tokens, and its
  last token is never fed back (`padding_position`; engine/row.py's
  `Row.position` refuses a decode step there);
- attention over every row of the cache (a row that is not decoding gets a
  query of its own whose output nobody uses, as `attention.attend` does
  for free rows inside its span), as far as the step's span rounded up to a
  power of two (`span_buckets`: 128, 256, ... up to max_seq_len). Reading
  every row costs little beside the weights (a 1B Llama: 32 rows of 256
  positions are 0.27 GB of bfloat16 keys and values against 2.5 GB of
  weights), and at most twice the positions the rows need.

Each (rows, span) pair is captured once, when the engine warms up, every
graph in one memory pool. A step copies its inputs into the static buffers
(a few small kernels), replays its graph and reads the first rows of the
logits. The graph holds the whole step: the visibility mask and the cache
slots, built on the device from the inputs, and the step function the
runner gives (`DecoderRunner.graph_step`: its decode step and the head).

Without CUDA the same buffers and the same function run without capture
(`capture=False`): that is how the tests on a CPU hold this path to the
eager step. A CPU gains nothing from it (padding costs its matrix products
rows, and a new shape costs it no more than an old one: docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from backend.layers.row_cache import RowCache, cache_slots
from backend.layers.step_layout import StepLayout, visibility

# A whole decode step from the static inputs to the logits: (input ids, positions, the queries' rows in
# any order, cache slots, visibility) -> [queries, vocab]. The runner's `graph_step`.
GraphStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32)
SMALLEST_SPAN = 128


def row_buckets(rows: int) -> tuple[int, ...]:
    """The padded query counts of a cache of `rows` rows: `ROW_BUCKETS` below it, then `rows`."""
    return tuple(sorted({bucket for bucket in ROW_BUCKETS if bucket < rows} | {rows}))


def span_buckets(max_seq_len: int) -> tuple[int, ...]:
    """The padded spans: powers of two from SMALLEST_SPAN below max_seq_len, then max_seq_len."""
    spans, span = [], SMALLEST_SPAN
    while span < max_seq_len:
        spans.append(span)
        span *= 2
    return (*spans, max_seq_len)


def padding_position(max_seq_len: int) -> int:
    """Where a padding query writes: its row's last position, which no query reads. A decoding row
    never stands there (engine/row.py, `Row.position`, refuses to), since a row ends when it holds
    max_seq_len tokens and its last token is never fed back."""
    return max_seq_len - 1


def bucket(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds `value`."""
    return next(size for size in buckets if size >= value)


class DecodeGraphs:
    """The decode steps of one runner over one cache, at static shapes, captured as CUDA graphs."""

    def __init__(self, step: GraphStep, cache: RowCache, capture: bool = True):
        self.step, self.cache, self.capture = step, cache, capture
        self.row_buckets = row_buckets(cache.rows)
        self.span_buckets = span_buckets(cache.max_seq_len)
        device, most = cache.keys[0].device, self.row_buckets[-1]
        # The static inputs, outside the graphs' pool: a replay reads them where capture found them.
        self.input_ids = torch.zeros(most, dtype=torch.long, device=device)
        self.positions = torch.zeros(most, dtype=torch.long, device=device)
        self.query_rows = torch.zeros(most, dtype=torch.long, device=device)
        self.row_positions = torch.zeros(cache.rows, dtype=torch.long, device=device)  # 0: reads position 0
        self.logits: torch.Tensor | None = None  # [most, vocab], allocated at the first run
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        """The step's logits, [decode queries, vocab], from the graph of its bucket."""
        queries = layout.decode_queries
        span = max([layout.span] + [row.position + 1 for row in layout.long_rows])
        shape = bucket(queries, self.row_buckets), bucket(span, self.span_buckets)
        self._load(input_ids, positions, layout.decode_index, shape[0])
        if self.capture and shape not in self.graphs:  # captured at warm-up, unless that was skipped
            self._prepare(shape)
        if self.capture:
            self.graphs[shape].replay()
        else:
            self._step(*shape)
        return self.logits[:queries]

    @torch.inference_mode()  # as the engine's steps run: no autograd bookkeeping captured
    def capture_all(self) -> None:
        """Capture every bucket, the largest first (later graphs then fit in the pool it made)."""
        nothing = self.input_ids[:0]
        self._load(nothing, nothing, nothing, self.row_buckets[-1])  # every query a padding one
        for shape in sorted(
            ((rows, span) for rows in self.row_buckets for span in self.span_buckets), reverse=True
        ):
            self._prepare(shape)

    def _load(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, padded: int
    ) -> None:
        """The step's queries into the static buffers, then padding queries in rows that are not
        decoding, each at the last position of its row."""
        queries = input_ids.shape[0]
        self.input_ids[:queries].copy_(input_ids)
        self.positions[:queries].copy_(positions)
        self.query_rows[:queries].copy_(rows)
        self.row_positions.zero_().index_copy_(0, rows, positions)
        if padded > queries:
            decoding = torch.zeros_like(self.row_positions).index_fill_(0, rows, 1)
            free_first = decoding.argsort(stable=True)  # on the device: no host sync to find them
            self.query_rows[queries:padded].copy_(free_first[: padded - queries])
            self.input_ids[queries:padded].zero_()
            self.positions[queries:padded].fill_(padding_position(self.cache.max_seq_len))

    def _prepare(self, shape: tuple[int, int]) -> None:
        """Run a bucket once (CUDA's lazy set-up happens outside capture), then capture it."""
        self._step(*shape)
        if not self.capture:
            return
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        pool = next(iter(self.graphs.values())).pool() if self.graphs else None
        with torch.cuda.graph(graph, pool=pool):
            self._step(*shape)
        self.graphs[shape] = graph

    def _step(self, rows: int, span: int) -> None:
        """The whole decode step at one static shape, from the static inputs to the static logits."""
        cache = self.cache
        query_rows, positions = self.query_rows[:rows], self.positions[:rows]
        visible = visibility(self.row_positions, span, cache.keys[0].dtype)
        slots = cache_slots(query_rows, positions, cache.kv_heads, cache.max_seq_len)
        # With --compile, the compiled step (its small operations fused into generated kernels) is what
        # the graph captures: compiled at the first run of a bucket, which is before capture.
        logits = self.step(self.input_ids[:rows], positions, query_rows, slots, visible)
        if self.logits is None:
            self.logits = logits.new_empty((self.row_buckets[-1], logits.shape[-1]))
        self.logits[:rows].copy_(logits)
