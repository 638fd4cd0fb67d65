"""An input embedding whose rows come from blocks: the output head's, where the two are tied, or its own.

Most small models tie their output head to their input embedding (Llama 3.2 1B and 3B, Qwen2.5 up to
3B, SmolLM2), and their GGUF files keep that one tensor quantized (a Q4_K_M file's Q6_K, SmolLM2's
Q8_0). Where the CPU multiplies blocks the head is served from those blocks (gguf_weights.py), but the
embedding kept the file's weights as floats as well: 2 bytes a weight beside the blocks' 0.8 to 1.1,
the whole vocabulary (Llama 3.2 1B: 128,256 x 2,048, 501 MiB in bfloat16; SmolLM2: 54 MiB). llama.cpp
keeps the embedding quantized and dequantizes the rows a step looks up; so does this module: a step's
tokens' rows are written from the head's blocks (`block_weights.rows`), the same floats the embedding
held, bit for bit (the blocks hold the file's weights exactly, and both round them once to the model's
dtype). The head then multiplies every number of rows by its blocks: its dense copy was the embedding,
which is kept where the loader timed the copy faster at the rows a decode step has (a CPU multiplying
bfloat16 fast, say: on the AMD EPYC that measures this project, SmolLM2's Q8_0 head took 1.9 ms for
32 rows in blocks against 3.5 by its bfloat16 copy, and 3.7 against 5.2 at 64).

An untied embedding that the file keeps quantized (Llama 3.1 8B's Q4_K_M file: 128,256 x 4,096 in Q4_K,
1 GiB in bfloat16) is served so from its own blocks (gguf_weights.serve_embedding).
"""

from __future__ import annotations

import torch
from torch import nn

from backend.quant import block_weights


class BlocksEmbedding(nn.Module):
    """nn.Embedding's lookup, from blocks [num_embeddings, bytes] of `embedding_dim` inputs a row."""

    def __init__(
        self,
        blocks: torch.Tensor,
        embedding_dim: int,
        dtype: torch.dtype,
        table: block_weights.Table = block_weights.Table.NONE,
    ):
        super().__init__()
        self.register_buffer("blocks", blocks, persistent=False)
        self.num_embeddings, self.embedding_dim = blocks.shape[0], embedding_dim
        self.dtype = dtype
        self.written = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32  # the loop's
        self.layout = block_weights.layout_of(blocks, embedding_dim, table)  # refuses blocks of other rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = block_weights.rows(self.blocks, ids.reshape(-1), self.layout, self.written)
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.layout.name()}"


# Rows compared at a time when checking that blocks hold an embedding's floats (bounds the memory)
ROWS_CHECKED_AT_ONCE = 1024


def serve_from_tied_head(model: nn.Module, rows: int) -> bool:
    """Where the model's input embedding is its output head's weight (tied), the head multiplies by blocks
    whose weights are exactly those floats (checked, row by row: a type requantized to 8-bit blocks
    holds others), and its dense copy (those floats) would not multiply a decode step of up to `rows`
    rows (the loader timed from how many rows it pays: `calibration.time_head_crossover`), make the
    embedding a `BlocksEmbedding` of those blocks and let go of the floats. Returns whether it did."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    blocks, dense = getattr(head, "blocks", None), getattr(head, "dense", None)
    if blocks is None or dense is None or head.dense_from_rows <= rows:
        return False
    tied = type(embedding) is nn.Embedding and same_storage(embedding.weight, dense)
    if not tied or not serve_from_blocks(model, blocks, head.blocks_layout.table):
        return False
    head.drop_dense()
    return True


def serve_from_blocks(
    model: nn.Module, blocks: torch.Tensor, table: block_weights.Table = block_weights.Table.NONE
) -> bool:
    """Make the model's input embedding (an nn.Embedding) a `BlocksEmbedding` of `blocks` ([num_embeddings,
    bytes]) where they hold exactly its floats (checked, row by row), and let go of those. Returns whether
    it did."""
    embedding = model.get_input_embeddings()
    if type(embedding) is not nn.Embedding or embedding.max_norm is not None:
        return False
    weight = embedding.weight
    if blocks.shape[0] != weight.shape[0] or not block_weights.fits(*weight.shape):
        return False
    try:
        replacement = BlocksEmbedding(blocks, weight.shape[1], weight.dtype, table)
    except ValueError:  # blocks of another width
        return False
    with torch.inference_mode():
        for first in range(0, weight.shape[0], ROWS_CHECKED_AT_ONCE):
            ids = torch.arange(first, min(first + ROWS_CHECKED_AT_ONCE, weight.shape[0]))
            if not torch.equal(replacement(ids), weight[ids]):
                return False
    model.set_input_embeddings(replacement)
    return True


def same_storage(first: torch.Tensor, second: torch.Tensor) -> bool:
    return first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
