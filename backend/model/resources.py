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
from backend.model.architectures import TEXT_ALONE, text_config_of
from backend.quant.quantized_linear import quantizable_linears

GIB = 1024**3
HEADROOM = 1.1  # activations, allocator slack, the Python process itself
# A load that quantizes the weights holds more than they serve in, for a while: the quantized layers of
# `--quantize int4|int8` beside the floats that become the dense copies, the head quantized, the
# calibration pass (and so did a GGUF file's blocks, where the CPU does not multiply them: "gguf"). In
# bytes a parameter beyond the weights in their serving dtype (the process itself included), from what a
# Llama-3.2-1B-shaped model (1.07 billion parameters, 2.0 GiB in bfloat16) held at most in anonymous
# memory on this project's 2-core Xeon (scripts/load_memory.py, 2026-12-05, several runs each):
# `--quantize int4` 3.7-4.1 GiB and `int8` 3.9-5.1 from bfloat16 (int8's dense copies are new, beside its
# int8 weights), its Q4_K_M file 3.4-4.1 before its loads were lean, and 2.3-2.8 once serving. The
# figures with HEADROOM cover those: 4.6, 5.7 and 4.4 GiB.
LOADING_BYTES = {"gguf": 2.0, "int4": 2.2, "int8": 3.2}
# A GGUF file served from its blocks on a CPU that multiplies them loads lean (model/lean_load.py): its
# blocks (lean_load.blocks_bytes) beside the weights in their serving dtype (the dense copies, at most all
# of them; or none, where they do not fit: loader.check_room_for_copies), and this many bytes a parameter
# more (the process, the head's blocks as they are packed, a layer's copy as it is made, the calibration's
# passes). The 1B's Q4_K_M file then held at most 2.6-2.8 GiB where its copies went int8 (2.3 once
# loaded), 3.4 in a run where every bfloat16 copy stayed (3.0 once loaded), and 1.6-1.7 without copies
# (1.15 once loaded), 1.3 since its head is packed a part at a time (block_weights.PACK_CHANNELS); the
# check requires 3.7 GiB at its first start, 3.8 at later ones (whose blocks' copy is larger than the
# file's quantized tensors), and 1.8 without copies.
LEAN_LOADING_BYTES = 0.7
# An MXFP4 checkpoint's experts (mxfp4_checkpoint.py): 18 bytes a block of 32 weights as served (an fp16
# d; 17 as stored), read a projection at a time as they are packed.
MXFP4_BLOCK_BYTES = 18
# A gpt-oss GGUF file's experts (model/gguf_gpt_oss.py): read as the blocks copy keeps them (4-bit values two
# a byte, a float32 d a 32) before their layers are made. Its 4-layer gpt-oss-20b-shaped file held 2.4 GiB
# once loaded and peaked 1.7 GiB higher: 0.53 bytes an expert's weight.
EXPERTS_READ_BYTES = 0.55
# A GGUF file whose architecture's tensors are read together (gguf_conversion.streams: Qwen2/3-MoE,
# gpt-oss, GPT-2, Mixtral) is converted in memory: its float32 model whole, 4.6 GiB of the 1B above
# (converted so, before files were converted a tensor at a time), in bytes a parameter.
WHOLE_CONVERSION_BYTES = 4.7


class InsufficientResources(RuntimeError):
    pass


@dataclass(frozen=True)
class Needs:
    weights: int  # bytes of weights in the serving dtype (and a lean GGUF load's blocks beside them)
    kv_cache: int  # bytes of the preallocated KV cache
    rows: int
    max_seq_len: int
    loading: int = 0  # bytes the weights take at their most while loading, where they are quantized
    conversion: int = 0  # bytes a GGUF file converted in memory takes: its float32 model
    converted: int = 0  # bytes of a GGUF file's converted copy on disk: its float32 weights and its blocks


@dataclass(frozen=True)
class Available:
    ram: int
    disk: int
    vram: int | None  # None on CPU


def skeleton(model_config: PretrainedConfig) -> torch.nn.Module:
    """The model the config describes on the meta device: its names and shapes, nothing allocated (a
    TEXT_ALONE checkpoint's text model: what is loaded of it)."""
    if model_config.model_type in TEXT_ALONE:
        model_config = text_config_of(model_config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config)


