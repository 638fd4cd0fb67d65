"""A GGUF file's quantized weights, served as they are stored.

transformers dequantizes a GGUF file into float weights. For the linear
layers stored quantized this module reads the blocks themselves and gives
them to the weight-only layers (quantized_linear.py), whose kernels take
the same kind of layout: 32 inputs of an output channel share a scale (and
a zero). So the served model multiplies by the file's own weights (Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K and Q6_K exactly, the
other types as 8-bit blocks close to them: gguf_types.py), and reads a
quarter (4-bit) to a half (8-bit) of the bytes a bfloat16 copy would: on a
CPU that multiplies blocks, the file's own bytes or nearly (Q4_0 and Q5_0
as symmetric blocks, d alone as the file keeps it).

PyTorch's `_weight_int8pack_mm` takes one scale a channel only, and there
is no 5-bit or 6-bit kernel but the blocks', so elsewhere (CUDA, a CPU
without AVX2) 5-, 6- and 8-bit layers are quantized again to int8 per channel, from
transformers' dequantized floats, and the log says so. An output head
stored quantized (SmolLM2's Q8_0, a Q4_K_M file's Q6_K, tied to the
embedding) goes the same way for few rows, and its dequantized floats serve
many. Float tensors keep the dequantized weights transformers
made.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, ReaderTensor
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, TensorProcessor, read_field

from backend.quant import block_weights, blocks_embedding, gguf_types, quantized_experts
from backend.quant.gguf_types import (
    EightBitWeight,
    FiveBitSuperBlocks,
    FiveBitSymmetric,
    FiveBitWeight,
    FourBitSuperBlocks,
    FourBitSymmetric,
    FourBitWeight,
    InBlocksWeight,
    MXFP4Weight,
    SixBitWeight,
    SuperBlockWeight,
    SymmetricWeight,
    TableSuperBlocks,
    TableWeight,
    ThreeBitWeight,
    TwoBitWeight,
    Weight,
)
from backend.quant.quantized_linear import (
    GROUP_SIZE,
    BlocksLinear,
    Int4Linear,
    Int8Linear,
    WeightOnlyLinear,
    fits_int4_kernels,
    quantizable_linears,
    quantize_head,
    replace_module,
)
from backend.utils.heap import give_back_freed_memory

log = logging.getLogger(__name__)

FLOAT_TYPES = {kind.name for kind in gguf_types.FLOAT_TYPES}

# Processors whose only change to a tensor is a permutation of its rows (output channels), which
# moves whole blocks: llama.cpp's converter permutes Llama's q and k projections for its rotary
# layout, and transformers permutes them back. Other architectures' processors reshape tensors in
# ways blocks do not follow, so their GGUF files are dequantized.
# SmolLM3's, Granite's and Arcee AFM's converters are LlamaModel's subclasses (model/gguf_families.py lends
# transformers' reader this processor for them).
ROW_ONLY_PROCESSORS = dict.fromkeys(("llama", "smollm3", "granite", "arcee"), LlamaTensorProcessor)
PLAIN_ARCHITECTURES = {
    "qwen2",
    "qwen3",
    "qwen3moe",
    "qwen2moe",
    "phi3",
    "gemma2",
    "gemma3",
    "gpt-oss",
    "lfm2",  # (its processor reshapes the convolutions' weights alone, no linear layer's)
    "starcoder2",
    "stablelm",
    "nemotron",  # (its processor takes 1 from its norms' weights alone)
    # the families model/gguf_families.py lends transformers' reader tables for
    "olmo2",
    "olmoe",
    "seed_oss",
    "ernie4_5",
    "cohere2",
    "exaone4",
}  # rows as transformers has them

# Beside a GGUF file's converted copy: its blocks as read, so that later starts need not parse the
# file again (gguf's reader walks every field first, the tokenizer's 49,152 strings and 48,900 merges
# among them: 5 of a 7.6 s load of the default model).
BLOCKS_CACHE = "gguf_blocks.safetensors"
HEAD_KEY = ":head"  # the head's tensors in that copy (no module name starts with a colon)
EMBEDDING_KEY = ":embedding"  # an input embedding's of its own (not the head's), where its type is exact
# A copy's layout: a copy written by a version that served fewer types is read past and replaced.
BLOCKS_CACHE_VERSION = "10"
# The weights a file's cached blocks hold, by name, and their fields (4-bit values packed two a byte).
WEIGHT_KINDS = {
    kind.__name__: kind
    for kind in (
        FourBitWeight,
        FiveBitWeight,
        EightBitWeight,
        FourBitSymmetric,
        FiveBitSymmetric,
        FourBitSuperBlocks,
        FiveBitSuperBlocks,
        SixBitWeight,
        ThreeBitWeight,
        TwoBitWeight,
        TableWeight,
        MXFP4Weight,
        TableSuperBlocks,
    )
}
WEIGHT_FIELDS = {kind: [field.name for field in dataclasses.fields(kind)] for kind in WEIGHT_KINDS.values()}
FOUR_BIT_VALUES = (
    FourBitWeight,
    FourBitSymmetric,
    FourBitSuperBlocks,
    ThreeBitWeight,
    TwoBitWeight,  # 2-bit values, kept as 4-bit ones
    TableWeight,
    TableSuperBlocks,
)


class PackedWeights(Mapping[str, Weight]):
    """Weights by name, held as the blocks copy stores them (4-bit values two a byte) and unpacked as each
    is asked for: all unpacked at once, a byte a value, they were 0.9 GiB of a 1B Q4_K_M file's load
    beside the layers made of them. `pop` lets go of one once its layer is made."""

    def __init__(self) -> None:
        self.kinds: dict[str, type[Weight]] = {}
        self.fields: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, weight: Weight) -> None:
        fields = dict(zip(WEIGHT_FIELDS[type(weight)], fields_of(weight), strict=True))
        if isinstance(weight, FOUR_BIT_VALUES):
            fields["q"] = fields["q"][:, 0::2] | fields["q"][:, 1::2] << 4
        self.add_packed(name, type(weight), {field: t.contiguous() for field, t in fields.items()})

    def add_packed(self, name: str, kind: type[Weight], fields: dict[str, torch.Tensor]) -> None:
        self.kinds[name], self.fields[name] = kind, fields

    def __getitem__(self, name: str) -> Weight:
        return unpacked(self.kinds[name], self.fields[name])

    def parts(self, name: str, rows: int) -> Iterator[Weight]:
        """The weight `name`, `rows` output channels at a time, each part unpacked as it is asked for (a
        vocabulary's table, unpacked whole a byte a value, is 0.5 GiB of an 8B file)."""
        fields = self.fields[name]
        count = fields["q"].shape[0]
        for first in range(0, count, rows):
            yield unpacked(self.kinds[name], {field: t[first : first + rows] for field, t in fields.items()})

    def __iter__(self) -> Iterator[str]:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    def pop(self, name: str, default: Weight | None = None) -> Weight | None:
        if name not in self.fields:
            return default
        weight = self[name]
        self.discard(name)
        return weight

    def discard(self, name: str) -> None:
        """Let go of a weight, not unpacked (where it has one)."""
        self.kinds.pop(name, None)
        self.fields.pop(name, None)


def unpacked(kind: type[Weight], fields: dict[str, torch.Tensor]) -> Weight:
    """A weight from its fields as PackedWeights holds them (4-bit values two a byte)."""
    values = dict(fields)
    if issubclass(kind, FOUR_BIT_VALUES):
        q = values["q"]
        values["q"] = torch.stack((q & 0x0F, q >> 4), dim=-1).reshape(q.shape[0], -1)
    return kind(**values)


@dataclass(frozen=True)
class GGUFBlocks:
    """What of a GGUF file is served from its own blocks."""

    # the quantizable linear layers', by module name; a mixture's experts' by `expert_key`
    layers: PackedWeights
    # the output head's (the embedding's, where tied) by HEAD_KEY, if served, and an untied embedding's by
    # EMBEDDING_KEY where the file keeps it in a type unpacked exactly
    packed_head: PackedWeights
    types: Counter  # how many tensors of each type the file holds, for the start-up log
    head_type: str
    kinds: dict[str, str]  # each served layer's GGUF type, by module name

    @property
    def head(self) -> Weight | None:
        return self.packed_head.get(HEAD_KEY)

    def take_head(self) -> Weight | None:
        """The head's weight, let go of here (unpacked, it is a byte a value of the whole vocabulary)."""
        return self.packed_head.pop(HEAD_KEY, None)

    def take_embedding_blocks(self) -> tuple[torch.Tensor, block_weights.Table] | None:
        """An untied input embedding's weight as the CPU's blocks, and the table whose indices they hold
        (None where the file has none, or its shape takes none), let go of here. Unpacked and packed
        block_weights.PACK_CHANNELS rows at a time: whole, its values a byte each raised an untied 1B
        file's peak by 23 MiB more, 0.5 GiB on an 8B's vocabulary."""
        if EMBEDDING_KEY not in self.packed_head:
            return None
        rows = self.packed_head.fields[EMBEDDING_KEY]["q"].shape[0]
        parts = self.packed_head.parts(EMBEDDING_KEY, block_weights.PACK_CHANNELS)
        first = next(parts)
        found = None
        if block_weights.fits(rows, first.q.shape[1]):
            blocks, table = cpu_blocks(first)
            whole = torch.empty(rows, blocks.shape[1], dtype=torch.uint8)
            whole[: len(blocks)], done = blocks, len(blocks)
            for part in parts:
                blocks, _ = cpu_blocks(part)
                whole[done : done + len(blocks)], done = blocks, done + len(blocks)
            found = whole, table
        self.packed_head.discard(EMBEDDING_KEY)
        return found


def tensor_processor(architecture: str, model: nn.Module) -> TensorProcessor | None:
    """transformers' processor for this architecture if it only permutes rows; None if it does more."""
    if architecture in ROW_ONLY_PROCESSORS:
        return ROW_ONLY_PROCESSORS[architecture](config=model.config.to_dict())
    if architecture in PLAIN_ARCHITECTURES:
        return TensorProcessor()
    return None


def gguf_names(architecture: str, model: nn.Module) -> dict[str, str]:
    """GGUF tensor name ("blk.0.attn_q.weight") to module name, for the quantizable linear layers."""
    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == architecture)
    names = gguf.get_tensor_name_map(arch, model.config.get_text_config().num_hidden_layers)
    mapped = {module: names.get_name(module) for module in quantizable_linears(model)}
    return {f"{name}.weight": module for module, name in mapped.items() if name is not None}


