"""Group-wise int4 checkpoints, GPTQ's and AWQ's, repacked once at load into the engine's 4-bit weights.

A "-GPTQ-Int4" or "-AWQ" repository keeps, for each quantized linear layer,
its 4-bit values and a scale and zero point for every `group_size` inputs
of an output channel (128 mostly):

    w = scale * (q - z), q and z in 0..15

    GPTQ: qweight int32 [in / 8, out], eight q of one output down the inputs, value k at bits 4k;
          qzeros int32 [groups, out / 8], eight z along the outputs; scales fp16 [groups, out];
          g_idx int32 [in], each input's group. Its first format ("gptq", most checkpoints)
          stores each qzeros word less 0x11111111 (every z less one, borrows and all), which
          GPTQModel adds back on loading; "gptq_v2" stores z.
    AWQ ("gemm"): qweight int32 [in, out / 8] and qzeros int32 [groups, out / 8], eight values along
          the outputs in the order 0 2 4 6 1 3 5 7; scales fp16 [groups, out].

transformers reads neither without GPTQModel or AutoAWQ, which build CUDA
kernels; this module reads the tensors itself. In Int4Linear's terms (w =
(q - 8) * scale + zero, a scale a block of 32 inputs) each group is
group_size / 32 blocks with its scale and zero = (8 - z) * scale: the same
weights, exactly in float32 (the CPU's blocks keep z * scale in fp16:
exact for symmetric checkpoints, where z is 8; within 2^-11 of it
otherwise). The model itself is built from the dequantized weights, in
the start's dtype (the exact mode's float32 is the reference), which are
the dense copy for many rows, as a GGUF file's are.

GPTQ's act-order checkpoints (`desc_act`, as many published "-GPTQ"
repositories were quantized) number each input's group in g_idx in the
order of the inputs' importance, so 32 consecutive inputs fall in several groups and
share no scale: such a layer cannot be the engine's 4-bit blocks. It is
converted once, from the weights the library dequantizes (scales[g_idx] *
(q - z[g_idx]), in float32), to 8-bit blocks of 32 where the CPU multiplies
blocks (a byte a weight, within half a step of 1/127 of each block's
largest weight), else served as those dequantized floats; the log says how
many.

Refused, with the reason: other bit widths, groups that are no whole
number of 32 inputs, and other packings (AWQ's "gemv", GPTQ's "marlin").
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from backend.quant import block_weights
from backend.quant.gguf_types import BLOCK, FourBitWeight, requantize_int8
from backend.quant.quantized_linear import Int4Linear, Int8Linear, fits_int4_kernels, replace_module

log = logging.getLogger(__name__)

METHODS = ("gptq", "awq")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the output within each 8 that nibble i holds
AWQ_REVERSE_ORDER = [AWQ_ORDER.index(column) for column in range(8)]
PARTS = ("qweight", "qzeros", "scales", "g_idx")


class UnsupportedCheckpoint(ValueError):
    """A quantized checkpoint this server does not serve; the message says why."""


@dataclass(frozen=True)
class ActOrderLayer:
    """A layer quantized in act order: input i's scale and zero are those of group g_idx[i]."""

    q: torch.Tensor  # [in, out] uint8, 0..15
    scales: torch.Tensor  # [groups, out] float32
    zeros: torch.Tensor  # [groups, out] float32, z
    g_idx: torch.Tensor  # [in] int64

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [out, in] as GPTQModel's dequantize_weight gives them."""
        weights = self.scales[self.g_idx] * (self.q.float() - self.zeros[self.g_idx])
        return weights.T.contiguous()


@dataclass(frozen=True)
class GroupWiseFormat:
    method: str  # "gptq" or "awq"
    group_size: int  # inputs a scale and zero cover; 0: all of a layer's (one group a channel)
    zeros_less_one: bool  # GPTQ's first format: each qzeros word is stored less 0x11111111


