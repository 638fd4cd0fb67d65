"""The fill-in-the-middle prompt (inference_api/fill_in_middle.py) on the vocabularies the end-to-end tests'
Qwen-like one does not cover: CodeLlama's, whose tokenizer puts a BOS first and whose vocabulary has no
repository or file separator tokens (other files then go after llama.cpp's plain-text separator, with no
names), and which ends a middle with its own `<EOT>`; and a vocabulary with no such tokens at all."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

from backend.messages import InvalidParams
from inference_api.fill_in_middle import (
    ContextFile,
    context_ids,
    fill_prompt,
    fill_tokens,
    required_fill_tokens,
)
from inference_api.tokenizer import ModelTokenizer

# "a.py" and "myproject" are words, so that a file's name or the project's line would show if written.
WORDS = ["<unk>", "<s>", "</s>", "def", "f", "return", "x", "---", "snippet", "a.py", "myproject"]
DEF, F, RETURN, X, DASHES, SNIPPET = range(3, 9)
CODE_LLAMA_TOKENS = ["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"]


def saved_tokenizer(directory: Path, special: list[str], bos: bool) -> ModelTokenizer:
    """A word-level tokenizer (each word a token, whitespace dropped), saved as the backend saves one."""
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(text, special=True) for text in ["<s>", "</s>", *special]])
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(directory / "tokenizer.json"))
    return ModelTokenizer(str(directory))


def test_code_llamas_prompt_has_its_bos_first_and_files_after_plain_separators(tmp_path):
    tokenizer = saved_tokenizer(tmp_path, CODE_LLAMA_TOKENS, bos=True)
    tokens = required_fill_tokens(tokenizer, "suffix")
    pre, suf, mid, eot = (tokenizer.token_id(text) for text in CODE_LLAMA_TOKENS)
    assert (tokens.prefix, tokens.suffix, tokens.middle) == (pre, suf, mid)
    assert tokens.repo is None and tokens.file_separator is None and tokens.ends == (eot,)
    files = context_ids(tokenizer, tokens, [ContextFile("x", "a.py"), ContextFile("return x")])
    separator = [DASHES, SNIPPET, DASHES]  # llama.cpp's "\n\n--- snippet ---\n\n"; no names, no project
    assert files == [*separator, X, *separator, RETURN, X]
    prompt = fill_prompt(
        tokenizer, tokens, tokenizer.encode_text("def f"), tokenizer.encode_text("return x"), files
    )
    assert prompt == [1, *files, pre, DEF, F, suf, RETURN, X, mid]


def test_a_vocabulary_without_the_three_tokens_cannot_fill_in_the_middle(tmp_path):
    tokenizer = saved_tokenizer(tmp_path, ["▁<PRE>", "▁<SUF>"], bos=False)  # no middle token
    assert fill_tokens(tokenizer) is None
    with pytest.raises(InvalidParams, match="cannot fill in the middle") as failure:
        required_fill_tokens(tokenizer, "input_prefix")
    assert failure.value.param == "input_prefix"
