"""Weight-only quantized layers, and a GGUF file's own 4-bit and 8-bit blocks, multiply as their floats do."""

import copy
import weakref

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from backend.messages import BackendConfig
from backend.model.loader import load_model
from backend.model.source import default_model_path
from backend.quant import block_weights, gguf_weights, quantized_linear
from backend.quant.blocks_embedding import BlocksEmbedding, serve_from_tied_head
from backend.quant.gguf_types import FourBitSuperBlocks, FourBitWeight, unpack_blocks, unpack_q8_0
from backend.quant.gguf_weights import BLOCKS_CACHE, read_gguf_blocks, serve_gguf_weights
from backend.quant.quantize import quantize_model
from backend.quant.quantized_linear import (
    DENSE_FROM_ROWS,
    GROUP_SIZE,
    QUANTIZERS,
    BlocksLinear,
    Int4Linear,
    Int8Linear,
    fuse_linears,
)
from tests.backend.gguf_files import q4_k_m, write_tiny_gguf
from tests.backend.k_quants import quantize
from tests.backend.models import load_on_cpu, tiny_model, write_gguf_linears

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def bf16_tolerance(reference: torch.Tensor) -> float:
    """What bf16 activations and outputs may cost: a few units in the last place of the largest output."""
    return 4 * 2**-8 * reference.abs().max().item()


