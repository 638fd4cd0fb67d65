"""Each GGUF file parsed once while a model loads, not once for every part of it that reads the file.

transformers reads a GGUF file's config, tokenizer and weights through
`gguf.GGUFReader`, each part parsing the whole file again: the default
model's 49,152-token vocabulary and merges are 589,000 metadata fields, 3.4 s
a parse, and a first start parsed it four times, then once more for the
file's 4-bit blocks (quant/gguf_weights.py). Matching each weight's name
built llama.cpp's table of tensor names again for every module (397 times,
5 s). Together 18 of a first start's 25 s on 2 cores (docs/performance.md).
While a model loads, `gguf.GGUFReader` and `gguf.get_tensor_name_map` (the
names transformers' GGUF loader imports them by, when it runs) answer from
what they made the first time: a reader maps its file read-only, and a table
of names is only looked up. And the parse itself reads plain numpy arrays
over the file's mapping (`PlainArrayReader`), 1.6 s where gguf's reader took 7.

Such a reader also withholds from `fields` the fields transformers reads wrong
(`WITHHELD_PREFIXES`), keeping them in `withheld` for this server's own readers
(`all_fields`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import gguf
import numpy as np
from transformers.modeling_gguf_pytorch_utils import read_field

# transformers 5.23 reads a gpt-oss file's rotary scaling fields by their first part (their key's length),
# not their value, and fails on any file that has them (every gpt-oss file llama.cpp writes: YaRN) with
# "only 0-dimensional arrays can be converted", its tokenizer too. model/gguf_gpt_oss.py reads them.
WITHHELD_PREFIXES = ("gpt-oss.rope.scaling.",)
# Architectures whose files are another's for their text, and that one. llama.cpp's converter writes the
# text model of Qwen3-VL (of its MoE, of Qwen2-VL and 2.5-VL) as an architecture of its own for its
# positions of images (each head's pairs rotated by time, height or width), which for text are all one
# position: Qwen3's rotation (Qwen2's), and its tensors are Qwen3's (Qwen3-MoE's, Qwen2's).
# So too "mistral3", Mistral3Model's: Ministral 3's text model, and Mistral Small 3.1's and 3.2's (a
# Mistral's), converted by LlamaModel (q's and k's rows permuted as Llama's) with keys beside Llama's for
# Ministral 3's scaling of queries (gguf_families.ministral3_fields).
PRESENTED_AS = {"qwen3vl": "qwen3", "qwen3vlmoe": "qwen3moe", "qwen2vl": "qwen2", "mistral3": "llama"}


class PlainArrayReader(gguf.GGUFReader):
    """gguf's reader, each field and tensor it reads a plain numpy array over the file's mapping rather
    than an np.memmap slice: np.memmap's __getitem__ and __array_finalize__ run in Python, twice for each
    of the default model's 589,000 metadata fields (its vocabulary and merges are arrays of strings), 5.6
    of the 7.2 s a parse took on the 2-core EPYC. The arrays still read the mapped file, which they keep
    open, and are the same values (tests/backend/test_gguf_parsing.py)."""

    def _get(
        self, offset: int, dtype: np.typing.DTypeLike, count: int = 1, override_order: str | None = None
    ) -> np.ndarray:
        ordered = byte_ordered(dtype, override_order or self.byte_order)
        return self.plain[offset : offset + ordered.itemsize * int(count)].view(ordered)

    @functools.cached_property
    def plain(self) -> np.ndarray:
        return self.data.view(np.ndarray)


@functools.cache
def byte_ordered(dtype: np.typing.DTypeLike, order: str) -> np.dtype:
    return np.dtype(dtype).newbyteorder(order)


@contextlib.contextmanager
def each_gguf_file_parsed_once() -> Iterator[None]:
    """Within it, a GGUF file opened again gives the reader made the first time (and a table of tensor
    names asked for again, the one made then); `gguf` as it was after it."""
    make_reader, make_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], gguf.GGUFReader] = {}

    def reader(path: os.PathLike[str] | str, mode: str = "r") -> gguf.GGUFReader:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = presented(withholding(PlainArrayReader(path, mode)))
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(make_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, make_name_map


def withholding(reader: gguf.GGUFReader) -> gguf.GGUFReader:
    """`reader` with the fields of WITHHELD_PREFIXES moved from `fields` to `withheld`."""
    reader.withheld = {
        key: reader.fields.pop(key) for key in list(reader.fields) if key.startswith(WITHHELD_PREFIXES)
    }
    return reader


def presented(reader: gguf.GGUFReader) -> gguf.GGUFReader:
    """`reader` with a PRESENTED_AS architecture's fields as those of the one it is presented as: its keys
    under that one's name, and `general.architecture` saying it (`presented_from` the file's own)."""
    architecture = read_field(reader, "general.architecture")[0]
    reader.presented_from = architecture
    served = PRESENTED_AS.get(architecture)
    if served is None:
        return reader
    prefix = f"{architecture}."
    reader.fields = {
        f"{served}.{key.removeprefix(prefix)}" if key.startswith(prefix) else key: field
        for key, field in reader.fields.items()
    }
    said = reader.fields["general.architecture"]
    value = np.frombuffer(served.encode(), dtype=np.uint8)
    parts = [*said.parts[:-2], np.array([len(value)], dtype=np.uint64), value]  # (a string: length, bytes)
    reader.fields["general.architecture"] = said._replace(parts=parts)
    return reader


def all_fields(reader: gguf.GGUFReader) -> dict[str, gguf.ReaderField]:
    """A reader's fields, those it withholds from transformers among them."""
    return {**reader.fields, **getattr(reader, "withheld", {})}


def is_architecture(path: os.PathLike[str] | str, architecture: str) -> bool:
    """Whether the GGUF file's `general.architecture` is `architecture` (llama.cpp's name: "phi3")."""
    return read_field(gguf.GGUFReader(str(path)), "general.architecture") == [architecture]


def architecture_fields(reader: gguf.GGUFReader, architecture: str) -> Callable[[str], object]:
    """The file's `{architecture}.{key}` fields, withheld ones among them, as a function of the key: its
    first value, or None where the file has no such field."""
    fields = SimpleNamespace(fields=all_fields(reader))  # (read_field reads `fields`)

    def field(key: str) -> object:
        found = read_field(fields, f"{architecture}.{key}")
        return found[0] if found else None

    return field