def read_gguf_blocks(path: Path, model: nn.Module, cache_dir: Path | None = None) -> GGUFBlocks:
    """The file's blocks that are served as they are, from `cache_dir`'s copy where it has one, else
    from the file (then saved there)."""
    cached = cache_dir / BLOCKS_CACHE if cache_dir is not None else None
    if cached is not None and cached.is_file():
        try:
            return load_gguf_blocks(cached)
        except Exception as error:  # a damaged copy: read the file again, and replace the copy
            log.warning(
                "the cached GGUF blocks in %s are unreadable (%s): reading the GGUF file", cached, error
            )
    found = parse_gguf_blocks(path, model)
    if cached is not None and save_gguf_blocks(cached, found):
        # Read back as a later start reads it: mapped from the file, where the blocks just parsed were
        # a third of a GiB of a 1B Q4_K_M file's first start, in memory beside everything else.
        return load_gguf_blocks(cached)
    return found


def parse_gguf_blocks(path: Path, model: nn.Module) -> GGUFBlocks:
    reader = gguf.GGUFReader(str(path))  # the one the load made already (model/gguf_parsing.py)
    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    head_tensor = tensors.get("output.weight") or tensors.get("token_embd.weight")  # tied: the embedding
    head_type = head_tensor.tensor_type.name if head_tensor is not None else "F32"
    head = PackedWeights()
    if head_tensor is not None and gguf_types.served(head_tensor.tensor_type, int(head_tensor.shape[0])):
        head.add(HEAD_KEY, gguf_types.unpack(np.asarray(head_tensor.data), head_tensor.tensor_type))
    embedding = tensors.get("token_embd.weight") if "output.weight" in tensors else None  # untied
    if embedding is not None and embedding.tensor_type in gguf_types.UNPACKINGS and served_tensor(embedding):
        head.add(EMBEDDING_KEY, gguf_types.unpack(np.asarray(embedding.data), embedding.tensor_type))
    architecture = read_field(reader, "general.architecture")[0]
    processor = tensor_processor(architecture, model)
    if processor is None:
        log.info(
            "GGUF architecture %r: its weights are dequantized (no block-preserving mapping)", architecture
        )
        return GGUFBlocks(PackedWeights(), head, types, head_type, {})
    layers, kinds = PackedWeights(), {}
    for tensor, module in projections_in_blocks(reader, architecture, model):
        rows = processor.process(weights=np.asarray(tensor.data), name=tensor.name).weights
        layers.add(module, gguf_types.unpack(rows, tensor.tensor_type))
        kinds[module] = tensor.tensor_type.name
    for key, weight, kind in gguf_experts(tensors, model):
        layers.add(key, weight)
        kinds[key] = kind
    return GGUFBlocks(layers, head, types, head_type, kinds)


