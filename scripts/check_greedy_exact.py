#!/usr/bin/env python
"""Greedy float32 text from the engine against `model.generate`, token for token, on this machine's device.

    .venv/bin/python scripts/check_greedy_exact.py [--size tiny|1b|8b] [--tokenizer DIR] [--max-tokens N]

SPEC §7: greedy float32 output stays token for token `model.generate`'s, on
a GPU too, where the engine's decode steps are replayed CUDA graphs over
padded rows. A Llama of random weights of that shape (scripts/random_llama.py)
is built on the device; its prompts decode together in the engine's rows
and one at a time through `generate`. Prints, for each prompt, how many
tokens agree before the first difference; exits 1 where any differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.engine.engine import Engine  # noqa: E402
from backend.model.loader import pick_device  # noqa: E402
from scripts.bench_engine import PROMPTS, greedy_tokens, machine  # noqa: E402
from scripts.random_llama import SHAPES, default_tokenizer, random_llama  # noqa: E402


def generate_tokens(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens from transformers' own `generate`, one prompt at a time."""
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt], device=model.device)
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=model.generation_config.eos_token_id,
        )
        outputs.append(output[0, len(prompt) :].tolist())
    return outputs


def agreeing(reference: list[int], other: list[int]) -> int:
    """Tokens until the first difference."""
    return next((i for i, (a, b) in enumerate(zip(reference, other, strict=False)) if a != b), len(reference))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer directory (default: the default model's)")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else default_tokenizer()
    device = pick_device("auto")
    model = random_llama(args.size, tokenizer, torch.float32, device)
    prompts = [tokenizer(text).input_ids for text in PROMPTS]
    engine = Engine(model, tokenizer, rows=len(prompts), max_seq_len=256, name=f"random {args.size}")
    engine.warm_up()  # on a GPU: the decode steps' graphs captured, as a server's are
    ours = greedy_tokens(engine, prompts, args.max_tokens)
    theirs = generate_tokens(model, prompts, args.max_tokens)
    same = [agreeing(reference, other) for reference, other in zip(theirs, ours, strict=True)]
    graphs = engine.runner.decoder is not None and engine.runner.decoder.graphs is not None
    print(f"random Llama {args.size}, float32, {device}, decode steps as CUDA graphs: {graphs}; {machine()}")
    for prompt, count in zip(PROMPTS, same, strict=True):
        print(f"  {count} of {args.max_tokens} greedy tokens as generate's: {prompt[:50]!r}")
    exact = all(count == args.max_tokens for count in same)
    print("token for token model.generate's" if exact else "DIFFERS from model.generate")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
