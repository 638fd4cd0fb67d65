#!/usr/bin/env python
r"""Each fast-path family on the decoder runner against the same model on transformers' modules.

    .venv/bin/python scripts/bench_families.py [--families llama qwen3] [--rows 1 32] [--max-tokens N]
        [--quantize int4|int8|none] [--dtype D]

For each family, a model of random weights of a ~0.5B checkpoint's shape (Qwen2.5-0.5B's for Llama-shaped
layers, Qwen3-0.6B's for Qwen3, Qwen3-30B-A3B's layer at 0.4B for Qwen3-MoE, Gemma 3 1B's for Gemma 3 (and
Gemma 3 4B's text at 6 layers), Phi-4-mini's and Phi-3-mini's layers at 0.75B for Phi-3, Granite 3 2B's at
0.6B for Granite, Gemma 2 2B's at 0.7B for Gemma 2, OLMo 2 1B's at 0.6B for OLMo 2, EXAONE 4.0 1.2B's at 0.5B
for EXAONE 4, ERNIE 4.5 0.3B's, GLM-4-9B-0414's at 0.9B for GLM-4, OLMoE-1B-7B's at 2 layers for OLMoE,
Granite 3.0 3B-A800M's at 8 layers for Granite MoE, Command R7B's at 4 layers for Cohere 2, Ministral 3 3B's
at 8 layers for Ministral 3, AFM-4.5B's at 6 layers for Arcee, Hunyuan-1.8B's at 8 layers for Hunyuan, Llama 4
Maverick's at 2 layers for Llama 4, LFM2-350M's for LFM2, LFM3's at 6 layers for LFM3) with
the default model's tokenizer, quantized as `--quantize` says (int4, as a 4-bit file would be served, by
default). Engine tokens/s with 1 and 32 rows decoding, first on the path the server takes (the decoder
runner), then on transformers' own modules over the row attention (what every other family takes), alternating
the two at each row count so that drift in the machine falls on both; and transformers' `generate` one request
at a time. Prints a markdown table and the machine. Random weights decode at the speed of real ones.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.engine.engine import Engine  # noqa: E402
from backend.model.decoder_runner import DecoderRunner  # noqa: E402
from backend.model.loader import pick_device, pick_dtype  # noqa: E402
from backend.quant.quantize import quantize_model  # noqa: E402
from backend.quant.quantized_linear import QUANTIZERS  # noqa: E402
from scripts.bench_engine import PROMPTS, machine, time_engine, time_generate  # noqa: E402
from scripts.random_llama import default_tokenizer  # noqa: E402

SHAPES = {
    # Qwen2.5-0.5B's shape, a Llama layer with biases on q, k and v: 24 layers, 896 wide, 14 heads, 2 KV
    "llama": (
        "qwen2",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
        ),
    ),
    # Qwen3-0.6B's: 28 layers, 1024 wide, 16 heads of 128, 8 KV heads, norms of each head's q and k
    "qwen3": (
        "qwen3",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
        ),
    ),
    # Qwen3-30B-A3B's layer at a ~0.4B size: Qwen3's attention, 16 experts of 384 a layer, 4 chosen a token
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            moe_intermediate_size=384,
            num_experts=16,
            num_experts_per_tok=4,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
        ),
    ),
    # Gemma 3 1B's layers: 26, 1152 wide, 4 heads of 256 sharing one KV head, five window layers (512
    # positions) to a global one, its GELU MLP 6912 wide (0.7B with this tokenizer's vocabulary)
    "gemma3": (
        "gemma3_text",
        dict(
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=512,
            query_pre_attn_scalar=256,
        ),
    ),
    # Gemma 3 4B's text model's layers at 6 of its 34 (the multimodal checkpoint's text, which the server
    # loads alone): 2560 wide, 8 heads of 256 over 4 KV heads, five window layers (1024 positions) to a
    # global one
    "gemma3_4b": (
        "gemma3_text",
        dict(
            hidden_size=2560,
            intermediate_size=10240,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            sliding_window=1024,
            query_pre_attn_scalar=256,
        ),
    ),
    # Phi-4-mini's layer at 6 of its 32: 3072 wide, 24 heads of 128 over 8 KV heads, three quarters of each
    # head rotated, q, k and v one linear layer and gate and up another (0.75B with this vocabulary)
    "phi3": (
        "phi3",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=6,
            num_attention_heads=24,
            num_key_value_heads=8,
            partial_rotary_factor=0.75,
        ),
    ),
    # Gemma 2 2B's layer at 8 of its 26: 2304 wide, 8 heads of 256 over 4 KV heads, window layers (4096)
    # beside global ones, its soft caps of the scores (50) and of the logits (30)
    "gemma2": (
        "gemma2",
        dict(
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            sliding_window=4096,
            query_pre_attn_scalar=256,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
    ),
    # Granite 3's 2B layer at 8 of its 40: 2048 wide, 32 heads of 64 over 8 KV heads, its multipliers
    "granite": (
        "granite",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=8,
            num_attention_heads=32,
            num_key_value_heads=8,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.015625,
            logits_scaling=8.0,
        ),
    ),
    # OLMo 2 1B's layer at 8 of its 16: 2048 wide, 16 heads of 128, each its own KV head; its norms of
    # each sublayer's output and of q and k whole
    "olmo2": (
        "olmo2",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=16,
        ),
    ),
    # EXAONE 4.0 1.2B's layer at 8 of its 30: 2048 wide, 32 heads of 64 over 8 KV heads, head norms, norms of
    # each sublayer's output; 32B's window layers (4096) three in four, the global ones without rotation
    "exaone4": (
        "exaone4",
        dict(
            hidden_size=2048,
            intermediate_size=4096,
            num_hidden_layers=8,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            sliding_window=4096,
            sliding_window_pattern=4,
        ),
    ),
    # ERNIE 4.5 0.3B whole: 18 layers, 1024 wide, 16 heads of 128 over 2 KV heads, neighbouring pairs rotated
    "ernie4_5": (
        "ernie4_5",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=18,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=128,
        ),
    ),
    # GLM-4-9B-0414's layer at 4 of its 40: 4096 wide, 32 heads of 128 over 2 KV heads, neighbouring pairs of
    # half of each head rotated, biases on q, k and v, norms of each sublayer's output
    "glm4": (
        "glm4",
        dict(
            hidden_size=4096,
            intermediate_size=13696,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=2,
            head_dim=128,
        ),
    ),
    # OLMoE-1B-7B's layer at 2 of its 16: 2048 wide, 16 heads of 128, each its own KV head, q and k normed
    # whole, 64 experts of 1024, 8 a token
    "olmoe": (
        "olmoe",
        dict(
            hidden_size=2048,
            intermediate_size=1024,
            num_experts=64,
            num_experts_per_tok=8,
            num_hidden_layers=2,
            num_attention_heads=16,
            num_key_value_heads=16,
        ),
    ),
    # Granite 3.0 3B-A800M's layer at 8 of its 32: 1536 wide, 24 heads of 64 over 8 KV heads, 40 experts of
    # 512, 8 a token, its multipliers
    "granitemoe": (
        "granitemoe",
        dict(
            hidden_size=1536,
            intermediate_size=512,
            num_local_experts=40,
            num_experts_per_tok=8,
            num_hidden_layers=8,
            num_attention_heads=24,
            num_key_value_heads=8,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.015625,
            logits_scaling=6.0,
        ),
    ),
    # Command R7B's layer at 4 of its 32: 4096 wide, 32 heads of 128 over 8 KV heads, LayerNorms, the MLP
    # beside attention, neighbouring pairs rotated; window layers (4096) three in four, the global ones
    # unrotated
    "cohere2": (
        "cohere2",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=8,
            sliding_window=4096,
            sliding_window_pattern=4,
        ),
    ),
    # Ministral 3 3B's layer at 8 of its 26: 3072 wide, 32 heads of 128 over 8 KV heads, its queries' factor
    # past the rotation's original length (16384: 1 within these rows)
    "ministral3": (
        "ministral3",
        dict(
            hidden_size=3072,
            intermediate_size=9216,
            num_hidden_layers=8,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
        ),
    ),
    # AFM-4.5B's layer at 6 of its 36: 2560 wide, 20 heads of 128 over 4 KV heads, an MLP of 18432 without a
    # gate (ReLU(up)^2)
    "arcee": (
        "arcee",
        dict(
            hidden_size=2560,
            intermediate_size=18432,
            num_hidden_layers=6,
            num_attention_heads=20,
            num_key_value_heads=4,
            head_dim=128,
        ),
    ),
    # Hunyuan-1.8B's layer at 8 of its 32: 2048 wide, 16 heads of 128 over 4 KV heads, each head's query and
    # key normed after the rotation
    "hunyuan": (
        "hunyuan_v1_dense",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
        ),
    ),
    # Llama 4 Maverick's layers at 2 of its 48 (Scout's are each its second): 5120 wide, 40 heads of 128
    # over 8 KV heads; a dense layer (an MLP of 16384), rotated, its heads' L2 norms after the rotation; then
    # one without rotary positions, its mixture 16 experts of 8192 (one chosen a token) beside a shared one
    "llama4": (
        "llama4_text",
        dict(
            hidden_size=5120,
            intermediate_size=8192,
            intermediate_size_mlp=16384,
            num_hidden_layers=2,
            num_attention_heads=40,
            num_key_value_heads=8,
            head_dim=128,
            num_local_experts=16,
            num_experts_per_tok=1,
            moe_layers=[1],
            no_rope_layers=[1, 0],
        ),
    ),
    # LFM2-350M's: 16 layers, 1024 wide, ten of them short convolutions, six attention (16 heads of 64 over 8
    # KV heads); its MLP 4608 wide (6656 as its config gives it, adjusted: `block_auto_adjust_ff_dim`)
    "lfm2": (
        "lfm2",
        dict(
            hidden_size=1024,
            intermediate_size=6656,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=8,
            layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
        ),
    ),
    # LFM3's (its config's defaults) at 6 of its 24 layers: 2048 wide, four short convolutions (a kernel of
    # 7), a global and a window attention layer of 16 heads of 128 over 4 KV heads, gated, sandwich norms
    "lfm3": (
        "lfm3",
        dict(
            num_hidden_layers=6,
            layer_types=["conv", "conv", "full_attention", "conv", "sliding_attention", "conv"],
        ),
    ),
    # Phi-3-mini's (Phi-3.5-mini's) layer at 6 of its 32: 32 heads of 96, each its own KV head, all rotated
    "phi3_mini": (
        "phi3",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=6,
            num_attention_heads=32,
            num_key_value_heads=32,
        ),
    ),
}


def random_model(family: str, tokenizer, dtype: torch.dtype, quantize: str) -> torch.nn.Module:
    model_type, shape = SHAPES[family]
    return random_model_of(model_type, shape, tokenizer, dtype, quantize)


def random_model_of(
    model_type: str, shape: dict, tokenizer, dtype: torch.dtype, quantize: str
) -> torch.nn.Module:
    """A model of random weights of the type and `shape` (its config's sizes), with the tokenizer's vocabulary
    and special tokens, `quantize`d as --quantize would."""
    config = CONFIG_MAPPING[model_type](
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,  # (GLM-4's default is past this vocabulary)
        **shape,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    if quantize in QUANTIZERS:
        quantize_model(model, quantize)
    return model


def engine_on(model: torch.nn.Module, tokenizer, rows: int, runner: bool) -> Engine:
    """The engine as the server builds it, or (`runner` False) on transformers' modules."""
    with mock.patch.object(DecoderRunner, "supports", staticmethod(lambda config: runner)):
        engine = Engine(model, tokenizer, rows=rows, max_seq_len=512)
    assert (engine.runner.decoder is not None) == runner
    engine.warm_up()
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--quantize", choices=["none", *QUANTIZERS], default="int4")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--baseline-requests", type=int, default=2)
    args = parser.parse_args()

    tokenizer = default_tokenizer()
    prompts = [tokenizer(text).input_ids for text in PROMPTS]
    dtype = pick_dtype(args.dtype, pick_device("auto"))
    rows: list[str] = []
    for family in args.families:
        model = random_model(family, tokenizer, dtype, args.quantize)
        baseline = time_generate(model, prompts, args.baseline_requests, args.max_tokens)
        engines = {path: engine_on(model, tokenizer, max(args.rows), path) for path in (True, False)}
        for active in args.rows:  # first-call costs off the clock: oneDNN builds a kernel for each new
            for engine in engines.values():  # shape of a product (an MoE's experts: about a second each)
                time_engine(engine, prompts, active, 8)
        for active in args.rows:
            measured = {
                path: time_engine(engine, prompts, active, args.max_tokens)[0]
                for path, engine in engines.items()
            }
            fast, modules = measured[True], measured[False]
            ratio = fast / modules
            rows.append(
                f"| {family} | {active} | {fast:.1f} | {modules:.1f} | {ratio:.2f}x | {baseline:.1f} |"
            )
        del engines, model
    print(f"\n{args.quantize} weights, {dtype}, {args.max_tokens} tokens a request; {machine()}\n")
    print("| family | rows | decoder runner tokens/s | transformers' modules tokens/s | ratio | generate |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
