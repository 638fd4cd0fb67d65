"""A decode step's layers in one C++ call (decode_layers.cpp), where the model's step allows it.

With its weights in blocks (block_weights.py) a one-row step of the default
model on a CPU took 5.7 ms, of which the C++ work of its 30 layers was some
2.6 and Python around it, ten calls a layer through the interpreter and
pybind, about another millisecond (docs/performance.md). `decode_layers.cpp`
is `DecoderRunner.decode_layers`'s loop with the same functions in the same
order, so its numbers are the Python loop's bit for bit
(tests/backend/test_native_decode.py); it runs where every one of them is
this extension's: a CPU with the fused operations and blocks (AVX-512 VNNI or AVX2), every
projection in blocks, the attention loop for the model's head size, and
activations in the kernels' dtype (bfloat16, the default mode's); Llama's layer, with Qwen3's norms
of each query and key head where the model has them, Qwen3-MoE's and Mixtral's mixtures of experts
and gpt-oss's (experts.cpp, `LayerExperts`), biases, attention sinks and Gemma 3's layer (`LayerForm`), and
LFM2's convolution layers (`short_conv` over the rows' states, where its attention layers attend).
Other steps, and other models, run the Python loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from backend.layers.decode_ops import DecodeOps, FusedOps, Norm
from backend.model.short_conv import RowConvolution
from backend.quant.quantized_experts import ClampedSwiGLU, PlainGLU, QuantizedExperts
from backend.quant.quantized_linear import WeightOnlyLinear

# transformers' mixture blocks whose routing experts.cpp does, by their router's class (FloatRouter's
# `router`), and none with a shared expert: a softmax's top k, renormalized (Mixtral's always, Qwen3-MoE's
# where `norm_topk_prob`); gpt-oss's top k of the logits, then their softmax
NATIVE_MIXTURES = {
    "Qwen3MoeSparseMoeBlock": ("gate", "Qwen3MoeTopKRouter"),
    "MixtralSparseMoeBlock": ("gate", "MixtralTopKRouter"),
    "OlmoeSparseMoeBlock": ("gate", "OlmoeTopKRouter"),  # (Qwen3-MoE's routing)
    "GptOssMLP": ("router", "GptOssTopKRouter"),
    "GraniteMoeMoE": ("router", "GraniteMoeTopKRouter"),  # (gpt-oss's routing, without a bias)
}
# The routers that take the top k of the logits, then their softmax (no renormalizing)
TOP_K_FIRST = {"GptOssTopKRouter", "GraniteMoeTopKRouter"}


NO_MIXTURE = (0, False, False, 0.0, 0.0)  # `LayerExperts.routing` of a model without one
NO_NORM = torch.empty(0)  # what decode_layers.cpp takes where a layer norms nothing there (OLMo 2's inputs)
NO_SCALES = torch.empty(0)  # ... and where a model's queries have no factor (all but Ministral 3's)
NO_CONVOLUTION = torch.empty(0)  # ... and an attention layer's convolution states and weights (LFM2's)


@dataclass(frozen=True)
class LayerExperts:
    """A mixture-of-experts layer as experts.cpp takes it: its router's float32 weight and bias, how it
    routes and activates (`routing`: the extension's `Mixture`'s fields), and each expert's projections."""

    router: torch.Tensor  # [experts, hidden], float32
    router_bias: torch.Tensor | None
    routing: tuple[int, bool, bool, float, float]  # top_k, normalize, top_k_first, alpha, limit
    gate_up: list[nn.Module]  # expert e's gate and up
    down: list[nn.Module]

    @classmethod
    def of(cls, mlp: nn.Module) -> LayerExperts | None:
        """A layer's MLP as experts.cpp would run it, or None where it cannot: not one of
        `NATIVE_MIXTURES`, its router not in float32 (float_router.py), or its experts not the quantized
        ones with SiLU or gpt-oss's clamped SwiGLU (quantized_experts.py)."""
        place, router_class = NATIVE_MIXTURES.get(type(mlp).__name__, ("", ""))
        router = getattr(getattr(mlp, place, None), "router", None)  # FloatRouter's
        experts = getattr(mlp, "experts", None)
        if (
            type(router).__name__ != router_class
            or router.weight.dtype != torch.float32
            or not isinstance(experts, QuantizedExperts)
        ):
            return None
        activation = experts.activation
        if isinstance(activation, ClampedSwiGLU):
            alpha, limit = activation.alpha, activation.limit
        elif isinstance(activation, PlainGLU) and activation.silu:
            alpha, limit = 0.0, 0.0  # (no limit: SiLU's GLU)
        else:
            return None
        top_k_first = router_class in TOP_K_FIRST
        # Mixtral's router always renormalizes, Qwen3-MoE's where asked; gpt-oss's softmax is over the top k
        normalize = getattr(router, "norm_topk_prob", not top_k_first)
        return cls(
            router.weight,
            getattr(router, "bias", None),
            (router.top_k, normalize, top_k_first, alpha, limit),
            list(experts.gate_up),
            list(experts.down),
        )


