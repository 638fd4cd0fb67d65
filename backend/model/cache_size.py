"""How many positions a row holds, and so what the KV cache takes: the memory decision of a start-up.

The cache is allocated once, zeroed (so resident from the start), with keys and values of every row
at every position in every layer: rows x max_seq_len x (2 x layers x kv_heads x head_dim x bytes of
its dtype), the rows being the user rows and, where the served model embeds, one more that embedding
inputs are prefilled in (engine.py). `--max-seq-len` sets the length; `--kv-cache-memory` gives a
budget instead, and the length is the most that fits; with neither it is the smaller of 2,048 and the
model's context. The start-up log says what came of it, for the default model on a CPU:

    KV cache: 32 rows and 1 for embedding inputs x 2048 positions, float32, 2970 MiB (45 KiB a position
    a row: 2 x 30 layers x 3 KV heads x 64 x 4 bytes); the default, the smaller of 2048 and the
    model's context of 8192; ...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from backend.layers.row_cache import KVShape
from backend.layers.row_states import StateShape
from backend.messages import BackendConfig

# The fewest positions a budget may leave a row: SmolLM2's chat template makes a one-word message 32
# tokens, so a row of fewer than 64 cannot hold a chat turn and a short answer.
MIN_SEQ_LEN = 64
DEFAULT_MAX_SEQ_LEN = 2048


def context_length(model_config: PretrainedConfig) -> int:
    """The longest sequence the model was built for (capped per row by max_seq_len), and the engine serves
    exactly (`context_limit`)."""
    return context_limit(model_config)[0]


def context_limit(model_config: PretrainedConfig) -> tuple[int, str]:
    """The context served exactly, and its name: the model's, but no longer than Llama 4's chunks, since its
    rotated layers' queries read their own chunk of positions alone (`attention_chunk_size`: from position
    8,192 on, the last p mod 8,192 + 1), nor than DeepSeek-V3.2's and GLM-5's sparse attention's top k
    (`index_topk`: past 2,048 positions a query reads the 2,048 its indexer chooses), neither of which the
    engine's attention does."""
    text = model_config.get_text_config()
    limits = [(getattr(text, "max_position_embeddings", None) or DEFAULT_MAX_SEQ_LEN, "the model's context")]
    if "chunked_attention" in (getattr(text, "layer_types", None) or []):
        limits.append((text.attention_chunk_size, "the model's attention chunk"))
    if getattr(text, "index_topk", None):
        limits.append((text.index_topk, "the model's sparse attention's top k"))
    return min(limits, key=lambda limit: limit[0])


@dataclass(frozen=True)
class CacheSize:
    shape: KVShape
    rows: int  # the user rows
    max_seq_len: int
    dtype: torch.dtype
    reason: str  # where max_seq_len comes from, for the log
    spare_rows: int = 0  # rows beside them: the embedding row

    @property
    def bytes(self) -> int:
        return self.shape.bytes(self.rows + self.spare_rows, self.max_seq_len, self.dtype)

    def summary(self) -> str:
        """The start-up log's line: what the cache holds and takes, and why."""
        element = torch.finfo(self.dtype).bits // 8
        dtype = str(self.dtype).removeprefix("torch.")
        position = self.shape.bytes(1, 1, self.dtype)
        widths = f"{self.shape.tensors} x {self.shape.describe()}"  # keys and values, or a latent
        rows = f"{self.rows} rows" + (
            f" and {self.spare_rows} for embedding inputs" if self.spare_rows else ""
        )
        return (
            f"KV cache: {rows} x {self.max_seq_len} positions, {dtype}, {size_text(self.bytes)} "
            f"({size_text(position)} a position a row: {widths} x {element} bytes); "
            f"{self.reason}"
        )


