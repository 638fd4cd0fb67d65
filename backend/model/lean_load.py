"""A GGUF file's converted copy loaded without the weights its blocks serve.

The default mode serves a GGUF file's quantized linear layers from its own blocks (gguf_weights.py).
Loaded from the float32 copy as transformers loads a checkpoint, every one of those layers was first a
float tensor in the start's dtype, 2 bytes a parameter beside the blocks, and a 1B Q4_K_M file's start
peaked at 3.9-4.1 GiB where it serves in 2.3 (2.6-2.8 loaded so: docs/backend.md, Loading). Here, on a
CPU that multiplies blocks, those layers
load as placeholders of their shape (one value, stride 0: no memory); their dense copies for many rows
are made from the blocks when the loader's calibration asks for them, a layer at a time, and kept only
where it chooses them (`WeightOnlyLinear.make_dense_on_demand`). The blocks hold exactly the file's
weights, but for the types requantized to 8-bit blocks (the IQ2 and IQ3 types, ...:
gguf_types.py), whose copies are then the blocks' weights, as their decode steps multiply by.
Everything else (embeddings, norms, a layer of a shape blocks do not take) loads as before. The copy
a lean first start writes holds none of those layers' floats (gguf_conversion.py): their placeholders
take the model's shapes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import gguf
import torch
from safetensors import safe_open
from torch import nn

from backend.model.gguf_conversion import INDEX_FILE, omitted_weights
from backend.quant.gguf_weights import BLOCKS_CACHE, FLOAT_TYPES, GGUFBlocks, modules_in_blocks
from backend.quant.quantized_linear import BlocksLinear, quantizable_linears

SINGLE_FILE = "model.safetensors"  # a copy saved whole, through transformers (no index)


def served_in_blocks(blocks: GGUFBlocks, model: nn.Module, device: torch.device) -> set[str]:
    """The linear layers (module names) that will be served from the file's blocks on this device (a CPU
    with AVX2 or AVX-512 VNNI), where their dense copies can be made from the blocks."""
    return blocks_take(blocks.layers, model, device)


def weights_left_to_blocks(gguf_path: Path, model: nn.Module, device: torch.device) -> frozenset[str]:
    """The weights (state dict names) of the layers that `served_in_blocks` will give, known before the
    blocks are read: what a converted copy made for a lean start leaves out (gguf_conversion.py)."""
    return frozenset(
        f"{name}.weight" for name in blocks_take(modules_in_blocks(gguf_path, model), model, device)
    )


def blocks_take(names: Iterable[str], model: nn.Module, device: torch.device) -> set[str]:
    linears = quantizable_linears(model)
    return {
        name for name in names if name in linears and BlocksLinear.takes(linears[name].weight.shape, device)
    }


def blocks_bytes(gguf_path: Path, converted: Path | None) -> int:
    """What a GGUF file's blocks take in memory as they are served: their copy beside the converted one
    where a start kept it (`gguf_weights.BLOCKS_CACHE`), else the file's quantized tensors (read from the
    reader that the first start's conversion parses anyway: model/gguf_parsing.py)."""
    cached = converted / BLOCKS_CACHE if converted is not None else None
    if cached is not None and cached.is_file():
        return cached.stat().st_size
    reader = gguf.GGUFReader(str(gguf_path))
    return sum(int(tensor.n_bytes) for tensor in reader.tensors if tensor.tensor_type.name not in FLOAT_TYPES)


def copy_files(location: Path) -> dict[str, str]:
    """The converted copy's weight names, with the file each is in."""
    index = location / INDEX_FILE
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    with safe_open(location / SINGLE_FILE, framework="pt") as file:
        return dict.fromkeys(file.keys(), SINGLE_FILE)


def state_dict_without(
    location: Path, dtype: torch.dtype, layers: set[str], names: nn.Module
) -> dict[str, torch.Tensor] | None:
    """The converted copy in `location` as a state dict, the weights of `layers` (module names) as
    placeholders of their shape in `dtype`; None where the copy's names are not those of the model's state
    dict (`names`, its `resources.skeleton`): a family whose weights transformers renames as it loads
    them, which a load from a state dict would not rename; or where the copy leaves out a weight not
    among them (`omitted_weights`: made where the blocks served more layers)."""
    files = copy_files(location)
    shapes = {name: tensor.shape for name, tensor in names.state_dict().items()}
    weights = {f"{layer}.weight" for layer in layers}  # (in the copy, or left out of it)
    if not set(files) <= set(shapes) or not set(omitted_weights(location)) <= weights:
        return None
    state_dict = {name: torch.zeros((), dtype=dtype).expand(*shapes[name]) for name in weights}
    for file_name in sorted(set(files.values())):
        with safe_open(location / file_name, framework="pt") as file:
            for name in [name for name, in_file in files.items() if in_file == file_name]:
                if name not in weights:  # as stored (float32): transformers casts it, or keeps it so
                    state_dict[name] = file.get_tensor(name)  # (_keep_in_fp32_modules)
    return state_dict
