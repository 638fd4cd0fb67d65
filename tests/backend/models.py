"""Models for backend tests: tiny random-weight ones for mechanics, the default one for real text."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    CONFIG_MAPPING,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    BertConfig,
    FalconConfig,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from scripts.random_bert import write_random_bert

TINY_VOCAB = 512
TINY_EOS = TINY_VOCAB - 1

# A sliding window this short comes into play within the tests' prompts.
TINY_WINDOW = 8

# A hybrid's Mamba-2 layers: 8 heads of 16 in two groups, a state of 8, scanned in chunks of 8 (prompts
# cross their bounds).
HYBRID_MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=8)

# A Gated DeltaNet layer, then an attention layer (Qwen3-Next's and Qwen3.5's kinds).
GATED_DELTA = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
TINY_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# A latent-attention layer (DeepSeek's MLA): a latent of 32 a token beside a rotated key of 8, expanded
# into four heads' key parts of 16 and values of 12 (not 16: a value read as a key part would not fit).
TINY_LATENT = dict(
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    head_dim=8,
    num_key_value_heads=4,
    initializer_range=0.15,
)
DSA_INDEXER = dict(index_head_dim=16, index_n_heads=4, index_topk=256)
DEEPSEEK_EXPERTS = dict(
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
)
# The sizes of a tiny model of Llama's layer (`tiny_model`, `tiny_qwen_vl`): two layers, 64 wide, 4 query
# heads over 2 key and value heads
TINY_LAYERS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
# Families whose configs name their sizes their own way: GPT-NeoX's rotary positions on a quarter of each
# head and its attention and MLP side by side (Pythia's); OPT's embeddings narrower than its layers,
# projected in and out (OPT-350m's); GPT-BigCode's one key head for all queries (StarCoder's).
OLDER_FAMILIES: dict[str, dict] = {
    "gpt_neox": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        rotary_pct=0.25,
        use_parallel_residual=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    "opt": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=128,
        word_embed_proj_dim=32,
        max_position_embeddings=512,
    ),
    "gpt_bigcode": dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, multi_query=True),
}

# What each family's tiny config sets beyond the Llama-like sizes: its own features switched on where
# a default would leave them off (granite's multipliers, a layer without rotary positions for smollm3),
# experts small enough for a test (4, two of them chosen per token), a window layer beside a global one.
# Gemma's tied embeddings make a random model repeat its input whatever its attention does, and Gemma 2's
# soft-capping bites only logits larger than random weights give: untied, larger weights and a small cap,
# so that attention without them gives other tokens (tested in tests/backend/test_attention_features.py).
FAMILY_EXTRAS: dict[str, dict] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    # Qwen2-MoE: experts and a shared expert behind a sigmoid gate; its attention has a window it does not
    # use (Qwen2's)
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
    "phi3": {},
    "olmo2": {},
    "granite": {
        "embedding_multiplier": 12.0,
        "logits_scaling": 8.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.0625,
    },
    "smollm3": {"no_rope_layers": [1, 0]},  # the second layer has no rotary embedding
    "gemma2": {
        "sliding_window": TINY_WINDOW,  # the first layer's: Gemma 2 alternates window and global layers
        "attn_logit_softcapping": 1.0,
        "initializer_range": 0.5,
        "tie_word_embeddings": False,
    },
    "gemma3_text": {
        "sliding_window": TINY_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "tie_word_embeddings": False,
    },
    # Gemma 4: window layers beside global ones with wider heads (32, of one key head whose keys are its
    # values); a per-layer embedding into each layer; the last two layers attend over the keys and values of
    # the last earlier layer of their kind, and have MLPs twice as wide; experts beside each MLP
    "gemma4_text": {
        "num_hidden_layers": 4,
        "sliding_window": TINY_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "global_head_dim": 32,
        "attention_k_eq_v": True,
        "num_global_key_value_heads": 1,
        "vocab_size_per_layer_input": TINY_VOCAB,
        "hidden_size_per_layer_input": 8,
        "num_kv_shared_layers": 2,
        "use_double_wide_mlp": True,
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": False,
    },
    # Gemma 3n: window layers beside a global one, a per-layer embedding into each layer, its residual
    # stream in two (AltUp) with a low-rank path beside attention (Laurel); the last two layers attend over
    # the keys and values of the last earlier layer of their kind; the first layer's MLP keeps its largest
    # activations only (activation sparsity)
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "sliding_window": TINY_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "vocab_size_per_layer_input": TINY_VOCAB,
        "hidden_size_per_layer_input": 8,
        "num_kv_shared_layers": 2,
        "altup_num_inputs": 2,
        "laurel_rank": 8,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
        "intermediate_size": [128] * 4,
        "tie_word_embeddings": False,
    },
    "gpt_oss": {  # alternates window and global layers; every layer has its sinks
        "sliding_window": TINY_WINDOW,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0},
    },
    "cohere2": {"sliding_window": TINY_WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    # Window layers beside global ones; StarCoder 2's window is every layer's
    "ministral": {"sliding_window": TINY_WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    "olmo3": {"sliding_window": TINY_WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    "exaone4": {"sliding_window": TINY_WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    "starcoder2": {"sliding_window": TINY_WINDOW, "tie_word_embeddings": False},
    # Gemma's and Cohere's tied embeddings would make a random model repeat its input (above): untied
    "gemma": {"tie_word_embeddings": False, "initializer_range": 0.2},
    "cohere": {"tie_word_embeddings": False},
    "phi": {"partial_rotary_factor": 0.5},  # rotary positions on half of each head, as Phi-2's
    "stablelm": {"partial_rotary_factor": 0.25},
    "nemotron": {},
    "glm": {},
    "glm4": {},
    "olmo": {},
    "ernie4_5": {},
    "seed_oss": {},
    "arcee": {},
    "helium": {},
    "hunyuan_v1_dense": {},
    "apertus": {},
    # Served from 2026-12-03 (the window ones' window in play, experts four, two chosen a token)
    # Ministral 3: its queries' factor (Llama 4's) from position 16 on, where its YaRN rotation's original
    # length ends (16384 in its checkpoints), a larger beta than its 0.1 so that the factor bites
    "ministral3": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 32.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.5,
        }
    },
    # Llama 4: a rotated layer (chunked attention, its L2 norms of heads), then one without rotary positions
    # (its queries' temperature, from position 3 on: a floor of 4 where Llama 4's is 8,192) whose MLP is
    # four experts, one chosen a token, and a shared expert
    "llama4_text": {
        "no_rope_layers": [1, 0],
        "moe_layers": [1],
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "intermediate_size_mlp": 128,
        "intermediate_size": 32,
        "floor_scale": 4,
        "attn_scale": 0.5,
    },
    "minimax_m2": {"num_local_experts": 4, "num_experts_per_tok": 2},
    # Served from 2026-12-07: families transformers 5 added whose modules run exactly over the row attention
    # (InternLM3's, IQuest-Coder's and CWM's on the decoder runner), their windows in play, experts four
    "internlm3": {},
    "iquestcoder": {},
    "cwm": {  # (its Llama 3 rotation's original length within the tiny model's)
        "sliding_window": TINY_WINDOW,
        "layer_types": ["full_attention", "sliding_attention"],
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 1000000.0,
            "factor": 16.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 64,
        },
    },
    "jais2": {},  # (LayerNorms, biases, an MLP of ReLU(up)^2)
    "vaultgemma": {"sliding_window": TINY_WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    "nanochat": {},  # (norms without weights, an MLP of ReLU(up)^2, logits soft-capped)
    "flex_olmo": {"num_experts": 4, "num_experts_per_tok": 2},
    "hy_v3": {**TINY_EXPERTS, "mlp_layer_types": ["dense", "sparse"]},
    "mellum": {
        "sliding_window": TINY_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "mlp_layer_types": ["sparse", "sparse"],
    },
    "flint": {
        "sliding_window": TINY_WINDOW,
        "layer_types": ["full_attention", "sliding_attention"],
        **TINY_EXPERTS,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [0],
    },
    "kolibri1": {
        "sliding_window": TINY_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
    "gemma4_unified_text": {
        "sliding_window": TINY_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": False,
    },
    "ernie4_5_moe": {"moe_num_experts": 4, "moe_k": 2},
    "hunyuan_v1_moe": {"num_experts": 4, "moe_topk": 2},
    "granitemoeshared": {"num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 32},
    "solar_open": {"n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1},
    "jetmoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "cohere2_moe": {
        "sliding_window": TINY_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        **TINY_EXPERTS,
    },
    "exaone_moe": {
        "sliding_window": TINY_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        **TINY_EXPERTS,
        "first_k_dense_replace": 1,
    },
    "afmoe": {
        "sliding_window": TINY_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        **TINY_EXPERTS,
        "num_dense_layers": 1,
    },
    "laguna": {
        "sliding_window": TINY_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        **TINY_EXPERTS,
    },
    # Granite's window models: every layer's sinks (random below), window layers beside global ones
    "granite_swa": {"sliding_window": TINY_WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    "granitemoe_swa": {
        "sliding_window": TINY_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    # Experts: four, two chosen a token; GLM-4.5's first layer dense, its second of experts
    "granitemoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "phimoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "glm4_moe": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
    # Latent attention (DeepSeek's MLA): DeepSeek-V2-Lite's queries straight from the hidden state, the
    # others' through their own low rank; V2's complex rotation, V3's interleaved, MiniCPM3's not; the
    # first layer dense, the second of experts where the family has them.
    "deepseek_v2": TINY_LATENT | DEEPSEEK_EXPERTS | {"q_lora_rank": None, "topk_method": "greedy"},
    "deepseek_v3": TINY_LATENT | DEEPSEEK_EXPERTS | {"n_group": 2, "topk_group": 1},
    "glm4_moe_lite": TINY_LATENT | DEEPSEEK_EXPERTS | {"mlp_layer_types": ["dense", "sparse"]},
    # DeepSeek-V3.2's and GLM-5's sparse attention: an indexer of four heads of 16, its top 256 past the rows'
    # 128 (every key chosen: the context they are served within); GLM-5's second layer shares the first's
    "deepseek_v32": TINY_LATENT | DEEPSEEK_EXPERTS | DSA_INDEXER | {"n_group": 2, "topk_group": 1},
    "glm_moe_dsa": TINY_LATENT
    | DEEPSEEK_EXPERTS
    | DSA_INDEXER
    | {"n_group": 2, "topk_group": 1, "indexer_types": ["full", "shared"]},
    "axk1": TINY_LATENT
    | DEEPSEEK_EXPERTS
    | {"n_group": 2, "topk_group": 1, "mlp_layer_types": ["dense", "sparse"]},
    # LongCat-Flash: one layer of two attention sublayers beside a mixture with zero-computation experts
    "longcat_flash": TINY_LATENT
    | {
        "num_layers": 2,
        "n_routed_experts": 4,
        "zero_expert_num": 2,
        "moe_topk": 2,
        "expert_ffn_hidden_size": 32,
    },
    "minicpm3": TINY_LATENT | {"scale_emb": 1},
    "youtu": TINY_LATENT,
    # Hybrids: a Mamba-2 layer before an attention layer; Granite 4's with its multipliers and four
    # experts, two chosen a token.
    "bamba": {"attn_layer_indices": [1], **HYBRID_MAMBA},
    # Falcon-H1: attention and a Mamba-2 mixer side by side in every layer, each scaled by its own
    # multipliers (not 1, so that one left out gives other tokens); weights large enough that the mixer's
    # output decides tokens beside the attention's
    "falcon_h1": {
        **HYBRID_MAMBA,
        "initializer_range": 0.2,
        "mamba_d_ssm": 128,
        "embedding_multiplier": 1.5,
        "lm_head_multiplier": 0.8,
        "ssm_in_multiplier": 1.3,
        "ssm_out_multiplier": 0.7,
        "attention_in_multiplier": 1.2,
        "attention_out_multiplier": 0.9,
        "key_multiplier": 1.1,
        "ssm_multipliers": [0.9, 1.1, 1.2, 0.8, 1.05],
        "mlp_multipliers": [1.1, 0.9],
        "tie_word_embeddings": False,
    },
    # Jamba: a Mamba layer (with norms of its scan's time step, B and C), then an attention layer whose
    # MLP is four experts, two chosen a token
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "mamba_d_state": 8,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
    },
    # Nemotron-H: a Mamba-2 layer, an attention layer, a layer of experts (four, two chosen a token,
    # one shared) and an MLP layer
    "nemotron_h": {
        "layer_types": ["linear_attention", "full_attention", "moe", "mlp"],
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "n_groups": 2,
        "ssm_state_size": 8,
        "chunk_size": 8,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
        "initializer_range": 0.2,
    },
    # Qwen3-Next and Qwen3.5: a Gated DeltaNet layer (four value heads over two key heads, as the real
    # ones group them) before a gated attention layer; Qwen3-Next's and Qwen3.5-MoE's MLPs four experts,
    # two chosen a token, beside a shared one
    "qwen3_next": {**GATED_DELTA, **TINY_EXPERTS, "shared_expert_intermediate_size": 32},
    "qwen3_5_text": GATED_DELTA,
    "qwen3_5_moe_text": {**GATED_DELTA, **TINY_EXPERTS, "shared_expert_intermediate_size": 32},
    # OLMo's hybrid: its rate may reach 2 (`linear_allow_neg_eigval`), so that a rate left at 0..1 gives
    # other tokens
    "olmo_hybrid": {**GATED_DELTA, "linear_allow_neg_eigval": True},
    # LFM2: a short convolution layer (its kernel of 3 reaching past a token) before an attention layer,
    # weights large enough that the convolution's output decides tokens; LFM2-MoE's second layer's MLP four
    # experts, two chosen a token, its first dense
    "lfm2": {
        "layer_types": ["conv", "full_attention"],
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
    },
    # LFM3: its norms of each sublayer's output and gated attention, a window layer among global ones
    "lfm3": {
        "num_hidden_layers": 4,
        "layer_types": ["conv", "full_attention", "conv", "sliding_attention"],
        "sliding_window": TINY_WINDOW,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
    },
    "lfm2_moe": {
        "layer_types": ["conv", "full_attention"],
        **TINY_EXPERTS,
        "num_dense_layers": 1,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
    },
    "granitemoehybrid": {
        "layer_types": ["linear_attention", "full_attention"],
        **HYBRID_MAMBA,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "embedding_multiplier": 12.0,
        "logits_scaling": 8.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.0625,
        "tie_word_embeddings": False,
    },
}


def tiny_model(
    architecture: str = "llama",
    seed: int = 0,
    vocab_size: int = TINY_VOCAB,
    eos_token_id: int = TINY_EOS,
    head_dim: int = 16,
    **extras,
) -> torch.nn.Module:
    """A two-layer random-weight causal LM of the given architecture, float32, on the CPU (`head_dim`:
    of the Llama-like ones; real models' 64 where a test must reach the CPU's attention loop; `extras`:
    config fields over the family's own, a sliding window say)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, eos_token_id=eos_token_id, bos_token_id=1, pad_token_id=0)
    llama_like = TINY_LAYERS | dict(head_dim=head_dim, **common)
    if architecture == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common))
    elif architecture in OLDER_FAMILIES:
        config = CONFIG_MAPPING[architecture](**OLDER_FAMILIES[architecture], **common, **extras)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    elif architecture == "falcon":  # Falcon-40B's layout: two key heads, each shared by two query heads
        config = FalconConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            new_decoder_architecture=True,
            num_kv_heads=2,
            max_position_embeddings=512,
            **common,
            **extras,
        )
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    elif architecture in ("mamba", "falcon_mamba", "mamba2"):  # state-space: a recurrent state a row
        # Mamba-2: 8 heads of 16 in two groups, scanned in chunks of 8 (prompts cross their bounds).
        heads = dict(num_heads=8, head_dim=16, n_groups=2, chunk_size=8) if architecture == "mamba2" else {}
        config = CONFIG_MAPPING[architecture](
            hidden_size=64,
            state_size=8,
            num_hidden_layers=2,
            conv_kernel=4,
            # Tied embeddings make a random Mamba repeat its last input whatever its layers do: untied.
            tie_word_embeddings=False,
            **heads,
            **common,
            **extras,
        )
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    elif architecture in FAMILY_EXTRAS:
        config = CONFIG_MAPPING[architecture](**(llama_like | FAMILY_EXTRAS[architecture] | extras))
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        raise ValueError(architecture)
    # Query and key norms (Qwen3, OLMo 2, Gemma 3, LFM2) start as ones: random, so that a runner that applied
    # one in place of the other, or none, would give other tokens.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            # (Gemma 4's every norm scales by its weight, ones to start with: random too.)
            if name.endswith(
                ("q_norm.weight", "k_norm.weight", "q_layernorm.weight", "k_layernorm.weight")
            ) or (architecture in ("gemma4_text", "gemma3n_text") and "norm" in name):
                parameter.uniform_(0.5, 1.5)
            # Gemma 3's four norms a layer start as zeros (each scales by 1 + weight): the same scale for
            # all, which would hide one applied in place of another.
            elif architecture == "gemma3_text" and name.endswith("layernorm.weight"):
                parameter.uniform_(-0.5, 0.5)
            # A Gated DeltaNet's decays start anywhere in exp(-16..-0.01) a token: most heads would forget
            # a row's past within a token or two, which would hide a state carried wrong between steps.
            elif name.endswith("self_attn.sinks") and architecture.startswith("granite"):  # zeros to start
                parameter.uniform_(-1.0, 1.0)
            elif name.endswith("linear_attn.A_log"):
                parameter.copy_(torch.empty_like(parameter).uniform_(0.01, 0.2).log())
    return model.eval()


