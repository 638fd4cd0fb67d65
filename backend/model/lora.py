"""LoRA adapters served beside the base model, each row with its own (vLLM's --lora-modules).

A LoRA adapter (a PEFT checkpoint: adapter_config.json and
adapter_model.safetensors) changes some of the model's linear layers by a
low-rank product: a layer's output for input x becomes

    base(x) + B(A(x)) * scaling        (A: [rank, in], B: [out, rank], scaling = alpha / rank)

Adapters are loaded at start, and with --allow-runtime-lora while the
server runs (vLLM's /v1/load_lora_adapter), each kept beside the base
weights, which stay as they are (quantized or not): each targeted layer
(every linear layer but the head, where adapters may come later) is wrapped
once (`LoraLinear`) and adds, for each token of the step, its adapter's product
(`LayerChanges`, every adapter's matrices of a group of layers in one
product, each token keeping its own adapter's part). Which adapter each
token has is the step's `token_slots` (`adapter_slots`, from each row's
adapter), set before the forward pass on the batch the wrapped layers share:
rows of different adapters, and rows of the base model, decode in one step,
as punica's and vLLM's multi-LoRA batches do. A step without an adapter's
row costs one check a layer.

An adapter loaded or unloaded while running changes every layer's stacked
matrices between two steps (`Adapters.add`, `Adapters.drop`): its columns
are added after the others', or taken out. Slots are never given twice: an
unloaded adapter's rows finish with its weights, which go when the last of
them ends, and a later adapter of the same name is another slot, whose
cached prefixes are its own (and whose columns come last).

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

from backend.quant.fp8_linear import Fp8Layer
from backend.quant.quantized_linear import WeightOnlyLinear
from backend.utils.host_lists import to_device
from backend.utils.hub import ADAPTER_FILES, DownloadFailed, download_adapter, names_hub_repository

log = logging.getLogger(__name__)

CONFIG_FILE, WEIGHTS_FILE = ADAPTER_FILES
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
    # Every layers' changes made of these layers: an adapter's columns go in or out as it comes or goes
    changes: list[LayerChanges] = field(default_factory=list)

    def use(self, step: StepAdapters | None) -> None:
        self.step = step
        self.token_column = step.token_slots[:, None] if step is not None else None


@dataclass(frozen=True)
class LoraWeights:
    """One adapter's change to one layer, as its checkpoint has it."""

    down: torch.Tensor  # A: [rank, in]
    up: torch.Tensor  # B: [out, rank]
    scaling: float

    def to(self, device: torch.device, dtype: torch.dtype) -> LoraWeights:
        return LoraWeights(self.down.to(device, dtype), self.up.to(device, dtype), self.scaling)


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
        """Its adapters' changes (made at the first step, restacked as adapters come and go)."""
        return LayerChanges([self])

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

    def __init__(self, layers: Sequence[nn.Module]):
        """`layers`: one LoraLinear at least."""
        self.layers = tuple(layers)
        self.batch = next(layer.batch for layer in layers if isinstance(layer, LoraLinear))
        self.batch.changes.append(self)
        self.restack()

    @classmethod
    def of(cls, layers: Sequence[nn.Module]) -> LayerChanges | None:
        """The changes to these layers' outputs side by side; None where none is wrapped for adapters."""
        return cls(layers) if any(isinstance(layer, LoraLinear) for layer in layers) else None

    def restack(self) -> None:
        """Every adapter's matrices of these layers stacked as they are now."""
        self.down = self.up = self.slots = None  # None: no adapter changes these layers
        self.column_slots: list[int] = []  # the adapter of each column, in slot order
        self.views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = {}
        changed = [layer for layer in self.layers if isinstance(layer, LoraLinear)]
        for slot in sorted({slot for layer in changed for slot in layer.adapters}):
            self.add(slot)

    def add(self, slot: int) -> None:
        """An adapter's matrices of these layers (where it changes them) stacked after the others': its
        slot is the highest yet (slots are never given twice). Only its columns are made, then joined to
        the others': restacking every adapter's paused every row 679-727 ms at the eighth rank-64 adapter
        of the default model, 252-262 ms so (2-core EPYC, docs/performance.md)."""
        if self.column_slots and slot <= self.column_slots[-1]:
            raise ValueError(f"adapter slot {slot} is not above the slots stacked ({self.column_slots[-1]})")
        changed = [layer for layer in self.layers if isinstance(layer, LoraLinear)]
        if not any(slot in layer.adapters for layer in changed):
            return
        downs, blocks = [], []  # its A of each layer; its B of each, its rank's columns, its layer's rows
        for layer in self.layers:
            weights = layer.adapters.get(slot) if isinstance(layer, LoraLinear) else None
            if weights is not None:
                downs.append(weights.down.t())
                blocks.append((weights.up * weights.scaling).t())
            else:  # a layer this adapter leaves alone: its outputs' columns of B transposed are zeros
                blocks.append(weights_like(changed, features_of(unwrapped(layer))[1]).t())
        # Transposed, as each step reads them (torch.mm of [tokens, in] by [in, ranks] took 60% of linear's
        # time at a row the other way), in one copy: joined from the transposes (the block-diagonal of
        # transposes is the transposed block-diagonal), not joined then copied transposed (half a load).
        down = torch.cat(downs, dim=1)  # the A matrices, transposed: [in, its ranks]
        up = torch.block_diag(*blocks)  # the B matrices, scaled, transposed: [its ranks, every output]
        self._stack(
            down if self.down is None else torch.cat((self.down, down), dim=1),
            up if self.up is None else torch.cat((self.up, up)),
            self.column_slots + [slot] * down.shape[1],
        )

    def remove(self, slot: int) -> None:
        """An adapter's columns gone (its weights dropped from the layers): in slot order, they are one
        run, and the columns before and after it are joined."""
        start = bisect.bisect_left(self.column_slots, slot)
        stop = bisect.bisect_right(self.column_slots, slot)
        if start == stop:
            return
        if stop - start == len(self.column_slots):
            self.restack()  # none left
            return
        down = torch.cat((self.down[:, :start], self.down[:, stop:]), dim=1)
        up = torch.cat((self.up[:start], self.up[stop:]))
        self._stack(down, up, self.column_slots[:start] + self.column_slots[stop:])

    def _stack(self, down: torch.Tensor, up: torch.Tensor, column_slots: list[int]) -> None:
        """The stacks as they are now: `down` [in, ranks] and `up` [ranks, outputs], each a fresh join."""
        self.down, self.up = down, up
        self.column_slots = column_slots
        self.slots = torch.tensor(column_slots, device=self.down.device)
        self.views = {}  # (lowest, highest) adapter of a step: the views of the columns between them, or None

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
        if self.down is None:
            return None
        key = (lowest, highest)
        if key not in self.views:
            start = bisect.bisect_left(self.column_slots, lowest)
            stop = bisect.bisect_right(self.column_slots, highest)
            within = slice(start, stop)
            views = (self.down[:, within], self.up[within], self.slots[within])
            self.views[key] = views if start < stop else None
        return self.views[key]


