"""The KV cache: one preallocated tensor pair per layer, one row per user.

Keys and values live in [rows, kv_heads, max_seq_len, head_dim] tensors,
allocated once. transformers' attention layers call `update()` with the new
keys and values of a forward pass; where they go is set beforehand by the
engine as a write plan: a prefill fills the first positions of the rows of new
prompts, a decode step writes one token per row, each at its own position. What `update()` returns is what
attention reads: only the rows in the batch and only the positions in use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: PretrainedConfig) -> KVShape:
        config = config.get_text_config()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.num_hidden_layers, kv_heads, head_dim)

    def bytes(self, rows: int, max_seq_len: int, dtype: torch.dtype) -> int:
        """Size of keys and values of all layers."""
        element = torch.finfo(dtype).bits // 8
        return 2 * self.layers * rows * self.kv_heads * max_seq_len * self.head_dim * element


@dataclass(frozen=True)
class PackedPrefillWrite:
    """Whole prompts packed into one sequence: prompt i fills positions 0..lengths[i]-1 of rows[i].

    Attention reads the packed keys themselves (a block-diagonal causal mask
    keeps each prompt to its own tokens): nothing was in these rows before.
    """

    rows: list[int]
    lengths: list[int]

    def write(self, cache: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        start = 0
        for row, length in zip(self.rows, self.lengths, strict=True):
            cache[row, :, :length] = new[0, :, start : start + length]
            start += length
        return new


@dataclass(frozen=True)
class DecodeWrite:
    """One token for each of rows 0..rows-1, row r at positions[r]; attention reads `span` positions."""

    rows: int
    positions: torch.Tensor  # [rows] long
    span: int

    def write(self, cache: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        batch = cache[: self.rows]
        row_ids = torch.arange(self.rows, device=cache.device)
        batch[row_ids, :, self.positions] = new[:, :, 0]
        return batch[:, :, : self.span]


class RowCacheLayer(CacheLayerMixin):
    def __init__(self, owner: RowCache, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.owner = owner
        self.keys, self.values = keys, values
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated up front, never lazily

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        plan = self.owner.plan
        return plan.write(self.keys, key_states), plan.write(self.values, value_states)

    def get_seq_length(self) -> int:
        return 0  # positions are per row and always passed explicitly

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # unused: the engine passes its own 4D masks

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class RowCache(Cache):
    def __init__(self, shape: KVShape, rows: int, max_seq_len: int, dtype: torch.dtype, device: torch.device):
        size = (rows, shape.kv_heads, max_seq_len, shape.head_dim)
        # Zeros, not empty: masked positions still get multiplied by a zero
        # attention weight, and 0 * NaN from uninitialised memory is NaN.
        layers = [
            RowCacheLayer(
                self,
                torch.zeros(size, dtype=dtype, device=device),
                torch.zeros(size, dtype=dtype, device=device),
            )
            for _ in range(shape.layers)
        ]
        super().__init__(layers=layers)
        self.rows = rows
        self.max_seq_len = max_seq_len
        self.plan: PackedPrefillWrite | DecodeWrite | None = None
