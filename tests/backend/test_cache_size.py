"""The KV cache's size: --max-seq-len, --kv-cache-memory or the default, and the start-up line saying it."""

import logging

import pytest
import torch
from transformers import AutoTokenizer

from backend.engine.engine import Engine
from backend.messages import BackendConfig
from backend.model.cache_size import MIN_SEQ_LEN, size_kv_cache, size_text
from backend.model.loader import load_model
from tests.backend.models import MarkerTokenizer, tiny_model

# The tiny Llama: 2 layers x 2 KV heads x 16 dims, keys and values, 4 bytes: 512 bytes a position a row;
# its context is 512 positions.
CONFIG = tiny_model("llama").config
POSITION = 2 * 2 * 2 * 16 * 4
CACHE_ROWS = 5  # at rows=4: the user rows and the one embedding inputs are prefilled in


def test_with_neither_option_rows_hold_the_smaller_of_2048_and_the_context():
    size = size_kv_cache(BackendConfig(rows=4), CONFIG, torch.float32)
    assert size.max_seq_len == 512 and size.bytes == CACHE_ROWS * 512 * POSITION
    assert "the default" in size.summary() and "--kv-cache-memory" in size.summary()
    assert size.summary().startswith("KV cache: 4 rows and 1 for embedding inputs x 512 positions")


def test_with_a_separate_embedding_model_the_cache_holds_the_user_rows_alone():
    size = size_kv_cache(BackendConfig(rows=4, embedding_model="an-encoder"), CONFIG, torch.float32)
    assert size.bytes == 4 * 512 * POSITION and size.summary().startswith("KV cache: 4 rows x 512 positions")


