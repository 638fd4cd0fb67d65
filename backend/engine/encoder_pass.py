"""Waiting inputs of a separate model (`--embedding-model`, `--rerank-model`) read in one padded pass
that goes a few layers a step (model/staged_pass.py), as many as the step's embedding budget pays for.

The budget is in tokens of a whole pass: a step of `budget` tokens runs `budget / tokens` of the
pass's layers, one at least. So a batch holds up to a budget's worth of tokens for each layer (the
oldest input at least, whatever its size; a row's worth at most), and where rows decode, a 418-token
pair of a 6-layer reranker goes a layer a step instead of holding the stream for all six.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from backend.messages import SCORE, Piece, Submit
from backend.model.embeddings import EmbeddingModel, embed, score
from backend.model.staged_pass import StagedPass, layers_of


def embedding_failed(request: Submit, error: Exception) -> Piece:
    message = f"embedding failed: {error}"
    return Piece(request.request_id, "", "error", len(request.prompt_ids), error=message)


class EncoderPass:
    """One pass of a separate model over a batch of its requests of one pooling (SCORE: pairs)."""

    def __init__(self, model: EmbeddingModel, requests: list[Submit]):
        self.requests = requests
        self.pooling = requests[0].params.embedding
        self.tokens = sum(len(request.prompt_ids) for request in requests)
        self.cancelled: set[str] = set()
        self.staged = StagedPass(self._forward(model.model), layers_of(model.model))

    @classmethod
    def of_waiting(
        cls, model: EmbeddingModel, waiting: Iterable[Submit], budget: int, ceiling: int
    ) -> EncoderPass:
        """A pass over the oldest of `waiting` (this model's, oldest first) and those after it of its
        pooling, up to `budget` tokens for each of the model's layers and `ceiling` tokens in all (a
        padded batch's attention grows with its inputs' lengths squared)."""
        waiting = list(waiting)
        pooling = waiting[0].params.embedding
        most = min(ceiling, max(1, budget) * max(1, len(layers_of(model.model))))
        batch, tokens = [], 0
        for request in waiting:
            size = len(request.prompt_ids)
            if request.params.embedding != pooling or (batch and tokens + size > most):
                continue
            batch.append(request)
            tokens += size
        return cls(model, batch)

    def holds(self, request_id: str) -> bool:
        return any(request.request_id == request_id for request in self.requests)

    def advance(self, budget: int) -> int:
        """Run as many of the pass's layers as `budget` tokens pay for; returns the tokens that was
        worth (for the budget's measure of what a token costs)."""
        layers = self.staged.layers
        run = max(1, budget * layers // max(1, self.tokens))
        before = self.staged.layers_run
        self.staged.advance(run)
        ran = min(layers, max(1, self.staged.layers_run - before))
        return self.tokens * ran // layers

    def pieces(self) -> list[Piece]:
        """Each request's answer once the pass is done: its vector, or its error; none for a cancelled
        one (its answer went when it was cancelled)."""
        answers = []
        for i, request in enumerate(self.requests):
            if request.request_id in self.cancelled:
                continue
            if self.staged.error is not None:
                answers.append(embedding_failed(request, self.staged.error))
                continue
            vector = tuple(self.staged.result[i].tolist())
            answers.append(Piece(request.request_id, "", "stop", len(request.prompt_ids), embedding=vector))
        return answers

    def _forward(self, model: torch.nn.Module) -> Callable[[], torch.Tensor]:
        """The pass itself: [requests, dimensions] vectors (SCORE: each pair's one logit)."""
        if self.pooling == SCORE:
            pairs = [(request.prompt_ids, request.params.pair_start) for request in self.requests]
            return lambda: score(model, pairs)[:, None]
        prompts = [request.prompt_ids for request in self.requests]
        return lambda: embed(model, prompts, self.pooling)
