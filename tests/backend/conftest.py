import pytest

from backend.engine import Engine
from backend.loader import load_model
from backend.messages import BackendConfig


@pytest.fixture(scope="session")
def default_model():
    """The default model (SmolLM2-135M-Instruct) in the exact mode (float32, no quantization), loaded once."""
    return load_model(BackendConfig(dtype="float32", quantize="none", max_seq_len=512))


@pytest.fixture(scope="session")
def default_engine(default_model):
    engine = Engine(default_model.model, default_model.tokenizer, rows=32, max_seq_len=512)
    engine.warm_up()
    return engine
