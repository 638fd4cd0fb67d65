"""A GGUF file's rotary scaling is its model's own (model/gguf_rope.py): transformers' GGUF reader drops it
for every architecture, which served every Llama 3 file and Gemma 3's global layers at frequencies their
models were not trained at. A tiny model of each scaling, written as llama.cpp's converter writes it
(tests/backend/gguf_files.py: linear and YaRN as keys, Llama 3's as a tensor of divisors), loads with
the model's rope parameters and gives its logits exactly."""

import pytest
import torch

from backend.model.architectures import UnsupportedModel
from backend.model.source import default_model_path
from tests.backend.gguf_files import write_tiny_gguf
from tests.backend.models import TINY_VOCAB, load_on_cpu, tiny_model


def llama3(original: int, theta: float = 1e4, head_dim: int = 16, low: float = 1.0, high: float = 4.0):
    return tiny_model(
        "llama",
        head_dim=head_dim,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": 8.0,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        },
    )


SCALED = {
    # the tiny model's frequencies on both sides of the original context and between
    "llama3": lambda: llama3(original=256),
    # Meta's original context: one frequency between, as in a real Llama 3's 64 of each head
    "llama3 of 8192": lambda: llama3(original=8192),
    # none between: any original context where the divisors change gives the same model
    "llama3 with no frequency between": lambda: llama3(original=1024, theta=1e6),
    "linear": lambda: tiny_model(
        "qwen2", rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}
    ),
    "yarn": lambda: tiny_model(
        "qwen3",
        head_dim=128,  # (no key width read for Qwen3: every released one's)
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "attention_factor": 1.25,
        },
    ),
    # Gemma 3's global layers scale linearly (8 times in its 4B, 12B and 27B), its window layers not; every
    # sixth layer is global (no key says which: llama.cpp's pattern, and transformers')
    "gemma3 global layers": lambda: tiny_model(
        "gemma3_text",
        tie_word_embeddings=True,
        num_hidden_layers=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        query_pre_attn_scalar=16,  # its heads' width, as llama.cpp scales all but 27B (gguf_families.py)
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),
}


@pytest.mark.parametrize("scaling", SCALED)
def test_a_gguf_files_rotary_scaling_is_the_models_own(scaling, tmp_path):
    model = SCALED[scaling]()
    path = write_tiny_gguf(tmp_path / "scaled.gguf", model, default_model_path())
    loaded = load_on_cpu(path, tmp_path, "none").model
    rope, expected = loaded.config.rope_parameters, model.config.rope_parameters
    if "full_attention" in expected:
        rope, expected = rope["full_attention"], expected["full_attention"]
    assert rope["rope_type"] == expected["rope_type"]
    ids = torch.randint(2, TINY_VOCAB - 1, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_a_llama_file_whose_divisors_are_no_llama_3_scaling_is_refused_naming_them(tmp_path):
    """Low and high frequency factors of other than Meta's ratio (a file says neither): no rope parameters
    of Llama 3's would rotate as the file says."""
    model = llama3(original=1024, head_dim=64, high=2.0)
    path = write_tiny_gguf(tmp_path / "scaled.gguf", model, default_model_path())
    with pytest.raises(UnsupportedModel, match="rope_freqs.weight"):
        load_on_cpu(path, tmp_path, "none")
