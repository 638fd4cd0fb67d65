"""The batching engine: user rows over one KV cache, decoded together step by step.

Each `step()` reads like the algorithm:

    free the rows of cancelled requests
    plan this step's prompt chunks: rows still prefilling, then waiting requests admitted into free rows
    one forward pass: a token for every decoding row, and the prompt chunks (prefill)
    sample every row's next token with its own settings (and its grammar, if it has one)
    embed waiting embedding requests (they take no row)
    free the rows whose requests ended

and returns the text each request gained. The engine does no I/O: the
backend process (`backend.engine.serve`) moves requests and pieces across queues.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from backend.engine.prefill_budget import PrefillBudget
from backend.engine.prefix_cache import PrefixIndex
from backend.engine.row import Row
from backend.layers.attention import attending_over
from backend.layers.grammar import GrammarError, Grammars, PendingMasks
from backend.layers.logits_processors import LogitsProcessors
from backend.layers.logprobs import token_logprobs
from backend.layers.row_cache import KVShape, RowCache, pick_cache_dtype
from backend.layers.sampler import SamplingBatch, sample
from backend.layers.step_layout import LongRow, PromptChunk, StepLayout, long_rows, visibility
from backend.messages import BackendConfig, Piece, SamplingParams, Submit, TokenLogprob
from backend.model.cache_size import DEFAULT_MAX_SEQ_LEN, context_length
from backend.model.decoder_runner import DecoderRunner
from backend.model.embeddings import EmbeddingModel, embed
from backend.utils.heap import reuse_freed_memory
from backend.utils.host_lists import to_device

log = logging.getLogger(__name__)


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
    ):
        if embedding_model is not None and embedding_model.name == name:
            raise ValueError(f"the embedding model and the served model are both named {name!r}")
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
        self.runner = (
            DecoderRunner(model, compile_decode)
            if DecoderRunner.supports(model.config, self.max_seq_len)
            else None
        )
        loop_attention = self.runner is not None and self.runner.reads_own_positions
        self.cache_dtype = kv_cache_dtype or pick_cache_dtype("auto", self.dtype, self.device, loop_attention)
        self.cache = RowCache(KVShape.of(model.config), rows, self.max_seq_len, self.cache_dtype, self.device)
        if compile_decode and self.runner is None:
            log.warning("--compile: %s runs through transformers' forward, which is not compiled", name)
        if cuda_graphs and self.runner is not None and self.device.type == "cuda":
            self.runner.use_graphs(self.cache)  # captured in warm_up
        self.processors = LogitsProcessors(rows, self.max_seq_len, self.vocab_size, self.device)
        self.grammars = Grammars(tokenizer, self.vocab_size, self.eos_ids, rows)
        self.rows: list[Row | None] = [None] * rows
        self.prefixes = PrefixIndex(rows, prefix_reuse)
        self.waiting: collections.OrderedDict[str, Submit] = collections.OrderedDict()
        self.embedding_waiting: collections.OrderedDict[str, Submit] = collections.OrderedDict()
        self.embedding_model = embedding_model  # None: embedding requests pool the served model's states
        self.undelivered: list[Piece] = []  # answers decided outside a step (rejections, cancels)
        self.admitted: list[str] = []  # the requests that took a row in the last step

    @classmethod
    def load(cls, config: BackendConfig) -> Engine:
        """Load the configured model (checking resources first) and warm it up."""
        from backend.model.loader import load_embedding_model, load_model

        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        loaded = load_model(config)
        embedding_model = load_embedding_model(config) if config.embedding_model else None
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
        )
        engine.tokenizer_path = loaded.tokenizer_path
        engine.warm_up()
        return engine

    # The frontend's side: requests in, cancels in.

    def submit(self, request: Submit) -> None:
        prompt_tokens = len(request.prompt_ids)
        # A separate embedding model takes its own token ids, up to its own length.
        separate = self.embedding_model if request.params.embedding is not None else None
        vocab_size = separate.vocab_size if separate else self.vocab_size
        if prompt_tokens == 0:
            self._reject(request, "the prompt is empty")
        elif separate is not None and prompt_tokens > separate.max_tokens:
            limit = separate.max_tokens
            self._reject(request, f"the input has {prompt_tokens} tokens; the embedding model takes {limit}")
        elif separate is None and prompt_tokens >= self.max_seq_len:
            self._reject(
                request, f"the prompt has {prompt_tokens} tokens; the context holds {self.max_seq_len}"
            )
        elif not all(0 <= token < vocab_size for token in request.prompt_ids):
            self._reject(request, f"the prompt has token ids outside the model's vocabulary of {vocab_size}")
        elif not all(0 <= token < self.vocab_size for token in self._named_tokens(request.params)):
            self._reject(
                request, f"logit_bias or stop_token_ids name ids outside the vocabulary of {self.vocab_size}"
            )
        elif (
            request.request_id in self.waiting
            or request.request_id in self.embedding_waiting
            or self._row_of(request.request_id) is not None
        ):
            self._reject(request, f"request id {request.request_id!r} is already in use")
        elif request.params.embedding is not None:
            self.embedding_waiting[request.request_id] = request
        else:
            self.waiting[request.request_id] = request

    def cancel(self, request_id: str) -> None:
        """End a request; its row is freed at the next step."""
        waiting = next((line for line in (self.waiting, self.embedding_waiting) if request_id in line), None)
        if waiting is not None:
            del waiting[request_id]
            self.undelivered.append(Piece(request_id, "", "cancelled"))
        elif (row := self._row_of(request_id)) is not None:
            row.cancelled = True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.embedding_waiting or self.undelivered or self.active_rows)

    @property
    def active_rows(self) -> list[Row]:
        return [row for row in self.rows if row is not None]

    # One step.

    @torch.inference_mode()
    def step(self) -> list[Piece]:
        pieces, self.undelivered = self.undelivered, []
        pieces += self._free_cancelled()
        try:
            # Finished rows were freed at the end of the last step; the rest decode or prefill.
            decoding = [row for row in self.active_rows if row.prefilled]
            # A prompt chunk makes every decoding row wait for it; with none decoding nobody waits, and a
            # step prefills up to a whole row's worth (chunks would only delay the first token).
            ceiling = self.prefill_budget.ceiling
            budget = self.prefill_budget.tokens(len(decoding)) if decoding else max(ceiling, self.max_seq_len)
            continuing, budget = self._plan_chunks(
                [row for row in self.active_rows if not row.prefilled], budget
            )
            admitted = self._admit_waiting(budget)
            self.admitted = [row.request.request_id for row in admitted]
            prefilling = continuing + admitted
            if decoding or prefilling:
                started = time.perf_counter()
                prompt_tokens = sum(row.chunk_end - row.cached for row in prefilling)
                pieces += self._step_rows(decoding, prefilling)
                self.prefill_budget.observe(time.perf_counter() - started, len(decoding), prompt_tokens)
            pieces += self._embed_waiting()
        except BaseException:
            self.undelivered = pieces + self.undelivered  # decided before the failure: sent next step
            raise
        self._free_finished()
        return pieces

    def _step_rows(self, decoding: list[Row], prefilling: list[Row]) -> list[Piece]:
        """A step over these rows; if it raises, the same rows apart, so that only the request at
        fault (a prompt the model cannot take, a token that breaks a kernel) ends with an error.

        The rows decoding go on together and each new prompt alone; rows decoding that still fail
        together go one by one. Nothing of a row changes until its step has sampled, so a step
        that raised can be run again.
        """
        try:
            return self._forward_and_sample(decoding, prefilling)
        except Exception as error:
            if len(decoding) + len(prefilling) == 1:
                log.exception(
                    "a step failed for request %s alone", (decoding + prefilling)[0].request.request_id
                )
                return [(decoding + prefilling)[0].error_piece(f"generation failed: {error}")]
            log.exception("a step of %d rows failed; running them apart", len(decoding) + len(prefilling))
        if prefilling:
            groups = [(decoding, [])] + [([], [row]) for row in prefilling]
        else:
            groups = [([row], []) for row in decoding]
        return [piece for group in groups if group[0] or group[1] for piece in self._step_rows(*group)]

    def _embed_waiting(self) -> list[Piece]:
        """Embed the oldest waiting embedding requests, up to the prefill budget in tokens (at least one),
        a batch per pooling; a batch that fails ends its requests alone with an error."""
        batch, tokens = [], 0
        while self.embedding_waiting:
            request = next(iter(self.embedding_waiting.values()))
            if batch and tokens + len(request.prompt_ids) > self.prefill_budget.ceiling:
                break
            batch.append(self.embedding_waiting.pop(request.request_id))
            tokens += len(request.prompt_ids)
        pieces = []
        for pooling in sorted({request.params.embedding for request in batch}):
            group = [request for request in batch if request.params.embedding == pooling]
            try:
                model = self.embedding_model.model if self.embedding_model else self.model
                vectors = embed(model, [request.prompt_ids for request in group], pooling).tolist()
            except Exception as error:
                log.exception("embedding %d prompts failed", len(group))
                pieces += [
                    Piece(r.request_id, "", "error", len(r.prompt_ids), error=f"embedding failed: {error}")
                    for r in group
                ]
                continue
            pieces += [
                Piece(request.request_id, "", "stop", len(request.prompt_ids), embedding=tuple(vector))
                for request, vector in zip(group, vectors, strict=True)
            ]
        return pieces

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
            self.prefixes.release(row.index, ())
        return pieces

    def _free_cancelled(self) -> list[Piece]:
        pieces = []
        for row in self.active_rows:
            if row.cancelled:
                pieces.append(row.cancel_piece())
                self._free(row)
        return pieces

    @staticmethod
    def _plan_chunks(rows: list[Row], budget: int) -> tuple[list[Row], int]:
        """This step's chunk of each row still prefilling, oldest first, within the budget: the rows
        that got one (their `chunk_end` set) and the budget left."""
        planned = []
        for row in rows:
            if budget <= 0:
                break
            row.chunk_end = min(len(row.prompt_ids), row.cached + budget)
            budget -= row.chunk_end - row.cached
            planned.append(row)
        return planned, budget

    def _admit_waiting(self, budget: int) -> list[Row]:
        """Put waiting requests into free rows, oldest request first, while the step's prefill
        budget lasts; each gets its first chunk, after what of its prompt is cached already."""
        admitted: list[Row] = []
        # What each busy row holds, built once for the burst (with reuse off, nothing to look at).
        busy = {row.index: row.cached_tokens for row in self.active_rows} if self.prefixes.enabled else {}
        while self.waiting and budget > 0 and None in self.rows:
            request = self.waiting.pop(next(iter(self.waiting)))
            try:
                matcher = self.grammars.matcher(request.params.grammar)
            except GrammarError as error:
                self._reject(request, str(error))
                continue
            free = [index for index, slot in enumerate(self.rows) if slot is None]
            # A prompt to be scored reuses nothing: it needs the logits of every position.
            reuse = request.params.prompt_logprobs is None
            place = self.prefixes.place(request.prompt_ids, free, busy, reuse)
            if place.source is not None:
                self.cache.copy_prefix(place.source, place.row, place.reused)
            row = Row(place.row, request, self.tokenizer, self.eos_ids, self.max_seq_len, cached=place.reused)
            self.processors.admit(place.row, request.params, request.prompt_ids)
            self.grammars.attach(place.row, matcher)
            self.rows[place.row] = row
            if self.prefixes.enabled:
                busy[row.index] = row.cached_tokens
            planned, budget = self._plan_chunks([row], budget)
            admitted += planned
        return admitted

    def _forward_and_sample(self, decoding: list[Row], prefilling: list[Row]) -> list[Piece]:
        """One forward pass over a packed sequence: a token per decoding row, then each prompt chunk.

        Decoding rows come in row order (`active_rows` lists them so), each
        its last token at its own position; the linear layers see no free
        rows. Attention batches the decode queries over rows
        0..decode_rows-1 of the cache, the free (and prefilling) rows in that
        span masked to position 0 (see row_attention). Prompt chunks follow,
        each token at its own position; a row whose chunk ends its prompt
        samples its first token in this step.
        """
        decode_rows = decoding[-1].index + 1 if decoding else 0
        token_ids = [row.next_input for row in decoding]
        decode_positions = [row.position for row in decoding]
        positions = list(decode_positions)
        chunks: list[PromptChunk] = []
        keep = list(range(len(decoding)))  # the positions whose logits the step needs
        last_of_row = list(range(len(decoding)))  # which of those each sampling row samples from
        completing: list[Row] = []  # rows whose chunk ends their prompt
        scored = []  # (row, its first kept position, how many prompt tokens those logits predict)
        for row in prefilling:
            past, end = row.cached, row.chunk_end
            start, length, completes = len(token_ids), end - past, end == len(row.prompt_ids)
            chunks.append(PromptChunk(row.index, start, length, past, self._chunk_mask(past, length)))
            token_ids += row.prompt_ids[past:end]
            positions += range(past, end)
            if row.request.params.prompt_logprobs is not None:
                scored.append((row, len(keep), length - completes))  # a final chunk's last one samples
                keep += range(start, start + length)
            elif completes:
                keep.append(start + length - 1)
            if completes:
                last_of_row.append(len(keep) - 1)
                completing.append(row)

        visible, alone = self._decode_visibility(decoding, decode_rows)
        masks = self.grammars.start_masks([row.index for row in decoding + completing])  # during the forward
        layout = StepLayout(
            decode_rows,
            to_device([row.index for row in decoding], self.device, torch.long),
            to_device(decode_positions, self.device, torch.long),
            visible.shape[-1],
            visible,
            tuple(chunks),
            alone,
        )
        logits = self._forward(
            to_device(token_ids, self.device, torch.long),
            to_device(positions, self.device, torch.long),
            layout,
            to_device(keep, self.device, torch.long),  # empty when no chunk ends
        )
        prompt_scores = {
            row.index: self._prompt_logprobs(row, logits[first : first + count])
            for row, first, count in scored
        }
        if len(keep) != len(last_of_row):
            logits = logits.index_select(0, to_device(last_of_row, self.device, torch.long))
        rows = decoding + completing
        tokens, logprobs = self._sample(rows, logits, masks)
        # The step has run: from here on the rows change.
        for row in decoding:
            row.cached += 1
        for row in prefilling:
            row.cached = row.chunk_end
            row.prompt_scores += prompt_scores.get(row.index, ())
            if row.prefilled and row.request.params.prompt_logprobs is not None:
                row.prompt_logprobs = (None, *row.prompt_scores)
        return self._accept(rows, tokens, logprobs)

    def _decode_visibility(
        self, decoding: list[Row], decode_rows: int
    ) -> tuple[torch.Tensor, tuple[LongRow, ...]]:
        """What each row of the decode span may read ([rows, 1, 1, span]: 0, or -inf past its
        position), and the long rows that attend alone (row_attention.long_rows; none where the runner
        reads each row up to its own position). Free rows of the span, and the long rows, read their
        position 0 only in the batch."""
        reads_own_positions = self.runner is not None and self.runner.reads_own_positions
        alone = (
            set() if reads_own_positions else long_rows({r.index: r.position for r in decoding}, decode_rows)
        )
        row_positions = [0] * decode_rows
        for row in decoding:
            if row.index not in alone:
                row_positions[row.index] = row.position
        span = max(row_positions, default=0) + 1
        visible = visibility(to_device(row_positions, self.device, torch.long), span, self.cache_dtype)
        long = [LongRow(query, row.index, row.position) for query, row in enumerate(decoding)]
        return visible, tuple(r for r in long if r.row in alone)

    def _chunk_mask(self, past: int, length: int) -> torch.Tensor | None:
        """A chunk after the first reads the row's earlier positions and itself causally."""
        if not past:
            return None
        keys = torch.arange(past + length, device=self.device)
        return keys <= past + torch.arange(length, device=self.device)[:, None]

    def _forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, layout: StepLayout, keep: torch.Tensor
    ) -> torch.Tensor:
        """The forward pass over our cache and attention; the logits at the `keep` positions.

        Llama-family models run through the decoder runner, the rest through
        transformers' own forward with row_attention registered for it.
        """
        self.cache.plan_step(layout)
        if self.runner is not None:
            return self.runner(input_ids, position_ids, layout, self.cache, keep)
        with attending_over(self.model.config, layout):
            output = self.model(
                input_ids=input_ids[None],
                position_ids=position_ids[None],
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=keep,
            )
        return output.logits[0]

    def _sample(
        self, rows: list[Row], logits: torch.Tensor, masks: PendingMasks
    ) -> tuple[dict[int, int], dict[int, TokenLogprob]]:
        """Each row's next token from its logits ([rows, vocab], raw), through its penalties, its
        grammar's mask and its sampling settings, and its logprob entry if it asks; by position in
        `rows`. Rows that only score their prompt (max_tokens 0) sample nothing."""
        sampling = [i for i, row in enumerate(rows) if row.request.params.max_tokens > 0]
        if not sampling:
            return {}, {}
        if len(sampling) < len(rows):
            logits = logits.index_select(0, to_device(sampling, self.device, torch.long))
        rows = [rows[i] for i in sampling]
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
                [len(rows[i].generated) for i in penalized],
                self.eos_ids,
            )
        masks.apply(processed, [row.index for row in rows])
        tokens = sample(processed, self._sampling_batch(rows))
        if penalized:  # written at the token's own place: a step run again writes the same
            self.processors.record(
                [rows[i].index for i in penalized],
                [len(rows[i].prompt_ids) + len(rows[i].generated) for i in penalized],
                tokens.index_select(0, torch.tensor(penalized, device=self.device)),
            )
        logprobs = self._logprobs(rows, logits, tokens)
        token_list = tokens.tolist()  # the step's one host sync
        return (
            {sampling[i]: token for i, token in enumerate(token_list)},
            {sampling[i]: entry for i, entry in logprobs.items()},
        )

    def _accept(
        self, rows: list[Row], tokens: dict[int, int], logprobs: dict[int, TokenLogprob]
    ) -> list[Piece]:
        """Each row takes its token (or, scoring only, ends); a row whose text cannot be made ends
        with an error alone."""
        pieces = []
        for i, row in enumerate(rows):
            try:
                if i in tokens:
                    complete = self.grammars.consume(row.index, tokens[i])
                    piece = row.accept(tokens[i], logprobs.get(i), complete)
                else:
                    piece = row.scored_piece()
            except Exception as error:
                log.exception("request %s could not take its token", row.request.request_id)
                piece = row.error_piece(f"generation failed: {error}")
            if piece is not None:
                pieces.append(piece)
        return pieces

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

    def _sampling_batch(self, rows: list[Row]) -> SamplingBatch:
        params = [row.request.params for row in rows]
        return SamplingBatch(
            temperature=[p.temperature for p in params],
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            seeds=[row.seed for row in rows],
            counters=[len(row.generated) for row in rows],
            min_p=[p.min_p for p in params],
        )

    @staticmethod
    def _named_tokens(params: SamplingParams) -> list[int]:
        return [token for token, _ in params.logit_bias] + list(params.stop_token_ids)

    def _free_finished(self) -> None:
        for row in self.active_rows:
            if row.finished:
                self._free(row)

    def _free(self, row: Row) -> None:
        """The row is free; it keeps its tokens' keys and values for a prompt that starts the same,
        unless its request failed (they may be half written)."""
        self.rows[row.index] = None
        self.grammars.release(row.index)
        self.prefixes.release(row.index, () if row.finish_reason == "error" else row.cached_tokens)

    def _row_of(self, request_id: str) -> Row | None:
        return next((row for row in self.active_rows if row.request.request_id == request_id), None)

    def _reject(self, request: Submit, message: str) -> None:
        self.undelivered.append(Piece(request.request_id, "", "error", len(request.prompt_ids), 0, message))

    # Start-up and use from a Python shell.

    def warm_up(self) -> None:
        """One prefill and a few decode steps, so the first real request pays no first-call costs.

        Compiled decode steps compile here, once for each way torch.compile specializes their
        shapes: one row decoding, then two. On a GPU the decode steps' CUDA graphs are captured
        first, every bucket of rows and span, so that the steps below already replay them.
        """
        if self.runner is not None and self.runner.graphs is not None and self.runner.graphs.capture:
            self._capture_graphs()
        prompt = tuple(t for t in self.tokenizer("Warm up.").input_ids if t < self.vocab_size) or (0,)
        compiled = self.runner is not None and self.runner.compiled_decode is not None
        runs = [(3,), (3, 3)] if compiled and len(self.rows) > 1 else [(3,)]
        for lengths in runs:
            for i, length in enumerate(lengths):
                params = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True)
                self.submit(Submit(f"warm-up-{i}", prompt, params))
            while self.has_work:
                self.step()
        self.prefill_budget.forget()  # first-call costs are no measure of a step

    def _capture_graphs(self) -> None:
        """Capture the decode steps' CUDA graphs; a model whose step cannot be captured (an operation
        that waits for the host, say) is served with eager steps instead, with a warning."""
        started = time.perf_counter()
        try:
            self.runner.graphs.capture_all()
        except Exception:
            log.exception("CUDA graphs could not be captured: decode steps run eagerly")
            self.runner.graphs = None
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # what capture left queued ends before the steps start
            return
        count, took = len(self.runner.graphs.graphs), time.perf_counter() - started
        log.info("captured %d CUDA graphs of decode steps in %.1f s", count, took)

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
