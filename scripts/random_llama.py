#!/usr/bin/env python
"""Write a Llama-shaped model of random weights, with the default model's tokenizer, as a model directory.

    .venv/bin/python scripts/random_llama.py --out DIR [--size 1b|8b|tiny] [--dtype D] [--tokenizer DIR]
        [--fp8]

The GPU benchmark's model (issue: a 1B-class Llama of random weights in bf16):
`--size 1b` has Llama-3.2-1B's shape (16 layers, 2048 wide, 32 heads, 8 KV
heads, 8192 MLP), about 1.1 billion parameters with the default tokenizer's
49,152-token vocabulary; `--size 8b` has Llama-3.1-8B's (32 layers, 4096
wide, 32 heads, 8 KV heads, 14336 MLP). `scripts/bench_engine.py --random
1b` builds one in its own process. Random weights make nonsense text at the speed of
real ones. `--fp8` writes the projections as an FP8 checkpoint in 128 x
128 blocks (transformers' `fp8`, as DeepSeek's and Qwen's "-FP8" files).
Then, for example:

    .venv/bin/python scripts/benchmark.py --model DIR --dtype bfloat16 --no-naive
    .venv/bin/python scripts/bench_engine.py --model DIR --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.messages import BackendConfig  # noqa: E402
from backend.model.loader import load_tokenizer  # noqa: E402

FP8_MAX = 448.0  # e4m3's largest finite value

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32),
    # Llama-3.1-8B's shape (the H100 trial's "8B"): 16 GB of bfloat16 weights to write
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
}


def write_random_llama(
    out: Path,
    size: str = "1b",
    dtype: torch.dtype = torch.bfloat16,
    tokenizer_dir: Path | None = None,
    fp8: bool = False,
) -> Path:
    """A model directory (config, safetensors, tokenizer) that the server loads like any other; the
    tokenizer from `tokenizer_dir` where given (a GPU machine without the default model's package);
    `fp8`: its projections as an FP8 checkpoint in 128 x 128 blocks (`write_fp8_blocks`)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else default_tokenizer()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a GPU builds an 8B in seconds
    model = random_llama(size, tokenizer, dtype, device)
    if fp8:
        write_fp8_blocks(model, out)
    else:
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_fp8_blocks(model: torch.nn.Module, out: Path, block: int = 128) -> dict[str, torch.Tensor]:
    """`model` saved as transformers' `fp8` quantization stores a checkpoint ("-FP8" repositories): each
    projection's `weight` in float8 e4m3 and a float32 `weight_scale_inv` for every `block` x `block` of it
    (its largest weight at 448), w = weight * weight_scale_inv; the head and embeddings as they are.
    Returns each projection's weights as they are dequantized, in float32."""
    model.save_pretrained(out)  # the config, and the files this replaces
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    tensors, dequantized = {}, {}
    for name, parameter in model.state_dict().items():
        module = name.removesuffix(".weight")
        is_linear = name.endswith(".weight") and type(model.get_submodule(module)) is torch.nn.Linear
        if not is_linear or module == "lm_head":
            if module != "lm_head" or not model.config.tie_word_embeddings:
                tensors[name] = parameter.contiguous()
            continue
        out_features, in_features = parameter.shape
        rows, columns = -(-out_features // block), -(-in_features // block)
        padded = torch.zeros(rows * block, columns * block, device=parameter.device)
        padded[:out_features, :in_features] = parameter.float()
        largest = padded.reshape(rows, block, columns, block).abs().amax(dim=(1, 3))
        scale = (largest / FP8_MAX).clamp_min(1e-12)
        spread = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out_features, :in_features]
        values = (parameter.float() / spread).to(torch.float8_e4m3fn)
        tensors[name], tensors[f"{module}.weight_scale_inv"] = values, scale
        dequantized[module] = values.float() * spread
    save_file({k: v.cpu() for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return dequantized


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
    parser.add_argument(
        "--fp8", action="store_true", help="write its projections as an FP8 checkpoint in 128 x 128 blocks"
    )
    args = parser.parse_args()
    write_random_llama(args.out, args.size, getattr(torch, args.dtype), args.tokenizer, args.fp8)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
