"""gpt-oss's MXFP4 checkpoints (openai/gpt-oss-20b and -120b: config.json's quant_method "mxfp4"), their
experts served from their own 4-bit values.

Such a checkpoint keeps every expert's projections in MXFP4 and the rest (attention, router, embeddings,
head, the experts' biases) in bfloat16. An experts' projection is two tensors beside its bias:

    `*.experts.gate_up_proj_blocks` uint8 [experts, out, in / 32, 16]: each block of 32 inputs' 4-bit
        indices into E2M1's values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), input 2j's in the
        low nibble of byte j and 2j + 1's in its high one
    `*.experts.gate_up_proj_scales` uint8 [experts, out, in / 32]: each block's exponent e; w = value *
        2^(e - 127)

(`down_proj_*` the same; gate_up's outputs interleave gate and up). transformers serves these with
triton kernels on a GPU; on a CPU, or without them, it dequantizes the experts to bfloat16 at load: 42
GB of gpt-oss-20b, where the checkpoint holds 13. Here they are read by this module: each expert's
projections are MXFP4's table blocks on a CPU that multiplies blocks (gguf_types.MXFP4Weight, exactly
the checkpoint's weights: 4.5 bits a weight), served by `QuantizedExperts`, and the model is built
without their floats (placeholders of their shape, as model/lean_load.py loads a GGUF file's layers);
the stored blocks are read a projection at a time as they are packed (read all at once, they were
another 10 GB beside gpt-oss-20b's served 13).
Elsewhere (a GPU, a CPU without AVX2), and in the exact mode, the model is built from the dequantized
weights, and a GPU's experts are int8 a channel of them (gguf_weights.served_layer).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from backend.quant import block_weights, quantized_experts
from backend.quant.gguf_types import BLOCK, Weight, mxfp4_weight, requantize_int8
from backend.quant.gguf_weights import served_layer
from backend.quant.group_wise import UnsupportedCheckpoint, checkpoint_files

log = logging.getLogger(__name__)

METHOD = "mxfp4"
BLOCKS, SCALES = "_blocks", "_scales"  # an MXFP4 projection's two tensors, after its name
E2M1_DOUBLED = torch.tensor(block_weights.TABLE_VALUES[block_weights.Table.MXFP4], dtype=torch.float32)


def is_mxfp4_checkpoint(quantization_config: dict | None) -> bool:
    return bool(quantization_config) and quantization_config.get("quant_method") == METHOD


def expert_parameters(model: nn.Module) -> int:
    """The parameters of the model's experts' projections (of its skeleton: names and shapes), which an
    MXFP4 checkpoint keeps in MXFP4 and this module serves from those blocks where they fit the kernels."""
    return sum(
        getattr(module, f"{part}_proj").numel()
        for module in model.modules()
        if quantized_experts.takes(module)
        for part in quantized_experts.PARTS
    )


@dataclass(frozen=True)
class MXFP4Projection:
    """One experts' projection as stored: every expert's blocks and exponents."""

    blocks: torch.Tensor  # uint8 [experts, out, in / 32, 16]
    scales: torch.Tensor  # uint8 [experts, out, in / 32]

    def indices(self, expert: int) -> torch.Tensor:
        """Expert `expert`'s 4-bit indices [out, in] (input 2j's in byte j's low nibble, 2j + 1's high)."""
        packed = self.blocks[expert]
        return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)

    def dequantize(self, expert: int) -> torch.Tensor:
        """Expert `expert`'s float32 weights [out, in]: E2M1 value * 2^(e - 127), as transformers' own
        dequantization gives them (the doubled value * 2^(e - 128), exactly)."""
        values = E2M1_DOUBLED[self.indices(expert).long()].reshape(*self.scales[expert].shape, BLOCK)
        exponents = self.scales[expert].to(torch.int32) - 128
        return torch.ldexp(values, exponents[..., None]).reshape(values.shape[0], -1)

    def weight(self, expert: int) -> Weight:
        """Expert `expert`'s weights as the engine's: MXFP4's table blocks, exactly, where fp16 holds
        every block's d; else 8-bit blocks close to them (gguf_types.mxfp4_weight)."""
        exact = mxfp4_weight(self.indices(expert), self.scales[expert])
        return exact if exact is not None else requantize_int8(self.dequantize(expert).numpy())


@dataclass(frozen=True)
class StoredProjection:
    """Where one experts' projection's blocks and exponents are, and their shape; read when asked for."""

    path: Path  # the safetensors file holding both
    name: str  # the parameter's: "model.layers.0.mlp.experts.gate_up_proj"
    shape: tuple[int, int, int]  # the exponents': [experts, out, in / 32]

    @property
    def experts(self) -> int:
        return self.shape[0]

    @property
    def weight_shape(self) -> tuple[int, int]:
        """An expert's weight's [out, in]."""
        return self.shape[1], self.shape[2] * BLOCK

    def fits(self) -> bool:
        """Whether the kernels take an expert's weight of this shape (block_weights.fits)."""
        return block_weights.fits(*self.weight_shape)

    def read(self) -> MXFP4Projection:
        with safe_open(self.path, framework="pt") as file:
            return MXFP4Projection(file.get_tensor(self.name + BLOCKS), file.get_tensor(self.name + SCALES))


