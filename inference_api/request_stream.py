"""One request's view of the backend: its own queue of pieces, and its end.

The router thread is the only writer (`deliver`); the request thread is the
only reader (`next_piece`, iteration) and blocks on the queue, so a piece is
handed on the moment it arrives and no request sees another's pieces.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator

from backend.messages import Piece
from inference_api.client_watch import POLL_SECONDS
from inference_api.metrics import Metrics


def wait_for_piece(pieces: queue.SimpleQueue[Piece], while_waiting: Callable[[], None] | None) -> Piece:
    if while_waiting is None:
        return pieces.get()
    while True:
        try:
            piece = pieces.get(timeout=POLL_SECONDS)
        except queue.Empty:
            while_waiting()
            continue
        while_waiting()  # pieces may come faster than the poll: it keeps its own pace
        return piece


class RequestStream:
    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        metrics: Metrics,
        on_close: Callable[[RequestStream], None],
        pieces: queue.SimpleQueue[Piece] | None = None,
        team: str | None = None,
        adapter: str = "",
    ):
        self.request_id = request_id  # the backend's id, unique per request (not the client's X-Request-ID)
        self.adapter = adapter  # the LoRA adapter that answers it ("": the model)
        self.prompt_tokens = prompt_tokens
        self.team = team  # from the proxy's X-Team-ID (metrics.team_of); None without one
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the backend found in its cache
        self.queued_seconds: float | None = None  # its wait for a row (Piece.queued_seconds)
        self.draft_tokens = self.accepted_draft_tokens = 0  # speculative decoding's, so far
        self.predicted_tokens = self.accepted_predicted_tokens = 0  # of those, the request's prediction's
        self.finish_reason: str | None = None
        self.error: str | None = None
        # Set by the router thread when the backend says the request took a row (or with its first
        # piece): from then on it counts as active, not waiting.
        self.admitted = False
        # Its own queue, or one shared by the choices of one API call (see choices.py).
        # A SimpleQueue (C, one lock): queue.Queue's put, with its Python Condition's notify, was a tenth
        # of the worker's GIL-held time at thousands of tokens a second (docs/performance.md).
        self._pieces: queue.SimpleQueue[Piece] = pieces if pieces is not None else queue.SimpleQueue()
        self._metrics = metrics
        self._on_close = on_close
        self._opened_at = time.monotonic()
        self._last_text_at: float | None = None
        self._closed = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def deliver(self, piece: Piece) -> None:
        """Called by the router thread only."""
        self.admitted = True
        self._pieces.put(piece)

    def waiting(self) -> bool:
        """Whether a piece is already queued: reading the next one will not wait."""
        return not self._pieces.empty()

    def next_piece(self, while_waiting: Callable[[], None] | None = None) -> Piece:
        """The next piece, blocking until the backend has produced it; `while_waiting` is called
        meanwhile, at least every POLL_SECONDS, and with the piece (a client_watch.ClientWatch, which
        raises to stop waiting)."""
        piece = wait_for_piece(self._pieces, while_waiting)
        self.observe(piece)
        return piece

    def __iter__(self) -> Iterator[Piece]:
        while not self.finished:
            yield self.next_piece()

    def close(self) -> None:
        """End the request; if it has not finished, the router cancels it and the row frees next step.

        Idempotent: both the response generator and the WSGI close() call it.
        """
        if self._closed:
            return
        self._closed = True
        self._metrics.request_latency.observe(time.monotonic() - self._opened_at)
        # Counted here rather than at the last piece, so that cancelled requests count what they got.
        self._metrics.generated_tokens.inc(self.completion_tokens)
        self._metrics.count_team_usage(self.team, self.prompt_tokens, self.completion_tokens)
        self._metrics.request_prompt_tokens.observe(self.prompt_tokens)
        self._metrics.request_generation_tokens.observe(self.completion_tokens)
        ended = self.finish_reason if self.finish_reason in ("stop", "length", "error") else "abort"
        self._metrics.finished_requests.labels(finished_reason=ended).inc()
        self._on_close(self)

    def observe(self, piece: Piece) -> None:
        """Account for a piece read from the queue (next_piece does it; a shared queue's reader must)."""
        now = time.monotonic()
        if piece.text:
            if self._last_text_at is None:
                self._metrics.time_to_first_token.observe(now - self._opened_at)
            else:
                # A piece may carry several tokens (text held back at a stop sequence's start).
                tokens = max(1, piece.completion_tokens - self.completion_tokens)
                gap = (now - self._last_text_at) / tokens
                for _ in range(tokens):
                    self._metrics.inter_token_latency.observe(gap)
            self._last_text_at = now
        self.completion_tokens = max(self.completion_tokens, piece.completion_tokens)
        if piece.prompt_tokens:
            self.prompt_tokens = piece.prompt_tokens
        if piece.queued_seconds is not None and self.queued_seconds is None:
            self.queued_seconds = piece.queued_seconds
            self._metrics.request_queue_time.observe(piece.queued_seconds)
        if piece.cached_tokens > self.cached_tokens:
            self._metrics.cached_prompt_tokens.inc(piece.cached_tokens - self.cached_tokens)
            self.cached_tokens = piece.cached_tokens
        if piece.draft_tokens > self.draft_tokens:
            self._metrics.draft_tokens.inc(piece.draft_tokens - self.draft_tokens)
            self._metrics.accepted_draft_tokens.inc(piece.accepted_draft_tokens - self.accepted_draft_tokens)
            self.draft_tokens, self.accepted_draft_tokens = piece.draft_tokens, piece.accepted_draft_tokens
            self.predicted_tokens = piece.predicted_tokens
            self.accepted_predicted_tokens = piece.accepted_predicted_tokens
        if piece.finished:
            self.finish_reason = piece.finish_reason
            self.error = piece.error