def projections_in_blocks(
    reader: gguf.GGUFReader, architecture: str, model: nn.Module
) -> Iterator[tuple[ReaderTensor, str]]:
    """Each of the file's tensors that its blocks serve as a quantizable linear layer, with that layer's
    module name (an architecture with a block-preserving mapping: `tensor_processor`)."""
    to_module = gguf_names(architecture, model)
    for tensor in reader.tensors:
        module = to_module.get(tensor.name)
        if module is not None and served_tensor(tensor):
            yield tensor, module


def modules_in_blocks(path: Path, model: nn.Module) -> set[str]:
    """The quantizable linear layers (module names) whose weights `parse_gguf_blocks` takes from the file's
    blocks, without reading them."""
    reader = gguf.GGUFReader(str(path))  # the one the load made already (model/gguf_parsing.py)
    architecture = read_field(reader, "general.architecture")[0]
    if tensor_processor(architecture, model) is None:
        return set()
    return {module for _, module in projections_in_blocks(reader, architecture, model)}


def expert_key(module: str, projection: str, expert: int) -> str:
    """Where an expert's weight is kept among `GGUFBlocks.layers`: "model.layers.0.mlp.experts.down.3"."""
    return f"{module}.{projection}.{expert}"


def expert_tensors(tensors: dict, layer: int, part: str, count: int) -> list | None:
    """The file's tensors of one projection ("gate", "up", "down") of a layer's experts: llama.cpp's one
    stacked tensor, [experts, rows, inputs], or one an expert as its first Mixtral conversions wrote them
    (`blk.N.ffn_gate.E.weight`); None where the file has neither."""
    stacked = tensors.get(f"blk.{layer}.ffn_{part}_exps.weight")
    if stacked is not None:
        return [stacked]
    each = [tensors.get(f"blk.{layer}.ffn_{part}.{expert}.weight") for expert in range(count)]
    return each if all(tensor is not None for tensor in each) else None


