"""Will the model fit? Disk, RAM and VRAM checked before anything is loaded.

Failing here, with the numbers, beats an out-of-memory kill halfway through
loading or, worse, at the first busy minute when the KV cache fills.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from backend.layers.row_cache import KVShape
from backend.layers.row_states import StateShape, has_row_states, is_state_space
from backend.model.architectures import TEXT_ALONE

GIB = 1024**3
HEADROOM = 1.1  # activations, allocator slack, the Python process itself
# A GGUF file's weights take more while they load than once served. At the first start transformers
# dequantizes the file into a float32 model, 4 bytes a parameter, which is saved as the converted copy and
# then cast; at later starts the default mode holds the model's bfloat16 weights, the file's blocks and
# the int8 copies it times beside them, until it drops what it does not keep. A Llama-3.2-1B-shaped Q4_K_M
# file (1.07 billion parameters) on a CPU held at most 4.6-5.0 GiB of anonymous memory at its first start,
# 4.1-4.4 at later ones and 2.4-2.5 once serving, where the weights count 2.0 GiB in bfloat16.
GGUF_LOADING_BYTES = 5  # a parameter, at most, the process itself included


class InsufficientResources(RuntimeError):
    pass


@dataclass(frozen=True)
class Needs:
    weights: int  # bytes of weights in the serving dtype
    kv_cache: int  # bytes of the preallocated KV cache
    rows: int
    max_seq_len: int
    loading: int = 0  # bytes the weights take at their most while loading, where more than `weights`
    converted: int = 0  # bytes of a GGUF file's converted copy: its float32 weights and its blocks


@dataclass(frozen=True)
class Available:
    ram: int
    disk: int
    vram: int | None  # None on CPU


def parameter_count(model_config: PretrainedConfig) -> int:
    """Parameters of the model the config describes, counted without allocating them (a TEXT_ALONE
    checkpoint's text model's: what is loaded of it)."""
    if model_config.model_type in TEXT_ALONE:
        model_config = model_config.get_text_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    return sum(p.numel() for p in model.parameters())


def estimate_needs(
    model_config: PretrainedConfig,
    dtype: torch.dtype,
    rows: int,
    max_seq_len: int,
    cache_dtype: torch.dtype | None = None,  # None: the weights' dtype
    gguf_bytes: int | None = None,
) -> Needs:
    """What serving takes; with `gguf_bytes` (the size of a GGUF file whose weights pass through float32
    as they load: GGUF_LOADING_BYTES) also what loading and the converted copy take."""
    element = torch.finfo(dtype).bits // 8
    parameters = parameter_count(model_config)
    weights = parameters * element
    kv_cache = (
        0
        if is_state_space(model_config)
        else KVShape.of(model_config).bytes(rows, max_seq_len, cache_dtype or dtype)
    )
    if has_row_states(model_config):  # a fixed size a row, whatever its length
        kv_cache += StateShape.of(model_config).bytes(rows, cache_dtype or dtype)
    if gguf_bytes is None:
        return Needs(weights, kv_cache, rows, max_seq_len)
    loading = parameters * GGUF_LOADING_BYTES
    converted = parameters * 4 + gguf_bytes  # float32 weights, and the blocks at most the file's size
    return Needs(weights, kv_cache, rows, max_seq_len, loading=loading, converted=converted)


def shortfalls(needs: Needs, available: Available, on_gpu: bool, converting: bool) -> list[str]:
    """One line per resource that is short, saying how much is needed, there and missing."""
    problems = []
    parts = (
        f"weights {needs.weights / GIB:.2f} GiB + KV cache for {needs.rows} rows x {needs.max_seq_len} tokens"
    )
    parts += f" {needs.kv_cache / GIB:.2f} GiB"
    both = needs.weights + needs.kv_cache
    # The KV cache is made once the weights have loaded, and what loading held beyond them let go.
    loading = (
        f"a GGUF file's weights as they load (dequantized to float32 the first time, its blocks beside "
        f"them later) {needs.loading / GIB:.2f} GiB"
        if needs.loading > needs.weights
        else f"weights {needs.weights / GIB:.2f} GiB while loading"
    )
    if on_gpu:
        problems += _short("VRAM", *with_headroom(both, parts), available.vram or 0)
        # The weights pass through host memory on the way.
        problems += _short("RAM", *with_headroom(max(needs.weights, needs.loading), loading), available.ram)
    elif needs.loading > both:
        problems += _short("RAM", *with_headroom(needs.loading, loading), available.ram)
    else:
        problems += _short("RAM", *with_headroom(both, parts), available.ram)
    if converting:  # a GGUF file's converted copy: float32 weights, and its blocks
        problems += _short("disk", needs.converted or needs.weights, "the converted copy", available.disk)
    return problems


def with_headroom(total: int, parts: str) -> tuple[int, str]:
    """What `total` bytes of `parts` need with HEADROOM, and the parts with the headroom named, so that
    the figures of a message add up."""
    needed = int(total * HEADROOM)
    return needed, f"{parts} + {HEADROOM - 1:.0%} headroom {(needed - total) / GIB:.2f} GiB"


def _short(resource: str, needed: int, what: str, available: int) -> list[str]:
    if needed <= available:
        return []
    return [
        f"{resource}: needs {needed / GIB:.2f} GiB ({what}), {available / GIB:.2f} GiB available, "
        f"{(needed - available) / GIB:.2f} GiB short"
    ]


def measure_available(device: torch.device, disk_path: Path) -> Available:
    disk_path.mkdir(parents=True, exist_ok=True)
    vram = None
    if device.type == "cuda":
        vram = torch.cuda.mem_get_info(device)[0]
    return Available(psutil.virtual_memory().available, shutil.disk_usage(disk_path).free, vram)


def check_resources(
    model_config: PretrainedConfig,
    *,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    device: torch.device,
    rows: int,
    max_seq_len: int,
    disk_path: Path,
    converting: bool,
    gguf_bytes: int | None = None,
) -> Needs:
    """Raise InsufficientResources, saying what is short and by how much, before any loading. `gguf_bytes`:
    the size of a GGUF file whose weights pass through float32 as they load (estimate_needs)."""
    needs = estimate_needs(model_config, dtype, rows, max_seq_len, cache_dtype, gguf_bytes)
    problems = shortfalls(needs, measure_available(device, disk_path), device.type == "cuda", converting)
    if problems:
        raise InsufficientResources(
            "not enough resources to serve this model:\n  "
            + "\n  ".join(problems)
            + "\nLower --rows, --max-seq-len or --kv-cache-memory, pick a smaller --dtype, --kv-cache-dtype"
            " or model, or free some memory."
        )
    return needs
