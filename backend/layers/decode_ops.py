"""The work of a CPU decode step between its matrix products: one C++ loop each instead of chains of
PyTorch operations.

Once the weights are 4-bit, a one-row decode step of the default model on a
CPU was half matrix kernels and half some 1,200 small PyTorch operations
around them (docs/performance.md), each paying a dispatch and a pass over
memory: an RMSNorm in bfloat16 is a composite of eight taking 13 us on
576 numbers, the rotary embedding and the cache writes another fifteen a
layer. `kernels/fused_ops.cpp` does each group in one loop: the RMSNorm (with the
residual add before it), SiLU(gate) * up (GELU's for Gemma 3), the rotation of queries and keys
with the writes of keys and values into the cache, the attention of each
decode query over its own row of the cache, or its window of it (PyTorch's kernel took a batch
over the span's rows, a mask and a scatter of the queries around it), and,
for the int8 path of many rows (smoothed_int8.py), the rounding of
activations to int8 and the scaling of the products back; and a Mamba-2
row's state advanced a token (model/mamba.py) in one pass over it, a Gated
DeltaNet's (model/gated_delta.py) in two.

`EAGER` holds the same functions as PyTorch operations: the reference the
tests hold the loops to, and what runs where the loops do not (a GPU,
`--compile`, whose compiler fuses the same operations itself, the exact
mode, whose arithmetic must stay transformers', and a machine where the C++
extension cannot be built: no compiler, say). The loops compute in float32
and round once to the output's dtype, where the operations round after each
step: in bfloat16 they differ by a rounding, not more. The extension is
built and loaded by `backend.kernels.extension`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn
from transformers.models.mamba.modeling_mamba import causal_conv1d_update

from backend.kernels.extension import extension
from backend.layers.attention import one_query_each
from backend.layers.attention_features import AttentionFeatures, attention_with

# RMSNorms that scale by 1 + weight (Gemma's keep their weights as offsets from 1) and name their epsilon
# `eps`; transformers' others scale by the weight and call it `variance_epsilon`.
OFFSET_NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")
# LayerNorms without a bias (Cohere's: x less its mean, over its deviation, times the weight), which name
# their epsilon `variance_epsilon` as Llama's RMSNorm does
CENTERED_NORMS = ("CohereLayerNorm", "Cohere2LayerNorm")


@dataclass(frozen=True, slots=True)
class Norm:
    """An RMSNorm's weight and epsilon (transformers' Llama RMSNorm module, as data); where `centered`, a
    LayerNorm's without a bias (Cohere's)."""

    weight: torch.Tensor
    eps: float
    centered: bool = False

    @classmethod
    def of(cls, module: nn.Module) -> Norm:
        """A module's norm; Gemma's as the weight it scales by, 1 + its own, computed in float32 as
        Gemma's module computes it (and kept in the model's dtype, which the loops take: in bfloat16
        that rounds the scale once, as a rounding of the output would)."""
        if type(module).__name__ in OFFSET_NORMS:
            # A parameter, as the module's own weight is: torch.compile takes a parameter's shape as fixed
            # and a plain tensor's as symbols, which made compiling Gemma 3's decode step 8x slower.
            scale = (1.0 + module.weight.float()).to(module.weight.dtype)
            return cls(nn.Parameter(scale, requires_grad=False), module.eps)
        # (Llama 4's names it `eps`)
        eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
        return cls(module.weight, eps, type(module).__name__ in CENTERED_NORMS)


class EagerOps:
    """The decode step's elementwise work as PyTorch operations (exact mode's arithmetic)."""

    @staticmethod
    def norm(x: torch.Tensor, norm: Norm | None) -> torch.Tensor:
        """transformers' Llama RMSNorm: bit for bit in float32 (PyTorch's one `rms_norm`); a centered norm
        as Cohere's module computes it (`layer_norm`); None: x as it is (a place the layer norms nothing:
        OLMo 2's sublayers' inputs)."""
        if norm is None:
            return x
        if norm.centered:
            return layer_norm(x, norm)
        return torch.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)

    @staticmethod
    def add_norm(
        hidden: torch.Tensor, delta: torch.Tensor, norm: Norm | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add, and the norm of its sum: (hidden + delta, its RMSNorm)."""
        hidden = hidden + delta
        return hidden, EagerOps.norm(hidden, norm)

    @staticmethod
    def head_norms(qkv: torch.Tensor, query: Norm, key: Norm, heads: int, kv_heads: int) -> torch.Tensor:
        """q, k and v side by side ([rows, (heads + 2 kv_heads) * head_dim]) with the queries normed by
        `query` and the keys by `key`, each over its weight's width: a head's (Qwen3's and Gemma 3's norms
        of each head), or all the heads' (OLMo 2's of q and k whole)."""
        head_dim = qkv.shape[-1] // (heads + 2 * kv_heads)
        widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        queries, keys, values = qkv.split(widths, dim=-1)
        queries = EagerOps.norm(queries.unflatten(-1, (-1, query.weight.shape[0])), query).flatten(-2)
        keys = EagerOps.norm(keys.unflatten(-1, (-1, key.weight.shape[0])), key).flatten(-2)
        return torch.cat([queries, keys, values], dim=-1)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * width] (gate and up side by side) -> SiLU(gate) * up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up

    @staticmethod
    def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * width] (gate and up side by side) -> GELU(gate) * up, GELU's tanh approximation
        (Gemma's MLP, transformers' `gelu_pytorch_tanh`)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.gelu(gate, approximate="tanh") * up

    @staticmethod
    def relu_squared(up: torch.Tensor) -> torch.Tensor:
        """ReLU(up)^2: Arcee's MLP's activation (transformers' `relu2`), which has no gate."""
        return torch.square(nn.functional.relu(up))

    @staticmethod
    def attend(
        query: torch.Tensor,  # [queries, heads, head_dim]: one a decoding row, in the cache's dtype
        keys: torch.Tensor,  # the layer's cache, [rows, kv_heads, max_seq_len, head_dim]
        values: torch.Tensor,
        rows: torch.Tensor,  # [queries]: the row of each, ascending unless `scatter`
        positions: torch.Tensor,  # [queries]: each reads its row's positions 0..its own
        visible: torch.Tensor,  # [span rows, 1, 1, span]: the same, as a mask over the span's rows
        scaling: float,
        scatter: bool = False,
        window: int | None = None,  # a sliding-window layer's: each reads its last `window` positions
        sinks: torch.Tensor | None = None,  # [heads], float32: each head's sink logit (gpt-oss's)
        softcap: float | None = None,  # Gemma 2's cap of the scaled scores
    ) -> torch.Tensor:
        """Each query over its own row of the cache: [queries, heads, head_dim] (`decode_attention`)."""
        if window is not None:
            visible = within_window(visible, window)
        return decode_attention(query, keys, values, rows, visible, scaling, scatter, sinks, softcap)

    @staticmethod
    def rotate_and_store(
        qkv: torch.Tensor,  # [queries, (heads + 2 * kv_heads) * head_dim]
        cos: torch.Tensor,  # [queries, 1, head_dim]
        sin: torch.Tensor,
        slots: torch.Tensor,  # [queries * kv_heads]: where each key and value goes (row_cache.cache_slots)
        keys: torch.Tensor,  # the layer's cache, [rows, kv_heads, max_seq_len, head_dim]
        values: torch.Tensor,
        heads: int,
        kv_heads: int,
        interleaved: bool = False,  # neighbours paired (`rotate`)
    ) -> torch.Tensor:
        """Queries and keys rotated (transformers' rotary embedding, in one rotation for both), keys and
        values written to the cache; returns the queries, [queries, heads, head_dim], in the cache's dtype."""
        head_dim = keys.shape[-1]
        all_heads = qkv.view(qkv.shape[0], -1, head_dim)
        rotated = rotate(all_heads[:, : heads + kv_heads], cos, sin, interleaved)
        query, key = rotated.split([heads, kv_heads], dim=1)
        for cache, new in ((keys, key), (values, all_heads[:, heads + kv_heads :])):
            cache.view(-1, head_dim).index_copy_(0, slots, new.reshape(-1, head_dim).to(cache.dtype))
        return query.to(keys.dtype)

    @staticmethod
    def ssm_update(
        state: torch.Tensor,  # [rows, heads, head_dim, state_size] float32, advanced in place
        x: torch.Tensor,  # [rows, heads, head_dim]
        dt: torch.Tensor,  # [rows, heads]: the time step, after its softplus
        decay: torch.Tensor,  # [rows, heads]: exp(dt * A), float32
        B: torch.Tensor,  # [rows, heads, state_size]
        C: torch.Tensor,
        D: torch.Tensor,  # [heads]
    ) -> torch.Tensor:
        """One token of each row through a Mamba-2 scan (model/mamba.py): transformers'
        `mamba2_selective_state_update` value for value, [rows, heads, head_dim] in x's dtype."""
        rows, heads, head_dim = x.shape
        added = (dt[:, :, None, None] * B[:, :, None, :]) * x[..., None]
        state.mul_(decay[:, :, None, None]).add_(added)
        out = torch.bmm(state.to(C.dtype).view(rows * heads, head_dim, -1), C.reshape(rows * heads, -1, 1))
        return (out.view(rows, heads, head_dim) + x * D[:, None]).to(x.dtype)

    @staticmethod
    def short_conv(
        states: torch.Tensor,  # [rows, hidden, kernel]: each row's last inputs, advanced in place
        projected: torch.Tensor,  # [queries, 3 * hidden]: B, C and x side by side
        rows: torch.Tensor,  # [queries]: the row of each, no two alike
        weight: torch.Tensor,  # [hidden, kernel]: each channel's filter
        bias: torch.Tensor | None,  # [hidden]
    ) -> torch.Tensor:
        """One token of each query's row through a short convolution layer (LFM2's: model/short_conv.py),
        B * x convolved with the row's last inputs, gated by C: transformers' `causal_conv1d_update` value
        for value; [queries, hidden]."""
        b, c, x = projected.chunk(3, dim=-1)
        state = states.index_select(0, rows)
        out = causal_conv1d_update((b * x)[:, :, None], state, weight, bias)
        states.index_copy_(0, rows, state)
        return c * out[:, :, 0]

    @staticmethod
    def gated_delta_update(
        state: torch.Tensor,  # [rows, heads, key_dim, value_dim] float32, advanced in place
        query: torch.Tensor,  # [rows, heads, key_dim] float32, normed and scaled
        key: torch.Tensor,  # [rows, heads, key_dim] float32, normed
        value: torch.Tensor,  # [rows, heads, value_dim] float32
        decay: torch.Tensor,  # [rows, heads]: the decay's factor (exp'd), float32
        beta: torch.Tensor,  # [rows, heads] float32
    ) -> torch.Tensor:
        """One token of each row through a Gated DeltaNet (model/gated_delta.py): transformers'
        `torch_recurrent_gated_delta_rule` value for value, less two of its copies of every state;
        [rows, heads, value_dim] float32."""
        state.mul_(decay[..., None, None])
        predicted = (state * key[..., None]).sum(dim=-2)
        delta = (value - predicted) * beta[..., None]
        state.add_(key[..., None] * delta[..., None, :])
        return (state * query[..., None]).sum(dim=-2)


