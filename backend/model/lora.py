"""LoRA adapters served beside the base model, each row with its own (vLLM's --lora-modules).

A LoRA adapter (a PEFT checkpoint: adapter_config.json and
adapter_model.safetensors) changes some of the model's linear layers by a
low-rank product: a layer's output for input x becomes

    base(x) + B(A(x)) * scaling        (A: [rank, in], B: [out, rank], scaling = alpha / rank)

Every adapter is loaded at start and kept beside the base weights, which
stay as they are (quantized or not): each targeted layer is wrapped once
(`LoraLinear`) and adds, for each token of the step, its adapter's product
(`LayerChanges`, every adapter's matrices of a group of layers in one
product, each token keeping its own adapter's part). Which adapter each
token has is the step's `token_slots` (`adapter_slots`, from each row's
adapter), set before the forward pass on the batch the wrapped layers share:
rows of different adapters, and rows of the base model, decode in one step,
as punica's and vLLM's multi-LoRA batches do. A step without an adapter's
row costs one check a layer.

Served: LoRA of linear layers (attention and dense MLP projections) with
rsLoRA's scaling, rank_pattern and alpha_pattern. Refused at start with the
reason: DoRA, trained biases, modules_to_save, fan_in_fan_out (GPT-2's
Conv1D), adapters of the embeddings or the head, and targets the model
does not have as a linear layer (a mixture of experts' fused experts).
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from backend.utils.host_lists import to_device

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # how PEFT's saved keys start: the wrapped model's own names follow


class AdapterError(ValueError):
    """An adapter that cannot be served, with the reason."""


@dataclass(frozen=True)
class StepAdapters:
    """The adapters of a step's tokens (`adapter_slots`)."""

    token_slots: torch.Tensor  # [tokens]: each token's adapter slot, 0 for the model's own
    lowest: int  # the lowest and the highest adapter slot among them
    highest: int
    uniform: bool  # every token has the same adapter


@dataclass
class LoraBatch:
    """What the wrapped layers of one model share: the current step's adapters (None where no token of
    the step has one)."""

    step: StepAdapters | None = None
    token_column: torch.Tensor | None = None  # the step's token_slots as a column, [tokens, 1]

    def use(self, step: StepAdapters | None) -> None:
        self.step = step
        self.token_column = step.token_slots[:, None] if step is not None else None


@dataclass(frozen=True)
class LoraWeights:
    """One adapter's change to one layer, as its checkpoint has it."""

    down: torch.Tensor  # A: [rank, in]
    up: torch.Tensor  # B: [out, rank]
    scaling: float


class LoraLinear(nn.Module):
    """A linear layer (any module of [..., in] to [..., out]: nn.Linear, the engine's quantized layers)
    with the adapters' changes added for their tokens."""

    def __init__(self, base: nn.Module, batch: LoraBatch):
        super().__init__()
        self.base = base
        self.batch = batch
        self.adapters: dict[int, LoraWeights] = {}  # by slot
        self.in_features, self.out_features = features_of(base)

    @functools.cached_property
    def changes(self) -> LayerChanges:
        """Its adapters' changes, stacked once every adapter is loaded (at the first step)."""
        return LayerChanges.of([self])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.changes(x, self.base(x))


