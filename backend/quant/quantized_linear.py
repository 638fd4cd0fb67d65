"""Weight-only quantized linear layers: 4-bit group-wise and 8-bit per channel, on CPU and CUDA, and
GGUF's 5-bit blocks and K-quants' super-blocks on a CPU.

A decode step with few rows is bound by reading the weights, and these
layers read a quarter (int4) or half (int8) of what bfloat16 weights take.
On a CPU with AVX-512 VNNI or AVX2 they are stored in blocks that
`block_weights.matmul` multiplies by int8 dot products, as llama.cpp does
(block_weights.py says why: PyTorch's kernels ran at half the memory's
speed there);
elsewhere through PyTorch's own weight-only kernels
(`_weight_int4pack_mm_for_cpu` and `_weight_int4pack_mm`,
`_weight_int8pack_mm`). The activations stay floats between layers.

    int4: w = (q - 8) * scale + zero, q in 0..15, one (scale, zero) per group
          of 32 inputs of an output channel: exactly GGUF's Q4_0 and Q4_1
          blocks (see gguf_weights.py), or a float weight quantized here.
    int8: w = q * scale, q in -127..127, one scale per output channel, or
          in blocks one per group of 32 inputs (GGUF's Q8_0).

Measured on this project's CI machine (2-core Xeon with AMX; all of
SmolLM2's projections, docs/performance.md), PyTorch's kernels:

- The CPU kernels want bfloat16 activations: with float32 ones they take a
  path about 20 times slower (87 ms against 4.5 at one row), so a float32
  model computes these layers in bfloat16 and gets float32 back.
- Their cost grows with the rows multiplied: int4 takes 4.5 ms at 1 row,
  13 at 8, 23 at 16 and 43 at 32, where dense bfloat16 takes 20, 21, 22 and
  23 (one pass over the weights, multiplied by AMX). So on the CPU a layer
  also keeps its weights dense, in the model's dtype, and a forward pass of
  `dense_from_rows` rows or more (a full decode batch, any real prefill)
  multiplies by those instead. The copy costs memory (2 bytes a weight in
  bfloat16 against half a byte packed), but without it a 500-token prefill
  would take seconds.
- Where the CPU multiplies bfloat16 slowly (no AMX), int8 activations times
  int8 weights are faster still from 16 rows: the loader replaces the dense
  copies by those (`smoothed_int8.py`).

Blocks cost less a row (on the 2-core AMD EPYC without AMX they beat the
int8 path up to about 128 rows), so the loader times from how many rows the
path for many rows pays on the machine it runs on
(calibration.time_projection_crossover).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from backend.quant import block_weights
from backend.quant.blocks_embedding import BlocksEmbedding
from backend.quant.fp8_linear import Fp8Layer
from backend.quant.smoothed_int8 import smoothed_int8_matmul

if TYPE_CHECKING:
    from backend.quant.gguf_types import InBlocksWeight

GROUP_SIZE = 32  # GGUF's block size, and the finest group the kernels take

# From this many rows a CPU multiplies faster by the dense bfloat16 copy than by packed int4 weights.
DENSE_FROM_ROWS = 16


class WeightOnlyLinear(nn.Module):
    """What int4 and int8 layers share: bfloat16 activations, and the dense copy for many rows."""

    in_features: int
    out_features: int
    compute_dtype = torch.bfloat16
    dense_from_rows = DENSE_FROM_ROWS
    # The buffers that hold one slice per output channel, by the dimension those slices stack in
    # (how `fuse_linears` joins layers), and those that parts over one input share.
    output_dims: dict[str, int] = {"dense": 0, "dense_int8": 0, "dense_scales": 0, "blocks": 0}
    shared_buffers = ("smoothing",)
    # What a pass of dense_from_rows rows or more multiplies by (the dense copy, or its int8 path)
    many_rows_buffers = ("dense", "dense_int8", "dense_scales", "smoothing")
    # Where a lean load let go of the dense copy: the dtype it is made in from the blocks when asked for
    # (`dense_weight`), until the loader keeps it or drops it.
    dense_on_demand: torch.dtype | None = None

    def __init__(self, bias: torch.Tensor | None, dense: torch.Tensor | None):
        super().__init__()
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        keep = dense is not None and dense.device.type == "cpu"
        self.register_buffer("dense", dense.detach() if keep else None, persistent=False)
        # The int8 path for many rows (smoothed_int8.py), where the loader calibrated one.
        self.register_buffer("dense_int8", None, persistent=False)
        self.register_buffer("dense_scales", None, persistent=False)
        self.register_buffer("smoothing", None, persistent=False)

    def make_dense_on_demand(self, dtype: torch.dtype) -> None:
        """Hold no dense copy, but make one from the blocks (exactly their weights, in `dtype`) each time one
        is asked for, until `keep_dense` or `drop_dense`: so that a GGUF file's load never holds every
        layer's copy at once (gguf_weights.serve_gguf_weights)."""
        if getattr(self, "blocks", None) is None:
            raise ValueError("only a layer of blocks makes its dense copy on demand")
        self.dense, self.dense_on_demand = None, dtype

    @property
    def has_dense(self) -> bool:
        """Whether this layer has a dense copy for many rows, kept or made on demand."""
        return self.dense is not None or self.dense_on_demand is not None

    def dense_weight(self) -> torch.Tensor:
        """The dense copy: the one kept, else one made from the blocks now (not kept)."""
        if self.dense is not None:
            return self.dense
        if self.dense_on_demand is None:
            raise ValueError("this layer has no dense copy")
        return block_weights.dense_copy(
            self.blocks, self.in_features, self.dense_on_demand, self.blocks_layout.table
        )

    def keep_dense(self) -> None:
        """Keep the dense copy made on demand from now on (the loader chose it for many rows)."""
        if self.dense is None and self.dense_on_demand is not None:
            self.dense = self.dense_weight()
        self.dense_on_demand = None

    def drop_dense(self) -> None:
        self.dense, self.dense_on_demand = None, None

    def uses_blocks(self, device: torch.device) -> bool:
        """Whether this layer's weights are stored in blocks for `block_weights.matmul` (a CPU with
        AVX-512 VNNI or AVX2), or else packed for PyTorch's kernels."""
        return block_weights.available(device) and block_weights.fits(self.out_features, self.in_features)

    def use_smoothed_int8(
        self, weight_int8: torch.Tensor, scales: torch.Tensor, smoothing: torch.Tensor
    ) -> None:
        """Multiply many rows by these int8 weights (of W * s; s = 1 / smoothing), not the dense copy."""
        self.dense_int8, self.dense_scales, self.smoothing = weight_int8, scales, smoothing
        self.drop_dense()

    def can_be_followed(self) -> bool:
        """Whether another layer's weights may follow this one's in a fused layer (`fuse_linears`)."""
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        few_rows = x.dim() == 2 and x.shape[0] < self.dense_from_rows and x.is_contiguous()
        if few_rows and x.dtype == self.compute_dtype:  # a decode step's few rows: no reshapes, no casts
            out = self.packed_matmul(x)
            return out if self.bias is None else out + self.bias
        flat = x.reshape(-1, self.in_features)
        if self.takes_many_rows_path(flat.shape[0]):
            out = self.many_rows_matmul(flat)
        else:
            # (the kernels read rows in place: Jamba's Mamba mixer hands its out_proj a transposed view)
            out = self.packed_matmul(flat.to(self.compute_dtype).contiguous())
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    @property
    def has_many_rows_path(self) -> bool:
        return self.has_dense or self.dense_int8 is not None

    def many_rows_from(self) -> float:
        """From how many rows a pass multiplies by the path for many rows (the dense copy or its int8
        path) rather than the packed weights (inf: never): the one rule `forward`, `few_rows_matmul`
        and the step plan (model/step_plan.py) read."""
        return self.dense_from_rows if self.has_many_rows_path else float("inf")

    def takes_many_rows_path(self, rows: int) -> bool:
        return rows >= self.many_rows_from()

    def path_at(self, rows: int) -> str:
        """What multiplies a pass of this many rows, as the step plan's log names it."""
        if self.takes_many_rows_path(rows):
            return (
                "int8, smoothed"
                if self.dense_int8 is not None
                else f"dense {dtype_name(self.dense.dtype)} copy"
            )
        if getattr(self, "blocks", None) is not None:
            return f"{self.layout()} ({block_weights.kernel(self.blocks.device)})"
        return f"PyTorch's int{self.bits} kernel"

    def layout(self) -> str:
        """How the packed weights are kept, as the logs name it."""
        return f"{self.bits}-bit blocks"

    def many_rows_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, in] @ W.T by the path for many rows: the int8 path where the loader calibrated one,
        else the dense copy; in x's dtype or the copy's."""
        if self.dense_int8 is not None:
            return smoothed_int8_matmul(x, self.dense_int8, self.dense_scales, self.smoothing, x.dtype)
        dense = self.dense_weight()
        return torch.nn.functional.linear(x.to(dense.dtype), dense)

    def packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        kernel, weights = self.kernel()
        return kernel(x, *weights)

    def kernel(self) -> tuple[Callable, tuple]:
        """The packed weights' kernel and what it takes after the activations."""
        raise NotImplementedError

    def few_rows_matmul(self, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        """This layer as one function of a decode step's [rows, in] activations in `dtype`, giving
        `dtype` back: the kernel with its weights bound between the two casts `forward` makes. At one
        row on a CPU, the module call and the checks and reshapes of `forward` cost about half what a
        small layer's kernel does (docs/performance.md). Many rows still go through `forward`, which
        multiplies them by the dense copy."""
        if self.bias is not None:
            return self
        kernel, weights = self.kernel()
        compute_dtype, many_rows_from = self.compute_dtype, self.many_rows_from()

        def matmul(x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] >= many_rows_from:
                return self(x)
            return kernel(x.to(compute_dtype), *weights).to(dtype)

        return matmul


class Int4Linear(WeightOnlyLinear):
    """`nn.Linear` with 4-bit weights in groups of GROUP_SIZE inputs, each group its scale and zero."""

    bits = 4
    blocks_layout = block_weights.Layout(4)  # where it keeps blocks
    output_dims = {**WeightOnlyLinear.output_dims, "packed": 0, "scales_and_zeros": 1}

    def can_be_followed(self) -> bool:
        """Whether another layer's packed weights may follow this one's in a fused layer: PyTorch's
        kernels pack output channels in tiles (64 on the CPU, 8 on CUDA), and a layer that ends inside
        one would be packed differently in the joined layer. Blocks hold 16 channels, as every layer has."""
        if self.blocks is not None:
            return True
        return self.out_features % (64 if self.packed.device.type == "cpu" else 8) == 0

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        bias: torch.Tensor | None,
        dense: torch.Tensor | None = None,
    ):
        """q: [out, in] integers 0..15; scale, zero: [out, in / GROUP_SIZE]; w = (q - 8) * scale + zero.
        dense: the same weights as floats, kept on the CPU for many rows (None: bfloat16 made from these)."""
        if dense is None and q.device.type == "cpu":
            dense = dequantize_int4(q, scale, zero).to(self.compute_dtype)
        super().__init__(bias, dense)
        self.out_features, self.in_features = q.shape
        if self.uses_blocks(q.device):
            self.register_buffer("blocks", block_weights.pack_int4(q, scale, zero), persistent=False)
            self.register_buffer("packed", None, persistent=False)
            self.register_buffer("scales_and_zeros", None, persistent=False)
            return
        self.register_buffer("blocks", None, persistent=False)
        self.register_buffer("packed", pack_int4(q.to(torch.int32), q.device), persistent=False)
        # The kernels' layout: [in / GROUP_SIZE, out, 2], (scale, zero) last.
        scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(self.compute_dtype), persistent=False)

    @classmethod
    def quantize(cls, linear: nn.Linear) -> Int4Linear:
        """Round a float layer's weights to 4 bits, asymmetric per group (min and max kept exactly)."""
        weight = linear.weight.detach().float()
        groups = weight.reshape(weight.shape[0], -1, GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).reshape(weight.shape)
        zero = low + 8 * scale
        dense = (
            dequantize_int4(q, scale, zero).to(linear.weight.dtype) if weight.device.type == "cpu" else None
        )
        return cls(q, scale, zero, linear.bias, dense)

    def kernel(self) -> tuple[Callable, tuple]:
        if self.blocks is not None:
            return block_weights.matmul, (self.blocks, 4)
        on_cpu = self.packed.device.type == "cpu"
        kernel = torch.ops.aten._weight_int4pack_mm_for_cpu if on_cpu else torch.ops.aten._weight_int4pack_mm
        return kernel.default, (self.packed, GROUP_SIZE, self.scales_and_zeros)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4, group {GROUP_SIZE}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    groups = (q.float() - 8).reshape(q.shape[0], -1, GROUP_SIZE) * scale[..., None] + zero[..., None]
    return groups.reshape(q.shape)


