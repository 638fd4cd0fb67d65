"""gpt-oss MXFP4 checkpoints of tiny models, written here to the format's documented packing (transformers
can quantize to MXFP4 only with triton's kernels, which need a GPU), with transformers' own
dequantization to read them back with.

As openai/gpt-oss-20b keeps them: each experts' projection (`gate_up_proj`, `down_proj`, [experts, in,
out] in the model) as `*_blocks` uint8 [experts, out, in / 32, 16], input 2j's E2M1 index in the low
nibble of byte j and 2j + 1's in its high one, and `*_scales` uint8 [experts, out, in / 32], each block's
exponent e (w = value * 2^(e - 127)); everything else bfloat16, and config.json's quantization_config
{"quant_method": "mxfp4"}. The blocks are the gguf package's MXFP4 quantizer's (E2M1 values doubled,
times 2^(e - 128): the same e), repacked to this nibble order."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from tests.backend.models import tiny_model, write_tiny_causal_lm

PROJECTIONS = ("gate_up_proj", "down_proj")


def weighty_gpt_oss(model: torch.nn.Module | None = None) -> torch.nn.Module:
    """`tiny_model("gpt_oss")` (or `model`) with experts that move its logits (random initialization's
    barely do): weights and biases large enough that an expert read wrong changes the greedy tokens."""
    model = model if model is not None else tiny_model("gpt_oss")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.normal_(0, 0.3)
            layer.mlp.experts.down_proj.normal_(0, 0.3)
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.5)
    return model


def write_mxfp4_checkpoint(directory: Path, model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """A model directory the server loads: `tiny_model("gpt_oss")` (or `model`) in bfloat16 with its
    experts in MXFP4. Returns each experts' projection's weights as transformers dequantizes them, in
    float32 and transformers' [experts, in, out], by parameter name."""
    model = (model if model is not None else tiny_model("gpt_oss")).to(torch.bfloat16)
    write_tiny_causal_lm(directory, "gpt_oss", model)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    expected = {}
    for name in [name for name in tensors if name.endswith(PROJECTIONS)]:
        weights = tensors.pop(name).float().transpose(1, 2)  # [experts, out, in]
        blocks, scales = mxfp4_blocks(weights)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        expected[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "lm_head"],
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return expected


def mxfp4_blocks(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[experts, out, in] float weights as MXFP4's blocks [experts, out, in / 32, 16] and exponents
    [experts, out, in / 32], as gpt-oss's checkpoints keep them."""
    experts, out_features, in_features = weights.shape
    rows = quants.quantize(weights.reshape(-1, in_features).numpy(), GGMLQuantizationType.MXFP4)
    gguf_blocks = torch.from_numpy(np.ascontiguousarray(rows)).reshape(experts, out_features, -1, 17)
    packed = gguf_blocks[..., 1:]
    indices = torch.cat([packed & 0x0F, packed >> 4], dim=-1)  # the gguf package's: j and j + 16
    blocks = indices[..., 0::2] | indices[..., 1::2] << 4  # 2j low, 2j + 1 high
    return blocks.contiguous(), gguf_blocks[..., 0].contiguous()