@dataclass(frozen=True)
class LayerProjections:
    """A layer's projections as a decode step calls them: q, k and v in one call where they fused, else in
    the calls of `Projections.groups` (a K-quant mix's Q4_K q and k beside its Q6_K v); o; gate and up
    likewise; down. A mixture of experts has `experts` in place of gate, up and down."""

    qkv: list[nn.Module]
    o: nn.Module
    gate_up: list[nn.Module]
    down: nn.Module | None
    experts: LayerExperts | None = None

    def calls(self) -> list[nn.Module]:
        if self.experts is not None:
            return [*self.qkv, self.o, *self.experts.gate_up, *self.experts.down]
        return [*self.qkv, self.o, *self.gate_up, self.down]


@dataclass(frozen=True)
class LayerForm:
    """How a model's layers differ from Llama's beyond their weights: each layer's rotation (an index into
    the runner's `rope_kinds`: Gemma 3 rotates its window and global layers apart), sliding window (0:
    none) and attention sinks (none for every layer where empty), Gemma 3's and OLMo 2's norms of each
    sublayer's output (`sandwich`), Gemma's GELU for SiLU, Granite's multiplier of each sublayer's output
    (`residual`), Gemma 2's cap of attention's scores (`softcap`), GLM's rotation of neighbouring
    pairs (`interleaved`), Arcee's MLP without a gate (`squared_relu`), and Cohere's LayerNorms
    (`centered`) and MLP beside attention (`parallel`)."""

    rotations: list[int]
    windows: list[int]
    sinks: list[torch.Tensor | None] = field(default_factory=list)  # gpt-oss's, [heads] float32 a layer
    sandwich: bool = False
    gelu: bool = False
    squared_relu: bool = False  # the MLP's up alone, then ReLU(up)^2 (Arcee's; no gate)
    residual: float = 1.0  # what each sublayer's output is multiplied by before its residual add (Granite's)
    softcap: float = 0.0  # the cap of attention's scaled scores (Gemma 2's; 0: none)
    interleaved: bool = False  # queries and keys rotated in neighbouring pairs (GLM's: decode_ops.rotate)
    centered: bool = False  # every norm a LayerNorm without a bias (Cohere's: decode_ops.Norm)
    parallel: bool = False  # the MLP takes the layer's input norm too, no norm after attention (Cohere's)


