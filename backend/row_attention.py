"""Attention for a step that mixes decode rows and new prompts in one forward pass.

The engine packs every query of a step into one sequence: first one token for
each decoding row, then the tokens of each new prompt. The linear layers run
once over the whole pack, so a free row costs them nothing. Attention cannot:
a decode query reads its own row of the cache up to its position, a prompt
token reads its own prompt up to itself (a chunk of a long prompt, prefilled over several
steps, also reads the chunks before it). The decode queries attend as one
batch over rows 0..n-1 of the cache (n-1 the last decoding row); free rows
inside that span get a zero query whose output is dropped. This function,
registered with transformers as an attention implementation, does both with
two kinds of scaled-dot-product calls over the cache the layer has just
written (see row_cache.py); the model classes stay transformers' own.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.nn.functional import scaled_dot_product_attention
from transformers import AttentionInterface, PretrainedConfig

ROW_ATTENTION = "row_attention"


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


_current_layout: contextvars.ContextVar[StepLayout] = contextvars.ContextVar("row_attention_layout")


@contextlib.contextmanager
def step_layout(config: PretrainedConfig, layout: StepLayout) -> Iterator[None]:
    """Within this block, the model attends with row_attention over this step's layout."""
    text_config = config.get_text_config()
    configs = [config] if text_config is config else [config, text_config]
    saved = [c._attn_implementation for c in configs]
    token = _current_layout.set(layout)
    for c in configs:
        c._attn_implementation = ROW_ATTENTION
    try:
        yield
    finally:
        for c, implementation in zip(configs, saved, strict=True):
            c._attn_implementation = implementation
        _current_layout.reset(token)


def row_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, tokens, head_dim], the packed queries
    key: torch.Tensor,  # [rows, kv_heads, max_seq_len, head_dim], the whole cache of this layer
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over `attend`, with the layout of the step in progress."""
    return attend(query, key, value, _current_layout.get(), scaling), None


def attend(
    query: torch.Tensor,  # [1, heads, tokens, head_dim], the packed queries
    key: torch.Tensor,  # [rows, kv_heads, max_seq_len, head_dim], the whole cache of this layer
    value: torch.Tensor,
    layout: StepLayout,
    scaling: float | None,
    by_position: Callable | None = None,
) -> torch.Tensor:
    """Each query over what it may read of the cache; returns [1, tokens, heads, head_dim].

    Attention runs in the cache's dtype (row_cache.pick_cache_dtype), the output in the queries' own.
    `by_position` (fused_ops.FusedOps.attend: the CPU's loop) takes the decode queries where there is
    one, each over its own row up to its own position: no batch padded to the longest row, no long rows
    apart (the engine makes none for it); and short new prompts (`StepLayout.loop_takes`) with them.
    """
    query_dtype, query = query.dtype, query.to(key.dtype)
    output = torch.empty_like(query)
    n, decoding = layout.decode_rows, layout.decode_queries
    if by_position is not None:
        places, rows, positions = layout.by_position
        if places.shape[0]:
            queries = query[0].index_select(1, places).transpose(0, 1).contiguous()  # [taken, heads, dim]
            attended = by_position(queries, key, value, rows, positions, layout.visible, scaling)
            output[0].index_copy_(1, places, attended.transpose(0, 1))
    elif decoding:
        queries = query[0, :, :decoding].unsqueeze(2).transpose(0, 1)  # [decoding, heads, 1, head_dim]
        if layout.has_free_rows:  # one query per row of the span, zero for the free ones
            queries = queries.new_zeros((n, *queries.shape[1:])).index_copy_(0, layout.decode_index, queries)
        attended = scaled_dot_product_attention(
            queries,
            key[:n, :, : layout.span],
            value[:n, :, : layout.span],
            attn_mask=layout.visible,
            scale=scaling,
            enable_gqa=True,
        )
        if layout.has_free_rows:
            attended = attended.index_select(0, layout.decode_index)
        output[0, :, :decoding] = attended.squeeze(2).transpose(0, 1)
        for long_row in layout.long_rows:  # a single query reads all it may: no mask
            pack, end = slice(long_row.query, long_row.query + 1), long_row.position + 1
            output[:, :, pack] = scaled_dot_product_attention(
                query[:, :, pack],
                key[long_row.row : long_row.row + 1, :, :end],
                value[long_row.row : long_row.row + 1, :, :end],
                scale=scaling,
                enable_gqa=True,
            )
    for chunk in layout.prompts:
        if by_position is not None and layout.loop_takes(chunk):
            continue
        end, pack = chunk.past + chunk.length, slice(chunk.start, chunk.start + chunk.length)
        output[:, :, pack] = scaled_dot_product_attention(
            query[:, :, pack],
            key[chunk.row : chunk.row + 1, :, :end],
            value[chunk.row : chunk.row + 1, :, :end],
            attn_mask=chunk.visible,
            is_causal=chunk.visible is None,
            scale=scaling,
            enable_gqa=True,
        )
    return output.transpose(1, 2).to(query_dtype, memory_format=torch.contiguous_format)


AttentionInterface.register(ROW_ATTENTION, row_attention)
