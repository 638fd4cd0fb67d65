"""compressed-tensors checkpoints (llm-compressor's "-quantized.w4a16", "-quantized.w8a8" and "-FP8-dynamic"
repositories), read by this server itself and served from their own values.

config.json's `quantization_config` (quant_method "compressed-tensors") gives groups of layers
(`config_groups`, each its `targets`: the class "Linear", module names or "re:" regexes; `ignore`
names those left as floats, `lm_head` mostly) and how each group's weights are stored (its `format`,
else the checkpoint's):

    pack-quantized (w4a16, w8a16): weight_packed int32 [out, in * bits / 32], 32 / bits values a word
        along the inputs, value k at bits k * bits, each stored as q + 2^(bits - 1); weight_scale
        [out, groups] in the model's dtype; weight_zero_point (asymmetric) int32 [out * bits / 32,
        groups], packed the same way down the outputs; weight_shape [out, in].
    int-quantized, naive-quantized (w8a8): weight int8 [out, in], weight_scale [out, 1].
    float-quantized (FP8-dynamic): weight float8 e4m3 [out, in], weight_scale [out, 1] or [1].

    w = (q - z) * scale, q and z signed (z = 0 where symmetric), a scale per `group_size` inputs
    (strategy "group"), per output channel ("channel"), per layer ("tensor") or per block ("block")

as the library's own code packs and dequantizes them (compressors/pack_quantized/helpers.py,
`pack_to_int32`; quantization/lifecycle/forward.py, `dequantize`: (q - z) * scale in the scale's
dtype, here in float32, which holds each product exactly for bfloat16 or fp16 scales). transformers
would read these checkpoints through the compressed-tensors library; this module needs none.

The model is built from the dequantized weights in the start's dtype (the exact mode's float32 is
the reference), which are the dense copy for many rows, as for GPTQ and AWQ (group_wise.py). Then:

    4-bit: an Int4Linear of the same groups, each group of 128 four blocks of 32 with its scale and
        zero = -z * scale: the dequantized weights exactly in float32 (in the CPU's blocks, which keep
        the scales in fp16, exactly too where the checkpoint is symmetric and its scales bfloat16 or
        fp16 in fp16's range; otherwise within 2^-11 of z * scale).
    8-bit integers, symmetric, a scale a channel or a layer: an Int8Linear of the checkpoint's own q
        and scale (exact in the blocks where fp16 holds the scale, as it does bfloat16 ones in its range).
    FP8 with a scale a channel or a tensor, or in 128 x 128 blocks, on a GPU with FP8 arithmetic: an
        Fp8Linear (Fp8BlockLinear) of the checkpoint's own values and scales (fp8_linear.py), its
        activations quantized to e4m3 a row (a 128 of a row) as the checkpoint's dynamic scheme says.
    FP8 elsewhere, 8-bit integers in groups, and groups in act order (actorder "group": weight_g_idx
        gives each input's group, so 32 consecutive inputs share no scale): 8-bit blocks of 32
        converted once from the dequantized weights where the CPU multiplies blocks (as
        fp8_weights.py), else the dequantized floats.

Activations stay floats but in FP8 products: a w8a8 or FP8-dynamic checkpoint's quantized inputs (int8
or FP8 a token, scaled as they come, or a static input_scale) are a speed feature of GPU kernels, not
part of the weights; the log says so.

Refused, naming what: other formats (sparse-24-bitmask, marlin-24, nvfp4-pack-quantized, the MX
ones, "mixed-precision" with a group of no format), weights of other bit widths and types, 4-bit
groups that are no whole number of 32 inputs, act-order groups of unequal sizes, sparsity,
transforms (rotations applied as the model runs), a quantized KV cache or outputs, targets by any
class but Linear, and checkpoints not saved compressed.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from backend.quant.checkpoint_layers import FP8_PRODUCTS, described, serve_layers
from backend.quant.fp8_linear import BLOCK as FP8_BLOCK
from backend.quant.gguf_types import BLOCK, EightBitWeight, FourBitWeight, requantize_int8
from backend.quant.group_wise import UnsupportedCheckpoint, read_tensors

log = logging.getLogger(__name__)

METHOD = "compressed-tensors"
PACKED, INT, NAIVE, FLOAT = "pack-quantized", "int-quantized", "naive-quantized", "float-quantized"
FORMATS = (PACKED, INT, NAIVE, FLOAT)
STRATEGIES = ("group", "channel", "tensor", "block")
# A quantized layer's tensors beside its `weight`, as the library names them
PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
INPUT_PARTS = ("input_scale", "input_zero_point")  # static input quantization: not served


@dataclass(frozen=True)
class WeightScheme:
    """How a group of layers stores its weights: w = (q - z) * scale."""

    format: str  # one of FORMATS
    type: str  # "int" or "float"
    bits: int
    strategy: str  # one of STRATEGIES
    group_size: int  # inputs a scale covers (strategy "group")
    block: tuple[int, int]  # outputs and inputs a scale covers (strategy "block")
    symmetric: bool

    def describe(self) -> str:
        kind = f"{self.type}{self.bits}" if self.type == "int" else "FP8"
        scope = {
            "group": f"groups of {self.group_size}",
            "channel": "a scale a channel",
            "tensor": "a scale a layer",
            "block": f"{self.block[0]} x {self.block[1]} blocks",
        }[self.strategy]
        return f"{kind}, {scope}, {'symmetric' if self.symmetric else 'asymmetric'}"


@dataclass(frozen=True)
class CompressedFormat:
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]  # each group's targets and scheme, in order
    ignore: tuple[str, ...]
    activations: tuple[str, ...]  # how the checkpoint quantizes its layers' inputs, for the log

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme of the module of this name, as the library picks it (apply_quantization_config: a
        target naming the module, else one matching it by regex, else the class Linear, which every
        layer stored quantized is here); None where no target matches or the ignore list does."""
        if any(match_kind(target, module) is not None for target in self.ignore):
            return None
        matches = [
            (kind, target, scheme)
            for targets, scheme in self.groups
            for target in targets
            if (kind := match_kind(target, module)) is not None
        ]
        return min(matches, key=lambda match: match[:2])[2] if matches else None

    def describe(self) -> str:
        return "; ".join(sorted({scheme.describe() for _, scheme in self.groups}))


