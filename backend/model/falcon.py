"""Falcon's attention over the row cache.

transformers' Falcon does not go through its attention interface: FalconAttention.forward writes the
cache and then attends itself, SDPA or eager over a causal mask from `create_causal_mask`. Over the
row cache that reads every row's whole cache as one sequence, and under `attending_over` (whose
implementation has no mask function, so the mask is None) its eager branch adds None to the scores.
`attend_over_rows` gives each FalconAttention of a model a forward that computes queries, keys and
values as transformers does, writes keys and values through the cache and attends with the engine's
`attend` over the step's layout; outside a step (`generate`, say) the layer is transformers' own.
The rest of FalconModel's forward runs as it is over the row cache: `get_seq_length` is 0 and the
positions are passed, so the rotary embeddings are each token's own, and the mask it makes (None) is
not read.

Falcon-RW has ALiBi positions instead of rotary ones: each head adds its slope times a key's position
to its logits. transformers adds the bias it builds for the whole (packed) sequence to its mask; here
each head's bias by row position is the attention's `key_bias` (attention_features.py), built as
transformers builds it (its slopes rounded to bfloat16, over the head size's square root), once.
"""

from __future__ import annotations

import functools
import math

import torch
from transformers.cache_utils import Cache
from transformers.models.falcon.modeling_falcon import (
    FalconAttention,
    apply_rotary_pos_emb,
    build_alibi_tensor,
)

from backend.layers.attention import _current_layout, attend
from backend.layers.attention_features import AttentionFeatures
from backend.model.mix_in import mix_in


def attend_over_rows(model: torch.nn.Module) -> torch.nn.Module:
    """Make each of the model's Falcon attention layers attend through the engine's `attend` inside
    `attending_over` (the model runner's step); returns the model. Applying it twice changes nothing."""
    for module in model.modules():
        if isinstance(module, FalconAttention):  # or FalconFlashAttention2, its fallback
            mix_in(module, AttendsOverRows)
    return model


class AttendsOverRows:
    """A FalconAttention's forward over the row cache, mixed in above the layer's own class."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        alibi: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        layer_past: Cache | None = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        layout = _current_layout.get(None)
        if layout is None:  # not in an engine's step: transformers' attention over its own cache
            return super().forward(
                hidden_states,
                alibi,
                attention_mask,
                position_ids,
                layer_past,
                use_cache,
                output_attentions,
                position_embeddings,
                **kwargs,
            )
        query, key, value = self.heads(hidden_states)
        if not self.config.alibi:
            cos, sin = position_embeddings  # of each packed token's own position
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
        # The new architecture's keys come out of `_split_heads` once per query head: the cache keeps
        # one per group (row_cache.key_value_heads).
        kv_heads = layer_past.kv_heads
        key, value = layer_past.update(fit_heads(key, kv_heads), fit_heads(value, kv_heads), self.layer_idx)
        features = None
        if self.config.alibi:
            bias = alibi_bias(self.num_heads, self.head_dim, key.shape[2], key.device, key.dtype)
            features = AttentionFeatures(key_bias=bias)
        # 1/sqrt(head_dim), as SDPA's default in transformers' branch and its eager division
        attended = attend(query, key, value, layout, self.inv_norm_factor, features=features)
        return self.dense(attended.reshape(*hidden_states.shape[:2], -1)), None

    def heads(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query [batch, heads, tokens, head_dim], key and value [batch, their heads, tokens, head_dim],
        as transformers' forward makes them: the new architecture's keys and values come out of
        `_split_heads` repeated for every query head of their group, multi-query's as one head."""
        query, key, value = self._split_heads(self.query_key_value(hidden_states))
        return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


@functools.lru_cache(maxsize=8)
def alibi_bias(
    heads: int, head_dim: int, positions: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """[heads, positions]: each head's ALiBi logit at each key position, as transformers' FalconModel adds
    it to SDPA's mask (`build_alibi_tensor` over an all-ones mask, over sqrt(head_dim)); one tensor a
    cache shape, which every layer and step reads."""
    ones = torch.ones((1, positions), dtype=torch.long, device=device)
    alibi = build_alibi_tensor(ones, heads, dtype).reshape(heads, positions)
    return alibi / math.sqrt(head_dim)


def fit_heads(states: torch.Tensor, heads: int) -> torch.Tensor:
    """Keys or values [batch, h, tokens, head_dim] as the cache's `heads` (row_cache.key_value_heads):
    one of each group's copies, query head i reading cache head i // (query heads / heads) as `attend`
    does (SDPA's enable_gqa); a multi-query layer's one head, or a head for each query, as they are."""
    have = states.shape[1]
    return states[:, :: have // heads] if have > heads else states
