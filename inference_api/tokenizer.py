"""Turning a prompt into token ids in the frontend, without torch.

The frontend tokenizes so that it can check prompt + max_tokens against the
model's context and answer 400 before anything reaches the backend.
transformers' AutoTokenizer imports torch whenever torch is installed, so the
model's tokenizer is read with the `tokenizers` library, which transformers'
fast tokenizers are built on, from the tokenizer.json the backend saved.
"""

from __future__ import annotations

import json
import os
import re
from functools import cache, cached_property
from typing import Protocol

from tokenizers import Encoding, Tokenizer


class PromptTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_cut(self, text: str, most: int, direction: str) -> list[int]:
        """`encode(text)` cut to `most` tokens with its special tokens, as transformers' tokenizer(text,
        truncation=True, max_length=most) cuts it: from the text's end, or (`direction` "left") its start."""
        ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (what logprobs name it)."""
        ...

    def special_token_id(self, text: str) -> int | None:
        """The id of the special token whose text this is (`<|im_end|>`), else None."""
        ...

    def token_id(self, text: str) -> int | None:
        """The id of the token, special or not, whose text this is whole (`▁<PRE>`), else None."""
        ...

    def is_added(self, text: str) -> bool:
        """Whether this text is a token added to the vocabulary (`added_tokens`), special or not."""
        ...

    def encode_text(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`text` as plain text, special tokens' texts in it spelled out as any other text: code that holds
        `<|endoftext|>`, say, stays code (llama.cpp's parse_special false). No special tokens are added
        unless asked (`add_special_tokens`: the BOS, say, that `encode` adds)."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: its text's, or, for a token that is part of a character (a
        byte-level BPE token, a SentencePiece byte such as `<0xC3>`), the bytes its text alone cannot
        show (llama.cpp's piece)."""
        ...


def stop_token_ids_of(stop: tuple[str, ...], tokenizer: PromptTokenizer) -> tuple[int, ...]:
    """The stop strings that are special tokens, as token ids.

    Generated text leaves special tokens out (as transformers' decode with
    skip_special_tokens does), so a stop string such as `<|im_end|>` or
    `</tool_call>` could never match it: the row stops on the token instead.
    """
    ids = (tokenizer.special_token_id(text) for text in stop)
    return tuple(i for i in ids if i is not None)


def are_tokens(texts: tuple[str, ...], tokenizer: PromptTokenizer) -> bool:
    """Whether each text is a token of its own (a tag the model writes whole, not spelled out)."""
    return all(len(tokenizer.encode(text, add_special_tokens=False)) == 1 for text in texts)


def are_grammar_tokens(texts: tuple[str, ...], tokenizer: PromptTokenizer) -> bool:
    """Whether each text is a token that llguidance takes as a special token: a token of its own that the
    tokenizer marks special, or an added one whose text is between angle brackets, which llguidance takes
    as special whatever the tokenizer marks (Qwen3's and DeepSeek-R1's `<think>`, Qwen's `<tool_call>`,
    which are not marked). No text or string of a grammar holds such a token: a grammar names it as one."""
    return are_tokens(texts, tokenizer) and all(
        tokenizer.special_token_id(text) is not None
        or (tokenizer.is_added(text) and text.startswith("<") and text.endswith(">"))
        for text in texts
    )


class ByteTokenizer:
    """For the mock backend, which has no vocabulary: one id per UTF-8 byte of the prompt."""

    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_cut(self, text: str, most: int, direction: str) -> list[int]:
        ids = self.encode(text)
        return ids[-most:] if direction == "left" else ids[:most]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def special_token_id(self, text: str) -> int | None:
        return None

    def token_id(self, text: str) -> int | None:
        return None

    def is_added(self, text: str) -> bool:
        return False

    def encode_text(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.encode(text)

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])


