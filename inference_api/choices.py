"""Several requests that answer one API call (OpenAI's `n`, or a list of prompts), read as one.

Each choice is its own request in its own row; their pieces arrive on one
shared queue, so the request thread blocks on that queue alone and passes
each piece on in the order the backend produced them.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator

from backend.messages import Piece, SamplingParams
from inference_api.request_stream import RequestStream, wait_for_piece
from inference_api.router import Router


class Choices:
    def __init__(
        self,
        router: Router,
        requests: list[tuple[list[int], SamplingParams]],
        team: str | None = None,
        cache_salt: str | None = None,
        adapter: str = "",
    ):
        """Open every request, or none: on NotReady or QueueFull the ones already opened are closed.
        `team`, `cache_salt`: whose usage they are and whose cached prefixes they share; `adapter`: the
        LoRA adapter that answers them (Router.open)."""
        self._pieces: queue.SimpleQueue[Piece] = queue.SimpleQueue()
        self.streams: list[RequestStream] = []
        try:
            for prompt_ids, params in requests:
                self.streams.append(router.open(prompt_ids, params, self._pieces, team, cache_salt, adapter))
        except BaseException:
            self.close()
            raise
        self._index = {stream.request_id: i for i, stream in enumerate(self.streams)}
        self._open = len(self.streams)

    def __iter__(self) -> Iterator[tuple[int, Piece]]:
        return self.pieces()

    def pieces(self, while_waiting: Callable[[], None] | None = None) -> Iterator[tuple[int, Piece]]:
        """(choice index, piece) until every choice has finished; `while_waiting` as in
        RequestStream.next_piece."""
        while self._open:
            piece = wait_for_piece(self._pieces, while_waiting)
            index = self._index[piece.request_id]
            self.streams[index].observe(piece)
            if piece.finished:
                self._open -= 1
            yield index, piece

    @property
    def prompt_tokens(self) -> int:
        return sum(stream.prompt_tokens for stream in self.streams)

    @property
    def cached_tokens(self) -> int:
        return sum(stream.cached_tokens for stream in self.streams)

    @property
    def completion_tokens(self) -> int:
        return sum(stream.completion_tokens for stream in self.streams)

    @property
    def prediction_tokens(self) -> tuple[int, int]:
        """The draft tokens the request's prediction gave its choices, and those of them that stood."""
        streams = self.streams
        return sum(s.predicted_tokens for s in streams), sum(s.accepted_predicted_tokens for s in streams)

    def waiting(self) -> bool:
        """Whether a piece is already queued: reading the next one will not wait."""
        return not self._pieces.empty()

    def close(self) -> None:
        """End every choice; those still running are cancelled (their rows free at the next step)."""
        for stream in self.streams:
            stream.close()