def match_kind(target: str, module: str) -> int | None:
    """0 where `target` names the module, 1 where its regex matches it, 2 for the class Linear."""
    if target.startswith("re:"):
        return 1 if re.match(target.removeprefix("re:"), module) else None
    if target == "Linear":
        return 2
    return 0 if target == module else None


def checkpoint_format(quantization_config: dict | None) -> CompressedFormat | None:
    """The format of a checkpoint whose config.json has this `quantization_config`: None where it is no
    compressed-tensors checkpoint; UnsupportedCheckpoint where it is one this module does not read."""
    if not quantization_config or quantization_config.get("quant_method") != METHOD:
        return None

    def refuse(reason: str) -> UnsupportedCheckpoint:
        return UnsupportedCheckpoint(f"a compressed-tensors checkpoint {reason}")

    config = quantization_config
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise refuse(f"saved {status!r}, its weights not stored compressed: only 'compressed' ones are read")
    sparsity = (config.get("sparsity_config") or {}).get("format", "dense")
    if sparsity != "dense" or config.get("format") in ("sparse-24-bitmask", "sparse-bitmask", "marlin-24"):
        raise refuse(f"stored sparse ({config.get('format') if sparsity == 'dense' else sparsity}): not read")
    if (config.get("transform_config") or {}).get("config_groups"):
        raise refuse("with transforms (rotations applied to the weights and activations as the model runs)")
    if config.get("kv_cache_scheme"):
        raise refuse(f"that quantizes the KV cache ({config['kv_cache_scheme']}): not served")
    if config.get("moe_sparsity_config"):
        raise refuse("with pruned mixture-of-experts experts (moe_sparsity_config): not read")
    if not config.get("config_groups"):
        raise refuse("with no quantized groups of layers (config_groups)")
    groups, activations = [], set()
    for name, group in config["config_groups"].items():
        stored = group.get("format") or config.get("format")
        if stored not in FORMATS:
            raise refuse(
                f"stored as {stored!r} ({name}): only {', '.join(FORMATS)} are read (4- and 8-bit "
                "integer weights, FP8 weights)"
            )
        if group.get("output_activations"):
            raise refuse(f"that quantizes layer outputs ({name}): not served")
        weights = group.get("weights")
        if not weights:
            raise refuse(f"that quantizes only activations ({name}): not served")
        classes = [t for t in group.get("targets", []) if t[:1].isupper() and t != "Linear"]
        if classes:
            raise refuse(f"whose {name} targets layers by the class {classes[0]!r}: only Linear is read")
        groups.append((tuple(group.get("targets", [])), weight_scheme(stored, weights, name, refuse)))
        if group.get("input_activations"):
            activations.add(describe_inputs(group["input_activations"]))
    return CompressedFormat(tuple(groups), tuple(config.get("ignore") or ()), tuple(sorted(activations)))


