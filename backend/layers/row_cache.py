"""The KV cache: one preallocated tensor pair per layer, one row per user.

Keys and values live in [rows, kv_heads, max_seq_len, head_dim] tensors,
allocated once. transformers' attention layers call `update()` with the new
keys and values of a forward pass; where they go is set beforehand by the
model runner as a write plan (`plan_step`) (one token for each decoding row at its own position,
prompt chunks at their positions in their rows). `update()` returns the
whole cache, and the engine's attention function (attention.py) reads
just the rows and positions each query may see: nothing is copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from backend.layers.row_states import attention_free_layers
from backend.layers.step_layout import StepLayout

CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_cache_dtype(
    requested: str, model_dtype: torch.dtype, device: torch.device, loop_attention: bool = False
) -> torch.dtype:
    """`--kv-cache-dtype`; auto: the model's own dtype, but float32 on a CPU where decode steps attend
    through PyTorch's kernel rather than the CPU's loop (`loop_attention`, fused_ops.cpp).

    PyTorch's CPU attention kernel is several times slower in bfloat16 than in float32 (docs/
    performance.md: a 32-row decode step's attention over 300 positions, 6.1 ms a layer against 1.3 on
    an AVX512-BF16 CPU), so without the loop a CPU keeps keys and values in float32 whatever its linear
    layers compute in, at twice the memory. The loop reads bfloat16 as fast as float32 and half the
    bytes, and prompts attend as fast over either.
    """
    if requested != "auto":
        return CACHE_DTYPES[requested]
    if not model_dtype.is_floating_point or (device.type == "cpu" and not loop_attention):
        return torch.float32
    return model_dtype


@dataclass(frozen=True)
class KVShape:
    """What each layer keeps a position: (kv_heads, head_dim), or None for a layer that keeps no keys
    and values: a hybrid's layers that do not attend (its Mamba layers, Nemotron-H's MLP and expert layers,
    row_states.attention_free_layers) and Gemma 4's layers that read an earlier layer's (`reading_earlier`).
    Most models' layers are all alike; Gemma 4's global layers have wider heads than its window layers.
    A latent-attention model's layers (DeepSeek's MLA) each keep one tensor, read as keys and as values
    (`latent`): one head of its latent and its rotated key (latent_attention.py)."""

    kept: tuple[tuple[int, int] | None, ...]
    latent: bool = False

    @classmethod
    def of(cls, config: PretrainedConfig) -> KVShape:
        config = config.get_text_config()
        width = latent_width(config)
        if width is not None:
            return cls(((1, width),) * config.num_hidden_layers, latent=True)
        without = set(attention_free_layers(config)) | set(reading_earlier(config))

        def layer_shape(layer: PretrainedConfig) -> tuple[int, int]:
            heads = layer.num_attention_heads
            return key_value_heads(layer), getattr(layer, "head_dim", None) or layer.hidden_size // heads

        layers = range(config.num_hidden_layers)
        return cls(tuple(None if i in without else layer_shape(config.per_layer_config[i]) for i in layers))

    @property
    def layers(self) -> int:
        """The layers that keep keys and values."""
        return sum(shape is not None for shape in self.kept)

    @property
    def without(self) -> tuple[int, ...]:
        """The layers that keep none."""
        return tuple(i for i, shape in enumerate(self.kept) if shape is None)

    @property
    def alike(self) -> bool:
        """Whether every layer that keeps keys and values keeps them in one shape."""
        return len(set(filter(None, self.kept))) == 1

    @property
    def uniform(self) -> tuple[int, int]:
        """(kv_heads, head_dim) of every layer that keeps keys and values; ValueError where they differ (a
        runner that writes all layers with one index needs them alike)."""
        if not self.alike:
            raise ValueError(f"the layers keep keys and values of {len(set(filter(None, self.kept)))} shapes")
        return next(filter(None, self.kept))

    @property
    def kv_heads(self) -> int:
        return self.uniform[0]

    @property
    def head_dim(self) -> int:
        return self.uniform[1]

    @property
    def tensors(self) -> int:
        """The tensors a layer keeps: keys and values, or a latent-attention layer's one."""
        return 1 if self.latent else 2

    def bytes(self, rows: int, max_seq_len: int, dtype: torch.dtype) -> int:
        """Size of keys and values of all layers."""
        element = torch.finfo(dtype).bits // 8
        widths = sum(kv_heads * head_dim for kv_heads, head_dim in filter(None, self.kept))
        return self.tensors * widths * rows * max_seq_len * element

    def positions_within(self, memory: int, rows: int, dtype: torch.dtype) -> int:
        """The most positions a row whose keys and values, in every row, fit in `memory` bytes."""
        return memory // self.bytes(rows, 1, dtype)

    def describe(self) -> str:
        """The keys' (or values') widths a position, for the start-up log: "30 layers x 4 KV heads x 64",
        or where layers differ "(25 layers x 8 KV heads x 256 + 5 layers x 2 KV heads x 512)"; a latent
        attention model's "27 latent layers x 576"."""
        if self.latent:  # one tensor a layer, one head
            return f"{len(self.kept)} latent layers x {self.kept[0][1]}"
        shapes = [shape for shape in self.kept if shape is not None]
        counts = {shape: shapes.count(shape) for shape in dict.fromkeys(shapes)}
        text = " + ".join(
            f"{n} layer{'s' * (n != 1)} x {heads} KV heads x {dim}" for (heads, dim), n in counts.items()
        )
        return text if len(counts) == 1 else f"({text})"


