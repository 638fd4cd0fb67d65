"""Incremental detokenization: token ids in, whole UTF-8 characters out.

Decoding one token at a time breaks multi-byte characters (an emoji is often
several byte-level tokens) and loses the spaces that some tokenizers add only
in context. So each new token is decoded together with a few tokens before it,
and the text is released only once it no longer ends in a partial character.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5  # tokens of left context decoded with each new one


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def decode_function(tokenizer: Decoder) -> Callable[[list[int], bool], str]:
    """The fastest call that returns what `tokenizer.decode(ids, skip_special_tokens)` does: the Rust
    tokenizer's own decode where transformers' wrapper only adds its own checks around it (a fast
    tokenizer that does not clean up spaces: `_decode` in transformers' tokenization_utils_tokenizers).
    The wrapper's conversions took four fifths of a decode, and a step decodes twice a row: about 0.4 ms
    of a 32-row step's host time on a small CPU, time a GPU's step waits for."""
    backend = getattr(tokenizer, "_tokenizer", None)
    cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", True)
    if backend is not None and hasattr(backend, "decode") and cleans_up is False:
        return lambda token_ids, skip_special_tokens: backend.decode(
            token_ids, skip_special_tokens=skip_special_tokens
        )
    return lambda token_ids, skip_special_tokens: tokenizer.decode(
        token_ids, skip_special_tokens=skip_special_tokens
    )


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Decoder, prompt_ids: list[int] | tuple[int, ...], skip_special_tokens: bool = True
    ):
        self.decode = decode_function(tokenizer)  # the tokenizer's decode, by its fastest call
        self.skip_special_tokens = skip_special_tokens  # False: special tokens' text is text too
        self.token_ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the context window
        self.read_offset = len(self.token_ids)  # end of what has been released

    def add(self, token_id: int) -> str:
        """Take one generated token; return the text it completes (maybe empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # a character is still incomplete: wait for its next byte
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        return self.decode(token_ids, self.skip_special_tokens)
