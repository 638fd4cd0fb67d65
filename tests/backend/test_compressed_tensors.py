"""compressed-tensors checkpoints (tests/backend/compressed_tensors_files.py writes them with the library
itself) load and serve without the library: the model is built from exactly the weights the library's
own dequantization gives, 4-bit layers multiply by the checkpoint's values and groups in the engine's
4-bit blocks, 8-bit integer ones by its values in 8-bit blocks, FP8 ones by 8-bit blocks converted once.
Checkpoints the engine cannot serve are refused at start, naming the format."""

import json
import random
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.engine.engine import Engine
from backend.messages import SamplingParams, Submit
from backend.quant import block_weights, compressed_checkpoint
from backend.quant.group_wise import UnsupportedCheckpoint
from backend.quant.quantized_linear import BlocksLinear, Int4Linear, Int8Linear
from tests.backend.compressed_tensors_files import FORMATS, SCHEMES, write_compressed_checkpoint
from tests.backend.models import MarkerTokenizer, drive, load_on_cpu, reference_greedy, text_of

INT4 = [name for name in SCHEMES if name.startswith("w4")]


def load(directory, tmp_path, quantize: str = "auto"):
    """`load_on_cpu`, with the compressed-tensors library made unimportable while the server loads."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "compressed_tensors", None)  # `import compressed_tensors` fails
        return load_on_cpu(directory, tmp_path, quantize)


def write(tmp_path, name: str):
    expected = write_compressed_checkpoint(tmp_path / name, name)
    config = json.loads((tmp_path / name / "config.json").read_text())["quantization_config"]
    assert config["format"] == FORMATS[name]  # the library chose the format each scheme is named for
    return expected


def set_quantization_config(directory, change) -> None:
    config = json.loads((directory / "config.json").read_text())
    change(config["quantization_config"])
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_the_exact_mode_builds_the_model_from_the_weights_the_library_dequantizes(name, tmp_path):
    expected = write(tmp_path, name)
    model = load(tmp_path / name, tmp_path, quantize="none").model
    assert len(expected) == 2 * 7
    for module, weight in expected.items():
        assert torch.equal(model.get_submodule(module).weight, weight), module
    assert type(model.lm_head) is torch.nn.Linear  # ignored: stored and served as floats


def test_unpacking_gives_the_librarys_weights_exactly_in_float32(tmp_path):
    """Below the blocks: each layer as stored, and the 4-bit ones in Int4Linear's terms, for every scheme."""
    from backend.quant.group_wise import dequantize

    for name in SCHEMES:
        expected = write(tmp_path, name)
        config = json.loads((tmp_path / name / "config.json").read_text())["quantization_config"]
        fmt = compressed_checkpoint.checkpoint_format(config)
        _, layers = compressed_checkpoint.read_checkpoint(str(tmp_path / name), fmt, torch.float32)
        assert layers.keys() == expected.keys()
        for module, layer in layers.items():
            assert torch.equal(layer.dequantize(), expected[module]), (name, module)
            four_bit = layer.four_bit()
            assert (four_bit is not None) == (name in INT4)
            if four_bit is not None:
                assert torch.equal(dequantize(four_bit), expected[module]), (name, module)


FOUR_BIT, SYMMETRIC, EIGHT_BIT = (
    "4-bit blocks of the checkpoint's groups x14",
    "4-bit symmetric blocks of the checkpoint's groups x14",  # d alone, as GGUF's Q4_0
    "8-bit blocks of the checkpoint's values x14",
)
CONVERTED = "8-bit blocks converted once from the dequantized weights x14"
SERVED = {  # name: (layer type, the log's scheme and how its layers were served)
    "w4a16-group-symmetric": (BlocksLinear, "int4, groups of 32, symmetric", SYMMETRIC),
    "w4a16-group-asymmetric": (Int4Linear, "int4, groups of 64, asymmetric", FOUR_BIT),
    "w4a16-channel-asymmetric": (Int4Linear, "int4, a scale a channel, asymmetric", FOUR_BIT),
    "w8a16-channel": (Int8Linear, "int8, a scale a channel, symmetric", EIGHT_BIT),
    "w8a8-channel": (Int8Linear, "int8, a scale a channel, symmetric", EIGHT_BIT),
    "fp8-dynamic": (Int8Linear, "FP8, a scale a channel, symmetric", CONVERTED),
    "fp8-tensor": (Int8Linear, "FP8, a scale a layer, symmetric", CONVERTED),
    "fp8-block": (Int8Linear, "FP8, 128 x 128 blocks, symmetric", CONVERTED),
}


