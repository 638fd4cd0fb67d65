"""GPTQ and AWQ checkpoints (tests/backend/group_wise_files.py writes them to each format's packing) load
and serve: the model is built from exactly the weights the libraries' own dequantization gives, and each
quantized layer multiplies by the checkpoint's values and groups, repacked into the engine's 4-bit
blocks (act-order layers, whose groups are not consecutive inputs, by 8-bit blocks converted once).
Checkpoints the engine cannot serve are refused at start, with the reason."""

import json

import pytest
import torch

from backend.model.architectures import UnsupportedModel
from backend.quant import block_weights, group_wise
from backend.quant.group_wise import UnsupportedCheckpoint, checkpoint_format
from backend.quant.quantized_linear import BlocksLinear, Int4Linear, Int8Linear
from tests.backend.group_wise_files import write_group_wise_checkpoint
from tests.backend.models import greedy_agreements, load_on_cpu, write_tiny_causal_lm


def every_layer(module: str) -> bool:
    return True


CHECKPOINTS = {  # name: write_group_wise_checkpoint's options
    "gptq-v1-symmetric": dict(method="gptq", group_size=32, symmetric=True, packing="gptq"),
    "gptq-v1-asymmetric": dict(method="gptq", group_size=64, symmetric=False, packing="gptq"),
    "gptq-v2-asymmetric": dict(method="gptq", group_size=32, symmetric=False, packing="gptq_v2"),
    "awq": dict(method="awq", group_size=64, symmetric=False, packing="gemm"),
    "gptq-v1-act-order": dict(
        method="gptq", group_size=32, symmetric=False, packing="gptq", act_order=every_layer
    ),
    "gptq-8-bit-v1-symmetric": dict(method="gptq", group_size=64, symmetric=True, packing="gptq", bits=8),
    "gptq-8-bit-v2-asymmetric": dict(
        method="gptq", group_size=32, symmetric=False, packing="gptq_v2", bits=8
    ),
}
ACT_ORDER = "gptq-v1-act-order"
FOUR_BIT = "4-bit blocks of the checkpoint's groups x14"
SYMMETRIC = "4-bit symmetric blocks of the checkpoint's groups x14"  # d alone, as GGUF's Q4_0
CONVERTED = "8-bit blocks converted once from the dequantized weights ({}) x14"
SERVED = {  # name: (layer type, the log's format and how its layers were served)
    "gptq-v1-symmetric": (BlocksLinear, "GPTQ checkpoint (4-bit, groups of 32)", SYMMETRIC),
    "gptq-v1-asymmetric": (Int4Linear, "GPTQ checkpoint (4-bit, groups of 64)", FOUR_BIT),
    "gptq-v2-asymmetric": (Int4Linear, "GPTQ checkpoint (4-bit, groups of 32)", FOUR_BIT),
    "awq": (Int4Linear, "AWQ checkpoint (4-bit, groups of 64)", FOUR_BIT),
    ACT_ORDER: (Int8Linear, "GPTQ checkpoint (4-bit, groups of 32)", CONVERTED.format("act-order groups")),
    "gptq-8-bit-v1-symmetric": (
        Int8Linear,
        "GPTQ checkpoint (8-bit, groups of 64)",
        "8-bit blocks of the checkpoint's values x14",
    ),
    "gptq-8-bit-v2-asymmetric": (
        Int8Linear,
        "GPTQ checkpoint (8-bit, groups of 32)",
        CONVERTED.format("zero points"),
    ),
}


def load(directory, tmp_path, quantize: str = "auto"):
    return load_on_cpu(directory, tmp_path, quantize)


def write(tmp_path, name: str):
    return write_group_wise_checkpoint(tmp_path / name, **CHECKPOINTS[name])


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_the_exact_mode_builds_the_model_from_the_weights_the_library_dequantizes(name, tmp_path):
    expected = write(tmp_path, name)
    model = load(tmp_path / name, tmp_path, quantize="none").model
    assert len(expected) == 2 * 7
    for module, weight in expected.items():
        assert torch.equal(model.get_submodule(module).weight, weight), module


@pytest.mark.skipif(not block_weights.available(torch.device("cpu")), reason="needs the CPU's blocks")
@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_each_layer_is_served_from_the_checkpoints_values_in_the_engines_blocks(name, tmp_path, caplog):
    """The 4-bit layers' weights are the library's to 0 error in float32 (q, scale and zero unpacked); in
    the CPU's blocks, which keep z * scale in fp16, to 0 for symmetric checkpoints (z = 8) and within 2^-11
    of z * scale otherwise. Symmetric 8-bit ones are the library's exactly (q - 128 and its fp16 scales).
    Act-order layers (no 4-bit block of 32 has one scale: their groups' inputs are scattered) and 8-bit
    ones with zero points are converted from the library's weights, within half a step of 1/127 of each
    block's largest weight."""
    expected = write(tmp_path, name)
    kind, fmt, served_as = SERVED[name]
    with caplog.at_level("INFO"):
        model = load(tmp_path / name, tmp_path).model
    assert f"{fmt}: 14 linear layers served as {served_as}, their dequantized weights" in caplog.text
    x = torch.randn(3, 128)
    for module, weight in expected.items():
        layer = model.get_submodule(module)
        assert isinstance(layer, kind), module
        served = block_weights.dequantize(layer.blocks, weight.shape[1])
        if "converted" in served_as:
            largest = weight.reshape(weight.shape[0], -1, 32).abs().amax(dim=-1, keepdim=True)
            error = (served - weight).reshape(weight.shape[0], -1, 32).abs()
            assert (error <= largest / 127 * 0.51).all(), module
        elif CHECKPOINTS[name]["symmetric"]:
            assert torch.equal(served, weight), module
        else:
            # z * scale is at most a group's range, at most twice its largest weight
            assert (served - weight).abs().max() <= 2 * weight.abs().max() * 2**-11, module
        reference = x[:, : weight.shape[1]] @ weight.T
        got = layer(x[:, : weight.shape[1]])
        assert (got - reference).abs().max() < 0.02 * reference.abs().max(), module


