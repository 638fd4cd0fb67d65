"""A server whose model writes gpt-oss's harmony messages (inference_api/harmony.py), for the tests of the
APIs that read them: the default model's weights, with a tokenizer whose special tokens 3 to 9 are
renamed to harmony's markers, gpt-oss's real chat template, and `<|return|>` as its end token but not
`<|call|>` (as a GGUF file's may have them; gpt-oss's generation_config.json has both, and the server
ends harmony answers at either). Served in the exact mode.

SmolLM2 writes no harmony by itself: a `guided_grammar` that names the markers (llguidance writes
special tokens by name) makes it write the messages a test needs, so the text is known while the tokens,
the pieces they stream in and the markers between them are the engine's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import ROOT, whole_default_model_copy
from tests.server_fixture import RunningServer, running_server

TEMPLATE = ROOT / "tests" / "frontend" / "chat_templates" / "openai-gpt-oss-120b.jinja"
# SmolLM2's special tokens that become harmony's markers, by id.
MARKERS = {
    3: "<|start|>",
    4: "<|channel|>",
    5: "<|message|>",
    6: "<|end|>",
    7: "<|return|>",
    8: "<|call|>",
    9: "<|constrain|>",
}
END_TOKENS = [7, 0]  # <|return|>, <|endoftext|>


def harmony_model(directory: Path) -> Path:
    """The model directory: the default model's weights (linked), its tokenizer with harmony's markers."""
    source = whole_default_model_copy()
    model = directory / "harmony-smollm2"
    model.mkdir()
    for weights in source.glob("model*.safetensors*"):  # its shards and their index, or one file
        (model / weights.name).symlink_to(weights)
    (model / "config.json").write_text((source / "config.json").read_text())
    generation = json.loads((source / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": END_TOKENS}))
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    for token in tokenizer["added_tokens"]:
        if token["id"] in MARKERS:
            vocab[MARKERS[token["id"]]] = vocab.pop(token["content"])
            token["content"] = MARKERS[token["id"]]
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|return|>"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").write_text(TEMPLATE.read_text())
    return model


@contextmanager
def harmony_server(directory: Path) -> Iterator[RunningServer]:
    """The server, its model written into `directory`."""
    exact = ["--dtype", "float32", "--quantize", "none", "--rows", "4", "--max-seq-len", "1024"]
    with running_server("--model", str(harmony_model(directory)), *exact, ready_timeout=300) as server:
        yield server
