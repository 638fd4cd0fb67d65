"""GPTQ and AWQ checkpoints (tests/backend/group_wise_files.py writes them to each format's packing) load
and serve: the model is built from exactly the weights the libraries' own dequantization gives, and each
quantized layer multiplies by the checkpoint's values and groups, repacked into the engine's 4-bit
blocks (act-order layers, whose groups are not consecutive inputs, by 8-bit blocks converted once).
Checkpoints the engine cannot serve are refused at start, with the reason."""

import json
import random

import pytest
import torch

from backend.engine.engine import Engine
from backend.messages import SamplingParams, Submit
from backend.model.architectures import UnsupportedModel
from backend.quant import block_weights, group_wise
from backend.quant.group_wise import UnsupportedCheckpoint, checkpoint_format
from backend.quant.quantized_linear import Int4Linear, Int8Linear
from tests.backend.group_wise_files import write_group_wise_checkpoint
from tests.backend.models import (
    TINY_VOCAB,
    MarkerTokenizer,
    drive,
    load_on_cpu,
    reference_greedy,
    text_of,
    write_tiny_causal_lm,
)

CHECKPOINTS = {  # name: (method, group size, symmetric, packing)
    "gptq-v1-symmetric": ("gptq", 32, True, "gptq"),
    "gptq-v1-asymmetric": ("gptq", 64, False, "gptq"),
    "gptq-v2-asymmetric": ("gptq", 32, False, "gptq_v2"),
    "awq": ("awq", 64, False, "gemm"),
}
ACT_ORDER = "gptq-v1-act-order"  # desc_act, groups of 32, asymmetric


def load(directory, tmp_path, quantize: str = "auto"):
    return load_on_cpu(directory, tmp_path, quantize)


def write(tmp_path, name: str):
    if name == ACT_ORDER:
        every_layer = lambda module: True  # noqa: E731
        return write_group_wise_checkpoint(tmp_path / name, "gptq", 32, False, "gptq", act_order=every_layer)
    method, group_size, symmetric, packing = CHECKPOINTS[name]
    return write_group_wise_checkpoint(tmp_path / name, method, group_size, symmetric, packing)


@pytest.mark.parametrize("name", [*sorted(CHECKPOINTS), ACT_ORDER])
def test_the_exact_mode_builds_the_model_from_the_weights_the_library_dequantizes(name, tmp_path):
    expected = write(tmp_path, name)
    model = load(tmp_path / name, tmp_path, quantize="none").model
    assert len(expected) == 2 * 7
    for module, weight in expected.items():
        assert torch.equal(model.get_submodule(module).weight, weight), module


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_each_layer_is_served_from_the_checkpoints_values_in_the_engines_blocks(name, tmp_path, caplog):
    """The 4-bit layers' weights are the library's to 0 error in float32 (q, scale and zero unpacked); in
    the CPU's blocks, which keep z * scale in fp16, to 0 for symmetric checkpoints (z = 8) and within 2^-11
    of z * scale otherwise."""
    expected = write(tmp_path, name)
    method, group_size, symmetric, _ = CHECKPOINTS[name]
    with caplog.at_level("INFO"):
        model = load(tmp_path / name, tmp_path).model
    assert f"{method.upper()} checkpoint: 14 linear layers repacked" in caplog.text
    x = torch.randn(3, 128)
    for module, weight in expected.items():
        layer = model.get_submodule(module)
        assert isinstance(layer, Int4Linear), module
        if layer.blocks is not None:
            served = block_weights.dequantize(layer.blocks, weight.shape[1])
            if symmetric:
                assert torch.equal(served, weight), module
            else:
                # z * scale is at most a group's range, at most twice its largest weight
                assert (served - weight).abs().max() <= 2 * weight.abs().max() * 2**-11, module
        reference = x[:, : weight.shape[1]] @ weight.T
        got = layer(x[:, : weight.shape[1]])
        assert (got - reference).abs().max() < 0.02 * reference.abs().max(), module


