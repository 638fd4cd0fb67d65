"""Quantized checkpoints as people download them, through the real server and the official `openai`
client: a GPTQ checkpoint (written to GPTQModel's packing, tests/backend/group_wise_files.py) and
Q4_K_M GGUF files (tests/backend/gguf_files.py: a Llama's, and a Mixtral's), each served in the default
mode from its own 4-bit blocks (the GPTQ checkpoint's act-order layers from 8-bit blocks of theirs), a
"-bnb-4bit" checkpoint that bitsandbytes wrote (tests/backend/bitsandbytes_files.py) from 8-bit blocks
of its NF4 weights, and gpt-oss's MXFP4 experts, of its checkpoint and of its GGUF file, from their own
blocks; greedy completions against `generate` on the same weights dequantized."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from gguf import GGMLQuantizationType
from openai import OpenAI

from backend.messages import BackendConfig
from backend.model.loader import load_model
from backend.model.source import default_model_path
from tests.backend.bitsandbytes_files import write_bitsandbytes_checkpoint
from tests.backend.gguf_files import q4_k_m, write_tiny_gguf
from tests.backend.group_wise_files import write_group_wise_checkpoint
from tests.backend.models import TINY_EOS, TINY_VOCAB, MarkerTokenizer, reference_greedy, tiny_model
from tests.backend.mxfp4_files import weighty_gpt_oss, write_mxfp4_checkpoint
from tests.server_fixture import running_server

MAX_TOKENS = 8


def completions_agreeing(
    model_path: str, reference: torch.nn.Module, matches: Callable[[str, list[int]], bool], eos_ids: set[int]
) -> int:
    """How many of ten greedy completions `matches` `generate`'s tokens on the reference model."""
    rng = random.Random(3)
    prompts = [[rng.randrange(2, TINY_VOCAB - 1) for _ in range(rng.randrange(2, 30))] for _ in range(10)]
    options = "--dtype float32 --rows 4 --max-seq-len 128"
    with running_server("--model", model_path, *options.split(), ready_timeout=300) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        name = client.models.list().data[0].id
        agreeing = 0
        for prompt in prompts:
            text = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            expected = reference_greedy(reference, prompt, MAX_TOKENS, eos_ids)
            agreeing += matches(text.choices[0].text, expected)
    return agreeing


def marker_ids_match(text: str, ids: list[int]) -> bool:
    return MarkerTokenizer.ids(text) == ids


def test_a_gptq_checkpoint_is_served_from_its_blocks(tmp_path):
    """Its down projections quantized in act order (desc_act: their groups' inputs scattered), the other
    layers in groups of consecutive inputs: both kinds in one model."""
    directory = tmp_path / "tiny-GPTQ-Int4"
    expected = write_group_wise_checkpoint(
        directory,
        "gptq",
        group_size=32,
        symmetric=True,
        act_order=lambda module: module.endswith("down_proj"),
    )
    reference = tiny_model("llama")
    for module, weight in expected.items():
        reference.get_submodule(module).weight.data = weight
    # int8 activations may tip a near-tie of the random model; a layer read wrong tips them all
    assert completions_agreeing(str(directory), reference, marker_ids_match, {TINY_EOS}) >= 8


def test_a_bnb_4bit_checkpoint_is_served_from_8_bit_blocks_of_its_weights(tmp_path):
    directory = tmp_path / "tiny-bnb-4bit"
    write_bitsandbytes_checkpoint(directory, "nf4-double-quant")
    exact = BackendConfig(model=str(directory), dtype="float32", quantize="none", cache_dir=str(tmp_path))
    reference = load_model(exact).model  # the library's weights (tests/backend/test_bitsandbytes.py)
    assert completions_agreeing(str(directory), reference, marker_ids_match, {TINY_EOS}) >= 8


@pytest.mark.parametrize("family", ["llama", "mixtral"])  # Mixtral: a "llama" file with experts
def test_a_q4_k_m_gguf_file_is_served_from_its_blocks(family, tmp_path, monkeypatch):
    monkeypatch.setenv("INFERENCE_CACHE_DIR", str(tmp_path / "cache"))  # the server's converted copy
    model = tiny_model(family, hidden_size=256, intermediate_size=512, head_dim=64)
    path = write_tiny_gguf(tmp_path / "tiny-Q4_K_M.gguf", model, default_model_path(), q4_k_m)
    exact = BackendConfig(
        model=str(path), dtype="float32", quantize="none", cache_dir=str(tmp_path / "exact")
    )
    reference = load_model(exact)
    eos = reference.model.generation_config.eos_token_id
    eos_ids = set(eos) if isinstance(eos, list) else {eos}

    def same_text(text: str, ids: list[int]) -> bool:
        return text == reference.tokenizer.decode(ids)

    # Fewer than GPTQ's: Q4_K's blocks keep d * s in fp16, and this random model's logits are near-ties
    # (on bfloat16 activations rounded to int8 a block; tests/backend/test_gguf_families.py holds the
    # logits to the file's). A layer read wrong agrees on none.
    assert completions_agreeing(str(path), reference.model, same_text, eos_ids) >= 4


def test_a_gpt_oss_mxfp4_checkpoint_is_served_from_its_own_blocks(tmp_path):
    """openai/gpt-oss-20b's form (tests/backend/mxfp4_files.py): its experts from MXFP4 blocks of exactly
    the checkpoint's weights, never held as floats."""
    directory = tmp_path / "tiny-gpt-oss"
    write_mxfp4_checkpoint(directory, weighty_gpt_oss())
    exact = BackendConfig(model=str(directory), dtype="float32", quantize="none", cache_dir=str(tmp_path))
    reference = load_model(exact).model  # transformers' dequantization of the same checkpoint
    # a random model's near-ties tip on int8 activations; an expert read wrong agrees on none
    assert completions_agreeing(str(directory), reference, marker_ids_match, {TINY_EOS}) >= 6


def test_a_gpt_oss_gguf_file_is_served_from_its_mxfp4_blocks(tmp_path, monkeypatch):
    """ggml-org's form (experts MXFP4, the rest Q8_0), which transformers cannot read: served from its
    own blocks, the experts never held as floats (model/gguf_gpt_oss.py)."""
    monkeypatch.setenv("INFERENCE_CACHE_DIR", str(tmp_path / "cache"))

    def mix(name: str) -> GGMLQuantizationType:  # llama-quantize's MXFP4_MOE
        return GGMLQuantizationType.MXFP4 if "_exps." in name else GGMLQuantizationType.Q8_0

    path = write_tiny_gguf(tmp_path / "tiny-gpt-oss.gguf", weighty_gpt_oss(), default_model_path(), mix)
    exact = BackendConfig(
        model=str(path), dtype="float32", quantize="none", cache_dir=str(tmp_path / "exact")
    )
    reference = load_model(exact)

    def same_text(text: str, ids: list[int]) -> bool:
        return text == reference.tokenizer.decode(ids)

    eos = reference.model.generation_config.eos_token_id
    eos_ids = set(eos) if isinstance(eos, list) else {eos}
    # As the Q4_K_M files' (its attention Q8_0, activations int8 a block): 6 of 10 here, and 0 with its
    # experts' gate and up joined rather than interleaved
    assert completions_agreeing(str(path), reference.model, same_text, eos_ids) >= 4
