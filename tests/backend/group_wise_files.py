"""GPTQ and AWQ checkpoints of tiny models, written here to each format's documented packing, and each
library's own dequantization to read them back with.

The quantizers (GPTQModel, AutoAWQ) install only with their CUDA kernels, so the layers are rounded here
to the nearest of 16 levels (256 for 8-bit GPTQ; what GPTQ and AWQ refine, the packing is the point)
and packed as the libraries pack them:

    GPTQ: qweight int32 [in / 8, out], value k of word (i, j) input 8i + k at bits 4k (8 bits: [in / 4,
          out], input 4i + k at bits 8k); qzeros int32 [groups, out / 8], value k of word (g, j) output
          8j + k (8 bits: 4j + k); scales fp16 [groups, out]; g_idx int32 [in], each input's group:
          consecutive inputs, or in act order (desc_act) a group of the inputs GPTQ took together (here
          a random order's). Format "gptq" (v1) stores each qzeros word less 0x11111111 (0x01010101).
    AWQ (GEMM): qweight int32 [in, out / 8] and qzeros [groups, out / 8], value k of a word output
          8j + AWQ_ORDER[k]; scales fp16 [groups, out].

The dequantizations below follow the libraries' code: GPTQModel's `convert_gptq_v1_to_v2_format_module`
(qzeros += 0x11111111 for 4 bits, 0x01010101 for 8) and `TorchQuantLinear.dequantize_weight`
(scales[g_idx] * (q - zeros[g_idx])), AutoAWQ's `awq.utils.packing_utils.dequantize_gemm` (unpack,
reverse the order, (q - z) * scales)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.backend.models import tiny_model, write_tiny_causal_lm

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def round_to_int(
    weight: torch.Tensor, group_size: int, symmetric: bool, bits: int = 4
) -> tuple[torch.Tensor, ...]:
    """[out, in] float weights to q [in, out], z and fp16 scales [groups, out]: w ~ scale * (q - z), as
    GPTQ's quantizer rounds (symmetric: z = 2^(bits - 1), the scale 2 max|w| / (2^bits - 1))."""
    top = (1 << bits) - 1
    groups = weight.T.reshape(-1, group_size, weight.shape[0])  # [groups, group_size, out]
    if symmetric:
        scale = (2 * groups.abs().amax(dim=1) / top).half()
        z = torch.full_like(scale, (top + 1) // 2, dtype=torch.int64)
    else:
        low, high = groups.amin(dim=1).clamp(max=0), groups.amax(dim=1).clamp(min=0)
        scale = ((high - low) / top).half()
        z = torch.round(-low / scale.float()).long().clamp(0, top)
    q = torch.round(groups / scale.float()[:, None]) + z[:, None]
    return q.clamp(0, top).long().reshape(weight.shape[1], -1), z, scale


def shifts(bits: int) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int64)


def pack(values: torch.Tensor, dim: int, bits: int = 4) -> torch.Tensor:
    """int64 values below 2^bits into int32 words of 32 / bits, value k at bits k * bits, down `dim` 0 or
    along 1."""
    per_word = 32 // bits
    if dim == 0:
        words = (values.reshape(-1, per_word, values.shape[1]) << shifts(bits)[None, :, None]).sum(dim=1)
    else:
        words = (values.reshape(values.shape[0], -1, per_word) << shifts(bits)[None, None, :]).sum(dim=2)
    return as_int32(words)


def as_int32(words: torch.Tensor) -> torch.Tensor:
    return (words & 0xFFFFFFFF).to(torch.uint32).view(torch.int32)


def gptq_layer(
    weight: torch.Tensor, group_size: int, symmetric: bool, v1: bool, act_order: bool = False, bits: int = 4
) -> dict[str, torch.Tensor]:
    """In act order, the inputs are grouped in a random order (GPTQ's is by their activations' size) and
    stored in their own: q row i is input i, of group g_idx[i]. Layers of one shape share the order, as
    q, k and v, which see the same activations, do in GPTQ."""
    in_features = weight.shape[1]
    shuffle = torch.Generator().manual_seed(weight.shape[0] * in_features)
    order = torch.randperm(in_features, generator=shuffle) if act_order else torch.arange(in_features)
    q_in_order, z, scale = round_to_int(weight[:, order], group_size, symmetric, bits)
    q = torch.empty_like(q_in_order)
    q[order] = q_in_order
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = torch.arange(in_features, dtype=torch.int32) // group_size
    qzeros = pack(z, dim=1, bits=bits)
    if v1:
        qzeros = as_int32(qzeros.to(torch.int64) - ones(bits))
    return {"qweight": pack(q, dim=0, bits=bits), "qzeros": qzeros, "scales": scale, "g_idx": g_idx}


