"""The frontend tokenizes as the model's tokenizer does, and never imports torch doing it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from inference_api.tokenizer import ByteTokenizer, ModelTokenizer, load_tokenizer
from tests.server_fixture import ROOT

TEXTS = [
    "Hello world",
    " leading and trailing spaces ",
    "héllo 日本語 🎉 naïve café",
    "<|im_start|>user\nhi<|im_end|>\n",
    "line one\n\nline two\ttab",
    "a" * 500,
]


@pytest.fixture(scope="module")
def saved_tokenizer(default_tokenizer_dir: Path) -> Path:
    """The default model's tokenizer saved as the backend saves it (transformers' save_pretrained)."""
    return default_tokenizer_dir


def test_byte_tokenizer_for_the_mock() -> None:
    assert ByteTokenizer().encode("hé") == [104, 195, 169]
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def test_model_tokenizer_matches_transformers(saved_tokenizer: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(saved_tokenizer)
    ours = load_tokenizer(str(saved_tokenizer))
    assert isinstance(ours, ModelTokenizer)
    for text in TEXTS:
        assert ours.encode(text) == reference(text)["input_ids"], text


def test_a_directory_without_tokenizer_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        ModelTokenizer(str(tmp_path))


def test_the_frontend_never_imports_torch(saved_tokenizer: Path) -> None:
    # A fresh interpreter: this test process has imported torch through transformers.
    script = textwrap.dedent(
        f"""
        import sys
        from backend.messages import BackendConfig
        from inference_api import create_app
        from inference_api.config import ServerConfig
        from inference_api.tokenizer import load_tokenizer

        app = create_app(ServerConfig(backend=BackendConfig(mock=True, mock_tokens_per_second=1000)))
        router = app.extensions["router"]
        assert router.wait_ready(30)
        response = app.test_client().post("/predictions/mock", json={{"text": "hi", "max_tokens": 3}})
        assert response.status_code == 200, response.data
        assert load_tokenizer({str(saved_tokenizer)!r}).encode("hello")
        router.stop()
        assert "torch" not in sys.modules, "the frontend imported torch"
        print("no torch")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no torch" in result.stdout


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_pair_is_cut_longest_first_as_transformers_cuts_it(tmp_path: Path, side: str) -> None:
    """A rerank pair cut to fit (truncate_prompt_tokens, TEI's truncate): the ids and token types that
    transformers' tokenizer(query, document, truncation=True, max_length=...) gives, from either end."""
    from transformers import AutoTokenizer

    from tests.backend.models import write_tiny_bert

    directory = write_tiny_bert(tmp_path / "reranker", reranker=True)
    reference = AutoTokenizer.from_pretrained(directory, truncation_side=side)
    ours = ModelTokenizer(str(directory))
    assert ours.pair_special_tokens == 3  # [CLS] query [SEP] document [SEP]
    short, long = "the cat sat", "stock markets fell sharply today on the mat"
    # The longer text alone cut, both cut to halves (an odd one and an even one), nothing cut.
    for first, second in [(short, long), (long, short), (long, long + " a cat")]:
        for most in (12, 17, 18, 60):
            expected = reference(first, second, truncation=True, max_length=most)
            assert len(expected.input_ids) == min(most, len(reference(first, second).input_ids))
            ids, start = ours.encode_pair(first, second, most, direction=side)
            assert ids == expected.input_ids, (first, second, most)
            assert start == expected.token_type_ids.index(1)
    # Cohere's max_tokens_per_doc: the document alone cut to that many tokens.
    query_tokens = len(reference(short).input_ids)  # with [CLS] and [SEP]
    expected = reference(short, long, truncation="only_second", max_length=query_tokens + 4 + 1)
    assert ours.encode_pair(short, long, second_most=4, direction=side)[0] == expected.input_ids