def read_checkpoint(
    location: str, dtype: torch.dtype, placeholders: bool
) -> tuple[dict[str, torch.Tensor], dict[str, StoredProjection]]:
    """The checkpoint's state dict with each MXFP4 projection's weights as transformers' experts' module
    keeps them ([experts, in, out]) in `dtype`: dequantized, or (`placeholders`: the CPU's blocks will
    serve them) placeholders of that shape that hold no memory, for each module `serve_mxfp4` serves
    (`module_served`); and where the projections are, by parameter name
    ("model.layers.0.mlp.experts.gate_up_proj"), read as they are served."""
    state_dict: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, tuple]] = {}
    for path in checkpoint_files(location):
        with safe_open(path, framework="pt") as file:
            for key in file.keys():  # noqa: SIM118 (a safetensors file is no dict)
                suffix = next((suffix for suffix in (BLOCKS, SCALES) if key.endswith(suffix)), None)
                if suffix is None:
                    state_dict[key] = file.get_tensor(key)
                    continue
                stored = file.get_slice(key)  # its dtype and shape, not its bytes
                parts.setdefault(key.removesuffix(suffix), {})[suffix] = (
                    path,
                    stored.get_dtype(),
                    tuple(stored.get_shape()),
                )
    projections = {name: projection_of(name, stored) for name, stored in parts.items()}
    for name, projection in projections.items():
        out_features, in_features = projection.weight_shape
        shape = (projection.experts, in_features, out_features)  # [experts, in, out]: gpt-oss's x @ W
        if placeholders and module_served(name.rpartition(".")[0], projections):
            state_dict[name] = torch.zeros((), dtype=dtype).expand(shape)
        else:
            read = projection.read()
            state_dict[name] = torch.stack(
                [read.dequantize(e).T.to(dtype) for e in range(projection.experts)]
            )
    return state_dict, projections


def projection_of(name: str, stored: dict[str, tuple]) -> StoredProjection:
    """Where the projection `name`'s blocks and exponents are (`stored`: each's file, safetensors dtype and
    shape); refused where either is missing or they disagree."""
    if set(stored) != {BLOCKS, SCALES}:
        missing = ({BLOCKS, SCALES} - set(stored)).pop()
        raise UnsupportedCheckpoint(f"an MXFP4 checkpoint whose {name} has no {name}{missing}")
    (blocks_path, blocks_dtype, blocks), (scales_path, scales_dtype, scales) = stored[BLOCKS], stored[SCALES]
    if blocks_dtype != "U8" or len(blocks) != 4 or blocks[3] != BLOCK // 2:
        raise UnsupportedCheckpoint(f"{name}{BLOCKS} is {blocks_dtype} {blocks}, not MXFP4's blocks")
    if scales_dtype != "U8" or scales != blocks[:3]:
        raise UnsupportedCheckpoint(
            f"{name}{SCALES} is {scales_dtype} {scales}, not one exponent for each of {name}{BLOCKS}'s "
            f"{blocks[:3]} blocks"
        )
    if scales_path != blocks_path:  # (transformers' saves keep them together)
        raise UnsupportedCheckpoint(f"{name}{BLOCKS} and {name}{SCALES} are in two files: not served")
    return StoredProjection(blocks_path, name, scales)


def module_served(module: str, projections: dict[str, StoredProjection]) -> bool:
    """Whether `serve_mxfp4` serves the experts' module `module`: both its projections in MXFP4, each of a
    shape the kernels take."""
    names = [f"{module}.{part}_proj" for part in quantized_experts.PARTS]
    return all(name in projections and projections[name].fits() for name in names)


def serve_mxfp4(model: nn.Module, projections: dict[str, StoredProjection]) -> Counter:
    """Replace each experts' module whose projections the checkpoint keeps in MXFP4, and which fit the
    kernels, by a QuantizedExperts of those weights (module docstring), letting go of each projection as
    it is served; returns how many layers were served each way, for the log. Any other module (of a shape
    the kernels do not take, or with a projection stored otherwise) keeps the floats it was built from."""
    served = Counter()
    modules = {name.rpartition(".")[0] for name in projections}
    for module_name in sorted(modules):
        if not module_served(module_name, projections):  # (its floats are real: read_checkpoint)
            continue
        experts = model.get_submodule(module_name)
        if not quantized_experts.takes(experts):  # (an MXFP4 checkpoint is gpt-oss's: loader.py checks)
            raise UnsupportedCheckpoint(f"MXFP4 experts in a {type(experts).__name__}: not served")
        layers = {part: [] for part in quantized_experts.PARTS}
        for part in quantized_experts.PARTS:
            projection = projections.pop(f"{module_name}.{part}_proj").read()
            for expert in range(len(projection.blocks)):
                floats = quantized_experts.expert_weight(experts, part, expert)
                bias = quantized_experts.expert_bias(experts, part, expert)
                weight = projection.weight(expert)
                layer, how = served_layer(weight, quantized_experts.as_linear(floats, bias), "MXFP4")
                layers[part].append(layer)
                served[how] += 1
        parent, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent), child, quantized_experts.QuantizedExperts(experts, **layers))
    log.info(
        "MXFP4 checkpoint: %d experts' projections served (%s), the rest as stored",
        sum(served.values()),
        ", ".join(f"{how} x{count}" for how, count in sorted(served.items())) or "none",
    )
    return served
