"""Latent attention (DeepSeek's MLA, model/latent_attention.py): the cache keeps each layer's latent and
rotated key as one tensor, steps attend over it with `kv_b_proj` absorbed (never expanding the cache),
quantized expansions included, and DeepSeek's checkpoints, published with modeling code of their own,
are served by transformers' classes without running it; DeepSeek-V3.2's and GLM-5's sparse attention
within the context where its indexer chooses every key.

test_exactness holds each latent family to `generate` (rows joining, prompts in chunks sharing prefixes);
test_model_families_e2e loads three from disk as the backend does."""

import json
import random

import pytest
import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM

from backend.engine.engine import Engine
from backend.layers.row_cache import KVShape, LatentCacheLayer
from backend.messages import BackendConfig, SamplingParams, Submit
from backend.model.cache_size import size_kv_cache
from backend.model.latent_attention import layer_weight
from backend.model.loader import load_model
from backend.quant.quantize import quantize_model
from tests.backend.models import (
    TINY_LATENT,
    TINY_VOCAB,
    MarkerTokenizer,
    drive,
    reference_greedy,
    text_of,
    tiny_model,
    write_tiny_causal_lm,
)
from tests.backend.test_exactness import assert_decode_steps_give_transformers_logits

LATENT_WIDTH = TINY_LATENT["kv_lora_rank"] + TINY_LATENT["qk_rope_head_dim"]  # 32 + 8


def test_the_cache_keeps_one_latent_tensor_a_layer_and_steps_never_expand_it():
    model = tiny_model("deepseek_v3")
    shape = KVShape.of(model.config)
    assert shape.latent and shape.kept == ((1, LATENT_WIDTH),) * 2
    # 2 layers x 40 numbers x 4 bytes a position, where keys and values expanded take 2 x 4 heads x (24 + 12)
    assert shape.bytes(1, 1, torch.float32) == 2 * LATENT_WIDTH * 4
    line = size_kv_cache(BackendConfig(max_seq_len=128), model.config, torch.float32).summary()
    assert "(320 bytes a position a row: 1 x 2 latent layers x 40 x 4 bytes)" in line

    expansions = []
    for layer in model.model.layers:
        layer.self_attn.kv_b_proj.register_forward_hook(lambda *_: expansions.append(1))
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128)
    assert all(isinstance(layer, LatentCacheLayer) for layer in engine.runner.cache.layers)
    assert all(layer.keys is layer.values for layer in engine.runner.cache.layers)
    rng = random.Random("latent")
    prompts = [[rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(5, 40))] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8)
    pieces = drive(engine, [(0, Submit(f"r{i}", tuple(p), params)) for i, p in enumerate(prompts)])
    assert expansions == []  # the float weight is read as it is, by head
    for i, prompt in enumerate(prompts):
        expected = reference_greedy(model, prompt, 8, engine.eos_ids)
        assert MarkerTokenizer.ids(text_of(pieces[f"r{i}"])) == expected


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_expansion_is_read_through_its_layer_and_steps_give_its_logits(mode, monkeypatch):
    """`--quantize` replaces `kv_b_proj` by a quantized layer, whose weight no view gives: it is read
    once through the layer from the identity. That weight is what the layer multiplies by (to its
    bfloat16 activations' rounding), and each decode step's logits are transformers' forward's over the
    same quantized model, to the quantized kernels' rounding (test_exactness's 0.03)."""
    model = tiny_model("deepseek_v3", initializer_range=0.02)
    quantize_model(model, mode)
    layers = [layer.self_attn for layer in model.model.layers]
    assert all(type(layer.kv_b_proj) is not torch.nn.Linear for layer in layers)
    latents = torch.randn(20, TINY_LATENT["kv_lora_rank"])
    with torch.no_grad():
        for layer in layers:
            weight = layer_weight(layer.kv_b_proj, torch.eye(TINY_LATENT["kv_lora_rank"]))
            expanded = torch.nn.functional.linear(latents, weight)
            torch.testing.assert_close(expanded, layer.kv_b_proj(latents), rtol=0.01, atol=0.01)
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, speculative_tokens=0)
    assert_decode_steps_give_transformers_logits(engine, model, f"deepseek_v3 {mode}", monkeypatch)
    assert all("_expansion" in layer.__dict__ for layer in layers)  # read once, kept


@pytest.mark.parametrize("architecture", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attentions_rows_end_at_its_top_k_and_steps_leave_its_indexer_out(architecture, monkeypatch):
    """DeepSeek-V3.2's and GLM-5's indexer chooses the keys each query reads, its top k (2,048; 16 here):
    rows end there, where the indexer still chooses every key (the start-up line says why), and within
    steps the indexer is never run (it would keep keys of its own, which the row cache does not hold). The
    engine's tokens are `generate`'s, which runs it."""
    model = tiny_model(architecture, index_topk=16)
    size = size_kv_cache(BackendConfig(max_seq_len=4096), model.config, torch.float32)
    assert size.max_seq_len == 16
    assert size.reason == "the model's sparse attention's top k, under --max-seq-len 4096"
    indexer = type(model.model.layers[0].self_attn.indexer)
    runs = []
    indexer_forward = indexer.forward
    monkeypatch.setattr(
        indexer, "forward", lambda self, *a, **k: runs.append(1) or indexer_forward(self, *a, **k)
    )
    engine = Engine(model, MarkerTokenizer(), rows=2, max_seq_len=4096, speculative_tokens=0)
    assert engine.max_seq_len == 16
    prompt, params = (5, 9, 14, 3, 22, 40, 41), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = MarkerTokenizer.ids(text_of(drive(engine, [(0, Submit("r", prompt, params))])["r"]))
    assert runs == [] and len(tokens) == 8
    assert tokens == reference_greedy(model, prompt, 8, engine.eos_ids) and runs


def test_deepseeks_own_modeling_code_is_not_run_its_type_served_by_transformers(tmp_path):
    """DeepSeek's checkpoints map transformers' Auto classes to the code they were written in
    (modeling_deepseek.py): a type transformers has classes for and the engine serves is loaded by those,
    trusted or not, and none of the model's code runs (here, code that raises)."""
    directory = write_tiny_causal_lm(tmp_path / "deepseek", "deepseek_v3")
    for name in ("configuration_deepseek.py", "modeling_deepseek.py"):
        (directory / name).write_text("raise RuntimeError('the checkpoint’s own code ran')\n")
    config = json.loads((directory / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    }
    (directory / "config.json").write_text(json.dumps(config))
    for trusted in (False, True):
        loaded = load_model(BackendConfig(model=str(directory), dtype="float32", trust_remote_code=trusted))
        assert type(loaded.model) is DeepseekV3ForCausalLM
