"""The forward pass of a Llama-family decoder over the row cache, without transformers' module calls.

transformers' model classes spend, per layer, more Python on keyword
arguments, masks, hooks and output objects than a one-row decode step
spends multiplying once the weights are 4-bit (docs/performance.md: about
5 ms of a 17 ms step on the default model). For the decoder families whose
layer is exactly

    x = x + o_proj(attention(rope(q_proj(norm(x))), rope(k_proj(...)), v_proj(...)))
    x = x + down_proj(silu(gate_proj(norm(x))) * up_proj(norm(x)))

this runner calls the same modules' weights in the same order, with
transformers' own rotary embedding, norms and linear layers (quantized or
not), and the engine's attention (`row_attention.attend`). Greedy output is
token for token that of transformers' classes (tests/backend/test_exactness.py
runs both). Any other architecture, or one of these with a feature the
layer above does not have (sliding windows, soft-capping, per-head norms),
goes through transformers' forward as before (`DecoderRunner.supports`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import CacheLayerMixin
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from backend.architectures import sliding_window
from backend.row_attention import StepLayout, attend
from backend.row_cache import RowCache

# The model types whose decoder layers are the Llama layer above; Mistral and Qwen2 only where their
# sliding window never comes into play (`supports`). Qwen2 adds biases to q, k and v: the linear
# layers have them.
LLAMA_LAYER_TYPES = {"llama", "mistral", "qwen2"}


class DecoderRunner:
    """Runs one step's packed tokens through the model and returns the logits at the `keep` positions."""

    def __init__(self, model: PreTrainedModel):
        self.embed = model.model.embed_tokens
        self.rotary = model.model.rotary_emb
        self.layers = list(model.model.layers)
        self.norm = model.model.norm
        self.head = model.get_output_embeddings()
        self.scaling = self.layers[0].self_attn.scaling
        self.head_dim = self.layers[0].self_attn.head_dim

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
        cos, sin = self.rotary(hidden, positions[None])
        for layer, cache_layer in zip(self.layers, cache.layers, strict=True):
            normed = layer.input_layernorm(hidden)
            hidden = hidden + self._attention(layer.self_attn, normed, cos, sin, cache_layer, layout)
            mlp = layer.mlp
            normed = layer.post_attention_layernorm(hidden)
            hidden = hidden + mlp.down_proj(nn.functional.silu(mlp.gate_proj(normed)) * mlp.up_proj(normed))
        return self.head(self.norm(hidden[0, keep]))

    def _attention(
        self,
        attention: nn.Module,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache_layer: CacheLayerMixin,
        layout: StepLayout,
    ) -> torch.Tensor:
        shape = (1, x.shape[1], -1, self.head_dim)
        query = attention.q_proj(x).view(shape).transpose(1, 2)
        key = attention.k_proj(x).view(shape).transpose(1, 2)
        value = attention.v_proj(x).view(shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        keys, values = cache_layer.update(key, value)
        attended = attend(query, keys, values, layout, self.scaling)
        return attention.o_proj(attended.reshape(1, x.shape[1], -1))
