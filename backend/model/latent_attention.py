"""DeepSeek's multi-head latent attention (MLA) over the row cache, its expansion absorbed.

An MLA layer compresses each token's keys and values into one latent (`kv_lora_rank`: 512 in
DeepSeek-V3) beside a rotated key that all heads share (`qk_rope_head_dim`: 64); `kv_b_proj` expands
the latent into each head's key part and value (V3: 128 heads of 128 + 128). transformers' layer caches
the latent and expands the whole cache every step, which over the row cache would expand every row's
every position, each step, in each layer.

Here the cache keeps the latent and the rotated key side by side, one tensor a layer
(row_cache.LatentCacheLayer: V3's 576 numbers a position a layer, where keys and values expanded take
2 x 128 x 192), and each layer attends over it as it is, `kv_b_proj` absorbed into the queries and the
output, as DeepSeek's own inference code, vLLM and llama.cpp do. A head's score is
q_nope . (W_UK c) + q_rope . k_rope = (W_UK^T q_nope) . c + q_rope . k_rope, and its output is
sum_j a_j W_UV c_j = W_UV (sum_j a_j c_j): attention over one key head of 576 that every query head
reads, whose first 512 are also the values, then W_UV per head. The scale is the layer's own: the
scores are the same numbers.

transformers' forward runs as it is (its projections and norms, its rotary convention: DeepSeek-V2's
complex one, V3's interleaved or not, and any scaling of the queries); within an engine's step
`expand_kv` hands the cache on unexpanded and the layer's `attend_rows` (attention.row_attention calls
it) absorbs. Outside a step (`generate`, say) the layer is transformers' own.

DeepSeek-V3.2's and GLM-5's layers add sparse attention (DSA): a lightning indexer scores each query
against the keys before it and the query reads its top `index_topk` (2,048) of them alone. Rows no longer
than that (cache_size.context_length) leave it nothing to choose: every key before a query is among its
top 2,048, and its attention is V3's. Within a step the indexer is left out (`ChoosesEveryKey`): it would
keep a cache of its own keys, which the row cache does not hold, to choose every key again.
"""

from __future__ import annotations

import torch

from backend.layers.attention import _current_layout, attend
from backend.layers.attention_features import AttentionFeatures
from backend.layers.step_layout import StepLayout
from backend.model.mix_in import mix_in


def attend_over_latents(model: torch.nn.Module) -> torch.nn.Module:
    """Make each latent-attention layer of the model (one with `kv_b_proj` and `expand_kv`) attend over
    the row cache's latents within `attending_over`, its DSA indexer left out there; returns the model.
    Applying it twice changes nothing."""
    for module in model.modules():
        if hasattr(module, "kv_b_proj") and hasattr(module, "expand_kv"):
            mix_in(module, AbsorbsLatents)
        if hasattr(module, "kv_b_proj") and hasattr(module, "indexer"):  # (GLM-5's sharing layers: None)
            mix_in(module, MasksForTheIndexer)
            if module.indexer is not None:
                mix_in(module.indexer, ChoosesEveryKey)
    return model


class MasksForTheIndexer:
    """A DSA layer within a step: handed a mask, which it indexes for its indexer before the call (a step
    gives none: the row attention reads each row's own positions), and which goes no further."""

    def forward(self, *args, **kwargs):
        if _current_layout.get(None) is not None and kwargs.get("attention_mask") is None:
            kwargs["attention_mask"] = torch.zeros((1, 1, 1, 1))  # (never read: no device to match)
        return super().forward(*args, **kwargs)


class ChoosesEveryKey:
    """A DSA indexer within a step: its choice is every key (the rows are no longer than its top k), which
    the row attention reads anyway, so it computes none. Its layer still hands what it gives to the
    attention interface (as `indices`, which the row attention leaves) and to the next layer (GLM-5's
    layers that share their choice)."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if _current_layout.get(None) is None:
            return super().forward(hidden_states, *args, **kwargs)
        return torch.zeros((*hidden_states.shape[:-1], 1), dtype=torch.long, device=hidden_states.device)


class AbsorbsLatents:
    """A latent-attention layer over the row cache, mixed in above the layer's own class."""

    def expand_kv(self, latent: torch.Tensor, rotated_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if _current_layout.get(None) is None:  # transformers' attention over its own cache
            return super().expand_kv(latent, rotated_key)
        return latent, rotated_key  # both the layer's whole cache, as LatentCacheLayer.update returned it

    def attend_rows(
        self,
        query: torch.Tensor,  # [1, heads, tokens, nope + rope]: transformers' queries, rotated and scaled
        key: torch.Tensor,  # [rows, 1, max_seq_len, rank + rope]: the layer's cache
        value: torch.Tensor,  # the same tensor
        layout: StepLayout,
        scaling: float | None,
        features: AttentionFeatures | None = None,
    ) -> torch.Tensor:
        """Each query over what it may read of the cache, as `attend`; returns [1, tokens, heads, v]."""
        key_part, value_part = self.absorbed(query)
        nope, rope = query.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent_query = torch.cat((nope @ key_part, rope), dim=-1)  # [1, heads, tokens, rank + rope]
        attended = attend(latent_query, key, value, layout, scaling, features=features)
        latent_output = attended[..., : self.kv_lora_rank]  # [1, tokens, heads, rank]
        return torch.einsum("bthr,hvr->bthv", latent_output, value_part)

    def absorbed(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`kv_b_proj`'s weight by head, in the query's dtype: its key part [heads, nope, rank] and its
        value part [heads, v, rank]. A float linear layer's own weight, viewed; a quantized one's
        (`--quantize`, a GPTQ file) read once through the layer from the identity, and kept."""
        weight = self.__dict__.get("_expansion")
        if weight is None:
            weight = layer_weight(
                self.kv_b_proj, torch.eye(self.kv_lora_rank, dtype=query.dtype, device=query.device)
            )
            if weight is not getattr(self.kv_b_proj, "weight", None):
                self.__dict__["_expansion"] = weight
        by_head = weight.to(query.dtype).view(-1, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return by_head[:, : self.qk_nope_head_dim], by_head[:, self.qk_nope_head_dim :]


def layer_weight(layer: torch.nn.Module, identity: torch.Tensor) -> torch.Tensor:
    """[outputs, inputs]: a linear layer's weight, its own where it is a float `nn.Linear`, else what it
    computes from the identity of its inputs (each output one weight times one: the weight it multiplies
    by)."""
    weight = getattr(layer, "weight", None)
    if type(layer) is torch.nn.Linear and weight.is_floating_point():
        return weight
    with torch.no_grad():
        return layer(identity).T.contiguous()