class LayerChanges:
    """Every adapter's changes to one or more layers over one input whose outputs lie side by side (q, k
    and v, or gate and up, fused; or one layer), as one product of two matrices: all the adapters' A
    matrices of these layers stacked, [in, ranks], and their B matrices scaled and placed
    block-diagonally, [ranks, outputs] (zeros where an adapter leaves a layer alone). Each token keeps
    its own adapter's columns of A(x) alone (a mask from the columns' slots), so that the step's tokens
    of every adapter, and of none, are changed in the same five operations, where taking each adapter's
    tokens apart took five an adapter (with index_select and index_add_). The columns are in slot
    order, and a step multiplies by those from its lowest adapter's to its highest's: a step of one
    adapter reads that adapter's matrices alone (reading all four adapters' gave one row 0.6x the
    speed, 2-core EPYC), one of several those of the adapters between them too."""

    def __init__(self, batch: LoraBatch, down: torch.Tensor, up: torch.Tensor, column_slots: list[int]):
        self.batch = batch
        self.down = down  # the A matrices, transposed: [in, ranks]
        self.up = up  # the B matrices, scaled, transposed: [ranks, outputs]
        self.column_slots = column_slots  # the adapter of each column, in slot order
        self.slots = torch.tensor(column_slots, device=down.device)
        # (lowest, highest) adapter of a step: the views of the columns between them, or None
        self.views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = {}

    @classmethod
    def of(cls, layers: Sequence[nn.Module]) -> LayerChanges | None:
        """The changes to these layers' outputs side by side; None where no adapter changes any."""
        changed = [layer for layer in layers if isinstance(layer, LoraLinear)]
        if not changed:
            return None
        downs, ups, column_slots = [], [], []
        for slot in sorted({slot for layer in changed for slot in layer.adapters}):
            blocks = []  # the adapter's B of each layer, its rank's columns, its layer's output rows
            for layer in layers:
                weights = layer.adapters.get(slot) if isinstance(layer, LoraLinear) else None
                if weights is not None:
                    downs.append(weights.down)
                    blocks.append(weights.up * weights.scaling)
                    column_slots += [slot] * weights.down.shape[0]
                else:  # a layer this adapter leaves alone: its outputs' rows of B are zeros
                    blocks.append(weights_like(changed[0], features_of(unwrapped(layer))[1]))
            ups.append(torch.block_diag(*blocks).t())  # [its ranks, every layer's outputs]
        # transposed once: torch.mm of [tokens, in] by [in, ranks] takes 60% of linear's time at a row
        down = torch.cat(downs).t().contiguous()
        up = torch.cat(ups).contiguous()
        return cls(changed[0].batch, down, up, column_slots)

    def __call__(self, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """The layers' `output` for `x` with the step's adapters' changes added, for their tokens."""
        step = self.batch.step
        if step is None:
            return output
        views = self.views_of(step.lowest, step.highest)
        if views is None:  # the step's adapters leave these layers alone
            return output
        down, up, slots = views
        flat_in, flat_out = x.reshape(-1, x.shape[-1]), output.reshape(-1, output.shape[-1])
        reduced = torch.mm(flat_in.to(down.dtype), down)
        if not step.uniform:  # each token its own adapter's columns
            reduced.mul_(slots == self.batch.token_column)
        flat_out += torch.mm(reduced, up).to(output.dtype)  # (in the output's dtype before the add)
        return flat_out.view(output.shape)

    def views_of(self, lowest: int, highest: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The A columns, B rows and column slots of the adapters from `lowest` to `highest`, kept for
        the next step of the same adapters; None where none of them changes these layers."""
        key = (lowest, highest)
        if key not in self.views:
            start = bisect.bisect_left(self.column_slots, lowest)
            stop = bisect.bisect_right(self.column_slots, highest)
            within = slice(start, stop)
            views = (self.down[:, within], self.up[within], self.slots[within])
            self.views[key] = views if start < stop else None
        return self.views[key]


def weights_like(layer: LoraLinear, rows: int) -> torch.Tensor:
    """B's rows for a layer an adapter leaves alone: zeros of no rank, in the adapters' dtype and device."""
    some = next(iter(layer.adapters.values())).up
    return some.new_zeros(rows, 0)


def unwrapped(module: nn.Module) -> nn.Module:
    """The base layer of a layer LoRA adapters change, else the module itself."""
    return module.base if isinstance(module, LoraLinear) else module


def lora_batch_of(model: nn.Module) -> LoraBatch | None:
    """The batch the model's adapter-changed layers share; None where no adapter is loaded."""
    return next((m.batch for m in model.modules() if isinstance(m, LoraLinear)), None)


def features_of(module: nn.Module) -> tuple[int, int]:
    """A linear layer's input and output sizes."""
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return module.in_features, module.out_features
    raise AdapterError(f"{type(module).__name__} is not a linear layer")


@dataclass
class Adapters:
    """The adapters a model serves: each name's slot (1, 2, ...; 0 is the base model), and the batch
    its wrapped layers read."""

    slots: dict[str, int] = field(default_factory=dict)
    batch: LoraBatch = field(default_factory=LoraBatch)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.slots)


def load_adapters(model: nn.Module, specs: Sequence[tuple[str, str]]) -> Adapters | None:
    """Every (name, directory) adapter loaded onto `model`'s layers, on its device (in its dtype, but
    float32 on a CPU); None where there are none. An adapter that cannot be served raises AdapterError
    naming it."""
    if not specs:
        return None
    adapters = Adapters()
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    # A CPU multiplies a few rows by a rank-16 matrix in bfloat16 in 3-4 times float32's time (82 against
    # 23 us for one row through a 576-by-1,536 layer, 2-core EPYC): the products are float32 there.
    dtype = torch.float32 if device.type == "cpu" else dtype
    wrapped: dict[str, LoraLinear] = {}
    for slot, (name, path) in enumerate(specs, start=1):
        if name in adapters.slots:
            raise AdapterError(f"--lora-modules names the adapter {name!r} twice")
        try:
            changes = read_adapter(Path(path))
            for module_name, weights in changes.items():
                layer = wrapped.get(module_name) or wrap(model, module_name, adapters.batch)
                wrapped[module_name] = layer
                check_shapes(module_name, layer, weights)
                layer.adapters[slot] = LoraWeights(
                    weights.down.to(device, dtype), weights.up.to(device, dtype), weights.scaling
                )
        except AdapterError as error:
            raise AdapterError(f"LoRA adapter {name!r} ({path}): {error}") from None
        adapters.slots[name] = slot
        ranks = sorted({w.down.shape[0] for w in changes.values()})
        log.info("LoRA adapter %r: %d layers, rank %s, from %s", name, len(changes), ranks, path)
    return adapters


def read_adapter(directory: Path) -> dict[str, LoraWeights]:
    """A PEFT LoRA checkpoint's changes, by the module names of the model it adapts."""
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterError(f"no {CONFIG_FILE} there: a LoRA adapter is a directory PEFT saved")
    config = json.loads(config_path.read_text())
    check_config(config)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise AdapterError(f"no {WEIGHTS_FILE} there (a pickled adapter_model.bin is not loaded)")
    tensors = load_file(weights_path)
    changes: dict[str, LoraWeights] = {}
    for key, down in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module_name = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        if module_name.rsplit(".", 1)[-1] in ("embed_tokens", "lm_head", "wte", "word_embeddings"):
            raise AdapterError(f"{module_name}: LoRA of the embeddings or the head is not served")
        up = tensors.get(key.removesuffix(".lora_A.weight") + ".lora_B.weight")
        if up is None:
            raise AdapterError(f"{key} has no lora_B beside it")
        rank = down.shape[0]
        alpha = pattern_value(config.get("alpha_pattern") or {}, module_name, config.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        changes[module_name] = LoraWeights(down.float(), up.float(), scaling)
    if not changes:
        raise AdapterError(f"{WEIGHTS_FILE} has no LoRA weights")
    other = next((key for key in tensors if not key.endswith((".lora_A.weight", ".lora_B.weight"))), None)
    if other is not None:  # a base layer's own weights (PEFT's save_embedding_layers), say
        raise AdapterError(f"{other}: only LoRA's A and B matrices of linear layers are served")
    return changes


def check_config(config: dict) -> None:
    """Refuse what the wrapped layers do not compute: another kind of adapter, or LoRA's options that
    change more than the product above."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"a {config['peft_type']} adapter; only LoRA adapters are served")
    if config.get("use_dora"):
        raise AdapterError("a DoRA adapter (use_dora); only plain LoRA is served")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"trained biases (bias: {config['bias']!r}) are not served")
    if config.get("modules_to_save"):
        saved = config["modules_to_save"]
        raise AdapterError(f"whole modules saved beside the adapter ({saved}) are not served")
    if config.get("fan_in_fan_out"):
        raise AdapterError("fan_in_fan_out (Conv1D layers' transposed weights) is not served")


def pattern_value(patterns: dict[str, float], module_name: str, default: float) -> float:
    """PEFT's alpha_pattern: the value of the first pattern that matches the module's name at its end."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module_name):
            return value
    return default


def wrap(model: nn.Module, module_name: str, batch: LoraBatch) -> LoraLinear:
    """The model's layer `module_name`, wrapped in place."""
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        raise AdapterError(f"it changes {module_name}, which the model has not as a linear layer") from None
    try:
        layer = LoraLinear(module, batch)
    except AdapterError as error:
        raise AdapterError(f"{module_name}: {error}") from None
    parent_name, _, child = module_name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, layer)
    return layer


def check_shapes(module_name: str, layer: LoraLinear, weights: LoraWeights) -> None:
    rank = weights.down.shape[0]
    expected_down, expected_up = (rank, layer.in_features), (layer.out_features, rank)
    if tuple(weights.down.shape) != expected_down or tuple(weights.up.shape) != expected_up:
        raise AdapterError(
            f"{module_name}: A is {list(weights.down.shape)} and B {list(weights.up.shape)}, where the "
            f"model's layer takes {list(expected_down)} and {list(expected_up)}: an adapter of another model"
        )


def adapter_slots(
    token_rows: Sequence[int], row_slots: Sequence[int], device: torch.device
) -> StepAdapters | None:
    """The step's adapters, from each packed token's row and each row's adapter slot (0: the model's
    own); None where no token has an adapter."""
    slots = [row_slots[row] for row in token_rows]
    present = set(slots)
    adapters = present - {0}
    if not adapters:
        return None
    uniform = len(present) == 1
    return StepAdapters(to_device(slots, device, torch.long), min(adapters), max(adapters), uniform)
