"""The router: owns the backend process, and hands each piece it writes to the request it belongs to.

One thread (`router_thread`) starts the backend, waits for BackendReady, then
reads every StepOutput and puts each Piece on the queue of its request. When
the backend dies it ends every request in flight with an error, marks the
server not ready and starts a new backend. Request threads call `open` to
submit a prompt and `RequestStream.close` to end it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import queue
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from backend.messages import (
    AdaptersChanged,
    BackendConfig,
    BackendReady,
    LoadAdapter,
    Piece,
    SamplingParams,
    Shutdown,
    StepOutput,
    UnloadAdapter,
    reserved_places,
)
from backend.process import BackendDied, BackendProcess, BackendStartError
from inference_api import (
    cohere_tool_calls,
    deepseek_tool_calls,
    listed_tool_calls,
    pythonic_tool_calls,
)
from inference_api.chat_template import ChatTemplate, load_chat_template
from inference_api.cohere_tool_calls import ActionTags
from inference_api.deepseek_tool_calls import DeepSeekTags
from inference_api.listed_tool_calls import ListTags
from inference_api.metrics import Metrics
from inference_api.mistral_tool_calls import CallTags
from inference_api.pythonic_tool_calls import PythonicTags
from inference_api.reasoning import (
    BLOCK_TAGS,
    HARMONY,
    HARMONY_PREFILLED,
    Blocks,
    Thinking,
    prompt_end,
    reasoning_format,
)
from inference_api.request_stream import RequestStream
from inference_api.tokenizer import (
    ModelTokenizer,
    PromptTokenizer,
    are_grammar_tokens,
    are_tokens,
    load_tokenizer,
)
from inference_api.tool_calls import (
    CALL_TAG_FORMATS,
    COHERE,
    DEEPSEEK_FORMATS,
    LFM2,
    LIST_FORMATS,
    NOTATIONS,
    TAGGED,
    XML_FORMATS,
    BlockTokens,
    FormatTags,
    block_tags,
    tool_parser,
)

log = logging.getLogger(__name__)

# The longest a request thread waits for the backend to load or unload an adapter: it does so between two
# steps, in a second or two; a backend that hangs meanwhile is killed after step_timeout, which ends the
# wait sooner.
ADAPTER_CHANGE_SECONDS = 600.0


def cache_scope(team: str | None, cache_salt: str | None) -> str:
    """The backend's cache scope of a request (messages.Submit): its team, as the proxy vouches for it
    (a client's own X-Team-ID never reaches here through the proxy), and its cache_salt. Requests without
    a team share with each other only. A team label holds no newline, so no two pairs give one scope."""
    return f"{team or ''}\n{cache_salt or ''}"


class NotReady(RuntimeError):
    """The backend is loading, restarting or has failed."""


class QueueFull(RuntimeError):
    """Every row is busy and max_queue requests already wait, or the request's team holds every place
    but those kept for other teams."""

    def __init__(self, message: str = "every row is busy and the queue is full"):
        super().__init__(message)


class BackendHung(BackendDied):
    """The backend sent nothing, not even its heartbeat, for step_timeout seconds: it was killed."""


@dataclass(frozen=True)
class Serving:
    """What a ready backend serves, and the tokenizer that goes with it."""

    backend: BackendReady
    tokenizer: PromptTokenizer
    chat_template: ChatTemplate
    names: tuple[str, ...] = ()  # --served-model-name; () serves the model under the backend's name
    # The --embedding-model's own tokenizer (BackendReady.embedding_model); None: the served model embeds
    embedding_tokenizer: PromptTokenizer | None = None
    # The --rerank-model's own tokenizer (BackendReady.rerank_model), which joins a query and a document
    rerank_tokenizer: ModelTokenizer | None = None
    # How chat answers' thoughts are read apart (reasoning.reasoning_format): BLOCK_TAGS' kinds, HARMONY, None
    reasoning_format: str | None = None
    tool_call_parser: str = "auto"  # --tool-call-parser: a format for the calls, or auto (the template's)

    def sampling_default(self, name: str, api_default: float) -> float:
        """The default of sampling field `name` (vLLM's names) where a request of the OpenAI, Responses or
        Anthropic API leaves it out: the model's recommendation (--generation-config), else the API's."""
        return self.backend.sampling_defaults.get(name, api_default)

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name requests may call the model by: /v1/models lists them in this order."""
        return self.names or (self.backend.model_name,)

    @property
    def model_name(self) -> str:
        """The name responses, /ready and the chat page give the model: the first served name."""
        return self.served_names[0]

    def serves(self, name: str) -> bool:
        return name in self.generating_names

    @property
    def generating_names(self) -> tuple[str, ...]:
        """The names the generating endpoints answer to: the model's, then its LoRA adapters'."""
        return self.served_names + self.backend.adapters

    @property
    def embedding_names(self) -> tuple[str, ...]:
        """The names /v1/embeddings answers to: the --embedding-model's, else the served model's."""
        embedding = self.backend.embedding_model
        return (embedding.name,) if embedding is not None else self.served_names

    @property
    def rerank_names(self) -> tuple[str, ...]:
        """The names /v1/rerank answers to: the --rerank-model's; () where there is none."""
        rerank = self.backend.rerank_model
        return (rerank.name,) if rerank is not None else ()

    def name_clash(self) -> str | None:
        """Why these names cannot be served apart (an alias that is also the embedding or rerank model's
        name, or those two of one name)."""
        names = [(name, "a --served-model-name") for name in self.served_names]
        for adapter in self.backend.adapters:
            taken = next((what for name, what in names if name == adapter), None)
            if taken is not None:
                return f"the name {adapter!r} is both {taken} and a --lora-modules adapter's"
            names.append((adapter, "a --lora-modules adapter's"))
        for model, option in (
            (self.backend.embedding_model, "--embedding-model"),
            (self.backend.rerank_model, "--rerank-model"),
        ):
            if model is None:
                continue
            taken = next((what for name, what in names if name == model.name), None)
            if taken is not None:
                return (
                    f"the name {model.name!r} is both {taken} and the {option}'s: "
                    "requests naming it could not tell the two models apart"
                )
            names.append((model.name, f"the {option}'s"))
        return None

    def unreadable(self) -> str | None:
        """Why the parsers named for this model cannot read its answers: their tags, special tokens, are
        not tokens of its tokenizer (no grammar could name them, no answer would hold them)."""
        tags = BLOCK_TAGS.get(self.reasoning_format)
        if tags is not None and tags.special and not are_tokens((tags.opening, tags.close), self.tokenizer):
            return (
                f"--reasoning-parser reads thoughts between {tags.opening} and {tags.close} tokens, which "
                "this model's tokenizer does not have"
            )
        notation = NOTATIONS.get(self.tool_parser)
        if notation is not None and not notation.has_tags(self.tokenizer):
            return (
                f"--tool-call-parser {notation.name} reads calls between {notation.family}'s {notation.open} "
                f"and {notation.close} tokens, which this model's tokenizer does not have"
            )
        opening = CALL_TAG_FORMATS.get(self.tool_parser)
        if opening is not None and self.call_tags is None:
            return (
                f"--tool-call-parser {self.tool_parser} reads calls after a {opening} token, which this "
                "model's tokenizer does not have"
            )
        if self.tool_parser in LIST_FORMATS and self.call_tags is None:
            opening, closing = listed_tool_calls.LISTS[self.tool_parser]
            return (
                f"--tool-call-parser {self.tool_parser} reads calls between {opening} and {closing} tokens, "
                "which this model's tokenizer does not have"
            )
        if self.tool_parser == LFM2 and self.call_tags is None:
            return (
                f"--tool-call-parser lfm2 reads calls between {pythonic_tool_calls.OPEN} and "
                f"{pythonic_tool_calls.CLOSE} tokens, which this model's tokenizer does not have"
            )
        if self.tool_parser == COHERE and self.call_tags is None:
            return (
                f"--tool-call-parser {COHERE} reads calls and answers between Cohere's "
                f"{' '.join(cohere_tool_calls.TAGS)} tokens, which this model's tokenizer does not have"
            )
        if self.tool_parser in DEEPSEEK_FORMATS and self.call_tags is None:
            return (
                f"--tool-call-parser {self.tool_parser} reads calls between DeepSeek's "
                f"{' '.join(deepseek_tool_calls.TAGS)} tokens, which this model's tokenizer does not have"
            )
        return None

    @property
    def reads_reasoning(self) -> bool:
        """Whether chat answers' thoughts come apart from their content (reasoning_content)."""
        return self.reasoning_format is not None

    @cached_property
    def tool_parser(self) -> str:
        """How chat answers are read for tool calls (tool_calls.tool_parser): the same for every request,
        found once."""
        harmony = self.reasoning_format == HARMONY
        return tool_parser(self.chat_template.source, harmony, self.tokenizer, self.tool_call_parser)

    @cached_property
    def call_tags(self) -> FormatTags | None:
        """The tokenizer's tags for Mistral's, Granite's, DeepSeek's, LFM2's, the JSON lists' or Cohere's
        calls, which their grammar names by id, or BlockTokens where the `<tool_call>` blocks' tags are
        tokens that llguidance takes as special; None for another format, or without them."""
        if self.tool_parser in TAGGED:
            form = XML_FORMATS.get(self.tool_parser)
            opening, closing = block_tags(self.tool_parser)
            tags = (opening, closing, *(form.tags if form else ()))
            tokens = frozenset(tag for tag in tags if are_grammar_tokens((tag,), self.tokenizer))
            special = self.tokenizer.special_token_id(opening) is not None
            return BlockTokens(tokens, special) if tokens else None
        if self.tool_parser in DEEPSEEK_FORMATS:
            return DeepSeekTags.of(self.tokenizer, self.tool_parser)
        if self.tool_parser == LFM2:
            return PythonicTags.of(self.tokenizer)
        if self.tool_parser == COHERE:
            return ActionTags.of(self.tokenizer)
        if self.tool_parser in LIST_FORMATS:
            return ListTags.of(self.tokenizer, self.tool_parser)
        opening = CALL_TAG_FORMATS.get(self.tool_parser)
        return None if opening is None else CallTags.of(self.tokenizer, opening)

    @cached_property
    def thought_tags_are_tokens(self) -> bool:
        """Whether the thought blocks' tags are tokens that llguidance takes as special (Blocks.tokens)."""
        tags = BLOCK_TAGS.get(self.reasoning_format)
        return tags is not None and are_grammar_tokens((tags.opening, tags.close), self.tokenizer)

    def prompt_thinking(self, prompt_ids: list[int], prefilled: bool = False) -> Thinking | None:
        """For a chat prompt: where it leaves a reasoning model's thought blocks (reasoning.Blocks),
        HARMONY for a model that writes them as harmony messages (HARMONY_PREFILLED where a prefill ended
        the prompt in the answer's message); None where answers are not read for thoughts."""
        tags = BLOCK_TAGS.get(self.reasoning_format)
        if tags is not None:
            return Blocks(tags, prompt_end(prompt_ids, self.tokenizer, tags), self.thought_tags_are_tokens)
        if self.reasoning_format == HARMONY and prefilled:
            return HARMONY_PREFILLED
        return self.reasoning_format

    @property
    def token_id_limit(self) -> int:
        """Prompt token ids must be below this: in the tokenizer and in the model's embedding."""
        return min(self.tokenizer.vocab_size, self.backend.vocab_size or self.tokenizer.vocab_size)


def adapters_after(config: BackendConfig, change: LoadAdapter | UnloadAdapter | None) -> BackendConfig:
    """The backend's configuration with an adapter loaded or unloaded while running, for a restart."""
    if change is None:
        return config
    without = dataclasses.replace(  # an adapter unloaded, or the one a load in place replaced
        config,
        lora_modules=tuple(module for module in config.lora_modules if module[0] != change.name),
        lora_modules_loaded=tuple(m for m in config.lora_modules_loaded if m[0] != change.name),
    )
    if isinstance(change, LoadAdapter):
        loaded = (*without.lora_modules_loaded, (change.name, change.path))
        return dataclasses.replace(without, lora_modules_loaded=loaded)
    return without


class Router:
    def __init__(
        self,
        backend_config: BackendConfig,
        max_queue: int,
        metrics: Metrics,
        restart_delay: float = 1.0,
        step_timeout: float = 60.0,
        on_ready: Callable[[Serving], None] | None = None,
        on_fatal: Callable[[str], None] | None = None,
        served_model_names: tuple[str, ...] = (),
        chat_template: str | None = None,
        reasoning_parser: str = "auto",
        tool_call_parser: str = "auto",
    ):
        self.backend_config = backend_config
        self.served_model_names = served_model_names
        self.chat_template = chat_template  # --chat-template: a file instead of the model's template
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = tool_call_parser
        self.max_queue = max_queue
        self.metrics = metrics
        self.restart_delay = restart_delay
        self.step_timeout = step_timeout
        self.restart_reason: str | None = None  # why the backend is being restarted, for /ready
        self.on_ready = on_ready
        self.on_fatal = on_fatal
        self.failure: str | None = None  # why the backend could not start, once it could not
        self._lock = threading.Lock()  # guards the three fields below
        self._streams: dict[str, RequestStream] = {}
        self._serving: Serving | None = None
        self._backend: BackendProcess | None = None
        # LoRA adapters being loaded or unloaded (--allow-runtime-lora): each change, and where its answer
        # goes (None: the backend stopped before answering)
        self._adapter_changes: dict[str, tuple[LoadAdapter | UnloadAdapter, queue.Queue]] = {}
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self.router_thread, name="router", daemon=True)
        metrics.watch_rows(self.active_rows, self.waiting_requests)

    # Life cycle, called by the app and by gunicorn's hooks.

    def start(self) -> Router:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        with self._lock:
            backend = self._backend
        if backend is not None:
            # Only ask: the router thread sees the process exit and cleans up after it.
            with contextlib.suppress(ValueError, OSError):
                backend.inbox.put(Shutdown())
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive() and backend is not None:
            log.warning("backend did not stop in %.0f s; killing it", timeout)
            backend.process.kill()
            self._thread.join(timeout)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def end_requests(self, reason: str) -> None:
        """End every request in flight with an error saying why (a 503 for one whose answer has not
        begun) and free its row: the worker calls it when its shutdown grace is nearly over."""
        with self._lock:
            streams, self._streams = self._streams, {}
            backend = self._backend
        for stream in streams.values():
            if backend is not None:
                with contextlib.suppress(ValueError, OSError):
                    backend.cancel(stream.request_id)
            stream.deliver(Piece(stream.request_id, "", "error", error=reason))

    # Called by request threads.

    @property
    def serving(self) -> Serving | None:
        """The ready backend's description, or None while it is not ready."""
        return self._serving

    def open(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        pieces: queue.SimpleQueue[Piece] | None = None,
        team: str | None = None,
        cache_salt: str | None = None,
        adapter: str = "",
    ) -> RequestStream:
        """Admit a request and submit it to the backend; raise NotReady or QueueFull (both 503).

        `pieces`: a queue shared with other requests of the same API call, instead of its own.
        `team`: whose usage it is, for the metrics (metrics.team_of), and whose cached prefixes it may
        reuse, those of requests with the same `cache_salt` (`cache_scope`). `adapter`: the LoRA
        adapter its `model` names ("": the model itself).
        """
        with self._lock:
            if self._serving is None or self._backend is None:
                raise NotReady
            places = self._serving.backend.rows + self.max_queue
            if len(self._streams) >= places:
                raise QueueFull
            self._check_team_share(team, places)
            stream = RequestStream(
                uuid.uuid4().hex, len(prompt_ids), self.metrics, self._close_stream, pieces, team, adapter
            )
            self._streams[stream.request_id] = stream
            # Under the lock, so that a backend that dies cannot miss a request submitted meanwhile.
            scope = cache_scope(team, cache_salt)
            self._backend.submit(stream.request_id, prompt_ids, params, scope, team or "", adapter)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return stream

    def change_adapters(self, change: LoadAdapter | UnloadAdapter) -> AdaptersChanged:
        """Load or unload a LoRA adapter (--allow-runtime-lora) and wait for the backend's answer; the
        names requests may call change with it. NotReady (a 503) where no backend is ready, or where it
        stopped before answering."""
        answer: queue.Queue[AdaptersChanged | None] = queue.Queue(1)
        with self._lock:
            if self._serving is None or self._backend is None:
                raise NotReady
            self._adapter_changes[change.request_id] = change, answer
            self._backend.inbox.put(change)
        try:
            changed = answer.get(timeout=ADAPTER_CHANGE_SECONDS)
        except queue.Empty:
            changed = None  # the change stays listed: an answer that comes later still takes effect
        if changed is None:
            raise NotReady
        return changed

    def _check_team_share(self, team: str | None, places: int) -> None:
        """A team (behind the proxy) may not take the places kept for other teams: one that queued a
        flood of requests left every other team a 503 until it drained. Requests without a team (a
        server with no proxy in front) may take every place, as one user's."""
        if team is None:
            return
        most = places - reserved_places(places)
        held = sum(stream.team == team for stream in self._streams.values())
        if held >= most:
            raise QueueFull(
                f"your team holds {held} of the server's {places} places for requests; "
                f"the other {places - most} are kept for other teams"
            )

    def active_rows(self) -> int:
        with self._lock:
            return sum(stream.admitted for stream in self._streams.values())

    def waiting_requests(self) -> int:
        with self._lock:
            return sum(not stream.admitted for stream in self._streams.values())

    def adapters_in_use(self) -> tuple[list[str], list[str]]:
        """The LoRA adapters of the requests in rows, and of those waiting for one, each once, sorted."""
        with self._lock:
            streams = list(self._streams.values())
        running = sorted({stream.adapter for stream in streams if stream.adapter and stream.admitted})
        waiting = sorted({stream.adapter for stream in streams if stream.adapter and not stream.admitted})
        return running, waiting

    def _close_stream(self, stream: RequestStream) -> None:
        with self._lock:
            in_flight = self._streams.pop(stream.request_id, None) is not None
            if in_flight and self._serving is not None and self._backend is not None:
                # The client went away before the end: free its row at the backend's next step.
                self._backend.cancel(stream.request_id)

    # The router thread.

    def router_thread(self) -> None:
        was_ready = False
        while not self._stopping.is_set():
            backend = BackendProcess(self.backend_config).start()
            with self._lock:
                self._backend = backend
            failure = None
            try:
                self._become_ready(backend)
                was_ready = True
                self._route(backend)
            except BackendDied as exc:
                failure = None if was_ready else f"the backend died while starting: {exc}"
                if was_ready and not self._stopping.is_set():
                    log.error("%s; restarting it in %.1f s", exc, self.restart_delay)
                    self.restart_reason = str(exc)
            except BackendStartError as exc:
                failure = str(exc)
            except Exception as exc:  # a tokenizer that does not load, a bug: do not leave requests hanging
                log.exception("router thread failed")
                failure = f"{type(exc).__name__}: {exc}"
            finally:
                self._end_backend(backend, self.restart_reason or "the backend process stopped")
            if failure is not None:
                self._fail(failure)
                return
            if not self._stopping.wait(self.restart_delay):
                self.metrics.backend_restarts.inc()

    def _become_ready(self, backend: BackendProcess) -> None:
        ready = backend.wait_ready()
        embedding, rerank = ready.embedding_model, ready.rerank_model
        tokenizer = load_tokenizer(ready.tokenizer_path)
        chat_template = load_chat_template(ready.tokenizer_path, self.chat_template)
        serving = Serving(
            ready,
            tokenizer,
            chat_template,
            self.served_model_names,
            embedding_tokenizer=None if embedding is None else load_tokenizer(embedding.tokenizer_path),
            rerank_tokenizer=None if rerank is None else ModelTokenizer(rerank.tokenizer_path),
            reasoning_format=reasoning_format(self.reasoning_parser, tokenizer, chat_template.source),
            tool_call_parser=self.tool_call_parser,
        )
        for refusal in (serving.name_clash(), serving.unreadable()):
            if refusal is not None:
                raise BackendStartError(refusal)
        with self._lock:
            self._serving = serving
        self.restart_reason = None
        self.metrics.backend_ready.set(1)
        self._ready.set()
        log.info(
            "backend ready: model %s served as %s, %d rows of %d tokens, %s %s",
            ready.model_name,
            ", ".join(serving.generating_names),
            ready.rows,
            ready.max_seq_len,
            ready.device,
            ready.dtype,
        )
        if self.on_ready is not None:
            self.on_ready(serving)
        # What is loaded by now (transformers, the tokenizers, the templates) lives as long as the
        # process: out of the cycle collector's sight, a full collection reads only what requests made
        # instead of stalling every request thread for 60 ms (docs/frontend.md).
        gc.freeze()

    def _route(self, backend: BackendProcess) -> None:
        """Hand every piece to its request until the backend dies (BackendDied) or hangs (BackendHung:
        nothing for step_timeout seconds, though it sends at least a heartbeat every second)."""
        while True:
            try:
                message = backend.receive(self.step_timeout)
            except queue.Empty:
                backend.process.kill()
                raise BackendHung(
                    f"the backend made no step in {self.step_timeout:g} s; it was killed"
                ) from None
            if isinstance(message, StepOutput):
                self._admit(message.admitted)
                self._deliver(message.pieces)
            elif isinstance(message, AdaptersChanged):
                self._adapters_changed(message)
            else:
                log.warning("ignoring %s from a running backend", type(message).__name__)

    def _admit(self, request_ids: list[str]) -> None:
        """Requests that took a row: no longer waiting, though they have no piece yet."""
        with self._lock:
            for request_id in request_ids:
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.admitted = True

    def _deliver(self, pieces: list[Piece]) -> None:
        with self._lock:
            for piece in pieces:
                stream = self._streams.get(piece.request_id)
                if stream is None:
                    continue  # cancelled: its client has gone
                if piece.finished:
                    del self._streams[piece.request_id]
                stream.deliver(piece)

    def _adapters_changed(self, changed: AdaptersChanged) -> None:
        """The backend loaded or unloaded an adapter (or could not): requests may name the adapters it
        serves now, and a backend restarted after a crash serves them too."""
        with self._lock:
            change, answer = self._adapter_changes.pop(changed.request_id, (None, None))
            if changed.error is None and self._serving is not None:
                backend = dataclasses.replace(self._serving.backend, adapters=changed.adapters)
                self._serving = dataclasses.replace(self._serving, backend=backend)
                self.backend_config = adapters_after(self.backend_config, change)
        if changed.error is None:
            log.info("LoRA adapters served now: %s", ", ".join(changed.adapters) or "none")
        if answer is not None:
            answer.put(changed)

    def _end_backend(self, backend: BackendProcess, reason: str) -> None:
        """Not ready any more; every request in flight ends with an error saying why."""
        self._ready.clear()
        self.metrics.backend_ready.set(0)
        with self._lock:
            self._serving = None
            self._backend = None
            streams, self._streams = self._streams, {}
            changes, self._adapter_changes = self._adapter_changes, {}
        for stream in streams.values():
            stream.deliver(Piece(stream.request_id, "", "error", error=reason))
        for _, answer in changes.values():
            answer.put(None)
        backend.stop()

    def _fail(self, message: str) -> None:
        self.failure = message
        log.critical("the backend cannot serve: %s", message)
        if self.on_fatal is not None and not self._stopping.is_set():
            self.on_fatal(message)
