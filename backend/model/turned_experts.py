"""The text model's weights of a multimodal checkpoint whose files keep its experts turned: Qwen3-VL-MoE's.

Qwen's Qwen3-VL-MoE files keep each layer's experts as [experts, hidden, 2 x
width] (gate and up) and [experts, width, hidden] (down): the layout of
transformers 4's module, which transformers 5 turns as it loads them for the
composite's own class (its `qwen3_vl_moe` conversion). The server loads the
text model alone as Qwen3-MoE's (architectures.TEXT_AS), whose module keeps
[experts, 2 x width, hidden] and [experts, hidden, width] and whose loading
turns nothing: so the text model's weights are read here, renamed from the
composite's names, and the experts turned where their shape is the other
layout's (a file saved by transformers 5 keeps the module's already).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from backend.quant.group_wise import checkpoint_files

EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


def read_text_weights(
    directory: Path, patterns: dict[str, str], config: PretrainedConfig
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The weights in `directory`'s safetensors files that `patterns` (TEXT_ALONE's) rename to the text
    model's names, by those names, the experts as `config`'s module keeps them; and the names of those
    left unread (the towers')."""
    weights, unread = {}, []
    for path in checkpoint_files(str(directory)):
        with safe_open(path, framework="pt") as opened:
            for key in opened.keys():  # noqa: SIM118 (a safetensors file is no dict)
                name = renamed(key, patterns)
                if name is None:
                    unread.append(key)
                else:
                    weights[name] = as_module_keeps(name, opened.get_tensor(key), config)
    return weights, unread


def renamed(key: str, patterns: dict[str, str]) -> str | None:
    """The text model's name of a weight: as a pattern renames it, the head's as it is (transformers 5 names
    it `lm_head.` in the composite too); None for a tower's."""
    for pattern, replacement in patterns.items():
        name, count = re.subn(pattern, replacement, key)
        if count:
            return name
    return key if key.startswith("lm_head.") else None


def as_module_keeps(name: str, weight: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    """An experts' weight turned to the module's layout where it is stored the other way; others as they
    are."""
    found = EXPERTS.search(name)
    if found is None:
        return weight
    width, hidden = config.moe_intermediate_size, config.hidden_size
    rows, inputs = (2 * width, hidden) if found.group(1) == "gate_up_proj" else (hidden, width)
    if weight.shape[1:] == (inputs, rows) and weight.shape[1:] != (rows, inputs):
        return weight.transpose(1, 2).contiguous()
    return weight
