"""A backend with no model and no torch, for developing and testing the frontend.

It speaks the same messages as the real backend, keeps the same number of
rows with a waiting line, honours max_tokens, stop sequences and cancellation,
and writes deterministic text at `mock_tokens_per_second` tokens per row.
"""

from __future__ import annotations

import collections
import math
import multiprocessing
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from backend.engine.inbox import read_inbox
from backend.engine.stop_matcher import StopMatcher
from backend.messages import (
    HEARTBEAT_SECONDS,
    AdaptersChanged,
    BackendConfig,
    BackendReady,
    Cancel,
    LoadAdapter,
    Piece,
    Shutdown,
    StepOutput,
    Submit,
    UnloadAdapter,
)
from backend.model.sampling_defaults import sampling_defaults

MOCK_MAX_SEQ_LEN = 4096
MOCK_WORDS = [
    "lorem",
    "ipsum",
    "dolor",
    "sit",
    "amet",
    "consectetur",
    "adipiscing",
    "elit",
    "sed",
    "do",
    "eiusmod",
    "tempor",
    "incididunt",
    "ut",
    "labore",
    "et",
    "dolore",
    "magna",
    "aliqua",
]


def mock_embedding(prompt_ids: tuple[int, ...], size: int = 8) -> tuple[float, ...]:
    """A unit vector made from the prompt: the same prompt, the same vector (the mock has no model)."""
    seed = sum((j + 1) * (token + 1) for j, token in enumerate(prompt_ids))
    raw = [math.sin(seed + i) for i in range(size)]
    norm = math.sqrt(sum(x * x for x in raw))
    return tuple(x / norm for x in raw)


def mock_token(prompt_ids: tuple[int, ...], index: int) -> str:
    """The `index`-th token of the mock answer to a prompt: a word and a space."""
    start = sum(prompt_ids) % len(MOCK_WORDS)
    return MOCK_WORDS[(start + index) % len(MOCK_WORDS)] + " "


def mock_text(prompt_ids: tuple[int, ...], n_tokens: int) -> str:
    """The whole mock answer of n_tokens tokens (before stop sequences)."""
    return "".join(mock_token(prompt_ids, i) for i in range(n_tokens))


@dataclass
class MockRow:
    request: Submit
    queued: float = 0.0  # seconds it waited for its row (Piece.queued_seconds)
    stop: StopMatcher = field(init=False)
    generated: int = 0

    def __post_init__(self) -> None:
        params = self.request.params
        self.stop = StopMatcher(params.stop, params.include_stop_str_in_output)

    def next_piece(self) -> Piece:
        if self.request.params.embedding is not None:
            vector = mock_embedding(self.request.prompt_ids)
            return Piece(self.request.request_id, "", "stop", len(self.request.prompt_ids), embedding=vector)
        if self.request.params.max_tokens == 0:  # a prompt only scored: the mock has no scores to give
            return Piece(self.request.request_id, "", "length", prompt_tokens=len(self.request.prompt_ids))
        self.generated += 1
        text = self.stop.feed(mock_token(self.request.prompt_ids, self.generated - 1))
        finish = None
        if self.stop.stopped:
            finish = "stop"
        elif self.generated >= self.request.params.max_tokens:
            finish = "length"
            text += self.stop.flush()
        return Piece(
            self.request.request_id,
            text,
            finish,
            prompt_tokens=len(self.request.prompt_ids),
            completion_tokens=self.generated,
            stop_sequence=self.stop.matched,
            queued_seconds=self.queued,
        )


def refusal(request: Submit, max_seq_len: int) -> Piece | None:
    """The error piece of a request the real engine refuses as the request's own fault (Engine.submit),
    for the prompts the mock can judge; None for one it takes. It has no grammars to judge."""
    prompt_tokens = len(request.prompt_ids)
    if prompt_tokens == 0:
        message = "the prompt is empty"
    elif prompt_tokens >= max_seq_len:
        message = f"the prompt has {prompt_tokens} tokens; the context holds {max_seq_len}"
    else:
        return None
    return Piece(request.request_id, "", "error", prompt_tokens, error=message, invalid="prompt_ids")