def weight_scheme(stored: str, weights: dict, group: str, refuse) -> WeightScheme:
    kind, bits = str(weights.get("type", "int")).lower(), weights.get("num_bits", 8)
    group_size = weights.get("group_size")
    strategy = weights.get("strategy") or (
        "tensor" if group_size is None else "channel" if group_size == -1 else "group"
    )
    strategy = str(strategy).lower()
    readable = (
        (kind == "int" and stored == PACKED and bits in (4, 8))
        or (kind == "int" and stored in (INT, NAIVE) and bits == 8)
        or (kind == "float" and stored in (FLOAT, NAIVE) and bits == 8)
    )
    if not readable:
        raise refuse(
            f"of {kind} {bits}-bit weights stored as {stored!r} ({group}): only 4- and 8-bit integers "
            "(pack-quantized, int-quantized) and 8-bit floats (float-quantized) are read"
        )
    if strategy not in STRATEGIES or weights.get("dynamic") or (bits == 4 and strategy == "block"):
        raise refuse(
            f"whose weights are scaled by {strategy!r}{' dynamically' * bool(weights.get('dynamic'))}"
        )
    if strategy == "group" and bits == 4 and group_size % BLOCK:
        raise refuse(
            f"of int4 groups of {group_size} inputs: the engine's blocks are 32 inputs, so groups must "
            "be a multiple of 32"
        )
    block = tuple(weights.get("block_structure") or (0, 0))
    return WeightScheme(
        stored, kind, bits, strategy, group_size or 0, block, bool(weights.get("symmetric", True))
    )


def describe_inputs(inputs: dict) -> str:
    kind = "int" if str(inputs.get("type", "int")).lower() == "int" else "FP"
    scope = "dynamic" if inputs.get("dynamic") else "static"
    return f"{kind}{inputs.get('num_bits')} {scope} a {inputs.get('strategy') or 'tensor'}"


