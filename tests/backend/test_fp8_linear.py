"""FP8 products (fp8_linear.py): float8 e4m3 weights a channel times e4m3 activations a row by
`torch._scaled_mm`, which PyTorch runs on a CPU too, so the layer and the loader's choice of it are tested
here as a GPU with FP8 arithmetic would run them; the CUDA test at the end runs them on one."""

import contextlib
import json
import random
from unittest import mock

import pytest
import torch

from backend.engine.engine import Engine
from backend.messages import BackendConfig, SamplingParams, Submit
from backend.model.loader import load_model
from backend.model.lora import load_adapters
from backend.quant.fp8_linear import (
    FP8,
    FP8_MAX,
    Fp8BlockLinear,
    Fp8Layer,
    Fp8Linear,
    blockwise_products_work,
    e4m3_channels,
    fp8_products,
)
from backend.quant.quantize import quantize_model
from backend.quant.quantized_linear import resident_bytes
from scripts.perplexity import as_on_an_fp8_gpu
from tests.backend.compressed_tensors_files import write_compressed_checkpoint
from tests.backend.fp8_files import write_fp8_checkpoint
from tests.backend.lora_files import write_lora_adapter
from tests.backend.models import (
    MarkerTokenizer,
    drive,
    load_on_cpu,
    text_of,
    tiny_model,
    write_tiny_causal_lm,
)

WIDE = dict(hidden_size=256, intermediate_size=384, head_dim=64)  # several 128 x 128 blocks a layer


def e4m3_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] as the layer quantizes its inputs: e4m3 with each row's largest value at 448."""
    scale = x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX
    return (x.float() / scale).to(FP8).float() * scale


def test_e4m3_channels_keeps_each_channel_within_e4m3s_rounding_of_its_weights():
    weight = torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None]  # channels of very unequal sizes
    layer = Fp8Linear(*e4m3_channels(weight), None)
    largest = weight.abs().amax(dim=-1)
    assert torch.equal(layer.scale, largest / FP8_MAX)
    assert torch.equal(layer.weight.float().abs().amax(dim=-1), torch.full((48,), FP8_MAX))
    # e4m3 keeps 3 bits after the leading one: within 1/16 of each weight, normals and subnormals alike
    error = (layer.dequantized() - weight).abs()
    assert (error <= weight.abs() / 16 + layer.scale[:, None] * 2**-10).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_multiplies_its_inputs_in_e4m3_a_row_by_its_e4m3_weights(dtype):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    layer = Fp8Linear(*e4m3_channels(weight), bias).to(dtype)
    x = (torch.randn(2, 5, 64) * torch.logspace(-2, 2, 5)[:, None]).to(dtype)  # rows of unequal sizes
    got = layer(x)
    assert got.shape == (2, 5, 96) and got.dtype == dtype
    expected = e4m3_rows(x.reshape(10, 64)) @ layer.dequantized().T + bias.to(dtype).float()
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    assert (got.reshape(10, 96).float() - expected).abs().max() <= tolerance * expected.abs().max()
    # and near the float layer's products: each operand within e4m3's 1/16
    reference = x.reshape(10, 64).float() @ weight.T + bias
    assert (
        (got.reshape(10, 96).float() - reference)
        .abs()
        .amax(dim=-1)
        .le(0.1 * reference.abs().amax(dim=-1))
        .all()
    )


def test_a_row_of_zeros_gives_the_bias_not_nans():
    layer = Fp8Linear(*e4m3_channels(torch.randn(32, 48)), torch.randn(32))
    x = torch.zeros(3, 48)
    x[1] = torch.randn(48)
    out = layer(x)
    assert torch.equal(out[0], layer.bias) and torch.equal(out[2], layer.bias) and out.isfinite().all()