def gguf_experts(tensors: dict, model: nn.Module) -> Iterator[tuple[str, Weight, str]]:
    """Each experts' module's weights as the file's blocks (quantized_experts.py), by `expert_key`, with
    their GGUF type: llama.cpp's `blk.N.ffn_{gate,up,down}_exps` tensors split by expert (or its tensors
    of one expert each: `expert_tensors`), gate and up joined as transformers' `gate_up_proj` joins them
    (gpt-oss's interleaved), as 8-bit blocks where they unpack to two kinds. An expert's projection at a
    time, unpacked (a byte a value) as the caller packs it: a module's whole, unpacked and joined, was 1.6
    GB of a 4-layer gpt-oss-20b's start beside its 2 GB of blocks. A layer whose experts are stored as
    floats is left out (`experts_in_blocks`: its experts stay floats)."""
    for index, layer in enumerate(model.model.layers):
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is None or not quantized_experts.takes(experts):
            continue
        if not experts_in_blocks(tensors, index, experts.num_experts):
            continue
        parts = [expert_tensors(tensors, index, part, experts.num_experts) for part in ("gate", "up", "down")]
        gate, up, down = (expert_rows(ts, experts.num_experts) for ts in parts)
        together = interleave if quantized_experts.is_gpt_oss(experts) else join
        module = next(name for name, m in model.named_modules() if m is experts)
        kinds = [ts[0].tensor_type.name for ts in parts]
        gate_kind = kinds[0] if kinds[0] == kinds[1] else f"{kinds[0]}/{kinds[1]}"
        for e, (g, u) in enumerate(zip(gate, up, strict=True)):
            joined = together(*same_kind(gguf_types.unpack(*g), gguf_types.unpack(*u)))
            yield expert_key(module, "gate_up", e), joined, gate_kind
        for e, d in enumerate(down):
            yield expert_key(module, "down", e), gguf_types.unpack(*d), kinds[2]


