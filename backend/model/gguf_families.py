"""GGUF files of served families that transformers' GGUF reader refuses or reads short: its tables lent
what they lack while a model loads.

transformers reads a GGUF file's configuration through a table of each architecture's keys, and refuses
an architecture it has none for ("GGUF model with architecture smollm3 is not supported yet"), though it
has the family's classes, reads its tokenizer by the file's tokenizer model, and gguf's map of
llama.cpp's tensor names covers its weights. Within `lent_to_transformers` its tables also have:

- the architectures it has no table for (`MORE_ARCHITECTURES`): SmolLM3, Granite, OLMo 2, Seed-OSS,
  ERNIE 4.5, Command R7B (Cohere 2), EXAONE 4.0, Arcee AFM and OLMoE. Where llama.cpp's converter
  permuted q's and k's rows for its rotary layout (LlamaModel's subclasses: SmolLM3, Granite, Arcee),
  Llama's processor undoes it; OLMoE's experts Qwen2-MoE's processor joins.
- keys it leaves unread for architectures it reads (`MORE_KEYS`): StarCoder 2's and StableLM's rotary
  base (StarCoder 2's released ones are 1e5 and 1e6, read as 10,000), Qwen2-MoE's and Qwen3-MoE's
  experts' widths (read as Qwen1.5-MoE-A2.7B's and Qwen3-30B-A3B's whatever the file: Qwen3-235B's failed
  with a size mismatch), Qwen's head width, and Gemma 2's soft-caps (read as the released models' 50
  and 30 whatever the file).

`with_files_fields` then gives the configuration what no key of a table can: which projections have
biases (from the file's tensors: a configuration without them would leave them unread without a word),
which layers attend through a window, and Gemma 2's and 3's attention scale at 27B (llama.cpp's rule:
no key says it), and Ministral 3's scaling of its queries. A file that is another architecture's for its
text (Qwen3-VL's text model, a Qwen3's; Ministral 3's, a Llama's) is presented as that architecture by
its reader (gguf_parsing.PRESENTED_AS).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
from transformers import CONFIG_MAPPING, PretrainedConfig
from transformers import modeling_gguf_pytorch_utils as transformers_gguf
from transformers.modeling_gguf_pytorch_utils import (
    Qwen2MoeTensorProcessor,
    read_field,
)

from backend.model.architectures import UnsupportedModel
from backend.quant.gguf_weights import ROW_ONLY_PROCESSORS

# TextModel.set_gguf_parameters' keys (the table transformers keeps for Llama's), with the head width
COMMON_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": None,
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.value_length": None,
    "vocab_size": "vocab_size",
}
MORE_ARCHITECTURES: dict[str, dict[str, str | None]] = {
    "smollm3": COMMON_KEYS,
    # Granite has no head width of its own (the converter drops it); its four multipliers are scales here
    "granite": COMMON_KEYS
    | {
        "attention.key_length": None,
        "attention.scale": "attention_multiplier",
        "embedding_scale": "embedding_multiplier",
        "residual_scale": "residual_multiplier",
        "logit_scale": "logits_scaling",
    },
    "olmo2": COMMON_KEYS,
    "seed_oss": COMMON_KEYS,
    "ernie4_5": COMMON_KEYS,
    "cohere2": COMMON_KEYS
    | {
        "attention.layer_norm_epsilon": "layer_norm_eps",
        "attention.sliding_window": "sliding_window",
        "logit_scale": "logit_scale",
    },
    "exaone4": COMMON_KEYS | {"attention.sliding_window": "sliding_window"},
    "arcee": COMMON_KEYS,
    "olmoe": COMMON_KEYS | {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok"},
}
# converted by LlamaModel's subclasses: their q's and k's rows permuted (the default mode's blocks too)
PERMUTED_ROWS = tuple(name for name in MORE_ARCHITECTURES if name in ROW_ONLY_PROCESSORS)
# Experts stacked as Qwen2-MoE's (blk.N.ffn_{gate,up,down}_exps), which transformers' Qwen2-MoE processor
# joins into the model's gate_up_proj and down_proj: converted whole (gguf_conversion.py)
EXPERTS_AS_QWEN2_MOE = ("olmoe",)
MORE_KEYS: dict[str, dict[str, str | None]] = {
    "starcoder2": {"rope.freq_base": "rope_theta"},
    "stablelm": {"rope.freq_base": "rope_theta"},
    "qwen3_moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "qwen2_moe": {
        "expert_feed_forward_length": "moe_intermediate_size",
        "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
        "attention.key_length": "head_dim",
    },
    "qwen3": {"attention.key_length": "head_dim"},
    "gemma2": {
        "attn_logit_softcapping": "attn_logit_softcapping",
        "final_logit_softcapping": "final_logit_softcapping",
    },
    "gemma3": {"final_logit_softcapping": "final_logit_softcapping"},
}


@contextlib.contextmanager
def lent_to_transformers() -> Iterator[None]:
    """Within it, transformers' GGUF reader has the tables of MORE_ARCHITECTURES and MORE_KEYS too (and
    the Llama processor for PERMUTED_ROWS); its own tables as they were after it."""
    tables = transformers_gguf.GGUF_TO_TRANSFORMERS_MAPPING["config"]
    supported = transformers_gguf.GGUF_SUPPORTED_ARCHITECTURES
    processors = transformers_gguf.TENSOR_PROCESSORS
    saved = (dict(tables), list(supported), dict(processors))
    tables.update(MORE_ARCHITECTURES)
    tables.update({architecture: tables[architecture] | keys for architecture, keys in MORE_KEYS.items()})
    supported.extend(MORE_ARCHITECTURES)
    processors.update({name: ROW_ONLY_PROCESSORS[name] for name in PERMUTED_ROWS})
    processors.update(dict.fromkeys(EXPERTS_AS_QWEN2_MOE, Qwen2MoeTensorProcessor))
    try:
        yield
    finally:
        for table, kept in zip((tables, processors), (saved[0], saved[2]), strict=True):
            table.clear()
            table.update(kept)
        supported[:] = saved[1]


# A projection's bias, named by the file's first layer's tensor, and the configuration's field that says it
BIASES = {
    "granite": {"attention_bias": "attn_q.bias", "mlp_bias": "ffn_up.bias"},
    "olmo2": {"attention_bias": "attn_q.bias"},
    "seed_oss": {
        "attention_bias": "attn_q.bias",
        "attention_out_bias": "attn_output.bias",
        "mlp_bias": "ffn_up.bias",
    },
    "ernie4_5": {"use_bias": "attn_q.bias"},
    "smollm3": {"attention_bias": "attn_q.bias", "mlp_bias": "ffn_up.bias"},
    "arcee": {"attention_bias": "attn_q.bias", "mlp_bias": "ffn_up.bias"},
}


def with_files_fields(path: Path, config: PretrainedConfig) -> PretrainedConfig:
    """`config` (transformers' reading of the file, with the tables lent) with what the file says beyond
    its keys' table: its biases, its window layers, Gemma's attention scale at 27B."""
    reader = gguf.GGUFReader(str(path))
    architecture = read_field(reader, "general.architecture")[0]  # (as presented: gguf_parsing.py)
    own = getattr(reader, "presented_from", architecture)
    if own not in BIASES and own not in FIXES:
        return config
    read = config.to_dict()

    def values(key: str) -> list | None:
        return read_field(reader, f"{architecture}.{key}") or None

    FIXES.get(own, no_more)(values, read, path.name)
    names = {tensor.name for tensor in reader.tensors}
    for field, tensor in BIASES.get(own, {}).items():
        read[field] = f"blk.0.{tensor}" in names
    return CONFIG_MAPPING[read["model_type"]](
        **{key: value for key, value in read.items() if key != "model_type"}
    )


Values = Callable[[str], list | None]  # a key's values in the file (None: no such key)


def no_more(values: Values, read: dict, name: str) -> None:
    """What the lent table reads is all there is."""


def olmo2_fields(values: Values, read: dict, name: str) -> None:
    """llama.cpp writes OLMo 3 (window layers beside global ones) as "olmo2" too, with its window."""
    if values("attention.sliding_window") is not None:
        raise UnsupportedModel(
            f'{name} is an OLMo 3 file (an "olmo2" file with window layers): not served from GGUF; serve '
            "its safetensors checkpoint"
        )


def window_layers(values: Values, read: dict, name: str) -> None:
    """EXAONE 4.0's window layers, where it has any (32B's three of four; 1.2B's none): the converter
    writes a bool a layer (`attention.sliding_window_pattern`)."""
    pattern = values("attention.sliding_window_pattern")
    if values("attention.sliding_window") is None or pattern is None:
        read["sliding_window"], read["sliding_window_pattern"] = None, None
        read["layer_types"] = ["full_attention"] * read["num_hidden_layers"]
    else:
        read["layer_types"] = ["sliding_attention" if sliding else "full_attention" for sliding in pattern]


def gemma_attention_scale(values: Values, read: dict, name: str) -> None:
    """Gemma 2 27B and Gemma 3 27B scale attention by their width a head (4,608 / 32 and 5,376 / 32), not
    by their heads' 128, and no key says so: llama.cpp tells them by their layer count (46 and 62)."""
    layers_27b = {"gemma2": 46, "gemma3": 62}[read["model_type"].removesuffix("_text")]
    if read["num_hidden_layers"] == layers_27b:
        read["query_pre_attn_scalar"] = read["hidden_size"] // read["num_attention_heads"]
    else:
        read["query_pre_attn_scalar"] = read["head_dim"]


def ministral3_fields(values: Values, read: dict, name: str) -> None:
    """A "mistral3" file with a temperature of its queries is Ministral 3's text model: its queries scaled by
    1 + beta log(1 + floor(p / original context)) (`llama_4_scaling_beta`), its YaRN gguf_rope.py reads.
    Without one, it is Mistral Small 3.1's or 3.2's: a Mistral, served as Llama (the same layers)."""
    beta = values("attention.temperature_scale")
    if beta is not None:
        read["model_type"] = "ministral3"
        read["rope_parameters"] = read["rope_parameters"] | {"llama_4_scaling_beta": float(beta[0])}


FIXES: dict[str, Callable[[Values, dict, str], None]] = {
    "mistral3": ministral3_fields,
    "olmo2": olmo2_fields,
    "exaone4": window_layers,
    "gemma2": gemma_attention_scale,
    "gemma3": gemma_attention_scale,
}
