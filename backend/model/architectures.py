"""Which model architectures the engine serves exactly, and a clear refusal for the rest.

The engine's attention (layers/attention.py) is plain causal attention over
each row's own positions, with the scale the model gives. Llama, Mistral and
Qwen2 run on the compact decoder runner (model/decoder_runner.py); every other
family here runs transformers' own modules with that attention plugged in
through transformers' attention interface, which is all their layers need
(q and k norms, mixtures of experts, fused projections, scaling multipliers,
layers without rotary positions live in the modules). A model whose attention does something else
(a sliding window, soft-capped logits, attention sinks, state-space layers)
would load and then write wrong text, with no error, once a sequence reached
the feature. So only the architectures below are served, each proven token
for token against transformers' `generate` (tests/backend/test_exactness.py),
and a model of any other type, or one of these with such a feature switched
on, is refused at start-up with a message that names what is missing
(SPEC §5). This is a decision for correctness over reach: adding a family
means implementing what its attention needs and adding it to the exactness
test.
"""

from __future__ import annotations

from transformers import PretrainedConfig

# model_type -> the families it covers (for the message)
SUPPORTED = {
    "llama": "Llama 2 and 3, SmolLM2, TinyLlama, Falcon3 and other Llama-architecture models",
    "mistral": "Mistral without a sliding window within the served context",
    "qwen2": "Qwen2 and Qwen2.5 without a sliding window within the served context",
    "qwen3": "Qwen3 dense models",
    "qwen3_moe": "Qwen3 mixture-of-experts models",
    "mixtral": "Mixtral without a sliding window within the served context",
    "phi3": "Phi-3, Phi-3.5 and Phi-4-mini without a sliding window within the served context",
    "olmo2": "OLMo 2",
    "granite": "Granite 3",
    "smollm3": "SmolLM3 without a sliding window within the served context",
    "gpt2": "GPT-2",
}

# Config fields that change attention in ways the engine does not do.
UNSUPPORTED_FEATURES = {
    "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "final logit soft-capping",
}


class UnsupportedModel(ValueError):
    """The model would be served wrong; the message says what it needs."""


def check_supported(config: PretrainedConfig, max_seq_len: int) -> None:
    """Raise UnsupportedModel unless the engine serves this model exactly up to max_seq_len positions."""
    config = config.get_text_config()
    model_type = config.model_type
    if model_type not in SUPPORTED:
        raise UnsupportedModel(
            f"model type {model_type!r} is not supported: the engine serves exactly only "
            + "; ".join(f"{name} ({families})" for name, families in SUPPORTED.items())
        )
    for field, feature in UNSUPPORTED_FEATURES.items():
        if getattr(config, field, None):
            raise UnsupportedModel(
                f"{model_type} model with {feature} ({field}), which the engine does not do"
            )
    window = sliding_window(config)
    if window is not None and window < max_seq_len:
        raise UnsupportedModel(
            f"{model_type} model with a sliding window of {window} positions, which the engine does not "
            f"do: serve it with --max-seq-len {window} or less, where the window never comes into play"
        )


def sliding_window(config: PretrainedConfig) -> int | None:
    """The attention window the model uses, if any: none where `use_sliding_window` is off (Qwen2,
    Qwen3, SmolLM3 carry a window they do not use) or where no layer is a sliding one (`layer_types`)."""
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", True):
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types and "sliding_attention" not in layer_types:
        return None
    return window or None
