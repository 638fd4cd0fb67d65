"""The forward pass of a Llama-family decoder over the row cache, without transformers' module calls.

transformers' model classes spend, per layer, more Python on keyword
arguments, masks, hooks and output objects than a one-row decode step
spends multiplying once the weights are 4-bit (docs/performance.md: about
5 ms of a 17 ms step on the default model). For the decoder families whose
layer is exactly

    x = x + o_proj(attention(rope(q_proj(norm(x))), rope(k_proj(...)), v_proj(...)))
    x = x + down_proj(silu(gate_proj(norm(x))) * up_proj(norm(x)))

this runner does the same arithmetic on the same modules' weights in fewer
operations: transformers' rotary embedding, applied to queries and keys in
one rotation; each RMSNorm as PyTorch's single `rms_norm` (bit for bit in
float32); q, k and v (and gate and up) as one fused kernel call where the
layers are weight-only quantized (`quantized_linear.fuse_linears`); and the
engine's attention (`row_attention.attend`). In exact mode (float32, no
quantization) greedy output is token for token that of transformers'
classes (tests/backend/test_exactness.py runs both). Any other
architecture, or one of these with a feature the layer above does not have
(sliding windows, soft-capping, per-head norms), goes through transformers'
forward as before (`DecoderRunner.supports`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import CacheLayerMixin

from backend.architectures import sliding_window
from backend.quantized_linear import fuse_linears
from backend.row_attention import StepLayout, attend
from backend.row_cache import RowCache

# The model types whose decoder layers are the Llama layer above; Mistral and Qwen2 only where their
# sliding window never comes into play (`supports`). Qwen2 adds biases to q, k and v: the linear
# layers have them.
LLAMA_LAYER_TYPES = {"llama", "mistral", "qwen2"}


class Projections:
    """Several linear layers over one input (q, k and v; gate and up), their outputs side by side.

    Weight-only quantized layers fuse into one kernel call (`fuse_linears`); float layers are called
    one by one, which keeps exact mode's arithmetic that of transformers' modules.
    """

    def __init__(self, *linears: nn.Module):
        self.linears = linears
        self.fused = fuse_linears(list(linears))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is None:
            return torch.cat([linear(x) for linear in self.linears], dim=-1)
        return self.fused(x)


class DecoderRunner:
    """Runs one step's packed tokens through the model and returns the logits at the `keep` positions."""

    def __init__(self, model: PreTrainedModel):
        self.embed = model.model.embed_tokens
        self.rotary = model.model.rotary_emb
        self.layers = list(model.model.layers)
        self.norm = model.model.norm
        self.head = model.get_output_embeddings()
        attention = self.layers[0].self_attn
        self.scaling = attention.scaling
        self.head_dim = attention.head_dim
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.qkv = [
            Projections(a.q_proj, a.k_proj, a.v_proj) for a in (layer.self_attn for layer in self.layers)
        ]
        self.gate_up = [Projections(layer.mlp.gate_proj, layer.mlp.up_proj) for layer in self.layers]

    @staticmethod
    def supports(model: PreTrainedModel, max_seq_len: int) -> bool:
        config = model.config
        window = sliding_window(config)
        return (
            config.model_type in LLAMA_LAYER_TYPES
            and (window is None or window >= max_seq_len)
            and getattr(config, "hidden_act", "silu") == "silu"
            and not getattr(config, "mlp_bias", False)
        )

    def __call__(
        self,
        input_ids: torch.Tensor,  # [tokens]
        positions: torch.Tensor,  # [tokens]
        layout: StepLayout,
        cache: RowCache,
        keep: torch.Tensor,  # [kept] indices into the tokens
    ) -> torch.Tensor:
        hidden = self.embed(input_ids)[None]  # [1, tokens, hidden], the shapes transformers' layers use
        cos, sin = (t[:, None] for t in self.rotary(hidden, positions[None]))  # [1, 1, tokens, head_dim]
        for layer, qkv, gate_up, cache_layer in zip(
            self.layers, self.qkv, self.gate_up, cache.layers, strict=True
        ):
            attended = self._attention(
                qkv(rms_norm(hidden, layer.input_layernorm)), cos, sin, cache_layer, layout
            )
            hidden = hidden + layer.self_attn.o_proj(attended)
            gate, up = gate_up(rms_norm(hidden, layer.post_attention_layernorm)).chunk(2, dim=-1)
            hidden = hidden + layer.mlp.down_proj(nn.functional.silu(gate) * up)
        return self.head(rms_norm(hidden[0, keep], self.norm))

    def _attention(
        self,
        qkv: torch.Tensor,  # [1, tokens, (heads + 2 * kv_heads) * head_dim]
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache_layer: CacheLayerMixin,
        layout: StepLayout,
    ) -> torch.Tensor:
        tokens = qkv.shape[1]
        all_heads = qkv.view(1, tokens, -1, self.head_dim).transpose(
            1, 2
        )  # [1, q, k and v heads, tokens, dim]
        query_and_key = rotate(all_heads[:, : self.heads + self.kv_heads], cos, sin)  # one rotation for both
        query, key = query_and_key.split([self.heads, self.kv_heads], dim=1)
        keys, values = cache_layer.update(key, all_heads[:, self.heads + self.kv_heads :])
        return attend(query, keys, values, layout, self.scaling).reshape(1, tokens, -1)


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' Llama RMSNorm as PyTorch's single operation: bit for bit in float32 (where
    transformers' module takes eight), one rounding instead of two in bfloat16."""
    return torch.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of transformers' `apply_rotary_pos_emb`, the same arithmetic, to one tensor."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
