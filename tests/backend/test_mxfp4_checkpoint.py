"""gpt-oss's MXFP4 checkpoints (tests/backend/mxfp4_files.py writes them) load and serve: the exact mode
builds the model from exactly the weights transformers' own dequantization gives, and the default mode
serves each expert from blocks of exactly those weights, never holding the experts as floats."""

import json
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from backend.model.architectures import UnsupportedModel
from backend.model.resources import GIB, WHOLE_CONVERSION_BYTES, estimate_needs, skeleton
from backend.quant import block_weights, mxfp4_checkpoint
from backend.quant.group_wise import UnsupportedCheckpoint
from backend.quant.quantized_experts import QuantizedExperts, expert_weight
from backend.quant.quantized_linear import BlocksLinear, Int8Linear, resident_bytes
from tests.backend.models import load_on_cpu, write_tiny_causal_lm
from tests.backend.mxfp4_files import mxfp4_blocks, weighty_gpt_oss, write_mxfp4_checkpoint
from tests.conftest import ROOT

BLOCKS = block_weights.available(torch.device("cpu"))


def experts_of(model) -> list:
    return [layer.mlp.experts for layer in model.model.layers]


def test_transformers_reads_the_written_checkpoint_as_its_own(tmp_path):
    """The test checkpoint is one transformers itself loads (dequantizing, on a CPU), to the weights its
    dequantization gives: the format the tests below read is the one it reads."""
    expected = write_mxfp4_checkpoint(tmp_path / "mxfp4")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "mxfp4", dtype=torch.float32)
    for name, weights in expected.items():
        assert torch.equal(model.get_parameter(name).float(), weights), name


def test_the_exact_mode_builds_the_model_from_the_weights_transformers_dequantizes(tmp_path):
    expected = write_mxfp4_checkpoint(tmp_path / "mxfp4")
    model = load_on_cpu(tmp_path / "mxfp4", tmp_path, quantize="none").model
    assert len(expected) == 2 * 2  # two layers' gate_up and down
    for name, weights in expected.items():
        assert torch.equal(model.get_parameter(name), weights), name


@pytest.mark.skipif(not BLOCKS, reason="needs the CPU's blocks")
def test_each_expert_is_served_from_mxfp4_blocks_of_exactly_the_checkpoints_weights(
    tmp_path, caplog, monkeypatch
):
    """Each expert's gate_up and down: MXFP4's table blocks holding exactly transformers' dequantized
    weights, with the checkpoint's biases; the model built without the experts' floats (placeholders that
    hold no memory, let go of with transformers' module)."""
    expected = write_mxfp4_checkpoint(tmp_path / "mxfp4")
    exact = load_on_cpu(tmp_path / "mxfp4", tmp_path, quantize="none").model
    strides, serve = [], mxfp4_checkpoint.serve_mxfp4

    def serving(model, projections):
        strides.extend(p.stride() for n, p in model.named_parameters() if n.endswith("_proj"))
        return serve(model, projections)

    monkeypatch.setattr(mxfp4_checkpoint, "serve_mxfp4", serving)
    with caplog.at_level("INFO"):
        model = load_on_cpu(tmp_path / "mxfp4", tmp_path, quantize="auto").model
    assert strides == [(0, 0, 0)] * 4  # as the model was built: its experts' floats never held
    assert (
        "MXFP4 checkpoint: 16 experts' projections served (MXFP4 as 4-bit MXFP4 table blocks x16)"
        in caplog.text
    )
    for index, module in enumerate(experts_of(model)):
        assert isinstance(module, QuantizedExperts)
        reference = experts_of(exact)[index]
        for part in ("gate_up", "down"):
            weights = expected[f"model.layers.{index}.mlp.experts.{part}_proj"]
            for e, layer in enumerate(getattr(module, part)):
                assert type(layer) is BlocksLinear and layer.layout() == "4-bit MXFP4 table blocks"
                held = block_weights.dequantize(layer.blocks, layer.in_features, block_weights.Table.MXFP4)
                assert torch.equal(held, weights[e].T), (index, part, e)
                assert torch.equal(layer.bias, getattr(reference, f"{part}_proj_bias")[e]), (index, part, e)
                assert layer.dense is None
    exact_floats = resident_bytes(exact)["floats"]
    expert_floats = sum(t.nbytes for name, t in exact.named_parameters() if name.endswith("_proj"))
    assert resident_bytes(model)["floats"] <= exact_floats - expert_floats


