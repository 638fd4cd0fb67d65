"""GGUF files of Phi-3 (Phi-3-mini, Phi-3-medium, Phi-3.5-mini, Phi-4, Phi-4-mini): their rotation and window.

llama.cpp's converter (Phi3MiniModel) writes the width of each head that rotates
(`phi3.rope.dimension_count`: Phi-4-mini's 96 of 128), the window (`phi3.attention.sliding_window`, 0 for
none: Phi-3-mini's 2,047), the original context (`phi3.rope.scaling.original_context_length`) and, for the
long-context models (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini), LongRoPE's factors as two tensors
(`rope_factors_long.weight`, `rope_factors_short.weight`, one factor a rotated pair of each head).
transformers' GGUF reader reads none of them: such a file would rotate whole heads by plain RoPE and
attend without a window, and serve text its model does not write. Here the configuration takes them.
LongRoPE's attention factor (`rope.scaling.attn_factor`) is left to transformers, which computes it from
the two context lengths by the converter's own formula.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from transformers import Phi3Config, PretrainedConfig

from backend.model.architectures import UnsupportedModel
from backend.model.gguf_parsing import architecture_fields, is_architecture

ARCHITECTURE = "phi3"
LONG_FACTORS, SHORT_FACTORS = "rope_factors_long.weight", "rope_factors_short.weight"


def is_phi3(path: Path) -> bool:
    return is_architecture(path, ARCHITECTURE)


def phi3_config(path: Path, config: PretrainedConfig) -> Phi3Config:
    """`config` (transformers' reading of the file) with the file's rotary width, window, original context
    and LongRoPE factors."""
    reader = gguf.GGUFReader(str(path))
    field = architecture_fields(reader, ARCHITECTURE)
    read = config.to_dict()
    head_dim = config.hidden_size // config.num_attention_heads
    partial = (field("rope.dimension_count") or head_dim) / head_dim
    read["sliding_window"] = field("attention.sliding_window") or None  # (0: none)
    original = field("rope.scaling.original_context_length") or config.original_max_position_embeddings
    read["original_max_position_embeddings"] = int(original)
    rope = {"rope_type": "default", "rope_theta": float(config.rope_parameters["rope_theta"])}
    factors = {
        tensor.name: tensor for tensor in reader.tensors if tensor.name in (LONG_FACTORS, SHORT_FACTORS)
    }
    if factors:
        if len(factors) < 2:
            missing = ({LONG_FACTORS, SHORT_FACTORS} - factors.keys()).pop()
            raise UnsupportedModel(f"this Phi-3 file has LongRoPE's factors but not {missing!r}: not served")
        rope |= {
            "rope_type": "longrope",
            "long_factor": float_list(factors[LONG_FACTORS]),
            "short_factor": float_list(factors[SHORT_FACTORS]),
            "original_max_position_embeddings": int(original),
        }
    read["rope_parameters"] = rope | {"partial_rotary_factor": partial}
    read["partial_rotary_factor"] = partial
    return Phi3Config(**{key: value for key, value in read.items() if key != "model_type"})


def float_list(tensor: gguf.ReaderTensor) -> list[float]:
    """A 1-D float tensor's values (LongRoPE's factors are float32), as transformers' config keeps them."""
    return [float(value) for value in np.asarray(tensor.data, dtype=np.float64).reshape(-1)]
