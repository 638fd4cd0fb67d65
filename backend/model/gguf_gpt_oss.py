"""GGUF files of gpt-oss (ggml-org's gpt-oss-20b and -120b files: experts MXFP4, the rest Q8_0 or F16).

transformers' GGUF reader leaves a gpt-oss file's experts unread (its processor looks for tensors named
`ffn_*_projs`, which llama.cpp's converter does not write), fails on its rotary scaling fields (they are
withheld from it: model/gguf_parsing.py), and reads its configuration's window, head width and rotary
scaling as gpt-oss-20b's defaults whatever the file says. Here the configuration takes the file's
`attention.sliding_window`, `attention.key_length` and rotary scaling (YaRN where the file has it, with
gpt-oss's own `truncate` off; none where it has none), and the weights are read as the
converter writes them: the experts' `blk.N.ffn_{gate,up,down}_exps` weights [experts, out, in] and their
biases, gate and up split from transformers' gate_up (whose outputs interleave them: gate j at 2j, up j
at 2j + 1) and interleaved again here, each expert's weights transposed to transformers' [in, out]; the
attention sinks `blk.N.attn_sinks.weight`; everything else by transformers' own name map. The default
mode then serves the experts from the file's blocks (quant/gguf_weights.py: MXFP4's, exactly).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import torch
from transformers import GptOssConfig, GptOssForCausalLM, PretrainedConfig
from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

from backend.model.architectures import UnsupportedModel
from backend.model.gguf_conversion import floats
from backend.model.gguf_parsing import architecture_fields, is_architecture
from backend.quant import gguf_weights

ARCHITECTURE = "gpt-oss"
PARTS = ("gate", "up", "down")


def is_gpt_oss(path: Path) -> bool:
    return is_architecture(path, ARCHITECTURE)


def gpt_oss_config(path: Path, config: PretrainedConfig) -> GptOssConfig:
    """`config` (transformers' reading of the file) with the file's window, head width and rotary
    scaling."""
    field = architecture_fields(gguf.GGUFReader(str(path)), ARCHITECTURE)
    read = config.to_dict()
    read["sliding_window"] = field("attention.sliding_window") or config.sliding_window
    read["head_dim"] = field("attention.key_length") or config.head_dim
    theta = field("rope.freq_base") or config.rope_parameters["rope_theta"]
    if field("rope.scaling.type") == "yarn":
        read["rope_parameters"] = {  # gpt-oss's own YaRN (truncate off), at the file's factor and length
            **GptOssConfig().rope_parameters,
            "rope_theta": float(theta),
            "factor": float(field("rope.scaling.factor")),
            "original_max_position_embeddings": int(field("rope.scaling.original_context_length")),
        }
        for key in ("beta_fast", "beta_slow"):
            if field(f"rope.scaling.yarn_{key}") is not None:
                read["rope_parameters"][key] = float(field(f"rope.scaling.yarn_{key}"))
    else:
        read["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta)}
    return GptOssConfig(**{key: value for key, value in read.items() if key != "model_type"})


def experts_left_to_blocks(path: Path, config: GptOssConfig) -> int:
    """The experts' parameters that `read_gpt_oss(experts_in_blocks=True)` leaves as placeholders (for the
    start's check: they are never floats)."""
    tensors = {tensor.name: tensor for tensor in gguf.GGUFReader(str(path)).tensors}
    experts, width, hidden = config.num_local_experts, config.intermediate_size, config.hidden_size
    served = [
        gguf_weights.experts_in_blocks(tensors, layer, experts) for layer in range(config.num_hidden_layers)
    ]
    return sum(served) * experts * 3 * width * hidden


def read_gpt_oss(
    path: Path, config: GptOssConfig, experts_in_blocks: bool = False, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Every weight of the gpt-oss in `path`, in float32, by transformers' names (module docstring);
    `experts_in_blocks`: the experts' weights of each layer whose blocks the default mode will serve
    (`gguf_weights.experts_in_blocks`) are placeholders of their shape that hold no memory (gpt-oss-20b's
    are 77 GB in float32), as an MXFP4 checkpoint's are (quant/mxfp4_checkpoint.py), in `dtype`: the
    model's, or a cast would make them whole."""
    tensors = {tensor.name: tensor for tensor in gguf.GGUFReader(str(path)).tensors}
    with torch.device("meta"):  # names and shapes only
        skeleton = GptOssForCausalLM(config)
    weights = {}
    for key, name in get_gguf_hf_weights_map(skeleton, TensorProcessor()).items():
        if ".experts." in name:
            continue
        tensor = tensors.get(key) or tensors.get(f"{key}.weight")  # the sinks: "blk.N.attn_sinks.weight"
        if tensor is not None:
            weights[name] = floats(tensor)
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_bias, up_bias, down_bias = (part_of(path, tensors, layer, part, "bias") for part in PARTS)
        if experts_in_blocks and gguf_weights.experts_in_blocks(tensors, layer, config.num_local_experts):
            experts, width = config.num_local_experts, config.intermediate_size
            shapes = {
                "gate_up_proj": (config.hidden_size, 2 * width),
                "down_proj": (width, config.hidden_size),
            }
            for name, shape in shapes.items():
                weights[f"{prefix}.{name}"] = torch.zeros((), dtype=dtype).expand(experts, *shape)
        else:
            gate, up, down = (part_of(path, tensors, layer, part, "weight") for part in PARTS)
            weights[f"{prefix}.gate_up_proj"] = interleaved(gate, up).transpose(1, 2)  # [experts, in, out]
            weights[f"{prefix}.down_proj"] = down.transpose(1, 2)
        weights[f"{prefix}.gate_up_proj_bias"] = interleaved(gate_bias, up_bias)
        weights[f"{prefix}.down_proj_bias"] = down_bias
    return weights


def part_of(path: Path, tensors: dict, layer: int, part: str, kind: str) -> torch.Tensor:
    """One projection's stacked weights [experts, out, in] or biases [experts, out], in float32."""
    name = f"blk.{layer}.ffn_{part}_exps.{kind}"
    if name not in tensors:
        raise UnsupportedModel(f"{Path(path).name} is a gpt-oss file without {name}")
    return floats(tensors[name])


def interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gate's and up's outputs (dimension 1) as transformers' gate_up keeps them: gate j at 2j, up j at
    2j + 1."""
    return torch.stack((gate, up), dim=2).flatten(1, 2)
