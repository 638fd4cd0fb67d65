"""Each model family the engine serves through transformers' own modules, through the real server: a tiny
random-weight model of the family, saved with a tokenizer whose token `i` is the text "<i>", served in
the exact mode with prompts in chunks of 8 tokens; six greedy completions at once, whose prompts share
a prefix, each give the token ids `generate` gives on the prompt alone (SPEC §5).

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

from tests.backend.models import TINY_EOS, TINY_VOCAB, MarkerTokenizer, reference_greedy, write_tiny_causal_lm
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
    "falcon",
    "falcon_rw",
    # A recurrent state a row (model/mamba.py): Mamba's and Mamba-2's runner paths; and the hybrids'
    # mixers over the rows, Mamba-2's (Granite 4's, as Bamba's, Falcon-H1's and Nemotron-H's) and
    # Mamba's (Jamba's, as Falcon-Mamba's). test_exactness holds each of those families to `generate`.
    "mamba",
    "mamba2",
    "granitemoehybrid",
    "jamba",
]
MAX_TOKENS = 10
# Two families a test, their servers side by side: a server's start is most of a family's test (about
# 5 s, mostly one core's), and this machine has two. Only the servers and their requests run in threads:
# transformers' model building patches process-wide state (its weight initialisation, the meta device),
# which two threads building at once left patched for the rest of the session.
PAIRS = [FAMILIES[i : i + 2] for i in range(0, len(FAMILIES), 2)]


@dataclass(frozen=True)
class Family:
    name: str
    directory: Path
    model: torch.nn.Module  # the reference, transformers' own classes
    prompts: list[list[int]]


@pytest.mark.parametrize("families", PAIRS, ids=["+".join(pair) for pair in PAIRS])
def test_the_family_gives_generates_tokens_through_the_api(families, tmp_path):
    prepared = [prepare(family, tmp_path) for family in families]
    with ThreadPoolExecutor(len(prepared)) as pool:
        served = list(pool.map(complete_through_a_server, prepared))
    for family, texts in zip(prepared, served, strict=True):
        for prompt, text in zip(family.prompts, texts, strict=True):
            expected = reference_greedy(family.model, prompt, MAX_TOKENS, {TINY_EOS})
            assert MarkerTokenizer.ids(text) == expected, f"{family.name}: {prompt}"


def prepare(family: str, tmp_path: Path) -> Family:
    """The family's model directory, the reference model loaded from it, and six prompts sharing a prefix."""
    # Falcon-RW: Falcon with ALiBi positions (tests/backend/test_falcon.py's shape)
    built = tiny_falcon(SHAPES["rw"]) if family == "falcon_rw" else None
    directory = write_tiny_causal_lm(tmp_path / family, family, built)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    rng = random.Random(family)
    shared = [rng.randrange(2, TINY_EOS) for _ in range(12)]
    prompts = [
        shared + [rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(1, 20))] for _ in range(6)
    ]
    return Family(family, directory, model, prompts)


def complete_through_a_server(family: Family) -> list[str]:
    """Each prompt's greedy completion from a server of the family's model directory, all at once."""
    options = "--dtype float32 --quantize none --rows 4 --max-seq-len 128 --max-prefill-tokens 8"
    with running_server("--model", str(family.directory), *options.split(), ready_timeout=300) as server:
        name = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]

        def complete(prompt: list[int]) -> str:
            body = {"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            response = requests.post(f"{server.url}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(family.prompts)) as pool:
            return list(pool.map(complete, family.prompts))
