"""Finding and loading models; checking resources before loading."""

import dataclasses
import logging
import re
from functools import partial
from pathlib import Path

import pytest
import torch

from backend.layers.row_cache import pick_cache_dtype
from backend.messages import BackendConfig
from backend.model import gguf_conversion
from backend.model.architectures import UnsupportedModel
from backend.model.decoder_runner import DecoderRunner
from backend.model.lean_load import blocks_bytes
from backend.model.loader import converted_dir, load_model
from backend.model.resources import (
    GIB,
    LEAN_LOADING_BYTES,
    LOADING_BYTES,
    WHOLE_CONVERSION_BYTES,
    Available,
    Needs,
    estimate_needs,
    shortfalls,
)
from backend.model.source import default_model_path, resolve_model
from backend.quant import block_weights, calibration
from backend.quant.gguf_weights import BLOCKS_CACHE
from backend.utils.hub import hub_token
from tests.backend.gguf_files import write_tiny_gguf
from tests.backend.models import (
    TINY_VOCAB,
    tiny_model,
    tiny_qwen_vl,
    write_gemma3n_multimodal,
    write_multimodal,
    write_tiny_causal_lm,
)


def test_the_default_model_is_converted_once_then_loaded_from_safetensors(tmp_path, monkeypatch):
    """The first start converts the file, parsing it once where transformers' config, tokenizer and
    weights would each parse it again (gguf_parsing.py); later starts load the converted copy, and the
    default mode parses the file once more, for its 4-bit blocks."""
    import gguf

    from backend.model import gguf_parsing

    parsed = []
    make_reader, before = gguf_parsing.PlainArrayReader, gguf.GGUFReader
    monkeypatch.setattr(
        gguf_parsing, "PlainArrayReader", lambda *args: parsed.append(args) or make_reader(*args)
    )
    first = load_model(BackendConfig(cache_dir=str(tmp_path), quantize="none"))
    assert len(parsed) == 1 and gguf.GGUFReader is before  # each part read the one parse; then as before
    source = resolve_model(None)
    converted = converted_dir(source, tmp_path)
    assert (converted / gguf_conversion.INDEX_FILE).is_file()  # written a tensor at a time, in shards
    assert first.tokenizer_path == str(converted)
    second = load_model(BackendConfig(cache_dir=str(tmp_path), quantize="none"))
    assert second.model.config.quantization_config is None  # not a GGUF load this time
    assert torch.equal(first.model.lm_head.weight, second.model.lm_head.weight)
    assert not (converted / BLOCKS_CACHE).exists()
    assert len(parsed) == 1
    load_model(BackendConfig(cache_dir=str(tmp_path)))  # the default mode: the file's 4-bit blocks
    assert (converted / BLOCKS_CACHE).is_file()  # read from the file once, kept for later starts
    assert len(parsed) == 2


def test_a_gemma_3n_checkpoint_loads_its_text_model_alone_and_is_refused_with_a_text_weight_missing(tmp_path):
    """Gemma 3n as published: the text model is loaded by its own class from the composite's names (its
    vision tower, which needs timm, is not built); a text weight missing is refused, not left random."""
    from safetensors.torch import load_file, save_file

    text = tiny_model("gemma3n_text")
    directory = write_gemma3n_multimodal(
        write_tiny_causal_lm(tmp_path / "gemma3n", "gemma3n_text", text), text
    )
    loaded = load_model(BackendConfig(model=str(directory), dtype="float32", quantize="none", max_seq_len=64))
    assert type(loaded.model).__name__ == "Gemma3nForCausalLM"
    assert torch.equal(
        loaded.model.model.layers[1].self_attn.q_proj.weight, text.model.layers[1].self_attn.q_proj.weight
    )
    weights = load_file(directory / "model.safetensors")
    del weights["model.language_model.layers.1.mlp.down_proj.weight"]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match=r"no weights for 1 .*model.layers.1.mlp.down_proj.weight"):
        load_model(BackendConfig(model=str(directory), dtype="float32", quantize="none", max_seq_len=64))


