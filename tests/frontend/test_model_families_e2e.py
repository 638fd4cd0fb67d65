"""Each model family the engine serves through transformers' own modules, started as the backend starts
it: a tiny random-weight model of the family, saved with a tokenizer whose token `i` is the text "<i>", its
directory loaded with the loader's checks and warmed up (`serve.start_engine`), in the exact mode with
prompts in chunks of 8 tokens; six greedy completions at once, whose prompts share a prefix, each give
the token ids `generate` gives on the prompt alone (SPEC §5). Two families, a decoder's and a recurrent
state's, go through the real server and its HTTP API too: what lies between the API and the engine is
the same for every family, and a server's start (a backend process importing torch and transformers)
took 10 s each on a 2-core CPU, 17 of them 145 s of the suite.

The engine-level tests (tests/backend/test_exactness.py) hold every family to `generate` in more
shapes; this one proves the path a user takes: the model directory, the loader's checks, the HTTP API.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM

from backend.engine.engine import Engine
from backend.engine.serve import start_engine
from backend.messages import BackendConfig, SamplingParams, Submit
from tests.backend.models import (
    TINY_EOS,
    TINY_VOCAB,
    MarkerTokenizer,
    reference_greedy,
    tiny_gemma4_multimodal,
    tiny_model,
    tiny_qwen3_5_multimodal,
    tiny_qwen_vl,
    write_gemma3n_multimodal,
    write_multimodal,
    write_tiny_causal_lm,
)
from tests.backend.test_falcon import SHAPES, tiny_falcon
from tests.server_fixture import running_server

# The families beyond Llama's layer (held to the default model end to end elsewhere): Qwen3 on the decoder
# runner, the others on transformers' modules over the row attention, Mamba's over its rows' states.
FAMILIES = [
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "phi3",
    "olmo2",
    "granite",
    "smollm3",
    "gemma2",
    "gemma3_text",
    "gpt_oss",
    "cohere2",
    # Served from 2026-12-02: each family transformers' modules run exactly over the row attention
    "ministral",
    "gemma",
    "starcoder2",
    "phi",
    "phimoe",
    "stablelm",
    "cohere",
    "glm",
    "glm4",
    "glm4_moe",
    "olmo",
    "olmo3",
    "olmoe",
    "granitemoe",
    "nemotron",
    "exaone4",
    "ernie4_5",
    "seed_oss",
    "arcee",
    "helium",
    "hunyuan_v1_dense",
    "apertus",
    "falcon",
    "falcon_rw",
    # A recurrent state a row (model/mamba.py): Mamba's and Mamba-2's runner paths; and the hybrids'
    # mixers over the rows, Mamba-2's (Granite 4's, as Bamba's, Falcon-H1's and Nemotron-H's) and
    # Mamba's (Jamba's, as Falcon-Mamba's). test_exactness holds each of those families to `generate`.
    "mamba",
    "mamba2",
    "granitemoehybrid",
    "jamba",
    # Served from 2026-12-02: Gated DeltaNet layers over the rows' states (model/gated_delta.py); Qwen3.5
    # both as its text model alone and as Qwen publishes it, a vision tower beside (its text served); OLMo's
    # hybrid
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_5",
    "olmo_hybrid",
    # Served from 2026-12-03: Gemma 4, its text model alone and as Google publishes it (a vision tower
    # beside): global layers wider than its window layers, layers attending over earlier ones' keys and values
    "gemma4_text",
    "gemma4",
    "gemma4_unified",  # (Gemma 4 12B's)
    # Gemma 3n, its text model alone and as Google publishes it (whose towers the loader leaves unread:
    # the vision one needs timm)
    "gemma3n_text",
    "gemma3n",
    # Served from 2026-12-03 beside Gemma 4: families whose modules run exactly over the row attention as
    # they are (test_exactness holds each); three here for the loader's path
    "ministral3",
    # Ministral 3 as Mistral publishes it (Mistral3ForConditionalGeneration, a Pixtral tower beside), which
    # transformers builds as no causal LM, and Gemma 3 4B-27B as Google does (its files with transformers 4's
    # names): their text model alone loaded
    "mistral3",
    "gemma3",
    # Qwen3-VL and Qwen2.5-VL as Qwen publishes them: their text model loaded alone as Qwen3's and Qwen2's,
    # the composite model's own `generate` the reference
    "qwen3_vl",
    "qwen2_5_vl",
    "qwen3_vl_moe",  # (its text model as Qwen3-MoE's)
    # Llama 4 as Meta publishes it (Llama4ForConditionalGeneration, files with transformers 4's names): its
    # text model alone, a rotated layer and one without rotary positions, experts
    "llama4",
    # LFM2-VL as Liquid AI publishes it (Lfm2VlForConditionalGeneration, a SigLIP 2 tower beside): its text
    # model alone, LFM2's, on the decoder runner
    "lfm2_vl",
    # Served from 2026-12-07: families transformers 5 added, three here for the loader's path (CWM on the
    # decoder runner, its window layers; Jais 2's LayerNorms and biases; Hy3's experts)
    "cwm",
    "jais2",
    "hy_v3",
    "minimax_m2",
    "granitemoe_swa",
    # LFM2: short convolution layers over the rows' states (model/short_conv.py)
    "lfm2",
    "lfm2_moe",
    "lfm3",  # (served from 2026-12-07: its window layer among them)
    # Served from 2026-12-03: GPT-NeoX (Pythia), OPT and GPT-BigCode (StarCoder, one key head)
    "gpt_neox",
    "opt",
    "gpt_bigcode",
    # Served from 2026-12-03: latent attention (model/latent_attention.py), its latents cached and read as
    # they are; DeepSeek-V2's complex rotation, V3's interleaved, GLM-4.7-Flash's MLP layers by type
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe_lite",
    # Served from 2026-12-07: DeepSeek-V3.2's and GLM-5's sparse attention within its indexer's top k
    "deepseek_v32",
    "glm_moe_dsa",
]
MAX_TOKENS = 10
EXACT = dict(dtype="float32", quantize="none", rows=4, max_seq_len=128, max_prefill_tokens=8)
# Through the real server, side by side: the decoder runner's path and a recurrent state's. Only the
# servers and their requests run in threads: transformers' model building patches process-wide state (its
# weight initialisation, the meta device), which two threads building at once left patched.
SERVED = ["qwen3", "mamba2"]


# The multimodal families above whose text model the test writes under the composite's names
TEXT_MODELS = {"mistral3": "ministral3", "gemma3": "gemma3_text", "llama4": "llama4_text", "lfm2_vl": "lfm2"}


@dataclass(frozen=True)
class Family:
    name: str
    directory: Path
    model: torch.nn.Module  # the reference, transformers' own classes
    prompts: list[list[int]]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_started_as_the_backend_starts_it_gives_generates_tokens(family, tmp_path):
    prepared = prepare(family, tmp_path)
    engine, ready = start_engine(BackendConfig(model=str(prepared.directory), **EXACT))
    assert ready.model_name == family and ready.vocab_size == TINY_VOCAB
    assert_generates_tokens(prepared, complete_in_the_engine(engine, prepared.prompts))


def test_families_give_generates_tokens_through_the_api(tmp_path):
    prepared = [prepare(family, tmp_path) for family in SERVED]
    with ThreadPoolExecutor(len(prepared)) as pool:
        served = list(pool.map(complete_through_a_server, prepared))
    for family, texts in zip(prepared, served, strict=True):
        assert_generates_tokens(family, texts)


def assert_generates_tokens(family: Family, texts: list[str]) -> None:
    for prompt, text in zip(family.prompts, texts, strict=True):
        expected = reference_greedy(family.model, prompt, MAX_TOKENS, {TINY_EOS})
        assert MarkerTokenizer.ids(text) == expected, f"{family.name}: {prompt}"


def prepare(family: str, tmp_path: Path) -> Family:
    """The family's model directory, the reference model loaded from it, and six prompts sharing a prefix."""
    # Falcon-RW: Falcon with ALiBi positions (tests/backend/test_falcon.py's shape)
    # Qwen3.5 as published: the multimodal model, whose own `generate` is then the reference
    # Gemma 4 too
    build = {
        "falcon_rw": lambda: tiny_falcon(SHAPES["rw"]),
        "qwen3_5": tiny_qwen3_5_multimodal,
        "gemma4": tiny_gemma4_multimodal,
        "gemma4_unified": lambda: tiny_gemma4_multimodal("gemma4_unified"),
        "qwen3_vl": lambda: tiny_qwen_vl("qwen3_vl"),
        "qwen3_vl_moe": lambda: tiny_qwen_vl("qwen3_vl_moe"),
        "qwen2_5_vl": lambda: tiny_qwen_vl("qwen2_5_vl"),
    }.get(family)
    built = build() if build is not None else None
    if family == "gemma3n":  # the text model's weights and tokenizer, then the composite's config and names
        built = tiny_model("gemma3n_text")
        directory = write_gemma3n_multimodal(write_tiny_causal_lm(tmp_path / family, family, built), built)
    elif family in TEXT_MODELS:  # the same, Ministral 3's, Gemma 3's and Llama 4's
        built = tiny_model(TEXT_MODELS[family])
        directory = write_tiny_causal_lm(tmp_path / family, family, built)
        transformers_4_names = family not in ("mistral3", "lfm2_vl")
        directory = write_multimodal(directory, built, family, transformers_4_names=transformers_4_names)
    else:
        directory = write_tiny_causal_lm(tmp_path / family, family, built)
    model = built.eval() if built is not None else AutoModelForCausalLM.from_pretrained(directory).eval()
    rng = random.Random(family)
    shared = [rng.randrange(2, TINY_EOS) for _ in range(12)]
    prompts = [
        shared + [rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(1, 20))] for _ in range(6)
    ]
    return Family(family, directory, model, prompts)


def complete_in_the_engine(engine: Engine, prompts: list[list[int]]) -> list[str]:
    """Each prompt's greedy completion, all submitted at once, as the backend's loop steps them."""
    texts = {f"p{i}": "" for i in range(len(prompts))}
    for request_id, prompt in zip(texts, prompts, strict=True):
        engine.submit(Submit(request_id, tuple(prompt), SamplingParams(temperature=0, max_tokens=MAX_TOKENS)))
    while engine.has_work:
        for piece in engine.step():
            assert piece.error is None, piece.error
            texts[piece.request_id] += piece.text
    return list(texts.values())


def complete_through_a_server(family: Family) -> list[str]:
    """Each prompt's greedy completion from a server of the family's model directory, all at once."""
    options = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in EXACT.items())
    with running_server("--model", str(family.directory), *options.split(), ready_timeout=300) as server:
        name = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]

        def complete(prompt: list[int]) -> str:
            body = {"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            response = requests.post(f"{server.url}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(family.prompts)) as pool:
            return list(pool.map(complete, family.prompts))