def test_unpacking_gives_the_librarys_weights_exactly_in_float32(tmp_path):
    """Below the blocks: group_wise's own q, scale and zero, for every checkpoint kind."""
    for name in [*CHECKPOINTS, ACT_ORDER]:
        expected = write(tmp_path, name)
        fmt = checkpoint_format(
            json.loads((tmp_path / name / "config.json").read_text())["quantization_config"]
        )
        _, layers = group_wise.read_checkpoint(str(tmp_path / name), fmt, torch.float32)
        assert layers.keys() == expected.keys()
        for module, weight in layers.items():
            assert torch.equal(group_wise.dequantize(weight), expected[module]), (name, module)


def test_act_order_layers_are_served_by_8_bit_blocks_of_the_librarys_weights(tmp_path, caplog):
    """Their groups' inputs are scattered (g_idx), so no 4-bit block of 32 has one scale: each layer is
    converted once from the library's dequantized weights, within half a step of 1/127 of each block's
    largest weight, and said so in the log."""
    expected = write(tmp_path, ACT_ORDER)
    g_idx = group_wise.read_checkpoint(
        str(tmp_path / ACT_ORDER),
        checkpoint_format(
            json.loads((tmp_path / ACT_ORDER / "config.json").read_text())["quantization_config"]
        ),
        torch.float32,
    )[1]["model.layers.0.mlp.down_proj"].g_idx
    assert not torch.equal(g_idx, torch.arange(len(g_idx)) // 32)  # the groups really are scattered
    with caplog.at_level("INFO"):
        model = load(tmp_path / ACT_ORDER, tmp_path).model
    if not block_weights.available(torch.device("cpu")):
        assert "0 linear layers repacked" in caplog.text and "14 served as dequantized floats" in caplog.text
        return
    assert (
        "GPTQ checkpoint: 0 linear layers repacked into 4-bit blocks of 32 inputs (groups of 32), 14 in act "
        "order (groups permuted by g_idx) converted once to 8-bit blocks of 32" in caplog.text
    )
    for module, weight in expected.items():
        layer = model.get_submodule(module)
        assert isinstance(layer, Int8Linear), module
        served = block_weights.dequantize(layer.blocks, weight.shape[1])
        largest = weight.reshape(weight.shape[0], -1, 32).abs().amax(dim=-1, keepdim=True)
        error = (served - weight).reshape(largest.shape[0], -1, 32).abs()
        assert (error <= largest / 127 * 0.51).all(), module


@pytest.mark.parametrize("name", ["gptq-v1-symmetric", ACT_ORDER])
def test_a_served_gptq_checkpoint_gives_the_greedy_tokens_of_its_dequantized_model(name, tmp_path):
    """Symmetric GPTQ (its blocks are exactly the library's weights), and act order (8-bit blocks of
    them): the engine, rows joining and leaving, against `generate` on the exact mode's model of the
    same checkpoint."""
    write(tmp_path, name)
    served = load(tmp_path / name, tmp_path).model
    exact = load(tmp_path / name, tmp_path, quantize="none").model
    rng = random.Random(7)
    prompts = [[rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(1, 40))] for _ in range(5)]
    engine = Engine(served, MarkerTokenizer(), rows=4, max_seq_len=128)
    greedy = SamplingParams(temperature=0, max_tokens=10)
    pieces = drive(engine, [(i, Submit(f"r{i}", tuple(p), greedy)) for i, p in enumerate(prompts)])
    agree = sum(
        MarkerTokenizer.ids(text_of(pieces[f"r{i}"])) == reference_greedy(exact, p, 10, engine.eos_ids)
        for i, p in enumerate(prompts)
    )
    assert agree >= 4  # int8 activations may tip one near-tie; a wrong unpacking tips them all


@pytest.mark.parametrize(
    ("quantization_config", "reason"),
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "GPTQ checkpoint of 8 bits"),
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
    """transformers loads bitsandbytes checkpoints through their own library, which this server does not
    install: a clear refusal at start, not a traceback. (compressed-tensors checkpoints are read without
    theirs: tests/backend/test_compressed_tensors.py.)"""
    directory = write_tiny_causal_lm(tmp_path / "quantized", "llama")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
    }
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedModel, match="through a library that is not installed here: .*bitsandbytes"
    ):
        load(directory, tmp_path)
