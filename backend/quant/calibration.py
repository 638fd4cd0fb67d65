"""Calibration at load time: the int8 path for many rows of quantized projections (smoothed_int8.py).

The model reads a short text shipped with the package (calibration_text.txt:
a chat in the model family's usual template, code, figures, another
language; about 570 tokens, under two seconds a pass on a 2-core CPU)
while hooks record the largest absolute input each projection sees per
channel. Projections
that read the same tensor are grouped, so that they get one smoothing and
can still be fused (quantized_linear.fuse_linears).

Whether int8 pays depends on the CPU: without AMX (AVX-512 VNNI only) it is
2.5x faster than bfloat16 at 32 rows, but where AMX multiplies bfloat16,
the dense copies are 1.4x faster than int8 at 32 rows and 2.6x at 512. So
the loader first times both on one layer and keeps the dense copies unless
int8 wins (`int8_multiplies_faster`).

Where the projections are in blocks for the CPU's int8 dot products
(block_weights.py), the blocks multiply many rows about as fast as either
copy (a 512-row chunk of a long prompt through SmolLM2's down projection on
the 2-core AMD EPYC: 1.8 ms in blocks, 1.6 as int8, 2.2 as bfloat16), and
the copies took more memory than the blocks (128 against 92 MiB). So the
loader drops them unless one is clearly faster there
(`drop_copies_blocks_match`), as it may be on a CPU with AMX.

The output head's own switch from its packed int8 kernel to its dense copy
is timed at load too (`time_head_crossover`): with bfloat16 copies on
AVX-512 the copy wins from 6 to 8 rows, but with the float32 copies of an
AVX2 CPU (no native bfloat16) the int8 kernel is faster up to 32 to 48 rows
(at 8 rows 13.0 against 41.2 ms on SmolLM2's head, docs/performance.md).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from backend.quant.blocks_embedding import same_storage
from backend.quant.quantized_linear import BlocksLinear, Int8Linear, WeightOnlyLinear, first_outputs
from backend.quant.smoothed_int8 import quantize_smoothed, smoothed_int8_matmul, smoothing_factors
from backend.utils.heap import give_back_freed_memory

log = logging.getLogger(__name__)

CALIBRATION_TEXT = Path(__file__).with_name("calibration_text.txt")
# Tokens a calibration forward pass takes at once: the whole text (571 tokens of SmolLM2's), so that the
# int8 weights of a group are settled as the pass goes (`smooth_within_error`).
CALIBRATION_WINDOW = 1024
# The relative error of a layer's output in int8 above which it keeps its dense copy. On SmolLM2
# most down projections (whose input, SiLU(gate) * up, has the widest outliers) measure 1.3-3%, the
# other projections 0.5-2%: at 2% perplexity is within 1% of float32 (docs/performance.md).
MAX_ERROR = 0.02
TIMED_ROWS = 32  # a full decode batch, where the int8 path must pay off
MIN_SPEEDUP = 1.1  # int8 replaces the dense copies only if it is clearly faster, not within noise
# Beside blocks, a copy for many rows is kept only if it multiplies a long prompt's chunk of this many
# rows this many times faster than the blocks do: it must at least halve the chunk's time. A copy holds 8
# or 16 bits a weight beside the blocks' 4.5 to 7, 1.6 to 3 times what the layer keeps resident, for
# prompts alone (a decode step's 32 rows multiply as fast in 4-bit blocks as by the int8 path without
# AMX). On the AVX-512 EPYC the int8 path was 1.3-1.4x the 4-bit blocks at 512 rows and 1.6x the 6-bit
# ones, and its copies took a 1B Q4_K_M file's memory from 1.2x llama-server's to 1.6x
# (docs/performance.md); with AMX a bfloat16 copy is several times as fast, and stays.
COPY_TIMED_ROWS = 512
# A projection of more weights than this is timed against its copies on its first outputs alone
# (`timed_part`): at COPY_TIMED_ROWS rows both paths are arithmetic, not reads of the weights, and take
# time in proportion to the outputs. Timed whole, the 1B Llama's three kinds of projection took 20 s of a
# 28 s start on the AVX2 EPYC, 11 of them the int8 path's one call that shows it cannot pay; on their first
# outputs 3.9 s, the blocks' time over the copy's within what it moves from run to run (docs/performance.md).
COPY_TIMED_WEIGHTS = 2**21
# The calibration gives the heap's freed pages back to the system (`malloc_trim`) each time the float32
# weights it made since add up to this: left, they stayed resident under the int8 weights made after them,
# 0.9 GiB of a 1B Q4_K_M file's load.
TRIM_AFTER_BYTES = 256 * 2**20
COPY_MIN_SPEEDUP = 2.0
# A copy's path is timed in rounds only if its first call took at most this many times what it must beat
# (the blocks' first call over COPY_MIN_SPEEDUP): a first call's one-off costs are not that large, and
# without VNNI int8 products (torch._int_mm) ran 20x slower than float32's, 0.34 s a call at 512 rows of
# SmolLM2's projections on the AVX2 EPYC, and their rounds were 6.6 s of a start's 8 s of timing.
COPY_HOPELESS = 4.0
# The row counts at which the head's kernels are timed against each other, fewest first.
HEAD_TIMED_ROWS = (4, 6, 8, 12, 16, 24, 32, 48, 64)
HEAD_TIMED_OUTPUTS = 8192
# And the projections': a decode step's rows, and prompt chunks beside them. Without AMX, blocks of
# int4 (block_weights.py) were faster than the int8 path up to about 128 rows (docs/performance.md).
PROJECTION_TIMED_ROWS = (16, 24, 32, 48, 64, 96, 128, 192, 256)


def calibration_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    return tokenizer(CALIBRATION_TEXT.read_text()).input_ids


def drop_dense_copies(model: nn.Module) -> None:
    """Let go of the projections' dense copies for many rows (kept or made on demand), where the RAM does
    not hold them: many rows then multiply by the packed weights. The head keeps its floats (the
    embedding, where tied)."""
    head = model.get_output_embeddings()
    for module in model.modules():
        if isinstance(module, WeightOnlyLinear) and module is not head:
            module.drop_dense()


def keep_dense_copies(model: nn.Module) -> None:
    """Keep the dense copies still made on demand (a GGUF file's lean load): those the calibration left
    for many rows, made once now rather than at each pass."""
    for module in model.modules():
        if isinstance(module, WeightOnlyLinear):
            module.keep_dense()


def drop_copies_blocks_match(model: nn.Module, paths: tuple[str, ...] = ("dense", "int8")) -> int:
    """Drop the quantized projections' copies for many rows where their weights are in blocks and no copy
    multiplies COPY_TIMED_ROWS rows COPY_MIN_SPEEDUP times faster than the blocks (`copies_pay_off`): there
    they cost memory, and the calibration of an int8 path a start, for nothing. Decided for each group of
    projections over one input in one kind of module (q, k, v and o; gate and up; down) and of one kind of
    block (a Q4_K_M file's Q6_K down projections are slower in blocks than its Q4_K ones), timed on its
    largest: on the AVX-512 EPYC the int8 path was 1.3x the 4-bit blocks at 512 rows for a 1B model's down
    projections and 1.6x the 6-bit ones (docs/performance.md), and layers that fuse into one kernel call
    decide alike. The head keeps its copy (where it is tied to the embedding, the copy is the embedding).
    `paths`: what a copy may multiply by; after `smooth_many_rows_path`, the copies left are those int8
    would move too far, timed as themselves ("dense",): without AMX a bfloat16 copy is slower than the
    blocks. Returns how many layers dropped theirs."""
    head = model.get_output_embeddings()
    groups: dict[tuple[str, int, str], list[WeightOnlyLinear]] = {}  # parent's type, in_features, layout
    for name, module in model.named_modules():
        if (
            isinstance(module, WeightOnlyLinear)
            and module is not head
            and module.blocks is not None
            and module.has_dense
        ):
            parent = model.get_submodule(name.rpartition(".")[0])
            groups.setdefault((type(parent).__name__, module.in_features, module.layout()), []).append(module)
    dropped = [
        layer
        for layers in groups.values()
        if not copies_pay_off(max(layers, key=weight_count), paths=paths)
        for layer in layers
    ]
    for layer in dropped:
        layer.drop_dense()
    if dropped:
        log.info(
            "%d of %d quantized projections multiply every number of rows in their blocks: no copy of theirs "
            "was %.2fx faster at %d rows (timed, by kind of projection)",
            len(dropped),
            sum(len(layers) for layers in groups.values()),
            COPY_MIN_SPEEDUP,
            COPY_TIMED_ROWS,
        )
    return len(dropped)


@torch.inference_mode()
def copies_pay_off(
    layer: WeightOnlyLinear, rows: int = COPY_TIMED_ROWS, paths: tuple[str, ...] = ("dense", "int8")
) -> bool:
    """Whether `rows` rows of random activations go through layer's dense copy, or an int8 version of it
    (`smoothed_int8.py`, unsmoothed: as fast), COPY_MIN_SPEEDUP times faster than through its blocks;
    `paths`: which of the two may. A path whose first call shows it cannot (COPY_HOPELESS) is not timed
    further. A layer of more than COPY_TIMED_WEIGHTS weights is timed on its first outputs (`timed_part`)."""
    layer = timed_part(layer)
    dense = layer.dense_weight()
    x = torch.randn(rows, layer.in_features, dtype=dense.dtype)
    smoothing = torch.ones(layer.in_features)
    int8 = quantize_smoothed(dense, smoothing) if "int8" in paths else None
    kernel, weights = layer.kernel()
    copies = {
        "dense": lambda: torch.nn.functional.linear(x, dense),
        "int8": lambda: smoothed_int8_matmul(x, *int8, smoothing),
    }
    calls = {"blocks": lambda: kernel(x.to(layer.compute_dtype), *weights)}
    calls.update((path, copies[path]) for path in paths)
    first = {name: seconds(call, repeats=1) for name, call in calls.items()}  # these warm them up, too
    contenders = [path for path in paths if first[path] * COPY_MIN_SPEEDUP <= COPY_HOPELESS * first["blocks"]]
    if not contenders:
        return False
    timed = {name: calls[name] for name in ("blocks", *contenders)}
    times = median_seconds(timed, rounds=3, repeats=2, warmed=True)
    return min(times[path] for path in contenders) * COPY_MIN_SPEEDUP <= times["blocks"]


def timed_part(layer: WeightOnlyLinear) -> WeightOnlyLinear:
    """`layer`, or where it holds more than COPY_TIMED_WEIGHTS weights, its first outputs that do not (a
    multiple of 16, as blocks hold them)."""
    outputs = max(16, COPY_TIMED_WEIGHTS // layer.in_features // 16 * 16)
    return layer if outputs >= layer.out_features else first_outputs(layer, outputs)


def smooth_many_rows_path(model: nn.Module, token_ids: list[int]) -> int:
    """Give the quantized projections that keep a dense copy an int8 path for many rows instead,
    calibrated on token_ids (`calibration_token_ids`), but those whose outputs it would move by more
    than MAX_ERROR; the dense copies of the others go. Returns how many layers changed."""
    head = model.get_output_embeddings()
    layers = [
        module
        for module in model.modules()
        if isinstance(module, WeightOnlyLinear) and module is not head and module.has_dense
    ]
    if not layers:
        return 0
    if not int8_multiplies_faster(max(layers, key=weight_count)):
        log.info("this CPU multiplies many rows faster by the dense copies than in int8: keeping them")
        return 0
    groups, ranges, weight_ranges_of = measure_inputs(model, layers, token_ids)
    give_back_freed_memory()  # the pass's activations, before the int8 weights are made above them
    smoothings = {}
    for group in groups:
        weight_ranges = torch.stack([weight_ranges_of[layer] for layer in group]).amax(dim=0)
        smoothings.update(dict.fromkeys(group, smoothing_factors(ranges[group[0]], weight_ranges)))
    count = sum(len(group) for group in smooth_within_error(model, groups, smoothings, token_ids))
    log.info(
        "%d of %d quantized projections multiply many rows as int8 activations times int8 weights; "
        "the rest, whose outputs moved by more than %.0f%% in int8, by their dense copies",
        count,
        len(layers),
        100 * MAX_ERROR,
    )
    return count


@torch.inference_mode()
def int8_multiplies_faster(layer: WeightOnlyLinear, rows: int = TIMED_ROWS) -> bool:
    """Whether `rows` rows of random activations go through layer at least MIN_SPEEDUP times faster as
    int8 times int8 than through its dense copy (median of alternating timings; a few ms in all)."""
    dense = layer.dense_weight()
    x = torch.randn(rows, layer.in_features, dtype=dense.dtype, device=dense.device)
    smoothing = torch.ones(layer.in_features, device=dense.device)
    weight_int8, weight_scales = quantize_smoothed(dense, smoothing)
    times = median_seconds(
        {
            "dense": lambda: torch.nn.functional.linear(x, dense),
            "int8": lambda: smoothed_int8_matmul(x, weight_int8, weight_scales, smoothing),
        },
        rounds=7,
        repeats=5,
    )
    return times["int8"] * MIN_SPEEDUP <= times["dense"]


def time_head_crossover(model: nn.Module) -> int | None:
    """Set from how many rows an int8 (or 5-bit or 6-bit) head with a dense copy multiplies by that
    copy: the fewest of HEAD_TIMED_ROWS at which the copy is at least as fast as the int8 kernel (else
    the most), timed on its first HEAD_TIMED_OUTPUTS outputs (both take time in proportion to them;
    the whole head of SmolLM2 took seconds). Returns the number, or None where the head has no such choice."""
    head = model.get_output_embeddings()
    if not isinstance(head, (Int8Linear, BlocksLinear)) or head.dense is None:
        return None
    sample = first_outputs(head, min(HEAD_TIMED_OUTPUTS, head.out_features))
    head.dense_from_rows = dense_pays_from(sample, HEAD_TIMED_ROWS, head.dense.dtype)
    log.info("the output head multiplies %d rows or more by its dense copy (timed)", head.dense_from_rows)
    return head.dense_from_rows


def drop_unpaid_head_copy(model: nn.Module, rows: int) -> bool:
    """Let go of the output head's dense copy where it would not multiply a decode step of up to `rows`
    rows (the crossover `time_head_crossover` timed is past them) and holds floats of its own: a head
    tied to the input embedding shares the embedding's, which stay for the lookups (or go with
    blocks_embedding.serve_from_tied_head). The head then multiplies every number of rows by its packed
    weights. Returns whether it let go."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if not isinstance(head, WeightOnlyLinear) or head.dense is None or head.dense_from_rows <= rows:
        return False
    weight = getattr(embedding, "weight", None)
    if weight is not None and same_storage(weight, head.dense):
        return False
    head.drop_dense()
    return True


def time_projection_crossover(model: nn.Module) -> int | None:
    """Set from how many rows the quantized projections multiply by their path for many rows (the
    dense copies, or their int8 path): the fewest of PROJECTION_TIMED_ROWS at which it is at least as
    fast as the packed kernel, timed on the largest projection. Returns the number, or None where no
    projection has such a path (a GPU)."""
    head = model.get_output_embeddings()
    layers = [
        module
        for module in model.modules()
        if isinstance(module, WeightOnlyLinear) and module is not head and module.has_many_rows_path
    ]
    if not layers:
        return None
    largest = max(layers, key=lambda layer: layer.in_features * layer.out_features)
    rows = dense_pays_from(largest, PROJECTION_TIMED_ROWS, model.dtype)
    for layer in layers:
        layer.dense_from_rows = rows
    log.info("the quantized projections multiply %d rows or more by their path for many rows (timed)", rows)
    return rows


def dense_pays_from(layer: WeightOnlyLinear, candidates: tuple[int, ...], dtype: torch.dtype) -> int:
    """The fewest `candidates` rows that `layer` multiplies at least as fast by its path for many rows
    as by its packed kernel (`dense_pays_at`), activations in `dtype`; the last candidate if none."""
    return next((rows for rows in candidates if dense_pays_at(layer, rows, dtype)), candidates[-1])


@torch.inference_mode()
def dense_pays_at(layer: WeightOnlyLinear, rows: int, dtype: torch.dtype) -> bool:
    """Whether `rows` rows of random activations in `dtype` go through `layer`'s path for many rows (its
    dense copy or int8 path) at least as fast as through its packed kernel, casts included
    (`median_seconds` of three rounds)."""
    x = torch.randn(rows, layer.in_features, dtype=dtype)
    kernel, weights = layer.kernel()
    times = median_seconds(
        {
            "dense": lambda: layer.many_rows_matmul(x),
            "packed": lambda: kernel(x.to(layer.compute_dtype), *weights).to(x.dtype),
        },
        rounds=3,
        repeats=1,
    )
    return times["dense"] <= times["packed"]


def median_seconds(
    calls: dict[str, Callable[[], object]], rounds: int, repeats: int, warmed: bool = False
) -> dict[str, float]:
    """Each call's median time over `rounds` rounds that take the calls in turn (a noisy neighbour then
    slows all alike), each timing over `repeats` calls, after a first untimed call of each (which may
    allocate or pick a kernel) unless the caller has `warmed` them."""
    if not warmed:
        for call in calls.values():
            call()
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(seconds(call, repeats))
    return {name: statistics.median(values) for name, values in times.items()}


def seconds(call: Callable[[], object], repeats: int) -> float:
    """Time of one call, over `repeats` calls."""
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


@torch.inference_mode()
def smooth_within_error(
    model: nn.Module,
    groups: list[list[nn.Module]],
    smoothings: dict[nn.Module, torch.Tensor],
    token_ids: list[int],
) -> list[list[nn.Module]]:
    """Give each group whose layers' relative errors on token_ids with their int8 path, |y_int8 - y| / |y|,
    are all within MAX_ERROR that path (their dense copies go); returns those groups.

    A layer's int8 weights are made as the pass first reaches it, and in the pass's last window each
    group is settled as soon as its last layer is measured: smoothed, or its int8 weights let go. Made
    for every layer before the pass, they were a byte a parameter beside the dense copies, the peak of a
    1B Q4_K_M file's start (4.4 GiB where it serves in 2.4); so, where the text is one window, a start
    holds one group's. A layer the text never reaches (an expert no token chose) is settled at the end,
    its error taken as none, as before. A layer whose dense copy is made on demand (a GGUF file's lean
    load) holds one through its call (`HeldDense`) and keeps it only where its group is not smoothed."""
    candidates: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
    squared_errors: dict[nn.Module, float] = defaultdict(float)
    squared_norms: dict[nn.Module, float] = defaultdict(float)
    group_of = {layer: index for index, group in enumerate(groups) for layer in group}
    measured_last: dict[int, set[nn.Module]] = defaultdict(set)  # in the last window, by group
    settled: dict[int, bool] = {}  # by group: whether smoothed
    windows = calibration_windows(model, token_ids)

    def int8_weights(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in candidates:
            candidates[layer] = quantize_smoothed(layer.dense_weight(), smoothings[layer])
        return candidates[layer]

    def settle(index: int) -> None:
        nonlocal made_since_trim
        errors = [squared_errors[layer] / max(squared_norms[layer], 1e-30) for layer in groups[index]]
        settled[index] = max(errors) ** 0.5 <= MAX_ERROR
        for layer in groups[index]:
            weights = int8_weights(layer) if settled[index] else None
            candidates.pop(layer, None)
            if weights is not None:
                layer.use_smoothed_int8(*weights, smoothings[layer])
            else:
                layer.keep_dense()
        # The groups' temporaries (float32 weights, a layer's copy), freed under the int8 weights kept
        # after them, go back to the system once they add up: trimmed after every group, a start of the
        # default model spent 0.4 s in it.
        made_since_trim += sum(weight_count(layer) for layer in groups[index]) * 4
        if made_since_trim >= TRIM_AFTER_BYTES:
            give_back_freed_memory()
            made_since_trim = 0

    def compare(layer: nn.Module, args: tuple, output: torch.Tensor) -> None:
        index = group_of[layer]
        if index in settled:  # a layer the pass calls twice
            held.release(layer)
            return
        x = args[0].reshape(-1, layer.in_features)
        expected = output.reshape(-1, layer.out_features).float()
        if layer.bias is not None:
            expected = expected - layer.bias.float()
        weights = int8_weights(layer)
        held.release(layer)  # before `settle` may keep it
        got = smoothed_int8_matmul(x, *weights, smoothings[layer])
        squared_errors[layer] += (got - expected).square().sum().item()
        squared_norms[layer] += expected.square().sum().item()
        if in_last_window:
            measured_last[index].add(layer)
            if len(measured_last[index]) == len(groups[index]):
                settle(index)

    in_last_window = False  # read by compare as the pass goes
    made_since_trim = 0  # bytes of float32 weights made since the heap was last trimmed
    held = HeldDense()
    hooks = [layer.register_forward_pre_hook(held.hold) for layer in group_of]
    hooks += [layer.register_forward_hook(compare) for layer in group_of]
    try:
        for number, ids in enumerate(windows):
            in_last_window = number == len(windows) - 1
            run_over(model, ids)
    finally:
        for hook in hooks:
            hook.remove()
    for index in range(len(groups)):
        if index not in settled:
            settle(index)
    return [group for index, group in enumerate(groups) if settled[index]]


class HeldDense:
    """Dense copies made on demand (a GGUF file's lean load: `WeightOnlyLinear.make_dense_on_demand`) held
    from a layer's forward pre-hook to what its forward hook reads of it, so that a calibration pass makes
    each layer's copy once, and holds one layer's at a time."""

    def __init__(self) -> None:
        self.layers: set[nn.Module] = set()

    def hold(self, layer: nn.Module, args: tuple) -> None:
        if layer.dense is None and layer.dense_on_demand is not None:
            layer.dense = layer.dense_weight()
            self.layers.add(layer)

    def release(self, layer: nn.Module) -> None:
        if layer in self.layers:
            self.layers.discard(layer)
            layer.dense = None


def column_ranges(values: torch.Tensor) -> torch.Tensor:
    """The largest absolute value in each column of values [n, columns], in float32: taken in values' own
    dtype, where |x| is exact, without a float32 copy of them (a bfloat16 projection's took twice as long)."""
    return values.abs().amax(dim=0).float()


def weight_count(layer: nn.Module) -> int:
    return layer.in_features * layer.out_features


def calibration_windows(model: nn.Module, token_ids: list[int]) -> list[list[int]]:
    """token_ids in windows of CALIBRATION_WINDOW, or of the model's positions where it has fewer."""
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None) or CALIBRATION_WINDOW
    size = min(CALIBRATION_WINDOW, positions)
    return [token_ids[start : start + size] for start in range(0, len(token_ids), size)]


def run_over(model: nn.Module, token_ids: list[int]) -> None:
    """The model's forward pass over token_ids (one window), without its head (not calibrated, and a
    quantized one has no `weight` for the forward of a model that reads its dtype: Mamba's)."""
    model.base_model(torch.tensor([token_ids], device=model.device))


@torch.inference_mode()
def measure_inputs(
    model: nn.Module, layers: list[nn.Module], token_ids: list[int]
) -> tuple[list[list[nn.Module]], dict[nn.Module, torch.Tensor], dict[nn.Module, torch.Tensor]]:
    """Run the model over token_ids; return the layers grouped by the input they read (the same
    tensor), each layer's largest absolute input per channel, and its dense copy's largest absolute
    weight per input channel (taken as the pass holds the copy, where it is made on demand)."""
    ranges: dict[nn.Module, torch.Tensor] = {}
    weight_ranges: dict[nn.Module, torch.Tensor] = {}
    readers: dict[int, list[nn.Module]] = defaultdict(list)  # in the first window: input tensor -> layers
    first_inputs: list[torch.Tensor] | None = []  # kept, so that no other tensor takes their ids
    held = HeldDense()

    def record(layer: nn.Module, args: tuple) -> None:
        x = args[0]
        seen = column_ranges(x.reshape(-1, x.shape[-1]))
        ranges[layer] = seen if layer not in ranges else torch.maximum(ranges[layer], seen)
        if first_inputs is not None:
            readers[id(x)].append(layer)
            first_inputs.append(x)
        held.hold(layer, args)

    def weigh(layer: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if layer not in weight_ranges:
            weight_ranges[layer] = column_ranges(layer.dense_weight())
        held.release(layer)

    hooks = [layer.register_forward_pre_hook(record) for layer in layers]
    hooks += [layer.register_forward_hook(weigh) for layer in layers]
    try:
        for window in calibration_windows(model, token_ids):
            run_over(model, window)
            first_inputs = None
    finally:
        for hook in hooks:
            hook.remove()
    for layer in layers:  # those the text never reached (an expert no token chose)
        if layer not in weight_ranges:
            weight_ranges[layer] = column_ranges(layer.dense_weight())
    groups = list(readers.values())
    grouped = {layer for group in groups for layer in group}
    return groups + [[layer] for layer in layers if layer not in grouped], ranges, weight_ranges