@dataclass(frozen=True)
class CompressedLayer:
    """One quantized layer as the checkpoint stores it, unpacked: w = (values - zero) * scale."""

    scheme: WeightScheme
    values: torch.Tensor  # [out, in]: signed integers (int8), or float8 e4m3
    scale: torch.Tensor  # as stored: [out, groups], [out, 1], [1] or [out blocks, in blocks]
    zero: torch.Tensor | None  # [out, groups] signed integers, where asymmetric
    g_idx: torch.Tensor | None = None  # [in] int64, each input's group, where in act order

    def spread(self, tensor: torch.Tensor) -> torch.Tensor:
        """A scale or zero point over every weight, [out, in] float32."""
        out_features, in_features = self.values.shape
        tensor = tensor.float()
        if self.scheme.strategy == "group" and self.g_idx is not None:
            return tensor[:, self.g_idx]
        if self.scheme.strategy == "group":
            return tensor.repeat_interleave(self.scheme.group_size, dim=1)[:, :in_features]
        if self.scheme.strategy == "block":
            rows, columns = self.scheme.block
            spread = tensor.repeat_interleave(rows, dim=0).repeat_interleave(columns, dim=1)
            return spread[:out_features, :in_features]
        return tensor.reshape(-1, 1).expand(out_features, in_features)  # a channel's, or the layer's

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [out, in]: the library's (q - z) * scale, in float32."""
        q = self.values.float()
        if self.zero is not None:
            q = q - self.spread(self.zero)
        return q * self.spread(self.scale)

    def four_bit(self) -> FourBitWeight | None:
        """A 4-bit layer in Int4Linear's terms, w = (u - 8) * scale + zero, u = q + 8 in 0..15, each block of
        32 inputs its group's scale and zero = -z * scale."""
        if self.scheme.type != "int" or self.scheme.bits != 4 or self.g_idx is not None:
            return None
        out_features, in_features = self.values.shape
        per_block = self.values.shape[1] // BLOCK
        zero = self.zero if self.zero is not None else torch.zeros(1, dtype=torch.int8)

        def blocks(tensor: torch.Tensor) -> torch.Tensor:
            return self.spread(tensor)[:, ::BLOCK].reshape(out_features, per_block).contiguous()

        scale = blocks(self.scale)
        zero = (0 - blocks(zero.expand_as(self.scale))) * scale  # 0, not -0.0, where z is 0
        return FourBitWeight((self.values + 8).to(torch.uint8), scale, zero)

    def eight_bit(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A symmetric 8-bit integer layer as Int8Linear takes it, w = q * scale: q and a scale a channel
        ([out]) or, in groups of a multiple of 32, a block ([out, in / 32])."""
        scheme = self.scheme
        if scheme.type != "int" or scheme.bits != 8 or not scheme.symmetric or self.g_idx is not None:
            return None
        out_features, in_features = self.values.shape
        if scheme.strategy in ("channel", "tensor"):
            return self.values, self.scale.float().reshape(-1).expand(out_features).contiguous()
        if scheme.strategy == "group" and scheme.group_size % BLOCK == 0:
            scale = self.spread(self.scale)[:, ::BLOCK].contiguous()
            return self.values, scale
        return None

    def fp8(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An FP8 layer as the FP8 layers take it: its values and a scale a channel, or in 128 x 128
        blocks a scale a block [out / 128, in / 128]."""
        if self.scheme.type != "float":
            return None
        if self.scheme.strategy in ("channel", "tensor"):
            return self.values, self.scale.float().reshape(-1).expand(self.values.shape[0]).contiguous()
        whole = all(size % FP8_BLOCK == 0 for size in self.values.shape)
        if self.scheme.strategy == "block" and self.scheme.block == (FP8_BLOCK, FP8_BLOCK) and whole:
            return self.values, self.scale.float()
        return None

    @property
    def conversion(self) -> str:
        return "the dequantized weights" + (" (act-order groups)" if self.g_idx is not None else "")

    def converted(self) -> EightBitWeight:
        return requantize_int8(self.dequantize().numpy())


def unpack_words(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 [rows, n] of 32 / bits values each, value k at bits k * bits and stored as q + 2^(bits - 1),
    to the first `count` signed values q of each row, int8 [rows, count]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    values = (words.to(torch.int64)[:, :, None] >> shifts) & ((1 << bits) - 1)
    return (values.reshape(words.shape[0], -1)[:, :count] - (1 << (bits - 1))).to(torch.int8)


def unpack_layer(tensors: dict[str, torch.Tensor], scheme: WeightScheme, name: str) -> CompressedLayer:
    """One layer's tensors (`weight` or `weight_packed`, `weight_scale`, ...) as a CompressedLayer."""
    scale = tensors["weight_scale"]
    if scheme.format == PACKED:
        out_features, in_features = (int(size) for size in tensors["weight_shape"])
        values = unpack_words(tensors["weight_packed"], scheme.bits, in_features)[:out_features]
    else:
        values = tensors["weight"]
        out_features, in_features = values.shape
        if scheme.type == "int":
            values = values.to(torch.int8)
    zero = None
    if not scheme.symmetric and "weight_zero_point" in tensors:
        zero = tensors["weight_zero_point"]
        if zero.dtype == torch.int32 and scheme.format == PACKED and zero.shape[0] != out_features:
            zero = unpack_words(zero.T.contiguous(), scheme.bits, out_features).T  # packed down the outputs
        zero = zero.to(torch.int8).reshape(scale.shape)
    if scheme.strategy == "group" and (
        in_features % scheme.group_size or scale.shape[-1] != in_features // scheme.group_size
    ):
        raise UnsupportedCheckpoint(
            f"{name}: {in_features} inputs in {scale.shape[-1]} groups of {scheme.group_size}"
        )
    if scheme.bits == 4 and in_features % BLOCK:
        raise UnsupportedCheckpoint(f"{name}: {in_features} inputs, not whole blocks of 32")
    g_idx = act_order_groups(tensors, scheme, in_features, scale.shape[-1], name)
    return CompressedLayer(scheme, values, scale, zero, g_idx)


def act_order_groups(
    tensors: dict[str, torch.Tensor], scheme: WeightScheme, in_features: int, groups: int, name: str
) -> torch.Tensor | None:
    """Each input's group where `weight_g_idx` puts inputs in other groups than consecutive ones; None
    where there is none, it is consecutive, or it holds -1 (the library's mark of column order)."""
    if "weight_g_idx" not in tensors or scheme.strategy != "group":
        return None
    g_idx = tensors["weight_g_idx"].to(torch.int64)
    if (g_idx == -1).any() or torch.equal(g_idx, torch.arange(len(g_idx)) // scheme.group_size):
        return None
    # The library sorts the inputs by group and takes each group_size of them as a group: the groups must
    # be of that size for that to be input i's scale being group g_idx[i]'s.
    readable = g_idx.shape == (in_features,) and g_idx.min() >= 0 and g_idx.max() < groups
    if not readable or (g_idx.bincount(minlength=groups) != scheme.group_size).any():
        raise UnsupportedCheckpoint(
            f"{name}: act-order groups (weight_g_idx) of other sizes than {scheme.group_size} inputs, or "
            f"out of its {groups} groups"
        )
    return g_idx


def read_checkpoint(
    location: str, fmt: CompressedFormat, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, CompressedLayer]]:
    """The checkpoint's state dict with each quantized layer's weight dequantized to `dtype` (what the
    model is built from), and those layers as stored, by module name."""
    tensors = read_tensors(location)
    quantized = [key.removesuffix(".weight_scale") for key in tensors if key.endswith(".weight_scale")]
    layers = {}
    for module in quantized:
        scheme = fmt.scheme_for(module)
        if scheme is None:
            raise UnsupportedCheckpoint(
                f"{module}: stored quantized, but the config's targets and ignore list leave it unquantized"
            )
        parts = {
            part: tensors.pop(f"{module}.{part}")
            for part in ("weight", *PARTS)
            if f"{module}.{part}" in tensors
        }
        layers[module] = unpack_layer(parts, scheme, module)
        tensors[f"{module}.weight"] = layers[module].dequantize().to(dtype)
    for key in [key for key in tensors if key.rpartition(".")[2] in INPUT_PARTS]:
        del tensors[key]
    return tensors, layers


def serve_compressed(model: nn.Module, layers: dict[str, CompressedLayer], fmt: CompressedFormat) -> Counter:
    """Replace each quantized layer by a weight-only one of the checkpoint's values (module docstring),
    its dequantized weights the dense copy for many rows. Returns how many were served each way."""
    served = serve_layers(model, layers)
    inputs = (
        f"activations stay floats (weight-only; the checkpoint's {', '.join(fmt.activations)} input "
        "quantization is not applied)"
        if fmt.activations
        else "activations stay floats"
    )
    fp8 = sum(count for how, count in served.items() if how.startswith(FP8_PRODUCTS))
    if fp8 == len(layers):
        inputs = "activations quantized to e4m3 as they come"
    elif fp8:
        inputs = f"{inputs}, but the FP8 products' (e4m3 as they come)"
    log.info(
        "compressed-tensors checkpoint (%s): %s linear layers served as %s, their dequantized weights "
        "kept for many rows; %s",
        fmt.describe(),
        len(layers),
        described(served),
        inputs,
    )
    return served
