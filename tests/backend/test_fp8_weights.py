"""An FP8 checkpoint on a CPU: the exact mode serves the weights transformers dequantizes, the default mode
converts each FP8 layer once to 8-bit blocks within half a step of 1/127 of each block's largest weight."""

from unittest import mock

import pytest
import torch

from backend.messages import BackendConfig
from backend.model.loader import load_model
from backend.quant import block_weights
from backend.quant.fp8_linear import Fp8Layer, fp8_products
from backend.quant.gguf_types import requantize_int8
from backend.quant.quantized_linear import Int8Linear
from tests.backend.fp8_files import write_fp8_checkpoint
from tests.backend.models import load_on_cpu

WIDE = dict(hidden_size=256, intermediate_size=384, head_dim=64)  # several 128 x 128 blocks a layer


def load(directory, tmp_path, quantize: str):
    return load_on_cpu(directory, tmp_path, quantize).model


def test_the_exact_mode_serves_the_weights_transformers_dequantizes(tmp_path):
    expected = write_fp8_checkpoint(tmp_path / "tiny-FP8", **WIDE)
    model = load(tmp_path / "tiny-FP8", tmp_path, "none")
    assert len(expected) == 2 * 7
    for module, weight in expected.items():
        assert torch.equal(model.get_submodule(module).weight, weight), module


@pytest.mark.skipif(not block_weights.available(torch.device("cpu")), reason="needs the CPU's blocks")
def test_the_default_mode_converts_each_fp8_layer_to_8_bit_blocks(tmp_path, caplog):
    expected = write_fp8_checkpoint(tmp_path / "tiny-FP8", **WIDE)
    with caplog.at_level("INFO"):
        model = load(tmp_path / "tiny-FP8", tmp_path, "auto")
    assert "FP8 checkpoint: 14 linear layers converted to 8-bit blocks" in caplog.text
    x = torch.randn(3, 384)
    for module, weight in expected.items():
        layer = model.get_submodule(module)
        assert isinstance(layer, Int8Linear), module
        served = block_weights.dequantize(layer.blocks, weight.shape[1]).reshape(weight.shape[0], -1, 32)
        largest = weight.reshape(served.shape).abs().amax(dim=-1, keepdim=True)
        assert ((served - weight.reshape(served.shape)).abs() <= largest / 254 * 1.001).all(), module
        reference = x[:, : weight.shape[1]] @ weight.T
        assert (layer(x[:, : weight.shape[1]]) - reference).abs().max() < 0.02 * reference.abs().max()
    assert type(model.lm_head) is torch.nn.Linear  # not in FP8 in the checkpoint


def test_where_torch_sees_a_gpu_with_fp8_the_layers_still_load_as_their_dequantized_weights(tmp_path):
    """transformers keeps an FP8 checkpoint's layers as its FP8Linear where it finds a GPU with FP8, whose
    kernels it would download at the first product, and whose float8 weights the model's `.to(dtype)`
    turned into floats without their scales. The loader has them dequantized on any device."""
    expected = write_fp8_checkpoint(tmp_path / "tiny-FP8", **WIDE)
    with (
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)),
    ):
        model = load(tmp_path / "tiny-FP8", tmp_path, "none")
    for module, weight in expected.items():
        layer = model.get_submodule(module)
        assert type(layer) is torch.nn.Linear and torch.equal(layer.weight, weight), module


@pytest.mark.skipif(not block_weights.available(torch.device("cpu")), reason="needs the CPU's blocks")
def test_in_bfloat16_the_blocks_are_converted_from_the_float32_weights(tmp_path):
    """Not from their rounding to the model's bfloat16: the layers are replaced before the cast."""
    expected = write_fp8_checkpoint(tmp_path / "tiny-FP8", **WIDE)
    config = BackendConfig(
        model=str(tmp_path / "tiny-FP8"),
        dtype="bfloat16",
        device="cpu",
        rows=4,
        max_seq_len=128,
        cache_dir=str(tmp_path),
    )
    model = load_model(config).model
    for module, weight in expected.items():
        layer = model.get_submodule(module)
        eight_bit = requantize_int8(weight.numpy())
        assert torch.equal(layer.blocks, block_weights.pack_int8(eight_bit.q, eight_bit.scale)), module


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device")
def test_an_fp8_checkpoint_on_cuda_multiplies_near_its_dequantized_weights(tmp_path):
    """By FP8 products where the GPU has them (e4m3 activations: within a tenth), else by the dequantized
    weights in the model's dtype."""
    expected = write_fp8_checkpoint(tmp_path / "tiny-FP8", **WIDE)
    config = BackendConfig(
        model=str(tmp_path / "tiny-FP8"), device="cuda", rows=4, max_seq_len=128, cache_dir=str(tmp_path)
    )
    model = load_model(config).model
    products = fp8_products(torch.device("cuda"), model.dtype)
    x = torch.randn(3, 384, device="cuda", dtype=model.dtype)
    for module, weight in expected.items():
        layer = model.get_submodule(module)
        assert isinstance(layer, Fp8Layer) is products, module
        inputs = x[:, : weight.shape[1]].contiguous()
        reference = inputs.float() @ weight.to("cuda").T
        got = layer(inputs).float()
        assert (got - reference).abs().max() < (0.1 if products else 0.03) * reference.abs().max(), module
