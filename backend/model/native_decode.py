"""A decode step's layers in one C++ call (decode_layers.cpp), where the model's step allows it.

With its weights in blocks (block_weights.py) a one-row step of the default
model on a CPU took 5.7 ms, of which the C++ work of its 30 layers was some
2.6 and Python around it, ten calls a layer through the interpreter and
pybind, about another millisecond (docs/performance.md). `decode_layers.cpp`
is `DecoderRunner.decode_layers`'s loop with the same functions in the same
order, so its numbers are the Python loop's bit for bit
(tests/backend/test_native_decode.py); it runs where every one of them is
this extension's: a CPU with the fused operations and blocks (AVX-512 VNNI or AVX2), every
projection in blocks (no biases), the attention loop for the model's head size, and
activations in the kernels' dtype (bfloat16, the default mode's); Llama's layer, with Qwen3's norms
of each query and key head where the model has them. Other steps, and other models, run the Python
loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from backend.layers.decode_ops import DecodeOps, FusedOps, Norm
from backend.quant.quantized_linear import WeightOnlyLinear


@dataclass(frozen=True)
class LayerProjections:
    """A layer's projections as a decode step calls them: q, k and v in one call where they fused, else in
    the calls of `Projections.groups` (a K-quant mix's Q4_K q and k beside its Q6_K v); o; gate and up
    likewise; down."""

    qkv: list[nn.Module]
    o: nn.Module
    gate_up: list[nn.Module]
    down: nn.Module

    def calls(self) -> list[nn.Module]:
        return [*self.qkv, self.o, *self.gate_up, self.down]


@dataclass(frozen=True)
class NativeDecode:
    """What `decode_layers.cpp` takes besides a step's tensors, gathered once for a runner."""

    run: Callable[..., torch.Tensor]  # the extension's decode_layers
    projections: list[torch.Tensor]  # each layer's qkv, o, gate_up and down blocks (`LayerProjections.calls`)
    bits: list[int]
    tables: list[int]  # the table each projection's values index (block_weights.Table), or none
    calls: list[int]  # each layer's number of calls for q, k and v, then for gate and up
    norms: list[torch.Tensor]  # the first input norm, then each layer's two: after attention, after MLP
    eps: list[float]
    head_norms: list[torch.Tensor]  # each layer's norms of its query and key heads (Qwen3's), or none
    head_eps: list[float]
    heads: int
    kv_heads: int
    scaling: float
    rows_below: float  # steps of fewer rows: from there on a projection multiplies by its many-rows path

    @classmethod
    def of(
        cls,
        ops: DecodeOps,
        layers: list[LayerProjections],
        norms: list[Norm],
        dtype: torch.dtype,
        heads: int,
        kv_heads: int,
        scaling: float,
        head_norms: list[tuple[Norm, Norm]] | None = None,
    ) -> NativeDecode | None:
        """The plan for these layers, or None where a step must run the Python loop. `head_norms`: each
        layer's norms of its query and of its key heads, where the model has them (Qwen3's)."""
        projections = [projection for layer in layers for projection in layer.calls()]
        in_blocks = all(
            isinstance(p, WeightOnlyLinear) and p.blocks is not None and p.bias is None for p in projections
        )
        if not isinstance(ops, FusedOps) or not in_blocks or dtype != WeightOnlyLinear.compute_dtype:
            return None
        return cls(
            run=ops.extension.decode_layers,
            projections=[p.blocks for p in projections],
            bits=[p.blocks_layout.bits for p in projections],
            tables=[p.blocks_layout.table for p in projections],
            calls=[count for layer in layers for count in (len(layer.qkv), len(layer.gate_up))],
            norms=[norm.weight for norm in norms],
            eps=[norm.eps for norm in norms],
            head_norms=[norm.weight for pair in head_norms or [] for norm in pair],
            head_eps=[norm.eps for pair in head_norms or [] for norm in pair],
            heads=heads,
            kv_heads=kv_heads,
            scaling=scaling,
            rows_below=min((p.many_rows_from() for p in projections), default=math.inf),
        )

    def __call__(
        self,
        hidden: torch.Tensor,  # [queries, hidden]: the step's embeddings, its own (written into)
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
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
        )
