"""GGUF files of tiny transformers models, written as llama.cpp's convert_hf_to_gguf.py writes them.

The converter reads a model's config.json and safetensors; here the model itself stands in for them:
`model.config.to_dict()` is its config.json, and its state dict less the tied head is its safetensors.
Each family gets what its converter class writes: the metadata keys (TextModel's common ones, or the
class's own where it writes its own), the tensors under llama.cpp's names with the class's changes to
their values (Llama's q/k rows permuted for its rotary layout, Gemma's norms stored as 1 + w, Falcon's
query/key/value rows regrouped, GPT-2's Conv1D weights transposed, Qwen3-MoE's experts split into
gate and up), and a tokenizer that transformers' GGUF tokenizer conversion reads: the byte-level BPE
vocabulary of another GGUF file cut to the model's vocabulary, merges and all, or for Gemma, whose
converters write a sentencepiece vocabulary, one built from that vocabulary's words.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from gguf import (
    GGMLQuantizationType,
    GGUFWriter,
    Keys,
    LlamaFileType,
    TokenType,
    get_tensor_name_map,
)
from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES

from tests.backend.k_quants import quantize

# transformers' model_type -> the llama.cpp architecture its converter writes it as. Mistral is converted
# by LlamaModel (the same layers), so its files say "llama".
GGUF_ARCHITECTURES: dict[str, MODEL_ARCH] = {
    "llama": MODEL_ARCH.LLAMA,
    "mistral": MODEL_ARCH.LLAMA,
    "mixtral": MODEL_ARCH.LLAMA,  # LlamaModel too, its experts stacked beside the layers
    "qwen2": MODEL_ARCH.QWEN2,
    "qwen3": MODEL_ARCH.QWEN3,
    "qwen3_moe": MODEL_ARCH.QWEN3MOE,
    "phi3": MODEL_ARCH.PHI3,
    "gemma2": MODEL_ARCH.GEMMA2,
    "gemma3_text": MODEL_ARCH.GEMMA3,
    "falcon": MODEL_ARCH.FALCON,
    "gpt2": MODEL_ARCH.GPT2,
    "mamba": MODEL_ARCH.MAMBA,
    "gpt_oss": MODEL_ARCH.GPT_OSS,
    "lfm2": MODEL_ARCH.LFM2,
    "starcoder2": MODEL_ARCH.STARCODER2,
    "stablelm": MODEL_ARCH.STABLELM,
    "nemotron": MODEL_ARCH.NEMOTRON,
    "qwen2_moe": MODEL_ARCH.QWEN2MOE,
    # transformers' GGUF reader has no table for these (model/gguf_families.py lends it theirs)
    "smollm3": MODEL_ARCH.SMOLLM3,
    "granite": MODEL_ARCH.GRANITE,
    "olmo2": MODEL_ARCH.OLMO2,
    "seed_oss": MODEL_ARCH.SEED_OSS,
    "ernie4_5": MODEL_ARCH.ERNIE4_5,
    "cohere2": MODEL_ARCH.COHERE2,
    "exaone4": MODEL_ARCH.EXAONE4,
    "ministral3": MODEL_ARCH.MISTRAL3,
    "arcee": MODEL_ARCH.ARCEE,
    "olmoe": MODEL_ARCH.OLMOE,  # (Mistral3Model's, as it writes Mistral Small 3.1's Mistral too)
}

Metadata = dict[str, object]  # key -> value; ints are written as uint32, floats as float32, lists as arrays


def write_tiny_gguf(
    path: Path,
    model: torch.nn.Module,
    tokenizer_source: Path,
    weight_type: GGMLQuantizationType | Callable[[str], GGMLQuantizationType] = GGMLQuantizationType.F32,
    leave_out: str | None = None,
    one_tensor_an_expert: bool = False,
    architecture: MODEL_ARCH | None = None,
) -> Path:
    """Write `model` (a tiny float32 transformers causal LM of a family in GGUF_ARCHITECTURES) to `path` as
    a complete GGUF file, with the tokenizer of the GGUF file `tokenizer_source` cut to the model's
    vocabulary. `weight_type` Q8_0 stores the 2-D weights in Q8_0 blocks, as `--outtype q8_0` does;
    1-D ones (norms, biases) stay F32 as llama.cpp keeps them. A function of the GGUF tensor name gives
    each 2-D weight its own type, as llama-quantize's mixes do (`q4_k_m`). `leave_out`: a tensor's GGUF
    name not to write (a file whose weights transformers finds some of). `one_tensor_an_expert`: experts
    as llama.cpp's first Mixtral conversions wrote them (`blk.N.ffn_gate.E.weight`), not stacked.
    `architecture`: another whose files hold the family's text model (QWEN_VL_TEXT), with its keys."""
    hparams = model.config.to_dict()
    model_type = hparams["model_type"]
    if model_type not in GGUF_ARCHITECTURES:
        raise ValueError(f"no llama.cpp conversion written here for {model_type!r}")
    arch = architecture or GGUF_ARCHITECTURES[model_type]
    writer = GGUFWriter(str(path), MODEL_ARCH_NAMES[arch])
    # Not the family's name: transformers reads a "llama" file named exactly "mistral" as Mistral, a
    # name no converted Mistral has.
    writer.add_name(f"tiny {model_type}")
    file_type = {
        GGMLQuantizationType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
        q4_k_m: LlamaFileType.MOSTLY_Q4_K_M,
    }.get(weight_type, LlamaFileType.ALL_F32)
    metadata = METADATA[model_type](hparams) | {Keys.General.FILE_TYPE: int(file_type)}
    metadata |= QWEN_VL_TEXT.get(arch, {})
    add_metadata(writer, metadata, MODEL_ARCH_NAMES[arch])
    add_tokenizer(writer, tokenizer_source, hparams)
    names = get_tensor_name_map(arch, hparams.get("num_hidden_layers") or hparams["n_layer"])
    for name, tensor in converted_tensors(model, hparams):
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if one_tensor_an_expert and gguf_name.endswith("_exps.weight"):
            for expert, weight in enumerate(tensor):
                add_tensor(writer, gguf_name.replace("_exps.", f".{expert}."), weight, weight_type)
        elif gguf_name != leave_out:
            add_tensor(writer, gguf_name, tensor, weight_type)
    for gguf_name, tensor in EXTRA_TENSORS.get(model_type, no_extra_tensors)(hparams):
        if gguf_name != leave_out:
            add_tensor(writer, gguf_name, tensor, weight_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_metadata(writer: GGUFWriter, metadata: Metadata, arch: str) -> None:
    for key, value in metadata.items():
        key = key.format(arch=arch)
        if isinstance(value, list):  # (LFM2's key heads, one count a layer)
            writer.add_array(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)


# Tensors llama.cpp keeps in F32 whatever the file's type (TextModel.prepare_tensors): the routers and
# GPT-2's position embedding, besides every 1-D tensor.
KEPT_F32 = ("ffn_gate_inp.weight", "position_embd.weight")


# llama-quantize's types for rows that are no whole number of a K-quant's 256 (llama_tensor_get_type)
K_QUANT_FALLBACKS = {
    GGMLQuantizationType.Q4_K: GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_K: GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q6_K: GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q3_K: GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q2_K: GGMLQuantizationType.Q4_0,
}


def q4_k_m(name: str) -> GGMLQuantizationType:
    """llama-quantize's Q4_K_M mix, for a model of few layers: Q6_K for the output head (the embedding
    where tied), the value projections and the MLP's down projections (of half the layers in a large
    model, all in a small one), Q4_K for the rest."""
    if name.startswith(("output.", "token_embd.")) or ".attn_v." in name or ".ffn_down." in name:
        return GGMLQuantizationType.Q6_K
    return GGMLQuantizationType.Q4_K


def add_tensor(
    writer: GGUFWriter,
    name: str | None,
    tensor: torch.Tensor,
    weight_type: GGMLQuantizationType | Callable[[str], GGMLQuantizationType],
) -> None:
    if name is None:
        raise ValueError("a tensor llama.cpp has no name for: the file would lose it")
    data = tensor.detach().to(torch.float32).contiguous().numpy()
    kind = weight_type if isinstance(weight_type, GGMLQuantizationType) else weight_type(name)
    if data.ndim == 2 and data.shape[-1] % 256 and kind in K_QUANT_FALLBACKS:
        kind = K_QUANT_FALLBACKS[kind]
    # Rows that are no whole number of blocks stay F32 here (llama.cpp falls back to F16); so do biases
    # (gpt-oss's experts' are 2-D: llama-quantize quantizes weights alone).
    keep = data.ndim < 2 or data.shape[-1] % 32 or name.endswith((*KEPT_F32, ".bias"))
    if kind == GGMLQuantizationType.F32 or keep:
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, quantize(data, kind), raw_dtype=kind)