def test_the_models_cast_to_its_dtype_keeps_the_weights_and_their_scales():
    """Module.to(dtype) casts every floating tensor, float8 included: transformers' own FP8 layers lost
    their scales so. This layer keeps its weights and scales as their bits."""
    layer = Fp8Linear(*e4m3_channels(torch.randn(32, 48)), torch.randn(32))
    weight, scale = layer.weight.clone(), layer.scale.clone()
    model = torch.nn.Sequential(layer).to(torch.bfloat16)
    assert model[0].weight.dtype == FP8 and torch.equal(model[0].weight.float(), weight.float())
    assert model[0].scale.dtype == torch.float32 and torch.equal(model[0].scale, scale)
    assert model[0].bias.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("device", "capability", "dtype", "expected"),
    [
        ("cuda", (9, 0), torch.bfloat16, True),  # Hopper
        ("cuda", (8, 9), torch.bfloat16, True),  # Ada
        ("cuda", (8, 0), torch.bfloat16, False),  # Ampere: no FP8 tensor cores
        ("cuda", (9, 0), torch.float16, False),  # a scale a row gives bfloat16 alone
        ("cpu", (9, 0), torch.bfloat16, False),
    ],
)
def test_fp8_products_where_the_gpu_multiplies_fp8(device, capability, dtype, expected):
    with mock.patch("torch.cuda.get_device_capability", return_value=capability):
        assert fp8_products(torch.device(device), dtype) is expected


@contextlib.contextmanager
def blockwise_products_fail(reason: str):
    """The start's check of the GPU's blockwise product failing, for both layouts of weights' scales."""
    with (
        mock.patch("backend.quant.fp8_linear.blockwise_products_work", return_value=reason),
        mock.patch("backend.quant.fp8_weights.blockwise_products_work", return_value=reason),
        mock.patch("backend.quant.checkpoint_layers.blockwise_products_work", return_value=reason),
    ):
        yield


def load_as_on_an_fp8_gpu(directory, tmp_path, quantize: str = "auto"):
    """The model loaded as on a GPU with FP8 arithmetic, in bfloat16: the choice of FP8 products made
    true on this CPU, whose `_scaled_mm` then runs them."""
    with as_on_an_fp8_gpu():
        return load_on_cpu(directory, tmp_path, quantize, dtype="bfloat16").model