def test_unpacking_gives_the_librarys_weights_exactly_in_float32(tmp_path):
    """Below the blocks: group_wise's own unpacking, and the 4-bit blocks' q, scale and zero, for every
    checkpoint kind; an act-order checkpoint's groups are scattered indeed."""
    for name in CHECKPOINTS:
        expected = write(tmp_path, name)
        fmt = checkpoint_format(
            json.loads((tmp_path / name / "config.json").read_text())["quantization_config"]
        )
        _, layers = group_wise.read_checkpoint(str(tmp_path / name), fmt, torch.float32)
        assert layers.keys() == expected.keys()
        for module, layer in layers.items():
            assert torch.equal(layer.dequantize(), expected[module]), (name, module)
            assert layer.consecutive == (name != ACT_ORDER), (name, module)
            four_bit = layer.four_bit()
            if four_bit is not None:
                assert torch.equal(group_wise.dequantize(four_bit), expected[module]), (name, module)
            assert (four_bit is not None) == (SERVED[name][2] in (FOUR_BIT, SYMMETRIC)), (name, module)
            if four_bit is not None:
                assert (four_bit.symmetric() is not None) == CHECKPOINTS[name]["symmetric"], (name, module)


@pytest.mark.parametrize("name", ["gptq-v1-symmetric", ACT_ORDER, "gptq-8-bit-v1-symmetric"])
def test_a_served_gptq_checkpoint_gives_the_greedy_tokens_of_its_dequantized_model(name, tmp_path):
    """Symmetric GPTQ of 4 and 8 bits (its blocks are exactly the library's weights), and act order (8-bit
    blocks of them): the engine, rows joining and leaving, against `generate` on the exact mode's model of
    the same checkpoint."""
    write(tmp_path, name)
    served = load(tmp_path / name, tmp_path).model
    exact = load(tmp_path / name, tmp_path, quantize="none").model
    # int8 activations may tip one near-tie; a wrong unpacking tips them all
    assert greedy_agreements(served, exact, seed=7) >= 4


@pytest.mark.parametrize(
    ("quantization_config", "reason"),
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ checkpoint of 3 bits: only 4- and 8"),
        ({"quant_method": "awq", "bits": 8, "group_size": 128}, "AWQ checkpoint of 8 bits: only 4-bit"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "groups of 48 inputs"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "packed as 'gemv'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'"),
    ],
)
def test_checkpoints_the_engine_does_not_read_are_refused_with_the_reason(
    quantization_config, reason, tmp_path
):
    write(tmp_path, "gptq-v1-symmetric")
    config = json.loads((tmp_path / "gptq-v1-symmetric" / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (tmp_path / "gptq-v1-symmetric" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedCheckpoint, match=reason):
        load(tmp_path / "gptq-v1-symmetric", tmp_path)


def test_a_g_idx_naming_groups_the_layer_has_not_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    write(tmp_path, ACT_ORDER)
    path = tmp_path / ACT_ORDER / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.mlp.down_proj.g_idx"][5] = 1000
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(
        UnsupportedCheckpoint,
        match=r"down_proj: g_idx of shape \(128,\) and groups 0..1000 for 128 inputs in 4 groups",
    ):
        load(tmp_path / ACT_ORDER, tmp_path)


def test_a_checkpoint_whose_library_is_not_installed_is_refused_naming_it(tmp_path):
    """transformers loads HQQ checkpoints through their own library, which this server does not install:
    a clear refusal at start, not a traceback. (compressed-tensors and bitsandbytes checkpoints are read
    without theirs: tests/backend/test_compressed_tensors.py, tests/backend/test_bitsandbytes.py.)"""
    directory = write_tiny_causal_lm(tmp_path / "quantized", "llama")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "hqq", "quant_config": {"nbits": 4, "group_size": 64}}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="through a library that is not installed here: .*hqq"):
        load(directory, tmp_path)


def each_layer_on(device: str, name: str, tmp_path) -> None:
    """Load `name` in the default mode on `device` and hold each quantized layer's product to the library's
    weights': 4-bit groups of consecutive inputs as Int4Linear (PyTorch's int4 kernel on CUDA), the others
    as their dequantized weights where the device has no blocks."""
    from backend.messages import BackendConfig
    from backend.model.loader import load_model

    expected = write(tmp_path, name)
    config = BackendConfig(
        model=str(tmp_path / name), device=device, rows=4, max_seq_len=128, cache_dir=str(tmp_path / "cache")
    )
    model = load_model(config).model
    x = torch.randn(3, 128, device=device, dtype=model.dtype)
    for module, weight in expected.items():
        layer = model.get_submodule(module)
        if not block_weights.available(torch.device(device)):
            kind = Int4Linear if SERVED[name][2] in (FOUR_BIT, SYMMETRIC) else torch.nn.Linear
            assert type(layer) is kind, module
        inputs = x[:, : weight.shape[1]].contiguous()
        reference = inputs.float() @ weight.to(device).T
        got = layer(inputs).float()
        assert (got - reference).abs().max() < 0.03 * reference.abs().max(), module


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device")
@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_each_layer_of_a_checkpoint_served_on_cuda_multiplies_by_the_librarys_weights(name, tmp_path):
    each_layer_on("cuda", name, tmp_path)