def tiny_qwen3_5_multimodal() -> torch.nn.Module:
    """A Qwen3.5 checkpoint as Qwen publishes one: Qwen3_5ForConditionalGeneration, the tiny text model of
    `tiny_model("qwen3_5_text")` (its weights) beside a one-block vision tower, saved under the composite
    model's names (model.language_model.*, model.visual.*)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = tiny_model("qwen3_5_text")
    text_config = {k: v for k, v in text.config.to_dict().items() if k not in ("architectures", "model_type")}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text_config, vision_config=vision))
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    return model.eval()


def tiny_qwen_vl(model_type: str) -> torch.nn.Module:
    """A Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE checkpoint as Qwen publishes one
    (Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration), tiny and of random weights, its text model's rotation in three
    sections of each head (time, height and width streams; Qwen3-VL's interleaved) and a one-block vision
    tower (Qwen3-VL-MoE's text model four experts of 16, two chosen a token: their gate and up 32 wide
    beside the hidden size's 64, so that a weight kept turned would not fit): the reference whose
    `generate` its text model, served alone as Qwen2's, Qwen3's or Qwen3-MoE's, must give."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    torch.manual_seed(0)
    sizes = TINY_LAYERS | dict(
        head_dim=16, vocab_size=TINY_VOCAB, eos_token_id=TINY_EOS, bos_token_id=1, pad_token_id=0
    )
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    if model_type == "qwen3_vl":
        text = sizes | {"rope_parameters": rope | {"mrope_interleaved": True}}
        config = Qwen3VLConfig(text_config=text, vision_config=vision | {"deepstack_visual_indexes": [0]})
        model = Qwen3VLForConditionalGeneration(config)
    elif model_type == "qwen3_vl_moe":
        experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
        text = sizes | experts | {"rope_parameters": rope | {"mrope_interleaved": True}}
        config = Qwen3VLMoeConfig(text_config=text, vision_config=vision | {"deepstack_visual_indexes": [0]})
        model = Qwen3VLMoeForConditionalGeneration(config)
        with torch.no_grad():  # (a fresh router's weights are zeros: every expert alike to choose)
            for layer in model.model.language_model.layers:
                layer.mlp.gate.weight.normal_(0, 0.5)
    else:
        text = sizes | {"rope_parameters": rope}
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision))
    return model.eval()