def decode_attention(
    query: torch.Tensor,  # [queries, heads, head_dim]: one a decoding row, in the cache's dtype
    keys: torch.Tensor,  # the layer's cache, [rows, kv_heads, max_seq_len, head_dim]
    values: torch.Tensor,
    rows: torch.Tensor,  # [queries]: the row of each, ascending unless `scatter`
    visible: torch.Tensor,  # [span rows, 1, 1, span]
    scaling: float,
    scatter: bool = False,
    sinks: torch.Tensor | None = None,  # [heads]: each head's sink logit
    softcap: float | None = None,  # the scaled scores' cap
) -> torch.Tensor:
    """Each query over its own row of the cache, as one batch over the span's rows: [queries, heads,
    head_dim]. Free rows of the span get a zero query, their output dropped (attention.attend).
    With as many queries as rows, query i is row i unless `scatter` says they may come in any order.
    With sinks or soft-capping, the matmuls of transformers' eager attention
    (attention_features.attention_with).

    Eager, PyTorch's scaled-dot-product kernel (attention.one_query_each); compiled, two matrix
    products and a softmax the compiler fuses with the mask: one query a row is a matrix-vector
    product, which PyTorch's CPU flash kernel took 23 us a layer for in the graph (two products: 14).
    Compiled, the free rows are filled in whether there are any or not: one graph for both.
    """
    span_rows, span, head_dim = visible.shape[0], visible.shape[-1], query.shape[-1]
    per_row = query[:, :, None]  # [queries, heads, 1, head_dim]
    compiling = torch.compiler.is_compiling()
    scatter = scatter or compiling or per_row.shape[0] < span_rows
    if scatter:
        per_row = per_row.new_zeros((span_rows, *per_row.shape[1:])).index_copy_(0, rows, per_row)
    span_keys, span_values = keys[:span_rows, :, :span], values[:span_rows, :, :span]
    if sinks is not None or softcap is not None:
        features = AttentionFeatures(softcap=softcap, sinks=sinks)
        attended = attention_with(per_row, span_keys, span_values, visible, scaling, features)
    elif compiling:
        # Query heads grouped by the KV head they read, as `enable_gqa` groups them.
        grouped = per_row.view(span_rows, keys.shape[1], -1, head_dim)
        scores = grouped @ span_keys.transpose(2, 3) * scaling + visible
        attended = (scores.softmax(dim=-1) @ span_values).view(span_rows, -1, 1, head_dim)
    else:
        attended = one_query_each(per_row, span_keys, span_values, visible, scaling)
    if scatter:
        attended = attended.index_select(0, rows)
    return attended[:, :, 0]


