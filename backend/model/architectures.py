"""Which model architectures the engine serves exactly, and a clear refusal for the rest.

Llama, Mistral, Ministral, Ministral 3, Qwen2, Qwen3, Qwen3-MoE, Mixtral, OLMoE, Granite MoE, Granite's
window models, Qwen2-MoE, ERNIE 4.5 MoE, GLM-4.5, MiniMax-M2, Phi-3, SmolLM3, Granite, OLMo 2, OLMo 3,
EXAONE 4, Seed-OSS, ERNIE 4.5, Helium, GLM-4, Cohere, Cohere 2, Arcee, Hunyuan (dense), Gemma, Gemma 2,
Gemma 3 and gpt-oss run on the compact decoder runner (model/decoder_runner.py); every other family here
runs transformers' own modules with the engine's row attention plugged in through transformers' attention
interface (layers/attention.py). That is all their layers need: q and k norms, mixtures of experts, fused
projections, scaling multipliers, layers without rotary positions live in the modules, and the row
attention does what they ask of it beyond causal attention (sliding windows, soft-capped logits, attention
sinks: layers/attention_features.py).

State-space models (Mamba, Falcon-Mamba, Mamba-2) keep a recurrent state a row instead of keys and
values, and run on their own runner (model/mamba.py); the hybrids (Bamba, Granite 4, Falcon-H1, Jamba,
Nemotron-H) run transformers' modules with both the row attention and their Mamba mixers over the rows'
states (model/hybrid.py).

A family joins this list only once it is proven token for token against transformers' `generate`
(tests/backend/test_exactness.py runs the list); a model of any other type (RWKV, anything new) is
refused at start-up with a message that names what is served (SPEC §5), rather than loaded and served
wrong with no error. Falcon attends by itself, not through the interface: model/falcon.py gives its
layers the row attention. Latent-attention layers (DeepSeek's MLA) attend through it with their cache's
latents read as they are (model/latent_attention.py).
"""

from __future__ import annotations

import logging

from transformers import CONFIG_MAPPING, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

log = logging.getLogger(__name__)