def test_a_served_checkpoint_gives_the_logits_of_its_dequantized_model(tmp_path):
    """A decode step's rows and a prompt's tokens through the served model give the exact mode's logits,
    to the int8 rounding of activations: gpt-oss's routing, biases and clamped activation over the blocks'
    products. (Greedy tokens are no test here: a tiny random model's logits are near ties.)"""
    write_mxfp4_checkpoint(tmp_path / "mxfp4", weighty_gpt_oss())
    served = load_on_cpu(tmp_path / "mxfp4", tmp_path, quantize="auto").model
    exact = load_on_cpu(tmp_path / "mxfp4", tmp_path, quantize="none").model
    assert all(isinstance(module, QuantizedExperts) for module in experts_of(served)) == BLOCKS
    for ids in (torch.tensor([[5], [17], [200], [31]]), torch.tensor([[5, 17, 200, 31, 9, 44, 101, 7]])):
        with torch.inference_mode():
            expected, got = exact(ids).logits, served(ids).logits
        assert (got - expected).abs().max() < 0.05 * expected.abs().max()


@pytest.mark.skipif(not BLOCKS, reason="needs the CPU's blocks")
def test_an_expert_with_a_block_exponent_fp16_does_not_hold_is_served_from_8_bit_blocks(tmp_path, caplog):
    """An exponent under 104 (d = 2^(e - 128) under fp16's least, 2^-24) on a block of nonzero values:
    that expert's projection alone becomes 8-bit blocks close to its weights, and the log says so."""
    write_mxfp4_checkpoint(tmp_path / "mxfp4")
    path = tmp_path / "mxfp4" / "model.safetensors"
    tensors = load_file(path)
    scales = tensors["model.layers.1.mlp.experts.down_proj_scales"]
    blocks = tensors["model.layers.1.mlp.experts.down_proj_blocks"]
    assert (blocks[2, 0, 0] & 0x77).any()  # a block of nonzero values
    scales[2, 0, 0] = 100
    save_file(tensors, path, metadata={"format": "pt"})
    with caplog.at_level("INFO"):
        model = load_on_cpu(tmp_path / "mxfp4", tmp_path, quantize="auto").model
    assert "MXFP4 as 4-bit MXFP4 table blocks x15, MXFP4 requantized to 8-bit blocks x1" in caplog.text
    assert type(experts_of(model)[1].down[2]) is Int8Linear
    exact = load_on_cpu(tmp_path / "mxfp4", tmp_path, quantize="none").model
    weights = expert_weight(experts_of(exact)[1], "down", 2)
    served = block_weights.dequantize(experts_of(model)[1].down[2].blocks, weights.shape[1])
    assert (served - weights).abs().max() <= weights.abs().max() / 127


def test_a_projection_without_its_exponents_is_refused_naming_it(tmp_path):
    write_mxfp4_checkpoint(tmp_path / "mxfp4")
    path = tmp_path / "mxfp4" / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(UnsupportedCheckpoint, match=r"experts.down_proj has no .*down_proj_scales"):
        load_on_cpu(tmp_path / "mxfp4", tmp_path, quantize="auto")


def test_an_mxfp4_checkpoint_of_another_family_is_refused(tmp_path):
    """transformers' MXFP4 replaces gpt-oss's experts alone; a config saying MXFP4 elsewhere is refused at
    start, the model's type named."""
    directory = write_tiny_causal_lm(tmp_path / "llama", "llama")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="an MXFP4 checkpoint of a llama model: not served"):
        load_on_cpu(directory, tmp_path, quantize="auto")


