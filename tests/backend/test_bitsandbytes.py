"""bitsandbytes checkpoints (tests/backend/bitsandbytes_files.py has the library quantize and save them)
load and serve without the library: the model is built from exactly the weights the library's own
dequantization gives; LLM.int8 layers multiply by the checkpoint's int8 values, NF4 and FP4 ones (whose
16 uneven values no 4-bit block holds) by 8-bit blocks converted once."""

import json
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.quant import block_weights
from backend.quant.bitsandbytes_checkpoint import checkpoint_format, four_bit_layer
from backend.quant.gguf_types import requantize_int8
from backend.quant.group_wise import UnsupportedCheckpoint
from backend.quant.quantized_linear import Int8Linear
from tests.backend.bitsandbytes_files import SCHEMES, write_bitsandbytes_checkpoint
from tests.backend.models import greedy_agreements, load_on_cpu

SERVED = {  # name: the log's format and how its layers were served
    "nf4-double-quant": ("NF4", "8-bit blocks converted once from the dequantized NF4 weights x14"),
    "fp4": ("FP4", "8-bit blocks converted once from the dequantized FP4 weights x14"),
    "int8": ("LLM.int8", "8-bit blocks of the checkpoint's values x14"),
}


def load(directory, tmp_path, quantize: str = "auto"):
    """`load_on_cpu`, with bitsandbytes made unimportable while the server loads."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` fails
        return load_on_cpu(directory, tmp_path, quantize)


def write(tmp_path, name: str) -> dict[str, torch.Tensor]:
    return write_bitsandbytes_checkpoint(tmp_path / name, name)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_the_exact_mode_builds_the_model_from_the_weights_the_library_dequantizes(name, tmp_path):
    expected = write(tmp_path, name)
    model = load(tmp_path / name, tmp_path, quantize="none").model
    assert len(expected) == 2 * 7
    for module, weight in expected.items():
        assert torch.equal(model.get_submodule(module).weight, weight), module
    assert type(model.lm_head) is torch.nn.Linear  # the library leaves the head: stored and served as floats


@pytest.mark.skipif(not block_weights.available(torch.device("cpu")), reason="needs the CPU's blocks")
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_each_layer_is_served_from_8_bit_blocks_of_the_librarys_weights(name, tmp_path, caplog):
    """LLM.int8's own values, their scale a channel in fp16 (within 2^-11 of each weight). NF4 and FP4 within
    half a step of each block of 32's scale, its largest weight / 100 at most, and nearer than the plain
    conversion (the largest at 127) gets them: each block's scale is the one its codes round best at."""
    expected = write(tmp_path, name)
    with caplog.at_level("INFO"):
        model = load(tmp_path / name, tmp_path).model
    fmt, served_as = SERVED[name]
    assert f"bitsandbytes checkpoint ({fmt}): 14 linear layers served as {served_as}, their" in caplog.text
    x = torch.randn(3, 128)
    errors, plain_errors = [], []
    for module, weight in expected.items():
        layer = model.get_submodule(module)
        assert isinstance(layer, Int8Linear), module
        served = block_weights.dequantize(layer.blocks, weight.shape[1])
        if name == "int8":
            assert ((served - weight).abs() <= weight.abs() * 2**-11).all(), module
        else:
            largest = weight.reshape(weight.shape[0], -1, 32).abs().amax(dim=-1, keepdim=True)
            error = (served - weight).reshape(weight.shape[0], -1, 32)
            assert (error.abs() <= largest / 100 * 0.51).all(), module
            plain = requantize_int8(weight.numpy())
            plain_weights = plain.q.float().reshape(error.shape) * plain.scale[..., None]
            errors.append(error.square().sum())
            plain_errors.append((plain_weights - weight.reshape(error.shape)).square().sum())
        reference = x[:, : weight.shape[1]] @ weight.T
        got = layer(x[:, : weight.shape[1]])
        assert (got - reference).abs().max() < 0.02 * reference.abs().max(), module
    if errors:
        assert sum(errors) < 0.9 * sum(plain_errors)


@pytest.mark.parametrize("name", ["nf4-double-quant", "int8"])
def test_a_served_checkpoint_gives_the_greedy_tokens_of_its_dequantized_model(name, tmp_path):
    """The engine, rows joining and leaving, against `generate` on the exact mode's model of the same
    checkpoint."""
    write(tmp_path, name)
    served = load(tmp_path / name, tmp_path).model
    exact = load(tmp_path / name, tmp_path, quantize="none").model
    # int8 activations may tip one near-tie; a layer read wrong tips them all
    assert greedy_agreements(served, exact, seed=5) >= 4


def test_llm_int8_weights_in_a_gpu_tile_layout_are_refused(tmp_path):
    """Old bitsandbytes versions saved LLM.int8 weights in the GPUs' tile layouts (weight_format 1-3)."""
    write(tmp_path, "int8")
    path = tmp_path / "int8" / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.1.mlp.up_proj.weight_format"] = torch.tensor(1, dtype=torch.uint8)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(UnsupportedCheckpoint, match="layers.1.mlp.up_proj: LLM.int8 weights in the GPU tile"):
        load(tmp_path / "int8", tmp_path)


def test_a_checkpoint_quantized_to_neither_width_is_refused(tmp_path):
    write(tmp_path, "nf4-double-quant")
    config_path = tmp_path / "nf4-double-quant" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"].update(load_in_4bit=False, load_in_8bit=False)
    config_path.write_text(json.dumps(config))
    with pytest.raises(UnsupportedCheckpoint, match="quantized neither to 4 nor to 8 bits"):
        load(tmp_path / "nf4-double-quant", tmp_path)
    assert checkpoint_format({"quant_method": "gptq"}) is None


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_a_layer_whose_last_block_is_short_is_read_as_the_library_reads_it(quant_type):
    """150 weights in blocks of 64: the last block has 22, and double quantization's absmax codes are
    fewer than its blocks of 256."""
    from bitsandbytes import functional

    weight = torch.randn(3, 50)
    packed, state = functional.quantize_4bit(
        weight, blocksize=64, quant_type=quant_type, compress_statistics=True
    )
    stored = state.as_dict(packed=True)  # as save_pretrained writes it
    state_key = next(key for key in stored if key.startswith("quant_state."))
    json_state = json.loads(bytes(stored.pop(state_key).tolist()).decode("utf-8"))
    layer = four_bit_layer({"weight": packed, **stored}, json_state, "layer")
    state.dtype = torch.float32
    assert torch.equal(layer.dequantize(), functional.dequantize_4bit(packed, state))
