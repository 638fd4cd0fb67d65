#!/usr/bin/env python
"""Write a gpt-oss-shaped model of random weights as gpt-oss's MXFP4 checkpoints keep it, with the
default model's tokenizer, as a model directory.

    .venv/bin/python scripts/random_gpt_oss.py --out DIR [--layers N] [--size 20b|tiny]

gpt-oss-20b's shape (2,880 wide, 64 query heads and 8 KV heads of 64, 32 experts of 2,880 of which 4
serve a token, layers alternating a 128-token window and global attention) with `--layers` of its 24
layers (default 4: its experts are 0.8 billion parameters a layer) and the default tokenizer's 49,152-token
vocabulary (gpt-oss's is 201,088). The experts' projections are stored as openai/gpt-oss-20b stores them,
MXFP4 `*_blocks` and `*_scales` (mxfp4_checkpoint.py), the rest bfloat16, written a layer at a time:
the model is never held in floats. Random weights make nonsense text at the speed of real ones. Then:

    .venv/bin/python scripts/load_memory.py --model DIR
    .venv/bin/python scripts/bench_engine.py --model DIR --rows 1 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GptOssConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.messages import BackendConfig  # noqa: E402
from backend.model.loader import load_tokenizer  # noqa: E402
from backend.model.resources import skeleton  # noqa: E402

BLOCK = 32
# Halfway between E2M1's magnitudes doubled (0, 1, 2, 3, 4, 6, 8, 12): the nearest's index, by bucketize
MIDPOINTS = torch.tensor([0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0])
STD = 0.02  # gpt-oss's initializer_range
SHAPES = {
    "20b": dict(
        hidden_size=2880,
        intermediate_size=2880,
        num_attention_heads=64,
        num_key_value_heads=8,
        num_local_experts=32,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
    ),
}


def gpt_oss_config(size: str, layers: int, vocab_size: int, bos: int | None, eos: int | None) -> GptOssConfig:
    return GptOssConfig(
        **SHAPES[size],
        num_hidden_layers=layers,
        head_dim=64,
        num_experts_per_tok=4,
        sliding_window=128,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        bos_token_id=bos,
        eos_token_id=eos,
        tie_word_embeddings=False,
        architectures=["GptOssForCausalLM"],  # (llama.cpp's converter finds its class by it)
    )


def mxfp4(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float32 weights as MXFP4's blocks [out, in / 32, 16] (input 2j's index in byte j's low
    nibble) and exponents [out, in / 32], each block's largest weight between 8 and 16 of d = 2^(e - 128)
    (the gguf package's quantizer's choice), each weight its nearest E2M1 value."""
    blocks = weights.reshape(weights.shape[0], -1, BLOCK)
    largest = blocks.abs().amax(dim=-1)
    e = torch.where(largest > 0, torch.floor(torch.log2(largest)) - 2 + 127, 0).clamp(0, 255)
    scaled = blocks / torch.exp2(e - 128)[..., None]
    magnitude = torch.bucketize(scaled.abs(), MIDPOINTS)  # a tie: the smaller, as the gguf package's
    index = magnitude | ((scaled < 0) & (magnitude > 0)).to(torch.int64) << 3  # -0 never: its +0
    packed = index[..., 0::2] | index[..., 1::2] << 4
    return packed.to(torch.uint8), e.to(torch.uint8)


def random_tensor(name: str, shape: torch.Size) -> dict[str, torch.Tensor]:
    """A parameter's stored tensors: an experts' projection ([experts, in, out]) as MXFP4 blocks and
    exponents of [out, in] weights, norms ones, the rest normal(0, STD) in bfloat16."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        pairs = [mxfp4(torch.randn(shape[2], shape[1]) * STD) for _ in range(shape[0])]
        return {
            f"{name}_blocks": torch.stack([blocks for blocks, _ in pairs]),
            f"{name}_scales": torch.stack([scales for _, scales in pairs]),
        }
    if "norm" in name:
        return {name: torch.ones(shape, dtype=torch.bfloat16)}
    return {name: (torch.randn(shape) * STD).to(torch.bfloat16)}


def write_random_gpt_oss(out: Path, layers: int = 4, size: str = "20b") -> Path:
    tokenizer = load_tokenizer(BackendConfig())
    config = gpt_oss_config(size, layers, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    out.mkdir(parents=True, exist_ok=True)
    parameters = dict(skeleton(config).named_parameters())  # names and shapes only
    shards: dict[str, list[str]] = {}
    for name in parameters:
        part = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        shards.setdefault(part, []).append(name)
    weight_map = {}
    torch.manual_seed(0)
    for index, names in enumerate(shards.values(), start=1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {k: v for name in names for k, v in random_tensor(name, parameters[name].shape).items()}
        save_file(tensors, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    saved["quantization_config"] = {"quant_method": "mxfp4"}
    saved["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4, help="of gpt-oss-20b's 24")
    parser.add_argument("--size", choices=sorted(SHAPES), default="20b", help="tiny: the tests' shape")
    args = parser.parse_args()
    print(write_random_gpt_oss(args.out, args.layers, args.size))


if __name__ == "__main__":
    main()