def ones(bits: int) -> int:
    """A word of 32 / bits values of 1: what the v1 format takes from each qzeros word."""
    return {4: 0x11111111, 8: 0x01010101}[bits]


def awq_layer(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    q, z, scale = round_to_int(weight, group_size, symmetric=False)

    def in_awq_order(values: torch.Tensor) -> torch.Tensor:
        return values.reshape(values.shape[0], -1, 8)[:, :, AWQ_ORDER].reshape(values.shape)

    return {"qweight": pack(in_awq_order(q), dim=1), "qzeros": pack(in_awq_order(z), dim=1), "scales": scale}


def unpack_words(words: torch.Tensor, dim: int, bits: int = 4) -> torch.Tensor:
    mask = (1 << bits) - 1
    if dim == 0:
        values = (words.to(torch.int64)[:, None, :] >> shifts(bits)[None, :, None]) & mask
        return values.reshape(-1, words.shape[1])
    return ((words.to(torch.int64)[:, :, None] >> shifts(bits)[None, None, :]) & mask).reshape(
        words.shape[0], -1
    )


def gptqmodel_dequantize(tensors: dict[str, torch.Tensor], v1: bool, bits: int = 4) -> torch.Tensor:
    """GPTQModel's reading: [out, in] float32."""
    qzeros = tensors["qzeros"].to(torch.int64)
    if v1:
        qzeros = qzeros + ones(bits)
    zeros = unpack_words(qzeros, dim=1, bits=bits)
    weight = unpack_words(tensors["qweight"], dim=0, bits=bits)
    g_idx = tensors["g_idx"].long()
    return (tensors["scales"].float()[g_idx] * (weight - zeros[g_idx])).T.contiguous()


def autoawq_dequantize(tensors: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """AutoAWQ's dequantize_gemm: [out, in] float32."""
    weight = unpack_words(tensors["qweight"], dim=1)
    zeros = unpack_words(tensors["qzeros"], dim=1)
    order = torch.arange(weight.shape[-1]).reshape(-1, 8)[:, AWQ_REVERSE_ORDER].reshape(-1)
    weight, zeros = weight[:, order], zeros[:, order]
    scales = tensors["scales"].float().repeat_interleave(group_size, dim=0)
    return ((weight - zeros.repeat_interleave(group_size, dim=0)) * scales).T.contiguous()


def write_group_wise_checkpoint(
    directory: Path,
    method: str,
    group_size: int = 32,
    symmetric: bool = True,
    packing: str = "gptq",
    act_order: Callable[[str], bool] | None = None,
    bits: int = 4,
) -> dict[str, torch.Tensor]:
    """A model directory the server loads: `tiny_model("llama")` (with the marker tokenizer of
    `write_tiny_causal_lm`) whose projections are stored as `method` ("gptq" or "awq") packs them
    (GPTQ's in act order where `act_order` is true of the module's name). Returns each quantized layer's
    weights as the library dequantizes them, by module name."""
    write_tiny_causal_lm(directory, "llama")
    model = tiny_model("llama")
    tensors, expected = {}, {}
    head = model.get_output_embeddings()
    for name, parameter in model.state_dict().items():
        module_name = name.removesuffix(".weight")
        module = model.get_submodule(module_name) if name.endswith(".weight") else None
        if type(module) is not torch.nn.Linear or module is head:
            tensors[name] = parameter.contiguous()
            continue
        if method == "gptq":
            in_act_order = act_order is not None and act_order(module_name)
            v1 = packing == "gptq"
            layer = gptq_layer(parameter, group_size, symmetric, v1, act_order=in_act_order, bits=bits)
            expected[module_name] = gptqmodel_dequantize(layer, v1, bits)
        else:
            layer = awq_layer(parameter, group_size)
            expected[module_name] = autoawq_dequantize(layer, group_size)
        tensors.update({f"{module_name}.{part}": value for part, value in layer.items()})
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    if method == "gptq":
        quantization = dict(
            quant_method="gptq",
            bits=bits,
            group_size=group_size,
            desc_act=act_order is not None,
            sym=symmetric,
            checkpoint_format=packing,
        )
    else:
        quantization = dict(
            quant_method="awq", bits=4, group_size=group_size, zero_point=True, version="gemm"
        )
    config["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return expected
