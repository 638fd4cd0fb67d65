"""The forward pass of a Llama-family decoder (and Gemma's, gpt-oss's, LFM2's and LFM3's) over the row cache,
without transformers' module calls.

transformers' model classes spend, per layer, more Python on keyword
arguments, masks, hooks and output objects than a one-row decode step
spends multiplying once the weights are 4-bit (docs/performance.md: about
5 ms of a 17 ms step on the default model). For the decoder families whose
layer is exactly

    x = x + o_proj(attention(rope(q_proj(norm(x))), rope(k_proj(...)), v_proj(...)))
    x = x + down_proj(silu(gate_proj(norm(x))) * up_proj(norm(x)))

(Qwen3's adds an RMSNorm of each head's query and key before the rotation: `HeadNorms`; Qwen3-MoE's
and Mixtral's MLP is a mixture of experts, which the runner calls as the layer's own module: `experts`;
Gemma 3's norms each sublayer's output too, has GELU for SiLU and window layers, and Gemma 2's soft-caps
its scores and logits: `GEMMA_LAYER_TYPES`; gpt-oss's has biases, window layers, sinks and experts:
`GPT_OSS_LAYER_TYPES`; Phi-3's, SmolLM3's, Granite's and OLMo's differ in the ways `LLAMA_LAYER_TYPES` says)

this runner does the same arithmetic on the same modules' weights in fewer
operations: transformers' rotary embedding, applied to queries and keys in
one rotation; each RMSNorm as PyTorch's single `rms_norm` (bit for bit in
float32); q, k and v (and gate and up) as one fused kernel call where the
layers are weight-only quantized (`quantized_linear.fuse_linears`), and as one
matrix product of their joined weights where they are float layers outside exact
mode (`join_float_linears`); and the
engine's attention (`layers/attention.attend`). A decode step's work between
its matrix products is `DecoderRunner.ops` (layers/decode_ops.py): C++ loops on a
CPU, PyTorch's operations elsewhere and in exact mode. In exact mode (float32, no
quantization) greedy output is token for token that of transformers'
classes (tests/backend/test_exactness.py runs both). Any other
architecture, or one of these with a feature the layer above does not have
(an MLP with biases, another activation), goes through transformers'
forward as before (`DecoderRunner.supports`).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import re
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx.experimental._config as fx_shapes
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin

from backend.layers.attention import attend
from backend.layers.attention_features import AttentionFeatures
from backend.layers.decode_ops import (
    EAGER,
    DecodeOps,
    Norm,
    decode_ops,
    interleaved_angles,
    rotate,
    within_window,
)
from backend.layers.float_router import routers_in_float32
from backend.layers.row_cache import KVShape, RowCache
from backend.layers.row_states import RowStates
from backend.layers.step_layout import LOOP_PROMPT_TOKENS, StepLayout
from backend.model.architectures import sliding_window
from backend.model.decode_graphs import DecodeGraphs
from backend.model.lora import LayerChanges, LoraLinear, lora_batch_of, unwrapped
from backend.model.native_decode import LayerExperts, LayerForm, LayerProjections, NativeDecode
from backend.model.short_conv import RowConvolution, is_short_conv
from backend.model.step_plan import DECODE_LAYERS, GRAPH, LOOP, NATIVE, plan_runner
from backend.quant.quantized_linear import DENSE_FROM_ROWS, WeightOnlyLinear, fusable, fuse_linears

log = logging.getLogger(__name__)

# The model types whose decoder layers are the Llama layer above; Mistral's, Qwen2's and Phi-3's sliding
# window is each layer's (`window_in`). Qwen2 adds biases to q, k and v: the linear layers have them.
# Qwen3 norms each head's query and key (`HeadNorms`). Qwen3-MoE (Qwen3's attention) and Mixtral
# (Mistral's) have a mixture of experts for an MLP: the layer's own module multiplies each token by its
# chosen experts only (transformers' routing), called where the Llama MLP's products are. Phi-3 keeps q,
# k and v in one linear layer and gate and up in another (`attention_inputs`, `gate_and_up`), and rotates
# part of each head in Phi-4-mini (`partial_rotary_factor`: decode_ops.rotate).
# Ministral's window layers beside global ones are each layer's too. SmolLM3's layers without rotary
# positions (`no_rope_layers`, one in four) rotate by none (`UNROTATED`). Granite multiplies its
# embeddings, each sublayer's output before its residual add, and its attention's scores (its attention's
# `scaling`), and divides its logits (`DecoderRunner.residual`, `logits_scaling`, `ScaledEmbedding`).
# OLMo 2 norms each sublayer's output before its residual add (Gemma 3's `sandwich`) but not its input, and
# its queries and its keys whole before the heads are split (`HeadNorms`, a norm as wide as all the heads);
# OLMo 3's is OLMo 2's with window layers beside global ones, each kind with a rotation of its own.
# EXAONE 4's is OLMo 2's with Qwen3's norms of each head, and where it has window layers, global layers
# beside them without rotary positions (`rotates`). Seed-OSS adds a bias to o besides q's, k's and v's.
# ERNIE 4.5's and Helium's layers rotate neighbouring pairs of each head's elements (`INTERLEAVED_TYPES`);
# GLM's does too, over half of each head, with Phi-3's gate and up in one layer, and GLM-4's norms each
# sublayer's output as Gemma's do (`sublayer_norms`). OLMoE's is Llama's layer with OLMo 2's norms of q and k
# whole and Qwen3-MoE's mixture of experts (not where it clips q, k and v: `clip_qkv`). Qwen2-MoE's (Qwen2's
# attention), ERNIE 4.5 MoE's (ERNIE 4.5's), GLM-4.5's (Qwen3's head norms where it has them, biases, half
# of each head rotated) and MiniMax-M2's (OLMo 2's norms of q and k whole, part of each head rotated) call
# their mixture's own module, shared experts and all, dense layers among them Llama's MLP. Granite's window
# models add gpt-oss's windows and sinks to Granite's layer; Granite MoE's mixture (`block_sparse_moe`:
# `mlp_of`) routes as gpt-oss's does. Cohere's layer (Command R's, Aya Expanse's) norms its input alone, by a
# LayerNorm without a bias (decode_ops.Norm's `centered`), and its MLP takes that norm as attention does, both
# outputs added to the residual (`PARALLEL_TYPES`); it rotates neighbouring pairs, and multiplies its logits
# (`logit_scale`). Cohere 2's (Command R7B's, Command A's) has window layers beside global ones without
# rotary positions (`rotates`). Ministral 3's is Llama's with its queries multiplied, after the rotation, by a
# factor that grows with the position past the rotation's original length (`QUERY_SCALED_TYPES`). Arcee's
# (AFM-4.5B's) MLP has no gate: down(ReLU(up(x))^2) (`activation`: "relu2"). Hunyuan's (dense) norms each
# head's query and key after the rotation, where Qwen3's norms them before it (`HeadNorms.after_rotation`).
# Llama 4's (its text model's) rotates neighbouring pairs (its rotary module's angles as complex numbers:
# `cos_and_sin`) in three layers of four, the fourth without rotary positions; it norms each rotated head's
# query and key by an L2 norm without a weight (`HeadNorms.of`, after the rotation, as Hunyuan's), multiplies
# the queries of its layers without rotary positions by its attention temperature (`QueryScaling`), and
# calls its MLP `feed_forward`: a mixture of experts (its module, a shared expert beside them) in some or
# every layer. Its rotated layers attend in chunks of 8,192 positions, no further than the context the
# engine gives it (cache_size.context_length). InternLM3's and IQuest-Coder's are Llama's (transformers builds
# them as Llama), CWM's Llama's with Qwen2's attention, window layers beside global ones.
LLAMA_LAYER_TYPES = {
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "phi3",
    "ministral",
    "smollm3",
    "granite",
    "olmo2",
    "olmo3",
    "exaone4",
    "seed_oss",
    "ernie4_5",
    "helium",
    "glm",
    "glm4",
    "olmoe",
    "qwen2_moe",
    "ernie4_5_moe",
    "glm4_moe",
    "minimax_m2",
    "granite_swa",
    "granitemoe",
    "cohere",
    "cohere2",
    "ministral3",
    "arcee",
    "hunyuan_v1_dense",
    "llama4_text",
    "internlm3",
    "iquestcoder",
    "cwm",
}
# The model types whose rotation pairs element 2t of a head with 2t + 1 (decode_ops.rotate's `interleaved`)
INTERLEAVED_TYPES = {"ernie4_5", "ernie4_5_moe", "helium", "glm", "glm4", "cohere", "cohere2", "llama4_text"}
# ... and whose rotary module gives each angle twice in a row already (Cohere's), not the halves' form
PAIRED_ANGLES_TYPES = {"cohere", "cohere2"}
# The model types whose MLP takes the layer's input norm as its attention does (`DecoderRunner.parallel`)
PARALLEL_TYPES = {"cohere", "cohere2"}
# The model types whose queries are multiplied by a factor that grows with the position (Llama 4's attention
# temperature: `QueryScaling`): Ministral 3's every query after its rotation, Llama 4's those of its layers
# without rotary positions
QUERY_SCALED_TYPES = {"ministral3", "llama4_text"}
UNROTATED = "unrotated"  # the rotation of a layer without rotary positions (SmolLM3's, EXAONE 4's: `rotates`)

# Gemma 3's layer (its text model) is the Llama layer with a norm of the attention's output and of the
# MLP's before each residual add (`DecodeLayer.attention_out_norm`, `mlp_out_norm`; the MLP's input norm is
# `pre_feedforward_layernorm`), GELU's tanh form where Llama has SiLU, Qwen3's head norms, every norm
# scaling by 1 + its weight (decode_ops.Norm.of), embeddings scaled by the square root of the hidden size
# (its embedding module does it) and sliding-window layers among global ones, each kind with a rotary
# base of its own (`rope_kinds`). Its multimodal checkpoints (4B-27B, model type `gemma3`) load their text
# model alone (architectures.TEXT_ALONE), which this runner serves. Gemma 2's is Gemma 3's without the head
# norms, one rotation for both kinds of layer, and soft caps of attention's scores and of the logits
# (`softcap`, `final_softcap`). Gemma's (Gemma 1's, CodeGemma's) is Gemma 2's without the norms of each
# sublayer's output, the windows and the caps: the Llama layer with GELU, norms of 1 + weight and scaled
# embeddings.
GEMMA_LAYER_TYPES = {"gemma3_text", "gemma2", "gemma"}

# gpt-oss's layer is Qwen2's (biases on q, k and v, and on o) with Mixtral's MLP, a mixture of experts (its
# module: router and experts, `experts`), window layers among global ones (Gemma 3's, one rotation for
# both kinds), and each attention head's sink logit (`DecodeLayer.sinks`). Its rotary module gives cos and
# sin of half the head's width, the rotation of the halves Llama's (`as_rotated` widens them).
GPT_OSS_LAYER_TYPES = {"gpt_oss"}

# LFM2's layers are each a short convolution (short_conv.py) or an attention layer, then an MLP. Its
# attention layer is Qwen3's (each head's query and key normed before the rotation, its output layer named
# `out_proj`); a convolution layer projects its input to B, C and x by `in_proj` where an attention layer
# projects it to q, k and v, convolves over its rows' states (`RowConvolution`, `DecodeLayer.convolution`)
# where attention reads the cache, and projects back by `out_proj` where attention's o does. Its MLP is
# Llama's under other names (w1, w3, w2; `feed_forward`), its norms the inputs' (`operator_norm`,
# `ffn_norm`), its final norm `embedding_norm`. LFM2-MoE's MLP is a mixture of experts after its dense
# layers, called as its module (`experts`), its rotary module named `pos_emb`. LFM2's decode steps take
# decode_layers.cpp too (its `conv_states`), as LFM3's do where it has no gates; LFM2-MoE's and gated LFM3's
# the Python loop. LFM3's attention layer is
# Qwen3's with its output named o, each head's output multiplied by a sigmoid gate of the layer's input
# (`attention_gate`), window layers beside global ones (each kind with a rotation of its own, its global
# layers' over part of each head), and Gemma's norms of each sublayer's output (`post_operator_norm`,
# `post_ffn_norm`); its convolutions' kernel is 7. (Its module rotates in float32; the runner takes cos and
# sin in the model's dtype, as Llama's module gives them: the same in float32.)
SHORT_CONV_LAYER_TYPES = {"lfm2", "lfm2_moe", "lfm3"}
RUNNER_TYPES = LLAMA_LAYER_TYPES | GEMMA_LAYER_TYPES | GPT_OSS_LAYER_TYPES | SHORT_CONV_LAYER_TYPES

# Decode steps of fewer rows than this run `decode_layers` (compiled with --compile); from here on the
# linear layers multiply by their dense copies (quantized_linear.DENSE_FROM_ROWS) and the step is their
# time, whatever runs around them.
DECODE_BELOW = DENSE_FROM_ROWS


class Projections:
    """Several linear layers over one input (q, k and v; gate and up), their outputs side by side.

    Weight-only quantized layers fuse into one kernel call (`fuse_linears`); float layers into one matrix
    product of their joined weights where `join_floats` (`join_float_linears`: outside exact mode), else
    they are called one by one, which keeps exact mode's arithmetic that of transformers' modules. Where
    not all of them fuse, the runs of consecutive ones that do are fused (a GGUF Q4_K_M file's Q4_K q and
    k beside its Q6_K v): `groups`, each one call.

    Layers that LoRA adapters change (lora.py) fuse as their base layers do, the adapters' changes added to
    the output after (`changes`), so that a step without an adapter's row runs as it would without
    adapters loaded.
    """

    def __init__(self, *linears: nn.Module, join_floats: bool = False):
        self.linears = linears
        bases = tuple(unwrapped(linear) for linear in linears)
        fused = None  # (one layer, Phi-3's q, k and v say, is its own group)
        if len(bases) > 1:
            fused = fuse_linears(list(bases)) or (join_float_linears(list(bases)) if join_floats else None)
        self.groups: list[nn.Module] = [fused] if fused is not None else fused_runs(bases)
        self.changes = LayerChanges.of(linears)  # None: no adapter changes them

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.groups) == 1:
            output = self.groups[0](x)
        else:
            output = torch.cat([group(x) for group in self.groups], dim=-1)
        return output if self.changes is None else self.changes(x, output)

    def few_rows_matmul(self, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        """The projections as one function of a decode step's [rows, in] activations (`few_rows_matmul`)."""
        parts = [few_rows_matmul(group, dtype) for group in self.groups]

        def matmul(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([part(x) for part in parts], dim=-1)

        whole = parts[0] if len(parts) == 1 else matmul
        changes = self.changes
        return whole if changes is None else lambda x: changes(x, whole(x))


def fused_runs(linears: tuple[nn.Module, ...]) -> list[nn.Module]:
    """The layers with each run of consecutive ones that fuse (`fuse_linears`) made one, in order."""
    groups: list[list[nn.Module]] = []
    for linear in linears:
        if groups and fusable(groups[-1] + [linear]):
            groups[-1].append(linear)
        else:
            groups.append([linear])
    return [group[0] if len(group) == 1 else fuse_linears(group) for group in groups]


def join_float_linears(parts: list[nn.Module]) -> nn.Linear | None:
    """One float linear layer whose output is the parts' outputs side by side (q, k and v; gate and up),
    or None unless they are plain linear layers of one dtype and device over the same input, with biases
    all or none. On a GPU each product is a kernel launch and one of few rows reads its weights below the
    memory's rate where it is small (an 8B Llama's k and v, 8 MB each): one product of the joined weights
    does both better. The joined weights round differently from the parts' own products (another shape,
    another kernel), so exact mode keeps the parts. The parts keep working, on views of the joined
    weights, which are not stored twice (`rows_joined`)."""
    first = parts[0]
    if len(parts) < 2 or not all(
        type(part) is nn.Linear
        and part.in_features == first.in_features
        and part.weight.dtype == first.weight.dtype
        and part.weight.device == first.weight.device
        and (part.bias is None) == (first.bias is None)
        for part in parts
    ):
        return None
    out_features = sum(part.out_features for part in parts)
    joined = nn.Linear(first.in_features, out_features, bias=first.bias is not None, device="meta")
    joined.weight = nn.Parameter(rows_joined([part.weight for part in parts]), requires_grad=False)
    if first.bias is not None:
        joined.bias = nn.Parameter(rows_joined([part.bias for part in parts]), requires_grad=False)
    return joined


def rows_joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors one after another along their first dimension, each of them made a view of its rows
    of the result; where they already are that (joined for another runner of the same model: the
    benchmarks build several engines on one), the same memory again, not a copy."""
    first = tensors[0].detach()
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    if all(t.is_contiguous() for t in tensors) and all(
        t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and t.storage_offset() == before.storage_offset() + before.numel()
        for before, t in itertools.pairwise(tensors)
    ):
        return first.as_strided(shape, first.stride(), first.storage_offset())
    joined = torch.cat([t.detach() for t in tensors])
    for tensor, piece in zip(tensors, joined.split([t.shape[0] for t in tensors]), strict=True):
        tensor.data = piece
    return joined


@dataclass(frozen=True, slots=True)
class DecodeLayer:
    """One decoder layer as `decode_layers` runs it: its projections as plain functions with their
    weights bound, and its norms' weights, looked up once. Reaching them every step through the
    modules' attributes and calls took about a sixth of a one-row step on a CPU (docs/performance.md).
    The layer's input norm is the layer before's `next_norm` (the model's final norm after the last
    layer), so that each residual add and the norm after it are one operation (decode_ops.add_norm)."""

    qkv: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    mlp_norm: Norm | None  # (None: no norm there, OLMo 2's)
    gate_up: Callable[[torch.Tensor], torch.Tensor] | None  # None: a mixture of experts (`experts`)
    down: Callable[[torch.Tensor], torch.Tensor] | None
    next_norm: Norm | None
    experts: Callable[[torch.Tensor], torch.Tensor] | None = None  # the layer's own MoE block, [rows, hidden]
    window: int | None = None  # a sliding-window layer's: each query reads its last `window` positions
    rotation: int = 0  # which of the runner's `rope_kinds` rotates its queries and keys
    attention_out_norm: Norm | None = None  # Gemma's, OLMo 2's, GLM-4's norms of the sublayers' outputs
    mlp_out_norm: Norm | None = None
    sinks: torch.Tensor | None = None  # [heads], float32: gpt-oss's sink logit of each attention head
    head_norms: HeadNorms | None = None  # Qwen3's, Gemma 3's and OLMo 2's norms of queries and keys
    query_scaled: bool = False  # whether its queries take the runner's `query_scales` (QueryScaling)
    # LFM2's convolution layers': what runs between `qkv` (its in_proj) and `o` (its out_proj) in place of
    # attention (None: an attention layer)
    convolution: RowConvolution | None = None
    # LFM3's: the product whose sigmoid multiplies each head's attention output (None: no gate)
    attention_gate: Callable[[torch.Tensor], torch.Tensor] | None = None


def few_rows_matmul(linear: nn.Module, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """A linear layer as one function of [rows, in] activations in `dtype` (the model's), giving `dtype`
    back, as its module would: the weight-only layers' kernels with their weights bound, or
    `nn.functional.linear` with a float layer's; a layer LoRA adapters change, its base's, changed after."""
    if isinstance(linear, LoraLinear):
        base, changes = few_rows_matmul(linear.base, dtype), linear.changes
        return lambda x: changes(x, base(x))
    if isinstance(linear, WeightOnlyLinear):
        return linear.few_rows_matmul(dtype)
    if type(linear) is nn.Linear and linear.weight.dtype == dtype:
        weight, bias = linear.weight, linear.bias
        return lambda x: nn.functional.linear(x, weight, bias)
    return linear


@dataclass(frozen=True)
class HeadNorms:
    """The RMSNorms of queries and keys before the rotation: Qwen3's and Gemma 3's of each head's query and
    key, over the head's width; OLMo 2's of the queries and of the keys whole, over all the heads' (each
    norm's weight is as wide as what it norms: EagerOps.head_norms). Hunyuan's norm each head's query and
    key after the rotation (`after_rotation`: `rotated_then_normed`), and Llama 4's by an L2 norm without a
    weight (an RMSNorm of weight 1: the same products in float32)."""

    query: Norm
    key: Norm
    heads: int
    kv_heads: int
    after_rotation: bool = False

    @classmethod
    def of(cls, attention: nn.Module, heads: int, kv_heads: int, like: torch.Tensor) -> HeadNorms | None:
        """An attention layer's norms of queries and keys, or None; `like`: a tensor of the model's dtype
        and device (a weight of 1 is made so)."""
        if getattr(attention, "q_norm", None) is not None:
            return cls(Norm.of(attention.q_norm), Norm.of(attention.k_norm), heads, kv_heads)
        if getattr(attention, "q_layernorm", None) is not None:  # LFM2's names for Qwen3's
            return cls(Norm.of(attention.q_layernorm), Norm.of(attention.k_layernorm), heads, kv_heads)
        if getattr(attention, "query_layernorm", None) is not None:  # Hunyuan's
            norms = (Norm.of(attention.query_layernorm), Norm.of(attention.key_layernorm))
            return cls(*norms, heads, kv_heads, after_rotation=True)
        if getattr(attention, "qk_norm", None) is not None:  # Llama 4's, in its rotated layers
            ones = nn.Parameter(torch.ones(attention.head_dim, dtype=like.dtype, device=like.device), False)
            norm = Norm(ones, attention.qk_norm.eps)
            return cls(norm, norm, heads, kv_heads, after_rotation=True)
        return None

    @staticmethod
    def after(
        project: Callable[[torch.Tensor], torch.Tensor], norms: HeadNorms | None
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """The q, k and v projection followed by the layer's head norms, where it has them before the
        rotation."""
        return project if norms is None or norms.after_rotation else lambda x: norms(project(x))

    def __call__(self, qkv: torch.Tensor, ops: DecodeOps = EAGER) -> torch.Tensor:
        """q, k and v side by side ([..., (heads + 2 kv_heads) * head_dim]) with q and k normed, by `ops`
        (the CPU's loop normalizes them in place)."""
        return ops.head_norms(qkv, self.query, self.key, self.heads, self.kv_heads)


class DecoderRunner:
    """Runs one step's packed tokens through the model and returns the logits at the `keep` positions.

    A step of decoding rows alone, fewer than `DECODE_BELOW` of them, runs `decode_layers`: the same layer
    in fewer PyTorch operations, since each pays a dispatch cost and those costs are what a one-row
    step on a CPU is made of once the weights are 4-bit (docs/performance.md). With
    `compile_decode`, torch.compile (inductor) compiles it: the rotary embedding, norms, residual
    adds, cache writes and casts of each layer become a few generated C++ loops around the matrix
    and attention kernels. Steps with prompt tokens, and steps of many rows (where the matrix
    products dominate and compiling gained nothing, measured), take the general path.

    On a GPU, with `use_graphs`, every decode step (any number of rows) is a replayed CUDA graph of
    `decode_layers` and the head instead (backend/model/decode_graphs.py); on a CPU with every
    projection in blocks, steps of few rows run decode_layers.cpp (native_decode.py). Which of these
    runs a step of each shape is `plan` (step_plan.py), decided once from the settings.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        compile_decode: bool = False,
        rows: int = 32,
        max_seq_len: int | None = None,
        states: RowStates | None = None,
    ):
        """`max_seq_len`: the rows' length; a sliding window as long never comes into play. `states`: the
        rows' recurrent states, a layer of them each of LFM2's convolution layers, in order."""
        self.rows = rows  # the most rows a step has: how far the step plan goes
        # Granite's multipliers: of the embeddings, of each sublayer's output before its residual add, and
        # the logits' divisor (1: not there)
        self.embed = scaled(model.model.embed_tokens, getattr(model.config, "embedding_multiplier", 1.0))
        self.residual = getattr(model.config, "residual_multiplier", 1.0)
        self.logits_scaling = getattr(model.config, "logits_scaling", 1.0)
        self.logit_scale = getattr(model.config, "logit_scale", None) or 1.0  # Cohere's logits' multiplier
        # Gemma 2's soft caps: of attention's scaled scores, and of the logits (None: none)
        self.softcap = getattr(model.config, "attn_logit_softcapping", None)
        self.final_softcap = getattr(model.config, "final_logit_softcapping", None)
        self.rotary = rotary_of(model.model)
        self.half_rotation = model.config.model_type in GPT_OSS_LAYER_TYPES  # (`as_rotated`)
        self.interleaved = model.config.model_type in INTERLEAVED_TYPES  # neighbours rotate in pairs
        self.paired_angles = model.config.model_type in PAIRED_ANGLES_TYPES  # (`as_rotated`)
        # Cohere's: attention and the MLP take the layer's one norm, their outputs both added to the residual
        self.parallel = model.config.model_type in PARALLEL_TYPES
        # Ministral 3's and Llama 4's factor of queries by their position (`query_scales`), or None
        self.query_scaling = QueryScaling.of(model.config)
        self.layers = list(model.model.layers)
        # each layer's attention module, or LFM2's convolution module in its convolution layers
        self.mixers = [mixer_of(layer) for layer in self.layers]
        self.convolutions = convolutions(self.mixers, states)  # (None in each attention layer)
        self.convolves = any(conv is not None for conv in self.convolutions)
        # Gemma 3's and OLMo 3's rotary modules give each kind of layer (window or global, the config's
        # `layer_types`) cos and sin of its own;
        # SmolLM3's layers without rotary positions rotate by none (`UNROTATED`).
        by_kind = rotates_by_kind(self.rotary)
        layer_types = getattr(model.config, "layer_types", None) or [None] * len(self.layers)
        attending = [
            (layer_type if by_kind else None) if rotates(mixer) else UNROTATED
            for mixer, conv, layer_type in zip(self.mixers, self.convolutions, layer_types, strict=True)
            if conv is None
        ]
        # (a convolution layer rotates nothing: it is given the first attention layer's kind, none of its own)
        in_order = iter(attending)
        kinds = [attending[0] if conv is not None else next(in_order) for conv in self.convolutions]
        self.rope_kinds: list[str | None] = sorted(set(kinds), key=str)  # [None]: one rotation for all
        # each layer's norms by place (`sublayer_norms`); Gemma's, OLMo 2's and GLM-4's norm each sublayer's
        # output too (see above)
        norms = [[optional_norm(module) for module in sublayer_norms(layer)] for layer in self.layers]
        self.sandwich = norms[0][1] is not None
        self.gelu = activation(model.config) == "gelu_pytorch_tanh"
        self.squared_relu = activation(model.config) == "relu2"  # Arcee's MLP: no gate, ReLU(up)^2
        self.norm = final_norm(model.model)
        self.head = model.get_output_embeddings()
        self.lora = lora_batch_of(model)  # the step's LoRA adapters' tokens (lora.py); None: no adapters
        attention = self.mixers[self.convolutions.index(None)]  # (the first attention layer)
        self.scaling = attention.scaling
        self.head_dim = attention.head_dim
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        dtype = self.norm.weight.dtype  # the model's: what the modules give back
        # Exact mode: float32 products as transformers' modules make them, one layer at a time.
        exact = dtype == torch.float32 and not any(
            isinstance(mixer_inputs(mixer)[0], WeightOnlyLinear) for mixer in self.mixers
        )
        # (a convolution layer's in_proj: its B, C and x)
        self.qkv = [Projections(*mixer_inputs(mixer), join_floats=not exact) for mixer in self.mixers]
        self.outputs = [output_of(mixer) for mixer in self.mixers]  # o, or a convolution layer's out_proj
        self.attention_gates = [mixer.g_proj if gated(mixer) else None for mixer in self.mixers]  # (LFM3's)
        self.mlps = [mlp_of(layer) for layer in self.layers]
        # A mixture-of-experts layer (no gate and up of its own) has none: its MLP is its module
        self.gate_up = [
            Projections(*gate_and_up(mlp), join_floats=not exact) if is_dense(mlp) else None
            for mlp in self.mlps
        ]
        # A mixture's routers compute in float32 on a CPU (float_router.py)
        routers_in_float32(self.mlps)
        self.head_norms = [
            HeadNorms.of(mixer, self.heads, self.kv_heads, self.norm.weight) for mixer in self.mixers
        ]
        # Hunyuan's norms of each head after the rotation (decode_layers.cpp norms them before it alone)
        self.rotated_norms = any(norms is not None and norms.after_rotation for norms in self.head_norms)
        # each layer's input norm (None: OLMo 2's layers have none)
        self.input_norms = [layer_norms[0] for layer_norms in norms]
        next_norms = self.input_norms[1:] + [Norm.of(self.norm)]
        self.first_norm = self.input_norms[0]
        self.bound_layers = [
            DecodeLayer(
                qkv=qkv.few_rows_matmul(dtype),
                o=few_rows_matmul(output, dtype),
                mlp_norm=layer_norms[2],
                gate_up=gate_up.few_rows_matmul(dtype) if gate_up is not None else None,
                down=few_rows_matmul(down_of(mlp), dtype) if gate_up is not None else None,
                next_norm=next_norm,
                experts=None if gate_up is not None else rows_through(mlp),
                window=window_in(mixer, max_seq_len) if conv is None else None,
                rotation=self.rope_kinds.index(kind),
                attention_out_norm=layer_norms[1],
                mlp_out_norm=layer_norms[3],
                sinks=sinks_of(mixer),
                head_norms=head_norms,
                query_scaled=self.query_scaling is not None and self.query_scaling.scales(kind != UNROTATED),
                convolution=conv,
                attention_gate=few_rows_matmul(gate, dtype) if gate is not None else None,
            )
            for mixer, conv, output, gate, mlp, layer_norms, qkv, head_norms, gate_up, next_norm, kind in zip(
                self.mixers,
                self.convolutions,
                self.outputs,
                self.attention_gates,
                self.mlps,
                norms,
                self.qkv,
                self.head_norms,
                self.gate_up,
                next_norms,
                kinds,
                strict=True,
            )
        ]
        # The work between them (norms, rotation, attention, SiLU): C++ loops on a CPU, else PyTorch's
        # operations (layers/decode_ops.py).
        self.dense = all(gate_up is not None for gate_up in self.gate_up)
        # Whether a decode step is one graph to capture or compile: not where the experts' routing loops over
        # the experts chosen, nor where convolution layers advance the rows' states in place (a graph's
        # padding queries would advance other rows')
        self.whole_graph = self.dense and not self.convolves
        self.compiled_decode = None
        if compile_decode and not self.whole_graph:
            what = "a mixture of experts" if not self.dense else "convolution layers"
            log.warning("--compile: the decode steps of a model with %s are not compiled", what)
        elif compile_decode:
            # One graph for every number of rows and span (torch.compile specializes size 1): those
            # sizes alone are symbols (`step_sizes_dynamic`), the rest constants. With every size a
            # symbol (dynamic=True), the weights' and heads' too, the default model's warm-up traced for
            # over 11 minutes on a 2-core Xeon before it was stopped, against 2.8 now (docs/performance.md).
            # Without duck shapes, sizes that happen to be equal when it compiles (two rows and two KV
            # heads, say) are not assumed equal for ever, which would compile again at every new shape.
            fx_shapes.use_duck_shape = False
            # Python floats (the attention's scaling, the norms' epsilon) as constants: traced as
            # symbols, Dynamo specialized them in the end and traced each graph a second time.
            torch._dynamo.config.specialize_float = True
            self.compiled_decode = torch.compile(
                own_copy(self.decode_layers),
                dynamic=None,
                fullgraph=True,
                # No shape assertions in the generated code either: ten Python calls a layer, every step.
                options={"guard_filter_fn": only_step_input_guards, "size_asserts": False},
            )
        self.graphs: DecodeGraphs | None = None  # use_graphs
        self.use_ops(decode_ops(self.norm.weight.device, exact, compile_decode))

    def use_ops(self, ops: DecodeOps) -> None:
        """Run the work between the matrix products by these operations (decode_ops: the C++ loops, or
        PyTorch's), and plan the steps again: what a step of each shape runs follows from them."""
        self.ops = ops
        # Where all of a decode step's work is the extension's, its layers are one C++ call.
        self.native = None
        # decode_layers.cpp has Llama's layer, Qwen3's head norms, Qwen3-MoE's (OLMoE's), Mixtral's and
        # gpt-oss's experts, biases, sinks, Gemma 3's layer and LFM2's convolution layers: not other mixtures
        # (each attention layer's norms of its heads: a convolution layer has none)
        attending = [
            norms for norms, conv in zip(self.head_norms, self.convolutions, strict=True) if conv is None
        ]
        head_norms = [(norms.query, norms.key) if norms is not None else None for norms in self.head_norms]
        experts = [
            LayerExperts.of(mlp) if gate_up is None else None
            for mlp, gate_up in zip(self.mlps, self.gate_up, strict=True)
        ]
        mlps_native = all(
            gate_up is not None or mixture is not None
            for gate_up, mixture in zip(self.gate_up, experts, strict=True)
        )
        if (
            self.reads_own_positions
            and all(layer.attention_gate is None for layer in self.bound_layers)  # (LFM3's: the Python loop)
            # every attention layer's norms of its heads, or none's
            and len({norms is None for norms in attending}) == 1
            and mlps_native
            and not self.rotated_norms  # (Hunyuan's take the Python loop)
            # decode_layers.cpp scales every layer's queries or none's (not Llama 4's some)
            and len({layer.query_scaled for layer in self.bound_layers}) == 1
        ):
            self.native = NativeDecode.of(
                self.ops,
                [
                    LayerProjections(
                        qkv.groups,
                        unwrapped(output),
                        gate_up.groups if gate_up is not None else [],
                        unwrapped(down_of(mlp)) if gate_up is not None else None,
                        mixture,
                    )
                    for output, mlp, qkv, gate_up, mixture in zip(
                        self.outputs, self.mlps, self.qkv, self.gate_up, experts, strict=True
                    )
                ],
                [self.first_norm] + [norm for step in self.bound_layers for norm in layer_norms(step)],
                self.norm.weight.dtype,
                self.heads,
                self.kv_heads,
                self.scaling,
                head_norms if attending[0] is not None else None,
                LayerForm(
                    rotations=[layer.rotation for layer in self.bound_layers],
                    windows=[layer.window or 0 for layer in self.bound_layers],
                    sinks=[layer.sinks for layer in self.bound_layers]
                    if any(layer.sinks is not None for layer in self.bound_layers)
                    else [],
                    sandwich=self.sandwich,
                    gelu=self.gelu,
                    squared_relu=self.squared_relu,
                    residual=self.residual,
                    softcap=self.softcap or 0.0,
                    interleaved=self.interleaved,
                    centered=Norm.of(self.norm).centered,
                    parallel=self.parallel,
                ),
                self.convolutions,
            )
        # With the fused operations every decode step takes `decode_layers`: at 32 rows on a CPU they
        # still took a fifth of the step as PyTorch's operations (docs/performance.md).
        self.decode_below = DECODE_BELOW if self.ops is EAGER else float("inf")
        # The fused operations' attention where the loop takes the model's head size, else PyTorch's.
        self.attend = self.ops.attend if self.reads_own_positions else EAGER.attend
        # The MLP's activation of the gate, times up
        self.gated = mlp_activation(self.ops, self.gelu, self.squared_relu)
        self.replan()

    def replan(self) -> None:
        """What each step shape runs (step_plan.py), from the settings above; the dispatch reads it."""
        self.plan = plan_runner(
            self.rows + (LOOP_PROMPT_TOKENS if self.takes_prompts_as_queries else 0),
            graphs=self.graphs is not None,
            native_below=self.native.rows_below if self.native is not None else 0,
            loop_below=self.decode_below,
            compiled=self.compiled_decode is not None,
            loop_attention=self.reads_own_positions,
            projections=self.projections(),
            head=self.head,
        )

    def projections(self) -> list[nn.Module]:
        """The linear layers a step multiplies by, in order, fused where they are."""
        modules: list[nn.Module] = []
        for output, gate, mlp, qkv, gate_up in zip(
            self.outputs, self.attention_gates, self.mlps, self.qkv, self.gate_up, strict=True
        ):
            modules += qkv.groups
            modules += [unwrapped(gate)] if gate is not None else []  # (LFM3's gates of each head)
            modules.append(unwrapped(output))
            if gate_up is not None:  # (a mixture of experts multiplies as its module does)
                modules += gate_up.groups
                modules.append(unwrapped(down_of(mlp)))
        return modules

    def use_graphs(self, cache: RowCache, capture: bool = True) -> DecodeGraphs:
        """Run decode steps over this cache as CUDA graphs (`capture=False`: the same static shapes
        and buffers without capture, which a CPU can run), captured by `DecodeGraphs.capture_all`."""
        self.graphs = DecodeGraphs(functools.partial(self.graph_step, cache=cache), cache, capture)
        self.replan()
        return self.graphs

    def graph_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
        visible: torch.Tensor,
        cache: RowCache,
    ) -> torch.Tensor:
        """What a decode graph captures: `decode_layers` (with --compile its compiled copy, whose
        generated kernels fuse the norms, rotations and residual adds) and the head; the queries'
        rows in any order, padding ones among them."""
        decode, visible = self.decode_function(visible, cache, (input_ids, positions, rows, slots))
        return self.logits(
            decode(input_ids, positions, rows, slots, visible, cache.keys, cache.values, scatter=True)
        )

    @staticmethod
    def supports(config: PretrainedConfig) -> bool:
        """Whether the runner serves this model (else transformers' forward does)."""
        if config.model_type in GPT_OSS_LAYER_TYPES | SHORT_CONV_LAYER_TYPES:  # (with all their forms)
            return True
        if config.model_type in GEMMA_LAYER_TYPES:  # not embedding models'
            return (
                not getattr(config, "use_bidirectional_attention", False)
                and activation(config) == "gelu_pytorch_tanh"
            )
        return (
            config.model_type in LLAMA_LAYER_TYPES
            and getattr(config, "hidden_act", "silu") == ("relu2" if config.model_type == "arcee" else "silu")
            and not getattr(config, "mlp_bias", False)
            and not getattr(config, "use_bias", False)  # (ERNIE 4.5's, on every linear layer)
            and getattr(config, "clip_qkv", None) is None
            # (Command R+'s LayerNorms of each head, a weight a head, are not the runner's; Llama 4's are)
            and not (config.model_type == "cohere" and getattr(config, "use_qk_norm", False))
        )

    @staticmethod
    def would_read_own_positions(
        config: PretrainedConfig, device: torch.device, exact: bool, compiled: bool
    ) -> bool:
        """Whether a runner for this model would attend by the CPU's loop (`reads_own_positions`), asked
        before there is one: the KV cache's dtype depends on it (row_cache.pick_cache_dtype)."""
        if not DecoderRunner.supports(config):
            return False
        shape = KVShape.of(config)
        group = config.get_text_config().num_attention_heads // shape.kv_heads
        return loop_attends(decode_ops(device, exact, compiled), shape.head_dim, group)

    @property
    def reads_own_positions(self) -> bool:
        """Whether decode queries attend by the CPU's loop, each over its row up to its own position,
        in steps with prompts too: no batch padded to the longest row, so no long rows to read apart."""
        return loop_attends(self.ops, self.head_dim, self.heads // self.kv_heads)

    @property
    def takes_prompts_as_queries(self) -> bool:
        """Whether a step's short prompts (and drafts, and an embedding input's chunk) may go as more decode
        queries of their rows (engine.py): where each query reads its own positions, but not where
        convolution layers advance a row's state by one token a query."""
        return self.reads_own_positions and not self.convolves

    def __call__(
        self,
        input_ids: torch.Tensor,  # [tokens]
        positions: torch.Tensor,  # [tokens]
        layout: StepLayout,
        cache: RowCache,
        keep: torch.Tensor,  # [kept] indices into the tokens
        embedded: range | None = None,  # tokens whose last hidden states the step gives back
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits at `keep` ([kept, vocab]) and the final norm's output at `embedded` (or None)."""
        layers = self.plan.path(layout).layers
        if layers is NATIVE and self.lora is not None and self.lora.step is not None:
            layers = LOOP  # decode_layers.cpp multiplies by the base layers alone: an adapter's rows are here
        if layers is GRAPH:
            return self.graphs.run(input_ids, positions, layout), None
        # A decode step keeps the logits of its decoding rows' queries, in pack order, but not those of a
        # prompt's tokens before its last, nor an embedding input's (the last): their normed states
        # instead. The head stays out of the compiled graph: it changes kernels with the number of
        # rows, each change a graph of its own.
        if layers is NATIVE or layers in DECODE_LAYERS:
            step = self._native_step if layers is NATIVE else self._decode_step
            normed = step(input_ids, positions, layout, cache)
            states = None if embedded is None else normed[embedded.start : embedded.stop]
            kept = normed if keep.shape[0] == normed.shape[0] else normed.index_select(0, keep)
            return self.logits(kept), states
        hidden = self.embed(input_ids)[None]  # [1, tokens, hidden], the shapes transformers' layers use
        # [1, 1, tokens, head_dim] each
        rotations = [(cos[:, None], sin[:, None]) for cos, sin in self.rotations(hidden, positions)]
        scales = self.query_scales(positions, hidden.dtype)
        for output_layer, gate, mlp_module, bound, input_norm, qkv, head_norms, gate_up, cache_layer in zip(
            self.outputs,
            self.attention_gates,
            self.mlps,
            self.bound_layers,
            self.input_norms,
            self.qkv,
            self.head_norms,
            self.gate_up,
            cache.layers,
            strict=True,
        ):
            normed = EAGER.norm(hidden, input_norm)
            projected = HeadNorms.after(qkv, head_norms)(normed)
            if bound.convolution is not None:  # (LFM2's convolution layer, over the rows' states)
                mixed = bound.convolution.over_pack(projected[0], layout)[None]
            else:
                rotation = rotations[bound.rotation]
                mixed = self._attention(projected, *rotation, cache_layer, layout, bound, scales)
                if gate is not None:  # (LFM3's)
                    mixed = gated_heads(mixed, gate(normed), self.head_dim)
            output = normed_output(output_layer(mixed), bound.attention_out_norm)
            hidden = hidden + self.residual_part(output)
            if not self.parallel:  # (Cohere's MLP takes the layer's input norm, as its attention did)
                normed = EAGER.norm(hidden, bound.mlp_norm)
            if gate_up is None:  # a mixture of experts: the layer's own module
                mlp = experts_output(mlp_module(normed)).view_as(normed)
            else:
                gated = mlp_activation(EAGER, self.gelu, self.squared_relu)(gate_up(normed))
                mlp = down_of(mlp_module)(gated)
            hidden = hidden + self.residual_part(normed_output(mlp, bound.mlp_out_norm))
        states = None if embedded is None else rms_norm(hidden[0, embedded.start : embedded.stop], self.norm)
        return self.logits(rms_norm(hidden[0, keep], self.norm)), states

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The head's output, divided by Granite's `logits_scaling`, multiplied by Cohere's `logit_scale` and
        soft-capped at Gemma 2's `final_logit_softcapping` where the model has them."""
        logits = self.head(normed)
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.final_softcap is not None:  # (transformers' order of operations)
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def residual_part(self, output: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as its residual add takes it: times Granite's `residual_multiplier`."""
        return output if self.residual == 1.0 else output * self.residual

    def _attention(
        self,
        qkv: torch.Tensor,  # [1, tokens, (heads + 2 * kv_heads) * head_dim]
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache_layer: CacheLayerMixin,
        layout: StepLayout,
        layer: DecodeLayer,  # its window and sinks
        scales: torch.Tensor | None = None,  # [tokens]: each token's query's scale where `layer.query_scaled`
    ) -> torch.Tensor:
        tokens = qkv.shape[1]
        all_heads = qkv.view(1, tokens, -1, self.head_dim).transpose(
            1, 2
        )  # [1, q, k and v heads, tokens, dim]
        # one rotation for both
        query_and_key = rotate(all_heads[:, : self.heads + self.kv_heads], cos, sin, self.interleaved)
        query, key = query_and_key.split([self.heads, self.kv_heads], dim=1)
        if layer.head_norms is not None and layer.head_norms.after_rotation:  # (Hunyuan's)
            query, key = EAGER.norm(query, layer.head_norms.query), EAGER.norm(key, layer.head_norms.key)
        if layer.query_scaled:  # (Ministral 3's, Llama 4's: in the scales' dtype, rounded to the queries')
            query = (query * scales[None, None, :, None]).to(query.dtype)
        keys, values = cache_layer.update(key, all_heads[:, self.heads + self.kv_heads :])
        by_position = self.attend if self.reads_own_positions else None
        features = None
        if layer.window is not None or layer.sinks is not None or self.softcap is not None:
            features = AttentionFeatures(window=layer.window, softcap=self.softcap, sinks=layer.sinks)
        return attend(query, keys, values, layout, self.scaling, by_position, features).reshape(1, tokens, -1)

    def _decode_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, layout: StepLayout, cache: RowCache
    ) -> torch.Tensor:
        """A step of decoding rows alone, up to the head: `decode_layers`, compiled where it was asked for."""
        slots = cache.plan.decode_slots(cache.kv_heads)  # where the general path writes too, once a step
        per_query = (input_ids, positions, layout.decode_index, slots)
        decode, visible = self.decode_function(layout.visible, cache, per_query)
        return decode(input_ids, positions, layout.decode_index, slots, visible, cache.keys, cache.values)

    def _native_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, layout: StepLayout, cache: RowCache
    ) -> torch.Tensor:
        """The same step, up to the head, by decode_layers.cpp: `decode_layers`' loop in one C++ call."""
        hidden = self.embed(input_ids)
        rotations = self.rotations(hidden, positions)  # each kind's [queries, 1, head_dim] below
        cos, sin = ([rotation[i][0, :, None] for rotation in rotations] for i in (0, 1))
        slots, rows = cache.plan.decode_slots(cache.kv_heads), layout.decode_index
        scales = None  # (the loop scales every layer's queries or none's: the first says which)
        if self.bound_layers[0].query_scaled:
            scales = self.query_scales(positions, cache.keys[0].dtype)  # (the queries' dtype: the cache's)
        return self.native(hidden, cos, sin, slots, rows, positions, cache.keys, cache.values, scales)

    def rotations(
        self, hidden: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """cos and sin at these positions ([1, tokens, head_dim] each) for each of `rope_kinds`, as the
        rotation takes them (`as_rotated`): one kind but for Gemma 3's window and global layers, and SmolLM3's
        layers that rotate by none (cos 1 and sin 0: x * 1 + rotate_half(x) * 0 is x, exactly)."""
        by_kind = {
            kind: self.as_rotated(
                *cos_and_sin(
                    self.rotary(hidden, positions[None])
                    if kind is None
                    else self.rotary(hidden, positions[None], layer_type=kind)
                ),
                hidden.dtype,
            )
            for kind in self.rope_kinds
            if kind != UNROTATED
        }
        if UNROTATED in self.rope_kinds:  # (the shapes of another kind's, or of the model's one rotation)
            cos, sin = next(iter(by_kind.values()), None) or self.as_rotated(
                *cos_and_sin(self.rotary(hidden, positions[None])), hidden.dtype
            )
            by_kind[UNROTATED] = (torch.ones_like(cos), torch.zeros_like(sin))
        return [by_kind[kind] for kind in self.rope_kinds]

    def query_scales(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Ministral 3's and Llama 4's factor of each token's query ([tokens]: `QueryScaling`, queries of
        `dtype`); None for other models."""
        return None if self.query_scaling is None else self.query_scaling(positions, dtype)

    def as_rotated(
        self, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A rotary module's cos and sin as the rotation (`rotate`) takes them: over the width the model
        rotates (gpt-oss's module gives them over half of it, each half of a query rotated by the same
        angles, its `_apply_rotary_emb`: Llama's rotation with them repeated, the same products and sums, so
        float32 stays exact; Phi-4-mini's and GLM's are narrower than a head, but they are all their
        rotation), each angle twice in a row for an interleaved rotation (GLM's; Cohere's module gives them
        so already: `paired_angles`), and in the model's dtype
        (OLMo 2's and ERNIE 4.5's modules give float32 whatever the model's: rounded to it as Llama's
        module rounds them)."""
        if self.half_rotation:
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        if self.interleaved and not self.paired_angles:
            cos, sin = interleaved_angles(cos), interleaved_angles(sin)
        return cos.to(dtype), sin.to(dtype)

    def layer_reads(self, visible: torch.Tensor) -> list[tuple[torch.Tensor, int | None]]:
        """What each layer's decode attention reads, (mask, window): the CPU's loop reads positions and
        takes the window itself; PyTorch's kernel takes the mask narrowed to it, narrowed once a step for
        all the layers of a window (Gemma 3 1B has 22 window layers)."""
        if self.reads_own_positions:
            return [(visible, layer.window) for layer in self.bound_layers]
        windows = {layer.window for layer in self.bound_layers} - {None}
        narrowed = {None: visible} | {window: within_window(visible, window) for window in windows}
        return [(narrowed[layer.window], None) for layer in self.bound_layers]

    def decode_function(
        self, visible: torch.Tensor, cache: RowCache, per_query: tuple[torch.Tensor, ...]
    ) -> tuple[Callable, torch.Tensor]:
        """`decode_layers` and its visibility, or with --compile its compiled copy and the visibility
        a compiled one takes (`graph_inputs`), with the step's sizes marked as its symbols."""
        if self.compiled_decode is None:
            return self.decode_layers, visible
        visible = graph_inputs(visible, cache)
        step_sizes_dynamic(per_query, visible)
        return self.compiled_decode, visible

    def decode_layers(
        self,
        input_ids: torch.Tensor,  # [queries]: one token for each decoding row
        positions: torch.Tensor,  # [queries]
        rows: torch.Tensor,  # [queries]: the row of each, ascending unless `scatter`
        slots: torch.Tensor,  # where each query's keys and values go (row_cache.StepWrite.decode_slots)
        visible: torch.Tensor,  # [span rows, 1, 1, span]: what each row of the span may read
        keys: list[torch.Tensor],  # each layer's cache, [rows, kv_heads, max_seq_len, head_dim]
        values: list[torch.Tensor],
        scatter: bool = False,  # rows need not be the span's rows in order (decode_graphs pads with others)
    ) -> torch.Tensor:
        """A decode step as `__call__` runs it up to the head, in fewer operations: [queries, hidden]
        throughout (no batch dimension to add and take off), the cache written and read directly (no
        layout objects), the linear layers on two-dimensional inputs, which the weight-only layers
        multiply without reshapes or casts (docs/performance.md); it is also what torch.compile
        compiles."""
        ops, queries = self.ops, input_ids.shape[0]
        hidden = self.embed(input_ids)
        # [queries, 1, head_dim] each
        rotations = [(cos[0, :, None], sin[0, :, None]) for cos, sin in self.rotations(hidden, positions)]
        scales = self.query_scales(positions, keys[0].dtype)  # (the queries' dtype: the cache's)
        if self.rotated_norms:  # the rotation by none of keys rotated already (x * 1 + t * 0 is x)
            unrotated = torch.ones_like(rotations[0][0]), torch.zeros_like(rotations[0][1])
        normed = ops.norm(hidden, self.first_norm)
        for layer, (reads, window), layer_keys, layer_values in zip(
            self.bound_layers, self.layer_reads(visible), keys, values, strict=True
        ):
            qkv = layer.qkv(normed)
            if layer.convolution is not None:  # LFM2's convolution layer: B, C and x, over the rows' states
                hidden, normed = self._decode_sublayer_ends(
                    hidden, layer.o(layer.convolution.decode(qkv, rows, ops)), layer
                )
                continue
            cos, sin = rotations[layer.rotation]
            if layer.head_norms is not None and layer.head_norms.after_rotation:  # Hunyuan's
                qkv = rotated_then_normed(qkv, cos, sin, layer.head_norms, self.interleaved, ops)
                cos, sin = unrotated  # (the keys are stored as they are now)
            elif layer.head_norms is not None:
                qkv = layer.head_norms(qkv, ops)
            query = ops.rotate_and_store(
                qkv, cos, sin, slots, layer_keys, layer_values, self.heads, self.kv_heads, self.interleaved
            )
            if layer.query_scaled:
                query = (query * scales[:, None, None]).to(query.dtype)
            attended = self.attend(
                query,
                layer_keys,
                layer_values,
                rows,
                positions,
                reads,
                self.scaling,
                scatter,
                window,
                layer.sinks,
                self.softcap,
            )
            attended = attended.view(queries, -1).to(hidden.dtype)
            if layer.attention_gate is not None:  # (LFM3's, of the layer's input norm)
                attended = gated_heads(attended, layer.attention_gate(normed), self.head_dim)
            hidden, normed = self._decode_sublayer_ends(hidden, layer.o(attended), layer, normed)
        return normed

    def _decode_sublayer_ends(
        self,
        hidden: torch.Tensor,
        output: torch.Tensor,
        layer: DecodeLayer,
        normed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's layer from its attention's output (or its convolution's) on: the residual adds,
        the norms around them and the MLP; the residual stream and its next norm. `normed`: the layer's
        input norm, which Cohere's MLP takes (`parallel`)."""
        ops = self.ops
        if layer.attention_out_norm is not None:
            output = ops.norm(output, layer.attention_out_norm)
        if self.parallel:  # the MLP takes `normed` as attention did (Cohere's layer)
            hidden = ops.add_norm(hidden, self.residual_part(output), None)[0]
        else:
            hidden, normed = ops.add_norm(hidden, self.residual_part(output), layer.mlp_norm)
        if layer.experts is not None:
            mlp = layer.experts(normed)
        else:
            mlp = layer.down(self.gated(layer.gate_up(normed)))
        if layer.mlp_out_norm is not None:
            mlp = ops.norm(mlp, layer.mlp_out_norm)
        return ops.add_norm(hidden, self.residual_part(mlp), layer.next_norm)


def cos_and_sin(
    angles: tuple[torch.Tensor, torch.Tensor] | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A rotary module's output as cos and sin: as it gives them, or where it gives each angle as a complex
    number of its cos and sin (Llama 4's `freqs_cis`, [..., head_dim / 2], rotating neighbouring pairs), in
    the form other modules give them, the angles of a half of the head, then the same again (`as_rotated`
    pairs them for the interleaved rotation)."""
    if not isinstance(angles, torch.Tensor):
        return angles
    return torch.cat([angles.real, angles.real], dim=-1), torch.cat([angles.imag, angles.imag], dim=-1)


def rotated_then_normed(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norms: HeadNorms,
    interleaved: bool,
    ops: DecodeOps,
) -> torch.Tensor:
    """q, k and v side by side ([queries, (heads + 2 kv_heads) * head_dim]) with q and k rotated, then
    normed (Hunyuan's order: its module's), v as it is."""
    rotated_heads = norms.heads + norms.kv_heads
    all_heads = qkv.view(qkv.shape[0], -1, qkv.shape[-1] // (rotated_heads + norms.kv_heads))
    rotated = rotate(all_heads[:, :rotated_heads], cos, sin, interleaved)
    return norms(torch.cat([rotated, all_heads[:, rotated_heads:]], dim=1).flatten(1), ops)


def layer_norms(layer: DecodeLayer) -> list[Norm | None]:
    """A layer's norms as decode_layers.cpp takes them: after its attention and after its MLP (the next
    layer's input norm), and Gemma's and OLMo 2's of each sublayer's output before each."""
    if layer.attention_out_norm is None or layer.mlp_out_norm is None:
        return [layer.mlp_norm, layer.next_norm]
    return [layer.attention_out_norm, layer.mlp_norm, layer.mlp_out_norm, layer.next_norm]


def activation(config: PretrainedConfig) -> str:
    """A model's MLP activation: Gemma 2's and 3's `hidden_activation`, the others' `hidden_act`."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")


@dataclass(frozen=True)
class QueryScaling:
    """Llama 4's attention temperature: a query at position p multiplied by 1 + beta log(1 + floor(p /
    length)). Ministral 3's (beta its rotation's `llama_4_scaling_beta`, the length its
    `original_max_position_embeddings`) multiplies every query after its rotation, the factor in the
    queries' dtype (transformers' `get_llama_4_attn_scale`); Llama 4's own (`attn_scale`, `floor_scale`)
    the queries of its layers without rotary positions alone, counting positions from 1, in float32 (its
    module's `attn_temperature_tuning`): `unrotated_layers`."""

    beta: float
    length: int
    unrotated_layers: bool = False

    @classmethod
    def of(cls, config: PretrainedConfig) -> QueryScaling | None:
        """A model's scaling of its queries (`QUERY_SCALED_TYPES`), or None."""
        if config.model_type == "llama4_text":
            tuned = config.attn_temperature_tuning
            return cls(config.attn_scale, config.floor_scale, unrotated_layers=True) if tuned else None
        if config.model_type not in QUERY_SCALED_TYPES:
            return None
        rope = config.rope_parameters
        return cls(rope["llama_4_scaling_beta"], rope["original_max_position_embeddings"])

    def scales(self, rotated: bool) -> bool:
        """Whether a layer's queries take the factor: a rotated one's, unless the unrotated ones' alone do."""
        return not (rotated and self.unrotated_layers)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Each position's factor ([tokens]), as the model's module computes it."""
        if self.unrotated_layers:
            return torch.log1p(torch.floor((positions.float() + 1.0) / self.length)) * self.beta + 1.0
        return (1 + self.beta * torch.log(1 + torch.floor(positions / self.length))).to(dtype)


def rotates(attention: nn.Module) -> bool:
    """Whether an attention layer rotates its queries and keys: not SmolLM3's layers without rotary
    positions (`use_rope` off), nor EXAONE 4's global layers where it has window layers (its module rotates
    where it has no window or the layer is a window layer)."""
    if not getattr(attention, "use_rope", True):
        return False
    if attention.config.model_type == "exaone4":
        return attention.sliding_window is None or attention.is_sliding
    if attention.config.model_type == "cohere2":  # (its module rotates in its window layers alone)
        return attention.sliding_window is not None
    return True


def rotates_by_kind(rotary: nn.Module) -> bool:
    """Whether a rotary module gives each kind of layer a rotation of its own (Gemma 3's: `layer_type`)."""
    return "layer_type" in inspect.signature(rotary.forward).parameters


def window_in(attention: nn.Module, max_seq_len: int | None) -> int | None:
    """An attention layer's sliding window where it comes into play within rows of `max_seq_len`: the
    layer's own (Qwen2's, Gemma 3's: None on its global layers), else its model's (Mistral and Phi-3
    give every layer the config's); none on a layer that says it is not a window layer (EXAONE 4's
    keep the config's window on every layer, read only where `is_sliding`)."""
    if getattr(attention, "is_sliding", True) is False:
        window = None
    elif hasattr(attention, "sliding_window"):
        window = attention.sliding_window
    else:
        window = sliding_window(attention.config)
    return window if window is not None and (max_seq_len is None or window < max_seq_len) else None


def sublayer_norms(layer: nn.Module) -> tuple[nn.Module | None, ...]:
    """A decoder layer's norm modules by place: of its input, of its attention's output, of the MLP's input,
    of the MLP's output (None where it has none there). Llama's norm the inputs alone (its
    `post_attention_layernorm` the MLP's input's); Gemma's and OLMo 2's the sublayers' outputs too (there
    `post_attention_layernorm` is the attention output's; OLMo 2's no input), and GLM-4's all four under
    names of its own. Cohere's norm the input alone, which the MLP takes too (`PARALLEL_TYPES`); LFM2's the
    inputs alone, under names of its own."""
    if hasattr(layer, "operator_norm"):  # LFM2's; LFM3's norm each sublayer's output too, where it has them
        outputs = [getattr(layer, name, None) for name in ("post_operator_norm", "post_ffn_norm")]
        outputs = [None if isinstance(norm, nn.Identity) else norm for norm in outputs]
        return layer.operator_norm, outputs[0], layer.ffn_norm, outputs[1]
    if not hasattr(layer, "post_attention_layernorm"):  # Cohere's
        return layer.input_layernorm, None, None, None
    if hasattr(layer, "post_mlp_layernorm"):  # GLM-4's
        return (
            layer.input_layernorm,
            layer.post_self_attn_layernorm,
            layer.post_attention_layernorm,
            layer.post_mlp_layernorm,
        )
    if hasattr(layer, "post_feedforward_layernorm"):  # Gemma's, OLMo 2's
        return (
            getattr(layer, "input_layernorm", None),
            layer.post_attention_layernorm,
            getattr(layer, "pre_feedforward_layernorm", None),
            layer.post_feedforward_layernorm,
        )
    return layer.input_layernorm, None, layer.post_attention_layernorm, None


def optional_norm(module: nn.Module | None) -> Norm | None:
    """A norm module's norm (`Norm.of`), or None where a layer has none there."""
    return None if module is None else Norm.of(module)


def normed_output(output: torch.Tensor, norm: Norm | None) -> torch.Tensor:
    """A sublayer's output, through Gemma's norm of it where the layer has one."""
    return output if norm is None else EAGER.norm(output, norm)


class ScaledEmbedding(nn.Module):
    """An embedding whose rows are multiplied by a number (Granite's `embedding_multiplier`), as its model's
    forward multiplies them."""

    def __init__(self, embedding: nn.Module, multiplier: float):
        super().__init__()
        self.embedding, self.multiplier = embedding, multiplier

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(input_ids) * self.multiplier


def scaled(embedding: nn.Module, multiplier: float) -> nn.Module:
    """The embedding, multiplied where the model multiplies it (`ScaledEmbedding`)."""
    return embedding if multiplier == 1.0 else ScaledEmbedding(embedding, multiplier)


def mlp_of(layer: nn.Module) -> nn.Module:
    """A decoder layer's MLP or mixture of experts: `mlp`, Granite MoE's `block_sparse_moe`, or Llama 4's
    `feed_forward`."""
    for name in ("mlp", "block_sparse_moe"):
        mlp = getattr(layer, name, None)
        if mlp is not None:
            return mlp
    return layer.feed_forward


def mixer_of(layer: nn.Module) -> nn.Module:
    """A decoder layer's attention module, or its short convolution module (LFM2's convolution layers)."""
    return layer.self_attn if hasattr(layer, "self_attn") else layer.conv


def convolutions(mixers: list[nn.Module], states: RowStates | None) -> list[RowConvolution | None]:
    """Each layer's convolution over the rows' states, a layer of them each convolution layer in order (None
    in each attention layer)."""
    convolving = [is_short_conv(mixer) for mixer in mixers]
    if any(convolving) and (states is None or len(states.conv) != sum(convolving)):
        raise ValueError(f"{sum(convolving)} convolution layers need as many layers of the rows' states")
    conv_states = iter(states.conv if states is not None else [])
    return [
        RowConvolution(mixer, next(conv_states)) if convolves else None
        for mixer, convolves in zip(mixers, convolving, strict=True)
    ]


def gated(mixer: nn.Module) -> bool:
    """Whether an attention layer gates each head's output (LFM3's `g_proj`, where it has one)."""
    return getattr(mixer, "g_proj", None) is not None


def gated_heads(attended: torch.Tensor, gate: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Attention's output ([..., heads * head_dim]), each head's multiplied by the sigmoid of its gate
    ([..., heads]), in the model's dtype as LFM3's module multiplies them."""
    heads = attended.view(*gate.shape, head_dim) * torch.sigmoid(gate)[..., None]
    return heads.view(attended.shape)


def mixer_inputs(mixer: nn.Module) -> tuple[nn.Module, ...]:
    """The linear layers that make a layer's mixer's inputs: an attention layer's queries, keys and values
    (`attention_inputs`), a convolution layer's B, C and x (its one `in_proj`)."""
    return (mixer.in_proj,) if is_short_conv(mixer) else attention_inputs(mixer)


def attention_inputs(attention: nn.Module) -> tuple[nn.Module, ...]:
    """The linear layers that make an attention layer's queries, keys and values, whose outputs side by side
    are q, k and v: Phi-3's one layer, the others' three."""
    if hasattr(attention, "qkv_proj"):
        return (attention.qkv_proj,)
    return (attention.q_proj, attention.k_proj, attention.v_proj)


def output_of(mixer: nn.Module) -> nn.Module:
    """The linear layer of a layer's mixer's output: attention's o (LFM2's `out_proj`, its convolution
    layers' too)."""
    return mixer.o_proj if hasattr(mixer, "o_proj") else mixer.out_proj


def rotary_of(model: nn.Module) -> nn.Module:
    """A base model's rotary module (LFM2-MoE's `pos_emb`)."""
    return model.rotary_emb if hasattr(model, "rotary_emb") else model.pos_emb


def final_norm(model: nn.Module) -> nn.Module:
    """A base model's norm after its last layer (LFM2's `embedding_norm`)."""
    return model.norm if hasattr(model, "norm") else model.embedding_norm


def down_of(mlp: nn.Module) -> nn.Module:
    """An MLP's down projection (LFM2's `w2`)."""
    return mlp.down_proj if hasattr(mlp, "down_proj") else mlp.w2


def gate_and_up(mlp: nn.Module) -> tuple[nn.Module, ...]:
    """The linear layers whose outputs side by side are an MLP's gate and up: Phi-3's one, Llama's two;
    Arcee's up alone (its MLP has no gate); LFM2's w1 and w3."""
    if hasattr(mlp, "gate_up_proj"):
        return (mlp.gate_up_proj,)
    if hasattr(mlp, "w1"):
        return (mlp.w1, mlp.w3)
    if not hasattr(mlp, "gate_proj"):
        return (mlp.up_proj,)
    return (mlp.gate_proj, mlp.up_proj)


def mlp_activation(ops: DecodeOps, gelu: bool, squared_relu: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the MLP does to gate and up's output (`ops`' functions): GELU(gate) * up (Gemma's), ReLU(up)^2
    (Arcee's, which has no gate), else SiLU(gate) * up."""
    if squared_relu:
        return ops.relu_squared
    return ops.gelu_tanh_mul if gelu else ops.silu_mul


def is_dense(mlp: nn.Module) -> bool:
    """Whether a layer's MLP is Llama's (gate and up, then down; Arcee's without the gate) rather than a
    mixture of experts (whose `gate_up_proj`, where it has one, is its experts' 3-D tensor)."""
    if isinstance(getattr(mlp, "gate_up_proj", None), nn.Module):
        return hasattr(mlp, "down_proj")
    return all(hasattr(mlp, name) for name in ("up_proj", "down_proj")) or hasattr(mlp, "w2")  # (LFM2's)


def rows_through(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A [batch, tokens, hidden] module (transformers' MoE blocks) as a function of [rows, hidden] (Llama 4's
    gives its output [tokens, hidden] whatever its input's batch)."""
    return lambda x: experts_output(module(x[None])).view_as(x)


def experts_output(output: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """An MoE block's output: gpt-oss's gives its router's scores beside it."""
    return output[0] if isinstance(output, tuple) else output


def sinks_of(attention: nn.Module) -> torch.Tensor | None:
    """An attention layer's sink logits (gpt-oss's `sinks`, one a head) in float32, which the CPU's loop
    takes (and the same tensor where they are float32 already), or None."""
    sinks = getattr(attention, "sinks", None)
    return None if sinks is None else sinks.detach().float().contiguous()


def loop_attends(ops: DecodeOps, head_dim: int, group: int) -> bool:
    """Whether `ops` attend by the CPU's loop (fused_ops.cpp) at this head size and query heads a KV head."""
    return ops is not EAGER and ops.attention_supports(head_dim, group)


def graph_inputs(visible: torch.Tensor, cache: RowCache) -> torch.Tensor:
    """What a compiled `decode_layers` takes in place of the eager one's inputs: the visibility with a free
    second row where the span has one row (reading its position 0, its output dropped), since
    torch.compile specializes size 1 and that would be one more graph to compile; and the cache's
    sizes marked static, since as constants they cost the compiler nothing, where as symbols (four
    for each of 60 tensors) they made it take many minutes."""
    if not getattr(cache, "static_for_compile", False):
        for tensor in cache.keys + cache.values:
            torch._dynamo.mark_static(tensor)
        cache.static_for_compile = True
    if visible.shape[0] > 1 or cache.rows == 1:
        return visible
    free_row = torch.full_like(visible, float("-inf"))
    free_row[..., 0] = 0
    return torch.cat([visible, free_row])


def step_sizes_dynamic(per_query: tuple[torch.Tensor, ...], visible: torch.Tensor) -> None:
    """Mark what changes from step to step as the compiled `decode_layers`' only symbols: the number of
    queries, and the visibility's rows and span. `maybe_`: a size of 1 is specialized (as
    torch.compile does with every size 1) instead of raising."""
    for tensor in per_query:
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    torch._dynamo.maybe_mark_dynamic(visible, 0)
    torch._dynamo.maybe_mark_dynamic(visible, 3)


# What Dynamo checks before each call of a compiled `decode_layers` that can change between calls: the
# step's tensors (their shapes choose the graph) and the global state. Not the runner's weights nor
# the cache's tensors, fixed for the runner's life: checking some 500 tensors and 8,000 attributes of
# them took 1.4 ms of a one-row step of 8.8 ms on the default model.
FIXED_FOR_LIFE = {"self", "keys", "values"}


def only_step_input_guards(guards: list) -> list[bool]:
    """torch.compile's `guard_filter_fn`: keep every guard but those on what is fixed for life."""
    return [re.split(r"[.\[]", guard.name, maxsplit=1)[0] not in FIXED_FOR_LIFE for guard in guards]


def own_copy(method: types.MethodType) -> types.MethodType:
    """The method over its own copy of its code: Dynamo keeps compiled graphs on the code object,
    and without the guards on the weights (above) one runner's graph must never run for another's."""
    function = method.__func__
    code = function.__code__.replace()
    copy = types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__)
    return types.MethodType(copy, method.__self__)


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' Llama RMSNorm module applied to x as PyTorch's single `rms_norm` (decode_ops.EAGER):
    bit for bit in float32, where the module takes eight operations."""
    return EAGER.norm(x, Norm.of(norm))