@pytest.mark.parametrize(
    "composite, text_family, transformers_4_names",
    [
        ("mistral3", "ministral3", False),
        ("mistral3", "mistral", True),
        ("gemma3", "gemma3_text", True),
        ("llama4", "llama4_text", True),
        ("lfm2_vl", "lfm2", False),
    ],
)
def test_a_multimodal_checkpoint_loads_its_text_model_alone(
    tmp_path, caplog, composite, text_family, transformers_4_names
):
    """Mistral 3 as published (Ministral 3 over its own text model; Mistral Small 3.1 over Mistral's, its
    files with transformers 4's names), which transformers builds as no causal LM, and Gemma 3 4B-27B and
    Llama 4 and LFM2-VL, whose composites would take transformers' modules (the decoder runner serves their
    text):
    the text model is loaded by its own class from the composite's names, every weight of it read, the
    towers left (the log says how many of their weights: the helper writes two)."""
    text = tiny_model(text_family)
    directory = write_multimodal(
        write_tiny_causal_lm(tmp_path / composite, text_family, text), text, composite, transformers_4_names
    )
    with caplog.at_level(logging.INFO, logger="backend.model.loader"):
        loaded = load_model(
            BackendConfig(model=str(directory), dtype="float32", quantize="none", max_seq_len=64)
        )
    assert f"{composite} checkpoint: its {text_family} text model alone is served, 2 weights" in caplog.text
    assert type(loaded.model) is type(text)
    assert all(
        torch.equal(weight, text.state_dict()[name]) for name, weight in loaded.model.state_dict().items()
    )
    assert DecoderRunner.supports(loaded.model.config)


def test_a_gemma_3_checkpoints_cache_is_the_dtype_its_text_models_runner_reads(tmp_path):
    """The KV cache's dtype is chosen before the model loads, by whether the runner would attend by the
    CPU's loop (bfloat16 there, float32 else: row_cache.pick_cache_dtype): asked of the text model that a
    Gemma 3 checkpoint serves, on the runner, not of the composite, which the runner does not take."""
    text = tiny_model("gemma3_text", head_dim=64)
    directory = write_multimodal(
        write_tiny_causal_lm(tmp_path / "gemma3", "gemma3_text", text), text, "gemma3", True
    )
    loaded = load_model(
        BackendConfig(model=str(directory), dtype="bfloat16", quantize="none", max_seq_len=64)
    )
    reads_own_positions = DecoderRunner(loaded.model).reads_own_positions
    assert loaded.cache_dtype == (torch.bfloat16 if reads_own_positions else torch.float32)