@dataclass(frozen=True)
class NativeDecode:
    """What `decode_layers.cpp` takes besides a step's tensors, gathered once for a runner."""

    run: Callable[..., torch.Tensor]  # the extension's decode_layers
    projections: list[torch.Tensor]  # each layer's qkv, o, gate_up and down blocks (`LayerProjections.calls`)
    bits: list[int]
    tables: list[int]  # the table each projection's values index (block_weights.Table), or none
    calls: list[int]  # each layer's number of calls for q, k and v, then for gate and up (0: experts)
    # the first input norm, then each layer's two, after attention and after its MLP; with a sandwich four:
    # its attention's output, after attention, its MLP's output, after its MLP; empty where there is none
    norms: list[torch.Tensor]
    eps: list[float]
    head_norms: list[torch.Tensor]  # each layer's norms of its query and key heads (Qwen3's), or none
    head_eps: list[float]
    heads: int
    kv_heads: int
    scaling: float
    biases: list[torch.Tensor | None]  # each projection's, or none for every one
    routers: list[torch.Tensor]  # each mixture-of-experts layer's, in order
    router_biases: list[torch.Tensor | None]  # theirs, or none for every one
    mixture: object  # the extension's `Mixture`: how every mixture routes and activates
    form: LayerForm
    rows_below: float  # steps of fewer rows: from there on a projection multiplies by its many-rows path
    # LFM2's: each layer's rows' states and filters ([hidden, kernel]), empty in attention layers; none for a
    # model without convolution layers
    conv_states: list[torch.Tensor] = field(default_factory=list)
    conv_weights: list[torch.Tensor] = field(default_factory=list)
    conv_biases: list[torch.Tensor | None] = field(default_factory=list)  # theirs, or none for every one

    @classmethod
    def of(
        cls,
        ops: DecodeOps,
        layers: list[LayerProjections],
        norms: list[Norm | None],
        dtype: torch.dtype,
        heads: int,
        kv_heads: int,
        scaling: float,
        head_norms: list[tuple[Norm, Norm] | None] | None = None,
        form: LayerForm | None = None,
        convolutions: list[RowConvolution | None] | None = None,
    ) -> NativeDecode | None:
        """The plan for these layers, or None where a step must run the Python loop. `head_norms`: each
        layer's norms of its query and of its key heads, where the model has them (Qwen3's, Gemma 3's; None
        in LFM2's convolution layers); `form`: where the layers are not Llama's (Gemma 3's); `convolutions`:
        each layer's convolution over the rows' states, None in an attention layer (LFM2's)."""
        projections = [projection for layer in layers for projection in layer.calls()]
        in_blocks = all(isinstance(p, WeightOnlyLinear) and p.blocks is not None for p in projections)
        if not isinstance(ops, FusedOps) or not in_blocks or dtype != WeightOnlyLinear.compute_dtype:
            return None
        form = form or LayerForm(rotations=[], windows=[])
        if any(norm is not None and norm.centered != form.centered for norm in norms):
            return None  # one kind of norm for every place (every model's)
        mixtures = [layer.experts for layer in layers if layer.experts is not None]
        if len({experts.routing for experts in mixtures}) > 1:
            return None  # one routing for every layer (every model's)
        biases = [p.bias for p in projections]
        router_biases = [experts.router_bias for experts in mixtures]
        head_pairs = [pair or (None, None) for pair in head_norms or []]  # (none in a convolution layer)
        convolutions = convolutions if any(conv is not None for conv in convolutions or []) else []
        conv_biases = [conv.bias if conv is not None else None for conv in convolutions]
        return cls(
            run=ops.extension.decode_layers,
            projections=[p.blocks for p in projections],
            bits=[p.blocks_layout.bits for p in projections],
            tables=[p.blocks_layout.table for p in projections],
            calls=[
                count
                for layer in layers
                for count in (len(layer.qkv), 0 if layer.experts is not None else len(layer.gate_up))
            ],
            norms=[NO_NORM if norm is None else norm.weight for norm in norms],
            eps=[0.0 if norm is None else norm.eps for norm in norms],
            head_norms=[NO_NORM if norm is None else norm.weight for pair in head_pairs for norm in pair],
            head_eps=[0.0 if norm is None else norm.eps for pair in head_pairs for norm in pair],
            heads=heads,
            kv_heads=kv_heads,
            scaling=scaling,
            biases=biases if any(bias is not None for bias in biases) else [],
            routers=[experts.router for experts in mixtures],
            router_biases=router_biases if any(bias is not None for bias in router_biases) else [],
            mixture=ops.extension.Mixture(*(mixtures[0].routing if mixtures else NO_MIXTURE)),
            form=form,
            rows_below=min((p.many_rows_from() for p in projections), default=math.inf),
            conv_states=[NO_CONVOLUTION if conv is None else conv.states for conv in convolutions],
            conv_weights=[NO_CONVOLUTION if conv is None else conv.weight for conv in convolutions],
            conv_biases=conv_biases if any(bias is not None for bias in conv_biases) else [],
        )

    def __call__(
        self,
        hidden: torch.Tensor,  # [queries, hidden]: the step's embeddings, its own (written into)
        cos: list[torch.Tensor],  # each rotation's, [queries, 1, head_dim]
        sin: list[torch.Tensor],
        slots: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        query_scales: torch.Tensor | None = None,  # [queries]: Ministral 3's factor of each rotated query
    ) -> torch.Tensor:
        return self.run(
            hidden,
            cos,
            sin,
            slots,
            rows,
            positions,
            keys,
            values,
            self.projections,
            self.bits,
            self.tables,
            self.calls,
            self.norms,
            self.eps,
            self.head_norms,
            self.head_eps,
            self.heads,
            self.kv_heads,
            self.scaling,
            self.biases,
            self.routers,
            self.router_biases,
            self.mixture,
            self.form.rotations,
            self.form.windows,
            self.form.sinks,
            self.form.sandwich,
            self.form.gelu,
            self.form.squared_relu,
            self.form.residual,
            self.form.softcap,
            self.form.interleaved,
            self.form.centered,
            self.form.parallel,
            NO_SCALES if query_scales is None else query_scales,
            self.conv_states,
            self.conv_weights,
            self.conv_biases,
        )