@pytest.mark.parametrize("device", DEVICES)
def test_int4_layer_multiplies_by_q_minus_8_times_scale_plus_zero(device, weight_layout):
    generator = torch.Generator().manual_seed(0)
    out_features, in_features = 96, 4 * GROUP_SIZE
    q = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    scale = torch.rand(out_features, in_features // GROUP_SIZE, generator=generator) / 8
    zero = torch.randn(out_features, in_features // GROUP_SIZE, generator=generator) / 8
    bias = torch.randn(out_features, generator=generator)
    layer = Int4Linear(q.to(device), scale.to(device), zero.to(device), bias.to(device))
    weight = (q.float() - 8).reshape(out_features, -1, GROUP_SIZE) * scale[..., None] + zero[..., None]
    for rows in (5, DENSE_FROM_ROWS):  # the packed weights, then (on the CPU) the dense copy
        x = torch.randn(rows, in_features, generator=generator)
        expected = x @ weight.reshape(out_features, in_features).T + bias
        got = layer(x.to(device)).cpu()
        assert got.dtype == torch.float32 and got.shape == expected.shape
        assert (got - expected).abs().max() < bf16_tolerance(expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantizing_a_float_layer_keeps_its_products_close(mode, device, weight_layout):
    torch.manual_seed(1)
    linear = torch.nn.Linear(8 * GROUP_SIZE, 64).to(device)
    layer = {"int4": Int4Linear, "int8": Int8Linear}[mode].quantize(linear)
    for rows in (3, layer.dense_from_rows):
        x = torch.randn(rows, 8 * GROUP_SIZE, device=device)
        expected = linear(x)
        error = (layer(x) - expected).abs().max() / expected.abs().max()
        assert error < {"int4": 0.15, "int8": 0.02}[mode]  # 16 levels a group, 255 a channel
        assert error > 0  # it did quantize


def test_int8_layer_multiplies_by_q_times_its_channel_scale(weight_layout):
    torch.manual_seed(2)
    q = torch.randint(-127, 128, (48, 64), dtype=torch.int8)
    scale = torch.rand(48) / 100
    layer = Int8Linear(q, scale, None)
    for rows in (3, Int8Linear.dense_from_rows):
        x = torch.randn(rows, 64)
        expected = x @ (q.float() * scale[:, None]).T
        assert (layer(x) - expected).abs().max() < bf16_tolerance(expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_fused_layers_give_their_parts_outputs_side_by_side_and_share_their_weights(
    mode, device, weight_layout
):
    torch.manual_seed(3)
    quantize = {"int4": Int4Linear, "int8": Int8Linear}[mode].quantize
    parts = [quantize(torch.nn.Linear(4 * GROUP_SIZE, out).to(device)) for out in (64, 128, 32)]
    inputs = [torch.randn(rows, 4 * GROUP_SIZE, device=device) for rows in (2, DENSE_FROM_ROWS)]
    before = [[part(x) for part in parts] for x in inputs]  # packed weights, then (CPU) the dense copy
    fused = fuse_linears(parts)
    assert fused is not None and fused.out_features == 224
    for x, outputs in zip(inputs, before, strict=True):
        expected = torch.cat(outputs, dim=-1)
        assert (fused(x) - expected).abs().max() < bf16_tolerance(expected)
        for part, output in zip(parts, outputs, strict=True):  # the parts still work, on views
            assert torch.equal(part(x), output)
    weight_name = "blocks" if fused.blocks is not None else {"int4": "packed", "int8": "weight_int8"}[mode]
    assert (weight_name == "blocks") == (weight_layout == "blocks" and device == "cpu")
    fused_weight = getattr(fused, weight_name)
    for part in parts:  # the parts read slices of the fused weights: nothing is stored twice
        weight = getattr(part, weight_name)
        assert fused_weight.data_ptr() <= weight.data_ptr() < fused_weight.data_ptr() + fused_weight.nbytes


def test_float_layers_and_mixed_kinds_do_not_fuse():
    linears = [torch.nn.Linear(GROUP_SIZE, 16), torch.nn.Linear(GROUP_SIZE, 16)]
    assert fuse_linears(linears) is None
    assert fuse_linears([Int4Linear.quantize(linears[0]), Int8Linear.quantize(linears[1])]) is None


@pytest.mark.skipif(
    not block_weights.available(torch.device("cpu")), reason="5- and 6-bit layers are blocks only"
)
def test_5_and_6_bit_layers_fuse_with_their_own_kind_alone():
    """A Q4_K_M file's value projection is Q6_K in some layers, beside Q4_K q and k: 6-bit blocks joined to
    5-bit ones (one class, BlocksLinear) would be read with one size of block, so they stay apart; two
    6-bit layers fuse and give their outputs side by side."""
    generator = torch.Generator().manual_seed(4)

    def six_bit(out_features: int) -> BlocksLinear:
        q = torch.randint(0, 64, (out_features, 4 * GROUP_SIZE), generator=generator, dtype=torch.uint8)
        sub_scale = torch.randint(-128, 128, (out_features, 8), generator=generator).to(torch.int8)
        return BlocksLinear.int6(
            q, sub_scale, torch.rand(out_features, 4, generator=generator).half().float() / 99
        )

    def five_bit(out_features: int) -> BlocksLinear:
        q = torch.randint(0, 32, (out_features, 4 * GROUP_SIZE), generator=generator, dtype=torch.uint8)
        scale, minimum = (torch.rand(out_features, 4, generator=generator).half().float() for _ in range(2))
        return BlocksLinear.int5(q, scale / 30, -minimum)

    assert fuse_linears([six_bit(32), five_bit(16)]) is None
    parts = [six_bit(32), six_bit(48)]
    fused = fuse_linears(parts)
    assert fused is not None and fused.bits == 6 and fused.out_features == 80
    x = torch.randn(3, 4 * GROUP_SIZE, generator=generator)
    assert torch.equal(fused(x), torch.cat([part(x) for part in parts], dim=-1))


def test_int4_layers_fuse_only_where_the_cpu_packing_blocks_line_up(weight_layout):
    def int4(out_features):
        return Int4Linear.quantize(torch.nn.Linear(GROUP_SIZE, out_features))

    assert fuse_linears([int4(64), int4(16)]) is not None
    # 32 rows end inside PyTorch's 64-row tile; blocks hold 16 channels
    assert (fuse_linears([int4(32), int4(32)]) is not None) == (weight_layout == "blocks")


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_gguf_four_bit_blocks_unpack_to_the_weights_gguf_dequantizes(kind):
    """Blocks quantized by the gguf package itself, read back by our unpacking, equal its dequantization."""
    weights = np.random.default_rng(3).standard_normal((32, 5 * GROUP_SIZE)).astype(np.float32)
    blocks = quants.quantize(weights, kind)
    expected = quants.dequantize(blocks, kind)
    unpacked = unpack_blocks(blocks, kind)
    rebuilt = (unpacked.q.float() - 8).reshape(32, -1, GROUP_SIZE) * unpacked.scale[..., None]
    rebuilt = rebuilt + unpacked.zero[..., None]
    np.testing.assert_allclose(rebuilt.reshape(32, -1).numpy(), expected, rtol=1e-6, atol=1e-6)
    layer = Int4Linear(unpacked.q, unpacked.scale, unpacked.zero, None)
    x = torch.randn(4, 5 * GROUP_SIZE)
    reference = x @ torch.from_numpy(expected).T
    assert (layer(x) - reference).abs().max() < bf16_tolerance(reference)


def test_the_default_models_q4_1_layers_are_served_from_their_own_blocks(default_model):
    """Every projection, q and k included (llama.cpp permutes their rows), against transformers' own
    dequantization of the same file; the Q8_0 head tied to the embedding from its own blocks, and where the
    CPU multiplies blocks (and the head's copy does not pay at a step's rows) the embedding's rows from
    them too."""
    model = copy.deepcopy(default_model.model)  # the exact mode's, served here
    embedding = model.get_input_embeddings().weight.detach().clone()
    dequantized = {
        name: module.weight.detach().clone()
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and ("layers.3." in name or "layers.29." in name)
    }
    assert len(dequantized) == 2 * 7
    assert serve_gguf_weights(model, default_model_path()) == 30 * 7 + 1
    x = torch.randn(3, 1536)
    for name, weight in dequantized.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, Int4Linear), name
        reference = x[:, : weight.shape[1]] @ weight.T
        assert (layer(x[:, : weight.shape[1]]) - reference).abs().max() < bf16_tolerance(reference), name
    # Its own blocks (or, without blocks, int8 per channel) for few rows, the embedding's floats for many
    assert isinstance(model.lm_head, Int8Linear)
    assert model.lm_head.dense.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    if not block_weights.available(torch.device("cpu")):
        assert not serve_from_tied_head(model, 1)
        return
    # the file's blocks exactly (no requantization)
    assert torch.equal(block_weights.dequantize(model.lm_head.blocks, embedding.shape[1]), embedding)
    assert not serve_from_tied_head(model, model.lm_head.dense_from_rows)  # the copy pays at a step's rows
    # a step of fewer rows than it pays from (not timed here): the embedding's floats go, its rows made
    # from the same blocks, and the head multiplies every number of rows by them
    assert serve_from_tied_head(model, model.lm_head.dense_from_rows - 1)
    assert model.lm_head.dense is None and not model.lm_head.has_many_rows_path
    served_embedding = model.get_input_embeddings()
    assert isinstance(served_embedding, BlocksEmbedding) and served_embedding.blocks is model.lm_head.blocks
    ids = torch.tensor([[0, 17, 49151, 17], [5, 6, 7, 8]])
    assert torch.equal(served_embedding(ids), embedding[ids])


def test_q8_0_blocks_unpack_to_the_weights_gguf_dequantizes():
    weights = np.random.default_rng(4).standard_normal((16, 3 * GROUP_SIZE)).astype(np.float32)
    blocks = quants.quantize(weights, GGMLQuantizationType.Q8_0)
    unpacked = unpack_q8_0(blocks)
    rebuilt = unpacked.q.float().reshape(16, -1, GROUP_SIZE) * unpacked.scale[..., None]
    expected = quants.dequantize(blocks, GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(rebuilt.reshape(16, -1).numpy(), expected)


def assert_same_blocks(found, expected) -> None:
    assert (found.types, found.head_type) == (expected.types, expected.head_type)
    assert found.layers.keys() == expected.layers.keys()
    pairs = [(found.layers[name], weight) for name, weight in expected.layers.items()]
    assert (found.head is None) == (expected.head is None)
    if expected.head is not None:
        pairs.append((found.head, expected.head))
    for weight, reference in pairs:
        assert type(weight) is type(reference) and weight.q.dtype == reference.q.dtype
        assert torch.equal(weight.q, reference.q) and torch.equal(weight.scale, reference.scale)
        if isinstance(reference, FourBitWeight):
            assert torch.equal(weight.zero, reference.zero)


def test_the_gguf_files_blocks_are_read_once_then_from_their_copy(
    default_model, tmp_path, monkeypatch, caplog
):
    """The 4-bit layers and the Q8_0 head as the file holds them (the head's blocks give exactly
    transformers' dequantized embedding); later starts take them from the copy beside the converted
    model, without parsing the file; a damaged copy is read past and replaced."""
    model = default_model.model
    from_file = read_gguf_blocks(default_model_path(), model, tmp_path)
    assert (tmp_path / BLOCKS_CACHE).is_file()
    assert len(from_file.layers) == 30 * 7 and from_file.head_type == "Q8_0"
    assert all(isinstance(weight, FourBitWeight) for weight in from_file.layers.values())
    head = from_file.head
    weight = (head.q.float().reshape(head.q.shape[0], -1, GROUP_SIZE) * head.scale[..., None]).flatten(1)
    assert head.q.dtype == torch.int8 and torch.equal(weight, model.get_input_embeddings().weight)

    def no_parsing(*args):
        raise AssertionError("the GGUF file was parsed again")

    with monkeypatch.context() as patched:
        patched.setattr(gguf_weights.gguf, "GGUFReader", no_parsing)
        assert_same_blocks(read_gguf_blocks(default_model_path(), model, tmp_path), from_file)

    # Damaged as a new file: `from_file`, read back from the copy, maps the one it replaces (as a running
    # server does while a later start replaces it).
    (tmp_path / "damaged").write_bytes(b"not safetensors")
    (tmp_path / "damaged").replace(tmp_path / BLOCKS_CACHE)
    assert_same_blocks(read_gguf_blocks(default_model_path(), model, tmp_path), from_file)
    assert "unreadable" in caplog.text
    with monkeypatch.context() as patched:  # replaced by a good copy
        patched.setattr(gguf_weights.gguf, "GGUFReader", no_parsing)
        assert_same_blocks(read_gguf_blocks(default_model_path(), model, tmp_path), from_file)


def test_the_blocks_are_held_packed_and_unpacked_a_layer_at_a_time_as_they_are_served(tmp_path, monkeypatch):
    """The file's blocks are held as the copy keeps them (4-bit values two a byte), each layer's unpacked
    only as it is served and let go before the next: all unpacked at once, a byte a value, they were
    0.9 GiB of a 1B Q4_K_M file's load beside the layers made of them."""
    model = tiny_model("llama", hidden_size=256, intermediate_size=512, head_dim=64)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", model, default_model_path(), q4_k_m)
    floats = load_on_cpu(path, tmp_path).model  # the exact mode: no layer served from blocks yet
    blocks = read_gguf_blocks(path, floats, tmp_path)
    four_bit = [name for name, kind in blocks.layers.kinds.items() if kind is FourBitSuperBlocks]
    assert four_bit and all(
        blocks.layers.fields[name]["q"].shape[1] * 2 == blocks.layers[name].q.shape[1] for name in four_bit
    )
    unpacked, served_layer = [], gguf_weights.served_layer

    def serving(weight, linear, kind):
        held = {id(buffer) for buffer in floats.buffers()}  # what a served layer keeps as it is
        assert all(ref() is None or id(ref()) in held for ref in unpacked), (
            "an earlier layer's values are held"
        )
        unpacked.append(weakref.ref(weight.q))
        return served_layer(weight, linear, kind)

    monkeypatch.setattr(gguf_weights, "served_layer", serving)
    assert serve_gguf_weights(floats, path, tmp_path) == 2 * 7 + 1
    assert len(unpacked) == 2 * 7 + 1  # the head's too


def dequantized_like_transformers(model: torch.nn.Module, kinds: dict) -> dict[str, torch.Tensor]:
    """Set the tiny model's linear layers to their GGUF types' dequantized weights, as transformers loads
    a GGUF file; returns them by module name."""
    weights = {}
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear and module is not model.get_output_embeddings():
            kind = next(kind for part, kind in kinds.items() if part in name)
            dequantized = quants.dequantize(quantize(module.weight.detach().numpy(), kind), kind)
            module.weight.data = torch.from_numpy(dequantized.copy())
            weights[name] = module.weight.detach().clone()
    return weights


def test_a_gguf_files_q8_0_and_q4_0_layers_are_served_from_their_blocks(tmp_path, monkeypatch, weight_layout):
    """A Llama file mixing Q8_0 attention and Q4_0 MLP layers, q and k permuted as llama.cpp stores them:
    each layer is the file's weights exactly where the CPU multiplies blocks (Q8_0 with its scale a block
    of 32, Q4_0 in symmetric blocks: d alone, 18 bytes a channel's 32 as in the file); for PyTorch's
    kernels, Q4_0 is its int4 layer and Q8_0 layers, which its int8 kernel takes with a scale a channel,
    are quantized again. Read once: a second start takes both kinds from the copy."""
    kinds = {"self_attn": GGMLQuantizationType.Q8_0, "mlp": GGMLQuantizationType.Q4_0}
    path = write_gguf_linears(tmp_path / "tiny.gguf", tiny_model("llama"), kinds)
    for start in range(2):
        model = tiny_model("llama")
        expected = dequantized_like_transformers(model, kinds)
        x = torch.randn(3, 128)
        references = {name: x[:, : weight.shape[1]] @ weight.T for name, weight in expected.items()}
        with monkeypatch.context() as patched:
            if start == 1:
                patched.setattr(gguf_weights.gguf, "GGUFReader", lambda path: pytest.fail("parsed again"))
            assert serve_gguf_weights(model, path, tmp_path) == 2 * 7  # the head is not in the file
        for name, weight in expected.items():
            layer = model.get_submodule(name)
            four_bit = BlocksLinear if weight_layout == "blocks" else Int4Linear
            assert type(layer) is (Int8Linear if "self_attn" in name else four_bit), name
            if weight_layout == "blocks":
                assert torch.equal(block_weights.dequantize(layer.blocks, weight.shape[1]), weight), name
                if "mlp" in name:
                    assert layer.layout() == "4-bit symmetric blocks"
                    assert layer.blocks.shape[1] == weight.shape[1] // 32 * 18, name
            elif type(layer) is Int8Linear:  # a scale a channel: close, not equal
                served = layer.weight_int8.float() * layer.scales.float()[:, None]
                assert not torch.equal(served, weight)
                assert (served - weight).abs().max() < 0.01 * weight.abs().max(), name
            got = layer(x[:, : weight.shape[1]])
            assert (got - references[name]).abs().max() < bf16_tolerance(references[name]), name


# How each type of a file's layers is served where the CPU multiplies blocks: exactly, its bits in super-
# blocks or in blocks of 32.
SERVED_AS = {
    GGMLQuantizationType.Q4_K: "4-bit super-blocks",
    GGMLQuantizationType.Q5_K: "5-bit super-blocks",
    GGMLQuantizationType.Q5_0: "5-bit symmetric blocks",
    GGMLQuantizationType.Q6_K: "6-bit super-blocks",
    GGMLQuantizationType.Q3_K: "4-bit symmetric super-blocks",  # q + 8 and its scales as Q6_K's
    GGMLQuantizationType.Q2_K: "2-bit super-blocks",
    GGMLQuantizationType.IQ4_XS: "4-bit table super-blocks",
    GGMLQuantizationType.IQ4_NL: "4-bit table blocks",
    GGMLQuantizationType.MXFP4: "4-bit MXFP4 table blocks",
}


@pytest.mark.parametrize(
    "attention, mlp",
    [
        (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K),
        (GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_K),
        (GGMLQuantizationType.IQ4_XS, GGMLQuantizationType.IQ4_NL),
        (GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K),
        (GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K),
        (GGMLQuantizationType.MXFP4, GGMLQuantizationType.IQ4_NL),
    ],
    ids=["q4_k_m", "q5_k_m", "iq4_xs", "q3_k_m", "q2_k", "mxfp4"],
)
def test_a_k_quant_files_layers_are_served_from_their_blocks(
    attention, mlp, weight_layout, tmp_path, monkeypatch, caplog
):
    """Llama files mixing layer types as llama-quantize's mixes do: Q4_K beside Q6_K (Q4_K_M's), Q5_0 (its
    type where a row is no whole K-quant block) beside Q5_K (Q5_K_M's), IQ4_XS beside IQ4_NL (IQ4_XS's
    own fallback), Q3_K beside Q4_K (Q3_K_M's), Q2_K beside Q3_K (Q2_K's), MXFP4 beside IQ4_NL (two tables'
    blocks of the same bytes). Each layer is blocks of exactly the file's weights, the K-quants' in
    super-blocks (Q3_K's symmetric, as Q6_K's), the IQ4 types' and MXFP4's as their tables'; without the
    CPU's blocks, Q4_K is PyTorch's int4 layer and the others int8 per channel. A second start takes them
    from the copy, and the log names each."""
    kinds = {"self_attn": attention, "mlp": mlp}
    # K-quants' rows are whole blocks of 256 (o_proj's too: 4 heads of 64)
    wide = dict(hidden_size=256, intermediate_size=512, head_dim=64)
    path = write_gguf_linears(tmp_path / "tiny.gguf", tiny_model("llama", **wide), kinds)
    blocks = weight_layout == "blocks"
    for start in range(2):
        model = tiny_model("llama", **wide)
        expected = dequantized_like_transformers(model, kinds)
        with monkeypatch.context() as patched, caplog.at_level("INFO"):
            if start == 1:
                patched.setattr(gguf_weights.gguf, "GGUFReader", lambda path: pytest.fail("parsed again"))
            assert serve_gguf_weights(model, path, tmp_path) == 2 * 7
        for kind, count in ((attention, 8), (mlp, 6)):
            four_bit = kind == GGMLQuantizationType.Q4_K
            how = SERVED_AS[kind] if blocks else "4-bit" if four_bit else "int8 per channel"
            assert f"{kind.name} as {how} x{count}" in caplog.text
        x = torch.randn(3, 512)
        for name, weight in expected.items():
            kind = attention if "self_attn" in name else mlp
            layer = model.get_submodule(name)
            if blocks:
                assert type(layer) is BlocksLinear and layer.layout() == SERVED_AS[kind], name
                table = layer.blocks_layout.table
                assert torch.equal(block_weights.dequantize(layer.blocks, weight.shape[1], table), weight), (
                    name
                )
            else:
                assert type(layer) is (Int4Linear if kind == GGMLQuantizationType.Q4_K else Int8Linear), name
            reference = x[:, : weight.shape[1]] @ weight.T
            got = layer(x[:, : weight.shape[1]])
            assert (got - reference).abs().max() < 2 * bf16_tolerance(reference), name
        caplog.clear()


def test_an_int8_layer_with_block_scales_needs_blocks(weight_layout):
    q = torch.randint(-127, 128, (16, 2 * GROUP_SIZE), dtype=torch.int8)
    scale = (torch.rand(16, 2) / 100).half().float()  # as a block stores it
    if weight_layout == "blocks":
        layer = Int8Linear(q, scale, None)
        expected = (q.float().reshape(16, 2, GROUP_SIZE) * scale[..., None]).reshape(16, -1)
        assert torch.equal(block_weights.dequantize(layer.blocks, 2 * GROUP_SIZE), expected)
        assert torch.equal(layer.dense, expected.to(layer.dense.dtype))
    else:
        with pytest.raises(ValueError, match="one scale per output channel"):
            Int8Linear(q, scale, None)


def test_the_default_mode_serves_the_gguf_weights_and_the_exact_mode_does_not(default_model):
    served = load_model(BackendConfig(rows=1, max_seq_len=64)).model
    exact = default_model.model
    assert sum(isinstance(m, Int4Linear) for m in served.modules()) == 30 * 7
    assert isinstance(served.lm_head, Int8Linear)
    assert not any(isinstance(m, Int4Linear) for m in exact.modules())
    assert exact.dtype == torch.float32


def test_int8_quantizes_a_tall_layer_a_few_channels_at_a_time_to_what_it_would_at_once(monkeypatch):
    """Channels quantized QUANTIZE_ROWS at a time (all at once, a 1B's head took a GiB more for a moment):
    the same int8 weights, scales and dense copy, bit for bit, as the whole layer's at once."""
    monkeypatch.setattr(quantized_linear, "QUANTIZE_ROWS", 48)  # not a divisor of 160: a short last chunk
    linear = torch.nn.Linear(2 * GROUP_SIZE, 160, bias=False).to(torch.bfloat16)
    weight = linear.weight.detach().float()
    scale = (weight.abs().amax(dim=-1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = (weight / scale[:, None]).round().clamp(-127, 127)
    at_once = Int8Linear(q, scale, None, (q * scale[:, None]).to(torch.bfloat16))
    chunked = dict(Int8Linear.quantize(linear).named_buffers())
    assert chunked.keys() == dict(at_once.named_buffers()).keys()
    for name, buffer in at_once.named_buffers():  # the blocks (or int8 weights and scales), the dense copy
        assert torch.equal(chunked[name], buffer), name


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantize_model_replaces_every_projection_but_the_head(mode):
    model = tiny_model("qwen2")  # q, k and v have biases
    x = torch.randint(2, 500, (1, 12))
    expected = model(x).logits
    assert quantize_model(model, mode) == 2 * 7 + 1
    kind = {"int4": Int4Linear, "int8": Int8Linear}[mode]
    assert sum(type(m) is kind for m in model.modules()) == 2 * 7 + (mode == "int8")
    assert type(model.lm_head) is Int8Linear
    got = model(x).logits
    assert (got - expected).abs().max() < 0.25 * expected.abs().max()


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantize_model_lets_go_of_each_float_layer_before_it_quantizes_the_next(mode, monkeypatch):
    """Each float layer's weights are freed once its quantized layer is in, not when every layer is: the
    float weights held to the end were a 1B's load at 6.3 GiB where it serves 2.4 (resources.py)."""
    model = tiny_model("llama")
    quantize, replaced = QUANTIZERS[mode], []

    def quantize_seeing_the_last_ones_freed(linear: torch.nn.Linear):
        # Freed as their last reference goes, with no garbage collection: the load would not run one
        assert all(weight() is None for weight in replaced), "an earlier float layer is still held"
        replaced.append(weakref.ref(linear.weight))
        return quantize(linear)

    monkeypatch.setitem(QUANTIZERS, mode, quantize_seeing_the_last_ones_freed)
    assert quantize_model(model, mode) == 2 * 7 + 1
    assert len(replaced) == 2 * 7


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", [Int4Linear, Int8Linear])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layers_few_rows_function_multiplies_as_the_layer_does(device, kind, dtype, weight_layout):
    """What a decode step calls instead of the module (decoder_runner.DecodeLayer): the same result,
    bit for bit and in the same dtype, for few rows (the kernel) and many (the dense copy), the layer
    alone and fused with another."""
    torch.manual_seed(0)
    layers = [kind.quantize(torch.nn.Linear(2 * GROUP_SIZE, 64, bias=False).to(device)) for _ in range(2)]
    fused = fuse_linears(layers)
    for layer in [*layers, fused]:
        matmul = layer.few_rows_matmul(dtype)
        for rows in (1, 3, DENSE_FROM_ROWS, 2 * DENSE_FROM_ROWS):
            x = torch.randn(rows, 2 * GROUP_SIZE, device=device, dtype=dtype)
            expected = layer(x)
            got = matmul(x)
            assert got.dtype == dtype and torch.equal(got, expected), (layer, rows)
    with_bias = Int4Linear.quantize(torch.nn.Linear(GROUP_SIZE, 64).to(device))
    assert with_bias.few_rows_matmul(dtype) is with_bias  # the kernels add no bias: the module does