def pack_int4(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[out, in] values 0..15 in the layout of the device's int4 kernel."""
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    # CUDA takes two values a byte, the even input in the high nibble, and tiles of in/16 columns.
    pairs = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
    inner_k_tiles = next(t for t in (8, 4, 2) if (q.shape[1] // 16) % t == 0)
    return torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles)


QUANTIZE_ROWS = 4096  # output channels quantized at once (`Int8Linear.quantize`)


class Int8Linear(WeightOnlyLinear):
    """`nn.Linear` with 8-bit symmetric weights, one scale per output channel (or, in blocks, per block
    of 32 inputs of one: GGUF's Q8_0)."""

    # The int8 kernel costs twice int4's a row: SmolLM2's head takes 1.6 ms at 4 rows and 3.3 at 8
    # against 2.4 and 2.2 for bfloat16. Against a float32 copy (AVX2) it wins up to 32-48 rows, so the
    # loader times a head's own switch (calibration.time_head_crossover); this is the default.
    dense_from_rows = 6
    bits = 8
    blocks_layout = block_weights.Layout(8)  # where it keeps blocks
    output_dims = {**WeightOnlyLinear.output_dims, "weight_int8": 0, "scales": 0}

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        dense: torch.Tensor | None = None,
    ):
        """q: [out, in] int8; scale: [out], or [out, in / GROUP_SIZE] where the layer is stored in blocks;
        w = q * scale. dense: as for Int4Linear."""
        if dense is None and q.device.type == "cpu":
            dense = dequantize_int8(q, scale).to(self.compute_dtype)
        super().__init__(bias, dense)
        self.out_features, self.in_features = q.shape
        if self.uses_blocks(q.device):
            self.register_buffer("blocks", block_weights.pack_int8(q, scale), persistent=False)
            self.register_buffer("weight_int8", None, persistent=False)
            self.register_buffer("scales", None, persistent=False)
            return
        if scale.dim() != 1:
            raise ValueError("PyTorch's int8 kernel takes one scale per output channel, not one per block")
        self.register_buffer("blocks", None, persistent=False)
        self.register_buffer("weight_int8", q.to(torch.int8).contiguous(), persistent=False)
        self.register_buffer("scales", scale.to(self.compute_dtype), persistent=False)

    @classmethod
    def quantize(cls, linear: nn.Linear, dense: torch.Tensor | None = None) -> Int8Linear:
        """Round a float layer's weights to int8, symmetric with a scale a channel, QUANTIZE_ROWS channels
        at a time: all at once, a layer's float32 temporaries were several times its float32 size, and
        `--quantize int8` of a 1B peaked 0.8-1.1 GiB higher, at its 49,152 x 2,048 head."""
        weight = linear.weight.detach()
        q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
        scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
        copy = dense is None and weight.device.type == "cpu"  # only the CPU keeps a dense copy
        dense = torch.empty_like(weight) if copy else dense
        for start in range(0, weight.shape[0], QUANTIZE_ROWS):
            rows = slice(start, start + QUANTIZE_ROWS)
            floats = weight[rows].float()
            scale[rows] = (floats.abs().amax(dim=-1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
            rounded = (floats / scale[rows, None]).round().clamp(-127, 127)
            q[rows] = rounded
            if copy:
                dense[rows] = rounded * scale[rows, None]
        return cls(q, scale, linear.bias, dense)

    def kernel(self) -> tuple[Callable, tuple]:
        if self.blocks is not None:
            return block_weights.matmul, (self.blocks, 8)
        return torch.ops.aten._weight_int8pack_mm.default, (self.weight_int8, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


class BlocksLinear(WeightOnlyLinear):
    """`nn.Linear` with weights of a GGUF type only the CPU's blocks take (block_weights.py): the
    K-quants' super-blocks (Q4_K, Q5_K, Q6_K), IQ4_NL's, IQ4_XS's and MXFP4's table blocks, the symmetric
    blocks of Q4_0 and Q5_0, and the 5-bit blocks of Q5_1. PyTorch has no kernel for these: elsewhere
    (CUDA, no AVX2) gguf_weights.served_layer serves Q4_K and Q4_0 as int4 groups and the rest as int8 a
    channel."""

    dense_from_rows = 6  # as 8-bit blocks (Int8Linear), until timed (calibration.time_head_crossover)

    def __init__(
        self,
        blocks: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None,
        dense: torch.Tensor | None = None,
        table: block_weights.Table = block_weights.Table.NONE,
    ):
        """blocks: [out, bytes a channel] of `in_features` inputs, in either of block_weights.py's layouts
        (`table`: whose values their indices pick); dense: the same weights as floats, kept on the CPU for
        many rows (None: bfloat16 made from the blocks)."""
        if dense is None:
            dense = block_weights.dequantize(blocks, in_features, table).to(self.compute_dtype)
        super().__init__(bias, dense)
        self.blocks_layout = block_weights.layout_of(blocks, in_features, table)
        self.out_features, self.in_features = blocks.shape[0], in_features
        self.register_buffer("blocks", blocks, persistent=False)

    @property
    def bits(self) -> int:
        return self.blocks_layout.bits

    @property
    def super_blocks(self) -> bool:
        return self.blocks_layout.super_blocks

    @staticmethod
    def takes(shape: torch.Size, device: torch.device) -> bool:
        """Whether a layer of this [out, in] shape on `device` can be one (the CPU multiplies blocks)."""
        return block_weights.available(device) and block_weights.fits(*shape)

    @classmethod
    def int6(
        cls,
        q: torch.Tensor,
        sub_scale: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        dense: torch.Tensor | None = None,
    ) -> BlocksLinear:
        """w = scale * sub_scale * (q - 32): q [out, in] 0..63, sub_scale [out, in / 16] int8, scale [out,
        in / 32], in blocks of 32."""
        return cls(block_weights.pack_int6(q, sub_scale, scale), q.shape[1], bias, dense)

    @classmethod
    def of(
        cls, weight: InBlocksWeight, bias: torch.Tensor | None = None, dense: torch.Tensor | None = None
    ) -> BlocksLinear:
        """A GGUF weight that only blocks take as it is (the K-quants' super-blocks, IQ4's and MXFP4's
        tables, Q4_0's and Q5_0's symmetric blocks): exactly its weights."""
        return cls(weight.blocks(), weight.q.shape[1], bias, dense, weight.table)

    @classmethod
    def int5(
        cls,
        q: torch.Tensor,
        scale: torch.Tensor,
        minimum: torch.Tensor,
        bias: torch.Tensor | None = None,
        dense: torch.Tensor | None = None,
    ) -> BlocksLinear:
        """w = scale * q + minimum (Q5_1, and Q5_K per block): q [out, in] 0..31, scale and minimum [out,
        in / 32]."""
        return cls(block_weights.pack_int5(q, scale, minimum), q.shape[1], bias, dense)

    def kernel(self) -> tuple[Callable, tuple]:
        return block_weights.matmul, (self.blocks, self.bits, self.blocks_layout.table)

    def layout(self) -> str:
        return self.blocks_layout.name()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.layout()}"


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w = q * scale, with a scale per channel ([out]) or per block of GROUP_SIZE ([out, in / GROUP_SIZE])."""
    blocks = q.float().reshape(q.shape[0], -1, GROUP_SIZE if scale.dim() == 2 else q.shape[1])
    return (blocks * scale.float().reshape(q.shape[0], -1, 1)).reshape(q.shape)


def fuse_linears(parts: list[nn.Module]) -> WeightOnlyLinear | None:
    """One layer whose output is the parts' outputs side by side (q, k and v; gate and up), so that a
    step makes one kernel call where it made several; None unless all parts are weight-only layers
    of one kind over the same input.

    Each kernel call has a fixed cost that is most of a small layer's time at one row (docs/
    performance.md). The parts keep working, on views of the fused weights where those are
    contiguous slices of them, so the weights are not stored twice; only the small scales are.
    """
    if not fusable(parts):
        return None
    biases = [part.bias for part in parts]
    fused = bare_like(parts[0], sum(part.out_features for part in parts), biases)
    for name, dim in fused.output_dims.items():
        tensors = [getattr(part, name) for part in parts]
        if tensors[0] is None:
            fused.register_buffer(name, None, persistent=False)
            continue
        joined = torch.cat(tensors, dim=dim)
        fused.register_buffer(name, joined, persistent=False)
        if dim == 0:  # each part's rows are a contiguous slice of the joined tensor
            for part, piece in zip(parts, joined.split([t.shape[0] for t in tensors]), strict=True):
                setattr(part, name, piece)
    return fused


def first_outputs(layer: WeightOnlyLinear, count: int) -> WeightOnlyLinear:
    """A layer of `layer`'s first `count` outputs (a multiple of 16), on views of its weights: what
    calibration times where the whole layer would take long; one made on demand makes its dense copy so."""
    part = bare_like(layer, count, [None if layer.bias is None else layer.bias[:count]])
    part.dense_on_demand = layer.dense_on_demand
    for name, dim in layer.output_dims.items():
        tensor = getattr(layer, name)
        part.register_buffer(name, None if tensor is None else tensor.narrow(dim, 0, count), persistent=False)
    return part


def bare_like(first: WeightOnlyLinear, out_features: int, biases: list) -> WeightOnlyLinear:
    """A layer of `first`'s kind over its inputs, with `out_features` outputs, the biases joined and
    the buffers its parts share, its own weights still to set; from as many rows on its many-rows path."""
    layer = type(first).__new__(type(first))
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = first.in_features, out_features
    layer.dense_from_rows = first.dense_from_rows
    if isinstance(first, BlocksLinear):  # (the others' bits are their class's)
        layer.blocks_layout = first.blocks_layout
    layer.bias = None if biases[0] is None else nn.Parameter(torch.cat(biases), requires_grad=False)
    for name in first.shared_buffers:
        layer.register_buffer(name, getattr(first, name), persistent=False)
    return layer


def fusable(parts: list[nn.Module]) -> bool:
    """Weight-only layers of one kind over one input, with biases all or none, packed so that each
    part's weights may follow the one before, and equal in what they share (smoothed_int8.py)."""
    first = parts[0]
    return (
        isinstance(first, WeightOnlyLinear)
        and all(
            type(part) is type(first)
            # BlocksLinear's layouts differ (the others' bits are their class's)
            and getattr(part, "blocks_layout", None) == getattr(first, "blocks_layout", None)
            and part.in_features == first.in_features
            and (part.bias is None) == (first.bias is None)
            for part in parts
        )
        and all(part.can_be_followed() for part in parts[:-1])
        and all(
            same_tensor(getattr(part, name), getattr(first, name))
            for part in parts
            for name in first.shared_buffers
        )
    )


def same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


QUANTIZERS = {"int4": Int4Linear.quantize, "int8": Int8Linear.quantize}


def quantizable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The model's linear layers that weight-only kernels can take, but the output head (see
    quantize_head) and any whose shape the kernels do not take."""
    head = model.get_output_embeddings()
    return {
        name: module
        for name, module in model.named_modules()
        if type(module) is nn.Linear and module is not head and fits_int4_kernels(module)
    }


def fits_int4_kernels(linear: nn.Linear) -> bool:
    """The kernels take inputs in whole groups and outputs in tiles of 16."""
    return linear.in_features % GROUP_SIZE == 0 and linear.out_features % 16 == 0


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def quantize_head(model: nn.Module) -> int:
    """The output head in int8, one scale per vocabulary entry, for the steps of few rows.

    It is the largest matrix of a small model (SmolLM2: 28 of 135 M weights),
    and bfloat16 multiplies it slowly at one row (3.6 ms here against 0.9 in
    int8). Its float weights stay as the dense copy for many rows; when
    they are tied to the input embedding, as they often are, that costs
    nothing. Returns 1 if the head was replaced, 0 if its shape does not fit.
    """
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or not fits_int4_kernels(head):
        return 0
    name = next(name for name, module in model.named_modules() if module is head)
    replace_module(model, name, Int8Linear.quantize(head, dense=head.weight.detach()))
    return 1


def resident_bytes(model: nn.Module) -> dict[str, int]:
    """The bytes the model's weights hold, by what for (for the start-up log): "quantized" (the
    weight-only and FP8 layers' own weights and scales), "copies for many rows" (their dense or int8
    copies, where kept) and "floats" (everything else: embeddings, norms, layers left as floats); an
    embedding whose rows come from blocks (`BlocksEmbedding`) holds quantized weights too. Storage shared
    by several tensors (a head tied to the embedding, a copy that is the embedding, an embedding of the
    head's blocks) counts once."""
    totals = dict.fromkeys(("quantized", "copies for many rows", "floats"), 0)
    seen = set()
    for module in model.modules():
        owned = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in owned:
            storage = tensor.untyped_storage()
            if tensor.device.type == "meta" or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            if not isinstance(module, (WeightOnlyLinear, Fp8Layer, BlocksEmbedding)) or name == "bias":
                totals["floats"] += storage.nbytes()
            elif name in getattr(module, "many_rows_buffers", ()):
                totals["copies for many rows"] += storage.nbytes()
            else:
                totals["quantized"] += storage.nbytes()
    return totals