def latent_width(config: PretrainedConfig) -> int | None:
    """The width a latent-attention layer keeps a position (DeepSeek's MLA: its compressed keys and
    values, `kv_lora_rank`, and the rotated key all heads share, `qk_rope_head_dim`); None for others."""
    rank = getattr(config, "kv_lora_rank", None)
    return None if rank is None else rank + config.qk_rope_head_dim


def reading_earlier(config: PretrainedConfig) -> tuple[int, ...]:
    """The layers that attend over an earlier layer's keys and values instead of keeping their own (Gemma
    4's last `num_kv_shared_layers`, each reading the last earlier layer of its kind): they keep none."""
    modes = getattr(config, "kv_sharing_modes", None) or ()
    return tuple(i for i, mode in enumerate(modes) if mode == "reuse")


def key_value_heads(config: PretrainedConfig) -> int:
    """The heads of keys and values a layer keeps. Falcon's config names them its own way: one for all
    queries in Falcon-7B (`multi_query`), `num_kv_heads` groups in 40B and 180B (its new architecture),
    and its `num_kv_heads` defaults to the query heads even where the model has one (7B's 71): a cache of
    71 heads where one is read."""
    heads = config.num_attention_heads
    if config.model_type == "falcon":
        if config.new_decoder_architecture:
            return config.num_kv_heads
        return 1 if config.multi_query else heads
    return getattr(config, "num_key_value_heads", None) or heads


def cache_slots(rows: torch.Tensor, positions: torch.Tensor, kv_heads: int, max_seq_len: int) -> torch.Tensor:
    """[queries * kv_heads] indices of each query's (row, head, position) in a layer's cache viewed as
    [-1, head_dim], for `index_copy_`."""
    row_heads = rows[:, None] * kv_heads + torch.arange(kv_heads, device=rows.device)
    return (row_heads * max_seq_len + positions[:, None]).reshape(-1)


