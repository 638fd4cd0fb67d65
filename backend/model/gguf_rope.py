"""A GGUF file's rotary scaling, which transformers' GGUF reader drops whatever the architecture.

llama.cpp's converter (TextModel.set_gguf_parameters) writes a model's linear or YaRN scaling as keys,
`{arch}.rope.scaling.type`, `.factor`, `.original_context_length` and YaRN's `.yarn_*`, and Llama 3's
(every Llama 3.1, 3.2 and 3.3 file) as a tensor, `rope_freqs.weight`: the divisor of each rotated pair's
frequency, computed from the config's factor, low and high frequency factors and original context.
transformers' reader maps none of them, so such a file was served rotating by plain RoPE: Gemma 3's global
layers (linear, 8 times) and every Llama 3 at frequencies its model was not trained at, whatever the
prompt's length. Here the configuration takes them. Llama 3's parameters are found from the divisors
(`llama3_parameters`), and a file whose divisors no Llama 3 scaling gives is refused.

gpt-oss's scaling (gguf_gpt_oss.py) and Phi-3's LongRoPE (gguf_phi3.py) are read where their families are.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
from transformers import PretrainedConfig
from transformers.modeling_gguf_pytorch_utils import read_field

from backend.model.architectures import UnsupportedModel
from backend.model.gguf_parsing import architecture_fields

READ_ELSEWHERE = ("gpt-oss", "phi3")
LLAMA3_DIVISORS = "rope_freqs.weight"
# Meta's low and high frequency factors and original context, the converter's defaults too: a file says
# neither factor, and says the original context only through the divisors between the two
LOW_FREQ_FACTOR, HIGH_FREQ_FACTOR, ORIGINAL_CONTEXT = 1.0, 4.0, 8192
YARN_KEYS = {
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
    "yarn_attn_factor": "attention_factor",
}


def with_rotary_scaling(path: Path, config: PretrainedConfig) -> PretrainedConfig:
    """`config` (transformers' reading of the file) with the file's rotary scaling, of the global layers
    where the layer types rotate each their own way (Gemma 3's); `config` itself where it has none."""
    reader = gguf.GGUFReader(str(path))
    architecture = read_field(reader, "general.architecture")[0]
    rope = dict(getattr(config, "rope_parameters", None) or {})  # (GPT-2 and Mamba have none)
    if architecture in READ_ELSEWHERE or not rope:
        return config
    global_layers = "full_attention" in rope
    theta = float((rope["full_attention"] if global_layers else rope).get("rope_theta", 10000.0))
    scaling = scaling_of(reader, architecture, theta, path.name)
    if not scaling:
        return config
    if global_layers:
        rope["full_attention"] = rope["full_attention"] | scaling
    else:
        rope |= scaling
    read = config.to_dict() | {"rope_parameters": rope}
    return type(config)(**{key: value for key, value in read.items() if key != "model_type"})


def scaling_of(reader: gguf.GGUFReader, architecture: str, theta: float, name: str) -> dict:
    """The rotary scaling the file says, as transformers' rope parameters (none: {})."""
    divisors = next((tensor for tensor in reader.tensors if tensor.name == LLAMA3_DIVISORS), None)
    if divisors is not None:
        return llama3_parameters(np.asarray(divisors.data, dtype=np.float64).reshape(-1), theta, name)
    field = architecture_fields(reader, architecture)
    kind = field("rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(field("rope.scaling.factor"))}
    if kind != "yarn":
        return {}
    scaling = {"rope_type": "yarn", "factor": float(field("rope.scaling.factor"))}
    if field("rope.scaling.original_context_length") is not None:
        scaling["original_max_position_embeddings"] = int(field("rope.scaling.original_context_length"))
    for key, parameter in YARN_KEYS.items():
        if field(f"rope.scaling.{key}") is not None:
            scaling[parameter] = float(field(f"rope.scaling.{key}"))
    if field("rope.scaling.yarn_log_multiplier") is not None:
        # DeepSeek's and Ministral 3's mscale_all_dim; llama.cpp takes their mscale as 1, the released ones'
        scaling["mscale_all_dim"] = float(field("rope.scaling.yarn_log_multiplier"))
        scaling["mscale"] = 1.0
    return scaling


def llama3_parameters(divisors: np.ndarray, theta: float, name: str) -> dict:
    """Llama 3's rope parameters whose divisors of each pair's frequency are `divisors`. The factor is the
    largest; the original context follows from any divisor between 1 and it (where none is, any context
    between the longest wavelength left alone and the shortest one divided gives the same divisors)."""
    wavelengths = 2 * math.pi * theta ** (np.arange(len(divisors)) * 2 / (2 * len(divisors)))
    factor = float(divisors.max())
    if factor <= 1.0:
        return {}
    between = (divisors > 1.0 + 1e-6) & (divisors < factor * (1.0 - 1e-6))
    if between.any():
        smooth = (1 / divisors[between] - 1 / factor) / (1 - 1 / factor)
        originals = wavelengths[between] * (LOW_FREQ_FACTOR + smooth * (HIGH_FREQ_FACTOR - LOW_FREQ_FACTOR))
        original = round(float(np.median(originals)))
    else:
        shortest = HIGH_FREQ_FACTOR * wavelengths[divisors <= 1.0 + 1e-6].max(initial=0.0)
        longest = LOW_FREQ_FACTOR * wavelengths[divisors >= factor * (1.0 - 1e-6)].min(initial=math.inf)
        middle = round(math.sqrt(max(shortest, 1.0) * longest))
        original = ORIGINAL_CONTEXT if shortest < ORIGINAL_CONTEXT < longest else middle
    parameters = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": LOW_FREQ_FACTOR,
        "high_freq_factor": HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": original,
    }
    if not np.allclose(llama3_divisors(parameters, wavelengths), divisors, rtol=1e-4):
        raise UnsupportedModel(
            f"{name}: its rotary frequency divisors ({LLAMA3_DIVISORS}) are no Llama 3 scaling this server "
            "can say (low and high frequency factors other than Meta's 1 and 4?): not served"
        )
    return parameters


def llama3_divisors(parameters: dict, wavelengths: np.ndarray) -> np.ndarray:
    """The converter's (and transformers') Llama 3 scaling as a divisor of each pair's frequency."""
    factor, original = parameters["factor"], parameters["original_max_position_embeddings"]
    low, high = parameters["low_freq_factor"], parameters["high_freq_factor"]
    smooth = np.clip((original / wavelengths - low) / (high - low), 0.0, 1.0)
    return np.where(
        wavelengths < original / high,
        1.0,
        np.where(wavelengths > original / low, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