def experts_in_blocks(tensors: dict, layer: int, count: int) -> bool:
    """Whether `gguf_experts` serves the experts of layer `layer` from the file's blocks: each of its
    projections stored quantized, in rows the kernels take, each in one kind (what a model loaded without
    their floats relies on: model/gguf_gpt_oss.py)."""
    parts = [expert_tensors(tensors, layer, part, count) for part in ("gate", "up", "down")]
    if any(ts is None or not all(served_tensor(t) for t in ts) for ts in parts):
        return False
    # (ggml's shapes: inputs first, then rows)
    if not all(block_weights.fits(int(t.shape[1]), int(t.shape[0])) for ts in parts for t in ts):
        return False
    return all(len({t.tensor_type for t in ts}) == 1 for ts in parts)  # not a part's experts of two kinds


def same_kind(first: Weight, second: Weight) -> tuple[Weight, Weight]:
    """Two weights to be joined, as they are where they are of one kind, else both as 8-bit blocks close
    to them (gate Q4_K beside up Q5_0, or MXFP4 beside MXFP4 requantized for its exponents)."""
    if type(first) is type(second):
        return first, second
    return eight_bit_blocks(first), eight_bit_blocks(second)


def eight_bit_blocks(weight: Weight) -> EightBitWeight:
    if isinstance(weight, EightBitWeight):
        return weight
    blocks, table = cpu_blocks(weight) or (None, None)
    if blocks is None:
        raise ValueError(f"an expert's weight of shape {tuple(weight.q.shape)} takes no blocks")
    return gguf_types.requantize_int8(block_weights.dequantize(blocks, weight.q.shape[1], table).numpy())


def served_tensor(tensor) -> bool:
    return gguf_types.served(tensor.tensor_type, int(tensor.shape[0]))  # ggml's shape: inputs first


def expert_rows(tensors: list, count: int) -> list[tuple[np.ndarray, gguf.GGMLQuantizationType]]:
    """A projection's stored rows and type, one an expert, from its one stacked tensor [experts, rows,
    bytes] or its tensors of one expert: views of the file, nothing unpacked."""
    if len(tensors) == 1:
        data = np.asarray(tensors[0].data)
        return [(rows, tensors[0].tensor_type) for rows in data.reshape(count, -1, data.shape[-1])]
    return [(np.asarray(tensor.data), tensor.tensor_type) for tensor in tensors]


def join(first: Weight, second: Weight):
    """Two weights over the same inputs as one, `first`'s outputs first."""
    pairs = zip(fields_of(first), fields_of(second), strict=True)
    return type(first)(*(torch.cat(pair) for pair in pairs))


def interleave(first: Weight, second: Weight):
    """Two weights over the same inputs as one, their outputs taking turns (gpt-oss's gate_up: gate j at
    2j, up j at 2j + 1)."""
    pairs = zip(fields_of(first), fields_of(second), strict=True)
    return type(first)(*(torch.stack(pair, dim=1).flatten(0, 1) for pair in pairs))


def fields_of(weight: Weight) -> list[torch.Tensor]:
    return [getattr(weight, field.name) for field in dataclasses.fields(weight)]