def tiny_gemma4_multimodal(family: str = "gemma4") -> torch.nn.Module:
    """A Gemma 4 checkpoint as Google publishes one: Gemma4ForConditionalGeneration (or Gemma 4 12B's
    Gemma4UnifiedForConditionalGeneration: `family` "gemma4_unified"), the tiny text model of
    `tiny_model("gemma4_text")` (its weights) beside a one-layer vision tower, saved under the composite
    model's names (model.language_model.*, model.vision_tower.*)."""
    text = tiny_model(f"{family}_text")
    text_config = {k: v for k, v in text.config.to_dict().items() if k not in ("architectures", "model_type")}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    vision |= dict(num_key_value_heads=2, head_dim=16)
    config = CONFIG_MAPPING[family](text_config=text_config, vision_config=vision, tie_word_embeddings=False)
    model = AutoModelForImageTextToText.from_config(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    return model.eval()


def write_multimodal(directory: Path, text: torch.nn.Module, family: str, transformers_4_names: bool) -> Path:
    """A multimodal checkpoint as its maker publishes one, over a model directory of `text`: Mistral 3's
    (Mistral Small 3.1 and 3.2 over a Mistral text model, Ministral 3 over its own), Gemma 3's (4B-27B),
    Llama 4's or LFM2-VL's, the composite's config (its tower's defaults) and the text model's weights under
    the composite's names, as transformers 5 writes them (model.language_model.*, lm_head.*) or as
    transformers 4 did (language_model.model.*, language_model.lm_head.*), a tower's and the projector's
    weights beside them."""
    from safetensors.torch import save_file

    text_config = {k: v for k, v in text.config.to_dict().items() if k != "architectures"}
    composite = CONFIG_MAPPING[family](text_config=text_config)
    composite.architectures = [MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[family]]
    composite.save_pretrained(directory)
    # where the text model's weights and the towers' go under the composite's names
    if transformers_4_names:
        body, head, outside = "language_model.model.", "language_model.lm_head.", ""
    else:
        body, head, outside = "model.language_model.", "lm_head.", "model."
    weights = {
        re.sub(r"^model\.", body, re.sub(r"^lm_head\.", head, k)): v.contiguous()
        for k, v in text.state_dict().items()
    }
    weights[outside + "vision_tower.patch_conv.weight"] = torch.zeros(8, 3, 4, 4)
    weights[outside + "multi_modal_projector.linear_1.weight"] = torch.zeros(8, 8)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def write_gemma3n_multimodal(directory: Path, text: torch.nn.Module) -> Path:
    """Gemma 3n as Google publishes it, over a model directory of `text` (a tiny Gemma 3n text model):
    Gemma3nForConditionalGeneration's config (its towers' defaults) and the text model's weights under the
    composite's names (model.language_model.*), a tower's weight beside them. Written by hand: building
    the composite model needs timm, for its vision tower."""
    from safetensors.torch import save_file
    from transformers import Gemma3nConfig

    text_config = {k: v for k, v in text.config.to_dict().items() if k not in ("architectures", "model_type")}
    config = Gemma3nConfig(text_config=text_config)
    config.architectures = ["Gemma3nForConditionalGeneration"]
    config.save_pretrained(directory)
    weights = {
        re.sub(r"^model\.", "model.language_model.", k): v.contiguous() for k, v in text.state_dict().items()
    }
    weights["model.vision_tower.timm_model.conv_stem.conv.weight"] = torch.zeros(8, 3, 3, 3)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def write_gguf_linears(
    path: Path, model: torch.nn.Module, kinds: dict[str, object], embedding: object | None = None
) -> Path:
    """A GGUF file of a tiny Llama's linear layers but its head, as llama.cpp's converter writes them:
    q and k with their rows permuted for its rotary layout, and each layer quantized by the gguf package
    to the type `kinds` gives by a part of its module name ("self_attn": GGMLQuantizationType.Q8_0), the
    K-quants by tests/backend/k_quants.py. `embedding`: a type to write an untied model's input embedding
    in (its head then in float32), as a file of a model with a head of its own.
    Only what gguf_weights reads is there: no tokenizer, no norms."""
    from gguf import GGUFWriter, get_tensor_name_map
    from gguf.constants import MODEL_ARCH

    from tests.backend.k_quants import quantize

    config = model.config
    names = get_tensor_name_map(MODEL_ARCH.LLAMA, config.num_hidden_layers)
    writer = GGUFWriter(str(path), "llama")
    for module_name, module in model.named_modules():
        if type(module) is not torch.nn.Linear or module is model.get_output_embeddings():
            continue
        weight = module.weight.detach().numpy()
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
        for projection, count in heads.items():
            if module_name.endswith(projection):  # llama.cpp's permutation, which transformers undoes
                weight = weight.reshape(count, 2, -1, weight.shape[1]).swapaxes(1, 2).reshape(weight.shape)
        kind = next(kind for part, kind in kinds.items() if part in module_name)
        writer.add_tensor(f"{names.get_name(module_name)}.weight", quantize(weight, kind), raw_dtype=kind)
    if embedding is not None:
        table = model.get_input_embeddings().weight.detach().numpy()
        writer.add_tensor("token_embd.weight", quantize(table, embedding), raw_dtype=embedding)
        writer.add_tensor("output.weight", model.get_output_embeddings().weight.detach().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


TINY_BERT_WORDS = ("the", "cat", "sat", "on", "mat", "stock", "markets", "fell", "sharply", "today", "a")
TINY_BERT_POSITIONS = 64


def write_tiny_bert(directory: Path, reranker: bool = False) -> Path:
    """A sentence-embedding model directory, built offline: a two-layer random BertModel (64 positions)
    and a WordPiece tokenizer of a few words, letters and their `##` pieces, saved as transformers does.
    `reranker`: a cross-encoder instead, BertForSequenceClassification with one label, whose tokenizer
    joins a pair as BERT's does ([CLS] query [SEP] document [SEP], the document's tokens of type 1)."""
    config = BertConfig(
        vocab_size=0,  # the tokenizer's
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=TINY_BERT_POSITIONS,
        # BERT's initial weights (std 0.02) give every pair about the same logit: wider ones tell them apart.
        initializer_range=0.5 if reranker else 0.02,
    )
    return write_random_bert(directory, config, TINY_BERT_WORDS, reranker)


class MarkerTokenizer:
    """Decodes every token id to a marker "<id>", so that text reveals the exact token ids.

    Wraps a real tokenizer (for EOS and encoding) or stands alone with a toy encoding.
    """

    def __init__(self, real=None, eos_token_id: int = TINY_EOS):
        self.real = real
        self.eos_token_id = real.eos_token_id if real is not None else eos_token_id

    def __call__(self, text: str):
        if self.real is not None:
            return self.real(text)
        return _Encoding([2 + ord(c) % (TINY_VOCAB - 3) for c in text])

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in token_ids)

    @staticmethod
    def ids(text: str) -> list[int]:
        return [int(i) for i in re.findall(r"<(\d+)>", text)]


class _Encoding:
    def __init__(self, input_ids):
        self.input_ids = input_ids


def reference_greedy(model, prompt_ids, max_tokens: int, eos_ids) -> list[int]:
    """What `model.generate` gives for this prompt alone, greedy, without its EOS token (on the model's
    device)."""
    input_ids = torch.tensor([list(prompt_ids)], device=next(model.parameters()).device)
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_tokens,
        eos_token_id=sorted(eos_ids),
        pad_token_id=sorted(eos_ids)[0],
    )
    generated = output[0, input_ids.shape[1] :].tolist()
    return [t for t in generated if t not in eos_ids]


