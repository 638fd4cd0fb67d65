"""FP8 checkpoints of tiny models, as transformers' `fp8` quantization stores them ("-FP8" repositories):
each linear layer's `weight` in float8 e4m3 and a float32 `weight_scale_inv` for every 128 x 128 of it,
w = weight * weight_scale_inv."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.backend.models import tiny_model, write_tiny_causal_lm

FP8_MAX = 448.0  # e4m3's largest finite value
BLOCK = 128


def write_fp8_checkpoint(directory: Path, **extras) -> dict[str, torch.Tensor]:
    """A model directory of `tiny_model("llama", **extras)` with its projections in FP8, each 128 x 128
    block scaled to its largest weight; returns each layer's weights as transformers dequantizes them."""
    write_tiny_causal_lm(directory, "llama")
    model = tiny_model("llama", **extras)
    model.save_pretrained(directory)  # the config of these sizes
    tensors, expected = {}, {}
    for name, parameter in model.state_dict().items():
        module = name.removesuffix(".weight")
        linear = name.endswith(".weight") and type(model.get_submodule(module)) is torch.nn.Linear
        if not linear or module == "lm_head":
            tensors[name] = parameter.contiguous()
            continue
        out_features, in_features = parameter.shape
        rows, columns = -(-out_features // BLOCK), -(-in_features // BLOCK)
        padded = torch.zeros(rows * BLOCK, columns * BLOCK)
        padded[:out_features, :in_features] = parameter
        largest = padded.reshape(rows, BLOCK, columns, BLOCK).abs().amax(dim=(1, 3))
        scale = (largest / FP8_MAX).clamp_min(1e-12)
        spread = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:out_features, :in_features]
        fp8 = (parameter / spread).to(torch.float8_e4m3fn)
        tensors[name], tensors[f"{module}.weight_scale_inv"] = fp8, scale
        expected[module] = fp8.float() * spread
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return expected
