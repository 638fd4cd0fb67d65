"""The model's side of a step: the KV cache, a step's inputs packed, and the forward pass over them.

The constructor is the recipe: the compact decoder runner where it serves
the model (decoder_runner.py, else transformers' own classes with the
engine's attention plugged in), the cache's dtype by how decode queries
attend, the cache allocated once, CUDA graphs on a GPU, and the step plan
(step_plan.py) that says what runs each step shape. `prepare` packs the
rows the engine scheduled (step_inputs.py); `run` gives their logits.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence

import torch
from transformers import PreTrainedModel

from backend.layers.attention import attending_over
from backend.layers.row_cache import KVShape, RowCache, pick_cache_dtype
from backend.layers.row_states import RowStates, StateShape, has_row_states
from backend.model.decoder_runner import DecoderRunner
from backend.model.falcon import attend_over_rows
from backend.model.hybrid import mix_over_rows
from backend.model.latent_attention import attend_over_latents
from backend.model.long_rope import fix_long_rope
from backend.model.lora import Adapters
from backend.model.step_inputs import DecodingRow, PrefillingRow, StepInputs, pack
from backend.model.step_plan import StepPlan, plan_transformers
from backend.quant.quantized_experts import route_llama4_mixtures

log = logging.getLogger(__name__)


class ModelRunner:
    """Runs the steps of one model over one row cache."""

    def __init__(
        self,
        model: PreTrainedModel,
        rows: int,
        max_seq_len: int,
        kv_cache_dtype: torch.dtype | None = None,
        compile_decode: bool = False,
        cuda_graphs: bool = True,
        embedding_row: bool = False,
        adapters: Adapters | None = None,
    ):
        """`embedding_row`: a spare row of the cache (index `rows`) that embedding inputs are prefilled
        in, a chunk a step beside the rows' (engine.py). `adapters`: the LoRA adapters loaded onto the
        model's layers (lora.py), which rows take by `use_adapter`."""
        self.model = model
        self.device = model.device
        self.adapters = adapters
        fix_long_rope(model, max_seq_len)  # (a row's rotation never follows another row's length)
        route_llama4_mixtures(model)  # (each token through its chosen expert, not all of them)
        self.row_adapters = [0] * (rows + int(embedding_row))  # each row's adapter slot, 0: the base model
        graphs = cuda_graphs and self.device.type == "cuda"
        if adapters is not None and (compile_decode or graphs):
            # Which tokens take which adapter changes every step: no one graph of the step to capture.
            what = "--compile" if compile_decode else "CUDA graphs"
            log.warning("%s: not with LoRA adapters loaded, whose steps run eagerly", what)
            compile_decode = cuda_graphs = False
        # A hybrid's Mamba layers keep a recurrent state a row beside the attention layers' cache.
        spare = int(embedding_row)
        self.states = None
        if has_row_states(model.config):
            self.states = RowStates(StateShape.of(model.config), rows + spare, model.dtype, self.device)
            mix_over_rows(model, self.states)
        supported = DecoderRunner.supports(model.config)
        self.decoder = (
            DecoderRunner(model, compile_decode, rows, max_seq_len, self.states) if supported else None
        )
        shape = KVShape.of(model.config)
        if self.decoder is None and model.config.model_type == "falcon":
            attend_over_rows(model)  # Falcon attends by itself, not through transformers' interface
        if shape.latent:
            attend_over_latents(model)  # DeepSeek's MLA: the cache keeps its latents, read as they are
        self.cache_dtype = kv_cache_dtype or pick_cache_dtype(
            "auto", model.dtype, self.device, self.reads_own_positions
        )
        self.cache = RowCache(shape, rows, max_seq_len, self.cache_dtype, self.device, spare)
        self.embedding_row = rows if embedding_row else None
        self.embedded_states: torch.Tensor | None = None  # the last run's, at its inputs' `embedded`
        if compile_decode and self.decoder is None:
            log.warning("--compile: this model runs through transformers' forward, which is not compiled")
        # (An MoE's routing waits for the host, which a graph cannot, and a graph's padding queries would
        # advance other rows' states in LFM2's convolution layers: their steps run eagerly.)
        graphable = self.decoder is not None and self.decoder.whole_graph
        if cuda_graphs and graphable and self.device.type == "cuda":
            self.decoder.use_graphs(self.cache)  # captured in capture_graphs, at warm-up
        self._transformers_plan = None if self.decoder is not None else plan_transformers(rows, model)

    @property
    def plan(self) -> StepPlan:
        """What runs each step shape (the decoder's plan follows its settings as they change)."""
        return self.decoder.plan if self.decoder is not None else self._transformers_plan

    @property
    def most_queries(self) -> int:
        """The most decode queries a step may have: its rows' tokens, drafts and, where each query reads its
        own positions, short prompts' tokens and an embedding input's (the step plan goes that far)."""
        return len(self.plan.decode)

    @property
    def reads_own_positions(self) -> bool:
        """Whether decode queries attend each over its own row up to its position (the CPU's loop)."""
        return self.decoder is not None and self.decoder.reads_own_positions

    @property
    def takes_prompts_as_queries(self) -> bool:
        """Whether a step's short prompts, drafts and embedding chunks may go as more decode queries of their
        rows (DecoderRunner.takes_prompts_as_queries)."""
        return self.decoder is not None and self.decoder.takes_prompts_as_queries

    def prepare(
        self,
        decoding: Sequence[DecodingRow],
        prefilling: Sequence[PrefillingRow],
        embedding: PrefillingRow | None = None,
    ) -> StepInputs:
        """The step's inputs: `decoding` in row order, then `prefilling`, each with its chunk set, then
        `embedding`'s chunk (its index the embedding row)."""
        adapters = self.row_adapters if any(self.row_adapters) else None
        return pack(
            decoding, prefilling, self.device, self.cache_dtype, self.reads_own_positions, embedding, adapters
        )

    def use_adapter(self, row: int, slot: int) -> None:
        """The row's tokens take this LoRA adapter's changes from its next step (0: none)."""
        self.row_adapters[row] = slot

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The forward pass over the cache: the logits at the kept places, [kept, vocab]. Where the
        inputs carry an embedding chunk, `embedded_states` are then its tokens' last hidden states
        ([tokens, hidden], the base model's output: after the final norm)."""
        self.cache.plan_step(inputs.layout)
        self.embedded_states = None
        if self.adapters is not None:
            self.adapters.batch.use(inputs.adapters)
        if self.decoder is not None:
            logits, self.embedded_states = self.decoder(
                inputs.token_ids, inputs.positions, inputs.layout, self.cache, inputs.keep, inputs.embedded
            )
            return logits
        with attending_over(self.model.config, inputs.layout), self._keeping_states(inputs.embedded):
            output = self.model(
                input_ids=inputs.token_ids[None],
                position_ids=inputs.positions[None],
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=inputs.keep,
            )
        return output.logits[0]

    @contextlib.contextmanager
    def _keeping_states(self, embedded: range | None) -> Iterator[None]:
        """transformers' forward: the base model's output at `embedded` kept as `embedded_states`."""
        if embedded is None:
            yield
            return

        def keep(module: torch.nn.Module, args: tuple, output) -> None:
            self.embedded_states = output.last_hidden_state[0, embedded.start : embedded.stop]

        hook = self.model.base_model.register_forward_hook(keep)
        try:
            yield
        finally:
            hook.remove()

    @property
    def decodes_in_graphs(self) -> bool:
        """Whether decode steps run as CUDA graphs (or their static shapes without capture)."""
        return self.decoder is not None and self.decoder.graphs is not None

    @property
    def graphs_to_capture(self) -> bool:
        return self.decoder is not None and self.decoder.graphs is not None and self.decoder.graphs.capture

    def capture_graphs(self) -> None:
        """Capture the decode steps' CUDA graphs; a model whose step cannot be captured (an operation
        that waits for the host, say) is served with eager steps instead, with a warning."""
        started = time.perf_counter()
        try:
            self.decoder.graphs.capture_all()
        except Exception:
            log.exception("CUDA graphs could not be captured: decode steps run eagerly")
            self.decoder.graphs = None
            self.decoder.replan()
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # what capture left queued ends before the steps start
            return
        count, took = len(self.decoder.graphs.graphs), time.perf_counter() - started
        log.info("captured %d CUDA graphs of decode steps in %.1f s", count, took)
