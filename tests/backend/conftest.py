import pytest
import torch

from backend.engine.engine import Engine
from backend.messages import BackendConfig
from backend.model.loader import load_model
from backend.quant import block_weights


@pytest.fixture(scope="session")
def default_model():
    """The default model (SmolLM2-135M-Instruct) in the exact mode (float32, no quantization), loaded once."""
    return load_model(BackendConfig(dtype="float32", quantize="none", max_seq_len=512))


@pytest.fixture(scope="session")
def default_engine(default_model):
    engine = Engine(default_model.model, default_model.tokenizer, rows=32, max_seq_len=512)
    engine.warm_up()
    return engine


@pytest.fixture(params=["blocks", "pytorch"])
def weight_layout(request, monkeypatch):
    """How the quantized layers a test builds on the CPU store their weights: in blocks for the CPU's
    int8 dot products (block_weights.py), or packed for PyTorch's kernels, as a CPU without AVX2 or
    without the C++ extension stores them."""
    if request.param == "pytorch":
        monkeypatch.setattr(block_weights, "available", lambda device: False)
    elif not block_weights.available(torch.device("cpu")):
        pytest.skip("this CPU has no AVX2 (or no compiler): its layers are packed for PyTorch's kernels")
    return request.param
