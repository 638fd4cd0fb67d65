"""The sampling a model's generation_config.json recommends, read as vLLM reads it (--generation-config)."""

from __future__ import annotations

import logging

import pytest
from transformers import GenerationConfig

from backend.model.sampling_defaults import checked, sampling_defaults
from tests.conftest import ROOT

QWEN3 = ROOT / "tests" / "frontend" / "generation_config"  # Qwen3's file: 0.6, 0.95, 20


def test_auto_takes_the_sampling_fields_the_models_config_sets_and_nothing_else():
    config = GenerationConfig(
        do_sample=True, temperature=0.6, top_p=0.95, top_k=20, bos_token_id=1, num_beams=1
    )
    assert sampling_defaults(config, "auto", {}) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def test_a_config_made_from_the_models_config_recommends_nothing():
    # What transformers makes where the model has no generation_config.json (the default GGUF model's)
    assert sampling_defaults(GenerationConfig(bos_token_id=1, eos_token_id=2), "auto", {}) == {}
    assert sampling_defaults(None, "auto", {}) == {}


def test_vllm_leaves_the_models_out_and_a_directory_is_read_instead():
    config = GenerationConfig(temperature=0.2, min_p=0.1)
    assert sampling_defaults(config, "vllm", {}) == {}
    assert sampling_defaults(config, str(QWEN3), {}) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def test_the_override_goes_over_either_and_max_new_tokens_is_the_default_max_tokens():
    config = GenerationConfig(temperature=0.7, repetition_penalty=1.05, max_new_tokens=300)
    override = {"temperature": 0.0, "min_p": 0.05}
    assert sampling_defaults(config, "auto", override) == {
        "temperature": 0.0,
        "repetition_penalty": 1.05,
        "max_tokens": 300,
        "min_p": 0.05,
    }
    assert sampling_defaults(config, "vllm", {"max_new_tokens": 64}) == {"max_tokens": 64}


def test_a_models_value_out_of_range_is_left_out_and_said(caplog):
    config = GenerationConfig(temperature=3.5, top_p=0.8)
    with caplog.at_level(logging.WARNING, logger="backend"):
        assert sampling_defaults(config, "auto", {}) == {"top_p": 0.8}
    assert "temperature must be at least 0 and at most 2, got 3.5" in caplog.text


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("temperature", -0.1, "temperature must be at least 0 and at most 2"),
        ("temperature", float("nan"), "temperature must be a number"),
        ("top_k", 1e400, "top_k must be an integer, got inf"),
        ("top_k", -2, "top_k must be at least -1, got -2"),
        ("top_p", 0, "top_p must be over 0 and at most 1"),
        ("top_k", 2.5, "top_k must be an integer"),
        ("repetition_penalty", "1.1", "repetition_penalty must be a number"),
        ("max_new_tokens", 0, "max_new_tokens must be at least 1, got 0"),
        ("do_sample", True, "do_sample is not a sampling field this server takes from it"),
    ],
)
def test_an_operators_bad_value_is_an_error_naming_it(name, value, message):
    with pytest.raises(ValueError, match=message):
        sampling_defaults(None, "vllm", {name: value})
    with pytest.raises(ValueError, match=message):
        checked(name, value)


def test_a_directory_without_the_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=f"--generation-config {tmp_path}: no generation_config.json"):
        sampling_defaults(None, str(tmp_path), {})