# --- metadata, as each converter class writes it -------------------------------------------------


def rope_theta(hparams: dict) -> float:
    """The rotary base; of the global layers where the layer types have their own (Gemma 3)."""
    rope = hparams.get("rope_parameters") or {}
    return float(rope.get("full_attention", rope).get("rope_theta", 10000.0))


def text_model_metadata(hparams: dict) -> Metadata:
    """TextModel.set_gguf_parameters, which most families keep: the sizes config.json names, an RMSNorm's
    epsilon and a LayerNorm's under whichever of their names the config has."""
    metadata: Metadata = {
        Keys.LLM.BLOCK_COUNT: hparams["num_hidden_layers"],
        Keys.LLM.CONTEXT_LENGTH: hparams["max_position_embeddings"],
        Keys.LLM.EMBEDDING_LENGTH: hparams["hidden_size"],
        Keys.LLM.FEED_FORWARD_LENGTH: hparams["intermediate_size"],
        Keys.Attention.HEAD_COUNT: hparams["num_attention_heads"],
        Keys.Attention.HEAD_COUNT_KV: hparams["num_key_value_heads"],
        Keys.Rope.FREQ_BASE: rope_theta(hparams),
    }
    epsilons = {
        Keys.Attention.LAYERNORM_RMS_EPS: ("rms_norm_eps", "norm_eps"),
        Keys.Attention.LAYERNORM_EPS: ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"),
    }
    for key, names in epsilons.items():
        found = [hparams[name] for name in names if hparams.get(name) is not None]
        if found:
            metadata[key] = float(found[0])
    experts = hparams.get("num_local_experts") or hparams.get("num_experts")
    if experts:
        metadata[Keys.LLM.EXPERT_COUNT] = experts
        metadata[Keys.LLM.EXPERT_USED_COUNT] = hparams["num_experts_per_tok"]
    if hparams.get("head_dim") is not None:
        metadata[Keys.Attention.KEY_LENGTH] = hparams["head_dim"]
        metadata[Keys.Attention.VALUE_LENGTH] = hparams["head_dim"]
    return metadata | rope_scaling_metadata(hparams)


