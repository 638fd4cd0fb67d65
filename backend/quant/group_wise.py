"""Group-wise checkpoints, GPTQ's and AWQ's, repacked once at load into the engine's 4- and 8-bit blocks.

A "-GPTQ-Int4", "-GPTQ-Int8" or "-AWQ" repository keeps, for each quantized
linear layer, its 4-bit (GPTQ: or 8-bit) values and a scale and zero point
for every `group_size` inputs of an output channel (128 mostly):

    w = scale * (q - z), q and z in 0..15 (0..255 for 8 bits)

    GPTQ: qweight int32 [in / 8, out], eight q of one output down the inputs, value k at bits 4k
          (8 bits: [in / 4, out], four, value k at bits 8k); qzeros int32 [groups, out / 8], eight z
          along the outputs (8 bits: four); scales fp16 [groups, out]; g_idx int32 [in], each
          input's group. Its first format ("gptq", most checkpoints) stores each qzeros word less
          0x11111111 (0x01010101 for 8 bits: every z less one, borrows and all), which GPTQModel adds
          back on loading; "gptq_v2" stores z.
    AWQ ("gemm", 4 bits only): qweight int32 [in, out / 8] and qzeros int32 [groups, out / 8], eight
          values along the outputs in the order 0 2 4 6 1 3 5 7; scales fp16 [groups, out].

transformers reads neither without GPTQModel or AutoAWQ, which build CUDA
kernels; this module reads the tensors itself. The model is built from the
dequantized weights, in the start's dtype (the exact mode's float32 is the
reference), which are the dense copy for many rows, as a GGUF file's are.
Then each layer is:

    4-bit, groups of consecutive inputs: an Int4Linear (w = (q - 8) * scale + zero, a scale a block of
        32 inputs) of group_size / 32 blocks a group with its scale and zero = (8 - z) * scale: the
        same weights, exactly in float32 (the CPU's blocks keep z * scale in fp16: exact for
        symmetric checkpoints, where z is 8; within 2^-11 of it otherwise).
    8-bit, symmetric (every z 128), consecutive groups: an Int8Linear of the checkpoint's own q - 128
        and its fp16 scales, a block of 32 each, exactly the library's weights.
    in act order (GPTQ's `desc_act`, as many published "-GPTQ" repositories were quantized: g_idx
        numbers the inputs' groups in the order of their importance, so 32 consecutive inputs fall
        in several groups and share no scale), and 8-bit with zero points: 8-bit blocks of 32
        converted once from the weights the library dequantizes (scales[g_idx] * (q - z[g_idx]), in
        float32), a byte a weight within half a step of 1/127 of each block's largest weight.

Where the CPU has no blocks (and on a GPU) only the 4-bit layers of
consecutive groups are served quantized (PyTorch's int4 kernel); the others
are their dequantized floats. The log says how many are served each way.

Refused, with the reason: other bit widths (AWQ's 8), groups that are no
whole number of 32 inputs, a g_idx naming groups the layer has not, and
other packings (AWQ's "gemv", GPTQ's "marlin").
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from backend.quant.checkpoint_layers import described, serve_layers
from backend.quant.gguf_types import BLOCK, EightBitWeight, FourBitWeight, requantize_int8

log = logging.getLogger(__name__)

METHODS = ("gptq", "awq")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the output within each 8 that nibble i holds
AWQ_REVERSE_ORDER = [AWQ_ORDER.index(column) for column in range(8)]
PARTS = ("qweight", "qzeros", "scales", "g_idx")


class UnsupportedCheckpoint(ValueError):
    """A quantized checkpoint this server does not serve; the message says why."""


@dataclass(frozen=True)
class GroupWiseFormat:
    method: str  # "gptq" or "awq"
    bits: int  # 4, or 8 (GPTQ's)
    group_size: int  # inputs a scale and zero cover; 0: all of a layer's (one group a channel)
    zeros_less_one: bool  # GPTQ's first format: each qzeros value is stored less one

    def describe(self) -> str:
        groups = f"groups of {self.group_size}" if self.group_size else "a group a channel"
        return f"{self.bits}-bit, {groups}"


def checkpoint_format(quantization_config: dict | None) -> GroupWiseFormat | None:
    """The format of a checkpoint whose config.json has this `quantization_config`: None where it is no
    GPTQ or AWQ checkpoint; UnsupportedCheckpoint where it is one this module does not read."""
    if not quantization_config or quantization_config.get("quant_method") not in METHODS:
        return None
    method = quantization_config["quant_method"]
    bits = quantization_config.get("bits", quantization_config.get("w_bit"))
    if bits not in ((4, 8) if method == "gptq" else (4,)):
        served = "4- and 8-bit ones are" if method == "gptq" else "4-bit ones are"
        raise UnsupportedCheckpoint(f"a {method.upper()} checkpoint of {bits} bits: only {served} served")
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
        return GroupWiseFormat("awq", bits, group_size, False)
    packing = quantization_config.get("checkpoint_format", "gptq")
    if packing not in ("gptq", "gptq_v2"):
        raise UnsupportedCheckpoint(
            f"a GPTQ checkpoint packed as {packing!r}: only 'gptq' and 'gptq_v2' are read"
        )
    return GroupWiseFormat("gptq", bits, group_size, packing == "gptq")


def unpack_words(packed: torch.Tensor, dim: int, bits: int = 4) -> torch.Tensor:
    """int32 [n, m] of 32 / bits values each, value k at bits k * bits, to uint8 values: [32n / bits, m]
    down `dim` 0 (value k of row i is row (32 / bits) i + k), [n, 32m / bits] along `dim` 1."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:
        values = (packed[:, None, :] >> shifts[None, :, None]) & mask
        return values.reshape(-1, packed.shape[1]).to(torch.uint8)
    values = (packed[:, :, None] >> shifts[None, None, :]) & mask
    return values.reshape(packed.shape[0], -1).to(torch.uint8)