# model_type -> the families it covers (for the message)
SUPPORTED = {
    "llama": "Llama 2 and 3, SmolLM2, TinyLlama, Falcon3 and other Llama-architecture models",
    "mistral": "Mistral, with or without a sliding window, and Mistral Small 3.1 and 3.2 (their text)",
    "qwen2": "Qwen2 and Qwen2.5, and the text of Qwen2-VL and Qwen2.5-VL",
    "qwen3": "Qwen3 dense models, and the text of Qwen3-VL",
    "qwen3_moe": "Qwen3 mixture-of-experts models, and the text of Qwen3-VL-MoE",
    "mixtral": "Mixtral",
    "qwen2_moe": "Qwen1.5-MoE and Qwen2-57B-A14B",
    "phi3": "Phi-3, Phi-3.5 and Phi-4-mini",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3, and the text of the multimodal ones",
    "gemma3n_text": "Gemma 3n (its text), with per-layer embeddings and layers sharing keys and values",
    "gemma4_text": "Gemma 4 (its text), with per-layer embeddings, layers sharing keys and values, experts",
    "gpt_oss": "gpt-oss",
    "cohere2": "Command R7B and other Cohere 2 models",
    "olmo2": "OLMo 2",
    "granite": "Granite 3",
    "smollm3": "SmolLM3",
    "ministral": "Ministral 8B, its window layers beside global ones",
    "gemma": "Gemma and CodeGemma",
    "starcoder2": "StarCoder 2",
    "phi": "Phi-1.5 and Phi-2",
    "phimoe": "Phi-3.5-MoE",
    "stablelm": "StableLM 2 and StableLM Zephyr",
    "cohere": "Command R, Command R+ and Aya Expanse",
    "glm": "GLM-4-9B (glm-4-9b-chat-hf)",
    "glm4": "GLM-4-0414 and GLM-Z1",
    "glm4_moe": "GLM-4.5, GLM-4.5-Air and GLM-4.6",
    "olmo": "OLMo",
    "olmo3": "OLMo 3, its window layers beside global ones",
    "olmoe": "OLMoE",
    "granitemoe": "Granite 3 mixture-of-experts models",
    "nemotron": "Nemotron and Minitron",
    "exaone4": "EXAONE 4.0",
    "ernie4_5": "ERNIE 4.5 dense models",
    "seed_oss": "Seed-OSS",
    "arcee": "Arcee's AFM",
    "helium": "Helium",
    "hunyuan_v1_dense": "Hunyuan dense models",
    "apertus": "Apertus",
    "ministral3": "Ministral 3 (its text)",
    "llama4_text": "Llama 4 Scout and Maverick (their text), experts, contexts up to their chunks of 8,192",
    "internlm3": "InternLM3",
    "iquestcoder": "IQuest-Coder",
    "cwm": "CWM (Code World Model), its window layers beside global ones",
    "jais2": "Jais 2",
    "vaultgemma": "VaultGemma",
    "nanochat": "nanochat",
    "flex_olmo": "FlexOlmo, experts",
    "hy_v3": "Hy3, experts",
    "mellum": "Mellum 2, window layers beside global ones, experts",
    "flint": "Flint, window layers beside global ones, experts",
    "kolibri1": "Kolibri-1, window layers beside global ones, experts",
    "gemma4_unified_text": "Gemma 4 12B (its text), window layers beside global ones",
    "minimax_m2": "MiniMax-M2, experts",
    "ernie4_5_moe": "ERNIE 4.5 mixture-of-experts models",
    "hunyuan_v1_moe": "Hunyuan mixture-of-experts models",
    "granitemoeshared": "Granite mixture-of-experts models with a shared expert",
    "solar_open": "Solar Open, experts",
    "jetmoe": "JetMoE, experts in attention and MLP",
    "cohere2_moe": "Cohere 2 mixture-of-experts models, window layers beside global ones",
    "exaone_moe": "EXAONE mixture-of-experts models, window layers beside global ones",
    "afmoe": "Arcee's AFMoE models, window layers beside global ones, experts",
    "laguna": "Laguna, window layers beside global ones, experts",
    "granite_swa": "Granite window-attention models, attention sinks",
    "granitemoe_swa": "Granite window-attention mixture-of-experts models, attention sinks",
    "deepseek_v2": "DeepSeek-V2, V2-Lite, V2.5 and DeepSeek-Coder-V2, latent attention, experts",
    "deepseek_v3": "DeepSeek-V3, R1 and V3.1, latent attention, experts",
    "deepseek_v32": "DeepSeek-V3.2, latent attention, experts, contexts up to its sparse attention's 2,048",
    "glm_moe_dsa": "GLM-5, latent attention, experts, contexts up to its sparse attention's 2,048",
    "axk1": "A.X K1, latent attention, experts",
    "longcat_flash": "LongCat-Flash, latent attention, experts (zero-computation ones among them)",
    "glm4_moe_lite": "GLM-4.7-Flash, latent attention, experts",
    "minicpm3": "MiniCPM3, latent attention",
    "youtu": "Youtu-LLM, latent attention",
    "falcon": "Falcon 7B, 40B and 180B, and Falcon-RW with its ALiBi positions",
    "gpt2": "GPT-2",
    "gpt_neox": "GPT-NeoX-20B, Pythia, Dolly v2, RedPajama-INCITE and StableLM-Alpha",
    "opt": "OPT",
    "gpt_bigcode": "StarCoder, StarCoderBase and WizardCoder-15B (GPT-BigCode, one key head for all queries)",
    "mamba": "Mamba, a state-space model (each row a recurrent state instead of keys and values)",
    "falcon_mamba": "Falcon-Mamba",
    "mamba2": "Mamba-2 and Codestral Mamba",
    "bamba": "Bamba, Mamba-2 layers among attention layers",
    "granitemoehybrid": "Granite 4.0 hybrids (H-Micro, H-Tiny, H-Small)",
    "falcon_h1": "Falcon-H1, attention and Mamba-2 side by side in each layer",
    "jamba": "Jamba, Mamba layers among attention layers, experts",
    "nemotron_h": "Nemotron-H and Nemotron Nano 2, Mamba-2, attention, MLP and expert layers",
    "qwen3_next": "Qwen3-Next, Gated DeltaNet layers among gated attention layers, experts",
    "qwen3_5_text": "Qwen3.5 dense models (their text), Gated DeltaNet layers among gated attention layers",
    "qwen3_5_moe_text": "Qwen3.5 mixture-of-experts models (their text)",
    "olmo_hybrid": "OLMo's hybrid, Gated DeltaNet layers among attention layers",
    "lfm2": "LFM2, short convolution layers among attention layers, and the text of LFM2-VL",
    "lfm2_moe": "LFM2 mixture-of-experts models",
    "lfm3": "LFM3, short convolution layers among global and window attention layers",
}

