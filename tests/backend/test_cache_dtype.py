"""A model computing in bfloat16 on a CPU, over the KV cache's default dtype there
(row_cache.pick_cache_dtype): float32 where decode steps attend through PyTorch's kernel, bfloat16 where
they attend by the CPU's loop (fused_ops.cpp)."""

import copy
import random

import pytest
import torch

from backend.engine.engine import Engine
from backend.messages import SamplingParams, Submit
from tests.backend.models import TINY_VOCAB, MarkerTokenizer, drive, text_of, tiny_model


@pytest.mark.parametrize(
    "architecture, head_dim, cache_dtype",
    [
        ("llama", 16, torch.float32),  # the decoder runner, a head size the loop is not compiled for
        ("gpt2", 16, torch.float32),  # transformers' forward
        ("llama", 64, torch.bfloat16),  # the decoder runner, attending by the loop
    ],
)
def test_a_bfloat16_model_over_its_default_cache_scores_its_tokens_as_float32_does(
    architecture, head_dim, cache_dtype
):
    reference = tiny_model(architecture, head_dim=head_dim)
    with torch.no_grad():  # sharper distributions than the default initialisation, so attention matters
        for parameter in reference.parameters():
            parameter.mul_(2)
    model = copy.deepcopy(reference).to(torch.bfloat16)
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128)
    assert engine.runner.cache.layers[0].keys.dtype == cache_dtype

    rng = random.Random(f"{architecture}-{head_dim}")
    prompts = [[rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    arrivals = [(i, Submit(f"r{i}", tuple(prompt), params)) for i, prompt in enumerate(prompts)]
    pieces = drive(engine, arrivals)

    engine_error, bfloat16_error = 0.0, 0.0
    for i, prompt in enumerate(prompts):
        tokens = MarkerTokenizer.ids(text_of(pieces[f"r{i}"]))
        scored = torch.tensor([entry.logprob for piece in pieces[f"r{i}"] for entry in piece.logprobs])
        exact, bfloat16 = (token_logprobs(m, prompt, tokens) for m in (reference, model))
        engine_error = max(engine_error, (scored - exact).abs().max().item())
        bfloat16_error = max(bfloat16_error, (bfloat16 - exact).abs().max().item())
    # No further from float32 than the bfloat16 model's own forward pass is (which also rounds its
    # keys and values): a wrong cast, or attention over the wrong positions, is far beyond that.
    assert engine_error < 2 * bfloat16_error


def token_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The log-probability of each generated token, from one forward pass over the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return logits.log_softmax(-1)[len(prompt) - 1 : -1].gather(1, torch.tensor(tokens)[:, None])[:, 0]