def layer_norm(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    """Cohere's LayerNorm (no bias) in its module's operations, in float32 and rounded once to x's dtype:
    bit for bit its module's. (PyTorch's `layer_norm` reduces in another order.)"""
    x32 = x.float()
    centered = x32 - x32.mean(-1, keepdim=True)
    variance = centered.pow(2).mean(-1, keepdim=True)
    return (norm.weight.float() * (centered * torch.rsqrt(variance + norm.eps))).to(x.dtype)


def within_window(visible: torch.Tensor, window: int) -> torch.Tensor:
    """A decode batch's visibility ([rows, 1, 1, span]: 0 over each row's positions 0..its end, -inf
    after) narrowed to each row's last `window` positions (masking_utils' sliding window: a key is read
    where key > end - window)."""
    ends = (visible[:, 0, 0] == 0).sum(-1, keepdim=True) - 1  # [rows, 1]
    hidden = torch.arange(visible.shape[-1], device=visible.device) <= ends - window
    return visible.masked_fill(hidden[:, None, None], float("-inf"))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """The rotary embedding of transformers' `apply_rotary_pos_emb`, the same arithmetic, to one tensor:
    where cos and sin are narrower than a head (Phi-4-mini's `partial_rotary_factor`, GLM's), to that many
    of its first elements, the rest kept as they are. Each element t is paired with t + half the width,
    or where `interleaved` (GLM's, ERNIE 4.5's and Helium's form) 2t with 2t + 1, cos and sin given
    repeated so (`interleaved_angles`)."""
    rotated = cos.shape[-1]
    if rotated < x.shape[-1]:
        return torch.cat([rotate(x[..., :rotated], cos, sin, interleaved), x[..., rotated:]], dim=-1)
    if interleaved:
        turned = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


def interleaved_angles(angles: torch.Tensor) -> torch.Tensor:
    """cos or sin as a rotary module gives them ([..., width]: the angles of the width's first half, then
    the same again) as the interleaved rotation takes them: each angle twice in a row (transformers'
    GLM `apply_rotary_pos_emb` repeats them so)."""
    return angles[..., : angles.shape[-1] // 2].repeat_interleave(2, dim=-1)


class FusedOps:
    """The same functions as `EagerOps`, each one loop of the C++ extension."""

    def __init__(self, extension: ModuleType):
        self.extension = extension
        # (head size, query heads a KV head) -> whether the attention loop takes it; asked once a shape
        self.attention_supports = functools.cache(extension.attention_supports)

    def norm(self, x: torch.Tensor, norm: Norm | None) -> torch.Tensor:
        if norm is None:
            return x
        by = self.extension.layer_norm if norm.centered else self.extension.rms_norm
        return by(x, norm.weight, norm.eps)

    def add_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor, norm: Norm | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As EagerOps.add_norm, but the sum is written into `hidden` itself, which must be the step's own
        (with no norm, the sum is the normed output too: decode_layers.cpp's `add_norm_or_not`)."""
        if norm is None:
            return hidden, hidden.add_(delta)
        by = self.extension.add_layer_norm if norm.centered else self.extension.add_rms_norm
        return hidden, by(hidden, delta, norm.weight, norm.eps)

    def head_norms(
        self, qkv: torch.Tensor, query: Norm, key: Norm, heads: int, kv_heads: int
    ) -> torch.Tensor:
        """As EagerOps.head_norms, in place in `qkv` (a step's own: a projection's output)."""
        return self.extension.head_rms_norms(
            qkv.contiguous(), query.weight, key.weight, heads, kv_heads, query.eps, key.eps
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.extension.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.extension.gelu_tanh_mul(gate_up)

    def relu_squared(self, up: torch.Tensor) -> torch.Tensor:
        """As EagerOps.relu_squared, by the same operations (decode_layers.cpp's too): two a layer."""
        return EagerOps.relu_squared(up)

    def attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        scaling: float,
        scatter: bool = False,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """As EagerOps.attend, from the rows and positions (a query reads its row's 0..position, or its
        last `window` of them), for the head sizes the loop is compiled for (`attention_supports`; the
        runner attends by EAGER's for the rest, decided once in its step plan)."""
        return self.extension.decode_attention(
            query, keys, values, rows, positions, scaling, window or 0, sinks, softcap or 0.0
        )

    def rotate_and_store(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        heads: int,
        kv_heads: int,
        interleaved: bool = False,
    ) -> torch.Tensor:
        return self.extension.rotate_and_store(
            qkv, cos, sin, slots, keys, values, heads, kv_heads, interleaved
        )

    def ssm_update(
        self,
        state: torch.Tensor,
        x: torch.Tensor,
        dt: torch.Tensor,
        decay: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor,
    ) -> torch.Tensor:
        """As EagerOps.ssm_update, in one pass over the state (float32 throughout)."""
        inputs = [t.float().contiguous() for t in (x, dt, decay, B, C, D)]
        return self.extension.ssm_update(state, *inputs).to(x.dtype)

    def gated_delta_update(
        self,
        state: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        decay: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:
        """As EagerOps.gated_delta_update, in two passes over each head's state."""
        inputs = [t.contiguous() for t in (query, key, value, decay, beta)]
        return self.extension.gated_delta_update(state, *inputs)

    def short_conv(
        self,
        states: torch.Tensor,
        projected: torch.Tensor,
        rows: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """As EagerOps.short_conv, in one pass over the rows' states."""
        return self.extension.short_conv(states, projected.contiguous(), rows, weight, bias)


EAGER = EagerOps()
# What `DecoderRunner.decode_layers` does between its matrix products: the same functions either way.
DecodeOps = EagerOps | FusedOps


def decode_ops(device: torch.device, exact: bool, compiled: bool) -> DecodeOps:
    """The C++ loops on a CPU where they can be built, unless the step is compiled (inductor fuses the
    same operations) or exact (float32 without quantization: transformers' arithmetic, bit for bit);
    else PyTorch's operations."""
    if device.type != "cpu" or exact or compiled:
        return EAGER
    built = extension()
    return EAGER if built is None else FusedOps(built)