def estimate_needs(
    model_config: PretrainedConfig,
    dtype: torch.dtype,
    rows: int,
    max_seq_len: int,
    cache_dtype: torch.dtype | None = None,  # None: the weights' dtype
    quantizing: str | None = None,
    gguf_bytes: int | None = None,
    converting_whole: bool = False,
    lean_blocks: int | None = None,
    without_copies: bool = False,
    left_to_blocks: int = 0,
    experts_in_blocks: int = 0,
) -> Needs:
    """What serving takes; where the weights are quantized as they load (`quantizing`: "gguf", "int4" or
    "int8", LOADING_BYTES), what loading takes; with `gguf_bytes` (a GGUF file's size, converted at this
    start) what its converted copy takes on disk; `converting_whole`: the file is converted in memory
    (WHOLE_CONVERSION_BYTES); `lean_blocks`: what a GGUF file's blocks take, where its layers load lean
    (LEAN_LOADING_BYTES); `without_copies`: a lean load whose layers keep no dense copies for many rows;
    `left_to_blocks`: the parameters a converted copy leaves out, which the file's blocks serve;
    `experts_in_blocks`: experts' parameters served from blocks and never held as floats (an MXFP4
    checkpoint's, at 18 bytes a 32; a gpt-oss GGUF file's, among `lean_blocks`)."""
    element = torch.finfo(dtype).bits // 8
    model = skeleton(model_config)
    parameters = sum(p.numel() for p in model.parameters())
    floats = parameters - experts_in_blocks  # the parameters loaded, or converted, as floats
    weights = floats * element
    if quantizing == "gguf" and lean_blocks is not None:
        # A lean GGUF load serves its blocks beside the dense copies (at most all of them: a CPU whose
        # bfloat16 products beat int8 keeps them all), or beside its floats alone, without copies
        projections = quantizable_linears(model).values()  # those the blocks may serve: all but the head
        uncopied = sum(linear.weight.numel() for linear in projections) if without_copies else 0
        weights += lean_blocks - uncopied * element
    else:
        weights += experts_in_blocks * MXFP4_BLOCK_BYTES // 32
    kv_cache = (
        0
        if is_state_space(model_config)
        else KVShape.of(model_config).bytes(rows, max_seq_len, cache_dtype or dtype)
    )
    if has_row_states(model_config):  # a fixed size a row, whatever its length
        kv_cache += StateShape.of(model_config).bytes(rows, cache_dtype or dtype)
    if quantizing == "gguf" and lean_blocks is not None:
        loading = weights + int(floats * LEAN_LOADING_BYTES + experts_in_blocks * EXPERTS_READ_BYTES)
    else:
        loading = weights + int(parameters * LOADING_BYTES[quantizing]) if quantizing else 0
    conversion = int(floats * WHOLE_CONVERSION_BYTES) if converting_whole else 0
    # float32 weights, and the blocks at most the file's size
    converted = (parameters - left_to_blocks) * 4 + gguf_bytes if gguf_bytes is not None else 0
    return Needs(weights, kv_cache, rows, max_seq_len, loading, conversion, converted)


def shortfalls(needs: Needs, available: Available, on_gpu: bool, converting: bool) -> list[str]:
    """One line per resource that is short, saying how much is needed, there and missing."""
    problems = []
    if on_gpu:
        problems += _short(
            "VRAM", *with_headroom(needs.weights + needs.kv_cache, serving(needs)), available.vram or 0
        )
    problems += _short("RAM", *ram_needed(needs, on_gpu), available.ram)
    if converting:  # a GGUF file's converted copy: float32 weights, and its blocks
        problems += _short("disk", needs.converted or needs.weights, "the converted copy", available.disk)
    return problems


def serving(needs: Needs) -> str:
    """What serving holds: the weights and the KV cache, in words and figures."""
    rows = f"{needs.rows} rows x {needs.max_seq_len} tokens"
    return f"weights {needs.weights / GIB:.2f} GiB + KV cache for {rows} {needs.kv_cache / GIB:.2f} GiB"


def ram_needed(needs: Needs, on_gpu: bool) -> tuple[int, str]:
    """The host RAM a start needs, with HEADROOM, and what it is made of: the most of loading and of
    serving. The KV cache is made once the weights have loaded, and what loading held beyond them let
    go. On a GPU the weights pass through host memory on the way, and the layers are quantized on the
    device, after the move: the host holds more than the weights only while a GGUF file is converted in
    memory."""
    if on_gpu:
        held, what = needs.weights, f"weights {needs.weights / GIB:.2f} GiB while loading"
    else:
        held, what = needs.weights + needs.kv_cache, serving(needs)
    if not on_gpu and needs.loading > held:
        held = needs.loading
        what = f"weights as they load and are quantized, beside the floats {held / GIB:.2f} GiB"
    if needs.conversion > held:
        held = needs.conversion
        what = f"a GGUF file's weights converted in float32, in memory {held / GIB:.2f} GiB"
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
    quantizing: str | None = None,
    gguf_bytes: int | None = None,
    converting_whole: bool = False,
    lean_blocks: int | None = None,
    without_copies: bool = False,
    left_to_blocks: int = 0,
    experts_in_blocks: int = 0,
) -> Needs:
    """Raise InsufficientResources, saying what is short and by how much, before any loading. `quantizing`,
    `gguf_bytes`, `converting_whole`, `lean_blocks`, `without_copies`, `left_to_blocks` and
    `experts_in_blocks`: as estimate_needs takes them."""
    needs = estimate_needs(
        model_config,
        dtype,
        rows,
        max_seq_len,
        cache_dtype,
        quantizing,
        gguf_bytes,
        converting_whole,
        lean_blocks,
        without_copies,
        left_to_blocks,
        experts_in_blocks,
    )
    problems = shortfalls(needs, measure_available(device, disk_path), device.type == "cuda", converting)
    if problems:
        raise InsufficientResources(
            "not enough resources to serve this model:\n  "
            + "\n  ".join(problems)
            + "\nLower --rows, --max-seq-len or --kv-cache-memory, pick a smaller --dtype, --kv-cache-dtype"
            " or model, or free some memory."
        )
    return needs
