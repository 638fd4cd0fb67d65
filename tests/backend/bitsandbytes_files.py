"""bitsandbytes checkpoints of tiny models, quantized and saved by the library itself through transformers
(a development requirement only: the server reads them without it), and the library's own
dequantization to read them back with.

As a "-bnb-4bit" repository is made: the model (bfloat16 first, as the published ones are) loaded with
transformers' BitsAndBytesConfig on the CPU, then `save_pretrained`."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from tests.backend.models import tiny_model, write_tiny_causal_lm

SCHEMES = {  # name: BitsAndBytesConfig's options
    "nf4-double-quant": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "int8": dict(load_in_8bit=True),
}


def write_bitsandbytes_checkpoint(directory: Path, scheme: str) -> dict[str, torch.Tensor]:
    """A model directory the server loads: `tiny_model("llama")` in bfloat16 (with the marker tokenizer of
    `write_tiny_causal_lm`) quantized as `scheme` by bitsandbytes. Returns each quantized layer's weights
    as the library dequantizes them, in float32, by module name."""
    import bitsandbytes  # inside: importing it logs a warning about optional CPU kernels

    source = write_tiny_causal_lm(
        directory.with_name(f"{directory.name}-source"), "llama", tiny_model("llama")
    )
    model = AutoModelForCausalLM.from_pretrained(
        source,
        dtype=torch.bfloat16,
        quantization_config=BitsAndBytesConfig(**SCHEMES[scheme]),
        device_map="cpu",
    )
    expected = {}
    for name, module in model.named_modules():
        if isinstance(module, bitsandbytes.nn.Linear4bit):
            state = copy.copy(module.weight.quant_state)
            state.dtype = torch.float32  # the library's products before its cast to the model's dtype
            expected[name] = bitsandbytes.functional.dequantize_4bit(module.weight.data, state)
        elif isinstance(module, bitsandbytes.nn.Linear8bitLt):
            expected[name] = bitsandbytes.functional.int8_vectorwise_dequant(
                module.weight.data, module.weight.SCB
            )
    write_tiny_causal_lm(directory, "llama", model)
    return expected