def greedy_shortfalls(model, exact, seed: int) -> list[float]:
    """Through the engine (4 rows, joining and leaving), greedy: at each token, how far its logit under
    `exact` falls short of `exact`'s greedy token's."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 511) for _ in range(rng.randrange(1, 40))] for _ in range(5)]
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128)
    greedy = SamplingParams(temperature=0, max_tokens=10)
    pieces = drive(engine, [(i, Submit(f"r{i}", tuple(p), greedy)) for i, p in enumerate(prompts)])
    shortfalls = []
    for i, prompt in enumerate(prompts):
        tokens = MarkerTokenizer.ids(text_of(pieces[f"r{i}"]))
        assert len(tokens) == 10
        with torch.no_grad():
            logits = exact(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        shortfalls += (logits.amax(dim=-1) - logits[torch.arange(10), tokens]).tolist()
    return shortfalls


def exact_model(directory, tmp_path):
    return load_on_cpu(directory, tmp_path).model


def test_an_fp8_checkpoint_on_a_gpu_with_fp8_is_served_in_its_own_blocks(tmp_path, caplog):
    """transformers' `fp8` checkpoint (a scale for every 128 x 128): each layer the file's own e4m3 weights
    and scales, exactly; the engine serves the model, its greedy tokens the exact model's or near ties."""
    expected = write_fp8_checkpoint(tmp_path / "tiny-FP8", **WIDE)
    with caplog.at_level("INFO"):
        model = load_as_on_an_fp8_gpu(tmp_path / "tiny-FP8", tmp_path)
    assert "FP8 checkpoint: 14 linear layers on cpu served as the file's 128 x 128 blocks" in caplog.text
    for module, weight in expected.items():
        layer = model.get_submodule(module)
        assert isinstance(layer, Fp8BlockLinear) and torch.equal(layer.dequantized(), weight), module
    assert type(model.lm_head) is torch.nn.Linear
    scales = sum(w.shape[0] // 128 * 4 * 4 for w in expected.values())  # inner blocks padded to 4
    assert resident_bytes(model)["quantized"] == sum(w.numel() for w in expected.values()) + scales
    shortfalls = greedy_shortfalls(model, exact_model(tmp_path / "tiny-FP8", tmp_path), seed=3)
    # e4m3 activations move these random models' logits by a few hundredths (each layer's arithmetic is
    # held exactly below): the chosen token is the exact model's or a near tie; a wrong layer misses by
    # whole units
    assert sum(s == 0 for s in shortfalls) >= 40 and max(shortfalls) <= 0.15, shortfalls


def test_where_the_gpus_blockwise_product_fails_its_check_the_layers_go_a_channel(tmp_path, caplog):
    """Each quantized once from its float32 weights (not bfloat16's) to e4m3 a channel, the reason
    logged."""
    expected = write_fp8_checkpoint(tmp_path / "tiny-FP8", **WIDE)
    reason = "RuntimeError: no blockwise product here"
    with caplog.at_level("INFO"), blockwise_products_fail(reason):
        model = load_as_on_an_fp8_gpu(tmp_path / "tiny-FP8", tmp_path)
    assert (
        "served as e4m3 a channel, activations e4m3 a row, converted once from the blocks' weights x14"
        in (caplog.text)
    )
    assert f"(not in blocks: {reason})" in caplog.text
    for module, weight in expected.items():
        layer = model.get_submodule(module)
        assert type(layer) is Fp8Linear, module
        assert torch.equal(layer.weight, Fp8Linear(*e4m3_channels(weight), None).weight), module
    shortfalls = greedy_shortfalls(model, exact_model(tmp_path / "tiny-FP8", tmp_path), seed=3)
    assert sum(s == 0 for s in shortfalls) >= 40 and max(shortfalls) <= 0.15, shortfalls


def test_the_block_layer_multiplies_inputs_in_e4m3_a_128_of_a_row_by_its_blocks():
    torch.manual_seed(1)
    weight = (torch.randn(256, 384) * 50).clamp(-448, 448).to(FP8)
    scale = torch.rand(2, 3) * 0.01 + 0.001
    layer = Fp8BlockLinear(weight, scale, torch.randn(256)).to(torch.bfloat16)
    spread = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(layer.dequantized(), weight.float() * spread) and layer.scale.dtype == torch.float32
    x = torch.randn(5, 384) * torch.tensor([1.0, 100.0, 0.01]).repeat_interleave(128)  # unequal groups
    got = layer(x.to(torch.bfloat16).reshape(1, 5, 384))
    assert got.shape == (1, 5, 256)
    groups = x.to(torch.bfloat16).float().reshape(5, 3, 128)
    group_scale = groups.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    inputs = ((groups / group_scale).to(FP8).float() * group_scale).reshape(5, 384)
    expected = inputs @ layer.dequantized().T + layer.bias.float()
    assert (got[0].float() - expected).abs().max() <= 2**-7 * expected.abs().max()
    with pytest.raises(ValueError, match="scales of 128 inputs"):
        Fp8BlockLinear(weight[:200], scale, None)


def test_a_channels_scale_for_every_128_inputs_multiplies_as_the_channel_layer_with_inputs_in_groups():
    torch.manual_seed(2)
    values, scale = e4m3_channels(torch.randn(48, 256))
    layer = Fp8BlockLinear.of_channels(values, scale, None)
    assert layer.rows_a_scale == 1 and torch.equal(
        layer.dequantized(), Fp8Linear(values, scale, None).dequantized()
    )
    x = torch.randn(3, 256) * torch.tensor([0.01, 10.0]).repeat_interleave(128)
    expected = e4m3_groups(x) @ layer.dequantized().T
    assert (layer(x).float() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_the_start_checks_the_gpus_blockwise_product_against_its_emulation():
    blockwise_products_work.cache_clear()
    assert blockwise_products_work(torch.device("cpu")) is None  # off CUDA the emulation is the product
    assert blockwise_products_work(torch.device("cpu"), rows_a_scale=1) is None
    blockwise_products_work.cache_clear()
    wrong = lambda self, x8, x_scale, dtype: self.emulated(x8, x_scale).to(dtype) * 1.05  # noqa: E731
    with mock.patch.object(Fp8BlockLinear, "product", wrong):
        assert "off the emulation's" in blockwise_products_work(torch.device("cpu"))
    blockwise_products_work.cache_clear()

    def failing(self, x8, x_scale, dtype):
        raise RuntimeError("Invalid scaling configuration.\nmore")

    with mock.patch.object(Fp8BlockLinear, "product", failing):
        assert blockwise_products_work(torch.device("cpu")) == "RuntimeError: Invalid scaling configuration."
    blockwise_products_work.cache_clear()


def e4m3_groups(x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] as the block layer quantizes its inputs: e4m3 with each 128 of a row's largest at 448."""
    return e4m3_rows(x.reshape(-1, 128)).reshape(x.shape)


@pytest.mark.parametrize(
    ("name", "served"),
    [
        # tiny_model's: q, k, v, o, gate and up take 64 inputs, down 128 (a 128 of a row)
        ("fp8-dynamic", "e4m3 a channel, activations e4m3 a row x12"),
        ("fp8-tensor", "e4m3 a channel, activations e4m3 a 128 of a row x2"),
        ("fp8-block", "128 x 128 blocks, activations e4m3 a 128 of a row x14"),  # (a wider model)
    ],
)
def test_a_compressed_tensors_fp8_checkpoint_multiplies_by_its_own_values(name, served, tmp_path, caplog):
    """FP8-dynamic (a scale a channel), a scale a tensor and FP8_BLOCK (a 128 x 128): the checkpoint's
    e4m3 values and scales as they are, so the layer's weights are the library's dequantized ones
    exactly; its inputs e4m3 a 128 of a row where it takes whole 128s, else a row."""
    expected = write_compressed_checkpoint(tmp_path / name, name)
    with caplog.at_level("INFO"):
        model = load_as_on_an_fp8_gpu(tmp_path / name, tmp_path)
    assert f"FP8 products of the checkpoint's values, {served}" in caplog.text
    assert "activations quantized to e4m3 as they come" in caplog.text
    x = torch.randn(3, 384, dtype=torch.bfloat16)
    for module, weight in expected.items():
        layer = model.get_submodule(module)
        assert isinstance(layer, Fp8Layer) and torch.equal(layer.dequantized(), weight), module
        assert isinstance(layer, Fp8BlockLinear) is (weight.shape[1] % 128 == 0), module
        inputs = x[:, : weight.shape[1]]
        reference = (e4m3_groups if isinstance(layer, Fp8BlockLinear) else e4m3_rows)(inputs) @ weight.T
        got = layer(inputs).float()
        assert (got - reference).abs().max() <= 2**-7 * reference.abs().max(), module


def test_a_compressed_tensors_fp8_block_checkpoint_goes_a_channel_where_the_blockwise_product_fails(
    tmp_path, caplog
):
    expected = write_compressed_checkpoint(tmp_path / "fp8-block", "fp8-block")
    with caplog.at_level("INFO"), blockwise_products_fail("no"):
        model = load_as_on_an_fp8_gpu(tmp_path / "fp8-block", tmp_path)
    assert (
        "FP8 products converted once from the blocks' weights to e4m3 a channel, activations e4m3 a row"
        in (caplog.text)
    )
    for module, weight in expected.items():
        layer = model.get_submodule(module)
        assert type(layer) is Fp8Linear, module
        assert torch.equal(layer.weight, Fp8Linear(*e4m3_channels(weight), None).weight), module


def test_rows_of_a_lora_adapter_over_fp8_products_decode_beside_the_base_models(tmp_path):
    """An adapter's changes added to FP8 products' outputs: its rows near PEFT's model of the file's
    weights (greedy, near ties as above), the base model's rows as with no adapter loaded."""
    write_fp8_checkpoint(tmp_path / "tiny-FP8", **WIDE)
    exact = exact_model(tmp_path / "tiny-FP8", tmp_path)
    peft_model = write_lora_adapter(tmp_path / "adapter", exact, ["q_proj", "v_proj", "down_proj"], scale=1.0)
    plain = load_as_on_an_fp8_gpu(tmp_path / "tiny-FP8", tmp_path)
    served = load_as_on_an_fp8_gpu(tmp_path / "tiny-FP8", tmp_path)
    adapters = load_adapters(served, [("a", str(tmp_path / "adapter"))])
    assert isinstance(served.model.layers[0].self_attn.q_proj.base, Fp8BlockLinear)
    rng = random.Random(9)
    prompts = [[rng.randrange(2, 511) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=10)

    def tokens(model, names, **options):
        engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, **options)
        submits = [
            Submit(f"r{i}", tuple(p), greedy, adapter=n)
            for i, (p, n) in enumerate(zip(prompts, names, strict=True))
        ]
        pieces = drive(engine, list(enumerate(submits)))
        return [MarkerTokenizer.ids(text_of(pieces[f"r{i}"])) for i in range(len(prompts))]

    names = ["a", ""] * 3
    mixed = tokens(served, names, adapters=adapters)
    alone = tokens(plain, [""] * 6)
    assert [mixed[i] for i in (1, 3, 5)] == [alone[i] for i in (1, 3, 5)]
    for i in (0, 2, 4):
        with torch.no_grad():
            logits = peft_model(torch.tensor([prompts[i] + mixed[i]])).logits[0, len(prompts[i]) - 1 : -1]
        short = logits.amax(dim=-1) - logits[torch.arange(10), mixed[i]]
        assert short.max() <= 0.15, (i, short)
    assert [mixed[i] for i in (0, 2, 4)] != [alone[i] for i in (0, 2, 4)]  # the adapter changes them


def test_quantize_fp8_serves_a_float_models_layers_as_fp8_products(tmp_path, caplog):
    """`--quantize fp8` (vLLM's `--quantization fp8`): any float model's projections quantized at load to
    e4m3 a channel, the head left in floats; the engine's greedy tokens the float model's or near ties."""
    directory = write_tiny_causal_lm(tmp_path / "tiny", "llama", tiny_model("llama", **WIDE))
    with caplog.at_level("INFO"):
        model = load_as_on_an_fp8_gpu(directory, tmp_path, quantize="fp8")
    assert "quantized 14 linear layers to FP8 products" in caplog.text
    exact = tiny_model("llama", **WIDE)
    for name, module in exact.named_modules():
        if type(module) is torch.nn.Linear and name != "lm_head":
            served = model.get_submodule(name)
            # every one takes whole 128s of inputs: a channel's scale for every 128 of them
            assert isinstance(served, Fp8BlockLinear) and served.rows_a_scale == 1, name
            # from the bfloat16 model's weights, as loaded
            values, scale = e4m3_channels(module.weight.bfloat16())
            assert torch.equal(served.weight, values) and torch.equal(served.scale[:, 0], scale), name
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
    shortfalls = greedy_shortfalls(model, exact, seed=4)
    assert sum(s == 0 for s in shortfalls) >= 40 and max(shortfalls) <= 0.15, shortfalls


def test_the_engine_benchmark_counts_fp8_layers_bytes_in_a_steps_weight_read():
    from scripts.bench_engine import step_bytes

    model = tiny_model("llama", **WIDE)
    before, _ = step_bytes(model, 1, 1, torch.float32)
    weights = [m.weight for n, m in model.named_modules() if type(m) is torch.nn.Linear and n != "lm_head"]
    assert quantize_model(model, "fp8") == len(weights) == 14
    after, _ = step_bytes(model, 1, 1, torch.float32)
    scales = sum(4 * w.shape[0] * (w.shape[1] // 128) for w in weights)  # a channel's for every 128 inputs
    assert after == before - sum(w.numel() * 4 for w in weights) + sum(w.numel() for w in weights) + scales


def test_quantize_fp8_is_refused_where_the_device_has_no_fp8_arithmetic(tmp_path):
    directory = write_tiny_causal_lm(tmp_path / "tiny", "llama")
    config = BackendConfig(model=str(directory), quantize="fp8", device="cpu", rows=4, max_seq_len=128)
    with pytest.raises(ValueError, match=r"--quantize fp8 needs a GPU with FP8 arithmetic .* not cpu in"):
        load_model(config)


def test_a_checkpoint_whose_config_keeps_layers_as_floats_serves_those_as_floats(tmp_path):
    write_fp8_checkpoint(tmp_path / "tiny-FP8", **WIDE)
    config_path = tmp_path / "tiny-FP8" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["model.layers.1.mlp"]
    config_path.write_text(json.dumps(config))
    model = load_as_on_an_fp8_gpu(tmp_path / "tiny-FP8", tmp_path)
    assert isinstance(model.model.layers[1].self_attn.q_proj, Fp8BlockLinear)
    assert type(model.model.layers[1].mlp.down_proj) is torch.nn.Linear


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="a Hopper GPU"
)
def test_cuda_blockwise_fp8_products_give_their_emulations_on_hopper():
    """cuBLAS's blockwise FP8 products (BlockWise1x128 by BlockWise128x128, and by BlockWise1x128) run on
    Hopper: the start's checks pass there, else the layers go by `_scaled_mm` a row (the reasons are this
    assertion's)."""
    blockwise_products_work.cache_clear()
    verdicts = {rows: blockwise_products_work(torch.device("cuda"), rows) for rows in (128, 1)}
    assert verdicts == {128: None, 1: None}  # else the reasons, by the weights' scales' rows


@pytest.mark.skipif(
    not torch.cuda.is_available() or not fp8_products(torch.device("cuda"), torch.bfloat16),
    reason="a CUDA GPU with FP8 arithmetic",
)
def test_cuda_fp8_products_through_decode_graphs(tmp_path):
    """On a GPU with FP8: the checkpoint's layers are FP8 products there, and the engine's greedy tokens
    with decode graphs are those without them (the layer's activations quantized inside the graph)."""
    write_fp8_checkpoint(tmp_path / "tiny-FP8", **WIDE)
    tokens = {}
    for graphs in (True, False):
        config = BackendConfig(
            model=str(tmp_path / "tiny-FP8"),
            device="cuda",
            rows=4,
            max_seq_len=128,
            cache_dir=str(tmp_path),
            cuda_graphs=graphs,
        )
        model = load_model(config).model
        assert isinstance(model.model.layers[0].self_attn.q_proj, Fp8Layer)
        engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=128, cuda_graphs=graphs)
        greedy = SamplingParams(temperature=0, max_tokens=10)
        rng = random.Random(5)
        prompts = [[rng.randrange(2, 511) for _ in range(rng.randrange(1, 40))] for _ in range(5)]
        pieces = drive(engine, [(i, Submit(f"r{i}", tuple(p), greedy)) for i, p in enumerate(prompts)])
        tokens[graphs] = [MarkerTokenizer.ids(text_of(pieces[f"r{i}"])) for i in range(5)]
    assert tokens[True] == tokens[False]