def mock_adapters_change(
    adapters: list[str], change: LoadAdapter | UnloadAdapter, config: BackendConfig
) -> AdaptersChanged:
    """A LoRA adapter loaded or unloaded as the engine would, by name alone: the mock answers every
    request as the model, reading no weights."""
    error = None
    runtime = config.runtime_lora
    if not runtime:
        error = "adapters are loaded and unloaded while running only with --allow-runtime-lora"
    elif isinstance(change, LoadAdapter) and change.name in adapters:
        if not change.replace:
            error = f"a LoRA adapter named {change.name!r} is already loaded"
    elif isinstance(change, LoadAdapter) and len(adapters) >= (config.max_loras or math.inf):
        error = f"{len(adapters)} LoRA adapters are loaded, the most --max-loras allows"
    elif isinstance(change, UnloadAdapter) and change.name not in adapters:
        error = f"no LoRA adapter {change.name!r} is loaded"
    elif isinstance(change, LoadAdapter) and change.name not in adapters:
        adapters.append(change.name)
    elif isinstance(change, LoadAdapter):
        pass  # reloaded in place: the mock reads no weights
    else:
        adapters.remove(change.name)
    unknown = isinstance(change, UnloadAdapter) and runtime and error is not None
    return AdaptersChanged(change.request_id, tuple(adapters), error, not_found=unknown)


def serve_mock(config: BackendConfig, inbox: multiprocessing.Queue, outbox: Connection) -> None:
    max_seq_len = config.max_seq_len or MOCK_MAX_SEQ_LEN
    adapters = [name for name, _ in config.lora_modules + config.lora_modules_loaded]  # answered as the model
    outbox.send(
        BackendReady(
            model_name="mock",
            rows=config.rows,
            max_seq_len=max_seq_len,
            tokenizer_path=None,
            device="none",
            dtype="none",
            adapters=tuple(adapters),
            # No model's file here: --override-generation-config's alone (or a directory's, named)
            sampling_defaults=sampling_defaults(
                None, config.generation_config, dict(config.override_generation_config)
            ),
        )
    )
    interval = 1.0 / config.mock_tokens_per_second
    rows: dict[str, MockRow] = {}
    waiting: collections.OrderedDict[str, tuple[Submit, float]] = collections.OrderedDict()  # and its coming
    next_tick = last_sent = time.monotonic()
    while True:
        idle = not rows and not waiting
        timeout = HEARTBEAT_SECONDS if idle else max(0.0, next_tick - time.monotonic())
        pieces, admitted = [], []
        for message in read_inbox(inbox, timeout):
            if isinstance(message, Shutdown):
                return
            if isinstance(message, Submit):
                if (
                    config.mock_stall_text is not None
                    and bytes(message.prompt_ids) == config.mock_stall_text.encode()
                ):
                    stall_for_good()
                if (refused := refusal(message, max_seq_len)) is not None:
                    pieces.append(refused)
                else:
                    waiting[message.request_id] = message, time.monotonic()
            elif isinstance(message, Cancel):
                cancelled = rows.pop(message.request_id, None) or waiting.pop(message.request_id, None)
                if cancelled is not None:
                    pieces.append(Piece(message.request_id, "", "cancelled"))
            elif isinstance(message, LoadAdapter | UnloadAdapter):
                outbox.send(mock_adapters_change(adapters, message, config))
        if idle and waiting:
            next_tick = time.monotonic()
        if time.monotonic() >= next_tick and (rows or waiting):
            while waiting and len(rows) < config.rows:
                request_id, (request, came) = waiting.popitem(last=False)
                rows[request_id] = MockRow(request, time.monotonic() - came)
                admitted.append(request_id)
            for request_id, row in list(rows.items()):
                piece = row.next_piece()
                if piece.text or piece.finished:
                    pieces.append(piece)
                if piece.finished:
                    del rows[request_id]
            next_tick += interval
        if pieces or admitted or time.monotonic() - last_sent >= HEARTBEAT_SECONDS:
            outbox.send(StepOutput(pieces, admitted))
            last_sent = time.monotonic()


def stall_for_good() -> None:
    """A backend stuck in a step (a kernel that never returns): no more steps, no heartbeat."""
    while True:
        time.sleep(3600)
