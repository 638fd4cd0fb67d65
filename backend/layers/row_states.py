"""The recurrent state of a state-space model's rows: what a Mamba keeps of a row in place of keys and values.

A Mamba layer carries two things from one token to the next, per row: the
last `conv_kernel` inputs of its causal convolution, and its selective
scan's state ([channels, state_size]). Both are fixed in size, whatever the
row's length: a row of a state-space model costs the same at position 10
as at 10,000, where a KV cache row grows with every position. They live in
one preallocated tensor a layer and a kind, one row per user row (and the
spare row that embedding inputs are prefilled in, as in the KV cache):

    conv[layer]: [rows, conv_channels, conv_kernel]   in the model's dtype
    ssm[layer]:  [rows, *ssm]                         in float32, as transformers keeps it

(Mamba's scan state is [channels, state_size]; Mamba-2's, of heads that
share a decay, [heads, head_dim, state_size]; a Gated DeltaNet's, a matrix
a value head that maps keys to values, [value_heads, key_dim, value_dim].)

A row's state holds all of its history or nothing: it cannot give back
the state at an earlier position. So a state-space model's rows are reused
only by a prompt that extends a row's whole history (a chat's next turn,
engine/prefix_cache.py's `whole_only`), verify no speculative drafts, and
any other prompt's first chunk starts from zeros, whatever the row held
before (model/mamba.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

# The model types whose rows are a recurrent state (model/mamba.py runs them).
STATE_SPACE_TYPES = ("mamba", "falcon_mamba", "mamba2")
# Hybrids, whose rows keep both a recurrent state and keys and values (model_runner.py,
# model/hybrid.py): Mamba-2 layers (their `layer_types` "linear_attention") among attention layers,
# or in every layer beside its attention (Falcon-H1's "hybrid" layers); Jamba's are Mamba's; Nemotron-H's
# layers are each a Mamba-2 mixer, an attention, an MLP or experts. Qwen3-Next's, Qwen3.5's and OLMo's
# hybrid's "linear_attention" layers are Gated DeltaNets instead (GATED_DELTA_TYPES, model/gated_delta.py).
# LFM2's and LFM3's "conv" layers are a short convolution alone, no scan (SHORT_CONV_TYPES,
# model/short_conv.py).
GATED_DELTA_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid")
SHORT_CONV_TYPES = ("lfm2", "lfm2_moe", "lfm3")
HYBRID_TYPES = (
    "bamba", "granitemoehybrid", "falcon_h1", "jamba", "nemotron_h", *GATED_DELTA_TYPES, *SHORT_CONV_TYPES
)  # fmt: skip
# The `layer_types` of a hybrid's layers that attend (and keep keys and values).
ATTENDING_LAYERS = ("full_attention", "sliding_attention", "hybrid")


def is_state_space(config: PretrainedConfig) -> bool:
    """Whether every layer of the model is a state-space one (no attention)."""
    return config.get_text_config().model_type in STATE_SPACE_TYPES


def has_row_states(config: PretrainedConfig) -> bool:
    """Whether the model's rows keep a recurrent state, which cannot go back to an earlier position."""
    return config.get_text_config().model_type in STATE_SPACE_TYPES + HYBRID_TYPES


def state_layers(config: PretrainedConfig) -> tuple[int, ...]:
    """The indices of the layers that keep a recurrent state (all of a state-space model's)."""
    config = config.get_text_config()
    if config.model_type in HYBRID_TYPES:
        recurrent = ("linear_attention", "hybrid", "conv")
        return tuple(i for i, kind in enumerate(config.layer_types) if kind in recurrent)
    return tuple(range(config.num_hidden_layers)) if config.model_type in STATE_SPACE_TYPES else ()


