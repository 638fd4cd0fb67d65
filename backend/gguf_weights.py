"""A GGUF file's 4-bit weights, served as they are stored.

transformers dequantizes a GGUF file into float weights. For the linear
layers stored as Q4_0 or Q4_1 this module reads the blocks themselves and
gives them to `Int4Linear`, whose kernel takes the same layout: 32 inputs
of an output channel share a scale and a zero. So the served model
multiplies by the file's own weights (the scales rounded to bfloat16, the
kernel's type), and reads a quarter of the bytes a bfloat16 copy would.

    Q4_1 block (20 bytes): fp16 d, fp16 m, 16 bytes of 4-bit q; w = d * q + m
    Q4_0 block (18 bytes): fp16 d,          16 bytes of 4-bit q; w = d * (q - 8)
    byte j of the 16 holds element j in its low nibble and element j + 16 in its high one.

In Int4Linear's terms, w = (q - 8) * scale + zero: scale = d and zero =
m + 8d (Q4_1) or 0 (Q4_0). Every other tensor type keeps the dequantized
weights transformers made. An output head stored as Q8_0 (SmolLM2's, tied
to its embedding) keeps its dequantized floats for many rows and, for few,
its own blocks where the CPU multiplies blocks (block_weights.py takes a
scale a block of 32); elsewhere an int8 copy with one scale per channel
(quantized_linear.quantize_head), since PyTorch's `_weight_int8pack_mm`
takes no other.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFReader, get_tensor_name_map
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, TensorProcessor, read_field

from backend import block_weights
from backend.quantized_linear import (
    GROUP_SIZE,
    Int4Linear,
    Int8Linear,
    fits_int4_kernels,
    quantizable_linears,
    quantize_head,
    replace_module,
)

log = logging.getLogger(__name__)

FLOAT_TYPES = {"F32", "F16", "BF16"}
FOUR_BIT = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}  # bytes per block of 32

# Processors whose only change to a tensor is a permutation of its rows (output channels), which
# moves whole blocks: llama.cpp's converter permutes Llama's q and k projections for its rotary
# layout, and transformers permutes them back. Other architectures' processors reshape tensors in
# ways blocks do not follow, so their GGUF files are dequantized.
ROW_ONLY_PROCESSORS = {"llama": LlamaTensorProcessor}
PLAIN_ARCHITECTURES = {"qwen2"}  # stored as transformers names them

# Beside a GGUF file's converted copy: its 4-bit weights as read, so that later starts need not parse
# the file again (gguf's reader walks every field first, the tokenizer's 49,152 strings and 48,900
# merges among them: 5 of a 7.6 s load of the default model).
FOUR_BIT_CACHE = "four_bit_weights.safetensors"
HEAD_CACHE = "head_q8_0_blocks.safetensors"  # and the head's Q8_0 blocks
Q8_0_BYTES = 34  # fp16 d, 32 int8 values


@dataclass(frozen=True)
class FourBitWeight:
    """One linear layer's weight as Int4Linear takes it: w = (q - 8) * scale + zero."""

    q: torch.Tensor  # [out, in] uint8, 0..15
    scale: torch.Tensor  # [out, in / 32] float32
    zero: torch.Tensor  # [out, in / 32] float32


def unpack_blocks(rows: np.ndarray, kind: GGMLQuantizationType) -> FourBitWeight:
    """[out, blocks * bytes per block] uint8 rows of Q4_0 or Q4_1 blocks to q, scale and zero."""
    block_bytes = FOUR_BIT[kind]
    blocks = np.ascontiguousarray(rows).reshape(rows.shape[0], -1, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == GGMLQuantizationType.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    else:
        zero = np.zeros_like(d)
    packed = blocks[..., block_bytes - 16 :]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows.shape[0], -1)
    return FourBitWeight(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero))


def tensor_processor(architecture: str, model: nn.Module) -> TensorProcessor | None:
    """transformers' processor for this architecture if it only permutes rows; None if it does more."""
    if architecture in ROW_ONLY_PROCESSORS:
        return ROW_ONLY_PROCESSORS[architecture](config=model.config.to_dict())
    if architecture in PLAIN_ARCHITECTURES:
        return TensorProcessor()
    return None


