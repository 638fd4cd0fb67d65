"""Models of a type the engine does not serve are refused at start-up, saying why.

Every supported architecture is held to transformers' `generate` by
tests/backend/test_exactness.py, which runs the list in backend/model/architectures.py.
"""

import json
from pathlib import Path

import pytest
from transformers import (
    FalconConfig,
    Gemma2Config,
    Gemma3Config,
    Gemma3nConfig,
    Gemma3TextConfig,
    Gemma4Config,
    Gemma4TextConfig,
    LlamaConfig,
    LlavaConfig,
    Mamba2Config,
    MambaConfig,
    Mistral3Config,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3_5Config,
    RwkvConfig,
)

from backend.messages import BackendConfig
from backend.model.architectures import UnsupportedModel, check_supported
from backend.model.loader import load_model, load_tokenizer
from backend.process import BackendProcess, BackendStartError

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
RWKV = dict(
    hidden_size=64, num_hidden_layers=2, attention_hidden_size=64, intermediate_size=128, vocab_size=512
)


@pytest.mark.parametrize(
    "config, refused_for",
    [
        (LlamaConfig(**SMALL), None),
        (MistralConfig(**SMALL, sliding_window=16), None),
        (Qwen2Config(**SMALL, sliding_window=16, use_sliding_window=True, max_window_layers=0), None),
        (Phi3Config(**SMALL, sliding_window=64), None),
        (Gemma2Config(**SMALL), None),
        (Gemma3Config(text_config=SMALL), None),  # multimodal: its text model is served
        (Qwen3_5Config(text_config=SMALL), None),  # so is Qwen3.5's, Gated DeltaNets among attention layers
        (Gemma4Config(text_config=SMALL), None),  # and Gemma 4's
        (Gemma3nConfig(text_config=SMALL), None),  # and Gemma 3n's (its text model alone loaded)
        (Mistral3Config(text_config=SMALL), None),  # and Mistral 3's (Mistral Small 3.1's, Mistral text)
        # An embedding model's layers, every token reading every other: not a generator's
        (Gemma3TextConfig(**SMALL, use_bidirectional_attention=True), "attends both ways"),
        (Gemma4TextConfig(**SMALL, use_bidirectional_attention="all"), "attends both ways"),
        (FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4), None),
        (FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True), None),
        (MambaConfig(hidden_size=64, num_hidden_layers=2), None),  # a recurrent state a row
        (Mamba2Config(hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16), None),
        (RwkvConfig(**RWKV), "'rwkv' is not supported"),
        # a multimodal model of a served text model that transformers builds as no causal LM, and whose text
        # the server does not load alone: refused, not failed in the loading
        (
            LlavaConfig(text_config=LlamaConfig(**SMALL)),
            "'llava' is a multimodal model of a llama text model",
        ),
    ],
)
def test_check_supported(config, refused_for):
    if refused_for is None:
        check_supported(config)
    else:
        with pytest.raises(UnsupportedModel, match=refused_for):
            check_supported(config)


def test_a_model_of_another_type_is_refused_at_start_up_with_the_reason(tmp_path):
    from transformers import RwkvForCausalLM

    model = RwkvForCausalLM(RwkvConfig(**RWKV))
    model.save_pretrained(tmp_path / "state-space")
    load_tokenizer(BackendConfig()).save_pretrained(tmp_path / "state-space")
    with pytest.raises(UnsupportedModel, match="'rwkv' is not supported"):
        load_model(BackendConfig(model=str(tmp_path / "state-space"), max_seq_len=256))
    backend = BackendProcess(BackendConfig(model=str(tmp_path / "state-space"), max_seq_len=256)).start()
    try:
        with pytest.raises(BackendStartError, match="'rwkv' is not supported.*gemma2"):
            backend.wait_ready(timeout=120)
    finally:
        backend.stop()


def own_code_model(directory: Path, auto_map: dict[str, str]) -> Path:
    """A model directory whose config.json maps Auto classes to its own code (a config class that says
    its own model type: where the refusal names that type, the code ran)."""
    directory.mkdir()
    code = (
        "from transformers import LlamaConfig\n\nclass OwnConfig(LlamaConfig):\n    model_type = 'own-llama'"
    )
    (directory / "configuration_own.py").write_text(code)
    config = {**LlamaConfig(**SMALL).to_dict(), "model_type": "own-llama", "auto_map": auto_map}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_models_own_code_runs_only_with_trust_remote_code(tmp_path):
    directory = own_code_model(tmp_path / "own", {"AutoConfig": "configuration_own.OwnConfig"})
    with pytest.raises(UnsupportedModel, match="own code .*AutoConfig.*only with --trust-remote-code"):
        load_model(BackendConfig(model=str(directory)))
    # Trusted, its configuration code runs (its own type), and the type is refused as any other is.
    with pytest.raises(UnsupportedModel, match="'own-llama' is not supported"):
        load_model(BackendConfig(model=str(directory), trust_remote_code=True))


def test_a_models_own_modeling_code_is_refused_even_trusted(tmp_path):
    auto_map = {
        "AutoConfig": "configuration_own.OwnConfig",
        "AutoModelForCausalLM": "modeling_own.OwnForCausalLM",
    }
    directory = own_code_model(tmp_path / "own", auto_map)
    with pytest.raises(UnsupportedModel, match="own modeling code .*modeling_own.OwnForCausalLM"):
        load_model(BackendConfig(model=str(directory), trust_remote_code=True))