def save_gguf_blocks(target: Path, found: GGUFBlocks) -> bool:
    """Save what `parse_gguf_blocks` found, atomically (another process may be starting too): each
    weight's fields and its kind, 4-bit q as two values a byte. Returns whether it could."""
    fields = {**found.layers.fields, **found.packed_head.fields}
    tensors = {f"{name}.{field}": t for name, named in fields.items() for field, t in named.items()}
    kinds = {name: kind.__name__ for name, kind in {**found.layers.kinds, **found.packed_head.kinds}.items()}
    metadata = {
        "layers": json.dumps(list(found.layers)),
        "weight_kinds": json.dumps(kinds),
        "types": json.dumps(found.types),
        "head_type": found.head_type,
        "has_head": json.dumps(HEAD_KEY in found.packed_head),
        "has_embedding": json.dumps(EMBEDDING_KEY in found.packed_head),
        "kinds": json.dumps(found.kinds),
        "version": BLOCKS_CACHE_VERSION,
    }
    staging = target.with_name(f".{target.name}.{os.getpid()}")
    try:
        save_file(tensors, staging, metadata=metadata)
        staging.replace(target)
    except OSError as error:  # a full disk: later starts parse the file again
        staging.unlink(missing_ok=True)
        log.warning("could not cache the GGUF file's blocks in %s: %s", target, error)
        return False
    return True


def load_gguf_blocks(source: Path) -> GGUFBlocks:
    with safe_open(source, framework="pt") as file:
        metadata = file.metadata()
        if metadata.get("version") != BLOCKS_CACHE_VERSION:
            raise ValueError("written by an older version")
        kinds = {name: WEIGHT_KINDS[kind] for name, kind in json.loads(metadata["weight_kinds"]).items()}
        layers = PackedWeights()
        apart = [key for key in (HEAD_KEY, EMBEDDING_KEY) if json.loads(metadata[f"has_{key[1:]}"])]
        for name in [*json.loads(metadata["layers"]), *apart]:
            fields = {field: file.get_tensor(f"{name}.{field}") for field in WEIGHT_FIELDS[kinds[name]]}
            layers.add_packed(name, kinds[name], fields)
        head = PackedWeights()
        for key in apart:
            head.add_packed(key, layers.kinds.pop(key), layers.fields.pop(key))
    types = Counter(json.loads(metadata["types"]))
    return GGUFBlocks(layers, head, types, metadata["head_type"], json.loads(metadata["kinds"]))


def serve_gguf_weights(
    model: nn.Module,
    path: Path,
    cache_dir: Path | None = None,
    blocks: GGUFBlocks | None = None,
    dense_on_demand: frozenset[str] = frozenset(),
) -> int:
    """Replace the linear layers stored quantized in `path` by weight-only layers of those weights (or,
    for the types with no exact engine layout, 8-bit blocks close to them), and a head stored quantized
    by its blocks or an int8 copy; the rest keep their dequantized floats. Returns how many layers were
    replaced. `cache_dir`: where the blocks read from the file are kept for the next start (the file's
    converted copy); `blocks`: those blocks, where the caller has read them; `dense_on_demand`: the
    layers loaded without their floats (model/lean_load.py), whose dense copies are made from their
    blocks when asked for."""
    blocks = blocks if blocks is not None else read_gguf_blocks(path, model, cache_dir)
    # The blocks' unpacked temporaries, given back before the layers are made beside the blocks (a 4-layer
    # gpt-oss-20b's start peaked 0.4 GiB higher with them held)
    give_back_freed_memory()
    from_blocks = len(blocks.layers)
    linears = quantizable_linears(model)
    served = Counter()
    experts = serve_experts(model, blocks, served)
    for name in [name for name in blocks.layers if name in linears]:  # (an expert's are served above)
        # Popped: its unpacked values gone once its layer is made (a local of this loop would hold them)
        served[serve_projection(model, name, blocks.layers.pop(name), linears[name], blocks.kinds[name])] += 1
        if name in dense_on_demand:
            model.get_submodule(name).make_dense_on_demand(linears[name].weight.dtype)
    head = serve_head(model, blocks)
    embedding = serve_embedding(model, blocks)
    log.info(
        "GGUF %s (tensor types %s): %d linear layers%s served from the file's blocks (%s), %d dequantized "
        "(with the %s) to %s; output head (%s) %s%s",
        path.name,
        ", ".join(f"{kind} x{count}" for kind, count in sorted(blocks.types.items())),
        from_blocks,
        f" (a mixture's {experts} experts' projections among them)" if experts else "",
        ", ".join(f"{how} x{count}" for how, count in sorted(served.items())) or "none",
        len(linears) + experts - from_blocks,
        "norms" if embedding else "embeddings and norms",
        next(model.parameters()).dtype,
        blocks.head_type,
        head,
        f"; input embedding from its {embedding}" if embedding else "",
    )
    return from_blocks + (head != "as floats")


