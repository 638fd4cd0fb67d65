"""Attention for a step that mixes decode rows and new prompts in one forward pass.

The model runner packs every query of a step into one sequence (model/step_inputs.py,
laid out as step_layout.py says): first one token for each decoding row, then the tokens
of each new prompt. The linear layers run
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
from collections.abc import Callable, Iterator

import torch
from torch.nn.functional import scaled_dot_product_attention
from transformers import AttentionInterface, PretrainedConfig

from backend.layers.attention_features import AttentionFeatures, attention_with
from backend.layers.step_layout import PromptChunk, StepLayout

ROW_ATTENTION = "row_attention"

_current_layout: contextvars.ContextVar[StepLayout] = contextvars.ContextVar("row_attention_layout")


@contextlib.contextmanager
def attending_over(config: PretrainedConfig, layout: StepLayout) -> Iterator[None]:
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
    """transformers' attention interface over `attend` (or the layer's own `attend_rows`), with the layout
    of the step in progress and what the layer asks for beyond causal attention (a window, soft-capping,
    sinks)."""
    features = AttentionFeatures.asked(kwargs, positions=key.shape[2])
    # A layer that attends its own way over the row cache names it (model/latent_attention.py, DeepSeek's).
    attend_rows = getattr(module, "attend_rows", attend)
    return attend_rows(query, key, value, _current_layout.get(), scaling, features=features), None


def attend(
    query: torch.Tensor,  # [1, heads, tokens, head_dim], the packed queries
    key: torch.Tensor,  # [rows, kv_heads, max_seq_len, head_dim], the whole cache of this layer
    value: torch.Tensor,
    layout: StepLayout,
    scaling: float | None,
    by_position: Callable | None = None,
    features: AttentionFeatures | None = None,
) -> torch.Tensor:
    """Each query over what it may read of the cache; returns [1, tokens, heads, head_dim].

    Attention runs in the cache's dtype (row_cache.pick_cache_dtype), the output in the queries' own.
    `by_position` (decode_ops.FusedOps.attend: the CPU's loop) takes the decode queries where there is
    one, each over its own row up to its own position: no batch padded to the longest row, no long rows
    apart (the engine makes none for it); and short new prompts (`StepLayout.loop_takes`) with them.
    `features` (attention_features.py): a window, soft-capping or sinks, all of which the loop does too.
    """
    query_dtype, query = query.dtype, query.to(key.dtype)
    output = torch.empty_like(query)
    n, decoding = layout.decode_rows, layout.decode_queries
    if by_position is not None:
        asked = features or AttentionFeatures()  # (none: a window, sinks and a cap of none)
        places, rows, positions = layout.by_position
        if places.shape[0]:
            queries = query[0].index_select(1, places).transpose(0, 1).contiguous()  # [taken, heads, dim]
            attended = by_position(
                queries,
                key,
                value,
                rows,
                positions,
                layout.visible,
                scaling,
                window=asked.window,
                sinks=asked.sinks,
                softcap=asked.softcap,
            )
            output[0].index_copy_(1, places, attended.transpose(0, 1))
    elif decoding:
        queries = query[0, :, :decoding].unsqueeze(2).transpose(0, 1)  # [decoding, heads, 1, head_dim]
        if layout.has_free_rows:  # one query per row of the span, zero for the free ones
            queries = queries.new_zeros((n, *queries.shape[1:])).index_copy_(0, layout.decode_index, queries)
        visible = layout.visible
        if features is not None and features.window is not None:
            hides = features.window_hides(layout.batch_ends, layout.span)
            visible = visible.masked_fill(hides[:, None, None], float("-inf"))
        attended = scaled(
            queries, key[:n, :, : layout.span], value[:n, :, : layout.span], scaling, features, visible
        )
        if layout.has_free_rows:
            attended = attended.index_select(0, layout.decode_index)
        output[0, :, :decoding] = attended.squeeze(2).transpose(0, 1)
        for long_row in layout.long_rows:  # a single query reads all it may: no mask
            pack, end = slice(long_row.query, long_row.query + 1), long_row.position + 1
            start = max(0, end - features.window) if features is not None and features.window else 0
            output[:, :, pack] = scaled(
                query[:, :, pack],
                key[long_row.row : long_row.row + 1, :, start:end],
                value[long_row.row : long_row.row + 1, :, start:end],
                scaling,
                features,
            )
    for chunk in layout.prompts:
        if by_position is not None and layout.loop_takes(chunk):
            continue
        end, pack = chunk.past + chunk.length, slice(chunk.start, chunk.start + chunk.length)
        output[:, :, pack] = scaled(
            query[:, :, pack],
            key[chunk.row : chunk.row + 1, :, :end],
            value[chunk.row : chunk.row + 1, :, :end],
            scaling,
            features,
            *chunk_reads(chunk, features, query.device),
        )
    return output.transpose(1, 2).to(query_dtype, memory_format=torch.contiguous_format)


def scaled(
    query: torch.Tensor,  # [batch, heads, queries, head_dim]
    key: torch.Tensor,  # [batch, kv_heads, keys, head_dim]
    value: torch.Tensor,
    scaling: float | None,
    features: AttentionFeatures | None,
    mask: torch.Tensor | None = None,  # [batch or 1, 1, queries, keys]: True or 0 where a query reads
    is_causal: bool = False,
) -> torch.Tensor:
    """PyTorch's fused attention, or the matmuls where the layer's features need them."""
    if features is not None and features.key_bias is not None:  # keys from position 0 (no window)
        assert not features.needs_matmuls, "a bias by key position beside soft-capping or sinks"
        mask, is_causal = features.with_key_bias(mask, key.shape[2], query.dtype), False
    if features is not None and features.needs_matmuls:
        return attention_with(query, key, value, mask, scaling, features)
    if query.shape[2] == 1 and not is_causal and (mask is None or mask.shape[1] == 1):
        return one_query_each(query, key, value, mask, scaling)
    return scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling, enable_gqa=True
    )


def one_query_each(
    query: torch.Tensor,  # [batch, heads, 1, head_dim]: a decode step's, one query a row
    key: torch.Tensor,  # [batch, kv_heads, keys, head_dim]
    value: torch.Tensor,
    mask: torch.Tensor | None,  # [batch or 1, 1, 1, keys], the same for every head
    scaling: float | None,
) -> torch.Tensor:
    """Attention of one query a batch item, each key head's group of query heads attending as that head's
    queries: one PyTorch attention over [batch, kv_heads, group, head_dim], no key repeated.

    What `enable_gqa` gives, but PyTorch's CPU kernel repeats each key head for its group first: a decode
    step of 32 rows over 1,024 positions took 2.6x as long in float32 (Qwen-like 32 heads over 8 key
    heads: 37 ms against 22) and 10-29x in bfloat16 (a latent-attention layer's 16 heads over one of 576:
    439 ms against 15), on this 2-core CPU."""
    batch, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    attended = scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)
    return attended.reshape(batch, heads, 1, value.shape[-1])


def chunk_reads(
    chunk: PromptChunk, features: AttentionFeatures | None, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """(mask, is_causal) of a prompt chunk over its row's positions 0..past+length-1: its own causal mask
    (none where it starts the row: causal); with features, an explicit one, narrowed to the window where
    the layer has one (the matmuls of soft-capping and sinks take a mask, not `is_causal`)."""
    if features is None:
        return chunk.visible, chunk.visible is None
    end = chunk.past + chunk.length
    positions = torch.arange(chunk.past, end, device=device)
    reads = torch.arange(end, device=device) <= positions[:, None]
    hides = features.window_hides(positions, end)
    if hides is not None:
        reads &= ~hides
    return reads[None, None], False


AttentionInterface.register(ROW_ATTENTION, row_attention)