def drive(engine, arrivals: list[tuple[int, object]], max_steps: int = 10_000) -> dict[str, list]:
    """Step the engine, submitting each request at its arrival step; return every request's pieces."""
    pieces: dict[str, list] = {}
    arrivals = sorted(arrivals, key=lambda arrival: arrival[0])
    step = 0
    while arrivals or engine.has_work:
        while arrivals and arrivals[0][0] <= step:
            engine.submit(arrivals.pop(0)[1])
        for piece in engine.step():
            pieces.setdefault(piece.request_id, []).append(piece)
        step += 1
        assert step < max_steps, "the engine did not finish"
    return pieces


def text_of(pieces: list) -> str:
    return "".join(piece.text for piece in pieces)


def logprobs_of(pieces: list) -> list:
    """A request's logprobs entries, a token each, from its pieces."""
    return [entry for piece in pieces for entry in piece.logprobs]


def greedy_agreements(served: torch.nn.Module, exact: torch.nn.Module, seed: int) -> int:
    """Of five random prompts (1 to 39 tokens), how many the engine on `served` (4 rows, joining and
    leaving) answers greedily with the 10 tokens `generate` gives on `exact`: a quantized checkpoint's
    served model against its exact mode's."""
    import random

    from backend.engine.engine import Engine  # inside: this module builds models without the engine
    from backend.messages import SamplingParams, Submit

    rng = random.Random(seed)
    prompts = [[rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(1, 40))] for _ in range(5)]
    engine = Engine(served, MarkerTokenizer(), rows=4, max_seq_len=128)
    greedy = SamplingParams(temperature=0, max_tokens=10)
    pieces = drive(engine, [(i, Submit(f"r{i}", tuple(p), greedy)) for i, p in enumerate(prompts)])
    return sum(
        MarkerTokenizer.ids(text_of(pieces[f"r{i}"])) == reference_greedy(exact, p, 10, engine.eos_ids)
        for i, p in enumerate(prompts)
    )