@dataclass(frozen=True)
class StepWrite:
    """Where the packed tokens of one step go (see step_layout.StepLayout).

    Decode token i goes to row decode_index[i] at positions[i]; each prompt
    chunk fills positions past..past+length-1 of its row. Attention then reads the
    cache itself.
    """

    layout: StepLayout
    max_seq_len: int
    _slots: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def decode_slots(self, kv_heads: int) -> torch.Tensor:
        """[decode queries * kv_heads] indices of (row, head, position) in a layer of `kv_heads` heads viewed
        as [-1, head_dim].

        Computed once a step for each width of layer (one for all layers in most models) and kept:
        `index_copy_` with it is a few times faster than advanced-index assignment, which mattered at 60
        writes a step.
        """
        if kv_heads not in self._slots:
            self._slots[kv_heads] = cache_slots(
                self.layout.decode_index, self.layout.positions, kv_heads, self.max_seq_len
            )
        return self._slots[kv_heads]

    def write(self, cache: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        n = self.layout.decode_queries
        if n:
            kv_heads, head_dim = cache.shape[1], cache.shape[-1]
            decoded = new[0, :, :n].transpose(0, 1).reshape(-1, head_dim)  # [n * kv_heads, head_dim]
            cache.view(-1, head_dim).index_copy_(0, self.decode_slots(kv_heads), decoded.to(cache.dtype))
        for chunk in self.layout.prompts:
            cache[chunk.row, :, chunk.past : chunk.past + chunk.length] = new[
                0, :, chunk.start : chunk.start + chunk.length
            ]
        return cache


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
        return query_length, 0  # unused: row_attention takes no mask from transformers

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class LatentCacheLayer(RowCacheLayer):
    """A latent-attention layer's one tensor [rows, 1, max_seq_len, latent + rotated key]: transformers'
    layer (DeepSeek's MLA) hands `update` its normed latent and its rotated key, which go side by side; it
    gets the whole tensor back as both, which latent_attention.py reads as keys and values."""

    def __init__(self, owner: RowCache, latents: torch.Tensor):
        super().__init__(owner, latents, latents)

    def update(self, latent: torch.Tensor, rotated_key: torch.Tensor, *args, **kwargs):
        both = self.owner.plan.write(self.keys, torch.cat((latent, rotated_key), dim=-1))
        return both, both


class RowCache(Cache):
    def __init__(
        self,
        shape: KVShape,
        rows: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device,
        spare_rows: int = 0,
    ):
        """`rows` user rows, then `spare_rows` more that no request decodes in (the row an embedding
        input is prefilled in a chunk at a time, engine.py)."""
        nothing = (0, 0)  # a layer that keeps no keys and values: no positions

        def layer(kept: tuple[int, int] | None) -> RowCacheLayer:
            kv_heads, head_dim = kept or nothing
            size = (rows + spare_rows, kv_heads, max_seq_len if kept else 0, head_dim)
            # Zeros, not empty: masked positions still get multiplied by a zero
            # attention weight, and 0 * NaN from uninitialised memory is NaN.
            tensors = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.tensors)]
            return LatentCacheLayer(self, *tensors) if shape.latent else RowCacheLayer(self, *tensors)

        layers = [layer(kept) for kept in shape.kept]
        super().__init__(layers=layers)
        # Every layer's tensors, for a forward pass that writes and reads them itself (decoder_runner).
        self.keys = [layer.keys for layer in layers]
        self.values = [layer.values for layer in layers]
        self.rows = rows  # the user rows: decode steps and their graphs span these only
        # Where all layers are alike (all but Gemma 4): for the runners that write every layer with one index.
        self.kv_heads = shape.kv_heads if shape.alike else None
        self.max_seq_len = max_seq_len
        self.plan: StepWrite | None = None

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Positions 0..length-1 of one row into another, in every layer (prefix reuse)."""
        for layer in self.layers:
            layer.keys[target, :, :length] = layer.keys[source, :, :length]
            if layer.values is not layer.keys:  # a latent layer's one tensor is both
                layer.values[target, :, :length] = layer.values[source, :, :length]

    def plan_step(self, layout: StepLayout) -> None:
        """The next forward pass writes its keys and values where this layout says."""
        self.plan = StepWrite(layout, self.max_seq_len)