def gguf_names(architecture: str, model: nn.Module) -> dict[str, str]:
    """GGUF tensor name ("blk.0.attn_q.weight") to module name, for the quantizable linear layers."""
    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == architecture)
    names = get_tensor_name_map(arch, model.config.get_text_config().num_hidden_layers)
    mapped = {module: names.get_name(module) for module in quantizable_linears(model)}
    return {f"{gguf}.weight": module for module, gguf in mapped.items() if gguf is not None}


FourBitWeights = tuple[dict[str, FourBitWeight], Counter, str]


def read_four_bit_weights(path: Path, model: nn.Module, cache_dir: Path | None = None) -> FourBitWeights:
    """The Q4_0/Q4_1 weights of the model's quantizable linear layers, by module name; a count of
    the file's tensor types (for the start-up log); and the type the output head is stored in. From
    `cache_dir`'s copy where it has one, else from the file (then saved there)."""
    cached = cache_dir / FOUR_BIT_CACHE if cache_dir is not None else None
    if cached is not None and cached.is_file():
        try:
            return load_four_bit_weights(cached)
        except Exception as error:  # a damaged copy: read the file again, and replace the copy
            log.warning(
                "the cached 4-bit weights in %s are unreadable (%s): reading the GGUF file", cached, error
            )
    found = parse_four_bit_weights(path, model)
    if cached is not None:
        save_four_bit_weights(cached, found)
    return found


def parse_four_bit_weights(path: Path, model: nn.Module) -> FourBitWeights:
    reader = GGUFReader(str(path))
    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    by_name = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
    head_type = by_name.get("output.weight") or by_name.get("token_embd.weight", "F32")  # tied: the embedding
    architecture = read_field(reader, "general.architecture")[0]
    processor = tensor_processor(architecture, model)
    if processor is None:
        log.info(
            "GGUF architecture %r: its weights are dequantized (no block-preserving mapping)", architecture
        )
        return {}, types, head_type
    to_module = gguf_names(architecture, model)
    weights = {}
    for tensor in reader.tensors:
        module = to_module.get(tensor.name)
        if module is None or tensor.tensor_type not in FOUR_BIT:
            continue
        rows = processor.process(weights=np.asarray(tensor.data), name=tensor.name).weights
        weights[module] = unpack_blocks(rows, tensor.tensor_type)
    return weights, types, head_type


def save_four_bit_weights(target: Path, found: FourBitWeights) -> None:
    """Save what `parse_four_bit_weights` found, atomically (another process may be starting too);
    q as two values a byte."""
    weights, types, head_type = found
    tensors = {}
    for name, weight in weights.items():
        tensors[f"{name}.q"] = weight.q[:, 0::2] | weight.q[:, 1::2] << 4
        tensors[f"{name}.scale"], tensors[f"{name}.zero"] = weight.scale, weight.zero
    staging = target.with_name(f".{target.name}.{os.getpid()}")
    try:
        metadata = {"layers": json.dumps(list(weights)), "types": json.dumps(types), "head_type": head_type}
        save_file(tensors, staging, metadata=metadata)
        staging.replace(target)
    except OSError as error:  # a full disk: later starts parse the file again
        staging.unlink(missing_ok=True)
        log.warning("could not cache the GGUF file's 4-bit weights in %s: %s", target, error)


def load_four_bit_weights(source: Path) -> FourBitWeights:
    with safe_open(source, framework="pt") as file:
        metadata = file.metadata()
        weights = {}
        for name in json.loads(metadata["layers"]):
            packed = file.get_tensor(f"{name}.q")
            q = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
            weights[name] = FourBitWeight(
                q, file.get_tensor(f"{name}.scale"), file.get_tensor(f"{name}.zero")
            )
    return weights, Counter(json.loads(metadata["types"])), metadata["head_type"]