# Multimodal checkpoints whose towers transformers builds with a package the server does not install
# (Gemma 3n's vision tower is a timm MobileNet), that transformers builds as no causal LM (Mistral 3's:
# Mistral Small 3.1 and 3.2, Ministral 3), or whose composite would run on transformers' modules where its
# text model alone runs on the decoder runner (Gemma 3 4B-27B's, Llama 4's): their text model alone is loaded
# (loader.load_text_alone), its weights renamed from the composite's names by these patterns (files written
# by transformers 4 name them under `language_model.`), the towers' left unread. LFM2-VL's composite would
# run on transformers' modules too, where its text model, LFM2's, runs on the decoder runner.
COMPOSITE_NAMES = {
    r"^model\.language_model\.": "model.",
    r"^language_model\.model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
}
TEXT_ALONE = {
    "gemma3n": {r"^model\.language_model\.": "model."},
    "mistral3": COMPOSITE_NAMES,
    "gemma3": COMPOSITE_NAMES,
    "qwen2_vl": COMPOSITE_NAMES,  # (Qwen2-VL's and Qwen2.5-VL's first files name the text model as Qwen2's)
    "qwen2_5_vl": COMPOSITE_NAMES,
    "qwen3_vl": COMPOSITE_NAMES,
    "qwen3_vl_moe": COMPOSITE_NAMES,
    "llama4": COMPOSITE_NAMES,
    "lfm2_vl": COMPOSITE_NAMES,
}
# Multimodal families whose text model, given text alone, is a served family's layer for layer: Qwen2-VL's
# and Qwen2.5-VL's is Qwen2's, Qwen3-VL's Qwen3's, Qwen3-VL-MoE's Qwen3-MoE's (its router always
# renormalizing its top k: `TEXT_AS_FIELDS`). Their rotation of three position streams (time, height,
# width), each over its sections of a head, is one rotation where the streams are equal, as they are for
# text. Their text config is made that family's (`text_config_of`), and their text model loaded alone.
TEXT_AS = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe"}
TEXT_AS_FIELDS = {"qwen3_vl_moe": {"norm_topk_prob": True}}
# ... and of those, the ones whose files keep each layer's experts as [experts, in, out] (transformers turns
# them on load for the composite's own class, not for the text family's, whose module keeps [experts, out,
# in]): their text model's weights are read by turned_experts.read_text_weights (loader.load_text_alone)
EXPERTS_STORED_TRANSPOSED = {"qwen3_vl_moe"}


def text_config_of(config: PretrainedConfig) -> PretrainedConfig:
    """The config of the text model the server serves of a checkpoint: a multimodal one's text config
    (made its family's where TEXT_AS names one: the rotation's sections dropped), else the config."""
    text = config.get_text_config()
    family = TEXT_AS.get(config.model_type)
    if family is None:
        return text
    fields = {k: v for k, v in text.to_dict().items() if k not in ("model_type", "architectures")}
    rope = {k: v for k, v in (fields.get("rope_parameters") or {}).items() if not k.startswith("mrope")}
    if rope.get("rope_type") in (None, "mrope"):  # (Qwen2-VL's "mrope" is the default rotation, by streams)
        rope["rope_type"] = "default"
    fields["rope_parameters"] = rope
    fields["tie_word_embeddings"] = getattr(config, "tie_word_embeddings", False)  # (the composite's)
    fields |= TEXT_AS_FIELDS.get(config.model_type, {})
    return CONFIG_MAPPING[family](**fields)


