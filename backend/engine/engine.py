"""The batching engine: user rows over one KV cache, decoded together step by step.

Each `step()` reads like the algorithm:

    free the rows of cancelled requests
    schedule: the rows decoding, and prompt chunks of rows still prefilling and of waiting requests
        admitted into free rows (scheduler.py)
    draft: the decoding rows' guesses of their next tokens, where they pay (speculation.py)
    run: one forward pass over them all, a token for every decoding row and the chunks, and a chunk
        of an embedding input while rows decode (model_runner.py)
    sample every row's next token with its own settings (and its grammar, if it has one)
    accept: each row takes its token and gives its text
    embed waiting embedding inputs whole where nobody decodes (they take no user row)
    free the rows whose requests ended

and returns the text each request gained. Where decode steps are CUDA
graphs, a step whose rows all decode again launches the next one before it
reads its own tokens, and the next `step()` reads that one (ahead.py). The
engine does no I/O: the backend process (`backend.engine.serve`) moves
requests and pieces across queues.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from backend.engine.ahead import StepAhead, decodes_again, next_step_rows
from backend.engine.draft_model import DraftModel
from backend.engine.encoder_pass import EncoderPass, embedding_failed
from backend.engine.grammar_builds import GrammarBuilds
from backend.engine.prefill_budget import PrefillBudget
from backend.engine.prefix_cache import Placement, PrefixIndex
from backend.engine.row import Row
from backend.engine.scheduler import Schedule, Scheduler
from backend.engine.speculation import DRAFT_TOKEN_COST, DRAFT_TOKENS, Speculator, verified
from backend.layers.grammar import GrammarError, Grammars, Masks
from backend.layers.logits_processors import LogitsProcessors
from backend.layers.logprobs import token_logprobs
from backend.layers.row_states import has_row_states, is_state_space
from backend.layers.sampler import NOT_FINITE, SamplingBatch, sample
from backend.layers.step_layout import LOOP_PROMPT_TOKENS
from backend.messages import SCORE, BackendConfig, InvalidPart, Piece, SamplingParams, Submit, TokenLogprob
from backend.model.cache_size import DEFAULT_MAX_SEQ_LEN, context_length
from backend.model.embeddings import EmbeddingJob, EmbeddingModel, embed
from backend.model.lora import AdapterError, Adapters, load_adapters
from backend.model.mamba import MambaRunner
from backend.model.model_runner import ModelRunner
from backend.model.step_inputs import StepInputs
from backend.utils.heap import give_back_freed_memory, reuse_freed_memory
from backend.utils.host_lists import read_later, to_device

if TYPE_CHECKING:
    from llguidance import LLMatcher

log = logging.getLogger(__name__)

# Steps in a row that may give other teams their first tokens alone (`_first_tokens_alone`), the flooding
# team's rows waiting: two, so that a prompt that came during the first (clients that ended together send
# again together, a few milliseconds apart), or a first token that released no text, still gets its own
# instead of a whole flood's step; the flood still decodes at least one step in three.
MOST_STEPS_ALONE = 2
# The most prompt tokens such a step takes: four chat prompts of 11 tokens each took 8-10 ms, against 30
# for a step of the flood's 28 rows (the default model, 2 cores).
PROMPT_TOKENS_ALONE = 2 * LOOP_PROMPT_TOKENS

NOT_FINITE_ERROR = "generation failed: the model's logits are not finite (NaN or infinity)"


def with_adapters_scope(request: Submit, slot: int) -> Submit:
    """The request with its LoRA adapter's slot in its cache scope: a prefix's keys and values are those
    of the adapter that computed them, which another adapter, the base model, or a later adapter of the
    same name (another slot, lora.Adapters) cannot reuse."""
    if not slot:
        return request
    return dataclasses.replace(request, cache_scope=f"{request.cache_scope}\0lora:{slot}")


def rescoped(request: Submit, old_slot: int, new_slot: int) -> Submit:
    """A waiting request of an adapter reloaded in place, scoped to the new one's slot: the old one's
    cached prefixes are not its."""
    scope = request.cache_scope.replace(f"\0lora:{old_slot}", f"\0lora:{new_slot}")
    return dataclasses.replace(request, cache_scope=scope)


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every id the model or its tokenizer calls end-of-sequence."""
    ids: set[int] = set()
    for source in (model.config.get_text_config().eos_token_id, model.generation_config.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class Engine:
    """Owns the model, the row cache and the rows; `step()` advances every request."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        rows: int = 32,
        max_seq_len: int | None = None,
        name: str = "model",
        max_prefill_tokens: int | None = None,
        prefix_reuse: bool = True,
        kv_cache_dtype: torch.dtype | None = None,
        embedding_model: EmbeddingModel | None = None,
        compile_decode: bool = False,
        cuda_graphs: bool = True,
        speculative_tokens: int | None = None,
        prompt_lookup: tuple[int, int] = (2, 4),
        draft_model: PreTrainedModel | None = None,
        rerank_model: EmbeddingModel | None = None,
        adapters: Adapters | None = None,
    ):
        """`adapters`: LoRA adapters already loaded onto the model's layers (`load_adapters`)."""
        names = [name] + [model.name for model in (embedding_model, rerank_model) if model is not None]
        if len(set(names)) < len(names):
            raise ValueError(f"two of the server's models have one name: {', '.join(map(repr, names))}")
        self.name = name
        self.tokenizer_path: str | None = None  # set when loaded from a BackendConfig
        reuse_freed_memory()  # big per-step temporaries without a page fault per 4 KiB
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = model.device
        self.dtype = model.dtype
        self.max_seq_len = min(max_seq_len or DEFAULT_MAX_SEQ_LEN, context_length(model.config))
        self.prefill_budget = PrefillBudget(max_prefill_tokens)  # None: sized by the measured step times
        self.eos_ids = eos_token_ids(model, tokenizer)
        # The embedding's rows, which may be fewer than the tokenizer's ids (added tokens) or more.
        self.vocab_size = model.get_input_embeddings().num_embeddings
        # A state-space model's rows (and a hybrid's) are a recurrent state that cannot go back to an
        # earlier position: only a whole history to reuse, no rejected draft to drop (row_states.py).
        self.rows_keep_state = has_row_states(model.config)
        self.adapters = adapters
        if is_state_space(model.config):
            if adapters is not None:
                raise AdapterError("LoRA adapters are not served on a state-space model")
            self.runner = MambaRunner(model, rows, embedding_row=embedding_model is None)
        else:
            self.runner = ModelRunner(
                model,
                rows,
                self.max_seq_len,
                kv_cache_dtype,
                compile_decode,
                cuda_graphs,
                embedding_row=embedding_model is None,
                adapters=adapters,
            )
        self.processors = LogitsProcessors(rows, self.max_seq_len, self.vocab_size, self.device)
        self.grammars = Grammars(tokenizer, self.vocab_size, self.eos_ids, rows)
        self.grammar_builds = GrammarBuilds(self.grammars)  # requests whose grammar is compiling
        self.speculator = self._speculator(speculative_tokens, prompt_lookup, rows, draft_model, cuda_graphs)
        self.rows: list[Row | None] = [None] * rows
        if prefix_reuse and self.rows_keep_state:
            log.info(
                "prefix reuse: a state-space or hybrid model's row keeps the state of its whole history "
                "alone, which a prompt that extends it reuses (a chat's next turn), never a part of it"
            )
        self.prefixes = PrefixIndex(rows, prefix_reuse, whole_only=self.rows_keep_state)
        self.scheduler = Scheduler(self.prefill_budget, self.prefixes, self.max_seq_len)
        self.waiting: collections.OrderedDict[str, Submit] = collections.OrderedDict()
        self.arrived: dict[str, float] = {}  # when each waiting request came (time.monotonic): its queue time
        self.matchers: dict[str, LLMatcher] = {}  # the grammar matcher of each waiting request with one
        self.embedding_waiting: collections.OrderedDict[str, Submit] = collections.OrderedDict()
        self.embedding_model = embedding_model  # None: embedding requests pool the served model's states
        self.rerank_model = rerank_model  # None: score requests are refused
        self.embedding_job: tuple[Submit, EmbeddingJob] | None = None  # an input embedded a chunk a step
        self.encoder_pass: EncoderPass | None = None  # a separate model's inputs, read a few layers a step
        self.undelivered: list[Piece] = []  # answers decided outside a step (rejections, cancels)
        self.admitted: list[str] = []  # the requests that took a row in the last step
        self.steps_alone = 0  # steps in a row for other teams' first tokens alone (_first_tokens_alone)
        self.ahead: StepAhead | None = None  # a decode step launched before the last one was read (ahead.py)
        self.steps_ahead = True  # decode steps go ahead where they can; False: never (for comparisons)

    @classmethod
    def load(cls, config: BackendConfig) -> Engine:
        """Load the configured model (checking resources first) and warm it up."""
        from backend.model.loader import (
            load_draft_model,
            load_embedding_model,
            load_model,
            load_rerank_model,
        )
        from backend.utils.hub import hub_token

        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        loaded = load_model(config)
        limits = (config.max_loras, config.max_lora_rank)
        adapters = load_adapters(loaded.model, config.lora_modules, config.runtime_lora, *limits, hub_token())
        for name, path in config.lora_modules_loaded if adapters is not None else ():  # before a restart
            try:
                adapters.add(name, path)
            except AdapterError as error:  # gone since: the server serves on without it
                log.error("%s: not loaded again", error)
        draft = load_draft_model(config, loaded) if config.draft_model else None
        embedding_model = load_embedding_model(config) if config.embedding_model else None
        rerank_model = load_rerank_model(config) if config.rerank_model else None
        engine = cls(
            loaded.model,
            loaded.tokenizer,
            config.rows,
            loaded.max_seq_len,
            loaded.name,
            config.max_prefill_tokens,
            config.prefix_reuse,
            loaded.cache_dtype,
            embedding_model,
            config.compile_decode,
            config.cuda_graphs,
            config.speculative_tokens,
            (config.prompt_lookup_min, config.prompt_lookup_max),
            draft.model if draft else None,
            rerank_model,
            adapters,
        )
        engine.tokenizer_path = loaded.tokenizer_path
        engine.warm_up()
        # What building the engine freed (the weights of layers fused into one, the warm-up's temporaries)
        # stays in the heap, whose thresholds the engine raised: about 400 MiB on a 1B-class model.
        give_back_freed_memory()
        return engine

    def _speculator(
        self,
        tokens: int | None,
        prompt_lookup: tuple[int, int],
        rows: int,
        draft_model: PreTrainedModel | None,
        cuda_graphs: bool,
    ) -> Speculator:
        """Speculative decoding by prompt lookup, or by `draft_model`'s guesses where one is given:
        `tokens` draft tokens at most a row and step, or (None) `DRAFT_TOKENS` with a draft model or
        where decode steps take a row's draft as more of its queries (the CPU's loop), and none elsewhere,
        where a draft makes its step one with a chunk, which costs more (speculation.py)."""
        if self.rows_keep_state and (tokens or draft_model is not None):
            log.warning(
                "speculative decoding is off: a state-space or hybrid model's rows cannot drop a "
                "rejected draft"
            )
            tokens, draft_model = 0, None
        if tokens is None:
            tokens = DRAFT_TOKENS if self.runner.takes_prompts_as_queries or draft_model is not None else 0
        if draft_model is None or not tokens:
            speculator = Speculator(tokens, *prompt_lookup, step_queries=rows)
            if speculator.enabled:
                log.info(
                    "speculative decoding: prompt lookup of %d- to %d-grams, up to %d draft tokens a row",
                    *prompt_lookup,
                    tokens,
                )
            return speculator
        max_seq_len = min(self.max_seq_len, context_length(draft_model.config))
        drafts = DraftModel(draft_model, rows, max_seq_len, self.vocab_size, cuda_graphs=cuda_graphs)
        return Speculator(tokens, *prompt_lookup, rows, drafts, self._draft_cost(drafts, tokens))

    def _draft_cost(self, drafts: DraftModel, tokens: int) -> float:
        """What a draft model's guess costs, as a share of a one-row step (DraftModel.cost_against)."""
        cost = drafts.cost_against(self.model)
        log.info(
            "speculative decoding: a draft model's guesses, up to %d draft tokens a row (a guess costs "
            "%.2f of a one-row step besides its verifying)",
            tokens,
            cost,
        )
        if cost + DRAFT_TOKEN_COST >= 1:
            log.warning("the draft model is about as large as the served model: its drafts never pay")
        return cost

    # The frontend's side: requests in, cancels in.

    def submit(self, request: Submit) -> None:
        prompt_tokens = len(request.prompt_ids)
        # A separate embedding or rerank model takes its own token ids, up to its own length.
        separate = self._separate_model(request.params)
        vocab_size = separate.vocab_size if separate else self.vocab_size
        params = request.params
        if prompt_tokens == 0:
            self._reject(request, "the prompt is empty", "prompt_ids")
        elif params.embedding == SCORE and separate is None:
            self._reject(request, "this server has no rerank model (--rerank-model)", "prompt_ids")
        elif separate is not None and prompt_tokens > separate.max_tokens:
            limit = separate.max_tokens
            kind = "rerank" if params.embedding == SCORE else "embedding"
            message = f"the input has {prompt_tokens} tokens; the {kind} model takes {limit}"
            self._reject(request, message, "prompt_ids")
        elif separate is None and prompt_tokens >= self.max_seq_len:
            # Not even equal: a row's last position is never filled (Row.position).
            message = f"the prompt has {prompt_tokens} tokens; the context holds {self.max_seq_len}"
            self._reject(request, message, "prompt_ids")
        elif not all(0 <= token < vocab_size for token in request.prompt_ids):
            message = f"the prompt has token ids outside the model's vocabulary of {vocab_size}"
            self._reject(request, message, "prompt_ids")
        elif not self._in_vocabulary(token for token, _ in params.logit_bias):
            message = f"logit_bias names token ids outside the vocabulary of {self.vocab_size}"
            self._reject(request, message, "logit_bias")
        elif not self._in_vocabulary(params.stop_token_ids):
            message = f"stop_token_ids names token ids outside the vocabulary of {self.vocab_size}"
            self._reject(request, message, "stop_token_ids")
        elif not self._in_vocabulary(token for words in params.bad_words for token in words):
            message = f"bad_words has token ids outside the vocabulary of {self.vocab_size}"
            self._reject(request, message, "bad_words")
        elif not self._in_vocabulary(params.allowed_token_ids):
            message = f"allowed_token_ids names token ids outside the vocabulary of {self.vocab_size}"
            self._reject(request, message, "allowed_token_ids")
        elif self._only_held_back(params):
            message = "allowed_token_ids allows only end tokens, which min_tokens holds back"
            self._reject(request, message, "allowed_token_ids")
        elif (
            request.request_id in self.waiting
            or request.request_id in self.grammar_builds
            or request.request_id in self.embedding_waiting
            or (self.encoder_pass is not None and self.encoder_pass.holds(request.request_id))
            or self._row_of(request.request_id) is not None
        ):  # the frontend's fault, not the request's
            self._reject(request, f"request id {request.request_id!r} is already in use")
        elif request.adapter and request.adapter not in self.adapter_names:
            self._reject(request, f"no LoRA adapter {request.adapter!r} is loaded")
        elif request.adapter and params.embedding is not None:
            self._reject(request, f"the LoRA adapter {request.adapter!r} does not embed: the base model does")
        elif params.embedding is not None:
            self.embedding_waiting[request.request_id] = request
        else:
            self._wait(with_adapters_scope(request, self._adapter_slot(request)))

    @property
    def adapter_names(self) -> tuple[str, ...]:
        return self.adapters.names if self.adapters is not None else ()

    def _adapter_slot(self, request: Submit) -> int:
        """The slot of the request's LoRA adapter, 0 for the model's own."""
        return self.adapters.slots[request.adapter] if request.adapter else 0

    def load_adapter(self, name: str, path: str, replace: bool = False) -> None:
        """Load a LoRA adapter while serving (--allow-runtime-lora); AdapterError says why it is not.
        `replace`: in place of the one of that name (vLLM's load_inplace), whose rows finish with its
        weights while the waiting requests take the new one."""
        if self.adapters is None or not self.adapters.runtime:
            raise AdapterError("adapters are loaded while running only with --allow-runtime-lora")
        old = self.adapters.slots.get(name) if replace else None
        new = self.adapters.add(name, path, replace)
        if old is None:
            return
        for line in (self.waiting, self.grammar_builds.requests):
            for request_id, request in list(line.items()):
                if request.adapter == name:
                    line[request_id] = rescoped(request, old, new)
        self._drop_if_unused(old)

    def unload_adapter(self, name: str) -> None:
        """Serve a LoRA adapter no more: its waiting requests end with an error, its rows finish with
        its weights, which go with the last of them (`_free`). AdapterError where it is not loaded."""
        if self.adapters is None or not self.adapters.runtime:
            raise AdapterError("adapters are unloaded while running only with --allow-runtime-lora")
        slot = self.adapters.retire(name)
        for request in [request for request in self.waiting.values() if request.adapter == name]:
            self._unqueue(self.waiting, request.request_id)
            self._reject(request, f"the LoRA adapter {name!r} was unloaded")
        for request in [r for r in self.grammar_builds.requests.values() if r.adapter == name]:
            self._unbuild(request.request_id)
            self._reject(request, f"the LoRA adapter {name!r} was unloaded")
        self._drop_if_unused(slot)

    def _drop_if_unused(self, slot: int) -> None:
        """An unloaded (or replaced) adapter's weights go once no row has it."""
        if slot in self.adapters.retired and slot not in self.runner.row_adapters:
            self.adapters.drop(slot)

    def _unqueue(self, line: collections.OrderedDict[str, Submit], request_id: str) -> None:
        """A request out of its waiting line, with its compiled grammar and its arrival time."""
        del line[request_id]
        self.matchers.pop(request_id, None)
        self.arrived.pop(request_id, None)

    def _unbuild(self, request_id: str) -> None:
        """A request whose grammar is compiling out of the engine, with its arrival time."""
        self.grammar_builds.drop(request_id)
        self.arrived.pop(request_id, None)

    def _separate_model(self, params: SamplingParams) -> EmbeddingModel | None:
        """The model beside the served one that answers this request: the rerank model a score request's,
        the embedding model (where there is one) an embedding request's; None: the served model."""
        if params.embedding == SCORE:
            return self.rerank_model
        return self.embedding_model if params.embedding is not None else None

    def _wait(self, request: Submit) -> None:
        """Queue a request for a row, once its grammar has compiled (in another thread, so that a big
        one stalls no row: grammar_builds.py): a grammar the matcher refuses is the request's error as
        soon as it is compiled, not when a row frees up."""
        self.arrived[request.request_id] = time.monotonic()
        if request.params.grammar is None:
            self.waiting[request.request_id] = request
            return
        self.grammar_builds.start(request)  # waits a little: the usual grammar is ready at once
        self._queue_built()

    def _queue_built(self) -> None:
        """The requests whose grammar has compiled wait for a row; those it refused end with its error."""
        for request, built in self.grammar_builds.finished():
            if isinstance(built, GrammarError):
                self.arrived.pop(request.request_id, None)
                self._reject(request, str(built), "grammar")
                continue
            if built is not None:
                self.matchers[request.request_id] = built
            self.waiting[request.request_id] = request

    def cancel(self, request_id: str) -> None:
        """End a request; its row is freed at the next step."""
        waiting = next((line for line in (self.waiting, self.embedding_waiting) if request_id in line), None)
        if waiting is not None:
            self._unqueue(waiting, request_id)
            if self.embedding_job is not None and self.embedding_job[0].request_id == request_id:
                self.embedding_job = None  # and its cache with it
            self.undelivered.append(Piece(request_id, "", "cancelled"))
        elif request_id in self.grammar_builds:
            self._unbuild(request_id)
            self.undelivered.append(Piece(request_id, "", "cancelled"))
        elif self.encoder_pass is not None and self.encoder_pass.holds(request_id):
            self.encoder_pass.cancelled.add(request_id)  # the pass goes on for the others, if any
            if len(self.encoder_pass.cancelled) == len(self.encoder_pass.requests):
                self.encoder_pass.staged.abandon()
                self.encoder_pass = None
            self.undelivered.append(Piece(request_id, "", "cancelled"))
        elif (row := self._row_of(request_id)) is not None:
            row.cancelled = True

    @property
    def has_work(self) -> bool:
        return self._busy or bool(self.grammar_builds)

    @property
    def _busy(self) -> bool:
        """Work for a step now (grammars compiling aside)."""
        return bool(
            self.waiting or self.embeddings_pending or self.undelivered or self.active_rows or self.ahead
        )

    @property
    def embeddings_pending(self) -> bool:
        return bool(self.embedding_waiting or self.embedding_job is not None or self.encoder_pass is not None)

    @property
    def active_rows(self) -> list[Row]:
        return [row for row in self.rows if row is not None]

    # One step.

    @torch.inference_mode()
    def step(self) -> list[Piece]:
        if self.grammar_builds:
            if not self._busy:  # nothing to step: sleep on the builds, not spin
                self.grammar_builds.wait()
            self._queue_built()
        pieces, self.undelivered = self.undelivered, []
        pieces += self._free_cancelled()
        if self.ahead is not None:  # the step launched ahead: its tokens, and maybe the next one launched
            self.admitted = []
            pieces += self._continue_ahead()
            self._free_finished()
            return pieces
        try:
            # Finished rows were freed at the end of the last step; the rest decode or prefill.
            schedule = self.scheduler.schedule(self.rows, self.waiting, self._take_row)
            alone = self._first_tokens_alone(schedule) if self.steps_alone < MOST_STEPS_ALONE else None
            self.steps_alone = 0 if alone is None else self.steps_alone + 1
            schedule = schedule if alone is None else alone  # the rows left out go on next step
            self.admitted = [row.request.request_id for row in schedule.admitted]
            prompt_tokens = schedule.prompt_tokens  # before the step takes them
            embedding = self._embedding_job(len(schedule.decoding))
            if schedule or embedding is not None:
                pieces += self._run(schedule, embedding)
            if self.embedding_waiting or self.encoder_pass is not None:
                pieces += self._embed(len(schedule.decoding), prompt_tokens)
        except BaseException:
            self.undelivered = pieces + self.undelivered  # decided before the failure: sent next step
            raise
        self._free_finished()
        return pieces

    def _run(self, schedule: Schedule, embedding: EmbeddingJob | None = None) -> list[Piece]:
        """The scheduled rows' drafts, forward pass, sampling and text, and the embedding input's chunk,
        timed for the prefill budget (a draft token costs about what another decoding row does, and so
        does an embedding input's token where it is a decode query; a prompt's, where it is a chunk)."""
        started, prompt_tokens = time.perf_counter(), schedule.prompt_tokens
        queries = len(schedule.decoding) + self.speculator.draft(schedule.decoding)
        as_queries = self._prompts_as_queries(schedule.prefilling, queries)
        queries, prompt_tokens = queries + as_queries, prompt_tokens - as_queries
        embedded = 0 if embedding is None else self._size_embedding_chunk(embedding, queries, prompt_tokens)
        pieces = self._step_rows(schedule.decoding, schedule.prefilling, embedding)
        elapsed = time.perf_counter() - started
        if embedding is not None and embedding.as_queries:
            self.prefill_budget.observe_embedding_queries(elapsed, queries, embedded, prompt_tokens)
            queries += embedded
        else:
            prompt_tokens += embedded
        self.prefill_budget.observe(elapsed, queries, prompt_tokens)
        return pieces

    def _step_rows(
        self, decoding: list[Row], prefilling: list[Row], embedding: EmbeddingJob | None = None
    ) -> list[Piece]:
        """A step over these rows (and an embedding input's chunk); if it raises, the same rows apart,
        so that only the request at fault (a prompt the model cannot take, a token that breaks a
        kernel) ends with an error.

        The rows decoding go on together, and each new prompt and the embedding chunk alone; rows
        decoding that still fail together go one by one. Nothing of a row (nor of the embedding input)
        changes until its step has sampled, so a step that raised can be run again.
        """
        try:
            return self._forward_and_sample(decoding, prefilling, embedding)
        except Exception as error:
            self.ahead = None  # a step launched ahead of the failed one is not taken: its rows run again
            parts = len(decoding) + len(prefilling) + (embedding is not None)
            if parts == 1 and embedding is not None:
                log.exception("embedding request %s failed", self.embedding_job[0].request_id)
                return [self._end_embedding(embedding_failed(self.embedding_job[0], error))]
            if parts == 1:
                log.exception(
                    "a step failed for request %s alone", (decoding + prefilling)[0].request.request_id
                )
                return [(decoding + prefilling)[0].error_piece(f"generation failed: {error}")]
            log.exception("a step of %d rows failed; running them apart", parts)
        if prefilling or embedding is not None:
            groups = (
                [(decoding, [], None)] + [([], [row], None) for row in prefilling] + [([], [], embedding)]
            )
        else:
            groups = [([row], [], None) for row in decoding]
        return [
            piece
            for group in groups
            if group[0] or group[1] or group[2] is not None
            for piece in self._step_rows(*group)
        ]

    def _embedding_job(self, decoding_rows: int) -> EmbeddingJob | None:
        """The embedding input the served model embeds in this step's forward pass: while rows decode,
        the one begun or the oldest waiting; with no row decoding, only one already begun (the others
        then go whole, `_embed`)."""
        if self.runner.embedding_row is None:
            return None
        if self.embedding_job is None and decoding_rows:
            waiting = self.embedding_waiting.values()
            request = next((r for r in waiting if self._separate_model(r.params) is None), None)
            if request is not None:
                job = EmbeddingJob(request.prompt_ids, request.params.embedding, self.runner.embedding_row)
                self.embedding_job = (request, job)
        return None if self.embedding_job is None else self.embedding_job[1]

    def _first_tokens_alone(self, schedule: Schedule) -> Schedule | None:
        """This step's rows narrowed to other teams' first tokens, the rest waiting a step, or None where
        there are none: the short new prompts (or last chunks) of teams holding fewer rows than another
        (whole, as decode queries of their rows: a step of a few queries), and their rows whose first
        token released no text (a part of a character, the start of a stop sequence), which would
        otherwise show nothing until a whole flood's step had run.

        On a CPU a step's time grows with its rows, and a flooding team's made every first token of
        another team's wait for a step of them all (34 ms of 28 rows on the default model on 2 cores,
        against 8 for the prompts alone): the other team's first token then waited on the flood's size
        (issue 35, docs/performance.md). The flood's own new prompts, admitted in the same step, wait
        with its rows (with them, the step took 48 ms). At most MOST_STEPS_ALONE such steps in a row
        (`step`): a team sending a stream of tiny requests could otherwise keep the rows from decoding
        at all. A lone team's rows, and the busiest team's, go together. Not while an embedding input
        waits: with no row decoding it would go whole."""
        if not (schedule.decoding and self.runner.takes_prompts_as_queries):
            return None
        if self.embeddings_pending:
            return None
        held = collections.Counter(row.request.team for row in self.active_rows)
        busiest = max(held.values())
        lighter = {team for team, rows in held.items() if rows < busiest}
        prompts, tokens = [], 0
        for row in schedule.prefilling:
            length = row.chunk_end - row.cached
            if (
                row.request.team in lighter
                and row.chunk_end == len(row.prompt_ids)
                and length <= LOOP_PROMPT_TOKENS
                and not row.scores_prompt
                and tokens + length <= PROMPT_TOKENS_ALONE
            ):
                prompts.append(row)
                tokens += length
        unheard = [row for row in schedule.decoding if row.request.team in lighter and row.unheard]
        if not (prompts or unheard):
            return None
        return Schedule(unheard, prompts, schedule.admitted)

    def _prompts_as_queries(self, prefilling: list[Row], queries: int) -> int:
        """Mark the chunks that go as more decode queries of their rows in a step of `queries` (drafts
        counted), and return their tokens: where each decode query reads its own row (the CPU's loop),
        a chunk of up to LOOP_PROMPT_TOKENS tokens while the step plan has room. The step then stays a
        decode step, without the prompts' path and its fixed cost (about 13 ms of a 21 ms step of 20
        rows on the default model on 2 cores), which every row waiting on the new prompt paid. A row
        scoring its prompt keeps every such query's logits (step_inputs.pack): as a chunk, its
        1,900-token prompt held a stream beside it to steps of 70-110 ms."""
        taken = 0
        for row in prefilling:
            length = row.chunk_end - row.cached
            row.as_queries = (
                self.runner.takes_prompts_as_queries
                and length <= LOOP_PROMPT_TOKENS
                and queries + taken + length <= self.runner.most_queries
            )
            taken += length if row.as_queries else 0
        return taken

    def _size_embedding_chunk(self, job: EmbeddingJob, queries: int, prompt_tokens: int) -> int:
        """Set the embedding input's chunk for a step of this many decode queries (drafts counted) and
        prompt tokens; returns its length. Where each decode query reads its own row (the CPU's loop),
        the chunk is more decode queries, as many as the step's spare queries and the budget allow
        (prefill_budget.embedding_queries): a step of decode queries alone runs the decode path, where
        a chunk would take the prompts' path and its fixed cost. Else it is a chunk, within what the
        prefill budget leaves after the prompts (prefill_budget.embedding_tokens); with no row
        decoding, nobody waits, and it is the rest of the input."""
        if not queries:
            return job.take(job.left)
        spare = self.runner.most_queries - queries
        if self.runner.takes_prompts_as_queries and spare > 0:
            return job.take(self.prefill_budget.embedding_queries(queries, spare), as_queries=True)
        return job.take(self.prefill_budget.embedding_tokens(queries, prompt_tokens))

    def _embedded(self, job: EmbeddingJob, states: torch.Tensor) -> list[Piece]:
        """The embedding input's chunk has run: its states pooled, and its piece once it is all done."""
        request = self.embedding_job[0]
        try:
            if not job.add(states):
                return []
            vector = tuple(job.vector().tolist())
        except Exception as error:
            log.exception("embedding request %s failed", request.request_id)
            return [self._end_embedding(embedding_failed(request, error))]
        return [
            self._end_embedding(
                Piece(request.request_id, "", "stop", len(request.prompt_ids), embedding=vector)
            )
        ]

    def _end_embedding(self, piece: Piece) -> Piece:
        """The input embedded a chunk a step is done (or failed): it waits no more."""
        del self.embedding_waiting[self.embedding_job[0].request_id]
        self.embedding_job = None
        return piece

    def _embed(self, decoding_rows: int, prompt_tokens: int) -> list[Piece]:
        """The step's embedding work outside its forward pass. With no row decoding, nobody waits: the
        served model's waiting inputs go whole up to a row's worth of tokens, and a separate model's
        pass as many layers as that pays for. While rows decode, the served model's go into the step's
        own pass instead (`_embedding_job`), and a separate embedding or rerank model's pass goes as
        many layers as what the prefill budget leaves after the step's prompt chunks pays for
        (prefill_budget.embedding_tokens), timed for the next steps' budgets."""
        if not decoding_rows:
            whole = max(self.prefill_budget.ceiling, self.max_seq_len)  # a row's worth
            return self._embed_waiting(whole) + self._encode(whole)[0]
        if self.encoder_pass is None and not any(
            self._separate_model(request.params) for request in self.embedding_waiting.values()
        ):
            return []
        started = time.perf_counter()
        pieces, tokens = self._encode(self.prefill_budget.embedding_tokens(decoding_rows, prompt_tokens))
        self.prefill_budget.observe_embedding(time.perf_counter() - started, tokens)
        return pieces

    def _embed_waiting(self, budget: int) -> list[Piece]:
        """Embed the served model's waiting inputs whole, oldest first, within `budget` tokens, in one
        batch a pooling; not the one being embedded a chunk a step. A batch that fails ends its requests
        with an error."""
        pieces: list[Piece] = []
        batch, tokens = [], 0
        for request in list(self.embedding_waiting.values()):
            if self._separate_model(request.params) is not None:
                continue
            if self.embedding_job is not None and request is self.embedding_job[0]:
                continue
            size = len(request.prompt_ids)
            if tokens + size > budget:
                break
            batch.append(self.embedding_waiting.pop(request.request_id))
            tokens += size
        for pooling in sorted({request.params.embedding for request in batch}):
            group = [request for request in batch if request.params.embedding == pooling]
            try:
                vectors = embed(self.model, [request.prompt_ids for request in group], pooling).tolist()
            except Exception as error:
                log.exception("embedding %d prompts failed", len(group))
                pieces += [embedding_failed(request, error) for request in group]
                continue
            pieces += [
                Piece(request.request_id, "", "stop", len(request.prompt_ids), embedding=tuple(vector))
                for request, vector in zip(group, vectors, strict=True)
            ]
        return pieces

    def _encode(self, budget: int) -> tuple[list[Piece], int]:
        """Advance a separate model's pass by what `budget` tokens pay for, begun on the oldest of its
        waiting inputs if none is under way; the pass's answers once it is done, and the tokens the
        step's part of it was worth."""
        if self.encoder_pass is None:
            waiting = [r for r in self.embedding_waiting.values() if self._separate_model(r.params)]
            if not waiting:
                return [], 0
            model = self._separate_model(waiting[0].params)
            mine = [request for request in waiting if self._separate_model(request.params) is model]
            ceiling = max(self.prefill_budget.ceiling, self.max_seq_len)
            self.encoder_pass = EncoderPass.of_waiting(model, mine, budget, ceiling)
            for request in self.encoder_pass.requests:
                del self.embedding_waiting[request.request_id]
        tokens = self.encoder_pass.advance(budget)
        if not self.encoder_pass.staged.done:
            return [], tokens
        if (error := self.encoder_pass.staged.error) is not None:
            log.error("a pass of %d inputs failed", len(self.encoder_pass.requests), exc_info=error)
        pieces, self.encoder_pass = self.encoder_pass.pieces(), None
        return pieces, tokens

    def fail_all(self, message: str) -> list[Piece]:
        """A step raised past `_step_rows` (admission, not a row's forward pass): end every request in
        a row with an error, keep serving the waiting ones."""
        pieces = []
        for row in self.active_rows:
            pieces.append(
                Piece(row.request.request_id, "", "error", len(row.prompt_ids), len(row.generated), message)
            )
            self.rows[row.index] = None
            self.grammars.release(row.index)
            self.prefixes.release(row.index, "", ())
        self.ahead = None
        return pieces

    def _free_cancelled(self) -> list[Piece]:
        pieces = []
        for row in self.active_rows:
            if row.cancelled:
                pieces.append(row.cancel_piece())
                self._free(row)
        return pieces

    def _take_row(self, request: Submit, place: Placement) -> Row:
        """A waiting request takes the free row the scheduler placed it in: its cached prefix copied
        there first if another row holds it, its penalties' counts and its grammar set up, its time in
        the queue noted."""
        if place.source is not None:
            self.runner.cache.copy_prefix(place.source, place.row, place.reused)
        row = Row(place.row, request, self.tokenizer, self.eos_ids, self.max_seq_len, cached=place.reused)
        row.queued = time.monotonic() - self.arrived.pop(request.request_id, time.monotonic())
        if self.adapters is not None:
            self.runner.use_adapter(place.row, self._adapter_slot(request))
        self.speculator.admit(row)
        self.processors.admit(place.row, request.params, request.prompt_ids)
        self.grammars.attach(place.row, self.matchers.pop(request.request_id, None))
        return row

    def _forward_and_sample(
        self, decoding: list[Row], prefilling: list[Row], embedding: EmbeddingJob | None = None
    ) -> list[Piece]:
        """One forward pass over a packed sequence (model/step_inputs.py): a token per decoding row and
        its draft's, then each prompt chunk, then the embedding input's. The rows that sample are the
        decoding ones, at each of those tokens, and those whose chunk ends their prompt; nothing of a
        row changes before they have sampled."""
        inputs = self.runner.prepare(decoding, prefilling, embedding)
        sampling = decoding + [self.rows[index] for index in inputs.completing]
        logits = self._forward(inputs)
        masks = self.grammars.masks([row.index for row in sampling], self.device)  # a GPU's runs meanwhile
        embedded_states = self.runner.embedded_states
        prompt_scores = {
            score.row: self._prompt_logprobs(
                self.rows[score.row], logits[score.first : score.first + score.count]
            )
            for score in inputs.prompt_scores
        }
        if inputs.sample_from is not None:
            logits = logits.index_select(0, inputs.sample_from)
        next_step = decoding if not prefilling and self._goes_ahead(decoding) else None
        tokens, logprobs = self._sample(sampling, logits, masks, next_step)
        # The step has run: from here on the rows change (a decoding row's length as it takes tokens).
        for row in prefilling:
            row.cached = row.chunk_end
            row.prompt_scores += prompt_scores.get(row.index, ())
            if row.prefilled and row.scores_prompt:
                row.prompt_logprobs = (None, *row.prompt_scores)
        pieces = self._accept(sampling, len(decoding), tokens, logprobs)
        return pieces if embedding is None else pieces + self._embedded(embedding, embedded_states)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model's logits at the step's kept places (the one seam the tests watch steps through)."""
        return self.runner.run(inputs)

    def _sample(
        self,
        sampling_rows: list[Row],
        logits: torch.Tensor,
        masks: Masks,
        next_step: list[Row] | None = None,
    ) -> tuple[dict[int, int], dict[int, TokenLogprob]]:
        """Each sampled position's token from its logits ([positions, vocab], raw), through its row's
        penalties, grammar mask and sampling settings, and its logprob entry if the row asks; by
        position. A row samples at its token and at each of its draft's, with the draw numbers of the
        tokens it would be (so as plain decoding would); rows that only score their prompt (max_tokens
        0) sample nothing. `next_step`: these rows' next step is launched from the tokens on the
        device before they are read (ahead.py)."""
        rows = [row for row in sampling_rows for _ in range(1 + len(row.draft))]
        ahead = [offset for row in sampling_rows for offset in range(1 + len(row.draft))]
        sampling = [i for i, row in enumerate(rows) if row.request.params.max_tokens > 0]
        if not sampling:
            return {}, {}
        if len(sampling) < len(rows):
            logits = logits.index_select(0, to_device(sampling, self.device, torch.long))
        rows, ahead = [rows[i] for i in sampling], [ahead[i] for i in sampling]
        penalized = [i for i, row in enumerate(rows) if row.request.params.penalized]
        # `logits` stay raw for logprobs
        processed = logits.to(torch.float32, copy=bool(penalized) or masks.constrains)
        if penalized:
            self.processors.apply(
                processed,
                penalized,
                [rows[i].index for i in penalized],
                [rows[i].request.params for i in penalized],
                [len(rows[i].prompt_ids) for i in penalized],
                [rows[i].generated for i in penalized],
                self.eos_ids,
            )
        masks.apply(processed, [row.index for row in rows])
        # A row whose logits are not finite draws NOT_FINITE; its penalty counts and logprobs, made on
        # the device before the host sees it, take token 0 instead, and the row ends with an error.
        drawn = sample(processed, self._sampling_batch(rows, ahead))
        tokens = drawn.clamp_min(0)
        if penalized:  # written at the token's own place: a step run again writes the same
            self.processors.record(
                [rows[i].index for i in penalized],
                [len(rows[i].prompt_ids) + len(rows[i].generated) for i in penalized],
                tokens.index_select(0, torch.tensor(penalized, device=self.device)),
            )
        logprobs = self._logprobs(rows, logits, tokens)
        read = read_later(drawn)
        if next_step is not None:
            self._launch_ahead(next_step, drawn)
        token_list = read()  # the step's one host sync
        return (
            {sampling[i]: token for i, token in enumerate(token_list)},
            {sampling[i]: entry for i, entry in logprobs.items()},
        )

    # Steps launched ahead (ahead.py).

    def _goes_ahead(self, rows: list[Row]) -> bool:
        """Whether the next step of these decoding rows may be launched before their tokens are read: it
        runs as a CUDA graph, they are every row in use and each surely decodes again, and nothing else
        waits for a step of its own (a request for a free row, embeddings)."""
        return (
            self.steps_ahead
            and self.runner.decodes_in_graphs
            and not self.speculator.enabled
            and len(rows) == len(self.active_rows)
            and not (self.waiting and None in self.rows)
            and not self.embedding_waiting
            and self.encoder_pass is None
            and all(decodes_again(row) for row in rows)
        )

    def _launch_ahead(self, rows: list[Row], drawn: torch.Tensor) -> None:
        """The rows' next decode step, fed the tokens they just drew (`drawn`, on the device, unread),
        and its draw, each with its next draw number. A launch that fails leaves plain steps."""
        try:
            inputs = self.runner.prepare(next_step_rows(rows), [])
            inputs = dataclasses.replace(inputs, token_ids=drawn.clamp_min(0))  # NOT_FINITE: dropped later
            logits = self._forward(inputs)
            next_drawn = sample(logits.float(), self._sampling_batch(rows, [1] * len(rows)))
        except Exception:
            log.exception("a decode step launched ahead failed: plain steps instead")
            return
        self.ahead = StepAhead(rows, next_drawn, read_later(next_drawn))

    def _continue_ahead(self) -> list[Piece]:
        """The step launched ahead: the one after it launched first if its rows all go on, then its tokens
        read and taken by the rows still in use (those that ended meanwhile drop theirs)."""
        ahead, self.ahead = self.ahead, None
        kept = [i for i, row in enumerate(ahead.rows) if self.rows[row.index] is row and not row.finished]
        if len(kept) == len(ahead.rows) and self._goes_ahead(ahead.rows):
            self._launch_ahead(ahead.rows, ahead.drawn)
        tokens = ahead.read()
        rows = [ahead.rows[i] for i in kept]
        return self._accept(rows, len(rows), {place: tokens[i] for place, i in enumerate(kept)}, {})

    def _accept(
        self, rows: list[Row], decoding: int, tokens: dict[int, int], logprobs: dict[int, TokenLogprob]
    ) -> list[Piece]:
        """Each row takes its token, or those its draft verified (or, scoring only, ends); the first
        `decoding` rows grow by what they take. A row whose text cannot be made, or whose logits were not
        finite, ends with an error alone."""
        pieces, first = [], 0
        for i, row in enumerate(rows):
            places = range(first, first + 1 + len(row.draft))
            first = places.stop
            try:
                if places.start in tokens:
                    samples = [tokens[place] for place in places]
                    entries = [logprobs[place] for place in places] if row.wants_logprobs else None
                    piece = self._take(row, samples, entries, grows=i < decoding)
                else:
                    piece = row.scored_piece()
            except GrammarError as error:  # the request's grammar has no way on: its fault, not the step's
                log.info("request %s: %s", row.request.request_id, error)
                piece = row.error_piece(str(error), invalid="grammar")
            except Exception as error:
                log.exception("request %s could not take its token", row.request.request_id)
                piece = row.error_piece(f"generation failed: {error}")
            if piece is not None:
                pieces.append(piece)
        return pieces

    def _take(
        self, row: Row, samples: list[int], entries: list[TokenLogprob] | None, grows: bool
    ) -> Piece | None:
        """A row takes what it sampled: its token, or those its draft verified (speculation.verified);
        `grows`: its cache holds the keys and values of the tokens before each it takes (a decoding row)."""
        taken = verified(samples, row.draft)
        if row.draft:
            row.took_draft(stood=len(taken) - 1)
        if taken[-1] == NOT_FINITE:
            log.warning("request %s: the model's logits are not finite", row.request.request_id)
            return row.error_piece(NOT_FINITE_ERROR)
        complete = len(taken) == 1 and self.grammars.consume(row.index, taken[0])  # no grammar drafts
        before = len(row.generated)
        piece = row.accept(taken, entries, complete)
        if grows:
            row.cached += len(row.generated) - before
        return piece

    def _logprobs(
        self, rows: list[Row], logits: torch.Tensor, tokens: torch.Tensor
    ) -> dict[int, TokenLogprob]:
        """The chosen tokens' log-probabilities, by position in `rows`, for the rows that ask."""
        asking = [i for i, row in enumerate(rows) if row.wants_logprobs]
        if not asking:
            return {}
        index = torch.tensor(asking, device=self.device)
        tops = [rows[i].request.params.logprobs for i in asking]
        entries = token_logprobs(logits.index_select(0, index), tokens.index_select(0, index), tops)
        return dict(zip(asking, entries, strict=True))

    def _prompt_logprobs(self, row: Row, logits: torch.Tensor) -> list[TokenLogprob]:
        """The log-probabilities of the prompt tokens these logits (this step's chunk) predict: those
        after the chunk's first, and the next chunk's first."""
        past = row.cached
        following = torch.tensor(row.prompt_ids[past + 1 : past + 1 + logits.shape[0]], device=self.device)
        top = row.request.params.prompt_logprobs
        return token_logprobs(logits, following, [top] * len(following))

    def _sampling_batch(self, rows: list[Row], ahead: list[int]) -> SamplingBatch:
        """The sampling settings of each sampled position: its row's, the draw number of the token it
        would be (`ahead` of the row's next)."""
        params = [row.request.params for row in rows]
        return SamplingBatch(
            temperature=[p.temperature for p in params],
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            seeds=[row.seed for row in rows],
            counters=[len(row.generated) + offset for row, offset in zip(rows, ahead, strict=True)],
            min_p=[p.min_p for p in params],
            typical_p=[p.typical_p for p in params],
        )

    def _only_held_back(self, params: SamplingParams) -> bool:
        """Whether min_tokens holds back every token allowed_token_ids leaves: nothing could be sampled."""
        ends = self.eos_ids | set(params.stop_token_ids)
        return bool(params.min_tokens and params.allowed_token_ids) and set(params.allowed_token_ids) <= ends

    def _in_vocabulary(self, tokens: Iterable[int]) -> bool:
        return all(0 <= token < self.vocab_size for token in tokens)

    def _free_finished(self) -> None:
        for row in self.active_rows:
            if row.finished:
                self._free(row)

    def _free(self, row: Row) -> None:
        """The row is free; it keeps its tokens' keys and values for a prompt that starts the same,
        unless its request failed (they may be half written)."""
        self.rows[row.index] = None
        self.grammars.release(row.index)
        if self.adapters is not None:  # else packing every later step would look up its tokens' adapters
            slot = self.runner.row_adapters[row.index]
            self.runner.use_adapter(row.index, 0)
            self._drop_if_unused(slot)  # its last row: an unloaded adapter's weights go
        kept = () if row.finish_reason == "error" else row.cached_tokens
        self.prefixes.release(row.index, row.request.cache_scope, kept)

    def _row_of(self, request_id: str) -> Row | None:
        return next((row for row in self.active_rows if row.request.request_id == request_id), None)

    def _reject(self, request: Submit, message: str, invalid: InvalidPart | None = None) -> None:
        """End a request before it waits for a row; `invalid`: the part of it at fault, if it is."""
        prompt_tokens = len(request.prompt_ids)
        self.undelivered.append(
            Piece(request.request_id, "", "error", prompt_tokens, error=message, invalid=invalid)
        )

    # Start-up and use from a Python shell.

    def warm_up(self) -> None:
        """One prefill and a few decode steps, sampled, so the first real request pays no first-call
        costs.

        Compiled decode steps compile here, once for each way torch.compile specializes their
        shapes: one row decoding, then two. On a GPU the decode steps' CUDA graphs are captured
        first, every bucket of rows and span, so that the steps below already replay them.
        """
        if self.runner.graphs_to_capture:
            self.runner.capture_graphs()
        if self.speculator.draft_model is not None and self.speculator.draft_model.runner.graphs_to_capture:
            self.speculator.draft_model.runner.capture_graphs()
        prompt = tuple(t for t in self.tokenizer("Warm up.").input_ids if t < self.vocab_size) or (0,)
        compiled = self.runner.decoder is not None and self.runner.decoder.compiled_decode is not None
        runs = [(3,), (3, 3)] if compiled and len(self.rows) > 1 else [(3,)]
        for lengths in runs:
            for i, length in enumerate(lengths):
                # Sampled from a nucleus, seeded: on a CPU that path's loop is the C++ extension's, which
                # the exact mode builds nowhere else, and a first build inside a serving step (half a
                # minute) held every row and tripped the watchdog.
                params = SamplingParams(top_p=0.9, seed=i, max_tokens=length, ignore_eos=True)
                self.submit(Submit(f"warm-up-{i}", prompt, params))
            while self.has_work:
                self.step()
        self.prefill_budget.forget()  # first-call costs are no measure of a step
        self.runner.plan.log(self.name)

    def generate(self, prompts: Iterable[str], params: SamplingParams | None = None) -> list[str]:
        """Generate for several prompts at once and return the texts (a convenience for shells and tests)."""
        params = params or SamplingParams()
        texts: dict[str, list[str]] = {}
        for i, prompt in enumerate(prompts):
            request_id = f"generate-{i}"
            texts[request_id] = []
            self.submit(Submit(request_id, tuple(self.tokenizer(prompt).input_ids), params))
        while self.has_work:
            for piece in self.step():
                texts[piece.request_id].append(piece.text)
                if piece.error:
                    raise ValueError(piece.error)
        return ["".join(parts) for parts in texts.values()]
