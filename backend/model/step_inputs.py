"""A step's inputs, packed for one forward pass: the tokens, their positions, what each query may read,
and which logits the step keeps.

The engine decides which rows a step runs (engine/scheduler.py); this
module turns them into tensors, as nano-vllm's `prepare_prefill` and
`prepare_decode` do. The pack is one sequence:

    [ the decode queries, in row order | each prompt chunk's tokens, row by row ]

A decoding row's queries are its last token and, where it has a draft
(engine/speculation.py), the draft's tokens at the positions after it:
decode queries of the same row where each decode query reads its own row
up to its own position (the CPU's loop), else a chunk of the row after the
prompt chunks' places, as a prompt's next chunk is. There, a short
prompt's chunk the engine marks `as_queries` is decode queries of its row
too, among the others in row order (engine._prompts_as_queries). The logits
kept are those of every decoding row's query and draft token, and the last
token's of a prompt whose chunk as queries ends it (every token's where the row
scores its prompt), then, for each prompt chunk,
its last token's where the chunk ends its prompt (the row samples its
first token in this step) or every token's where the row scores its
prompt (`prompt_logprobs`). The rows that sample this step are the
decoding rows, each at its token and its draft's, and then the rows whose
chunk completes their prompt; `sample_from` picks their logits out of the
kept ones, in that order. A step may also carry a chunk of an embedding
input, prefilled in a spare row (the highest) as a prompt is: it keeps no
logits, and the step gives back its tokens' last hidden states instead
(`embedded`). Where each decode query reads its own row up to its position,
the chunk's tokens are decode queries of that row, after the others (a step
of decode queries alone runs the decode path, without a prompt chunk's fixed
cost); else it is a chunk after the prompts'.

Rows are read through two small protocols, so that the model knows what
a step needs of a row and nothing of the engine's `Row`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from backend.layers.step_layout import LongRow, PromptChunk, StepLayout, long_rows, visibility
from backend.model.lora import StepAdapters, adapter_slots
from backend.utils.host_lists import to_device


class DecodingRow(Protocol):
    """A row that decodes one token this step."""

    index: int  # its row of the cache

    @property
    def position(self) -> int: ...  # where its token goes

    @property
    def next_input(self) -> int: ...  # the token it feeds: its last sampled

    @property
    def draft(self) -> tuple[int, ...]: ...  # the tokens it feeds after it, to verify (speculation.py)


class PrefillingRow(Protocol):
    """A row that prefills a chunk of its prompt this step: prompt_ids[cached:chunk_end]."""

    index: int
    cached: int
    chunk_end: int
    # Its chunk as decode queries of its row, where they read their own rows (never a row scoring its
    # prompt: only the last token's logits are kept).
    as_queries: bool

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
    the decode queries come first, rows ascending, a row's at consecutive positions; `keep` is
    ascending; `sample_from` indexes `keep`, one entry a sampled position: each decoding row's
    1 + len(draft), in row order, then one a completing row.
    """

    token_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]: each token's position in its row
    layout: StepLayout  # where the queries sit and what each may read
    keep: torch.Tensor  # [kept]: places in the pack whose logits the step needs
    sample_from: torch.Tensor | None  # [sampling rows]: their logits among the kept; None: all, in order
    completing: tuple[int, ...]  # the rows whose chunk ends their prompt, in pack order
    prompt_scores: tuple[PromptScores, ...]
    embedded: range | None = None  # the places of an embedding input's chunk, whose hidden states it needs
    adapters: StepAdapters | None = None  # its tokens' LoRA adapters (lora.py); None: no token has one

    @property
    def decode_queries(self) -> int:
        return self.layout.decode_queries


