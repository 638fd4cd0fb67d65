"""GGUF files of Mixtral, which llama.cpp writes as "llama" with experts beside the layers.

transformers reads such a file as a Llama whose MLPs it finds no weights for (loader.py refuses that).
Here its configuration becomes Mixtral's (`llama.expert_count` experts, `llama.expert_used_count` of
them a token), its attention, norms, embedding and head come from transformers' own GGUF reader (the
Llama rows' permutation undone), and its experts are read as llama.cpp's converter stacks them:
`blk.N.ffn_{gate,up,down}_exps`, [experts, rows, inputs], the router `blk.N.ffn_gate_inp`. Files of
llama.cpp's first Mixtral conversions keep one tensor an expert (`blk.N.ffn_gate.E.weight`): those are
read too. The default mode then serves the experts from the file's blocks (quant/gguf_weights.py).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, PretrainedConfig
from transformers.modeling_gguf_pytorch_utils import (
    LlamaTensorProcessor,
    TensorProcessor,
    get_gguf_hf_weights_map,
    read_field,
)

from backend.model.architectures import UnsupportedModel
from backend.model.gguf_conversion import floats
from backend.quant.gguf_weights import expert_tensors

PARTS = ("gate", "up", "down")  # llama.cpp's w1, w3 and w2
LLAMA_ONLY = ("model_type", "architectures")  # of the configuration transformers read


def has_experts(path: Path) -> bool:
    """A "llama" file with experts: a Mixtral, as llama.cpp writes one."""
    reader = gguf.GGUFReader(str(path))
    experts = read_field(reader, "llama.expert_count") or [0]  # a dense file may say 0
    return read_field(reader, "general.architecture") == ["llama"] and experts[0] > 0


def mixtral_config(path: Path, llama: PretrainedConfig) -> MixtralConfig:
    """The Mixtral configuration of the file whose Llama configuration transformers read as `llama`."""
    reader = gguf.GGUFReader(str(path))
    fields = {key: value for key, value in llama.to_dict().items() if key not in LLAMA_ONLY}
    return MixtralConfig(
        **fields,
        num_local_experts=read_field(reader, "llama.expert_count")[0],
        num_experts_per_tok=read_field(reader, "llama.expert_used_count")[0],
        architectures=["MixtralForCausalLM"],
    )


def read_mixtral(path: Path, config: MixtralConfig) -> dict[str, torch.Tensor]:
    """Every weight of the Mixtral in `path`, in float32, by transformers' names: each tensor dequantized
    once (transformers' own reader would dequantize the experts too, only to drop them)."""
    tensors = {tensor.name: tensor for tensor in gguf.GGUFReader(str(path)).tensors}
    names, processor = llama_names(config)
    weights = {name: floats(tensors[key], processor) for key, name in names.items() if key in tensors}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp"
        weights[f"{prefix}.gate.weight"] = floats(tensors[f"blk.{layer}.ffn_gate_inp.weight"])
        gate, up, down = (experts(path, tensors, layer, part, config.num_local_experts) for part in PARTS)
        weights[f"{prefix}.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        weights[f"{prefix}.experts.down_proj"] = down
    return weights


def llama_names(config: MixtralConfig) -> tuple[dict[str, str], TensorProcessor]:
    """GGUF name to transformers name of the tensors a Llama of the same attention has (all but the
    experts and router: transformers' map of llama.cpp's names), and the processor that undoes the
    permutation of q's and k's rows."""
    llama = LlamaConfig(**{key: value for key, value in config.to_dict().items() if key != "model_type"})
    with torch.device("meta"):  # names and shapes only
        skeleton = LlamaForCausalLM(llama)
    processor = LlamaTensorProcessor(config=llama.to_dict())
    names = get_gguf_hf_weights_map(skeleton, processor)
    return {key: name for key, name in names.items() if ".mlp." not in name}, processor


def experts(path: Path, tensors: dict, layer: int, part: str, count: int) -> torch.Tensor:
    """One projection of a layer's experts as [experts, rows, inputs] float32."""
    found = expert_tensors(tensors, layer, part, count)
    if found is None:
        raise UnsupportedModel(
            f"{Path(path).name} says it has experts but holds no blk.{layer}.ffn_{part}_exps.weight, nor one "
            "such tensor an expert"
        )
    if len(found) == 1:
        return floats(found[0])
    return torch.stack([floats(tensor) for tensor in found])
