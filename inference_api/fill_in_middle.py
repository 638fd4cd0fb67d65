"""Fill-in-the-middle: a code model's prompt for the text that goes between a prefix and a suffix.

Code models (Qwen2.5-Coder, StarCoder 2, CodeLlama, DeepSeek-Coder, CodeGemma, Granite Code...) learned to
fill a gap from documents cut in three and joined, in prefix-suffix-middle order, by special tokens:

    [FIM_PRE] prefix [FIM_SUF] suffix [FIM_MID]      -> the middle, then an end token

Other files of the project may go before it, as Qwen2.5-Coder's repository-level format has them (and
llama.cpp's /infill writes them for every model, a plain-text separator where the vocabulary has no
file separator token):

    [FIM_REP]myproject\\n [FIM_SEP]a.py\\n <a.py's text> ... [FIM_SEP]filename\\n [FIM_PRE] ...

The tokens are found by their texts in the vocabulary, the texts llama.cpp looks for (its
llama-vocab.cpp), so that a model llama-server fills in, this server fills in too. The prefix, the
suffix and the files are plain text: a special token's text in the code stays text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from backend.messages import InvalidParams
from inference_api.tokenizer import PromptTokenizer

# Qwen's and CodeGemma's, SantaCoder's, StarCoder's and Granite's, DeepSeek-Coder's, CodeLlama's (two
# spellings), GLM-4's: the first a vocabulary has is its token.
PREFIX_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>")
PREFIX_TEXTS += ("<PRE>", "▁<PRE>", "<|code_prefix|>")
SUFFIX_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>")
SUFFIX_TEXTS += ("<SUF>", "▁<SUF>", "<|code_suffix|>")
MIDDLE_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>")
MIDDLE_TEXTS += ("<MID>", "▁<MID>", "<|code_middle|>")
PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>")
REPO_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
FILE_SEPARATOR_TEXTS = ("<|file_sep|>",)
END_OF_FILL_TEXTS = ("<EOT>", "▁<EOT>")  # CodeLlama's end of a middle, which is not its EOS

# What llama.cpp writes where the request cannot name it: the project, and the file being edited.
PROJECT_LINE = "myproject\n"
CURRENT_FILE_LINE = "filename\n"
DEFAULT_FILENAME = "tmp"
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"  # between files, for a vocabulary with no file separator


@dataclass(frozen=True)
class FillTokens:
    """A vocabulary's fill-in-the-middle tokens: the three that frame the gap, and those a repository's
    context is written with (None: the vocabulary has none)."""

    prefix: int
    suffix: int
    middle: int
    pad: int | None = None
    repo: int | None = None
    file_separator: int | None = None
    end_of_fill: int | None = None

    @property
    def ends(self) -> tuple[int, ...]:
        """The tokens that end a middle as its end token does (llama.cpp counts them end-of-generation):
        a model that writes the next file's separator or padding has finished the gap."""
        tokens = (self.pad, self.repo, self.file_separator, self.end_of_fill)
        return tuple(dict.fromkeys(token for token in tokens if token is not None))


@dataclass(frozen=True)
class ContextFile:
    """One of llama.cpp's `input_extra` chunks: another file's text (or a part of it), and its name."""

    text: str
    filename: str = DEFAULT_FILENAME


def fill_tokens(tokenizer: PromptTokenizer) -> FillTokens | None:
    """The tokenizer's fill-in-the-middle tokens; None unless it has the three that frame a gap."""
    found = [_first(tokenizer, texts) for texts in (PREFIX_TEXTS, SUFFIX_TEXTS, MIDDLE_TEXTS)]
    if None in found:
        return None
    prefix, suffix, middle = found
    return FillTokens(
        prefix,
        suffix,
        middle,
        pad=_first(tokenizer, PAD_TEXTS),
        repo=_first(tokenizer, REPO_TEXTS),
        file_separator=_first(tokenizer, FILE_SEPARATOR_TEXTS),
        end_of_fill=_first(tokenizer, END_OF_FILL_TEXTS),
    )


def required_fill_tokens(tokenizer: PromptTokenizer, param: str) -> FillTokens:
    """The fill-in-the-middle tokens, or a 400 naming `param`: a model never trained to fill a gap would
    only continue the prompt's last token, and nothing would say so."""
    tokens = fill_tokens(tokenizer)
    if tokens is None:
        names = ", ".join(texts[0] for texts in (PREFIX_TEXTS, SUFFIX_TEXTS, MIDDLE_TEXTS))
        raise InvalidParams(
            param,
            f"{param}: this model cannot fill in the middle: its vocabulary has no fill-in-the-middle "
            f"tokens ({names} or their kin); serve a code model that has them (Qwen2.5-Coder, say)",
        )
    return tokens


def fill_prompt(
    tokenizer: PromptTokenizer,
    tokens: FillTokens,
    prefix: Sequence[int],
    suffix: Sequence[int],
    context: Sequence[int] = (),
) -> list[int]:
    """The prompt whose continuation is the middle: the tokenizer's leading special tokens (a BOS), the
    repository `context` (context_ids), then prefix and suffix in their frame."""
    frame = [tokens.prefix, *prefix, tokens.suffix, *suffix, tokens.middle]
    return [*leading_special_ids(tokenizer), *context, *frame]


def context_ids(tokenizer: PromptTokenizer, tokens: FillTokens, files: Sequence[ContextFile]) -> list[int]:
    """Other files before the gap, as llama.cpp writes them: the project's line after its token, then
    each file's name line after a file separator and its text, then the separator and name line of the
    file being edited (a vocabulary with no file separator gets a plain-text one between files, and no
    names)."""
    ids = [tokens.repo, *tokenizer.encode_text(PROJECT_LINE)] if tokens.repo is not None else []
    for file in files:
        if tokens.file_separator is not None:
            ids += [tokens.file_separator, *tokenizer.encode_text(file.filename + "\n")]
        else:
            ids += tokenizer.encode_text(SNIPPET_SEPARATOR)
        ids += tokenizer.encode_text(file.text)
    if tokens.file_separator is not None:
        ids += [tokens.file_separator, *tokenizer.encode_text(CURRENT_FILE_LINE)]
    return ids


def leading_special_ids(tokenizer: PromptTokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text (Llama's BOS; none for Qwen's)."""
    with_special, plain = tokenizer.encode("a"), tokenizer.encode("a", add_special_tokens=False)
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start : start + len(plain)] == plain:
            return with_special[:start]
    return []


def _first(tokenizer: PromptTokenizer, texts: tuple[str, ...]) -> int | None:
    for text in texts:
        token = tokenizer.token_id(text)
        if token is not None:
            return token
    return None