def serve_gguf_weights(model: nn.Module, path: Path, cache_dir: Path | None = None) -> int:
    """Replace the linear layers stored as Q4_0/Q4_1 in `path` by Int4Linear layers of those very
    weights, and a head stored quantized (Q8_0 and the like) by an int8 one; the rest keep their
    dequantized floats. Returns how many layers were replaced. `cache_dir`: where the weights read
    from the file are kept for the next start (the file's converted copy)."""
    weights, types, head_type = read_four_bit_weights(path, model, cache_dir)
    linears = quantizable_linears(model)
    for name, weight in weights.items():
        if weight.q.shape != linears[name].weight.shape or weight.q.shape[1] % GROUP_SIZE:
            raise ValueError(
                f"GGUF tensor for {name} has shape {tuple(weight.q.shape)}, the model expects "
                f"{tuple(linears[name].weight.shape)}"
            )
        device = linears[name].weight.device
        # transformers dequantized these very blocks: its weights are the dense copy for many rows.
        layer = Int4Linear(
            weight.q.to(device),
            weight.scale.to(device),
            weight.zero.to(device),
            linears[name].bias,
            dense=linears[name].weight,
        )
        replace_module(model, name, layer)
    head = "as floats"
    if head_type == "Q8_0" and serve_head_blocks(model, path, cache_dir):
        head = "from its Q8_0 blocks for few rows"
    elif head_type not in FLOAT_TYPES and quantize_head(model):
        head = "in int8 per channel for few rows"
    log.info(
        "GGUF %s (tensor types %s): %d linear layers served from their 4-bit blocks, %d dequantized "
        "(with the embeddings and norms) to %s; output head (%s) %s",
        path.name,
        ", ".join(f"{kind} x{count}" for kind, count in sorted(types.items())),
        len(weights),
        len(linears) - len(weights),
        next(model.parameters()).dtype,
        head_type,
        head,
    )
    return len(weights) + (head != "as floats")


def serve_head_blocks(model: nn.Module, path: Path, cache_dir: Path | None) -> bool:
    """Replace an output head stored as Q8_0 by an Int8Linear of its own blocks (a scale a block of 32)
    where the CPU multiplies blocks (block_weights.py); its float weights stay the dense copy for many
    rows. Returns whether it did (PyTorch's int8 kernel takes one scale a channel only)."""
    head = model.get_output_embeddings()
    device = head.weight.device
    if type(head) is not nn.Linear or not (block_weights.available(device) and fits_int4_kernels(head)):
        return False
    blocks = read_head_blocks(path, cache_dir)
    if blocks is None or blocks.q.shape != head.weight.shape:
        return False
    name = next(name for name, module in model.named_modules() if module is head)
    replace_module(model, name, Int8Linear(blocks.q, blocks.scale, head.bias, dense=head.weight.detach()))
    return True


@dataclass(frozen=True)
class EightBitWeight:
    """A Q8_0 tensor's blocks: w = q * scale, a scale a block of 32 inputs of an output channel."""

    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out, in / 32] float32


def unpack_q8_0(rows: np.ndarray) -> EightBitWeight:
    """[out, blocks * 34] uint8 rows of Q8_0 blocks (fp16 d, then 32 int8 values) to q and scale."""
    blocks = np.ascontiguousarray(rows).reshape(rows.shape[0], -1, Q8_0_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(rows.shape[0], -1)
    return EightBitWeight(torch.from_numpy(q), torch.from_numpy(d))


def read_head_blocks(path: Path, cache_dir: Path | None = None) -> EightBitWeight | None:
    """The output head's Q8_0 blocks (the embedding's, where they are tied), from `cache_dir`'s copy
    where it has one, else from the file (then saved there); None where the head is not Q8_0."""
    cached = cache_dir / HEAD_CACHE if cache_dir is not None else None
    if cached is not None and cached.is_file():
        try:
            with safe_open(cached, framework="pt") as file:
                return EightBitWeight(file.get_tensor("q"), file.get_tensor("scale"))
        except Exception as error:  # a damaged copy: read the file again, and replace the copy
            log.warning(
                "the cached head blocks in %s are unreadable (%s): reading the GGUF file", cached, error
            )
    tensors = {tensor.name: tensor for tensor in GGUFReader(str(path)).tensors}
    tensor = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if tensor is None or tensor.tensor_type != GGMLQuantizationType.Q8_0:
        return None
    found = unpack_q8_0(np.asarray(tensor.data))
    if cached is not None:
        staging = cached.with_name(f".{cached.name}.{os.getpid()}")
        try:
            save_file({"q": found.q, "scale": found.scale}, staging)
            staging.replace(cached)
        except OSError as error:  # a full disk: later starts read the file again
            staging.unlink(missing_ok=True)
            log.warning("could not cache the head's blocks in %s: %s", cached, error)
    return found
