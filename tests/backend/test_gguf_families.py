"""GGUF files of the served families load where transformers' GGUF loader reads them: a tiny model written
as llama.cpp's converter writes it (tests/backend/gguf_files.py) comes back from `load_model` with the
very weights it went in with, and the engine's greedy tokens on it equal `generate`'s on the original.

transformers reads most of these families from GGUF; SmolLM3, Granite, OLMo 2, Seed-OSS, ERNIE 4.5,
Command R7B, EXAONE 4.0, Arcee AFM and OLMoE it refuses ("GGUF model with architecture ... is not
supported yet") unless model/gguf_families.py lends it their tables, as it does while a model loads.
It reads Falcon-40B's layout as Falcon-7B's (a size mismatch), and loads Mixtral (a "llama" file with
experts) and gpt-oss with their experts left out: random weights, and no error. The loader reads a
Mixtral's experts itself (model/gguf_mixtral.py), and a gpt-oss file's with its window, head width and
rotary scaling (model/gguf_gpt_oss.py), and refuses a file that leaves any weight unread.
"""

import json
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from transformers import GPT2Config, GPT2LMHeadModel, GptOssConfig

from backend.engine.engine import Engine
from backend.messages import SamplingParams, Submit
from backend.model import gguf_conversion, gguf_families, gguf_gpt_oss, loader
from backend.model.architectures import UnsupportedModel
from backend.model.loader import LoadedModel
from backend.model.source import default_model_path
from backend.quant import block_weights
from backend.quant.quantized_experts import QuantizedExperts, expert_weight
from backend.quant.quantized_linear import BlocksLinear, Int4Linear, Int8Linear, fits_int4_kernels
from tests.backend import gguf_files
from tests.backend.gguf_files import OFFSET_NORM_FAMILIES, q4_k_m, round_trip_offset_norms, write_tiny_gguf
from tests.backend.models import (
    FAMILY_EXTRAS,
    TINY_EOS,
    TINY_VOCAB,
    TINY_WINDOW,
    MarkerTokenizer,
    drive,
    load_on_cpu,
    reference_greedy,
    text_of,
    tiny_model,
)
from tests.backend.mxfp4_files import weighty_gpt_oss
from tests.backend.test_falcon import SHAPES, tiny_falcon
from tests.backend.test_long_rope import ORIGINAL, long_rope_phi3

Q4_0 = GGMLQuantizationType.Q4_0


def random_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Norms start as ones and zeros, which transformers also gives a weight a file lacks: random ones
    make a dropped norm tell, and for Gemma (a scale of 1 + w) a file that stored w, not 1 + w; they also
    keep a tied random Gemma from repeating its last token whatever it attends."""
    offset = 1.0 if model.config.model_type in OFFSET_NORM_FAMILIES else 0.0
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1 and ("norm" in name or ".ln_" in name):
                middle = 1.0 - offset if name.endswith("weight") else 0.0
                parameter.uniform_(middle - 0.5, middle + 0.5)
    return round_trip_offset_norms(model)


def tiny_gpt2() -> torch.nn.Module:
    """transformers reads GPT-2's context length into `n_ctx`, which GPT2Config no longer has, so it
    sizes the position embedding to the default 1024: every released GPT-2's, and this one's. Weights
    larger than the default's: with small ones a tied random GPT-2 repeats its last token."""
    torch.manual_seed(0)
    ids = dict(vocab_size=TINY_VOCAB, eos_token_id=TINY_EOS, bos_token_id=1, pad_token_id=0)
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, initializer_range=0.5, **ids)
    return GPT2LMHeadModel(config).eval()


