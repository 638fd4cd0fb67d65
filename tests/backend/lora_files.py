"""LoRA adapters as PEFT saves them (adapter_config.json and adapter_model.safetensors), written here by
PEFT itself for a given model, with random B matrices: PEFT starts B at zeros, which changes nothing."""

from __future__ import annotations

import copy
from pathlib import Path

import torch


def write_lora_adapter(
    directory: Path,
    model: torch.nn.Module,
    target_modules: list[str] | str = "all-linear",
    rank: int = 4,
    scale: float = 0.3,
    seed: int = 0,
    **config,
) -> torch.nn.Module:
    """A LoRA adapter of `model` (left as it is) saved in `directory`; the returned PEFT model, the
    adapter on a copy of `model`, is the reference its outputs are checked against. `scale`: the
    standard deviation of B's entries (0: an adapter that changes nothing); `config`: LoraConfig's
    other fields (use_rslora, alpha_pattern...)."""
    from peft import LoraConfig, get_peft_model  # here: importing PEFT takes 2.7 s of each worker's start

    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=target_modules, **config)
    peft_model = get_peft_model(copy.deepcopy(model), lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    peft_model.save_pretrained(directory)
    return peft_model.eval()


def default_model_shapes() -> torch.nn.Module:
    """A random model of the default model's shapes (SmolLM2-135M's), whose adapters the default model
    takes: reading its config from the GGUF file takes seconds, these are its numbers."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(config)