class ModelTokenizer:
    """The model's own tokenizer; `encode(text)` gives the ids of `tokenizer(text)` in transformers."""

    def __init__(self, directory: str):
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"the backend's tokenizer directory {directory} has no tokenizer.json")
        self._tokenizer = Tokenizer.from_file(path)
        # transformers resets these on every call; a saved file may still carry them.
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self._special_ids = {
            token.content: token_id
            for token_id, token in self._tokenizer.get_added_tokens_decoder().items()
            if token.special
        }

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # add_special_tokens=True applies the post-processor, as tokenizer(text) does; a rendered
        # chat template already holds its special tokens (as in apply_chat_template).
        return encoded(self._tokenizer, text, add_special_tokens=add_special_tokens).ids

    def encode_cut(self, text: str, most: int, direction: str) -> list[int]:
        encoding = encoded(self._tokenizer, text, add_special_tokens=False)
        encoding.truncate(
            max(0, most - self._tokenizer.num_special_tokens_to_add(False)), direction=direction
        )
        return self._tokenizer.post_process(encoding).ids

    def encode_pair(
        self,
        first: str,
        second: str,
        most: int | None = None,
        second_most: int | None = None,
        direction: str = "right",
    ) -> tuple[list[int], int | None]:
        """Two texts joined as `tokenizer(first, second)` joins them (a cross-encoder's query and document),
        and where the second's token type 1 begins (None where the tokenizer gives both one type).

        `second_most` cuts the second text to that many tokens; `most` the pair to that many in all, its
        special tokens with them, as transformers' and Text Embeddings Inference's "longest_first" cuts
        it: the longer text down to what the shorter leaves, and where both are longer than half, each to
        half. The tokens go from each text's end (`direction` "left": from its start)."""
        if most is None and second_most is None:
            encoding = encoded(self._tokenizer, (first, second))
        else:
            texts = [encoded(self._tokenizer, text, add_special_tokens=False) for text in (first, second)]
            lengths = [
                len(texts[0]),
                len(texts[1]) if second_most is None else min(len(texts[1]), second_most),
            ]
            if most is not None:
                lengths = longest_first(lengths, most - self.pair_special_tokens)
            for text, length in zip(texts, lengths, strict=True):
                text.truncate(length, direction=direction)
            encoding = self._tokenizer.post_process(texts[0], texts[1])
        return encoding.ids, encoding.type_ids.index(1) if 1 in encoding.type_ids else None

    @property
    def pair_special_tokens(self) -> int:
        """The special tokens joining a pair adds ([CLS], [SEP] and [SEP] for BERT)."""
        return self._tokenizer.num_special_tokens_to_add(True)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def special_token_id(self, text: str) -> int | None:
        return self._special_ids.get(text)

    def token_id(self, text: str) -> int | None:
        return self._tokenizer.token_to_id(text)

    def is_added(self, text: str) -> bool:
        return text in self._added

    def encode_text(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return encoded(self._plain_text, text, add_special_tokens=add_special_tokens).ids

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.id_to_token(token_id)
        kinds = self._decoder_kinds
        if piece is None or piece in self._added:
            return self.token_text(token_id).encode()
        if "ByteLevel" in kinds:  # each character a byte: the space before a word is "Ġ"
            byte_of = byte_level_bytes()
            if all(character in byte_of for character in piece):
                return bytes(byte_of[character] for character in piece)
        if "ByteFallback" in kinds and (byte := SENTENCEPIECE_BYTE.fullmatch(piece)):
            return bytes([int(byte[1], 16)])
        if kinds & {"Metaspace", "Replace"}:  # SentencePiece's: decoding one token alone drops its space
            return piece.replace(METASPACE, " ").encode()
        return self.token_text(token_id).encode()

    @cached_property
    def _decoder_kinds(self) -> set[str]:
        """The kinds of step the tokenizer's decoder takes (`ByteLevel`; `Replace`, `ByteFallback`, ...)."""
        decoder = json.loads(self._tokenizer.to_str()).get("decoder") or {}
        return {step.get("type") for step in decoder.get("decoders") or [decoder]}

    @cached_property
    def _added(self) -> set[str]:
        return {token.content for token in self._tokenizer.get_added_tokens_decoder().values()}

    @cached_property
    def _plain_text(self) -> Tokenizer:
        """A copy that splits special tokens' texts as text: the setting is the tokenizer's, not a call's,
        and request threads share this one."""
        plain = Tokenizer.from_str(self._tokenizer.to_str())
        plain.encode_special_tokens = True
        return plain


def encoded(tokenizer: Tokenizer, text: str | tuple[str, str], add_special_tokens: bool = True) -> Encoding:
    """`tokenizer.encode(text)` (a pair too) as a batch of one, which lets other threads run meanwhile:
    `encode` holds the GIL throughout, and a 1 MiB prompt's 0.4 s of it held up every stream the worker
    was sending (the router thread waits for the GIL); the batch call releases it. Its "fast" form keeps
    no character offsets, which nothing here reads, and takes half the time."""
    return tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]


METASPACE = "\u2581"  # SentencePiece's space
SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback token


@cache
def byte_level_bytes() -> dict[str, int]:
    """The byte each character of a byte-level BPE vocabulary (GPT-2's, Llama 3's, Qwen's) stands for:
    the printable bytes as themselves, the rest as the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [byte for byte in range(256) if byte not in printable]
    return {chr(byte): byte for byte in printable} | {chr(256 + i): byte for i, byte in enumerate(others)}


def longest_first(lengths: list[int], most: int) -> list[int]:
    """Two texts' lengths cut to `most` tokens in all: the longer one's down to what the shorter leaves
    (never below the shorter), and where that is not enough, `most` shared in halves (the second the
    odd token)."""
    shorter, longer = sorted(lengths)
    if shorter + longer <= most:
        return lengths
    most = max(0, most)
    cut = [most // 2, most - most // 2] if shorter > most // 2 else [shorter, most - shorter]
    return cut if lengths[0] <= lengths[1] else cut[::-1]


def load_tokenizer(directory: str | None) -> PromptTokenizer:
    """The tokenizer a backend reported in BackendReady.tokenizer_path (None: the mock)."""
    if directory is None:
        return ByteTokenizer()
    return ModelTokenizer(directory)