def write_tiny_causal_lm(directory: Path, architecture: str, model: torch.nn.Module | None = None) -> Path:
    """A model directory the server loads, built offline: `tiny_model(architecture)` (or `model`) and a
    word-level tokenizer whose token `i` is the marker "<i>", so that a completion's text shows its exact
    ids (read them with `MarkerTokenizer.ids`)."""
    vocab = {f"<{i}>": i for i in range(TINY_VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))  # words not "<i>" (warm-up text)
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (model if model is not None else tiny_model(architecture)).save_pretrained(directory)
    # EOS the only special token: any other id the model draws must show in the text.
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=f"<{TINY_EOS}>").save_pretrained(directory)
    return directory


# Qwen2.5-Coder's special tokens, its fill-in-the-middle ones among them; the last is the EOS.
CODE_SPECIAL_TOKENS = (
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<|endoftext|>",
)


def write_tiny_code_model(directory: Path) -> Path:
    """A model directory the server loads as it would Qwen2.5-Coder's, built offline: a tiny random Qwen2
    and a byte-level BPE tokenizer (`write_tiny_byte_model`) that ends with Qwen2.5-Coder's special
    tokens, so that its fill-in-the-middle tokens are found by their texts as in the real one."""
    return write_tiny_byte_model(directory, CODE_SPECIAL_TOKENS)


