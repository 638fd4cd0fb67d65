"""A GGUF file's converted copy written a tensor at a time, never the whole model in float32 in memory.

The first start of a GGUF file saves its weights dequantized to float32 as safetensors (loader.py):
later starts load that copy, and the exact mode needs the file's own dequantized weights. Through
transformers' GGUF loader, the whole float32 model was in memory while it was converted: 4 bytes a
parameter, 4.6 GiB of a 1B Q4_K_M file's first start where it serves in 2.4. Here each tensor is
dequantized, changed as transformers' processor for its architecture changes it (the Llama rows'
permutation undone, Gemma's norms less one), named by transformers' own map, and written to a shard of
at most SHARD_BYTES; then the start loads the copy as a later start does. Architectures whose
processor assembles a weight from several of the file's tensors (the experts of Qwen2-MoE, Qwen3-MoE,
gpt-oss, MiniMax-M2, OLMoE; GPT-2's head) are converted through transformers as before (`streams`).

A start that serves the file's blocks (lean_load.py) reads none of their layers' floats: its copy leaves
them out (`omit`), the index naming them (`omitted_weights`). A 1B Q4_K_M file's copy was 4.3 GB of
float32 for a 0.7 GB file, and writing it most of a first start. A later start that needs those floats
(the exact mode, a GPU, --quantize int8) writes them into the copy first (`complete_copy`), exactly as
the whole conversion would have.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import ReaderTensor
from safetensors.torch import save_file
from torch import nn
from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    TensorProcessor,
    get_gguf_hf_weights_map,
    read_field,
)

from backend.model import gguf_families, resources
from backend.model.architectures import UnsupportedModel
from backend.quant import gguf_types

log = logging.getLogger(__name__)

# Their processors write into the state dict they are given (several tensors into one weight): OLMoE's
# too, whose experts gguf_families.py lends Qwen2-MoE's processor.
WHOLE_FILE_ARCHITECTURES = {
    "qwen2moe",
    "qwen3moe",
    "gpt-oss",
    "gpt_oss",
    "minimax-m2",
    "gpt2",
    *gguf_families.EXPERTS_AS_QWEN2_MOE,
}
SHARD_BYTES = 512 * 2**20  # float32 held at most before it is written
INDEX_FILE = "model.safetensors.index.json"


def streams(path: Path, config: PretrainedConfig) -> bool:
    """Whether `path` is converted here a tensor at a time (else through transformers, whole)."""
    architecture = read_field(gguf.GGUFReader(str(path)), "general.architecture")[0]
    return architecture not in WHOLE_FILE_ARCHITECTURES and config.model_type != "mixtral"


def write_converted(
    path: Path,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    target: Path,
    omit: frozenset[str] = frozenset(),
) -> bool:
    """Write `path`'s weights in float32 (but those named in `omit`, which the blocks serve), its
    configuration and `tokenizer` to `target` (`save_staged`): a later start's converted copy. Refuses
    (UnsupportedModel) a file that leaves any of the model's weights unread, before any copy is kept.
    False where the disk would not take it (the caller converts in memory instead)."""
    skeleton = resources.skeleton(config)  # names and shapes only

    def write(staging: Path) -> None:
        weight_map = write_weights(path, config, skeleton, staging, lambda name: name not in omit)
        check_all_weights_read(sorted(set(weight_names(skeleton)) - set(weight_map) - omit), path.name)
        write_index(staging, weight_map, omitted=sorted(omit))
        saved = copy.deepcopy(config)
        saved.quantization_config = None  # the GGUF marker: transformers would look for the file again
        saved.dtype = torch.float32
        saved.architectures = [type(skeleton).__name__]  # as a model's own save_pretrained writes them
        saved.save_pretrained(staging)
        GenerationConfig.from_model_config(saved).save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    if omit:
        log.info(
            "the converted copy leaves out the float weights of the %d layers the file's blocks serve (a "
            "start that reads them writes them into it: the exact mode, a GPU, --quantize int8)",
            len(omit),
        )
    return save_staged(target, write)


def save_staged(target: Path, write: Callable[[Path], None]) -> bool:
    """Have `write` fill a staging directory beside `target`, then rename it `target`: no start ever
    reads a copy half written, and one that fails leaves nothing. False where the disk would not take
    it; True too where another process made `target` first."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        write(staging)
        staging.rename(target)
    except OSError as error:  # a full disk, or another process converted it first
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():
            log.warning("could not cache the converted model in %s: %s", target, error)
            return False
        return True
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("saved the converted model to %s", target)
    return True


def write_weights(
    path: Path,
    config: PretrainedConfig,
    skeleton: nn.Module,
    directory: Path,
    wanted: Callable[[str], bool],
    weight_map: dict[str, str] | None = None,
) -> dict[str, str]:
    """Each of the file's tensors that `skeleton` (the model, on the meta device) has a weight for and
    that is `wanted` (by its name there), in float32 safetensors shards numbered on from those of
    `weight_map` (an index's: name to shard), which each shard written is added to; returns it."""
    reader = gguf.GGUFReader(str(path))
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    # by the file's architecture: a model's type is not always llama.cpp's name for it (Ministral 3's file
    # is presented as a Llama's)
    names = get_gguf_hf_weights_map(skeleton, processor, model_type=architecture)
    shapes = {name: tensor.shape for name, tensor in skeleton.state_dict().items()}
    weight_map, shard, held = {} if weight_map is None else weight_map, {}, 0
    for tensor in reader.tensors:
        if tensor.name not in names or not wanted(names[tensor.name]):  # (processors keep tensors' names)
            continue
        name, weight = names[tensor.name], floats(tensor, processor)
        if weight.shape != shapes[name]:
            raise UnsupportedModel(
                f"{path.name}: tensor {tensor.name} has shape {tuple(weight.shape)}, the model's {name} "
                f"{tuple(shapes[name])}"
            )
        shard[name], held = weight, held + weight.nbytes
        if held >= SHARD_BYTES:
            save_shard(shard, directory, weight_map)
            shard, held = {}, 0
    if shard:
        save_shard(shard, directory, weight_map)
    return weight_map


