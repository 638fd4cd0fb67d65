"""The frontend tokenizes as the model's tokenizer does, and never imports torch doing it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
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


LONGEST_PROMPT = "word " * 200_000  # 1 MB, a request body's limit: 200,001 tokens, 0.2-0.4 s to encode


@pytest.mark.parametrize(
    "encode",
    [
        lambda tokenizer, text: tokenizer.encode(text),
        lambda tokenizer, text: tokenizer.encode_cut(text, 2048, "left"),
        lambda tokenizer, text: tokenizer.encode_text(text),
        lambda tokenizer, text: tokenizer.encode_pair(text[:1000], text),
    ],
    ids=["encode", "encode_cut", "encode_text", "encode_pair"],
)
def test_other_threads_run_while_a_long_prompt_is_encoded(saved_tokenizer: Path, encode) -> None:
    """The frontend's router thread hands every stream its tokens: a request thread encoding a long
    prompt must not hold the GIL the while (tokenizers' `encode` did, and each stream's next token
    waited)."""
    tokenizer = ModelTokenizer(str(saved_tokenizer))
    encode(tokenizer, "warm up")
    gaps, done = [], threading.Event()

    def ticking() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=ticking)
    ticker.start()
    time.sleep(0.05)
    started = time.perf_counter()
    assert encode(tokenizer, LONGEST_PROMPT)
    took = time.perf_counter() - started
    done.set()
    ticker.join()
    assert max(gaps) < took / 3, f"another thread waited {max(gaps):.3f} s of the {took:.3f} s encoding"


def test_a_long_prompt_encodes_as_transformers_encodes_it(saved_tokenizer: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(saved_tokenizer)
    ours = ModelTokenizer(str(saved_tokenizer))
    text = "héllo 日本語 🎉 naïve café <|im_start|> " * 2000
    assert ours.encode(text) == reference(text)["input_ids"]
    cut = reference(text, truncation=True, max_length=100)["input_ids"]
    assert ours.encode_cut(text, 100, "right") == cut


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


def test_each_tokens_bytes_join_into_the_texts_even_where_a_token_is_part_of_a_character(
    saved_tokenizer: Path,
) -> None:
    """llama-server's pieces: a byte-level vocabulary's (the default model's) tokens give back the bytes
    their characters stand for, an emoji's three tokens each a part of its four bytes."""
    tokenizer = ModelTokenizer(str(saved_tokenizer))
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert b"".join(tokenizer.token_bytes(token) for token in ids) == text.encode(), text
    parts = [tokenizer.token_bytes(token) for token in tokenizer.encode("🎉")]
    assert len(parts) > 1 and b"".join(parts) == "🎉".encode()
    assert "\ufffd" in tokenizer.token_text(tokenizer.encode("🎉")[0])  # its text alone cannot say it
    assert tokenizer.token_bytes(tokenizer.special_token_id("<|im_end|>")) == b"<|im_end|>"


def test_sentencepiece_tokens_keep_their_space_and_byte_tokens_their_byte(tmp_path: Path) -> None:
    """Llama 2's and Mistral's kind: "▁" is the space, which decoding a token alone strips, and a
    character outside the vocabulary falls back to tokens such as <0xC3>."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "\u2581": 1, "h": 2, "\u2581h": 3} | {f"<0x{b:02X}>": 4 + b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab, [("\u2581", "h")], unk_token="<unk>", byte_fallback=True))
    space = normalizers.Replace(" ", "\u2581")
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), space])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    ours = ModelTokenizer(str(tmp_path))
    ids = ours.encode("hé h")
    assert [ours.token_bytes(token) for token in ids] == [b" h", b"\xc3", b"\xa9", b" h"]
    assert ours.token_text(ids[0]) == "h"  # alone, decoding strips the space


def test_grammar_tokens_are_special_or_added_between_angle_brackets_as_llguidance_takes_them(
    tmp_path: Path,
) -> None:
    """llguidance takes an added `<...>` token as special whether the tokenizer marks it or not (Qwen3's
    `<think>`): `are_grammar_tokens` says which tags a grammar must name as tokens, as llguidance does."""
    import llguidance.hf

    from inference_api.tokenizer import are_grammar_tokens
    from tests.backend.models import byte_tokenizer

    tokens = ("<think>", "[X]", "[THINK]", "<|endoftext|>")
    hf = byte_tokenizer(tokens, text_tags=("<think>", "[X]"))
    hf.save_pretrained(tmp_path)
    ours, theirs = ModelTokenizer(str(tmp_path)), llguidance.hf.from_tokenizer(hf)
    for text in (*tokens, "<b>", "ee"):  # "<b>" spelled out; "ee" a token of the BPE vocabulary
        taken_as_special = len(hf.encode(text)) == 1 and theirs.is_special_token(hf.encode(text)[0])
        assert are_grammar_tokens((text,), ours) == taken_as_special, text
    assert are_grammar_tokens(("<think>", "[THINK]"), ours)
    assert not are_grammar_tokens(("<think>", "[X]"), ours)
    assert not are_grammar_tokens(("<think>",), ByteTokenizer())
