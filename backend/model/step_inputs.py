"""A step's inputs, packed for one forward pass: the tokens, their positions, what each query may read,
and which logits the step keeps.

The engine decides which rows a step runs (engine/scheduler.py); this
module turns them into tensors, as nano-vllm's `prepare_prefill` and
`prepare_decode` do. The pack is one sequence:

    [ one token for each decoding row, in row order | each prompt chunk's tokens, row by row ]

and the logits kept are those of every decoding row, then, for each prompt
chunk, its last token's where the chunk ends its prompt (the row samples
its first token in this step) or every token's where the row scores its
prompt (`prompt_logprobs`). The rows that sample this step are the
decoding rows and then the rows whose chunk completes their prompt, in
pack order; `sample_from` picks their logits out of the kept ones.

Rows are read through two small protocols, so that the model knows what
a step needs of a row and nothing of the engine's `Row`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from backend.layers.step_layout import LongRow, PromptChunk, StepLayout, long_rows, visibility
from backend.utils.host_lists import to_device


class DecodingRow(Protocol):
    """A row that decodes one token this step."""

    index: int  # its row of the cache

    @property
    def position(self) -> int: ...  # where its token goes

    @property
    def next_input(self) -> int: ...  # the token it feeds: its last sampled


class PrefillingRow(Protocol):
    """A row that prefills a chunk of its prompt this step: prompt_ids[cached:chunk_end]."""

    index: int
    cached: int
    chunk_end: int

    @property
    def prompt_ids(self) -> tuple[int, ...]: ...

    @property
    def scores_prompt(self) -> bool: ...  # whether it asks for its prompt tokens' logprobs


@dataclass(frozen=True)
class PromptScores:
    """The kept logits of a row scoring its prompt: kept[first : first + count] predict its prompt
    tokens after the chunk's first (and the next chunk's first)."""

    row: int
    first: int
    count: int


@dataclass(frozen=True)
class StepInputs:
    """One step's forward pass and what it keeps, on the model's device.

    Invariants (`pack` keeps them; `check` tests them on the host lists, before the tensors):
    the decode queries come first, one a row, rows ascending; `keep` is ascending and starts with
    every decode query's place; `sample_from` indexes `keep`, one entry a sampling row, in pack order.
    """

    token_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]: each token's position in its row
    layout: StepLayout  # where the queries sit and what each may read
    keep: torch.Tensor  # [kept]: places in the pack whose logits the step needs
    sample_from: torch.Tensor | None  # [sampling rows]: their logits among the kept; None: all, in order
    completing: tuple[int, ...]  # the rows whose chunk ends their prompt, in pack order
    prompt_scores: tuple[PromptScores, ...]

    @property
    def decode_queries(self) -> int:
        return self.layout.decode_queries


def pack(
    decoding: Sequence[DecodingRow],
    prefilling: Sequence[PrefillingRow],
    device: torch.device,
    visibility_dtype: torch.dtype,
    reads_own_positions: bool,
) -> StepInputs:
    """The step's inputs for these rows: `decoding` in row order, `prefilling` each with its chunk set.

    `reads_own_positions`: the decode queries attend each over its own row up to its position (the
    CPU's loop); otherwise they attend as a batch over the span's rows, padded to the longest, and the
    longest rows attend alone where that saves reading (`step_layout.long_rows`).
    """
    token_ids = [row.next_input for row in decoding]
    decode_positions = [row.position for row in decoding]
    positions = list(decode_positions)
    chunks: list[PromptChunk] = []
    keep = list(range(len(decoding)))
    sample_from = list(range(len(decoding)))
    completing: list[int] = []
    scores: list[PromptScores] = []
    for row in prefilling:
        past, end = row.cached, row.chunk_end
        start, length, completes = len(token_ids), end - past, end == len(row.prompt_ids)
        chunks.append(PromptChunk(row.index, start, length, past, chunk_visibility(past, length, device)))
        token_ids += row.prompt_ids[past:end]
        positions += range(past, end)
        if row.scores_prompt:
            scores.append(PromptScores(row.index, len(keep), length - completes))  # a last token samples
            keep += range(start, start + length)
        elif completes:
            keep.append(start + length - 1)
        if completes:
            sample_from.append(len(keep) - 1)
            completing.append(row.index)
    check(decoding, keep, sample_from)
    decode_rows = decoding[-1].index + 1 if decoding else 0
    visible, alone = decode_visibility(decoding, decode_rows, device, visibility_dtype, reads_own_positions)
    layout = StepLayout(
        decode_rows,
        to_device([row.index for row in decoding], device, torch.long),
        to_device(decode_positions, device, torch.long),
        visible.shape[-1],
        visible,
        tuple(chunks),
        alone,
    )
    return StepInputs(
        token_ids=to_device(token_ids, device, torch.long),
        positions=to_device(positions, device, torch.long),
        layout=layout,
        keep=to_device(keep, device, torch.long),
        sample_from=None if len(sample_from) == len(keep) else to_device(sample_from, device, torch.long),
        completing=tuple(completing),
        prompt_scores=tuple(scores),
    )


def check(decoding: Sequence[DecodingRow], keep: list[int], sample_from: list[int]) -> None:
    """The invariants `StepInputs` states, on the host lists (a few comparisons a row): a step that broke
    one would sample another row's logits, so it fails here instead, with the reason."""
    rows = [row.index for row in decoding]
    if any(a >= b for a, b in zip(rows, rows[1:], strict=False)):
        raise ValueError(f"decoding rows must come once each, in row order: {rows}")
    if any(a >= b for a, b in zip(keep, keep[1:], strict=False)) or keep[: len(rows)] != list(
        range(len(rows))
    ):
        raise ValueError("the kept places must ascend and begin with every decode query")
    if any(not 0 <= i < len(keep) for i in sample_from):
        raise ValueError("a sampling row's logits must be among the kept ones")


def chunk_visibility(past: int, length: int, device: torch.device) -> torch.Tensor | None:
    """A chunk after the first reads the row's earlier positions and itself causally."""
    if not past:
        return None
    keys = torch.arange(past + length, device=device)
    return keys <= past + torch.arange(length, device=device)[:, None]


def decode_visibility(
    decoding: Sequence[DecodingRow],
    decode_rows: int,
    device: torch.device,
    dtype: torch.dtype,
    reads_own_positions: bool,
) -> tuple[torch.Tensor, tuple[LongRow, ...]]:
    """What each row of the decode span may read ([rows, 1, 1, span]: 0, or -inf past its position),
    and the long rows that attend alone (none where each query reads its own positions). Free rows of
    the span, and the long rows, read their position 0 only in the batch."""
    alone = set() if reads_own_positions else long_rows({r.index: r.position for r in decoding}, decode_rows)
    row_positions = [0] * decode_rows
    for row in decoding:
        if row.index not in alone:
            row_positions[row.index] = row.position
    span = max(row_positions, default=0) + 1
    visible = visibility(to_device(row_positions, device, torch.long), span, dtype)
    long = [LongRow(query, row.index, row.position) for query, row in enumerate(decoding)]
    return visible, tuple(r for r in long if r.row in alone)