@pytest.mark.skipif(not block_weights.available(torch.device("cpu")), reason="needs the CPU's blocks")
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_each_layer_is_served_from_the_checkpoints_values_in_the_engines_blocks(name, tmp_path, caplog):
    """In the CPU's blocks, which keep scales in fp16: the library's weights exactly for symmetric 4-bit
    and 8-bit integer checkpoints (bfloat16 scales, which fp16 holds), within 2^-11 of z * scale for
    asymmetric ones; FP8 within half a step of 1/127 of each block's largest weight."""
    expected = write(tmp_path, name)
    with caplog.at_level("INFO"):
        model = load(tmp_path / name, tmp_path).model
    kind, scheme, served = SERVED[name]
    assert f"compressed-tensors checkpoint ({scheme}): 14 linear layers served as {served}," in caplog.text
    if SCHEMES[name][1] is not None:
        assert "activations stay floats (weight-only; the checkpoint's" in caplog.text
    x = torch.randn(3, 384)  # (the widest layers of the schemes above)
    for module, weight in expected.items():
        layer = model.get_submodule(module)
        assert isinstance(layer, kind), module
        blocks = block_weights.dequantize(layer.blocks, weight.shape[1])
        if name.startswith("fp8"):
            served_blocks = blocks.reshape(weight.shape[0], -1, 32)
            largest = weight.reshape(served_blocks.shape).abs().amax(dim=-1, keepdim=True)
            assert (
                (served_blocks - weight.reshape(served_blocks.shape)).abs() <= largest / 254 * 1.001
            ).all()
        elif "asymmetric" in name:
            assert (blocks - weight).abs().max() <= 2 * weight.abs().max() * 2**-11, module
        else:
            assert torch.equal(blocks, weight), module
        reference = x[:, : weight.shape[1]] @ weight.T
        got = layer(x[:, : weight.shape[1]])
        assert (got - reference).abs().max() < 0.02 * reference.abs().max(), module
    assert type(model.lm_head) is torch.nn.Linear


def greedy_tokens(model, prompts: list[list[int]]) -> list[list[int]]:
    """What the engine gives each prompt, greedy, rows joining and leaving."""
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128)
    greedy = SamplingParams(temperature=0, max_tokens=10)
    pieces = drive(engine, [(i, Submit(f"r{i}", tuple(p), greedy)) for i, p in enumerate(prompts)])
    return [MarkerTokenizer.ids(text_of(pieces[f"r{i}"])) for i in range(len(prompts))]


@pytest.mark.parametrize("name", ["w4a16-group-symmetric", "w8a8-channel"])
def test_a_served_checkpoint_gives_the_greedy_tokens_of_its_dequantized_model(name, tmp_path):
    """The exact mode's model of the checkpoint (the library's weights, above) through the engine gives
    `generate`'s tokens on it. The default mode's, in blocks that round activations to int8 (logits within
    about 0.003 of the exact model's here), picks at every step the exact model's greedy token or one within
    0.01 of it (these random models' near-ties, some 0.02 apart): a wrong unpacking misses by tenths."""
    write(tmp_path, name)
    served = load(tmp_path / name, tmp_path).model
    exact = load(tmp_path / name, tmp_path, quantize="none").model
    rng = random.Random(7)
    prompts = [[rng.randrange(2, 511) for _ in range(rng.randrange(1, 40))] for _ in range(5)]
    eos = {exact.config.eos_token_id}
    assert greedy_tokens(exact, prompts) == [reference_greedy(exact, p, 10, eos) for p in prompts]
    for prompt, tokens in zip(prompts, greedy_tokens(served, prompts), strict=True):
        assert len(tokens) == 10
        with torch.no_grad():
            logits = exact(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        short = logits.amax(dim=-1) - logits[torch.arange(len(tokens)), tokens]
        assert short.max() <= 0.01, (prompt, tokens, short)


def sparse(config):
    config["format"] = "sparse-24-bitmask"
    config["config_groups"]["group_0"]["format"] = "sparse-24-bitmask"


def nvfp4(config):
    config["format"] = "nvfp4-pack-quantized"
    config["config_groups"]["group_0"].pop("format")
    config["config_groups"]["group_0"]["weights"].update(type="float", num_bits=4, group_size=16)


def weights(**changes):
    return lambda config: config["config_groups"]["group_0"]["weights"].update(changes)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (sparse, "stored sparse \\(sparse-24-bitmask\\)"),
        (lambda c: c.update(format="marlin-24"), "stored sparse \\(marlin-24\\)"),
        (nvfp4, "stored as 'nvfp4-pack-quantized' \\(group_0\\)"),
        (
            lambda c: c.update(sparsity_config={"format": "sparse-bitmask"}),
            "stored sparse \\(sparse-bitmask\\)",
        ),
        (lambda c: c.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), "quantizes the KV cache"),
        (lambda c: c.update(transform_config={"config_groups": {"u": {}}}), "with transforms"),
        (lambda c: c.update(quantization_status="frozen"), "saved 'frozen'"),
        (lambda c: c.update(config_groups={}), "no quantized groups"),
        (weights(num_bits=3), "of int 3-bit weights stored as 'pack-quantized'"),
        (weights(group_size=48), "int4 groups of 48 inputs"),
        (
            lambda c: c["config_groups"]["group_0"].update(output_activations={"num_bits": 8}),
            "quantizes layer outputs",
        ),
        (lambda c: c["config_groups"]["group_0"].update(targets=["Embedding"]), "class 'Embedding'"),
        (lambda c: c.update(ignore=["re:.*q_proj"]), "q_proj: stored quantized, but the config's targets"),
    ],
)
def test_checkpoints_the_engine_does_not_read_are_refused_naming_the_format(change, reason, tmp_path):
    write(tmp_path, "w4a16-group-symmetric")
    set_quantization_config(tmp_path / "w4a16-group-symmetric", change)
    with pytest.raises(UnsupportedCheckpoint, match=reason):
        load(tmp_path / "w4a16-group-symmetric", tmp_path)