def rope_scaling_metadata(hparams: dict) -> Metadata:
    """TextModel's rotary scaling, of the global layers where the layer types have their own (Gemma 3's
    linear 8): linear and YaRN as keys; Llama 3's is a tensor (`llama3_rope_freqs`)."""
    rope = hparams.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    if rope.get("rope_type") == "linear":
        return {Keys.Rope.SCALING_TYPE: "linear", Keys.Rope.SCALING_FACTOR: float(rope["factor"])}
    if rope.get("rope_type") != "yarn":
        return {}
    metadata: Metadata = {
        Keys.Rope.SCALING_TYPE: "yarn",
        Keys.Rope.SCALING_FACTOR: float(rope["factor"]),
        Keys.Rope.SCALING_ORIG_CTX_LEN: rope["original_max_position_embeddings"],
    }
    yarn_keys = {
        "attention_factor": Keys.Rope.SCALING_YARN_ATTN_FACTOR,
        "beta_fast": Keys.Rope.SCALING_YARN_BETA_FAST,
        "beta_slow": Keys.Rope.SCALING_YARN_BETA_SLOW,
    }
    return metadata | {
        key: float(rope[name]) for name, key in yarn_keys.items() if rope.get(name) is not None
    }


def llama_metadata(hparams: dict) -> Metadata:
    """LlamaModel adds the vocabulary's size and the rotary width."""
    head_dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    return text_model_metadata(hparams) | {
        Keys.LLM.VOCAB_SIZE: hparams["vocab_size"],
        Keys.Rope.DIMENSION_COUNT: head_dim,
    }


def qwen3_moe_metadata(hparams: dict) -> Metadata:
    """Qwen2MoeModel adds each expert's width."""
    return text_model_metadata(hparams) | {
        Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: hparams["moe_intermediate_size"]
    }


def qwen2_moe_metadata(hparams: dict) -> Metadata:
    """... and its shared expert's width, where it has one (Qwen2-MoE's)."""
    return qwen3_moe_metadata(hparams) | {
        Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: hparams["shared_expert_intermediate_size"]
    }


def phi3_metadata(hparams: dict) -> Metadata:
    """Phi3MiniModel writes its own, with the rotary width and a window of 0 for none; LongRoPE's attention
    factor where the model has LongRoPE (its factors are tensors: `phi3_long_rope_factors`)."""
    rotary = hparams["rope_parameters"].get("partial_rotary_factor", 1.0)
    long_rope = {}
    if hparams["rope_parameters"].get("rope_type") == "longrope":
        scale = hparams["max_position_embeddings"] / hparams["original_max_position_embeddings"]
        factor = math.sqrt(1 + math.log(scale) / math.log(hparams["original_max_position_embeddings"]))
        long_rope = {Keys.Rope.SCALING_ATTN_FACTOR: factor if scale > 1.0 else 1.0}
    return long_rope | {
        Keys.LLM.CONTEXT_LENGTH: hparams["max_position_embeddings"],
        Keys.Rope.SCALING_ORIG_CTX_LEN: hparams["original_max_position_embeddings"],
        Keys.LLM.EMBEDDING_LENGTH: hparams["hidden_size"],
        Keys.LLM.FEED_FORWARD_LENGTH: hparams["intermediate_size"],
        Keys.LLM.BLOCK_COUNT: hparams["num_hidden_layers"],
        Keys.Attention.HEAD_COUNT: hparams["num_attention_heads"],
        Keys.Attention.HEAD_COUNT_KV: hparams["num_key_value_heads"],
        Keys.Attention.LAYERNORM_RMS_EPS: float(hparams["rms_norm_eps"]),
        Keys.Rope.DIMENSION_COUNT: int(rotary * hparams["hidden_size"]) // hparams["num_attention_heads"],
        Keys.Rope.FREQ_BASE: rope_theta(hparams),
        Keys.Attention.SLIDING_WINDOW: hparams.get("sliding_window") or 0,
    }