def serve_projection(model: nn.Module, name: str, weight: Weight, linear: nn.Linear, kind: str) -> str:
    """Replace the projection `name` by the layer serving `weight` (of GGUF type `kind`); returns how."""
    if weight.q.shape != linear.weight.shape or weight.q.shape[1] % GROUP_SIZE:
        raise ValueError(
            f"GGUF tensor for {name} has shape {tuple(weight.q.shape)}, the model expects "
            f"{tuple(linear.weight.shape)}"
        )
    layer, how = served_layer(weight, linear, kind)
    replace_module(model, name, layer)
    return how


def serve_experts(model: nn.Module, blocks: GGUFBlocks, served: Counter) -> int:
    """Serve each plain experts' module from the file's blocks where `blocks` has its experts'
    (`gguf_experts`), counting how in `served`; returns how many expert layers the model has (two an
    expert of each plain experts' module), whether served so or left as floats."""
    count = 0
    for module_name, module in list(model.named_modules()):
        if not quantized_experts.takes(module):
            continue
        count += 2 * module.num_experts
        parts = quantized_experts.PARTS
        keys = {
            (part, e): expert_key(module_name, part, e) for part in parts for e in range(module.num_experts)
        }
        if not all(key in blocks.layers for key in keys.values()):
            continue
        layers = {part: [] for part in parts}
        for (part, expert), key in keys.items():
            floats, weight = quantized_experts.expert_weight(module, part, expert), blocks.layers.pop(key)
            if weight.q.shape != floats.shape:
                raise ValueError(
                    f"GGUF experts for {key} have shape {tuple(weight.q.shape)}, the model expects "
                    f"{tuple(floats.shape)}"
                )
            linear = quantized_experts.as_linear(floats, quantized_experts.expert_bias(module, part, expert))
            layer, how = served_layer(weight, linear, blocks.kinds[key])
            layers[part].append(layer)
            served[how] += 1
        parent, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent), child, quantized_experts.QuantizedExperts(module, **layers))
        # The layer's blocks as read, unpacked and popped above, given back before the next layer's are made:
        # held by the heap, a 4-layer gpt-oss-20b file's start peaked at 4.2-4.3 GiB, given back 3.7-3.8
        give_back_freed_memory()
    return count