def attention_free_layers(config: PretrainedConfig) -> tuple[int, ...]:
    """The indices of a hybrid's layers that keep no keys and values (its Mamba layers, Nemotron-H's MLP
    and experts' layers)."""
    config = config.get_text_config()
    if config.model_type not in HYBRID_TYPES:
        return ()
    return tuple(i for i, kind in enumerate(config.layer_types) if kind not in ATTENDING_LAYERS)


@dataclass(frozen=True)
class StateShape:
    layers: int
    # What the convolution mixes: Mamba's inner width, Mamba-2's and its B and C, a Gated DeltaNet's
    # queries, keys and values.
    conv_channels: int
    conv_kernel: int
    # A row's scan state: Mamba's [channels, state_size], Mamba-2's [heads, head_dim, state_size], a Gated
    # DeltaNet's [value_heads, key_dim, value_dim]; LFM2's short convolutions have none ([0]).
    ssm: tuple[int, ...]

    @classmethod
    def of(cls, config: PretrainedConfig) -> StateShape:
        config = config.get_text_config()
        if config.model_type in GATED_DELTA_TYPES:
            heads, key_dim, value_dim = (
                config.linear_num_value_heads,
                config.linear_key_head_dim,
                config.linear_value_head_dim,
            )
            conv_channels = 2 * config.linear_num_key_heads * key_dim + heads * value_dim
            ssm = (heads, key_dim, value_dim)
            return cls(len(state_layers(config)), conv_channels, config.linear_conv_kernel_dim, ssm)
        if config.model_type in SHORT_CONV_TYPES:  # a convolution over the hidden size, no scan: no state
            return cls(len(state_layers(config)), config.hidden_size, config.conv_L_cache, (0,))
        if config.model_type == "jamba":  # Mamba layers, their sizes named mamba_*
            inner = config.mamba_expand * config.hidden_size
            return cls(len(state_layers(config)), inner, config.mamba_d_conv, (inner, config.mamba_d_state))
        if config.model_type == "nemotron_h":
            inner = config.mamba_num_heads * config.mamba_head_dim
            conv_channels = inner + 2 * config.n_groups * config.ssm_state_size
            ssm = (config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size)
            return cls(len(state_layers(config)), conv_channels, config.conv_kernel, ssm)
        if config.model_type in HYBRID_TYPES:  # Mamba-2 layers, their sizes named mamba_*
            inner = getattr(config, "mamba_d_ssm", None) or int(config.mamba_expand * config.hidden_size)
            conv_channels = inner + 2 * config.mamba_n_groups * config.mamba_d_state
            ssm = (config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state)
            return cls(len(state_layers(config)), conv_channels, config.mamba_d_conv, ssm)
        if config.model_type == "mamba2":
            inner = int(config.expand * config.hidden_size)
            conv_channels = inner + 2 * config.n_groups * config.state_size
            ssm = (config.num_heads, config.head_dim, config.state_size)
            return cls(config.num_hidden_layers, conv_channels, config.conv_kernel, ssm)
        inner = config.intermediate_size
        return cls(config.num_hidden_layers, inner, config.conv_kernel, (inner, config.state_size))

    @property
    def ssm_size(self) -> int:
        return math.prod(self.ssm)

    def bytes(self, rows: int, dtype: torch.dtype) -> int:
        """Size of every layer's states for `rows` rows, the convolution's inputs in `dtype`."""
        element = torch.finfo(dtype).bits // 8
        return self.layers * rows * (self.conv_channels * self.conv_kernel * element + self.ssm_size * 4)


class RowStates:
    """Every row's recurrent state, allocated once (zeros: a row's state before its first token)."""

    def __init__(self, shape: StateShape, rows: int, dtype: torch.dtype, device: torch.device):
        conv_size = (rows, shape.conv_channels, shape.conv_kernel)
        self.conv = [torch.zeros(conv_size, dtype=dtype, device=device) for _ in range(shape.layers)]
        self.ssm = [
            torch.zeros((rows, *shape.ssm), dtype=torch.float32, device=device) for _ in range(shape.layers)
        ]
        self.shape = shape
