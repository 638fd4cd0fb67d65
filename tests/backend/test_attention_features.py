"""Sliding windows, soft-capped logits and attention sinks in the row attention (attention_features.py).

test_exactness.py holds Gemma 2, Gemma 3, gpt-oss and Cohere 2 to `generate`; the tests here show that
it would catch each feature done wrong (each tiny model gives other tokens without it), and hold the
matmuls to transformers' own eager attention of the families that use them.
"""

import random

import pytest
import torch
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

from backend.engine.engine import Engine
from backend.layers.attention_features import AttentionFeatures, attention_with
from backend.model import decoder_runner
from tests.backend.models import TINY_VOCAB, MarkerTokenizer, drive, reference_greedy, text_of, tiny_model
from tests.backend.test_exactness import staggered_greedy_requests


@pytest.mark.parametrize(
    "architecture, feature",
    [
        ("gemma3_text", "sliding_window"),
        ("gpt_oss", "sliding_window"),
        ("gemma2", "softcap"),
        ("gpt_oss", "s_aux"),
    ],
)
def test_the_tiny_models_tell_a_feature_left_out(architecture, feature, monkeypatch):
    """Attention that ignored the feature would fail the exactness test: the tokens differ from
    `generate`'s for most prompts (on the decoder runner, which gives their layers their windows, soft caps
    and sinks itself)."""
    asked = AttentionFeatures.asked.__func__

    def without_feature(cls, kwargs, positions):
        return asked(cls, {name: value for name, value in kwargs.items() if name != feature}, positions)

    monkeypatch.setattr(AttentionFeatures, "asked", classmethod(without_feature))
    if feature == "sliding_window":
        monkeypatch.setattr(decoder_runner, "window_in", lambda attention, max_seq_len: None)
    if feature == "s_aux":
        monkeypatch.setattr(decoder_runner, "sinks_of", lambda attention: None)
    model = tiny_model(architecture)
    rng = random.Random(architecture)
    prompts = [[rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(20, 60))] for _ in range(4)]
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128)
    if feature == "softcap":
        engine.runner.decoder.softcap = None
    pieces = drive(engine, staggered_greedy_requests(prompts, 12, rng))
    differ = [
        MarkerTokenizer.ids(text_of(pieces[f"r{i}"])) != reference_greedy(model, prompt, 12, engine.eos_ids)
        for i, prompt in enumerate(prompts)
    ]
    assert sum(differ) >= 3, differ


def attention_module(heads: int, kv_heads: int, head_dim: int, sinks: torch.Tensor | None = None):
    """What transformers' eager attention reads of its module."""
    module = torch.nn.Module()
    module.num_key_value_groups, module.head_dim, module.training = heads // kv_heads, head_dim, False
    if sinks is not None:
        module.sinks = sinks
    return module


def inputs(queries: int = 5, keys: int = 9, window: int | None = 4):
    """Random queries at positions keys-queries..keys-1 over keys 0..keys-1, 4 heads over 2 key heads,
    and the causal (windowed) mask as a boolean and as transformers' additive one."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, queries, 8, generator=generator) * 3
    key, value = (torch.randn(1, 2, keys, 8, generator=generator) * 3 for _ in range(2))
    positions = torch.arange(keys - queries, keys)
    reads = torch.arange(keys) <= positions[:, None]
    hides = AttentionFeatures(window=window).window_hides(positions, keys)
    if hides is not None:
        reads &= ~hides
    additive = torch.zeros(reads.shape).masked_fill(~reads, float("-inf"))
    return query, key, value, reads[None, None], additive[None, None]


def test_soft_capping_is_gemma2s():
    query, key, value, reads, additive = inputs()
    features = AttentionFeatures(window=4, softcap=2.0)
    expected, _ = gemma2_eager(
        attention_module(4, 2, 8), query, key, value, additive, scaling=0.3, softcap=2.0
    )
    ours = attention_with(query, key, value, reads, 0.3, features)
    torch.testing.assert_close(ours.transpose(1, 2), expected)
    uncapped = attention_with(
        query, key, value, reads, 0.3, AttentionFeatures(window=4, sinks=None, softcap=None)
    )
    assert not torch.allclose(uncapped, ours, atol=1e-3)


def test_sinks_are_gpt_osss():
    sinks = torch.tensor([0.5, -1.0, 2.0, 4.0])
    query, key, value, reads, additive = inputs(window=None)
    module = attention_module(4, 2, 8, sinks)
    expected, _ = gpt_oss_eager(module, query, key, value, additive, scaling=0.25)
    ours = attention_with(query, key, value, additive, 0.25, AttentionFeatures(sinks=sinks))
    torch.testing.assert_close(ours.transpose(1, 2), expected)
    # A sink takes its share: the output is the plain attention's, scaled down.
    plain = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=reads, scale=0.25, enable_gqa=True
    )
    assert (ours.norm(dim=-1) < plain.norm(dim=-1)).all()


def test_a_window_hides_what_masking_utils_hides():
    """transformers' sliding window: a key is read where key > query - window."""
    positions = torch.tensor([0, 3, 7, 12])
    hides = AttentionFeatures(window=4).window_hides(positions, 13)
    for query, hidden in zip(positions.tolist(), hides.tolist(), strict=True):
        assert [k for k in range(13) if not hidden[k] and k <= query] == list(
            range(max(0, query - 3), query + 1)
        )
    assert AttentionFeatures(softcap=1.0).window_hides(positions, 13) is None


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"sliding_window": None}, None),
        ({"sliding_window": 4096}, None),  # wider than the cache: never comes into play
        ({"sliding_window": 16, "softcap": None}, (16, None, False)),
        ({"softcap": 50.0}, (None, 50.0, False)),
        ({"s_aux": torch.zeros(4), "sliding_window": 128}, (None, None, True)),
    ],
)
def test_what_a_layer_asks_for(kwargs, expected):
    features = AttentionFeatures.asked(kwargs, positions=128)
    got = None if features is None else (features.window, features.softcap, features.sinks is not None)
    assert got == expected