# Each family at a shape its GGUF file can say: where transformers reads no key for a size, the tiny
# model takes the default it falls back on, which is the released models' value.
FAMILIES: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": lambda: tiny_model("llama"),
    "mistral": lambda: tiny_model("mistral"),
    "qwen2": lambda: tiny_model("qwen2"),
    "qwen3": lambda: tiny_model("qwen3"),
    # The top-k weights renormalized, as llama.cpp does.
    "qwen3_moe": lambda: tiny_model("qwen3_moe", norm_topk_prob=True),
    "mixtral": lambda: tiny_model("mixtral"),
    "phi3": lambda: tiny_model("phi3"),
    # llama.cpp writes Gemma's head tied (it drops lm_head), and transformers reads no soft-cap: Gemma 2's
    # released 50 and 30 are its defaults. Smaller weights than the family's tiny model, whose large ones
    # make a tied model repeat its input.
    # Nor is its attention's scale: its heads' width (query_pre_attn_scalar), but at 27B (llama.cpp's rule,
    # `test_a_gemma_27b_files_...`).
    "gemma2": lambda: tiny_model(
        "gemma2",
        tie_word_embeddings=True,
        attn_logit_softcapping=50.0,
        initializer_range=0.02,
        query_pre_attn_scalar=16,
    ),
    # Which layers are global is no key either: transformers' default pattern (every sixth) makes both of
    # two layers sliding ones, over the file's window of 8.
    "gemma3_text": lambda: tiny_model(
        "gemma3_text",
        tie_word_embeddings=True,
        layer_types=["sliding_attention"] * 2,
        query_pre_attn_scalar=16,
    ),
    # Falcon-7B's layout: transformers reads every Falcon file as 7B's.
    "falcon": lambda: tiny_falcon(SHAPES["7b"]),
    "gpt2": tiny_gpt2,
    "mamba": lambda: tiny_model("mamba"),  # rows of a recurrent state (model/mamba.py)
    # Its window, head width and rotary scaling (gpt-oss's YaRN) are read by model/gguf_gpt_oss.py, its
    # experts too.
    "gpt_oss": lambda: tiny_model("gpt_oss", rope_parameters=GptOssConfig().rope_parameters),
    # LFM2: which layers attend is each layer's key head count (0: a convolution); the MLP's width the
    # one it computes from its config
    "lfm2": lambda: tiny_model("lfm2"),
    # StarCoder 2's window is no key: transformers takes 4,096, its released models' (none in play here).
    "starcoder2": lambda: tiny_model("starcoder2", sliding_window=4096),
    # StableLM's rotary width is no key either: the quarter of each head its config defaults to.
    "stablelm": lambda: tiny_model("stablelm"),
    # Nemotron's LayerNorm1P scales by 1 + w, which llama.cpp stores (as Gemma's)
    "nemotron": lambda: tiny_model("nemotron"),
    # Qwen2-MoE's experts' and shared expert's widths are no keys: Qwen1.5-MoE-A2.7B's, transformers' default
    # Experts of the file's widths (read since model/gguf_families.py lent transformers their keys)
    "qwen2_moe": lambda: tiny_model("qwen2_moe"),
    # transformers has no table for these: model/gguf_families.py lends it theirs. SmolLM3's layers without
    # rotary positions are no key: one in four (llama.cpp's and transformers' pattern).
    "smollm3": lambda: tiny_model("smollm3", num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0]),
    # Its four multipliers, as llama.cpp's scales; biases its config's defaults lack (no key says them: the
    # file's tensors do)
    "granite": lambda: tiny_model("granite", attention_bias=True, mlp_bias=True),
    "olmo2": lambda: tiny_model("olmo2"),
    "seed_oss": lambda: tiny_model("seed_oss", attention_out_bias=True),  # biases on q, k, v (and o here)
    "ernie4_5": lambda: tiny_model("ernie4_5"),
    # Command R7B's global layers are no key either: one in four, the last
    "cohere2": lambda: tiny_model(
        "cohere2", num_hidden_layers=4, layer_types=["sliding_attention"] * 3 + ["full_attention"]
    ),
    "exaone4": lambda: tiny_model("exaone4"),  # its window layers a bool a layer
    "arcee": lambda: tiny_model("arcee"),  # its MLP without a gate (ReLU squared)
    "olmoe": lambda: tiny_model("olmoe"),  # experts stacked as Qwen2-MoE's
    # Ministral 3's text, written as "mistral3": its YaRN and its queries' scale past the original length;
    # YaRN's mscale_all_dim (the file's log multiplier) other than its config's default of 1
    "ministral3": lambda: tiny_model(
        "ministral3", rope_parameters=FAMILY_EXTRAS["ministral3"]["rope_parameters"] | {"mscale_all_dim": 0.5}
    ),
    # EXAONE 4.0 1.2B has no window layers (transformers' defaults are 32B's)
    "exaone4 without a window": lambda: tiny_model(
        "exaone4", sliding_window=None, layer_types=["full_attention"] * 2
    ),
}

# llama.cpp writes Mistral as "llama", and transformers reads it back as Llama (the same layers) unless the
# file's name is exactly "mistral".
LOADED_AS = {"mistral": "llama"}


def load_gguf(path: Path, tmp_path: Path, quantize: str = "none") -> LoadedModel:
    """The exact mode (or `quantize`'s), on the CPU, where `generate` runs too."""
    return load_on_cpu(path, tmp_path, quantize)


