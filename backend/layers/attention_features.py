"""What a layer may ask of attention beyond plain causal attention: a sliding window, soft-capped logits,
attention sinks.

transformers' attention layers pass these to every attention implementation as keyword arguments
(Mistral, Gemma 2 and 3, Cohere 2 and gpt-oss a `sliding_window`, Gemma 2 a `softcap`, gpt-oss its
per-head sinks as `s_aux`), and the row attention (attention.py) honours each of them, as
transformers' own eager attention does:

- a window of W: the query at position p reads positions p-W+1..p only (masking_utils'
  `sliding_window_overlay`: key > query - W). The row keeps every position (the cache is not a ring), so
  prefix reuse and chunked prefill are unchanged: a window layer just reads less of it;
- soft-capping: the logits, after scaling, become `softcap * tanh(logits / softcap)` before the mask;
- sinks: one more logit per head, in the softmax and not in the sum (it takes a share of each query's
  attention and gives nothing back);
- a bias by key position (ALiBi: Falcon-RW's positions, a slope per head times the key's position,
  which a layer of its own passes, not transformers' interface): added to each head's logits.

A window and a bias keep PyTorch's fused kernel (they are masks); soft-capping and sinks take the
matmuls below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)  # eq: a tensor field
class AttentionFeatures:
    """What one layer's attention call asks for beyond causal attention with its scale."""

    window: int | None = None  # a query reads its last `window` positions, itself included
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [heads]: each head's sink logit
    key_bias: torch.Tensor | None = None  # [heads, positions]: added to a head's logits by key position

    @classmethod
    def asked(cls, kwargs: dict, positions: int) -> AttentionFeatures | None:
        """The features in an attention call's keyword arguments, none where it asks for none that can
        come into play: a window as long as the cache (`positions`) never hides a thing."""
        window = kwargs.get("sliding_window")
        window = window if window is not None and window < positions else None
        softcap, sinks = kwargs.get("softcap") or None, kwargs.get("s_aux")
        if window is None and softcap is None and sinks is None:
            return None
        return cls(window, softcap, sinks)

    @property
    def needs_matmuls(self) -> bool:
        """Whether PyTorch's fused attention cannot do it: soft-capping and sinks change the softmax."""
        return self.softcap is not None or self.sinks is not None

    def with_key_bias(self, mask: torch.Tensor | None, keys: int, dtype: torch.dtype) -> torch.Tensor:
        """`mask` (True or 0 where a query reads, broadcast to [batch, 1, queries, keys]; None: all) as
        additive logits in `dtype` with each head's bias by key position added: [batch or 1, heads,
        queries or 1, keys]."""
        bias = self.key_bias[:, :keys].to(dtype)[None, :, None]
        if mask is None:
            return bias
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
        return mask.to(dtype) + bias

    def window_hides(self, query_positions: torch.Tensor, keys: int) -> torch.Tensor | None:
        """[queries, keys] True where a query's window hides a key position (0..keys-1); None without a
        window."""
        if self.window is None:
            return None
        return torch.arange(keys, device=query_positions.device) <= query_positions[:, None] - self.window


def attention_with(
    query: torch.Tensor,  # [batch, heads, queries, head_dim]
    key: torch.Tensor,  # [batch, kv_heads, keys, head_dim]
    value: torch.Tensor,
    mask: torch.Tensor | None,  # broadcast to [batch, 1, queries, keys]: True or 0 where a query reads
    scaling: float | None,
    features: AttentionFeatures,
) -> torch.Tensor:
    """Attention with soft-capped logits and/or sinks, as transformers' eager attention computes it:
    [batch, heads, queries, head_dim]. The query heads that share a key head are grouped, not the keys
    repeated."""
    batch, heads, queries, head_dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, queries, head_dim)
    scale = scaling if scaling is not None else head_dim**-0.5
    logits = grouped @ key[:, :, None].transpose(-1, -2) * scale  # [batch, kv_heads, group, queries, keys]
    if features.softcap is not None:
        logits = torch.tanh(logits / features.softcap) * features.softcap
    if mask is not None:
        mask = mask[:, :, None]  # over the group's heads too
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    if features.sinks is not None:
        sinks = features.sinks.to(logits.dtype).reshape(1, kv_heads, -1, 1, 1).expand(*logits.shape[:-1], 1)
        weights = torch.softmax(torch.cat([logits, sinks], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(logits, dim=-1)
    return (weights @ value[:, :, None]).reshape(batch, heads, queries, head_dim)
