"""gguf_parsing.PlainArrayReader reads a GGUF file's fields and tensors as gguf's own reader does, in
either byte order, as plain arrays over the file's mapping (np.memmap slices cost 5 of a parse's 7 s)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from backend.model.gguf_parsing import PlainArrayReader, each_gguf_file_parsed_once


def write_file(path: Path, endianess: gguf.GGUFEndian) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    writer.add_string("general.name", "tiny ☃")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "a", "héllo", "", "x" * 300])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.25, 2.0])
    writer.add_array("tokenizer.ggml.token_type", [1, 2, 3])
    weights = np.arange(48, dtype=np.float32).reshape(6, 8) / 7
    writer.add_tensor("token_embd.weight", weights)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(8, dtype=np.float32) * 3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["little", "big"])
def test_the_plain_reader_reads_every_field_and_tensor_as_ggufs_reader_does(tmp_path, endianess):
    path = write_file(tmp_path / "tiny.gguf", endianess)
    theirs, ours = gguf.GGUFReader(path), PlainArrayReader(path)
    assert ours.byte_order == ("S" if endianess == gguf.GGUFEndian.BIG else "I")  # S: swapped on this CPU
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.data, mine.types) == (field.offset, field.data, field.types), name
        assert [(part.dtype, part.tolist()) for part in mine.parts] == [
            (part.dtype, part.tolist()) for part in field.parts
        ], name
    assert bytes(ours.fields["general.name"].parts[-1]).decode() == "tiny ☃"
    for mine, tensor in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.shape.tolist()) == (
            tensor.name,
            tensor.tensor_type,
            tensor.shape.tolist(),
        )
        assert mine.data.dtype == tensor.data.dtype and np.array_equal(mine.data, tensor.data)
        assert type(mine.data) is np.ndarray and isinstance(tensor.data, np.memmap)
    assert ours.tensors[0].data[5, 7] == np.float32(47 / 7)


def test_within_a_load_a_file_is_parsed_once_by_the_plain_reader(tmp_path):
    path = write_file(tmp_path / "tiny.gguf", gguf.GGUFEndian.LITTLE)
    with each_gguf_file_parsed_once():
        first = gguf.GGUFReader(path)
        assert isinstance(first, PlainArrayReader) and gguf.GGUFReader(str(path)) is first
    assert gguf.GGUFReader is not None and not isinstance(gguf.GGUFReader(path), PlainArrayReader)
