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
# Weights quantized as they load take more then than once served. A GGUF file's first start dequantizes
# it into a float32 model, 4 bytes a parameter, saved as the converted copy and then cast; later starts of
# the default mode hold the model's bfloat16 weights, the file's blocks and the int8 copies timed beside
# them until what is not kept goes; `--quantize int4|int8` holds each layer's dense copy beside its
# quantized weights and int8 copies the same way. A Llama-3.2-1B-shaped model (1.07 billion parameters)
# on a CPU held at most, in anonymous memory: its Q4_K_M file 4.6-5.0 GiB at the first start and 4.1-4.4
# at later ones, `--quantize int4` 4.6 and `int8` 4.6-5.6 from bfloat16, and 2.3-2.8 once serving, where
# the weights count 2.0 GiB in bfloat16 (scripts/load_memory.py).
QUANTIZING_BYTES = 5.5  # a parameter while loading: int8's 5.6 GiB within the headroom, the process included


class InsufficientResources(RuntimeError):
    pass


@dataclass(frozen=True)
class Needs:
    weights: int  # bytes of weights in the serving dtype
    kv_cache: int  # bytes of the preallocated KV cache
    rows: int
    max_seq_len: int
    loading: int = 0  # bytes the weights take at their most while loading, where they are quantized
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
    quantizing: bool = False,
    gguf_bytes: int | None = None,
) -> Needs:
    """What serving takes; where the weights are `quantizing` as they load (QUANTIZING_BYTES), what loading
    takes; and with `gguf_bytes` (a GGUF file's size, converted at this start) what its converted copy
    takes on disk."""
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
    loading = int(parameters * QUANTIZING_BYTES) if quantizing else 0
    # float32 weights, and the blocks at most the file's size
    converted = parameters * 4 + gguf_bytes if gguf_bytes is not None else 0
    return Needs(weights, kv_cache, rows, max_seq_len, loading=loading, converted=converted)


def shortfalls(needs: Needs, available: Available, on_gpu: bool, converting: bool) -> list[str]:
    """One line per resource that is short, saying how much is needed, there and missing."""
    problems = []
    if on_gpu:
        problems += _short(
            "VRAM", *with_headroom(needs.weights + needs.kv_cache, serving(needs)), available.vram or 0
        )
    problems += _short("RAM", *ram_needed(needs, on_gpu, converting), available.ram)
    if converting:  # a GGUF file's converted copy: float32 weights, and its blocks
        problems += _short("disk", needs.converted or needs.weights, "the converted copy", available.disk)
    return problems


def serving(needs: Needs) -> str:
    """What serving holds: the weights and the KV cache, in words and figures."""
    rows = f"{needs.rows} rows x {needs.max_seq_len} tokens"
    return f"weights {needs.weights / GIB:.2f} GiB + KV cache for {rows} {needs.kv_cache / GIB:.2f} GiB"


def ram_needed(needs: Needs, on_gpu: bool, converting: bool) -> tuple[int, str]:
    """The host RAM a start needs, with HEADROOM, and what it is made of: the most of loading and of
    serving. The KV cache is made once the weights have loaded, and what loading held beyond them let
    go. On a GPU the weights pass through host memory on the way, and the layers are quantized on the
    device, after the move: the host holds more than the weights only while a GGUF file is converted."""
    if on_gpu:
        held, what = needs.weights, f"weights {needs.weights / GIB:.2f} GiB while loading"
    else:
        held, what = needs.weights + needs.kv_cache, serving(needs)
    loading = needs.loading if converting or not on_gpu else 0
    if loading > held:
        held, what = (
            loading,
            (
                f"weights as they load and are quantized (a GGUF file's in float32 the first time, the "
                f"quantized layers beside the floats) {loading / GIB:.2f} GiB"
            ),
        )
    return with_headroom(held, what)


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
    quantizing: bool = False,
    gguf_bytes: int | None = None,
) -> Needs:
    """Raise InsufficientResources, saying what is short and by how much, before any loading. `quantizing`
    and `gguf_bytes`: as estimate_needs takes them."""
    needs = estimate_needs(model_config, dtype, rows, max_seq_len, cache_dtype, quantizing, gguf_bytes)
    problems = shortfalls(needs, measure_available(device, disk_path), device.type == "cuda", converting)
    if problems:
        raise InsufficientResources(
            "not enough resources to serve this model:\n  "
            + "\n  ".join(problems)
            + "\nLower --rows, --max-seq-len or --kv-cache-memory, pick a smaller --dtype, --kv-cache-dtype"
            " or model, or free some memory."
        )
    return needs