@pytest.mark.parametrize("dtype, element", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_a_budget_gives_the_most_positions_that_fit(dtype, element):
    per_position = CACHE_ROWS * POSITION // 4 * element  # all the rows
    budget = 200 * per_position + per_position - 1  # not quite 201
    size = size_kv_cache(BackendConfig(rows=4, kv_cache_memory=budget), CONFIG, dtype)
    assert size.max_seq_len == 200 and size.bytes <= budget
    assert size.bytes + per_position > budget  # the most: one position more would not fit
    assert size.reason == f"the most that fit in --kv-cache-memory {size_text(budget)}"


def test_a_budget_past_the_context_stops_at_the_context():
    size = size_kv_cache(BackendConfig(rows=4, kv_cache_memory=2**30), CONFIG, torch.float32)
    assert size.max_seq_len == 512
    assert "the model's context; --kv-cache-memory 1024 MiB would hold 419430" in size.summary()


def test_a_budget_too_small_for_a_minimal_row_is_a_start_up_error():
    budget = CACHE_ROWS * POSITION * (MIN_SEQ_LEN - 1)
    with pytest.raises(ValueError, match=f"holds {MIN_SEQ_LEN - 1} positions a row, under the {MIN_SEQ_LEN}"):
        size_kv_cache(BackendConfig(rows=4, kv_cache_memory=budget), CONFIG, torch.float32)
    size = size_kv_cache(
        BackendConfig(rows=4, kv_cache_memory=budget + CACHE_ROWS * POSITION), CONFIG, torch.float32
    )
    assert size.max_seq_len == MIN_SEQ_LEN


def test_max_seq_len_with_a_budget_must_fit_in_it():
    budget = CACHE_ROWS * POSITION * 300
    size = size_kv_cache(
        BackendConfig(rows=4, max_seq_len=256, kv_cache_memory=budget), CONFIG, torch.float32
    )
    assert size.max_seq_len == 256 and size.reason == "--max-seq-len, within --kv-cache-memory 750 KiB"
    with pytest.raises(
        ValueError, match="--max-seq-len 400 does not fit in --kv-cache-memory 750 KiB.*holds 300"
    ):
        size_kv_cache(BackendConfig(rows=4, max_seq_len=400, kv_cache_memory=budget), CONFIG, torch.float32)


def test_max_seq_len_alone_is_capped_by_the_context():
    assert size_kv_cache(BackendConfig(max_seq_len=100), CONFIG, torch.float32).max_seq_len == 100
    size = size_kv_cache(BackendConfig(max_seq_len=4096), CONFIG, torch.float32)
    assert size.max_seq_len == 512 and size.reason == "the model's context, under --max-seq-len 4096"


def test_llama_4s_rows_are_no_longer_than_its_attention_chunk():
    """Llama 4's rotated layers attend within chunks of positions, which the engine's attention does not do:
    its rows end where the first chunk does (8,192 positions in its checkpoints; 64 here), the only context
    it serves exactly, and the start-up line says why."""
    model = tiny_model("llama4_text", attention_chunk_size=64)
    size = size_kv_cache(BackendConfig(max_seq_len=4096), model.config, torch.float32)
    assert size.max_seq_len == 64 and size.reason == "the model's attention chunk, under --max-seq-len 4096"
    assert Engine(model, MarkerTokenizer(), rows=2, max_seq_len=4096, speculative_tokens=0).max_seq_len == 64
    unchunked = tiny_model("llama4_text", no_rope_layers=[0, 0])  # (no rotated layer, no chunks)
    assert size_kv_cache(BackendConfig(max_seq_len=4096), unchunked.config, torch.float32).max_seq_len == 512


def test_the_default_models_line_gives_its_arithmetic():
    from transformers import LlamaConfig

    smollm2 = LlamaConfig(  # SmolLM2-135M's attention (the GGUF file's context is 8192)
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
        max_position_embeddings=8192,
    )  # fmt: skip
    line = size_kv_cache(BackendConfig(), smollm2, torch.bfloat16).summary()  # the default mode's cache
    assert line.startswith(
        "KV cache: 32 rows and 1 for embedding inputs x 2048 positions, bfloat16, 1485 MiB "
        "(22.5 KiB a position a row: 2 x 30 layers x 3 KV heads x 64 x 2 bytes); the default"
    )
    line = size_kv_cache(BackendConfig(), smollm2, torch.float32).summary()  # the exact mode's
    assert line.startswith("KV cache: 32 rows and 1 for embedding inputs x 2048 positions, float32, 2970 MiB")


def test_layers_of_other_widths_and_layers_keeping_none_are_counted_as_they_are():
    """Gemma 4's global layers keep wider keys than its window layers, and its last layers keep none (they
    read the last earlier layer of their kind's): the line and the bytes count each layer as it is."""
    from transformers import Gemma4TextConfig

    gemma4 = Gemma4TextConfig(
        num_hidden_layers=10, num_attention_heads=8, num_key_value_heads=2, head_dim=256, global_head_dim=512,
        layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2, num_kv_shared_layers=4,
    )  # fmt: skip
    size = size_kv_cache(BackendConfig(max_seq_len=1024), gemma4, torch.bfloat16)
    # Layers 0-5 keep theirs, five window layers and one global one; 6-9 read layers 3's and 4's
    assert size.shape.without == (6, 7, 8, 9)
    assert size.bytes == 33 * 1024 * 2 * (5 * 2 * 256 + 2 * 512) * 2
    widths = "(5 layers x 2 KV heads x 256 + 1 layer x 2 KV heads x 512)"
    assert f"a row: 2 x {widths} x 2 bytes)" in size.summary()


def test_starcoders_one_key_head_is_kept_as_one():
    """GPT-BigCode's `multi_query` (StarCoder's 48 query heads read one key head): a cache of 48 would
    serve the same text, at 48 times the memory."""
    from transformers import GPTBigCodeConfig

    starcoder = GPTBigCodeConfig(n_embd=6144, n_layer=40, n_head=48, n_positions=8192, multi_query=True)
    line = size_kv_cache(BackendConfig(max_seq_len=1024), starcoder, torch.bfloat16).summary()
    assert "a row: 2 x 40 layers x 1 KV heads x 128 x 2 bytes)" in line
    every_head = GPTBigCodeConfig(n_embd=64, n_layer=2, n_head=4, multi_query=False)
    assert "2 layers x 4 KV heads x 16" in size_kv_cache(BackendConfig(), every_head, torch.float32).summary()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """The tiny Llama saved as a model directory, with the default model's tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    AutoTokenizer.from_pretrained(
        load_model(BackendConfig(rows=1, max_seq_len=64)).tokenizer_path
    ).save_pretrained(path)
    return path


def test_a_loaded_engine_keeps_its_cache_within_the_budget_and_logs_its_size(tiny_model_dir, caplog):
    budget = 9 * 384 * POSITION + 1000  # 8 user rows and the embedding row of 384 positions, and a little
    config = BackendConfig(model=str(tiny_model_dir), rows=8, kv_cache_memory=budget, dtype="float32")
    with caplog.at_level(logging.INFO, logger="backend"):
        engine = Engine.load(config)
    cache = [tensor for layer in engine.runner.cache.layers for tensor in (layer.keys, layer.values)]
    allocated = sum(tensor.numel() * tensor.element_size() for tensor in cache)
    assert engine.max_seq_len == 384 and allocated == 9 * 384 * POSITION <= budget
    assert (
        "KV cache: 8 rows and 1 for embedding inputs x 384 positions, float32, 1.7 MiB (512 bytes a position "
        "a row: 2 x 2 layers x 2 KV heads x 16 x 4 bytes); the most that fit in --kv-cache-memory 1.7 MiB"
    ) in caplog.messages


def test_a_budget_too_small_stops_the_backend_saying_why(tiny_model_dir):
    from backend.process import BackendProcess, BackendStartError

    backend = BackendProcess(BackendConfig(model=str(tiny_model_dir), rows=4, kv_cache_memory=1000)).start()
    try:
        with pytest.raises(BackendStartError, match="--kv-cache-memory 1000 bytes holds 0 positions a row"):
            backend.wait_ready(timeout=120)
    finally:
        backend.stop()
