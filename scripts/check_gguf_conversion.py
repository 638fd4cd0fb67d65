#!/usr/bin/env python
r"""This server's reading of GGUF files against llama.cpp's own converter, family by family.

    .venv/bin/python scripts/check_gguf_conversion.py --llama-cpp DIR [--cases smollm3 granite ...]

The tests write their GGUF files with a mirror of llama.cpp's convert_hf_to_gguf.py
(tests/backend/gguf_files.py); this checks the mirror's model of it against the converter itself. For
each case, a tiny random checkpoint of the family (the default model's tokenizer, saved beside it) is
converted by `DIR/convert_hf_to_gguf.py --outtype f32` and loaded by this server's loader in the exact
mode (float32, no quantization); its logits over a 40-token prompt are compared with the checkpoint's own
under transformers. A case that reads the file as its model is 0 apart. `DIR` is a llama.cpp source tree
(its gguf-py is used, not the installed gguf); the converter imports sentencepiece for Llama-shaped
families, so install it where the converter's Python finds it (`--python-path`). Needs no network.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PreTrainedTokenizerBase

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.messages import BackendConfig  # noqa: E402
from backend.model.loader import load_model, load_tokenizer  # noqa: E402
from scripts.bench_engine import machine  # noqa: E402

SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
)
WINDOW = 8  # shorter than the prompt: window layers attend to fewer positions than global ones
# Each case: the family's model type and its config beyond SHAPE, as its released models have it where
# the file cannot say otherwise (llama.cpp's own rules: which layers are global, Gemma's attention scale)
CASES: dict[str, tuple[str, dict]] = {
    "llama 3.2 rotation": (
        "llama",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            max_position_embeddings=131072,
        ),
    ),
    "gemma 3 linear": (
        "gemma3_text",
        dict(
            num_hidden_layers=6,
            sliding_window=WINDOW,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            query_pre_attn_scalar=64,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
    "qwen3 yarn": (
        "qwen3",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
            },
            max_position_embeddings=131072,
        ),
    ),
    "qwen3_moe": (
        "qwen3_moe",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True),
    ),
    "starcoder2": (
        "starcoder2",
        dict(sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e5}),
    ),
    # Ministral 3's text (Mistral3Model writes it as "mistral3"): YaRN, its queries scaled past 16 positions
    "ministral3": (
        "ministral3",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 16.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.1,
            },
            max_position_embeddings=256,
        ),
    ),
    # Mistral Small 3.1's and 3.2's text (a Mistral's), which Mistral3Model writes as "mistral3" too
    "mistral small 3": ("mistral", dict(sliding_window=None)),
    "smollm3": ("smollm3", dict(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0])),
    "granite": (
        "granite",
        dict(attention_multiplier=0.5, embedding_multiplier=4.0, residual_multiplier=0.5, logits_scaling=2.0),
    ),
    "olmo2": ("olmo2", {}),
    "arcee": ("arcee", {}),
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2)),
    "seed_oss": ("seed_oss", {}),
    "exaone4": ("exaone4", dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])),
    "cohere2": (
        "cohere2",
        dict(
            num_hidden_layers=4,
            sliding_window=WINDOW,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
        ),
    ),
}

# Cases whose checkpoints name another class than their model's, as the released ones do: Mistral Small
# 3.1's and 3.2's text is a Mistral's, published as Mistral3ForConditionalGeneration (written "mistral3")
CONVERTED_AS = {"mistral small 3": "Ministral3ForCausalLM"}


def random_checkpoint(model_type: str, extra: dict, tokenizer: PreTrainedTokenizerBase) -> torch.nn.Module:
    torch.manual_seed(0)
    ids = {  # the tokenizer's (a family's defaults are its own vocabulary's)
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id or 0,
    }
    config = CONFIG_MAPPING[model_type](**(SHAPE | ids | extra))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms away from 1: a norm read wrong then tells
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1 and "norm" in name:
                parameter.uniform_(0.5, 1.5)
    if model_type == "cohere2":
        config.rotary_pct = 1.0  # (Cohere2Model reads it; transformers' config no longer has it)
    return model


def convert(checkpoint: Path, out: Path, llama_cpp: Path, python_path: str) -> str | None:
    """Convert with llama.cpp's converter; its last line of error where it fails."""
    paths = [str(llama_cpp / "gguf-py"), str(llama_cpp), *filter(None, [python_path])]
    command = [
        sys.executable,
        str(llama_cpp / "convert_hf_to_gguf.py"),
        str(checkpoint),
        "--outfile",
        str(out),
    ]
    done = subprocess.run(
        [*command, "--outtype", "f32"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
        capture_output=True,
        text=True,
    )
    return done.stderr.strip().splitlines()[-1] if done.returncode else None


def check(name: str, work: Path, llama_cpp: Path, python_path: str) -> str:
    model_type, extra = CASES[name]
    tokenizer = load_tokenizer(BackendConfig(model=None))
    checkpoint = work / "checkpoint"
    model = random_checkpoint(model_type, extra, tokenizer)
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    if (
        name in CONVERTED_AS
    ):  # the class the converter picks its converter by (save_pretrained writes the model's)
        saved = json.loads((checkpoint / "config.json").read_text())
        (checkpoint / "config.json").write_text(json.dumps(saved | {"architectures": [CONVERTED_AS[name]]}))
    failed = convert(checkpoint, work / "model.gguf", llama_cpp, python_path)
    if failed:
        return f"the converter failed: {failed}"
    config = BackendConfig(
        model=str(work / "model.gguf"),
        dtype="float32",
        quantize="none",
        device="cpu",
        cache_dir=str(work / "cache"),
    )
    try:
        served = load_model(config).model
    except Exception as error:  # what the server would say at start-up
        return f"refused: {type(error).__name__}: {str(error)[:200]}"
    ids = torch.randint(2, len(tokenizer) - 1, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, expected = served(ids).logits, model(ids).logits
    apart = (
        f"{(got - expected).abs().max().item():.3g} apart (logits up to {expected.abs().max().item():.3g})"
    )
    return f"{apart}, the file's architecture {file_architecture(work / 'model.gguf')!r}"


def file_architecture(path: Path) -> str:
    return str(gguf.GGUFReader(str(path)).fields["general.architecture"].contents())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp source tree")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--python-path", default="", help="more paths for the converter (sentencepiece's)")
    args = parser.parse_args()
    print("| case | this server's logits against the checkpoint's |\n| --- | --- |")
    for name in args.cases:
        work = Path(tempfile.mkdtemp(prefix="gguf-check-"))
        try:
            print(f"| {name} | {check(name, work, args.llama_cpp, args.python_path)} |", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{machine()}")


if __name__ == "__main__":
    main()
