"""Falcon, whose attention transformers does not route through its interface, served exactly: greedy
float32 decoding through the engine equals `model.generate` on each prompt alone (SPEC §5)."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, FalconConfig

from backend.engine.engine import Engine
from backend.model.falcon import AttendsOverRows, attend_over_rows
from tests.backend.models import TINY_EOS, TINY_VOCAB, MarkerTokenizer, reference_greedy
from tests.backend.test_exactness import (
    assert_chunked_prompts_sharing_a_prefix_match,
    assert_matches_reference,
)

# The attention layouts of released checkpoints, at a test's size.
SHAPES = {
    # Falcon-7B: one key and value head for all queries, attention and MLP side by side
    "7b": dict(multi_query=True, parallel_attn=True, new_decoder_architecture=False, bias=False),
    # Falcon-40B and 180B: groups of query heads sharing a key and value head, two layer norms
    "40b": dict(new_decoder_architecture=True, num_kv_heads=2, bias=False),
    # Falcon-RW: ALiBi positions instead of rotary ones, a head of keys and values for every query head
    "rw": dict(alibi=True, multi_query=False, parallel_attn=False, new_decoder_architecture=False, bias=True),
}


def tiny_falcon(shape: dict, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = FalconConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        initializer_range=0.2,  # weights large enough that a wrong scale or position changes tokens
        eos_token_id=TINY_EOS,
        bos_token_id=1,
        pad_token_id=0,
        **shape,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_falcon_matches_generate_with_rows_joining_mid_flight(shape):
    model, reference = tiny_falcon(SHAPES[shape]), tiny_falcon(SHAPES[shape])  # the same weights
    rng = random.Random(f"falcon {shape}")
    prompts = [[rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(1, 60))] for _ in range(18)]
    # 8 rows for 18 prompts: rows are also freed and refilled during the run.
    engine = Engine(model, MarkerTokenizer(), rows=8, max_seq_len=128)
    attention = model.transformer.h[0].self_attention
    assert engine.runner.decoder is None and isinstance(attention, AttendsOverRows)
    # The cache keeps Falcon's own key heads: 7B's one, a head a group of 40B's, RW's one a query head.
    assert engine.runner.cache.kv_heads == attention.num_kv_heads
    assert (attention.num_kv_heads < model.config.num_attention_heads) == (shape != "rw")
    assert_matches_reference(engine, reference, prompts, max_tokens=24, rng=rng)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_falcon_matches_generate_with_prompts_in_chunks_and_prefixes_reused(shape):
    """Prompts in 8-token chunks sharing a 20-token prefix, which later rows copy or find in the cache."""
    model, reference = tiny_falcon(SHAPES[shape]), tiny_falcon(SHAPES[shape])
    assert_chunked_prompts_sharing_a_prefix_match(model, reference, random.Random(f"falcon {shape} chunks"))


def test_patched_falcon_still_generates_as_transformers_does():
    """Outside an engine's step the layers are transformers' own: `generate` on a served model (the
    tests' reference, a user's check) is unchanged, and patching twice is patching once."""
    model, reference = tiny_falcon(SHAPES["40b"]), tiny_falcon(SHAPES["40b"])
    patched = type(attend_over_rows(model).transformer.h[0].self_attention)
    assert type(attend_over_rows(model).transformer.h[0].self_attention) is patched
    prompt = list(range(2, 30))
    assert reference_greedy(model, prompt, 16, {TINY_EOS}) == reference_greedy(
        reference, prompt, 16, {TINY_EOS}
    )