def size_kv_cache(config: BackendConfig, model_config: PretrainedConfig, dtype: torch.dtype) -> CacheSize:
    """The cache's length from --max-seq-len, --kv-cache-memory or the default, never past the model's
    context. ValueError, saying what to change, for a budget too small for MIN_SEQ_LEN positions a row
    or for a --max-seq-len that does not fit in it."""
    shape, rows, budget = KVShape.of(model_config), config.rows, config.kv_cache_memory
    spare = spare_rows(config)
    context, named = context_limit(model_config)  # (and what the start-up line calls it)
    requested = config.max_seq_len
    if budget is None and requested is None:
        length = min(DEFAULT_MAX_SEQ_LEN, context)
        reason = (
            f"the default, the smaller of {DEFAULT_MAX_SEQ_LEN} and {named} of {context}; "
            "--max-seq-len or --kv-cache-memory sizes it"
        )
        return CacheSize(shape, rows, length, dtype, reason, spare)
    if budget is None:
        length = min(requested, context)
        reason = "--max-seq-len" if length == requested else f"{named}, under --max-seq-len {requested}"
        return CacheSize(shape, rows, length, dtype, reason, spare)

    fitting = shape.positions_within(budget, rows + spare, dtype)
    per_position = f"{rows + spare} rows x {size_text(shape.bytes(1, 1, dtype))} a position a row"
    if requested is not None:
        length = min(requested, context)
        if length > fitting:
            taken = size_text(shape.bytes(rows + spare, length, dtype))
            raise ValueError(
                f"--max-seq-len {length} does not fit in --kv-cache-memory {size_text(budget)}: "
                f"{per_position} take {taken} at that length, and "
                f"the budget holds {fitting} positions a row. Lower --max-seq-len or --rows, or give one."
            )
        reason = f"--max-seq-len, within --kv-cache-memory {size_text(budget)}"
        return CacheSize(shape, rows, length, dtype, reason, spare)
    if fitting < MIN_SEQ_LEN:
        taken = size_text(shape.bytes(rows + spare, MIN_SEQ_LEN, dtype))
        raise ValueError(
            f"--kv-cache-memory {size_text(budget)} holds {fitting} positions a row, under the {MIN_SEQ_LEN} "
            f"a row needs: {per_position} take {taken} for "
            f"{MIN_SEQ_LEN}. Give it more, or lower --rows, or pick a smaller --kv-cache-dtype."
        )
    if fitting >= context:
        reason = f"{named}; --kv-cache-memory {size_text(budget)} would hold {fitting}"
        return CacheSize(shape, rows, context, dtype, reason, spare)
    reason = f"the most that fit in --kv-cache-memory {size_text(budget)}"
    return CacheSize(shape, rows, fitting, dtype, reason, spare)


@dataclass(frozen=True)
class StateSize:
    """A state-space model's rows (layers/row_states.py): a fixed size a row, whatever its length."""

    shape: StateShape
    rows: int
    max_seq_len: int
    dtype: torch.dtype
    spare_rows: int = 0

    @property
    def bytes(self) -> int:
        return self.shape.bytes(self.rows + self.spare_rows, self.dtype)

    def summary(self) -> str:
        rows = f"{self.rows} rows" + (
            f" and {self.spare_rows} for embedding inputs" if self.spare_rows else ""
        )
        a_row = size_text(self.shape.bytes(1, self.dtype))
        return (
            f"recurrent state: {rows}, {size_text(self.bytes)} ({a_row} a row at any length: "
            f"{self.shape.layers} layers x ({self.shape.conv_channels} x {self.shape.conv_kernel} inputs + "
            f"{self.shape.ssm_size} states)); rows of up to "
            f"{self.max_seq_len} tokens (--max-seq-len)"
        )


def size_row_states(config: BackendConfig, model_config: PretrainedConfig, dtype: torch.dtype) -> StateSize:
    """A state-space model's rows: as long as --max-seq-len says (or the default), their state the same
    size at any length. ValueError where --kv-cache-memory cannot hold it."""
    shape, rows, spare = StateShape.of(model_config), config.rows, spare_rows(config)
    length = min(config.max_seq_len or DEFAULT_MAX_SEQ_LEN, context_length(model_config))
    size = StateSize(shape, rows, length, dtype, spare)
    budget = config.kv_cache_memory
    if budget is not None and size.bytes > budget:
        raise ValueError(
            f"--kv-cache-memory {size_text(budget)} does not hold the rows' recurrent states: {rows + spare} "
            f"rows take {size_text(size.bytes)}. Give it more, or lower --rows."
        )
    return size


def spare_rows(config: BackendConfig) -> int:
    """The rows the cache holds beside the user rows: one that the served model's embedding inputs are
    prefilled in (none where a separate model embeds)."""
    return 0 if config.embedding_model else 1


def size_text(size: int) -> str:
    """Bytes as MiB, KiB or bytes, as the log and the errors give them: 2880 MiB, 45 KiB, 1.5 MiB."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f}".removesuffix(".0") + f" {unit}"
    return f"{size} bytes"
