"""Which code runs a step of each shape: decided once, from the runner's settings, and logged.

A step can run several ways, and each was chosen by its own rule: a CUDA
graph on a GPU, the layers in one C++ call (decode_layers.cpp) below the
rows where a projection switches to its path for many rows, the Python
loop over the layers (compiled or not) below `DECODE_BELOW` rows with
PyTorch's operations, the general forward otherwise; attention by the
CPU's loop where it is built for the model's head size, else PyTorch's
kernel; and each quantized projection by its blocks below the rows where
its dense copy or int8 path pays. The plan asks each rule once for every
step shape, the runner dispatches on its answer, and the start-up log
prints it by bucket, so that "what runs for a 20-row bfloat16 step?" has
one answer:

    step plan of SmolLM2-135M-Instruct:
      decode steps of 1-15 rows: the layers in one C++ call (decode_layers.cpp); attention: the CPU's
        loop, each query over its own row; projections: 4-bit blocks (AVX-512 VNNI); head: ...
      decode steps of 16-32 rows: decode_layers, a Python loop over the layers; ...
      steps with prompts (projections at a 512-token chunk): the runner's general forward; ...
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from backend.layers.step_layout import StepLayout
from backend.quant.quantized_linear import WeightOnlyLinear, dtype_name

log = logging.getLogger(__name__)

GRAPH = "a CUDA graph of decode_layers and the head (decode_graphs.py)"
NATIVE = "the layers in one C++ call (decode_layers.cpp)"
COMPILED_LOOP = "decode_layers compiled by torch.compile"
LOOP = "decode_layers, a Python loop over the layers"
FORWARD = "the runner's general forward"
TRANSFORMERS = "transformers' forward with the engine's attention"
DECODE_LAYERS = (LOOP, COMPILED_LOOP)

LOOP_ATTENTION = "the CPU's loop, each query over its own row"
BATCH_ATTENTION = "PyTorch's kernel, a batch over the span's rows"
# How the plan describes the projections of a step with prompts: as they multiply a chunk this long.
DESCRIBED_CHUNK = 512


@dataclass(frozen=True)
class StepPath:
    """What runs one step shape: its layers, its attention, its projections and its head."""

    layers: str
    attention: str
    projections: str
    head: str

    def __str__(self) -> str:
        parts = (self.layers, f"attention: {self.attention}", f"projections: {self.projections}")
        return "; ".join((*parts, f"head: {self.head}"))


@dataclass(frozen=True)
class StepPlan:
    """The path of every step shape: decode steps by their rows, decode steps with rows that attend
    alone (step_layout.long_rows), and steps with prompt tokens."""

    decode: tuple[StepPath, ...]  # [rows - 1]: a step of that many decoding rows
    long_rows: StepPath | None  # None: no row reads alone (each decode query reads its own positions)
    prompts: StepPath

    def path(self, layout: StepLayout) -> StepPath:
        """The path of a step laid out so. A CUDA graph takes long rows in its batch: it reads every row
        as far as the span's bucket anyway."""
        decode_queries = layout.decode_queries
        if layout.prompts or not decode_queries:
            return self.prompts
        if layout.long_rows and self.long_rows is not None:
            return self.long_rows
        if decode_queries > len(self.decode):
            raise ValueError(f"a step of {decode_queries} rows: the plan goes up to {len(self.decode)}")
        return self.decode[decode_queries - 1]

    def describe(self) -> list[str]:
        """One line a bucket of decode rows that run the same way, then the other two shapes."""
        lines, first = [], 1
        for rows in range(1, len(self.decode) + 1):
            if rows == len(self.decode) or self.decode[rows] != self.decode[first - 1]:
                span = f"{first}" if first == rows else f"{first}-{rows}"
                lines.append(f"decode steps of {span} rows: {self.decode[first - 1]}")
                first = rows + 1
        if self.long_rows is not None:
            lines.append(f"decode steps with long rows read alone: {self.long_rows}")
        lines.append(f"steps with prompts (projections at a {DESCRIBED_CHUNK}-token chunk): {self.prompts}")
        return lines

    def log(self, name: str) -> None:
        log.info("step plan of %s:\n  %s", name, "\n  ".join(self.describe()))


def plan_runner(
    rows: int,
    *,
    graphs: bool,
    native_below: float,
    loop_below: float,
    compiled: bool,
    loop_attention: bool,
    projections: list[nn.Module],
    head: nn.Module,
) -> StepPlan:
    """The plan of the decoder runner (decoder_runner.py): `native_below` and `loop_below` are the rows
    below which a decode step runs decode_layers.cpp and decode_layers; `loop_attention` whether decode
    queries attend by the CPU's loop."""

    def decode_layers(count: int) -> str:
        if graphs:
            return GRAPH
        if count < native_below:
            return NATIVE
        if count < loop_below:
            return COMPILED_LOOP if compiled else LOOP
        return FORWARD

    def path(layers: str, attention: str, count: int) -> StepPath:
        return StepPath(layers, attention, linear_paths(projections, count), linear_paths([head], count))

    decode_attention = LOOP_ATTENTION if loop_attention else BATCH_ATTENTION
    if graphs:
        decode_attention += ", every row, its span in buckets"
    prompt_attention = (
        f"{LOOP_ATTENTION} (and new prompts of up to 32 tokens); PyTorch's kernel for longer prompts"
        if loop_attention
        else BATCH_ATTENTION + "; PyTorch's kernel for each prompt"
    )
    return StepPlan(
        decode=tuple(path(decode_layers(n), decode_attention, n) for n in range(1, rows + 1)),
        long_rows=None
        if loop_attention
        else path(GRAPH if graphs else FORWARD, BATCH_ATTENTION + ", the longest rows alone", rows),
        prompts=path(FORWARD, prompt_attention, DESCRIBED_CHUNK),
    )


def plan_transformers(rows: int, model: nn.Module) -> StepPlan:
    """The plan of a model that runs through transformers' forward: one path, whatever the shape."""
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, WeightOnlyLinear))]
    head = model.get_output_embeddings()
    projections = [m for m in linears if m is not head]

    def path(count: int) -> StepPath:
        linear = linear_paths(projections, count)
        return StepPath(TRANSFORMERS, BATCH_ATTENTION, linear, linear_paths([head], count))

    return StepPlan(tuple(path(n) for n in range(1, rows + 1)), path(rows), path(DESCRIBED_CHUNK))


def linear_paths(linears: Iterable[nn.Module], rows: int) -> str:
    """What multiplies these layers at this many rows, each kind once."""
    return ", ".join(dict.fromkeys(linear_path(linear, rows) for linear in linears)) or "none"


def linear_path(linear: nn.Module, rows: int) -> str:
    if isinstance(linear, WeightOnlyLinear):
        return linear.path_at(rows)
    weight = getattr(linear, "weight", None)
    return f"{dtype_name(weight.dtype)} weights" if weight is not None else type(linear).__name__