def phi3_long_rope_factors(hparams: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Phi3MiniModel.generate_extra_tensors: LongRoPE's long and short factors, one a rotated pair."""
    rope = hparams["rope_parameters"]
    if rope.get("rope_type") == "longrope":
        yield "rope_factors_long.weight", torch.tensor(rope["long_factor"], dtype=torch.float32)
        yield "rope_factors_short.weight", torch.tensor(rope["short_factor"], dtype=torch.float32)


def no_extra_tensors(hparams: dict) -> Iterator[tuple[str, torch.Tensor]]:
    return iter(())


def llama3_rope_freqs(hparams: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """LlamaModel.generate_extra_tensors: Llama 3's rotary scaling as a divisor of each rotated pair's
    frequency (`rope_freqs.weight`), computed from the config's factor, low and high frequency factors and
    original context (the converter's defaults 8, 1, 4 and 8,192 where the config has none)."""
    rope = hparams.get("rope_parameters") or {}
    if rope.get("rope_type") != "llama3":
        return
    dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    frequencies = 1.0 / (rope_theta(hparams) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    original = rope.get("original_max_position_embeddings", 8192)
    divisors = []
    for frequency in frequencies:
        wavelength = 2 * math.pi / frequency
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    yield "rope_freqs.weight", torch.tensor(divisors, dtype=torch.float32)


def gemma2_metadata(hparams: dict) -> Metadata:
    """Gemma2Model writes its own: no rotary base, but both soft-caps and the window."""
    return {
        Keys.LLM.CONTEXT_LENGTH: hparams["max_position_embeddings"],
        Keys.LLM.EMBEDDING_LENGTH: hparams["hidden_size"],
        Keys.LLM.BLOCK_COUNT: hparams["num_hidden_layers"],
        Keys.LLM.FEED_FORWARD_LENGTH: hparams["intermediate_size"],
        Keys.Attention.HEAD_COUNT: hparams["num_attention_heads"],
        Keys.Attention.HEAD_COUNT_KV: hparams["num_key_value_heads"],
        Keys.Attention.LAYERNORM_RMS_EPS: float(hparams["rms_norm_eps"]),
        Keys.Attention.KEY_LENGTH: hparams["head_dim"],
        Keys.Attention.VALUE_LENGTH: hparams["head_dim"],
        Keys.LLM.ATTN_LOGIT_SOFTCAPPING: float(hparams["attn_logit_softcapping"]),
        Keys.LLM.FINAL_LOGIT_SOFTCAPPING: float(hparams["final_logit_softcapping"]),
        Keys.Attention.SLIDING_WINDOW: hparams["sliding_window"],
    }


def gemma3_metadata(hparams: dict) -> Metadata:
    """Gemma3Model: TextModel's (with the global layers' rotary base), the final soft-cap where there is
    one, and the window unless every layer is global."""
    metadata = text_model_metadata(hparams)
    if hparams.get("final_logit_softcapping"):
        metadata[Keys.LLM.FINAL_LOGIT_SOFTCAPPING] = float(hparams["final_logit_softcapping"])
    if hparams.get("sliding_window_pattern") != 1:
        metadata[Keys.Attention.SLIDING_WINDOW] = hparams["sliding_window"]
    return metadata


def falcon_kv_heads(hparams: dict) -> int:
    """Falcon-7B's config.json names no key heads (the converter takes 1); 40B's names its groups."""
    if hparams["new_decoder_architecture"]:
        return hparams["num_kv_heads"]
    return 1 if hparams["multi_query"] else hparams["num_attention_heads"]


def falcon_metadata(hparams: dict) -> Metadata:
    """FalconModel writes a context of 2048 whatever the model's (config.json has none) and says its
    query/key/value rows are regrouped ("jploski")."""
    return {
        Keys.LLM.CONTEXT_LENGTH: 2048,
        Keys.LLM.TENSOR_DATA_LAYOUT: "jploski",
        Keys.LLM.EMBEDDING_LENGTH: hparams["hidden_size"],
        Keys.LLM.FEED_FORWARD_LENGTH: 4 * hparams["hidden_size"],
        Keys.LLM.BLOCK_COUNT: hparams["num_hidden_layers"],
        Keys.Attention.HEAD_COUNT: hparams["num_attention_heads"],
        Keys.Attention.HEAD_COUNT_KV: falcon_kv_heads(hparams),
        Keys.Attention.LAYERNORM_EPS: float(hparams["layer_norm_epsilon"]),
    }


def mamba_metadata(hparams: dict) -> Metadata:
    """MambaModel.set_gguf_parameters: no attention, no feed-forward, a context of 2**20 (a Mamba has no
    limit), the scan's sizes."""
    return {
        Keys.LLM.CONTEXT_LENGTH: 2**20,
        Keys.LLM.EMBEDDING_LENGTH: hparams["hidden_size"],
        Keys.LLM.FEED_FORWARD_LENGTH: 0,
        Keys.Attention.HEAD_COUNT: 0,
        Keys.LLM.BLOCK_COUNT: hparams["num_hidden_layers"],
        Keys.SSM.CONV_KERNEL: hparams["conv_kernel"],
        Keys.SSM.INNER_SIZE: hparams["intermediate_size"],
        Keys.SSM.STATE_SIZE: hparams["state_size"],
        Keys.SSM.TIME_STEP_RANK: hparams["time_step_rank"],
        Keys.Attention.LAYERNORM_RMS_EPS: float(hparams["layer_norm_epsilon"]),
    }


def gpt_oss_metadata(hparams: dict) -> Metadata:
    """GptOssModel adds the window and each expert's width (TextModel writes its YaRN scaling, where it has
    one: gpt-oss's own, 32 times its original 4,096 positions)."""
    return text_model_metadata(hparams) | {
        Keys.Attention.SLIDING_WINDOW: hparams["sliding_window"],
        Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: hparams["intermediate_size"],
    }


def lfm2_metadata(hparams: dict) -> Metadata:
    """LFM2Model: a key head count a layer, 0 for its convolution layers (which is how llama.cpp, and
    transformers reading its file, tell them from the attention layers), the convolution's length, the
    vocabulary's size, and the MLP's width as the model computes it from its config (a third less, times
    its multiplier, up to a multiple of `block_multiple_of`, where `block_auto_adjust_ff_dim`)."""
    width = hparams["intermediate_size"]
    if hparams["block_auto_adjust_ff_dim"]:
        width = int(2 * width / 3)
        if hparams["block_ffn_dim_multiplier"] is not None:
            width = int(hparams["block_ffn_dim_multiplier"] * width)
        multiple = hparams["block_multiple_of"]
        width = multiple * ((width + multiple - 1) // multiple)
    kv_heads = [hparams["num_key_value_heads"] if kind != "conv" else 0 for kind in hparams["layer_types"]]
    return text_model_metadata(hparams) | {
        Keys.Attention.HEAD_COUNT_KV: kv_heads,
        Keys.LLM.VOCAB_SIZE: hparams["vocab_size"],
        Keys.ShortConv.L_CACHE: hparams["conv_L_cache"],
        Keys.LLM.FEED_FORWARD_LENGTH: width,
    }


def nemotron_metadata(hparams: dict) -> Metadata:
    """NemotronModel adds the vocabulary's size, its LayerNorm's epsilon (`norm_eps`, which TextModel
    writes as an RMSNorm's too) and the rotary width (its partial rotary factor of each head)."""
    part = hparams["rope_parameters"]["partial_rotary_factor"]
    rotary = int(part * hparams["hidden_size"]) // hparams["num_attention_heads"]
    return text_model_metadata(hparams) | {
        Keys.LLM.VOCAB_SIZE: hparams["vocab_size"],
        Keys.Attention.LAYERNORM_EPS: float(hparams["norm_eps"]),
        Keys.Rope.DIMENSION_COUNT: rotary,
    }


def gpt2_metadata(hparams: dict) -> Metadata:
    return {
        Keys.LLM.BLOCK_COUNT: hparams["n_layer"],
        Keys.LLM.CONTEXT_LENGTH: hparams["n_positions"],  # config.json's n_ctx, its old name
        Keys.LLM.EMBEDDING_LENGTH: hparams["n_embd"],
        Keys.LLM.FEED_FORWARD_LENGTH: 4 * hparams["n_embd"],
        Keys.Attention.HEAD_COUNT: hparams["n_head"],
        Keys.Attention.LAYERNORM_EPS: float(hparams["layer_norm_epsilon"]),
    }


def granite_metadata(hparams: dict) -> Metadata:
    """GraniteModel: LlamaModel's without a head width (it drops the config's), and its four multipliers
    as scales."""
    metadata = llama_metadata(hparams) | {
        Keys.Attention.SCALE: float(hparams["attention_multiplier"]),
        Keys.LLM.EMBEDDING_SCALE: float(hparams["embedding_multiplier"]),
        Keys.LLM.RESIDUAL_SCALE: float(hparams["residual_multiplier"]),
        Keys.LLM.LOGIT_SCALE: float(hparams["logits_scaling"]),
    }
    return {key: value for key, value in metadata.items() if key not in HEAD_WIDTH_KEYS}


HEAD_WIDTH_KEYS = (Keys.Attention.KEY_LENGTH, Keys.Attention.VALUE_LENGTH)


def cohere2_metadata(hparams: dict) -> Metadata:
    """Cohere2Model adds its logits' scale, the window, the vocabulary's size and the rotary width (which
    layers use the window is no key: one in four global, llama.cpp's pattern and transformers')."""
    head_dim = hparams["hidden_size"] // hparams["num_attention_heads"]
    return text_model_metadata(hparams) | {
        Keys.LLM.LOGIT_SCALE: float(hparams["logit_scale"]),
        Keys.Attention.SLIDING_WINDOW: hparams["sliding_window"],
        Keys.LLM.VOCAB_SIZE: hparams["vocab_size"],
        Keys.Rope.DIMENSION_COUNT: head_dim,
    }


def exaone4_metadata(hparams: dict) -> Metadata:
    """Exaone4Model adds the vocabulary's size and, where it has a window, the window and a bool a layer
    saying which layers use it."""
    metadata = text_model_metadata(hparams) | {Keys.LLM.VOCAB_SIZE: hparams["vocab_size"]}
    if hparams.get("sliding_window") is not None:
        metadata[Keys.Attention.SLIDING_WINDOW] = hparams["sliding_window"]
        layer_types = hparams["layer_types"]
        metadata[Keys.Attention.SLIDING_WINDOW_PATTERN] = [
            kind == "sliding_attention" for kind in layer_types
        ]
    return metadata


def ministral3_metadata(hparams: dict) -> Metadata:
    """Mistral3Model's Ministral3Model: LlamaModel's (TextModel's YaRN among them), YaRN's mscale_all_dim as
    its log multiplier, and Llama 4's beta of its queries' scale as the attention's temperature."""
    rope = hparams["rope_parameters"]
    return llama_metadata(hparams) | {
        Keys.Rope.SCALING_YARN_LOG_MUL: float(rope["mscale_all_dim"]),
        Keys.Attention.TEMPERATURE_SCALE: float(rope["llama_4_scaling_beta"]),
    }


# The keys of the architectures that hold a Qwen VL model's text (Qwen3VLTextModel, Qwen3VLMoeTextModel,
# Qwen2VLModel) beside their text model's: the positions' rotary sections (time, height, width, none)
# and the vision tower's layers that feed the text model's (Qwen3-VL's "deepstack").
QWEN_VL_TEXT: dict[MODEL_ARCH, Metadata] = {
    MODEL_ARCH.QWEN3VL: {Keys.Rope.DIMENSION_SECTIONS: [24, 20, 20, 0], Keys.LLM.NUM_DEEPSTACK_LAYERS: 3},
    MODEL_ARCH.QWEN3VLMOE: {Keys.Rope.DIMENSION_SECTIONS: [24, 20, 20, 0], Keys.LLM.NUM_DEEPSTACK_LAYERS: 3},
    MODEL_ARCH.QWEN2VL: {Keys.Rope.DIMENSION_SECTIONS: [16, 24, 24, 0]},
}


METADATA: dict[str, Callable[[dict], Metadata]] = {
    "llama": llama_metadata,
    "mistral": llama_metadata,
    "mixtral": llama_metadata,  # TextModel's expert counts among them
    "qwen2": text_model_metadata,
    "qwen3": text_model_metadata,
    "qwen3_moe": qwen3_moe_metadata,
    "phi3": phi3_metadata,
    "gemma2": gemma2_metadata,
    "gemma3_text": gemma3_metadata,
    "falcon": falcon_metadata,
    "gpt2": gpt2_metadata,
    "mamba": mamba_metadata,
    "gpt_oss": gpt_oss_metadata,
    "lfm2": lfm2_metadata,
    "starcoder2": text_model_metadata,
    "stablelm": text_model_metadata,
    "nemotron": nemotron_metadata,
    "qwen2_moe": qwen2_moe_metadata,
    "smollm3": llama_metadata,  # (SmolLM3Model is LlamaModel's)
    "granite": granite_metadata,
    "olmo2": text_model_metadata,
    "seed_oss": text_model_metadata,
    "ernie4_5": text_model_metadata,
    "cohere2": cohere2_metadata,
    "exaone4": exaone4_metadata,
    "ministral3": ministral3_metadata,
    "arcee": llama_metadata,  # (ArceeModel is LlamaModel's)
    "olmoe": text_model_metadata,  # (its expert counts among them)
}

# What a converter writes beyond the model's own tensors (generate_extra_tensors), by model type
EXTRA_TENSORS: dict[str, Callable[[dict], Iterator[tuple[str, torch.Tensor]]]] = {
    "phi3": phi3_long_rope_factors,
    "llama": llama3_rope_freqs,  # (LlamaModel's, which converts Mistral's and Mixtral's files too)
    "mistral": llama3_rope_freqs,
    "mixtral": llama3_rope_freqs,
}


# --- tensors, as each converter class changes them ------------------------------------------------


def converted_tensors(model: torch.nn.Module, hparams: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The (transformers name, value) pairs the converter hands to llama.cpp's name map."""
    model_type = hparams["model_type"]
    if model_type in ("gemma2", "gemma3_text") and not hparams["tie_word_embeddings"]:
        # Gemma's converters drop lm_head.weight: the file would serve the embedding as the head.
        raise ValueError("llama.cpp writes Gemma with its head tied to the embedding; tie this one")
    change = TENSOR_CHANGES.get(model_type, unchanged)
    for name, tensor in model.state_dict().items():
        if hparams["tie_word_embeddings"] and name == "lm_head.weight":
            continue  # not in the safetensors of a tied model
        yield from change(name, tensor, hparams)


Change = Callable[[str, torch.Tensor, dict], Iterator[tuple[str, torch.Tensor]]]


def unchanged(name: str, tensor: torch.Tensor, hparams: dict) -> Iterator[tuple[str, torch.Tensor]]:
    yield name, tensor


def llama_rotary_rows(name: str, tensor: torch.Tensor, hparams: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """LlamaModel.permute: each head's rows from halves (rotate_half) to interleaved pairs, llama.cpp's
    rotary layout."""
    heads = {"q_proj": hparams["num_attention_heads"], "k_proj": hparams["num_key_value_heads"]}
    for projection, count in heads.items():
        if name.endswith((f"{projection}.weight", f"{projection}.bias")):
            tensor = tensor.reshape(count, 2, -1, *tensor.shape[1:]).swapaxes(1, 2).reshape(tensor.shape)
    yield name, tensor


# The families whose norms scale by 1 + w (Gemma's RMSNorms, Nemotron's LayerNorm1P)
OFFSET_NORM_FAMILIES = ("gemma2", "gemma3_text", "nemotron")


def gemma_norms(name: str, tensor: torch.Tensor, hparams: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Gemma's norms (and Nemotron's) multiply by 1 + w; llama.cpp's by the stored value, so it stores
    1 + w."""
    yield name, tensor + 1 if name.endswith("norm.weight") else tensor


def falcon_groups(name: str, tensor: torch.Tensor, hparams: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """FalconModel's "jploski" layout: every query head's rows, then every key head's, then every value
    head's, where transformers keeps a group's queries, key and value together (the same order for
    Falcon-7B's single group)."""
    if "query_key_value" in name:
        heads, groups = hparams["num_attention_heads"], falcon_kv_heads(hparams)
        head_dim = hparams["hidden_size"] // heads
        qkv = tensor.reshape(groups, heads // groups + 2, head_dim, -1)
        parts = (qkv[:, :-2], qkv[:, [-2]], qkv[:, [-1]])
        tensor = torch.cat([part.reshape(-1, tensor.shape[-1]) for part in parts]).reshape(tensor.shape)
    yield name, tensor


def gpt2_conv1d(name: str, tensor: torch.Tensor, hparams: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """GPT-2's Conv1D weights are (in, out); llama.cpp's (out, in)."""
    if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
        tensor = tensor.T
    yield name, tensor


def qwen_moe_experts(name: str, tensor: torch.Tensor, hparams: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen2MoeModel splits transformers' fused (experts, 2 x width, hidden) gate_up_proj into gate and
    up; down_proj is stacked already."""
    if name.endswith("mlp.experts.gate_up_proj"):
        gate, up = tensor.chunk(2, dim=-2)
        base = name.removesuffix(".gate_up_proj")
        yield f"{base}.gate_proj.weight", gate
        yield f"{base}.up_proj.weight", up
    elif name.endswith("mlp.experts.down_proj"):
        yield f"{name}.weight", tensor
    else:
        yield name, tensor


def qwen2_moe_tensors(name: str, tensor: torch.Tensor, hparams: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen2MoeModel's experts, and its shared expert's gate ([1, hidden]) as one row, which llama.cpp
    stores 1-D (transformers reads it back so)."""
    if name.endswith("shared_expert_gate.weight"):
        tensor = tensor[0]
    yield from qwen_moe_experts(name, tensor, hparams)


def mixtral_experts(name: str, tensor: torch.Tensor, hparams: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """LlamaModel: the rows of q and k permuted, and each projection of a layer's experts stacked into one
    tensor (w1 gate, w3 up, w2 down), as Qwen2MoeModel's are."""
    for renamed, changed in llama_rotary_rows(name, tensor, hparams):
        yield from qwen_moe_experts(renamed, changed, hparams)


def gpt_oss_experts(name: str, tensor: torch.Tensor, hparams: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """GptOssModel: the experts' [experts, in, out] weights as llama.cpp's [experts, out, in], gate_up's
    interleaved outputs (gate j at 2j, up j at 2j + 1) split into gate and up, their biases too; the
    attention sinks named as weights."""
    base = name.rpartition(".")[0]
    if name.endswith("mlp.experts.gate_up_proj"):
        weights = tensor.transpose(-1, -2)
        yield f"{base}.gate_proj.weight", weights[:, 0::2]
        yield f"{base}.up_proj.weight", weights[:, 1::2]
    elif name.endswith("mlp.experts.gate_up_proj_bias"):
        yield f"{base}.gate_proj.bias", tensor[:, 0::2]
        yield f"{base}.up_proj.bias", tensor[:, 1::2]
    elif name.endswith("mlp.experts.down_proj"):
        yield f"{name}.weight", tensor.transpose(-1, -2)
    elif name.endswith("mlp.experts.down_proj_bias"):
        yield f"{base}.down_proj.bias", tensor
    elif name.endswith("self_attn.sinks"):
        yield f"{name}.weight", tensor
    else:
        yield name, tensor


def mamba_scan(name: str, tensor: torch.Tensor, hparams: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """MambaModel.modify_tensors: A stored as -exp(A_log), the convolution's weight without its middle
    axis of one."""
    if name.endswith("A_log"):
        yield name, -torch.exp(tensor)  # llama.cpp's name map gives it ssm_a
    elif name.endswith("conv1d.weight"):
        yield name, tensor.squeeze(1)
    else:
        yield name, tensor


def lfm2_conv(name: str, tensor: torch.Tensor, hparams: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """LFM2Model squeezes each convolution's weight ([hidden, 1, length]) to two dimensions."""
    yield name, tensor.squeeze(1) if "conv.conv" in name else tensor


TENSOR_CHANGES: dict[str, Change] = {
    "llama": llama_rotary_rows,
    "mistral": llama_rotary_rows,
    "mixtral": mixtral_experts,
    "qwen3_moe": qwen_moe_experts,
    "gemma2": gemma_norms,
    "gemma3_text": gemma_norms,
    "falcon": falcon_groups,
    "gpt2": gpt2_conv1d,
    "mamba": mamba_scan,
    "gpt_oss": gpt_oss_experts,
    "lfm2": lfm2_conv,
    "nemotron": gemma_norms,
    "qwen2_moe": qwen2_moe_tensors,
    "smollm3": llama_rotary_rows,
    "granite": llama_rotary_rows,
    "ministral3": llama_rotary_rows,
    "arcee": llama_rotary_rows,
    "olmoe": qwen_moe_experts,  # (OlmoeModel stacks its experts as Qwen2MoeModel does)
}


def round_trip_offset_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Round Gemma's and Nemotron's norm weights, in place, to values that come back the same from a file
    that stores 1 + w in float32 (transformers subtracts the 1 again): w = (1 + w) - 1, once, is such a
    value."""
    if model.config.model_type in OFFSET_NORM_FAMILIES:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.copy_((parameter + 1) - 1)
    return model


# --- the tokenizer ---------------------------------------------------------------------------------

# Families whose converter always writes a sentencepiece vocabulary (Gemma2Model; Gemma3Model where the
# checkpoint has a tokenizer.model, as every released Gemma 3 has; Ernie4_5Model); the others get a
# byte-level BPE one.
SENTENCEPIECE_FAMILIES = ("gemma2", "gemma3_text", "ernie4_5")


def add_tokenizer(writer: GGUFWriter, source: Path, hparams: dict) -> None:
    if hparams["model_type"] in SENTENCEPIECE_FAMILIES:
        add_sentencepiece_tokenizer(writer, source, hparams)
    else:
        add_byte_level_tokenizer(writer, source, hparams)
    for kind in ("bos", "eos", "pad"):
        if hparams.get(f"{kind}_token_id") is not None:
            getattr(writer, f"add_{kind}_token_id")(hparams[f"{kind}_token_id"])


def add_byte_level_tokenizer(writer: GGUFWriter, source: Path, hparams: dict) -> None:
    """The byte-level BPE tokenizer of the GGUF file `source`, cut to the model's vocabulary: its first
    vocab_size tokens, and the merges among them (a merge whose result is cut goes too, so that no
    merge makes a token the vocabulary lacks). The special ids are the model's own."""
    fields = source_tokenizer(source)
    size = hparams["vocab_size"]
    tokens = fields["tokenizer.ggml.tokens"][:size]
    if len(tokens) < size:
        raise ValueError(f"{source} has {len(tokens)} tokens, fewer than the model's {size}")
    kept = set(tokens)
    merges = [
        merge
        for merge in fields["tokenizer.ggml.merges"]
        if set(merge.split(" ")) <= kept and merge.replace(" ", "") in kept
    ]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(fields["tokenizer.ggml.token_type"][:size])
    writer.add_token_merges(merges)
    writer.add_add_bos_token(False)


def add_sentencepiece_tokenizer(writer: GGUFWriter, source: Path, hparams: dict) -> None:
    """A sentencepiece vocabulary as _set_vocab_sentencepiece writes one: the model's special tokens at
    its ids, <unk> and <mask> (Gemma's tokenizer class adds a <mask> a vocabulary lacks), the 256 byte
    tokens, then pieces (the words of `source`'s BPE vocabulary, spaces as "▁"), best first."""
    size = hparams["vocab_size"]
    specials = {
        hparams[f"{kind}_token_id"]: f"<{kind}>"
        for kind in ("pad", "bos", "eos")
        if hparams.get(f"{kind}_token_id") is not None
    }
    rest = iter(
        [("<unk>", TokenType.UNKNOWN), ("<mask>", TokenType.CONTROL)]
        + [(f"<0x{byte:02X}>", TokenType.BYTE) for byte in range(256)]
        + [(piece, TokenType.NORMAL) for piece in text_pieces(source)]
    )
    vocabulary = [(specials[i], TokenType.CONTROL) if i in specials else next(rest) for i in range(size)]
    tokens = [token for token, _ in vocabulary]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(size)])
    writer.add_token_types([int(kind) for _, kind in vocabulary])
    writer.add_unk_token_id(tokens.index("<unk>"))
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(True)


@functools.cache
def text_pieces(source: Path) -> tuple[str, ...]:
    """`source`'s byte-level BPE tokens that spell printable text, in its order (a merge's parts before
    it), as sentencepiece pieces."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {character: byte for byte, character in bytes_to_unicode().items()}
    fields = source_tokenizer(source)
    pieces = {}  # ordered, without repeats
    for token, kind in zip(fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"], strict=True):
        try:
            text = bytes(byte_of[character] for character in token).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue  # a token of part of a character
        piece = text.replace(" ", "\u2581")
        if kind == TokenType.NORMAL and piece.isprintable():
            pieces[piece] = None
    return tuple(pieces)


@functools.cache
def source_tokenizer(source: Path) -> dict:
    """The tokenizer metadata of a GGUF file, read once a session by transformers' reader, which reads
    only these arrays whole (the gguf package's reader parses every field: 5 s on the default model's)."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
    fields = read_gguf_metadata(str(source), arrays)[0]
    if fields["tokenizer.ggml.model"] != "gpt2":
        raise ValueError(f"{source} has no byte-level BPE tokenizer to copy")
    return fields