def assert_same_weights(loaded: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    found = loaded.state_dict()
    assert found.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(found[name], tensor), name


def assert_same_logits(loaded: torch.nn.Module, original: torch.nn.Module) -> None:
    """Over a prompt past the tiny models' windows (8) and original rotary lengths (16): greedy tokens of a
    random model can agree where a scale of its attention is off. (A norm's epsilon comes back through
    float32: close, not equal.)"""
    ids = torch.randint(2, TINY_VOCAB - 1, (1, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, original(ids).logits, rtol=1e-4, atol=1e-4)


def assert_greedy_tokens_match(served: torch.nn.Module, original: torch.nn.Module, rng: random.Random):
    """Six prompts of up to 60 tokens on 4 rows (rows freed and refilled), each giving what the original
    model's `generate` gives on it alone."""
    prompts = [[rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(1, 60))] for _ in range(6)]
    engine = Engine(served, MarkerTokenizer(), rows=4, max_seq_len=128)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    pieces = drive(engine, [(i, Submit(f"r{i}", tuple(prompt), greedy)) for i, prompt in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        expected = reference_greedy(original, prompt, 12, engine.eos_ids)
        assert MarkerTokenizer.ids(text_of(pieces[f"r{i}"])) == expected, f"prompt {i} diverged"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_gguf_file_gives_back_the_models_weights_and_its_greedy_tokens(family, tmp_path):
    model = random_norms(FAMILIES[family]())
    path = write_tiny_gguf(tmp_path / f"tiny-{family}.gguf", model, default_model_path())
    loaded = load_gguf(path, tmp_path)
    assert loaded.model.config.model_type == LOADED_AS.get(family, model.config.model_type)
    assert_same_weights(loaded.model, model.state_dict())
    text = "Hello world, the cat sat on the mat."
    assert loaded.tokenizer.decode(loaded.tokenizer(text).input_ids, skip_special_tokens=True) == text
    assert_same_logits(loaded.model, model)
    assert_greedy_tokens_match(loaded.model, model, random.Random(family))
    # A later start serves the converted copy (safetensors in the cache directory): the same weights.
    again = load_gguf(path, tmp_path)
    assert again.model.config.quantization_config is None  # not read from the GGUF file this time
    assert_same_weights(again.model, model.state_dict())
    assert_same_tokenizer(again.tokenizer, loaded.tokenizer)


# llama.cpp's converter writes the text model of Qwen VL checkpoints as architectures of their own, their
# tensors those of the family's text model (model/gguf_parsing.PRESENTED_AS), and Mistral Small 3.1's and
# 3.2's (a Mistral's) as Ministral 3's "mistral3"
TEXT_OF_ANOTHER = {
    "qwen3vl": ("qwen3", gguf_files.MODEL_ARCH.QWEN3VL),
    "qwen3vlmoe": ("qwen3_moe", gguf_files.MODEL_ARCH.QWEN3VLMOE),
    "qwen2vl": ("qwen2", gguf_files.MODEL_ARCH.QWEN2VL),
    "mistral3": ("mistral", gguf_files.MODEL_ARCH.MISTRAL3),
}


@pytest.mark.parametrize("architecture", sorted(TEXT_OF_ANOTHER))
def test_a_file_of_another_architecture_is_served_as_its_text_models_family(architecture, tmp_path):
    """Qwen VL's text positions are one position in each of time, height and width: the family's own
    rotation. A "mistral3" file without Ministral 3's temperature of its queries is a Mistral's. Through
    the default mode, its Q4_0 file's projections are served from its blocks, as its family's are."""
    family, arch = TEXT_OF_ANOTHER[architecture]
    model = random_norms(FAMILIES[family]())
    path = write_tiny_gguf(tmp_path / f"{architecture}.gguf", model, default_model_path(), architecture=arch)
    loaded = load_gguf(path, tmp_path)
    assert loaded.model.config.model_type == LOADED_AS.get(family, family)
    assert_same_weights(loaded.model, model.state_dict())
    assert_same_logits(loaded.model, model)
    assert_greedy_tokens_match(loaded.model, model, random.Random(architecture))
    blocks = write_tiny_gguf(
        tmp_path / f"{architecture}-Q4_0.gguf", model, default_model_path(), Q4_0, architecture=arch
    )
    exact, served = load_gguf(blocks, tmp_path).model, load_gguf(blocks, tmp_path, quantize="auto").model
    linears = [
        m for m in served.model.layers.modules() if type(m) is torch.nn.Linear and fits_int4_kernels(m)
    ]
    assert linears == []
    ids = torch.tensor([[5], [17], [200], [31]])  # four rows of one token: a decode step's shape
    with torch.inference_mode():
        expected, got = exact(ids).logits.float(), served(ids).logits.float()
    assert (got - expected).abs().max() < 0.03 * expected.abs().max()


def test_an_olmo_3_file_is_refused_rather_than_served_without_its_window(tmp_path, monkeypatch):
    """llama.cpp writes OLMo 3 as "olmo2", with a window: served as OLMo 2, its window layers would attend
    to every position."""
    with_window = gguf_files.METADATA["olmo2"]
    monkeypatch.setitem(
        gguf_files.METADATA,
        "olmo2",
        lambda hparams: with_window(hparams) | {gguf_files.Keys.Attention.SLIDING_WINDOW: TINY_WINDOW},
    )
    path = write_tiny_gguf(tmp_path / "olmo3.gguf", tiny_model("olmo2"), default_model_path())
    with pytest.raises(UnsupportedModel, match="OLMo 3"):
        load_gguf(path, tmp_path)


@pytest.mark.parametrize("layers, expected_scale", [(46, 64 // 4), (45, 8)], ids=["27B", "other"])
def test_a_gemma_2_27b_files_attention_scale_is_its_width_a_head(layers, expected_scale, tmp_path):
    """Gemma 2 27B's heads are 128 wide but it scales attention by 4,608 / 32 = 144; no key says so, and
    llama.cpp tells it by its 46 layers: heads of 8 here, of 64 / 4 = 16 a head at 46 layers."""
    torch.manual_seed(0)
    model = tiny_model(
        "gemma2",
        num_hidden_layers=layers,
        layer_types=None,
        head_dim=8,
        tie_word_embeddings=True,
        query_pre_attn_scalar=expected_scale,
    )
    path = write_tiny_gguf(tmp_path / "gemma2.gguf", model, default_model_path())
    loaded = load_gguf(path, tmp_path).model
    assert loaded.config.query_pre_attn_scalar == expected_scale
    ids = torch.randint(2, TINY_VOCAB - 1, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


SOME_TEXT = ["Hello world, the cat sat on the mat.", "  déjà vu: 12,345 <b>bold</b>\n\tend", "ÅÄÖ 😀 日本"]


def assert_same_tokenizer(again, first) -> None:
    """A later start's tokenizer (the converted copy's) gives the first start's ids and special tokens."""
    for text in SOME_TEXT:
        assert again(text).input_ids == first(text).input_ids, text
    assert (again.bos_token_id, again.eos_token_id) == (first.bos_token_id, first.eos_token_id)


def test_a_gemma_3_file_with_a_byte_level_vocabulary_starts_again_from_its_converted_copy(
    tmp_path, monkeypatch
):
    """llama.cpp writes a byte-level vocabulary for a Gemma 3 checkpoint without a tokenizer.model. The
    converted copy's tokenizer, read back as Gemma's class, built Gemma's own pipeline over it and failed
    at the second start ("Unk token None not found"); it is read as it was saved."""
    monkeypatch.setattr(gguf_files, "SENTENCEPIECE_FAMILIES", ("gemma2",))
    model = random_norms(FAMILIES["gemma3_text"]())
    path = write_tiny_gguf(tmp_path / "tiny-gemma3-bpe.gguf", model, default_model_path())
    first = load_gguf(path, tmp_path)
    again = load_gguf(path, tmp_path)
    assert again.model.config.quantization_config is None  # the converted copy
    assert_same_tokenizer(again.tokenizer, first.tokenizer)


def test_q8_0_weights_load_as_the_gguf_package_dequantizes_them(tmp_path):
    """2-D weights in Q8_0 blocks (Qwen2: no row permutation to undo), norms and biases in F32."""
    model = tiny_model("qwen2")
    path = write_tiny_gguf(tmp_path / "tiny-q8.gguf", model, default_model_path(), GGMLQuantizationType.Q8_0)
    expected = {}
    for name, tensor in model.state_dict().items():
        if tensor.dim() == 2:
            blocks = quants.quantize(tensor.numpy(), GGMLQuantizationType.Q8_0)
            tensor = torch.from_numpy(np.asarray(quants.dequantize(blocks, GGMLQuantizationType.Q8_0)))
        expected[name] = tensor
    assert not torch.equal(expected["lm_head.weight"], model.lm_head.weight)  # blocks, not floats
    assert_same_weights(load_gguf(path, tmp_path).model, expected)


def test_a_gguf_file_without_some_of_the_models_weights_is_refused(tmp_path):
    """transformers reads a file whose weights it finds no names for (a gpt-oss file's experts) with no
    error, those weights left at random: the loader refuses, naming them."""
    path = write_tiny_gguf(
        tmp_path / "tiny.gguf", tiny_model("llama"), default_model_path(), leave_out="blk.1.ffn_down.weight"
    )
    with pytest.raises(UnsupportedModel, match=r"no weights for 1 .*model.layers.1.mlp.down_proj.weight"):
        load_gguf(path, tmp_path)
    assert not list(tmp_path.glob("cache/converted/*"))  # no copy left for a later start to serve
    with pytest.raises(UnsupportedModel, match=r"no weights for 1 "):
        load_gguf(path, tmp_path)


@pytest.mark.parametrize(
    "family, a_tensor_at_a_time", [("llama", True), ("gemma2", True), ("qwen3_moe", False)]
)
def test_a_first_start_writes_the_converted_copy_a_tensor_at_a_time_and_loads_it(
    family, a_tensor_at_a_time, tmp_path, monkeypatch
):
    """The converted copy is written in float32 shards of at most SHARD_BYTES beside the largest tensor
    (gguf_conversion.py), and the first start loads the model from it as a later start does: never the
    whole float32 model in memory. A Qwen3-MoE file, whose experts transformers' processor assembles from
    several tensors, is converted whole through transformers as before."""
    monkeypatch.setattr(gguf_conversion, "SHARD_BYTES", 64 * 1024)
    read_from, load_weights = [], loader.load_weights

    def reading(location, gguf_file, *args, **kwargs):
        read_from.append(gguf_file)
        return load_weights(location, gguf_file, *args, **kwargs)

    monkeypatch.setattr(loader, "load_weights", reading)
    model = random_norms(FAMILIES[family]())
    path = write_tiny_gguf(tmp_path / f"tiny-{family}.gguf", model, default_model_path())
    assert_same_weights(load_gguf(path, tmp_path).model, model.state_dict())
    assert read_from == [None if a_tensor_at_a_time else path.name]
    (copy,) = tmp_path.glob("cache/converted/*")
    index = copy / gguf_conversion.INDEX_FILE
    assert index.is_file() == a_tensor_at_a_time
    if a_tensor_at_a_time:
        shards = set(json.loads(index.read_text())["weight_map"].values())
        largest = max(tensor.numel() * 4 for tensor in model.state_dict().values())
        assert len(shards) > 2
        assert all((copy / shard).stat().st_size < 64 * 1024 + largest + 16 * 1024 for shard in shards)


def test_a_q4_k_m_file_is_served_from_its_own_blocks_and_gives_the_dequantized_models_logits(tmp_path):
    """llama-quantize's Q4_K_M mix (Q4_K, Q6_K for the values, the down projections and the head, Q5_0
    where rows are no whole K-quant block) through the default mode: every projection and the head from
    the file's blocks, no layer left as floats, and a step of few rows (the blocks' path) gives the
    logits of the same file dequantized to float32."""
    model = tiny_model("llama", hidden_size=256, intermediate_size=512, head_dim=64)
    path = write_tiny_gguf(tmp_path / "tiny-Q4_K_M.gguf", model, default_model_path(), q4_k_m)
    exact = load_gguf(path, tmp_path).model
    served = load_gguf(path, tmp_path, quantize="auto").model
    layers = dict(served.named_modules())
    blocks = block_weights.available(torch.device("cpu"))
    q_proj = layers["model.layers.0.self_attn.q_proj"]  # Q4_K
    assert q_proj.layout() == "4-bit super-blocks" if blocks else isinstance(q_proj, Int4Linear)
    for name in ("model.layers.1.self_attn.v_proj", "model.layers.1.mlp.down_proj", "lm_head"):  # Q6_K
        layer = layers[name]
        assert layer.layout() == "6-bit super-blocks" if blocks else isinstance(layer, Int8Linear), name
    assert not any(type(module) is torch.nn.Linear for module in served.modules())
    ids = torch.tensor([[5], [17], [200], [31]])  # four rows of one token: a decode step's shape
    with torch.inference_mode():
        expected = exact(ids).logits.float()
        got = served(ids).logits.float()
    assert (got - expected).abs().max() < 0.03 * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("family", ["smollm3", "granite", "arcee", "ministral3"])
def test_a_lent_familys_permuted_rows_are_served_from_its_blocks_permuted_back(family, tmp_path):
    """SmolLM3's, Granite's, AFM's and Ministral 3's converters (LlamaModel's subclasses) permute q and k rows
    for llama.cpp's rotary layout: their blocks, served as they are, are permuted back
    (gguf_weights.ROW_ONLY_PROCESSORS; Ministral 3's file is presented as a Llama's),
    so a prompt, whose later positions rotate, gives the logits of the same file dequantized."""
    # (the tiny Granite's attention multiplier of 1/16 and residual one of 0.22 blur what rotation does)
    sharp = {"attention_multiplier": 0.5, "residual_multiplier": 1.0} if family == "granite" else {}
    model = random_norms(tiny_model(family, hidden_size=256, intermediate_size=512, head_dim=64, **sharp))
    path = write_tiny_gguf(tmp_path / f"{family}-Q4_0.gguf", model, default_model_path(), Q4_0)
    exact = load_gguf(path, tmp_path).model
    served = load_gguf(path, tmp_path, quantize="auto").model
    q_proj = served.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, BlocksLinear if block_weights.available(torch.device("cpu")) else Int4Linear)
    ids = torch.tensor([[5, 17, 200, 31, 7, 99, 3, 64, 250, 11]])
    with torch.inference_mode():
        expected, got = exact(ids).logits.float(), served(ids).logits.float()
    assert (got - expected).abs().max() < 0.03 * expected.abs().max()


@pytest.mark.parametrize("family", ["llama", "mixtral"])  # Mixtral's experts read by gguf_mixtral.py
def test_a_gguf_file_with_a_type_the_gguf_package_cannot_read_is_refused_naming_it(
    family, tmp_path, monkeypatch
):
    """Q1_0 (a 1-bit type newer than the gguf package's dequantizers): refused at start, the type named,
    not a traceback."""
    one_bit = GGMLQuantizationType.Q1_0
    block, size = GGML_QUANT_SIZES[one_bit]
    written = gguf_files.quantize

    def zeros_for_q1_0(data: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
        if kind != one_bit:
            return written(data, kind)
        return np.zeros((*data.shape[:-1], data.shape[-1] // block * size), dtype=np.uint8)

    monkeypatch.setattr(gguf_files, "quantize", zeros_for_q1_0)
    model = tiny_model(family, hidden_size=256, intermediate_size=512, head_dim=64)
    path = write_tiny_gguf(
        tmp_path / "tiny.gguf",
        model,
        default_model_path(),
        lambda name: one_bit if "ffn_up" in name else GGMLQuantizationType.Q8_0,  # Mixtral's ffn_up_exps
    )
    with pytest.raises(UnsupportedModel, match=r"tiny.gguf holds a tensor type .*Q1_0.*llama-quantize"):
        load_gguf(path, tmp_path)


@pytest.mark.parametrize("one_tensor_an_expert", [False, True], ids=["stacked", "one-an-expert"])
def test_a_mixtral_file_is_served_with_its_experts_from_their_blocks(one_tensor_an_expert, tmp_path):
    """A Mixtral as llama.cpp writes it ("llama", experts stacked; or, as its first conversions, one
    tensor an expert) loads as Mixtral with the very weights it went in with, and through the default
    mode its experts and projections come from the file's Q4_0 blocks, a step of few rows giving the
    logits of the same file dequantized to float32."""
    model = random_norms(tiny_model("mixtral"))
    floats = write_tiny_gguf(
        tmp_path / "f32.gguf", model, default_model_path(), one_tensor_an_expert=one_tensor_an_expert
    )
    exact = load_gguf(floats, tmp_path).model
    assert exact.config.model_type == "mixtral" and exact.config.num_local_experts == 4
    assert_same_weights(exact, model.state_dict())
    path = write_tiny_gguf(
        tmp_path / "q4_0.gguf", model, default_model_path(), Q4_0, one_tensor_an_expert=one_tensor_an_expert
    )
    dequantized = load_gguf(path, tmp_path).model
    served = load_gguf(path, tmp_path, quantize="auto").model
    assert all(isinstance(layer.mlp.experts, QuantizedExperts) for layer in served.model.layers)
    assert not any(type(module) is torch.nn.Linear for module in served.model.layers.modules())
    ids = torch.tensor([[5], [17], [200], [31]])  # four rows of one token: a decode step's shape
    with torch.inference_mode():
        expected, got = dequantized(ids).logits.float(), served(ids).logits.float()
    assert (got - expected).abs().max() < 0.03 * expected.abs().max()


def q2_k_mix(name: str) -> GGMLQuantizationType:
    """llama-quantize's Q2_K mix, in short: Q3_K for the value and down projections, Q2_K for the rest
    (the experts' gate and up among them), the head Q6_K."""
    if name.startswith(("output.", "token_embd.")):
        return GGMLQuantizationType.Q6_K
    if ".attn_v." in name or ".ffn_down" in name:
        return GGMLQuantizationType.Q3_K
    return GGMLQuantizationType.Q2_K


def mxfp4_moe(name: str) -> GGMLQuantizationType:
    """llama-quantize's MXFP4_MOE: a mixture's experts MXFP4 (as gpt-oss ships them), the rest Q8_0."""
    return GGMLQuantizationType.MXFP4 if "_exps." in name else GGMLQuantizationType.Q8_0


@pytest.mark.parametrize(
    "mix, layouts",
    [
        (q2_k_mix, {"2-bit super-blocks", "4-bit symmetric super-blocks"}),
        (mxfp4_moe, {"4-bit MXFP4 table blocks"}),
    ],
    ids=["q2_k", "mxfp4_moe"],
)
def test_a_mixtral_files_low_bit_experts_are_served_from_their_own_blocks(mix, layouts, tmp_path):
    """A Q2_K file of a mixture (its experts' gate and up Q2_K, their down Q3_K), and an MXFP4_MOE one
    (its experts MXFP4): the default mode serves every expert from the file's own blocks (2-bit and
    symmetric 4-bit super-blocks; MXFP4's table's blocks), a decode step giving the logits of the same
    file dequantized to float32."""
    wide = dict(hidden_size=256, intermediate_size=256, head_dim=64)  # rows of whole 256s
    model = random_norms(tiny_model("mixtral", **wide))
    path = write_tiny_gguf(tmp_path / "mix.gguf", model, default_model_path(), mix)
    dequantized = load_gguf(path, tmp_path).model
    served = load_gguf(path, tmp_path, quantize="auto").model
    experts = [layer.mlp.experts for layer in served.model.layers]
    assert all(isinstance(module, QuantizedExperts) for module in experts)
    if block_weights.available(torch.device("cpu")):
        served_as = {
            layer.layout()
            for module in experts
            for layer in module.modules()
            if isinstance(layer, BlocksLinear)
        }
        assert served_as == layouts
    ids = torch.tensor([[5], [17], [200], [31]])  # four rows of one token: a decode step's shape
    with torch.inference_mode():
        expected, got = dequantized(ids).logits.float(), served(ids).logits.float()
    assert (got - expected).abs().max() < 0.03 * expected.abs().max()


@pytest.mark.parametrize("rope", ["yarn", "default"])
def test_a_gpt_oss_files_rotary_positions_are_the_models_own(rope, tmp_path):
    """transformers reads any gpt-oss file's rotary scaling as gpt-oss-20b's YaRN (and with YaRN's
    `truncate` on, which gpt-oss's is not): the loaded model's rotary frequencies and scaling are the
    model's own, with YaRN and without."""
    parameters = (
        GptOssConfig().rope_parameters if rope == "yarn" else {"rope_type": "default", "rope_theta": 1e4}
    )
    model = tiny_model("gpt_oss", rope_parameters=parameters)
    path = write_tiny_gguf(tmp_path / "gpt-oss.gguf", model, default_model_path())
    loaded = load_gguf(path, tmp_path).model
    assert torch.equal(loaded.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    assert loaded.model.rotary_emb.attention_scaling == model.model.rotary_emb.attention_scaling
    assert loaded.config.head_dim == 16 and loaded.config.sliding_window == model.config.sliding_window


@pytest.mark.parametrize("long_rope", [True, False], ids=["LongRoPE", "plain RoPE"])
def test_a_phi_3_files_rotation_and_window_are_the_models_own(long_rope, tmp_path):
    """transformers reads no Phi-3 file's rotary width, window or LongRoPE factors (gguf_phi3.py): a file of
    Phi-4-mini's rotation (three quarters of each head, LongRoPE) with Phi-3-mini's window gives the
    model's logits exactly, over prompts within and past the original context (LongRoPE's short factors,
    then its long ones) and past the window."""
    if long_rope:
        model = long_rope_phi3(0.75, sliding_window=TINY_WINDOW)
    else:
        model = tiny_model(
            "phi3", partial_rotary_factor=0.75, sliding_window=TINY_WINDOW, initializer_range=0.3
        )
    path = write_tiny_gguf(tmp_path / "phi3.gguf", model, default_model_path())
    loaded = load_gguf(path, tmp_path).model
    assert loaded.config.sliding_window == TINY_WINDOW
    assert loaded.config.rope_parameters["rope_type"] == ("longrope" if long_rope else "default")
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for length in (ORIGINAL - 4, ORIGINAL + 16):
            ids = torch.randint(2, TINY_VOCAB - 1, (1, length), generator=generator)
            assert torch.equal(loaded(ids).logits, model(ids).logits), length


def test_a_phi_3_file_with_one_of_long_ropes_two_factor_tensors_is_refused_naming_the_other(tmp_path):
    missing = "rope_factors_short.weight"
    path = write_tiny_gguf(tmp_path / "phi3.gguf", long_rope_phi3(), default_model_path(), leave_out=missing)
    with pytest.raises(UnsupportedModel, match=missing):
        load_gguf(path, tmp_path)


def test_a_gpt_oss_file_serves_its_mxfp4_experts_without_ever_holding_their_floats(tmp_path, monkeypatch):
    """ggml-org's gpt-oss files keep the experts MXFP4 and the rest Q8_0 (`mxfp4_moe`). The default mode's
    start reads the experts' floats as placeholders that hold no memory (gguf_gpt_oss.py: gpt-oss-20b's
    are 77 GB in float32), writes no converted copy of them, and serves every expert from MXFP4's blocks
    of exactly the file's weights, with their biases; a decode step's logits are those of the same file
    dequantized to float32 (the exact mode), to the int8 rounding of activations."""
    model = weighty_gpt_oss(random_norms(tiny_model("gpt_oss")))
    path = write_tiny_gguf(tmp_path / "gpt-oss.gguf", model, default_model_path(), mxfp4_moe)
    strides, read = [], gguf_gpt_oss.read_gpt_oss

    def reading(*args):
        weights = read(*args)
        strides.extend(
            t.stride() for name, t in weights.items() if name.endswith(("gate_up_proj", "down_proj"))
        )
        return weights

    monkeypatch.setattr(gguf_gpt_oss, "read_gpt_oss", reading)
    served = load_gguf(path, tmp_path, quantize="auto").model
    # what the start's check counts as never floats: both layers' experts
    assert gguf_gpt_oss.experts_left_to_blocks(path, served.config) == 2 * 4 * 3 * 128 * 64
    blocks = block_weights.available(torch.device("cpu"))
    if blocks:  # (elsewhere the experts load as floats, and their copy is written)
        assert strides == [(0, 0, 0)] * 4
        assert not list((tmp_path / "cache").rglob("*.safetensors"))  # no copy of placeholders
    exact = load_gguf(path, tmp_path).model
    for index, layer in enumerate(served.model.layers):
        experts, reference = layer.mlp.experts, exact.model.layers[index].mlp.experts
        assert isinstance(experts, QuantizedExperts)
        for part in ("gate_up", "down"):
            for e, expert in enumerate(getattr(experts, part)):
                assert torch.equal(expert.bias, getattr(reference, f"{part}_proj_bias")[e])
                if blocks:
                    assert expert.layout() == "4-bit MXFP4 table blocks"
                    held = block_weights.dequantize(
                        expert.blocks, expert.in_features, block_weights.Table.MXFP4
                    )
                    assert torch.equal(held, expert_weight(reference, part, e)), (index, part, e)
    ids = torch.tensor([[5], [17], [200], [31]])  # four rows of one token: a decode step's shape
    with torch.inference_mode():
        expected, got = exact(ids).logits.float(), served(ids).logits.float()
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()


@pytest.mark.parametrize("missing", ["blk.1.ffn_up_exps.bias", "blk.0.ffn_down_exps.weight"])
def test_a_gpt_oss_file_without_a_tensor_of_its_experts_is_refused_naming_it(missing, tmp_path):
    """In the default mode (its experts' floats left to their blocks) as in the exact mode: refused at
    start, the tensor named, never experts made up."""
    path = write_tiny_gguf(
        tmp_path / "gpt-oss.gguf", tiny_model("gpt_oss"), default_model_path(), mxfp4_moe, leave_out=missing
    )
    for quantize in ("auto", "none"):
        with pytest.raises(UnsupportedModel, match=rf"gpt-oss.gguf is a gpt-oss file without {missing}"):
            load_gguf(path, tmp_path, quantize)


def test_a_mixtral_file_without_a_projection_of_its_experts_is_refused_naming_it(tmp_path):
    """A file that says it has experts but lacks a layer's up projections of them, stacked or one an
    expert: refused at start with the tensor named, not a traceback."""
    path = write_tiny_gguf(
        tmp_path / "tiny.gguf",
        tiny_model("mixtral"),
        default_model_path(),
        leave_out="blk.1.ffn_up_exps.weight",
    )
    with pytest.raises(
        UnsupportedModel, match=r"tiny.gguf says it has experts but holds no blk.1.ffn_up_exps"
    ):
        load_gguf(path, tmp_path)


@pytest.mark.parametrize(
    "family",
    [
        "qwen3",
        "qwen3_moe",
        "qwen2_moe",
        "phi3",
        "gemma2",
        "gemma3_text",
        "lfm2",
        "starcoder2",
        "stablelm",
        "nemotron",
        *sorted(gguf_families.MORE_ARCHITECTURES),  # (llama.cpp names these as transformers does)
    ],
)
def test_a_file_whose_rows_need_no_permuting_is_served_from_its_own_blocks_experts_included(family, tmp_path):
    """Qwen3, Qwen3-MoE, Qwen2-MoE, Phi-3, Gemma, LFM2, StarCoder 2, StableLM and Nemotron files (llama.cpp
    stores their rows as transformers has them), and those of the families model/gguf_families.py lends
    transformers' reader tables for (SmolLM3's and Granite's q and k rows permuted back: whole blocks
    move), through the default mode: every projection from the file's
    Q4_0 blocks (but Qwen2-MoE's shared expert's gate, one output, which the kernels do not take), a
    Qwen3-MoE's and Qwen2-MoE's experts too, each expert's gate and up joined as transformers joins them
    (quantized_experts.py); a step of few rows gives the logits of the same file dequantized to float32,
    and a later start, from the blocks' copy, serves the same."""
    model = random_norms(FAMILIES[family]())
    path = write_tiny_gguf(tmp_path / f"tiny-{family}-Q4_0.gguf", model, default_model_path(), Q4_0)
    exact = load_gguf(path, tmp_path).model
    for start in ("first", "again"):
        served = load_gguf(path, tmp_path, quantize="auto").model
        floats = [
            m for m in served.model.layers.modules() if type(m) is torch.nn.Linear and fits_int4_kernels(m)
        ]
        assert floats == [], start
        if family in ("qwen3_moe", "qwen2_moe", "olmoe"):
            experts = [layer.mlp.experts for layer in served.model.layers]
            assert all(isinstance(e, QuantizedExperts) for e in experts), start
            layers = [layer for e in experts for layer in (*e.gate_up, *e.down)]
            if block_weights.available(torch.device("cpu")):  # Q4_0's own blocks, d alone
                assert all(layer.layout() == "4-bit symmetric blocks" for layer in layers)
            else:
                assert all(isinstance(layer, Int4Linear) for layer in layers)
        ids = torch.tensor([[5], [17], [200], [31]])  # four rows of one token: a decode step's shape
        with torch.inference_mode():
            expected, got = exact(ids).logits.float(), served(ids).logits.float()
        assert (got - expected).abs().max() < 0.03 * expected.abs().max(), start
