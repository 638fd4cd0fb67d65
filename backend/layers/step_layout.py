"""Where the queries of one step sit in its packed sequence, and what each may read.

A step packs every query into one sequence: first one token for each
decoding row, in row order, then the tokens of each prompt chunk. The
linear layers run once over the whole pack; attention (attention.py) reads
this layout to give each query what it may see of the cache: a decode
query its own row up to its position, a prompt token its own prompt up to
itself (a chunk of a long prompt, prefilled over several steps, also the
chunks before it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class PromptChunk:
    """Prompt tokens of one row in the pack: positions past..past+length-1 of its row.

    A whole prompt has past 0; a long one is prefilled a chunk a step (past > 0 after the first),
    each chunk reading what the chunks before it wrote.
    """

    row: int
    start: int  # where the chunk begins in the packed sequence
    length: int
    past: int = 0  # positions of the row already in the cache
    visible: torch.Tensor | None = (
        None  # [length, past + length] bool, causal from past (None when past is 0)
    )


class LongRow(NamedTuple):
    """A decoding row whose query attends alone, over its own positions, instead of in the batch."""

    query: int  # its place in the packed sequence
    row: int
    position: int  # the position of its query: it reads 0..position


# Prompts this short, with nothing of theirs in the cache before, attend by the CPU's loop where there is
# one (`by_position`), with the step's decode queries: one call a layer instead of a PyTorch call and
# its slicing each. 32 prompts of 16 tokens (a burst of new requests) took 960 calls a step, some 75 us
# each; the loop takes a 16-token prompt in 20 us, but its cost grows with the square of the length
# and at 64 tokens it is slower than PyTorch's kernel (docs/performance.md).
LOOP_PROMPT_TOKENS = 32

# A row read alone costs an attention call of its own in every layer; it is worth it where the batch
# then reads fewer positions, counted over the rows of its span, by at least this many.
LONG_ROW_SAVES_POSITIONS = 512
MOST_LONG_ROWS = 4


def long_rows(positions: dict[int, int], span_rows: int) -> set[int]:
    """The decoding rows (row: position) that attend alone: the batch reads every row of its span as
    far as its longest row reaches, so one 2,000-token row among short ones made all 32 read 2,000
    positions (on the default model on a CPU, 150 ms a step instead of 60). The longest rows go alone
    while that saves reading."""
    longest_first = sorted(positions, key=positions.__getitem__, reverse=True)
    lengths = [positions[row] + 1 for row in longest_first] + [1]
    chosen, least, alone = 0, span_rows * lengths[0], 0
    for count in range(1, min(MOST_LONG_ROWS, len(longest_first)) + 1):
        alone += lengths[count - 1] + LONG_ROW_SAVES_POSITIONS
        if span_rows * lengths[count] + alone < least:
            chosen, least = count, span_rows * lengths[count] + alone
    return set(longest_first[:chosen])


@dataclass(frozen=True)
class StepLayout:
    """Where the queries of one step sit in the packed sequence, and what each may read."""

    decode_rows: int  # the decode queries attend as a batch over cache rows 0..decode_rows-1
    decode_index: torch.Tensor  # [decode queries]: the row of each, in pack order (ascending)
    positions: torch.Tensor  # [decode queries]: where each sits in its row
    span: int  # cache positions the decode queries read (the longest row's, masked per row)
    # [decode_rows, 1, 1, span]: 0 where a row may read, -inf where not, in the queries' dtype (a boolean
    # mask would be turned into this by every layer's attention call)
    visible: torch.Tensor
    prompts: tuple[PromptChunk, ...]  # the prompt tokens of the step, after the decode queries
    # Decoding rows read alone (`long_rows`): in the batch they are masked as free rows are.
    long_rows: tuple[LongRow, ...] = ()

    @property
    def decode_queries(self) -> int:
        return self.decode_index.shape[0]

    @property
    def has_free_rows(self) -> bool:
        """Whether some rows below decode_rows are not decoding (else query i is row i)."""
        return self.decode_queries < self.decode_rows

    def loop_takes(self, chunk: PromptChunk) -> bool:
        """Whether a prompt chunk attends by the CPU's loop, where there is one (LOOP_PROMPT_TOKENS)."""
        return chunk.past == 0 and chunk.length <= LOOP_PROMPT_TOKENS

    @functools.cached_property
    def batch_ends(self) -> torch.Tensor:
        """[decode_rows]: the last position each row of the decode batch reads (0 for free and long
        rows), as `visible` says: where a sliding window ends (attention_features.py)."""
        return (self.visible[:, 0, 0] == 0).sum(-1) - 1

    @functools.cached_property
    def by_position(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(place in the pack, row, position) of each query the CPU's loop takes, each reading its row up
        to its own position: the decode queries, then the prompt chunks it takes (`loop_takes`)."""
        device = self.decode_index.device
        chunks = [chunk for chunk in self.prompts if self.loop_takes(chunk)]
        places = [torch.arange(self.decode_queries, device=device)]
        places += [torch.arange(chunk.start, chunk.start + chunk.length, device=device) for chunk in chunks]
        rows = [self.decode_index] + [
            torch.full((chunk.length,), chunk.row, device=device) for chunk in chunks
        ]
        positions = [self.positions] + [torch.arange(chunk.length, device=device) for chunk in chunks]
        return torch.cat(places), torch.cat(rows), torch.cat(positions)


def visibility(ends: torch.Tensor, span: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, 1, 1, span]: 0 where a row may read (positions 0..its end), -inf past its end: the
    additive mask of a decode batch (`StepLayout.visible`)."""
    hidden = torch.arange(span, device=ends.device) > ends[:, None]
    visible = torch.zeros(hidden.shape, dtype=dtype, device=ends.device).masked_fill_(hidden, float("-inf"))
    return visible[:, None, None, :]