@pytest.mark.parametrize(
    "composite, served, transformers_4_names",
    [
        ("qwen3_vl", "Qwen3ForCausalLM", False),
        ("qwen2_5_vl", "Qwen2ForCausalLM", True),
        ("qwen3_vl_moe", "Qwen3MoeForCausalLM", False),
    ],
)
def test_a_qwen_vl_checkpoint_serves_its_text_model_as_qwens(
    tmp_path, composite, served, transformers_4_names
):
    """Qwen3-VL, Qwen2.5-VL and Qwen3-VL-MoE as published: their text model loaded alone as Qwen3's, Qwen2's
    or Qwen3-MoE's (its config made that family's, the rotation's sections dropped; Qwen3-VL-MoE's experts
    turned from the [experts, in, out] its files keep), which the decoder runner serves; on text its
    logits are the composite model's, bit for bit (three equal position streams rotate as one). Qwen2.5-VL's
    files name the text model's weights as Qwen2's and the tower's `visual.*` (transformers 4's names)."""
    from safetensors.torch import load_file, save_file

    reference = tiny_qwen_vl(composite)
    directory = write_tiny_causal_lm(tmp_path / composite, "llama", reference)
    if transformers_4_names:
        weights = load_file(directory / "model.safetensors")
        old_names = {r"^model\.language_model\.": "model.", r"^model\.visual\.": "visual."}
        for new, old in old_names.items():
            weights = {re.sub(new, old, name): weight for name, weight in weights.items()}
        assert (
            "model.layers.0.self_attn.q_proj.weight" in weights and "visual.blocks.0.norm1.weight" in weights
        )
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    if composite == "qwen3_vl_moe":  # its experts as Qwen's files keep them: [experts, in, out]
        weights = load_file(directory / "model.safetensors")
        turned = {
            name: weight.transpose(1, 2).contiguous() for name, weight in weights.items() if "experts" in name
        }
        assert turned["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 32)
        save_file(weights | turned, directory / "model.safetensors", metadata={"format": "pt"})
    loaded = load_model(BackendConfig(model=str(directory), dtype="float32", quantize="none", max_seq_len=64))
    assert type(loaded.model).__name__ == served and DecoderRunner.supports(loaded.model.config)
    ids = torch.randint(2, TINY_VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_a_local_directory_loads_as_is(tmp_path):
    from transformers import AutoTokenizer

    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path / "tiny")
    # Any tokenizer with the right files will do for loading mechanics.
    AutoTokenizer.from_pretrained(load_model(BackendConfig()).tokenizer_path).save_pretrained(
        tmp_path / "tiny"
    )
    loaded = load_model(BackendConfig(model=str(tmp_path / "tiny"), max_seq_len=64))
    assert loaded.name == "tiny" and loaded.max_seq_len == 64
    assert type(loaded.model).__name__ == "Qwen2ForCausalLM"
    assert loaded.tokenizer_path == str((tmp_path / "tiny").resolve())


def test_model_names_resolve_to_the_right_kind_of_source(tmp_path):
    assert resolve_model(None).gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    # its file named by its path is the default model still (its name, so its converted copy), another
    # GGUF file is named after its file
    by_path = resolve_model(str(default_model_path()))
    default = resolve_model(None)
    assert by_path.name == default.name == "SmolLM2-135M-Instruct"
    assert converted_dir(by_path, tmp_path) == converted_dir(default, tmp_path)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    assert resolve_model(str(other)).name == "other"
    hub = resolve_model("HuggingFaceTB/SmolLM2-135M")
    assert hub.location == "HuggingFaceTB/SmolLM2-135M" and not hub.is_gguf
    from backend.model.source import ModelNotFound

    with pytest.raises(ModelNotFound):
        resolve_model(str(tmp_path / "nothing.gguf"))
    with pytest.raises(ModelNotFound):
        resolve_model("./no/such/dir")


def test_hub_token_comes_from_the_environment_or_dotenv(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)
    assert hub_token() is None
    Path(".env").write_text("JWT_SECRET=x\nHF_TOKEN='hf_from_file'\n")
    assert hub_token() == "hf_from_file"
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    assert hub_token() == "hf_from_env"


def test_needs_count_weights_and_the_whole_kv_cache():
    model = tiny_model("llama")
    needs = estimate_needs(model.config, torch.float32, rows=32, max_seq_len=128)
    assert needs.weights == sum(p.numel() for p in model.parameters()) * 4
    # 2 (K and V) x 2 layers x 32 rows x 2 kv heads x 128 positions x 16 head dim x 4 bytes
    assert needs.kv_cache == 2 * 2 * 32 * 2 * 128 * 16 * 4


def test_shortfalls_say_what_is_short_and_by_how_much():
    needs = Needs(weights=2 * GIB, kv_cache=6 * GIB, rows=32, max_seq_len=4096)
    plenty = Available(ram=100 * GIB, disk=100 * GIB, vram=100 * GIB)
    assert shortfalls(needs, plenty, on_gpu=True, converting=True) == []
    problems = shortfalls(
        needs, Available(ram=5 * GIB, disk=1 * GIB, vram=None), on_gpu=False, converting=True
    )
    assert problems[0].startswith("RAM: needs 8.80 GiB") and "3.80 GiB short" in problems[0]
    assert "32 rows x 4096 tokens" in problems[0]
    # The parts add up to the need: weights 2.00 + KV cache 6.00 + 10% headroom 0.80.
    assert (
        "(weights 2.00 GiB + KV cache for 32 rows x 4096 tokens 6.00 GiB + 10% headroom 0.80 GiB)"
        in problems[0]
    )
    assert problems[1].startswith("disk: needs 2.00 GiB")
    gpu = shortfalls(
        needs, Available(ram=100 * GIB, disk=100 * GIB, vram=4 * GIB), on_gpu=True, converting=False
    )
    assert len(gpu) == 1 and gpu[0].startswith("VRAM")


def test_weights_quantized_as_they_load_are_counted_so_and_a_gguf_files_copy_on_disk():
    """Weights quantized as they load (a GGUF file's blocks, `--quantize int4|int8`) take LOADING_BYTES a
    parameter beyond themselves then: the RAM that counts where that is more than serving takes; a GGUF
    file converted in memory its float32 model (WHOLE_CONVERSION_BYTES), on a GPU's host too; and a GGUF
    file's converted copy takes its float32 weights (but those its blocks serve, for a lean start) and its
    blocks on disk."""
    model = tiny_model("llama")
    parameters = sum(p.numel() for p in model.parameters())
    needs = estimate_needs(
        model.config, torch.bfloat16, rows=1, max_seq_len=64, quantizing="int8", gguf_bytes=1000
    )
    assert needs.weights == parameters * 2
    assert needs.loading == needs.weights + int(parameters * LOADING_BYTES["int8"])
    assert needs.conversion == 0 and needs.converted == parameters * 4 + 1000
    assert needs.loading > needs.weights + needs.kv_cache  # a tiny model's few rows: loading is the most
    between = Available(ram=int(needs.loading * 1.05), disk=needs.converted, vram=None)
    (ram,) = shortfalls(needs, between, on_gpu=False, converting=True)
    expected = f"RAM: needs {int(needs.loading * 1.1) / GIB:.2f} GiB (weights as they load and are quantized"
    assert ram.startswith(expected)
    lean = estimate_needs(model.config, torch.bfloat16, 1, 64, quantizing="gguf", lean_blocks=1000)
    assert lean.weights == needs.weights + 1000  # its blocks serve beside the dense copies, at most all
    assert lean.loading == lean.weights + int(parameters * LEAN_LOADING_BYTES)
    assert lean.loading < needs.weights + int(parameters * LOADING_BYTES["gguf"])  # its floats too
    # A copy made for a lean start leaves out the floats of the layers the blocks serve
    left_out = estimate_needs(
        model.config,
        torch.bfloat16,
        1,
        64,
        quantizing="gguf",
        gguf_bytes=1000,
        left_to_blocks=parameters // 3,
    )
    assert left_out.converted == (parameters - parameters // 3) * 4 + 1000
    plain = estimate_needs(model.config, torch.bfloat16, rows=1, max_seq_len=64)
    assert plain.loading == plain.conversion == plain.converted == 0
    assert shortfalls(plain, between, on_gpu=False, converting=False) == []
    short_disk = Available(ram=100 * GIB, disk=needs.converted - 1, vram=None)
    (disk,) = shortfalls(needs, short_disk, on_gpu=False, converting=True)
    assert disk.startswith("disk: ") and "(the converted copy)" in disk
    # A GPU quantizes on the device, after the move: its host holds the weights alone, but where a GGUF
    # file is converted in memory.
    whole = estimate_needs(
        model.config, torch.bfloat16, 1, 64, quantizing="gguf", gguf_bytes=1000, converting_whole=True
    )
    assert whole.conversion == int(parameters * WHOLE_CONVERSION_BYTES) > whole.loading
    gpu = Available(ram=int(whole.conversion * 1.05), disk=needs.converted, vram=100 * GIB)
    assert shortfalls(needs, gpu, on_gpu=True, converting=True) == []
    (host,) = shortfalls(whole, gpu, on_gpu=True, converting=True)
    assert host.startswith(f"RAM: needs {int(whole.conversion * 1.1) / GIB:.2f} GiB (a GGUF file's weights")
    (cpu,) = shortfalls(whole, gpu, on_gpu=False, converting=True)
    assert "converted in float32, in memory" in cpu


def test_a_load_that_quantizes_is_refused_where_it_would_not_fit_though_serving_would(tmp_path, monkeypatch):
    """The loader counts the load where it quantizes: a GGUF file's conversion, the default mode's later
    starts (on a CPU that multiplies blocks, lean: the file's blocks beside the weights; elsewhere its
    floats too), `--quantize int4|int8`; not the exact mode reading the converted copy alone."""
    from gguf import GGMLQuantizationType

    from backend.model import resources

    model = tiny_model("llama")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", model, default_model_path(), GGMLQuantizationType.Q4_0)
    config = BackendConfig(model=str(path), dtype="float32", rows=1, max_seq_len=64, cache_dir=str(tmp_path))
    lean = blocks_bytes(path, None) if block_weights.available(torch.device("cpu")) else None
    assert lean is None or 0 < lean < path.stat().st_size  # its quantized tensors alone
    free = {"ram": 100 * GIB}
    monkeypatch.setattr(
        resources, "measure_available", lambda device, disk: Available(free["ram"], GIB, None)
    )
    # The exact mode's first start converts the file a tensor at a time, then reads its float32 copy alone
    load_model(dataclasses.replace(config, quantize="none"))
    for quantize, quantizing in (("auto", "gguf"), ("int4", "int4"), ("int8", "int8")):
        blocks = lean if quantizing == "gguf" else None
        needs = estimate_needs(model.config, torch.float32, 1, 64, quantizing=quantizing, lean_blocks=blocks)
        # between the load's need and serving's, with the headroom (a lean load's without its copies for
        # many rows, which it would go on without)
        least = estimate_needs(
            model.config, torch.float32, 1, 64, quantizing=quantizing, lean_blocks=blocks, without_copies=True
        )
        free["ram"] = short = int((least.loading + least.weights + least.kv_cache) / 2 * 1.1)
        with pytest.raises(resources.InsufficientResources, match="weights as they load and are quantized"):
            load_model(dataclasses.replace(config, quantize=quantize))
        free["ram"] = int(needs.loading * 1.1)  # the load's need, and no more
        load_model(dataclasses.replace(config, quantize=quantize))
        if quantize != "auto":  # (a lean load without copies holds less than the exact mode serves in)
            free["ram"] = short
            load_model(dataclasses.replace(config, quantize="none"))


@pytest.mark.skipif(
    not block_weights.available(torch.device("cpu")),
    reason="a lean load needs the CPU's blocks (AVX2 or AVX-512 VNNI)",
)
def test_a_gguf_file_whose_copies_for_many_rows_do_not_fit_is_served_from_its_blocks_alone(
    tmp_path, monkeypatch, caplog
):
    """Where the RAM holds a lean GGUF load's blocks and floats but not the dense copies that the
    calibration may keep beside them, the start goes on without the copies and says so; with less than
    that, it is refused as before."""
    from gguf import GGMLQuantizationType

    from backend.model import resources
    from backend.quant.quantized_linear import WeightOnlyLinear

    model = tiny_model("llama")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", model, default_model_path(), GGMLQuantizationType.Q4_0)
    config = BackendConfig(model=str(path), dtype="float32", rows=1, max_seq_len=64, cache_dir=str(tmp_path))
    load_model(config)  # the converted copy and the blocks' copy, which the later starts count
    blocks = blocks_bytes(path, converted_dir(resolve_model(str(path)), tmp_path))
    with_copies, without = (
        resources.ram_needed(
            estimate_needs(
                model.config, torch.float32, 1, 64, quantizing="gguf", lean_blocks=blocks, without_copies=bare
            ),
            on_gpu=False,
        )[0]
        for bare in (False, True)
    )
    assert without < with_copies
    free = {"ram": (with_copies + without) // 2}
    monkeypatch.setattr(calibration, "COPY_MIN_SPEEDUP", 0.0)  # copies that would stay where they fit
    monkeypatch.setattr(calibration, "int8_multiplies_faster", lambda layer: True)
    monkeypatch.setattr(
        resources, "measure_available", lambda device, disk: Available(free["ram"], GIB, None)
    )
    with caplog.at_level("WARNING", logger="backend.model.loader"):
        served = load_model(config).model
    assert "keep no copies for many rows" in caplog.text and "RAM: needs" in caplog.text
    projections = [m for m in served.model.layers.modules() if isinstance(m, WeightOnlyLinear)]
    assert projections and all(not m.has_many_rows_path for m in projections)
    free["ram"] = without - 1
    with pytest.raises(resources.InsufficientResources, match="weights as they load and are quantized"):
        load_model(config)


@pytest.mark.parametrize(
    "model, in_memory",
    [
        (lambda: tiny_model("qwen3_moe", moe_intermediate_size=768, norm_topk_prob=True), True),
        (lambda: tiny_model("llama"), False),
    ],
    ids=["qwen3_moe", "llama"],
)
def test_a_gguf_file_converted_in_memory_is_counted_so(model, in_memory, tmp_path, monkeypatch):
    """A file whose tensors are read together (Qwen3-MoE's experts) is converted in memory, its float32
    model whole: the check counts it. One converted a tensor at a time needs no more than it serves in."""
    from backend.model import resources

    model = model()
    whole = estimate_needs(model.config, torch.float32, 1, 64, converting_whole=True)
    assert whole.conversion > whole.weights + whole.kv_cache
    ram = int(whole.conversion * 1.05)  # under the conversion with its headroom, over serving with it
    monkeypatch.setattr(resources, "measure_available", lambda device, disk: Available(ram, GIB, None))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", model, default_model_path())
    config = BackendConfig(model=str(path), dtype="float32", quantize="none", rows=1, max_seq_len=64)
    load = partial(load_model, dataclasses.replace(config, cache_dir=str(tmp_path)))
    if in_memory:
        with pytest.raises(resources.InsufficientResources, match="converted in float32, in memory"):
            load()
    else:
        load()


def test_torch_threads_are_set_before_loading():
    from backend.engine.engine import Engine

    before = torch.get_num_threads()
    try:
        Engine.load(BackendConfig(torch_threads=1, rows=1, max_seq_len=64))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantize_serves_weight_only_layers_and_still_writes_text(mode):
    from backend.engine.engine import Engine
    from backend.messages import SamplingParams
    from backend.quant.quantized_linear import Int4Linear, Int8Linear

    loaded = load_model(BackendConfig(quantize=mode, rows=2, max_seq_len=64))
    kind = {"int4": Int4Linear, "int8": Int8Linear}[mode]
    assert sum(type(m) is kind for m in loaded.model.modules()) == 30 * 7 + (mode == "int8")
    assert not any(type(m) is torch.nn.Linear for m in loaded.model.modules())
    engine = Engine(loaded.model, loaded.tokenizer, rows=2, max_seq_len=64)
    (text,) = engine.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    assert "Paris" in text


def test_the_default_mode_caches_keys_and_values_in_its_own_dtype_where_the_loop_attends():
    """The loader chooses the cache's dtype before there is a runner; the engine, from its runner,
    chooses the same: the model's (bfloat16 on a CPU that multiplies it natively), since the loop
    attends (the fused operations' tests hold that the extension builds on a CPU)."""
    from backend.engine.engine import Engine

    loaded = load_model(BackendConfig(rows=2, max_seq_len=64))
    engine = Engine(loaded.model, loaded.tokenizer, rows=2, max_seq_len=64)
    assert engine.runner.reads_own_positions
    assert loaded.cache_dtype == engine.runner.cache_dtype == loaded.model.dtype


def test_an_unknown_quantization_is_refused_before_loading():
    with pytest.raises(ValueError, match="--quantize must be auto, none, int4, int8 or fp8, not 'int3'"):
        load_model(BackendConfig(quantize="int3", rows=1, max_seq_len=64))


def test_the_kv_cache_is_counted_in_its_own_dtype():
    model = tiny_model("llama")
    needs = estimate_needs(model.config, torch.bfloat16, rows=32, max_seq_len=128, cache_dtype=torch.float32)
    assert needs.weights == sum(p.numel() for p in model.parameters()) * 2
    assert needs.kv_cache == 2 * 2 * 32 * 2 * 128 * 16 * 4


def test_a_cpu_keeps_keys_and_values_in_float32_unless_its_loop_attends_or_told_otherwise():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert pick_cache_dtype("auto", torch.bfloat16, cpu) == torch.float32
    assert pick_cache_dtype("auto", torch.bfloat16, cpu, loop_attention=True) == torch.bfloat16
    assert pick_cache_dtype("auto", torch.float32, cpu, loop_attention=True) == torch.float32
    assert pick_cache_dtype("auto", torch.bfloat16, gpu) == torch.bfloat16
    assert pick_cache_dtype("auto", torch.float16, gpu) == torch.float16
    assert pick_cache_dtype("bfloat16", torch.bfloat16, cpu) == torch.bfloat16