class UnsupportedModel(ValueError):
    """The model would be served wrong; the message says what it needs."""


def check_supported(config: PretrainedConfig) -> None:
    """Raise UnsupportedModel unless the engine serves this model exactly."""
    composite = config.model_type
    config = text_config_of(config)
    model_type = config.model_type
    if model_type not in SUPPORTED:
        raise UnsupportedModel(
            f"model type {model_type!r} is not supported: the engine serves exactly only "
            + "; ".join(f"{name} ({families})" for name, families in SUPPORTED.items())
        )
    # A multimodal checkpoint of a served text model, which transformers builds as no causal LM, and whose
    # text model this server does not load alone (TEXT_ALONE): no weights would load (Llava's, say)
    if composite != model_type and composite not in TEXT_ALONE and not builds_causal_lm(composite):
        raise UnsupportedModel(
            f"model type {composite!r} is a multimodal model of a {model_type} text model, which "
            "transformers builds as no causal LM: of such models the server loads the text of "
            f"{', '.join(sorted(TEXT_ALONE))}; serve its text model's own checkpoint"
        )
    # EmbeddingGemma (Gemma 3's layers), and Gemma 4's "all": every token reads every other, which a
    # generator's rows, read up to each query's position, do not do.
    if getattr(config, "use_bidirectional_attention", None) in (True, "all"):
        raise UnsupportedModel(
            f"this {model_type} model attends both ways (use_bidirectional_attention), as an embedding model "
            "does, not causally as a generator: serve it beside a generator with --embedding-model"
        )


def builds_causal_lm(model_type: str) -> bool:
    """Whether transformers builds a causal LM of a model type (AutoModelForCausalLM)."""
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def check_own_code(config_dict: dict, trust_remote_code: bool) -> bool:
    """Raise UnsupportedModel where the model's config.json maps transformers' Auto classes to code of its
    own (`auto_map`): its modeling code always, since the engine serves transformers' own classes,
    proven exact, with its row attention (a model's own class would attend as it likes); its
    configuration or tokenizer code unless the operator trusts it (--trust-remote-code), since it runs
    in the backend process as it is. Returns whether the model's own configuration code is to be read.

    A model of a type transformers has classes for, and the engine serves, is served by those classes
    whatever its `auto_map` says, as transformers and vLLM serve it: DeepSeek publishes V2 and V3 with
    the modeling code they were written in, which transformers' classes of their type port. Its modeling
    and configuration code is not run then, trusted or not; its tokenizer's runs only where trusted."""
    own = config_dict.get("auto_map") or {}
    model_type = config_dict.get("model_type")
    if own and model_type in SUPPORTED and model_type in CONFIG_MAPPING:
        log.warning(
            "the model ships its own code (%s): transformers' own %s classes serve it, not that code",
            ", ".join(f"{n}: {c}" for n, c in sorted(own.items())),
            model_type,
        )
        return False
    modeling = sorted(name for name in own if name.startswith("AutoModel"))
    if modeling:
        raise UnsupportedModel(
            f"the model ships its own modeling code ({', '.join(f'{n}: {own[n]}' for n in modeling)}), which "
            "the engine does not serve: it serves transformers' own model classes, with its attention"
        )
    if own and not trust_remote_code:
        raise UnsupportedModel(
            f"the model ships its own code ({', '.join(f'{n}: {c}' for n, c in sorted(own.items()))}), which "
            "runs only with --trust-remote-code: that runs the model's code as it is, in the backend process"
        )
    return True


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
