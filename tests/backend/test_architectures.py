"""Models whose attention the engine does not honour are refused at start-up, saying why.

Every supported architecture is held to transformers' `generate` by
tests/backend/test_exactness.py, which runs the list in backend/model/architectures.py.
"""

import pytest
import torch
from transformers import (
    FalconConfig,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from backend.layers.attention import refuse_unsupported
from backend.messages import BackendConfig
from backend.model.architectures import UnsupportedModel, check_supported
from backend.model.loader import load_model
from backend.process import BackendProcess, BackendStartError
from tests.backend.models import tiny_model

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize(
    "config, max_seq_len, refused_for",
    [
        (LlamaConfig(**SMALL), 2048, None),
        (MistralConfig(**SMALL, sliding_window=None), 2048, None),
        (MistralConfig(**SMALL, sliding_window=4096), 2048, None),  # the window is never reached
        (MistralConfig(**SMALL, sliding_window=16), 128, "sliding window of 16"),
        (MistralConfig(**SMALL, sliding_window=16), 16, None),
        (Qwen2Config(**SMALL, sliding_window=16, use_sliding_window=False), 128, None),
        (Qwen2Config(**SMALL, sliding_window=16, use_sliding_window=True, max_window_layers=0), 128, "of 16"),
        (Gemma2Config(**SMALL), 128, "'gemma2' is not supported"),
        (Phi3Config(**SMALL), 128, None),
        (Phi3Config(**SMALL, sliding_window=64), 128, "sliding window of 64"),
        # Qwen3 turns its window on only for layers past max_window_layers (28 by default): none here.
        (Qwen3Config(**SMALL, sliding_window=16, use_sliding_window=True), 128, None),
        (Qwen3Config(**SMALL, sliding_window=16, use_sliding_window=True, max_window_layers=0), 128, "of 16"),
        (FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4), 128, "'falcon' is not"),
        (LlamaConfig(**SMALL, attn_logit_softcapping=50.0), 128, "soft-capping"),
    ],
)
def test_check_supported(config, max_seq_len, refused_for):
    if refused_for is None:
        check_supported(config, max_seq_len)
    else:
        with pytest.raises(UnsupportedModel, match=refused_for):
            check_supported(config, max_seq_len)


def test_a_sliding_window_model_is_refused_at_start_up_with_the_reason(tmp_path):
    from transformers import AutoTokenizer, MistralForCausalLM

    model = MistralForCausalLM(MistralConfig(**SMALL, vocab_size=512, sliding_window=32))
    model.save_pretrained(tmp_path / "windowed")
    AutoTokenizer.from_pretrained(
        load_model(BackendConfig(rows=1, max_seq_len=64)).tokenizer_path
    ).save_pretrained(tmp_path / "windowed")
    with pytest.raises(UnsupportedModel, match="sliding window of 32"):
        load_model(BackendConfig(model=str(tmp_path / "windowed"), max_seq_len=256))
    backend = BackendProcess(BackendConfig(model=str(tmp_path / "windowed"), max_seq_len=256)).start()
    try:
        with pytest.raises(BackendStartError, match="sliding window of 32.*--max-seq-len 32"):
            backend.wait_ready(timeout=120)
    finally:
        backend.stop()
    assert tiny_model("mistral").config.sliding_window is None  # what the exactness test serves


@pytest.mark.parametrize(
    "kwargs, refused_for",
    [
        ({"sliding_window": None}, None),
        ({"sliding_window": 4096}, None),  # wider than the cache: never comes into play
        ({"sliding_window": 16}, "sliding window of 16"),
        ({"softcap": 50.0}, "soft-capping"),
        ({"s_aux": torch.zeros(4)}, "sinks"),
    ],
)
def test_the_row_attention_refuses_a_feature_it_does_not_do(kwargs, refused_for):
    """What a layer asks of the attention interface and the loader did not refuse is an error, never an
    attention without it."""
    if refused_for is None:
        refuse_unsupported(kwargs, positions=128)
    else:
        with pytest.raises(NotImplementedError, match=refused_for):
            refuse_unsupported(kwargs, positions=128)