def checkpoint_format(quantization_config: dict | None) -> GroupWiseFormat | None:
    """The format of a checkpoint whose config.json has this `quantization_config`: None where it is no
    GPTQ or AWQ checkpoint; UnsupportedCheckpoint where it is one this module does not read."""
    if not quantization_config or quantization_config.get("quant_method") not in METHODS:
        return None
    method = quantization_config["quant_method"]
    bits = quantization_config.get("bits", quantization_config.get("w_bit"))
    if bits != 4:
        raise UnsupportedCheckpoint(
            f"a {method.upper()} checkpoint of {bits} bits: only 4-bit ones are served"
        )
    group_size = quantization_config.get("group_size", quantization_config.get("q_group_size", 128))
    if group_size == -1:
        group_size = 0
    elif group_size % BLOCK:
        raise UnsupportedCheckpoint(
            f"{method.upper()} groups of {group_size} inputs: the engine's blocks are 32 inputs, so "
            "groups must be a multiple of 32"
        )
    if method == "awq":
        version = str(quantization_config.get("version", "gemm")).lower()
        if version != "gemm" or quantization_config.get("zero_point", True) is not True:
            raise UnsupportedCheckpoint(
                f"an AWQ checkpoint packed as {version!r} (zero points: "
                f"{quantization_config.get('zero_point', True)}): only AutoAWQ's GEMM packing is read"
            )
        return GroupWiseFormat("awq", group_size, False)
    packing = quantization_config.get("checkpoint_format", "gptq")
    if packing not in ("gptq", "gptq_v2"):
        raise UnsupportedCheckpoint(
            f"a GPTQ checkpoint packed as {packing!r}: only 'gptq' and 'gptq_v2' are read"
        )
    return GroupWiseFormat("gptq", group_size, packing == "gptq")


def unpack_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 [n, m] of eight 4-bit values each, value k at bits 4k, to uint8 values: [8n, m] down `dim`
    0 (value k of row i is row 8i + k), [n, 8m] along `dim` 1."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    if dim == 0:
        values = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
        return values.reshape(-1, packed.shape[1]).to(torch.uint8)
    values = (packed[:, :, None] >> shifts[None, None, :]) & 0xF
    return values.reshape(packed.shape[0], -1).to(torch.uint8)


def awq_columns(values: torch.Tensor) -> torch.Tensor:
    """[n, 8m] nibbles in AWQ's order to the outputs' own."""
    return values.reshape(values.shape[0], -1, 8)[:, :, AWQ_REVERSE_ORDER].reshape(values.shape)


def unpack_layer(
    tensors: dict[str, torch.Tensor], fmt: GroupWiseFormat, name: str
) -> FourBitWeight | ActOrderLayer:
    """One layer's `qweight`, `qzeros`, `scales` (and GPTQ's `g_idx`) as Int4Linear's q, scale and zero
    a block of 32 inputs; an ActOrderLayer where g_idx puts inputs in other groups than consecutive ones."""
    scales = tensors["scales"].float()  # [groups, out]
    out_features = scales.shape[1]
    qzeros = tensors["qzeros"]
    if fmt.zeros_less_one:  # as GPTQModel's convert_gptq_v1_to_v2_format: the words, modulo 2^32
        qzeros = ((qzeros.to(torch.int64) + 0x11111111) & 0xFFFFFFFF).to(torch.uint32).view(torch.int32)
    if fmt.method == "gptq":
        q = unpack_nibbles(tensors["qweight"], dim=0)  # [in, out]
        zeros = unpack_nibbles(qzeros, dim=1)[:, :out_features]
    else:
        q = awq_columns(unpack_nibbles(tensors["qweight"], dim=1))
        zeros = awq_columns(unpack_nibbles(qzeros, dim=1))[:, :out_features]
    in_features = q.shape[0]
    group_size = fmt.group_size or in_features
    if in_features % BLOCK or in_features % group_size or scales.shape[0] != in_features // group_size:
        raise UnsupportedCheckpoint(
            f"{name}: {in_features} inputs in {scales.shape[0]} groups of {group_size}: not whole blocks "
            "of 32"
        )
    groups = torch.arange(in_features, dtype=torch.int32) // group_size
    z = zeros.float()
    if "g_idx" in tensors and not torch.equal(tensors["g_idx"].to(torch.int32), groups):
        g_idx = tensors["g_idx"].to(torch.int64)
        if g_idx.shape != (in_features,) or g_idx.min() < 0 or g_idx.max() >= scales.shape[0]:
            raise UnsupportedCheckpoint(
                f"{name}: g_idx of shape {tuple(g_idx.shape)} and groups {g_idx.min()}..{g_idx.max()} "
                f"for {in_features} inputs in {scales.shape[0]} groups"
            )
        return ActOrderLayer(q, scales, z, g_idx)
    blocks_per_group = group_size // BLOCK
    scale = scales.repeat_interleave(blocks_per_group, dim=0).T.contiguous()  # [out, in / 32]
    zero = ((8 - z) * scales).repeat_interleave(blocks_per_group, dim=0).T.contiguous()
    return FourBitWeight(q.T.contiguous(), scale, zero)