def test_the_start_check_counts_the_experts_as_served_not_as_floats():
    """gpt-oss-20b's shape: its 19.1 B experts' parameters served at 18 bytes a 32 (10.7 GB) beside 1.8 B
    bfloat16 others, where counted as bfloat16 floats the check would ask for 42 GB and refuse a machine
    that serves it in 14."""
    config = GptOssConfig(
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        vocab_size=201088,
    )
    experts = mxfp4_checkpoint.expert_parameters(skeleton(config))
    assert experts == 24 * 32 * 3 * 2880 * 2880
    as_floats = estimate_needs(config, torch.bfloat16, 1, 1024)
    served = estimate_needs(config, torch.bfloat16, 1, 1024, experts_in_blocks=experts)
    assert as_floats.weights / GIB > 38
    assert 12.5 < served.weights / GIB < 14
    # Its GGUF file (model/gguf_gpt_oss.py): the experts among the file's blocks, the rest converted
    blocks = 12 * GIB
    gguf = dict(quantizing="gguf", lean_blocks=blocks, converting_whole=True)
    whole = estimate_needs(config, torch.bfloat16, 1, 1024, **gguf)
    lean = estimate_needs(config, torch.bfloat16, 1, 1024, **gguf, experts_in_blocks=experts)
    others = sum(p.numel() for p in skeleton(config).parameters()) - experts
    assert lean.weights == others * 2 + blocks and whole.weights > lean.weights + experts
    assert lean.conversion == int(others * WHOLE_CONVERSION_BYTES) < whole.conversion / 5


def test_the_benchmarks_random_gpt_oss_is_an_mxfp4_checkpoint_the_server_serves(tmp_path):
    """scripts/random_gpt_oss.py (the benchmarks' gpt-oss) quantizes as the gguf package's MXFP4 quantizer
    does, and writes a checkpoint transformers reads as its own and the server serves from its blocks."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import random_gpt_oss
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    weights = torch.randn(3, 48, 256) * 0.02
    blocks, scales = mxfp4_blocks(weights)
    ours = [random_gpt_oss.mxfp4(expert) for expert in weights]
    assert torch.equal(torch.stack([b for b, _ in ours]), blocks)
    assert torch.equal(torch.stack([s for _, s in ours]), scales)
    directory = random_gpt_oss.write_random_gpt_oss(tmp_path / "gpt-oss", layers=2, size="tiny")
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    served = load_on_cpu(directory, tmp_path, quantize="auto").model
    assert all(isinstance(module, QuantizedExperts) for module in experts_of(served)) == BLOCKS
    ids = torch.tensor([[5, 17, 200, 31]])
    with torch.inference_mode():
        expected, got = reference(ids).logits, served(ids).logits
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()


def test_experts_with_a_projection_stored_otherwise_keep_their_floats(tmp_path):
    """A layer whose down projection the checkpoint keeps in bfloat16 (as transformers' MXFP4 quantizer
    leaves a module it was told not to convert): that layer's experts stay transformers' module, built
    from the stored floats and the dequantized gate_up; the other layer's are served from blocks."""
    write_mxfp4_checkpoint(tmp_path / "mxfp4")
    path = tmp_path / "mxfp4" / "model.safetensors"
    tensors = load_file(path)
    prefix = "model.layers.0.mlp.experts.down_proj"
    blocks, scales = tensors.pop(f"{prefix}_blocks"), tensors.pop(f"{prefix}_scales")
    tensors[prefix] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})
    served = load_on_cpu(tmp_path / "mxfp4", tmp_path, quantize="auto").model
    exact = load_on_cpu(tmp_path / "mxfp4", tmp_path, quantize="none").model
    first, second = experts_of(served)
    assert not isinstance(first, QuantizedExperts)
    assert torch.equal(first.down_proj, experts_of(exact)[0].down_proj)
    assert torch.equal(first.gate_up_proj, experts_of(exact)[0].gate_up_proj)
    assert isinstance(second, QuantizedExperts) == BLOCKS