def weights_like(layers: Sequence[LoraLinear], rows: int) -> torch.Tensor:
    """B's rows for a layer an adapter leaves alone: zeros of no rank, in the adapters' dtype and device."""
    some = next(weights.up for layer in layers for weights in layer.adapters.values())
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


class Adapters:
    """The adapters a model serves: each name's slot (1, 2, ...; 0 is the base model), and the batch
    its wrapped layers read."""

    def __init__(
        self,
        model: nn.Module,
        runtime: bool = False,
        most: int | None = None,
        highest_rank: int | None = None,
        hub_token: str | None = None,
    ):
        """`runtime`: adapters may come and go while the model serves (--allow-runtime-lora): every
        linear layer of the decoder is wrapped now, before the runners read the model's layers. `most`:
        the most adapters loaded at once (--max-loras); `highest_rank`: the highest rank an adapter may
        have (--max-lora-rank); None: no limit. `hub_token`: for adapters named by hub id (HF_TOKEN)."""
        self.model = model
        self.hub_token = hub_token
        self.most = most
        self.highest_rank = highest_rank
        self.slots: dict[str, int] = {}
        self.retired: set[int] = set()  # unloaded adapters' slots, whose weights their last rows still use
        self.batch = LoraBatch()
        self.runtime = runtime
        self.next_slot = 1
        parameter = next(model.parameters())
        # A CPU multiplies a few rows by a rank-16 matrix in bfloat16 in 3-4 times float32's time (82
        # against 23 us for one row through a 576-by-1,536 layer, 2-core EPYC): the products are float32.
        self.device = parameter.device
        self.dtype = torch.float32 if self.device.type == "cpu" else parameter.dtype
        self.wrapped: dict[str, LoraLinear] = {}
        if runtime:
            for module_name in adaptable_layers(model):
                self.wrapped[module_name] = wrap(model, module_name, self.batch)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.slots)

    def add(self, name: str, path: str, replace: bool = False, download: bool = False) -> int:
        """The adapter in `path` loaded under `name`, its slot returned; AdapterError naming it where it
        cannot be served, with nothing changed that a step reads. `replace`: an adapter already loaded
        under `name` (vLLM's load_inplace) is retired once this one is loaded, its slot's weights kept
        until `drop`. `download`: a hub id in `path` is downloaded (at start; while serving, a download
        would pause every stream)."""
        replaced = self.slots.get(name) if replace else None
        if name in self.slots and replaced is None:
            raise AdapterError(f"a LoRA adapter named {name!r} is already loaded")
        if self.most is not None and len(self.slots) - (replaced is not None) >= self.most:
            raise AdapterError(f"{len(self.slots)} LoRA adapters are loaded, the most --max-loras allows")
        try:
            changes = read_adapter(adapter_directory(path, download, self.hub_token))
            rank = max(weights.down.shape[0] for weights in changes.values())
            if self.highest_rank is not None and rank > self.highest_rank:
                raise AdapterError(f"rank {rank}, over --max-lora-rank {self.highest_rank}")
            layers = {module_name: self._layer(module_name) for module_name in changes}
            for module_name, weights in changes.items():
                check_shapes(module_name, layers[module_name], weights)
        except AdapterError as error:
            raise AdapterError(f"LoRA adapter {name!r} ({path}): {error}") from None
        slot, self.next_slot = self.next_slot, self.next_slot + 1
        for module_name, weights in changes.items():
            layers[module_name].adapters[slot] = weights.to(self.device, self.dtype)
        self.slots[name] = slot
        if replaced is not None:
            self.retired.add(replaced)
        for layer_changes in self.batch.changes:
            layer_changes.add(slot)
        ranks = sorted({weights.down.shape[0] for weights in changes.values()})
        log.info("LoRA adapter %r: %d layers, rank %s, from %s", name, len(changes), ranks, path)
        return slot

    def retire(self, name: str) -> int:
        """The adapter's name no longer served; its slot, whose weights stay until `drop`."""
        if name not in self.slots:
            raise AdapterError(f"no LoRA adapter {name!r} is loaded")
        slot = self.slots.pop(name)
        self.retired.add(slot)
        return slot

    def drop(self, slot: int) -> None:
        """A retired adapter's weights gone, once no row uses them."""
        self.retired.discard(slot)
        for layer in self.wrapped.values():
            layer.adapters.pop(slot, None)
        for layer_changes in self.batch.changes:
            layer_changes.remove(slot)
        log.info("LoRA adapter of slot %d unloaded", slot)

    def _layer(self, module_name: str) -> LoraLinear:
        """The wrapped layer `module_name`: wrapped now at start, where it must have been before at run
        time (the runners bound the model's layers)."""
        layer = self.wrapped.get(module_name)
        if layer is not None:
            return layer
        if self.runtime:
            raise AdapterError(f"it changes {module_name}, which the model has not as a linear layer")
        self.wrapped[module_name] = wrap(self.model, module_name, self.batch)
        return self.wrapped[module_name]


