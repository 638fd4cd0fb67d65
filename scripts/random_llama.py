#!/usr/bin/env python
"""Write a Llama-shaped model of random weights, with the default model's tokenizer, as a model directory.

    .venv/bin/python scripts/random_llama.py --out DIR [--size 1b|8b|tiny] [--dtype D] [--tokenizer DIR]

The GPU benchmark's model (issue: a 1B-class Llama of random weights in bf16):
`--size 1b` has Llama-3.2-1B's shape (16 layers, 2048 wide, 32 heads, 8 KV
heads, 8192 MLP), about 1.1 billion parameters with the default tokenizer's
49,152-token vocabulary; `--size 8b` has Llama-3.1-8B's (32 layers, 4096
wide, 32 heads, 8 KV heads, 14336 MLP). `scripts/bench_engine.py --random
1b` builds one in its own process. Random weights make nonsense text at the speed of
real ones. Then, for example:

    .venv/bin/python scripts/benchmark.py --model DIR --dtype bfloat16 --no-naive
    .venv/bin/python scripts/bench_engine.py --model DIR --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.messages import BackendConfig  # noqa: E402
from backend.model.loader import load_tokenizer  # noqa: E402

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32),
    # Llama-3.1-8B's shape (the H100 trial's "8B"): 16 GB of bfloat16 weights to write
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
}


def write_random_llama(
    out: Path, size: str = "1b", dtype: torch.dtype = torch.bfloat16, tokenizer_dir: Path | None = None
) -> Path:
    """A model directory (config, safetensors, tokenizer) that the server loads like any other; the
    tokenizer from `tokenizer_dir` where given (a GPU machine without the default model's package)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else default_tokenizer()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a GPU builds an 8B in seconds
    random_llama(size, tokenizer, dtype, device).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def default_tokenizer() -> PreTrainedTokenizerBase:
    """The default model's tokenizer (its 49,152-token vocabulary sizes the random models' heads)."""
    return load_tokenizer(BackendConfig())


def random_llama(
    size: str, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> LlamaForCausalLM:
    """A Llama of random weights of that shape, built where it will run: an 8B is 16 GB of bfloat16
    to write and read back, built on a GPU in seconds."""
    shape = SHAPES[size]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        num_key_value_heads=shape["num_attention_heads"] // 4,
        max_position_embeddings=2048,
        rope_theta=500_000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype=dtype,
        **shape,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype).eval()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer directory (default: the default model's)")
    args = parser.parse_args()
    write_random_llama(args.out, args.size, getattr(torch, args.dtype), args.tokenizer)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