def write_tiny_byte_model(
    directory: Path, special_tokens: tuple[str, ...], positions: int = 512, text_tags: tuple[str, ...] = ()
) -> Path:
    """A tiny random Qwen2 of `positions` positions and `byte_tokenizer(special_tokens, text_tags)`, the
    last of them the EOS (TINY_EOS)."""
    tiny_model("qwen2", max_position_embeddings=positions).save_pretrained(directory)
    byte_tokenizer(special_tokens, text_tags).save_pretrained(directory)
    return directory


def byte_tokenizer(
    special_tokens: tuple[str, ...], text_tags: tuple[str, ...] = ()
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of TINY_VOCAB tokens (GPT-2's byte alphabet, merges of the bytes code
    is made of most), so that any text tokenizes, which ends with these special tokens, the last of them
    its EOS (TINY_EOS). Those of them in `text_tags` are tokens of their own that are not marked special
    (as DeepSeek's and Qwen3's `<think>`), which a decoded answer keeps."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    common = [_byte_symbol(c) for c in " \n\tetaoinsrdlcu()=:"]
    merges = [(a, b) for a in common for b in common][: TINY_VOCAB - len(alphabet) - len(special_tokens)]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    for text in special_tokens:  # one at a time, in order (add_special_tokens would mark all special)
        add = tokenizer.add_tokens if text in text_tags else tokenizer.add_special_tokens
        add([AddedToken(text, special=text not in text_tags)])
    assert tokenizer.get_vocab_size() == TINY_VOCAB and tokenizer.token_to_id(special_tokens[-1]) == TINY_EOS
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=special_tokens[-1])


def _byte_symbol(character: str) -> str:
    """The symbol GPT-2's byte-level alphabet writes this (one-byte) character as."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(character)[0][0]


def load_on_cpu(model: Path, tmp_path: Path, quantize: str = "none", dtype: str = "float32"):
    """`load_model` of a model file or directory as the tests load one: float32 (or `dtype`) on the CPU,
    where `generate` runs too, 4 rows of 128 positions, the cache (a GGUF file's converted copy) in
    `tmp_path`; `quantize` "none" is the exact mode."""
    from backend.messages import BackendConfig
    from backend.model.loader import load_model

    config = BackendConfig(
        model=str(model),
        dtype=dtype,
        quantize=quantize,
        device="cpu",
        rows=4,
        max_seq_len=128,
        cache_dir=str(tmp_path / "cache"),
    )
    return load_model(config)