def adaptable_layers(model: nn.Module) -> list[str]:
    """The names of the linear layers an adapter may change: all but the output head (PEFT's
    "all-linear"), which the runners and transformers' modules call as layers."""
    head = model.get_output_embeddings()
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, WeightOnlyLinear, Fp8Layer)) and module is not head and name
    ]


def load_adapters(
    model: nn.Module,
    specs: Sequence[tuple[str, str]],
    runtime: bool = False,
    most: int | None = None,
    highest_rank: int | None = None,
    hub_token: str | None = None,
) -> Adapters | None:
    """Every (name, directory) adapter loaded onto `model`'s layers, on its device (in its dtype, but
    float32 on a CPU); None where there are none and none may come (`runtime`). An adapter that cannot
    be served raises AdapterError naming it; the others as `Adapters` takes them."""
    if not specs and not runtime:
        return None
    adapters = Adapters(model, runtime, most, highest_rank, hub_token)
    for name, path in specs:
        if name in adapters.slots:
            raise AdapterError(f"--lora-modules names the adapter {name!r} twice")
        adapters.add(name, path, download=True)
    return adapters


def adapter_directory(path: str, download: bool, token: str | None = None) -> Path:
    """Where an adapter's files are: `path` where it is a directory; else, where `download`, the hub
    repository it names (as vLLM's --lora-modules take them), downloaded as a model is (with `token`)."""
    if not names_hub_repository(path):
        return Path(path)
    if not download:  # /v1/load_lora_adapter downloads it in the frontend first: a step must not wait
        raise AdapterError(
            "not a directory on the server's disk (a hub id is downloaded at start, in --lora-modules, "
            f"or by /v1/load_lora_adapter; else download it first: hf download {path} --local-dir DIR)"
        )
    try:
        return download_adapter(path, token)
    except DownloadFailed as error:
        raise AdapterError(str(error)) from None


def read_adapter(directory: Path) -> dict[str, LoraWeights]:
    """A PEFT LoRA checkpoint's changes, by the module names of the model it adapts."""
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterError(f"no {CONFIG_FILE} there: a LoRA adapter is a directory PEFT saved")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as error:
        raise AdapterError(f"{CONFIG_FILE} cannot be read: {error}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} is not a JSON object")
    check_config(config)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise AdapterError(f"no {WEIGHTS_FILE} there (a pickled adapter_model.bin is not loaded)")
    try:
        tensors = load_file(weights_path)
    except Exception as error:  # safetensors' own error type, an OSError: a file that is not one
        raise AdapterError(f"{WEIGHTS_FILE} cannot be read: {error}") from None
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