def dequantize(weight: FourBitWeight | ActOrderLayer) -> torch.Tensor:
    """The float32 weights [out, in] a layer's q, scale and zero hold."""
    if isinstance(weight, ActOrderLayer):
        return weight.dequantize()
    blocks = (weight.q.float() - 8).reshape(weight.q.shape[0], -1, BLOCK) * weight.scale[..., None]
    return (blocks + weight.zero[..., None]).reshape(weight.q.shape)


def checkpoint_files(location: str) -> list[Path]:
    directory = Path(location)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / shard for shard in shards]
    return sorted(directory.glob("*.safetensors"))


def read_checkpoint(
    location: str, fmt: GroupWiseFormat, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, FourBitWeight | ActOrderLayer]]:
    """The checkpoint's state dict with each quantized layer's weight dequantized to `dtype` (what the
    model is built from), and those layers' 4-bit weights by module name."""
    state_dict: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for path in checkpoint_files(location):
        with safe_open(path, framework="pt") as file:
            for key in file.keys():  # noqa: SIM118 (a safetensors file is no dict)
                module, _, part = key.rpartition(".")
                if part in PARTS:
                    parts.setdefault(module, {})[part] = file.get_tensor(key)
                else:
                    state_dict[key] = file.get_tensor(key)
    layers = {}
    for module, tensors in parts.items():
        layers[module] = unpack_layer(tensors, fmt, module)
        state_dict[f"{module}.weight"] = dequantize(layers[module]).to(dtype)
    return state_dict, layers


def serve_group_wise(
    model: nn.Module, layers: dict[str, FourBitWeight | ActOrderLayer], fmt: GroupWiseFormat
) -> int:
    """Replace each quantized layer by an Int4Linear of the checkpoint's own values (an act-order one by
    8-bit blocks converted from its dequantized weights, where the CPU has blocks), its dequantized
    weights the dense copy for many rows. Returns how many layers are served quantized."""
    repacked = converted = 0
    for name, weight in layers.items():
        linear = model.get_submodule(name)
        if not fits_int4_kernels(linear):  # outputs no whole tile of 16: its dequantized floats serve
            continue
        device = linear.weight.device
        dense = linear.weight.detach()
        if isinstance(weight, ActOrderLayer):
            if not block_weights.available(device):
                continue
            eight_bit = requantize_int8(weight.dequantize().numpy())
            replace_module(model, name, Int8Linear(eight_bit.q, eight_bit.scale, linear.bias, dense=dense))
            converted += 1
            continue
        q, scale, zero = (t.to(device) for t in (weight.q, weight.scale, weight.zero))
        replace_module(model, name, Int4Linear(q, scale, zero, linear.bias, dense=dense))
        repacked += 1
    act_order = (
        f"{converted} in act order (groups permuted by g_idx) converted once to 8-bit blocks of 32, "
        if converted
        else ""
    )
    log.info(
        "%s checkpoint: %d linear layers repacked into 4-bit blocks of 32 inputs (groups of %s), %stheir "
        "dequantized weights kept for many rows; %d served as dequantized floats",
        fmt.method.upper(),
        repacked,
        fmt.group_size or "a whole channel",
        act_order,
        len(layers) - repacked - converted,
    )
    return repacked + converted
