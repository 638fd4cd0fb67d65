"""LongRoPE's rotary frequencies (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini, Phi-3.5-MoE) chosen once, for
the rows' length, not step by step.

transformers' LongRoPE module picks its frequencies at each forward pass: the long factors where the pass's
furthest position is past the model's original context (`original_max_position_embeddings`, 4,096),
else the short ones. In a step that packs many rows, one row past that point would change the rotation
of every other row's tokens: a row's text would depend on another request's length (another team's,
say), and its cache would hold keys rotated both ways. Here the choice is made once, at start-up, from
the longest row the cache holds, as llama.cpp (from its context size) and vLLM (from its longest
sequence) make it: rows of up to the original context rotate by the short factors, and give what
`generate` gives; longer rows by the long factors at every position.
"""

from __future__ import annotations

import logging

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

log = logging.getLogger(__name__)


def fix_long_rope(model: torch.nn.Module, max_seq_len: int) -> None:
    """Set each LongRoPE rotary module of `model` to the frequencies for rows of `max_seq_len`, for good."""
    for module in model.modules():
        if getattr(module, "rope_type", None) != "longrope":  # (Gemma 3's is a dict of its layer types')
            continue
        original = module.config.rope_parameters["original_max_position_embeddings"]
        long = max_seq_len > original
        if long:
            frequencies, _ = ROPE_INIT_FUNCTIONS["longrope"](
                module.config, module.inv_freq.device, seq_len=original + 1
            )
        else:
            frequencies = module.original_inv_freq
        module.inv_freq.copy_(frequencies.to(module.inv_freq.dtype))
        # transformers' update before each pass (modeling_rope_utils.dynamic_rope_update) now leaves them
        # be; cos and sin keep LongRoPE's attention scaling (`attention_scaling`), set when it was made.
        module.rope_type = "default"
        log.info(
            "LongRoPE: rows of %d positions, %s the model's original %d: its %s factors for every position%s",
            max_seq_len,
            "past" if long else "within",
            original,
            "long" if long else "short",
            f" (--max-seq-len {original} for the short ones)" if long else "",
        )