def awq_columns(values: torch.Tensor) -> torch.Tensor:
    """[n, 8m] nibbles in AWQ's order to the outputs' own."""
    return values.reshape(values.shape[0], -1, 8)[:, :, AWQ_REVERSE_ORDER].reshape(values.shape)


@dataclass(frozen=True)
class GroupWiseLayer:
    """One quantized layer as the checkpoint stores it, unpacked: w[o, i] = s (q[i, o] - z), the scale s and
    zero z of output o in group g_idx[i] (consecutive inputs, or in act order any)."""

    bits: int
    q: torch.Tensor  # [in, out] uint8
    scales: torch.Tensor  # [groups, out] float32
    zeros: torch.Tensor  # [groups, out] float32
    g_idx: torch.Tensor  # [in] int64
    group_size: int

    @property
    def consecutive(self) -> bool:
        """Whether each group is `group_size` consecutive inputs (no act order)."""
        return torch.equal(self.g_idx, torch.arange(len(self.g_idx)) // self.group_size)

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [out, in] as GPTQModel's dequantize_weight and AutoAWQ's dequantize_gemm give
        them (scales[g_idx] * (q - zeros[g_idx]))."""
        weights = self.scales[self.g_idx] * (self.q.float() - self.zeros[self.g_idx])
        return weights.T.contiguous()

    def by_block(self, per_group: torch.Tensor) -> torch.Tensor:
        """[groups, out] to [out, in / 32], each block of 32 inputs its group's."""
        return per_group.repeat_interleave(self.group_size // BLOCK, dim=0).T.contiguous()

    def four_bit(self) -> FourBitWeight | None:
        """A 4-bit layer of consecutive groups in Int4Linear's terms: each block of 32 inputs its group's
        scale, and zero = (8 - z) * scale."""
        if self.bits != 4 or not self.consecutive:
            return None
        zero = self.by_block((8 - self.zeros) * self.scales)
        return FourBitWeight(self.q.T.contiguous(), self.by_block(self.scales), zero)

    def fp8(self) -> None:  # integers
        return None

    def eight_bit(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A symmetric 8-bit layer of consecutive groups (every z 128) as Int8Linear takes it, w = (q - 128)
        * scale: int8 [out, in] and each block's scale [out, in / 32]."""
        if self.bits != 8 or not self.consecutive or not bool((self.zeros == 128).all()):
            return None
        signed = (self.q.to(torch.int16) - 128).to(torch.int8).T.contiguous()
        return signed, self.by_block(self.scales)

    @property
    def conversion(self) -> str:
        return f"the dequantized weights ({'zero points' if self.consecutive else 'act-order groups'})"

    def converted(self) -> EightBitWeight:
        return requantize_int8(self.dequantize().numpy())


def unpack_layer(tensors: dict[str, torch.Tensor], fmt: GroupWiseFormat, name: str) -> GroupWiseLayer:
    """One layer's `qweight`, `qzeros`, `scales` (and GPTQ's `g_idx`) unpacked."""
    scales = tensors["scales"].float()  # [groups, out]
    out_features = scales.shape[1]
    qzeros = tensors["qzeros"]
    if fmt.zeros_less_one:  # as GPTQModel's convert_gptq_v1_to_v2_format: one more in each value, mod 2^32
        ones = sum(1 << shift for shift in range(0, 32, fmt.bits))  # 0x11111111 for 4 bits
        qzeros = ((qzeros.to(torch.int64) + ones) & 0xFFFFFFFF).to(torch.uint32).view(torch.int32)
    if fmt.method == "gptq":
        q = unpack_words(tensors["qweight"], 0, fmt.bits)  # [in, out]
        zeros = unpack_words(qzeros, 1, fmt.bits)[:, :out_features]
    else:
        q = awq_columns(unpack_words(tensors["qweight"], 1))
        zeros = awq_columns(unpack_words(qzeros, 1))[:, :out_features]
    in_features = q.shape[0]
    group_size = fmt.group_size or in_features
    if in_features % BLOCK or in_features % group_size or scales.shape[0] != in_features // group_size:
        raise UnsupportedCheckpoint(
            f"{name}: {in_features} inputs in {scales.shape[0]} groups of {group_size}: not whole blocks "
            "of 32"
        )
    g_idx = tensors.get("g_idx", torch.arange(in_features) // group_size).to(torch.int64)
    if g_idx.shape != (in_features,) or g_idx.min() < 0 or g_idx.max() >= scales.shape[0]:
        raise UnsupportedCheckpoint(
            f"{name}: g_idx of shape {tuple(g_idx.shape)} and groups {g_idx.min()}..{g_idx.max()} "
            f"for {in_features} inputs in {scales.shape[0]} groups"
        )
    return GroupWiseLayer(fmt.bits, q, scales, zeros.float(), g_idx, group_size)


def dequantize(weight: FourBitWeight) -> torch.Tensor:
    """The float32 weights [out, in] a layer's 4-bit q, scale and zero hold."""
    blocks = (weight.q.float() - 8).reshape(weight.q.shape[0], -1, BLOCK) * weight.scale[..., None]
    return (blocks + weight.zero[..., None]).reshape(weight.q.shape)


def checkpoint_files(location: str) -> list[Path]:
    directory = Path(location)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / shard for shard in shards]
    return sorted(directory.glob("*.safetensors"))


def read_tensors(location: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory's safetensors files, by name."""
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(location):
        with safe_open(path, framework="pt") as file:
            for key in file.keys():  # noqa: SIM118 (a safetensors file is no dict)
                tensors[key] = file.get_tensor(key)
    return tensors


def read_checkpoint(
    location: str, fmt: GroupWiseFormat, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, GroupWiseLayer]]:
    """The checkpoint's state dict with each quantized layer's weight dequantized to `dtype` (what the
    model is built from), and those layers as stored, by module name."""
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
        state_dict[f"{module}.weight"] = layers[module].dequantize().to(dtype)
    return state_dict, layers


def serve_group_wise(model: nn.Module, layers: dict[str, GroupWiseLayer], fmt: GroupWiseFormat) -> Counter:
    """Replace each quantized layer by a weight-only one of the checkpoint's values (module docstring),
    its dequantized weights the dense copy for many rows. Returns how many were served each way."""
    served = serve_layers(model, layers)
    log.info(
        "%s checkpoint (%s): %d linear layers served as %s, their dequantized weights kept for many rows",
        fmt.method.upper(),
        fmt.describe(),
        len(layers),
        described(served),
    )
    return served
