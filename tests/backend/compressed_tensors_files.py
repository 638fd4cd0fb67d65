"""compressed-tensors checkpoints of tiny models, written by the compressed-tensors library itself (a
development requirement only: the server reads them without it), and the library's own dequantization
to read them back with.

As llm-compressor writes one: the scheme applied to the model's Linear layers but its head
(`apply_quantization_config`), each layer's scales and zero points from its weights' min and max
(`calculate_qparams`, what llm-compressor's default observer computes; GPTQ's refinement of them
changes no byte of the format), then `ModelCompressor.compress_model`, `save_pretrained` and
`update_config`. The model is bfloat16 first, as the checkpoints published are, so that the scales are
bfloat16 too."""

from __future__ import annotations

from pathlib import Path

import torch
from compressed_tensors.compressors import BaseCompressor, ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams
from compressed_tensors.utils import get_direct_state_dict

from tests.backend.models import tiny_model, write_tiny_causal_lm


def int_weights(bits: int, strategy: str, group_size: int | None = None, symmetric: bool = True) -> dict:
    return dict(num_bits=bits, type="int", strategy=strategy, group_size=group_size, symmetric=symmetric)


DYNAMIC_TOKENS = dict(num_bits=8, strategy="token", dynamic=True, symmetric=True)

SCHEMES = {  # name: (weights, input activations); the library picks each one's format (see FORMATS)
    "w4a16-group-symmetric": (int_weights(4, "group", 32), None),
    "w4a16-group-asymmetric": (int_weights(4, "group", 64, symmetric=False), None),
    "w4a16-channel-asymmetric": (int_weights(4, "channel", symmetric=False), None),
    "w8a16-channel": (int_weights(8, "channel"), None),
    "w8a8-channel": (int_weights(8, "channel"), dict(type="int", **DYNAMIC_TOKENS)),
    "fp8-dynamic": (dict(num_bits=8, type="float", strategy="channel"), dict(type="float", **DYNAMIC_TOKENS)),
    "fp8-tensor": (dict(num_bits=8, type="float", strategy="tensor"), dict(type="float", **DYNAMIC_TOKENS)),
    # llm-compressor's FP8_BLOCK: a scale for every 128 x 128 weights, inputs a scale a 128 of a token
    "fp8-block": (
        dict(num_bits=8, type="float", strategy="block", block_structure=[128, 128]),
        dict(num_bits=8, type="float", strategy="group", group_size=128, dynamic=True, symmetric=True),
    ),
}
FORMATS = {
    "w4a16-group-symmetric": "pack-quantized",
    "w4a16-group-asymmetric": "pack-quantized",
    "w4a16-channel-asymmetric": "pack-quantized",
    "w8a16-channel": "pack-quantized",
    "w8a8-channel": "int-quantized",
    "fp8-dynamic": "float-quantized",
    "fp8-tensor": "float-quantized",
    "fp8-block": "float-quantized",
}
# The sizes of the model each scheme is written over, where not tiny_model's own
SIZES = {"fp8-block": dict(hidden_size=256, intermediate_size=384, head_dim=64)}


def observe(weight: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's min and max per group, channel or tensor, shaped as its scale."""
    if args.strategy == "group":
        groups = weight.unflatten(-1, (-1, args.group_size))
        return groups.amin(dim=-1), groups.amax(dim=-1)
    if args.strategy == "channel":
        return weight.amin(dim=-1, keepdim=True), weight.amax(dim=-1, keepdim=True)
    if args.strategy == "block":
        rows, columns = args.block_structure
        blocks = weight.unflatten(0, (-1, rows)).unflatten(-1, (-1, columns))
        return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    return weight.amin().reshape(1), weight.amax().reshape(1)


def write_compressed_checkpoint(directory: Path, scheme: str) -> dict[str, torch.Tensor]:
    """A model directory the server loads: `tiny_model("llama")` in bfloat16 (with the marker tokenizer
    of `write_tiny_causal_lm`), its projections stored as compressed-tensors stores `scheme`. Returns
    each quantized layer's weights as the library dequantizes them with its scales in float32, by module
    name."""
    weights, inputs = SCHEMES[scheme]
    model = tiny_model("llama", **SIZES.get(scheme, {})).to(torch.bfloat16)
    group = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**weights),
        input_activations=None if inputs is None else QuantizationArgs(**inputs),
    )
    config = QuantizationConfig(config_groups={"group_0": group}, ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    quantized = {name: m for name, m in model.named_modules() if hasattr(m, "quantization_scheme")}
    with torch.no_grad():
        for module in quantized.values():
            args = module.quantization_scheme.weights
            scale, zero_point = calculate_qparams(*observe(module.weight, args), args)
            module.weight_scale.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    compressor.remove_decompression_hook(model)
    expected = {name: library_dequantize(module) for name, module in quantized.items()}
    write_tiny_causal_lm(directory, "llama", model)
    compressor.update_config(directory)
    return expected


def library_dequantize(module: torch.nn.Module) -> torch.Tensor:
    """The library's decompression of one compressed layer (its format's `decompress`, which unpacks and
    calls quantization/lifecycle/forward.py's `dequantize`), its scale in float32: [out, in] float32."""
    scheme = module.quantization_scheme
    state_dict = dict(get_direct_state_dict(module))
    state_dict["weight_scale"] = state_dict["weight_scale"].float()
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    return compressor.decompress(state_dict, scheme)["weight"].float()