def write_index(directory: Path, weight_map: dict[str, str], omitted: list[str]) -> None:
    """The copy's index: where each weight is, and which it leaves to the file's blocks. Replaced whole (a
    start may be reading it while another completes the copy)."""
    index = {"metadata": {"omitted": omitted} if omitted else {}, "weight_map": weight_map}
    staging = directory / f".{INDEX_FILE}.{os.getpid()}"
    staging.write_text(json.dumps(index, indent=1))
    staging.replace(directory / INDEX_FILE)


def omitted_weights(directory: Path) -> list[str]:
    """The weights a converted copy leaves to the GGUF file's blocks (none in a whole copy)."""
    index = directory / INDEX_FILE
    return json.loads(index.read_text())["metadata"].get("omitted", []) if index.is_file() else []


def complete_copy(path: Path, config: PretrainedConfig, directory: Path) -> bool:
    """Write the weights `directory`'s copy of `path` left to the blocks (`omitted_weights`) into it, as
    the whole conversion writes them; returns whether it could (where the disk would not take them, the
    shards written are removed). Another process may be completing the copy too, or loading it: each
    shard and then the index appear whole, under the names both would give them."""
    index = directory / INDEX_FILE
    read = json.loads(index.read_text()) if index.is_file() else {"metadata": {}}
    omitted = set(read["metadata"].get("omitted", []))  # (the index read once: another start may replace it)
    if not omitted:
        return True
    log.info("writing the float weights of %d layers the blocks serve into %s", len(omitted), directory)
    weight_map = read["weight_map"]
    shards = set(weight_map.values())
    completed = dict(weight_map)
    try:
        write_weights(path, config, resources.skeleton(config), directory, omitted.__contains__, completed)
        write_index(directory, completed, omitted=[])
    except OSError as error:  # a full disk
        for shard in set(completed.values()) - shards:
            (directory / shard).unlink(missing_ok=True)
        log.warning("could not write the rest of the converted copy in %s: %s", directory, error)
        return False
    return True


def floats(tensor: ReaderTensor, processor: TensorProcessor | None = None) -> torch.Tensor:
    """A GGUF tensor dequantized (and changed as `processor` changes it), in float32, rows first."""
    if tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0:
        values = q8_0_floats(np.asarray(tensor.data))
        if processor is None:
            return values
        values = values.numpy()
    else:
        values = gguf.dequantize(tensor.data, tensor.tensor_type)
    if processor is not None:
        values = processor.process(weights=values, name=tensor.name).weights
    return torch.from_numpy(values.copy()).float()


def q8_0_floats(data: np.ndarray) -> torch.Tensor:
    """Q8_0 blocks ([..., blocks * 34] bytes) as float32, [..., blocks * 32]: each value times its block's
    fp16 scale in float32, as the gguf package's dequantization multiplies them (the same numbers), in
    PyTorch's threads: the gguf package's numpy, and a copy of its output, took 5 s of a 4-layer
    gpt-oss-20b file's 17 s start."""
    weight = gguf_types.unpack_q8_0(data.reshape(-1, data.shape[-1]))
    values = weight.q.float().unflatten(-1, (-1, gguf_types.BLOCK)) * weight.scale[..., None]
    return values.reshape(*data.shape[:-1], -1)


def save_shard(shard: dict[str, torch.Tensor], directory: Path, weight_map: dict[str, str]) -> None:
    """Write `shard` as the next shard, its names added to `weight_map`."""
    name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
    staging = directory / f".{name}.{os.getpid()}"  # (a process completing the copy too writes the same)
    try:
        save_file(shard, staging, metadata={"format": "pt"})
        staging.replace(directory / name)
    except OSError:
        staging.unlink(missing_ok=True)
        raise
    weight_map.update(dict.fromkeys(shard, name))


def weight_names(skeleton: nn.Module) -> Iterable[str]:
    """The weights a model loads (a tied head's once, as its embedding): its parameters and persistent
    buffers."""
    yield from (name for name, _ in skeleton.named_parameters())
    persistent = set(skeleton.state_dict())
    yield from (name for name, _ in skeleton.named_buffers() if name in persistent)


def check_all_weights_read(missing: list[str], gguf_file: str) -> None:
    """Refuse a GGUF file whose tensors transformers' reader left some of the model's weights without: it
    reads a gpt-oss file with no error, its experts left at random (tests/backend/test_gguf_families.py),
    which would be served as nonsense. (A Mixtral, written as "llama", gguf_mixtral.py reads.)"""
    if missing:
        raise UnsupportedModel(
            f"transformers' GGUF reader found no weights for {len(missing)} of the model's parameters in "
            f"{gguf_file} ({', '.join(sorted(missing)[:4])}{', ...' if len(missing) > 4 else ''}): it does "
            "not read this architecture's tensors; serve the model's safetensors checkpoint instead"
        )