def library_act_order_dequantize(
    values: torch.Tensor, scale: torch.Tensor, g_idx: torch.Tensor, group_size: int
) -> torch.Tensor:
    """compressed-tensors' dequantization of an actorder "group" layer, which the library wrote up to 0.19
    (the installed one can no longer): quantization/lifecycle/forward.py's `_process_quantization` sorts
    the inputs by g_idx, takes each `group_size` of them as a group with its scale, and sorts them back."""
    order = torch.argsort(g_idx)
    groups = values.float().index_select(-1, order).unflatten(-1, (-1, group_size))
    return (groups * scale.float().unsqueeze(-1)).flatten(-2).index_select(-1, torch.argsort(order))


def write_act_order_layer(tensors: dict, module: str, weight: torch.Tensor) -> torch.Tensor:
    """`module` stored in act order (int4 symmetric, groups of 32 of a random order's inputs, its
    weight_g_idx), packed by the library's pack_to_int32; the weights the library reads back from it."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out_features, in_features = weight.shape
    order = torch.randperm(in_features, generator=torch.Generator().manual_seed(in_features))
    g_idx = torch.empty(in_features, dtype=torch.int64)
    g_idx[order] = torch.arange(in_features) // 32
    largest = torch.zeros(out_features, in_features // 32).index_reduce_(
        1, g_idx, weight.abs(), "amax", include_self=True
    )
    scale = (largest / 7).clamp(min=1e-6).to(torch.bfloat16)
    values = torch.round(weight / scale.float()[:, g_idx]).clamp(-8, 7).to(torch.int8)
    tensors[f"{module}.weight_packed"] = pack_to_int32(values, 4)
    tensors[f"{module}.weight_scale"] = scale
    tensors[f"{module}.weight_g_idx"] = g_idx.to(torch.int32)
    return library_act_order_dequantize(values, scale, g_idx, 32)


def test_act_order_layers_are_read_as_the_library_does_and_served_by_8_bit_blocks(tmp_path, caplog):
    """actorder "group" stores each input's group (weight_g_idx): a block of 32 consecutive inputs spans
    several groups' scales, so the layer is converted once to 8-bit blocks of its dequantized weights."""
    expected = write(tmp_path, "w4a16-group-symmetric")
    path = tmp_path / "w4a16-group-symmetric" / "model.safetensors"
    tensors = load_file(path)
    in_features = 128
    tensors["model.layers.0.mlp.down_proj.weight_g_idx"] = torch.arange(in_features, dtype=torch.int32) // 32
    scattered = "model.layers.1.mlp.down_proj"
    expected[scattered] = write_act_order_layer(tensors, scattered, expected[scattered])
    save_file(tensors, path, metadata={"format": "pt"})

    exact = load(tmp_path / "w4a16-group-symmetric", tmp_path, quantize="none").model
    for module, weight in expected.items():
        assert torch.equal(exact.get_submodule(module).weight, weight), module
    with caplog.at_level("INFO"):
        served = load(tmp_path / "w4a16-group-symmetric", tmp_path).model
    if not block_weights.available(torch.device("cpu")):
        return
    consecutive = served.get_submodule("model.layers.0.mlp.down_proj")
    assert isinstance(consecutive, BlocksLinear) and consecutive.layout() == "4-bit symmetric blocks"
    layer = served.get_submodule(scattered)
    assert isinstance(layer, Int8Linear)
    assert (
        "4-bit symmetric blocks of the checkpoint's groups x13, 8-bit blocks converted once from the "
        "dequantized weights (act-order groups) x1" in caplog.text
    )
    weight = expected[scattered]
    error = (block_weights.dequantize(layer.blocks, in_features) - weight).reshape(-1, 32).abs()
    assert (error <= weight.reshape(-1, 32).abs().amax(dim=-1, keepdim=True) / 127 * 0.51).all()


def test_act_order_groups_of_unequal_sizes_are_refused(tmp_path):
    """The library takes each group_size inputs of the sorted order as a group: with groups of other sizes
    its scales would fall on other inputs than g_idx says, so such a layer is refused, not guessed."""
    write(tmp_path, "w4a16-group-symmetric")
    path = tmp_path / "w4a16-group-symmetric" / "model.safetensors"
    tensors = load_file(path)
    g_idx = torch.arange(128, dtype=torch.int32) // 32
    g_idx[0] = 1  # group 0 has 31 inputs, group 1 has 33
    tensors["model.layers.1.mlp.down_proj.weight_g_idx"] = g_idx
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(UnsupportedCheckpoint, match="layers.1.mlp.down_proj: act-order groups"):
        load(tmp_path / "w4a16-group-symmetric", tmp_path)