def pack(
    decoding: Sequence[DecodingRow],
    prefilling: Sequence[PrefillingRow],
    device: torch.device,
    visibility_dtype: torch.dtype,
    reads_own_positions: bool,
    embedding: PrefillingRow | None = None,
    row_adapters: Sequence[int] | None = None,
) -> StepInputs:
    """The step's inputs for these rows: `decoding` in row order, `prefilling` each with its chunk set,
    and `embedding`'s chunk, whose hidden states the step gives back instead of logits. `row_adapters`:
    each row's LoRA adapter slot (0: none), where some row has one.

    `reads_own_positions`: the decode queries attend each over its own row up to its position (the
    CPU's loop); otherwise they attend as a batch over the span's rows, padded to the longest, and the
    longest rows attend alone where that saves reading (`step_layout.long_rows`).
    """
    token_ids: list[int] = []
    query_rows: list[int] = []  # the row of each decode query
    decode_positions: list[int] = []
    keep: list[int] = []
    kept_at: dict[int, range] = {}  # each decoding row's places among the kept logits
    completing: list[int] = []  # the rows whose chunk ends their prompt, in pack order
    completes_at: list[int] = []  # their places among the kept logits
    scores: list[PromptScores] = []
    as_queries = [row for row in decoding if reads_own_positions or not row.draft]
    queried = {row.index for row in prefilling if reads_own_positions and row.as_queries}
    in_row_order = sorted([*as_queries, *(row for row in prefilling if row.index in queried)], key=row_index)
    for row in in_row_order:  # decode queries come in row order: a short prompt's chunk among them
        if row.index in queried:  # a prompt's chunk: its last token's logits if it ends the prompt
            past, end = row.cached, row.chunk_end
            start, completes = len(token_ids), end == len(row.prompt_ids)
            token_ids += row.prompt_ids[past:end]
            query_rows += [row.index] * (end - past)
            decode_positions += range(past, end)
            if row.scores_prompt:  # every token's, as a chunk keeps them (a last token samples)
                scores.append(PromptScores(row.index, len(keep), end - past - completes))
                keep += range(start, len(token_ids))
            elif completes:
                keep.append(len(token_ids) - 1)
            if completes:  # the row samples its first token
                completing.append(row.index)
                completes_at.append(len(keep) - 1)
        else:  # a decoding row: its token and its draft's, each kept
            length = 1 + len(row.draft)
            kept_at[row.index] = range(len(keep), len(keep) + length)
            keep += range(len(token_ids), len(token_ids) + length)
            token_ids += (row.next_input, *row.draft)
            query_rows += [row.index] * length
            decode_positions += range(row.position, row.position + length)
    positions = list(decode_positions)
    chunks: list[PromptChunk] = []
    embedded = None
    if embedding is not None and embedding.as_queries and reads_own_positions:
        past, end = embedding.cached, embedding.chunk_end
        embedded = range(len(token_ids), len(token_ids) + end - past)
        token_ids += embedding.prompt_ids[past:end]
        query_rows += [embedding.index] * (end - past)
        decode_positions += range(past, end)
        positions += range(past, end)
    for row in decoding:  # drafts as chunks: the decode queries attend as a batch, one a row
        if row.index not in kept_at:
            start, past, length = len(token_ids), row.position, 1 + len(row.draft)
            chunks.append(PromptChunk(row.index, start, length, past, chunk_visibility(past, length, device)))
            token_ids += (row.next_input, *row.draft)
            positions += range(past, past + length)
            kept_at[row.index] = range(len(keep), len(keep) + length)
            keep += range(start, start + length)
    sample_from = [place for row in decoding for place in kept_at[row.index]] + completes_at
    for row in prefilling:
        if row.index in queried:
            continue
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
    if embedding is not None and embedded is None:
        past, end = embedding.cached, embedding.chunk_end
        start, length = len(token_ids), end - past
        chunks.append(
            PromptChunk(embedding.index, start, length, past, chunk_visibility(past, length, device))
        )
        token_ids += embedding.prompt_ids[past:end]
        positions += range(past, end)
        embedded = range(start, start + length)
    check(query_rows, decode_positions, keep, sample_from)
    decode_rows = query_rows[-1] + 1 if query_rows else 0
    visible, alone = decode_visibility(as_queries, decode_rows, device, visibility_dtype, reads_own_positions)
    layout = StepLayout(
        decode_rows,
        to_device(query_rows, device, torch.long),
        to_device(decode_positions, device, torch.long),
        visible.shape[-1],
        visible,
        tuple(chunks),
        alone,
    )
    in_order = sample_from == list(range(len(keep)))
    adapters = None
    if row_adapters is not None:  # each packed token's row: the decode queries', then each chunk's
        token_rows = query_rows + [chunk.row for chunk in chunks for _ in range(chunk.length)]
        adapters = adapter_slots(token_rows, row_adapters, device)
    return StepInputs(
        token_ids=to_device(token_ids, device, torch.long),
        positions=to_device(positions, device, torch.long),
        layout=layout,
        keep=to_device(keep, device, torch.long),
        sample_from=None if in_order else to_device(sample_from, device, torch.long),
        completing=tuple(completing),
        prompt_scores=tuple(scores),
        embedded=embedded,
        adapters=adapters,
    )


def row_index(row: DecodingRow | PrefillingRow) -> int:
    return row.index


def check(rows: list[int], positions: list[int], keep: list[int], sample_from: list[int]) -> None:
    """The invariants `StepInputs` states, on the host lists (a few comparisons a query): a step that broke
    one would sample another row's logits, so it fails here instead, with the reason."""
    for (row, position), (next_row, next_position) in zip(
        zip(rows, positions, strict=True), zip(rows[1:], positions[1:], strict=True), strict=False
    ):
        if next_row < row or (next_row == row and next_position != position + 1):
            raise ValueError(
                f"decode queries must come in row order, a row's at consecutive positions: {rows}"
            )
    if any(a >= b for a, b in zip(keep, keep[1:], strict=False)):
        raise ValueError("the kept places must ascend")
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
    """What each row of the decode span may read ([rows, 1, 1, span]: 0, or -inf past its position, its
    draft's last where it has one), and the long rows that attend alone (none where each query reads its
    own positions). Free rows of the span, and the long rows, read their position 0 only in the batch."""
    alone = set() if reads_own_positions else long_rows({r.index: r.position for r in decoding}, decode_rows)
    row_positions = [0] * decode_rows
    for row in decoding:
        if row.index not in alone:
            row_positions[row.index] = row.position + len(row.draft)
    span = max(row_positions, default=0) + 1
    visible = visibility(to_device(row_positions, device, torch.long), span, dtype)
    long = [LongRow(query, row.index, row.position) for query, row in enumerate(decoding)]
    return visible, tuple(r for r in long if r.row in alone)
