"""Token-id prompts are checked against the model's embedding, not only the tokenizer (issue 15, item 7).

A model directory whose embedding has fewer rows than its tokenizer has ids
(here a tiny random Llama with 1,024 rows and the default model's 49,152-id
tokenizer, as a model with added tokens it was never resized for would be)
must answer an id past its embedding with a 400 naming the prompt, never
with a failed step, and go on serving.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from transformers import AutoTokenizer

from tests.backend.models import tiny_model
from tests.server_fixture import RunningServer, running_server

EMBEDDING_ROWS = 1024


@pytest.fixture(scope="module")
def small_embedding_server(tmp_path_factory, default_tokenizer_dir: Path) -> Iterator[RunningServer]:
    directory: Path = tmp_path_factory.mktemp("small-embedding")
    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_dir)
    tiny_model("llama", vocab_size=EMBEDDING_ROWS, eos_token_id=tokenizer.eos_token_id).save_pretrained(
        directory
    )
    tokenizer.save_pretrained(directory)
    with running_server(
        "--model", str(directory), "--rows", "2", "--max-seq-len", "128", ready_timeout=300
    ) as server:
        yield server


def test_an_id_past_the_embedding_is_a_400_and_the_server_goes_on(small_embedding_server):
    model = requests.get(f"{small_embedding_server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": [5, EMBEDDING_ROWS + 100], "max_tokens": 3, "ignore_eos": True}
    refused = requests.post(f"{small_embedding_server.url}/v1/completions", json=body, timeout=60)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "prompt" and str(EMBEDDING_ROWS) in error["message"]
    body["prompt"] = [5, EMBEDDING_ROWS - 1]
    served = requests.post(f"{small_embedding_server.url}/v1/completions", json=body, timeout=60)
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["completion_tokens"] == 3