def served_layer(weight: Weight, linear: nn.Linear, kind: str) -> tuple[WeightOnlyLinear, str]:
    """The weight-only layer serving `weight` (read from a tensor of GGUF type `kind`), and how (for the
    log). transformers dequantized these very blocks: its weights are the dense copy for many rows (where
    the model loaded lean, a placeholder, which `serve_gguf_weights` has made from the blocks instead)."""
    device, dense = linear.weight.device, linear.weight.detach()
    blocks_here = BlocksLinear.takes(weight.q.shape, device)
    if isinstance(weight, InBlocksWeight) and blocks_here:
        layer = BlocksLinear.of(weight, linear.bias, dense)
        return layer, f"{kind} as {layer.layout()}"
    # No super-blocks or symmetric blocks here: Q4_K and Q4_0 as int4 groups, Q5_K and Q5_0 as below.
    if isinstance(weight, SuperBlockWeight | SymmetricWeight):
        weight = weight.per_block()
    if isinstance(weight, FourBitWeight):
        q, scale, zero = (t.to(device) for t in (weight.q, weight.scale, weight.zero))
        return Int4Linear(q, scale, zero, linear.bias, dense=dense), f"{kind} as 4-bit"
    if isinstance(weight, FiveBitWeight) and blocks_here:
        layer = BlocksLinear.int5(weight.q, weight.scale, weight.minimum, linear.bias, dense)
        return layer, f"{kind} as {layer.layout()}"
    if isinstance(weight, FiveBitWeight | InBlocksWeight):  # no kernel of PyTorch's takes these
        return Int8Linear.quantize(linear, dense=dense), f"{kind} as int8 per channel"
    if block_weights.available(device):
        return Int8Linear(weight.q, weight.scale, linear.bias, dense=dense), eight_bit(kind)
    return Int8Linear.quantize(linear, dense=dense), f"{kind} as int8 per channel"


def eight_bit(kind: str) -> str:
    return "Q8_0" if kind == "Q8_0" else f"{kind} requantized to 8-bit blocks"


def serve_head(model: nn.Module, blocks: GGUFBlocks) -> str:
    """Serve a head stored quantized from its blocks where the CPU multiplies blocks, else by an int8 copy
    with a scale a channel (PyTorch's int8 kernel takes no other); its float weights stay the dense copy
    for many rows (blocks_embedding.py may let them go). Returns how, as the log says it."""
    if blocks.head_type in FLOAT_TYPES:
        return "as floats"
    head_blocks = blocks.take_head()
    if head_blocks is not None and serve_head_blocks(model, head_blocks):
        if isinstance(head_blocks, EightBitWeight):
            return f"from its blocks ({eight_bit(blocks.head_type)}) for few rows"
        return f"from its {model.get_output_embeddings().layout()} for few rows"
    if quantize_head(model):
        return "in int8 per channel for few rows"
    return "as floats"


def serve_embedding(model: nn.Module, blocks: GGUFBlocks) -> str:
    """An untied input embedding the file keeps quantized: its rows looked up in its own blocks where the
    CPU multiplies blocks and they hold exactly the floats it was loaded with (blocks_embedding.py), which
    are let go. Returns the blocks' layout, as the log names it, or "" where it keeps its floats."""
    embedding = model.get_input_embeddings()
    if type(embedding) is not nn.Embedding or not block_weights.available(embedding.weight.device):
        blocks.packed_head.discard(EMBEDDING_KEY)
        return ""
    packed = blocks.take_embedding_blocks()
    if packed is None or not blocks_embedding.serve_from_blocks(model, *packed):
        return ""
    return model.get_input_embeddings().layout.name()


def cpu_blocks(weight: Weight) -> tuple[torch.Tensor, block_weights.Table] | None:
    """The CPU's blocks of a weight, and the table whose indices they hold; None where its shape takes
    none."""
    if not block_weights.fits(*weight.q.shape):
        return None
    if isinstance(weight, InBlocksWeight):
        return weight.blocks(), weight.table
    if isinstance(weight, FourBitWeight):
        return block_weights.pack_int4(weight.q, weight.scale, weight.zero), block_weights.Table.NONE
    if isinstance(weight, FiveBitWeight):
        return block_weights.pack_int5(weight.q, weight.scale, weight.minimum), block_weights.Table.NONE
    return block_weights.pack_int8(weight.q, weight.scale), block_weights.Table.NONE


def serve_head_blocks(model: nn.Module, head_blocks: Weight) -> bool:
    """Replace the output head by a layer of its blocks where the CPU multiplies blocks; returns whether it
    did."""
    head = model.get_output_embeddings()
    device = head.weight.device
    if type(head) is not nn.Linear or not (block_weights.available(device) and fits_int4_kernels(head)):
        return False
    if head_blocks.q.shape != head.weight.shape:
        return False
    name = next(name for name, module in model.named_modules() if module is head)
    layer, _ = served_layer(head_blocks, head, "")
    replace_module(model, name, layer)
    return True
