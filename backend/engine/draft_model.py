"""A draft model: a small model of the served model's vocabulary guesses each drafting row's next tokens.

Prompt lookup (prompt_lookup.py) guesses only text that came before; a
small model of the same family (SmolLM2-135M for a larger SmolLM2, a 1B
Llama for an 8B) guesses free text too, at the cost of running it: a
draft of k tokens takes k forward passes of the small model, each over
every drafting row at once (vLLM's and llama-server's `--draft-model`).

Its guesses are its greedy tokens, one guess a position, so the verifier
is prompt lookup's (speculation.verified): greedy and seeded output is
plain decoding's token for token, and unseeded tokens come from the served
model's own distribution, a guess standing with probability p(guess), the
speculative-sampling papers' rejection rule for a draft that is a single
guess. (Their rule for a sampled draft accepts more often; it needs the
draft's probabilities beside the verifier's, and keeps no seeded output.)

The draft model has a row cache of its own, a row for each of the
engine's, and `held[row]` says which tokens' keys and values that row
holds. Each step a drafting row catches up: its tokens past the longest
prefix of them held (those taken since its last draft, or a new request's
prompt) run as a chunk, whose last position gives the first guess; each
further guess is a decode step of the rows whose drafts are longer. A
guess the served model rejected is dropped as the served model's cache
drops it: `held` ends before it, and the next write goes over it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from backend.model.model_runner import ModelRunner
from backend.quant.quantized_linear import resident_bytes

log = logging.getLogger(__name__)

# The most tokens the draft's rows catch up in a step, all rows together: new requests' prompts go into the
# draft's cache a chunk a step (a row drafts once its prompt is all in), so that no step waits for whole
# prompts' passes; rows that took their draft's guesses catch up a few tokens each, 9 at most.
CATCH_UP_TOKENS = 512


@dataclass(frozen=True)
class Guessing:
    """A row to draft for: its index, its tokens so far and how many to guess after them."""

    index: int
    tokens: tuple[int, ...]
    count: int


@dataclass(frozen=True)
class _Chunk:  # step_inputs.PrefillingRow: a row's tokens past what its draft row holds
    index: int
    cached: int
    chunk_end: int
    prompt_ids: tuple[int, ...]
    scores_prompt: bool = False
    as_queries: bool = False  # a chunk of the draft's pass of chunks alone


@dataclass(frozen=True)
class _Query:  # step_inputs.DecodingRow: a guess fed back for the next
    index: int
    position: int
    next_input: int
    draft: tuple[int, ...] = ()


class DraftModel:
    """The draft model, its row cache and what each of its rows holds."""

    def __init__(
        self,
        model: PreTrainedModel,
        rows: int,
        max_seq_len: int,
        vocab_size: int,
        kv_cache_dtype: torch.dtype | None = None,
        cuda_graphs: bool = True,
    ):
        self.runner = ModelRunner(model.eval(), rows, max_seq_len, kv_cache_dtype, cuda_graphs=cuda_graphs)
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size  # the served model's: a guess past it cannot be verified
        self.held: list[tuple[int, ...]] = [()] * rows

    def cost_against(self, served: PreTrainedModel) -> float:
        """What a draft token costs in the draft model's pass, as a share of the served model's one-row
        step: its weights' bytes against the served model's (a one-row step reads them all, but not the
        copies kept for steps of many rows)."""
        return one_row_bytes(self.runner.model) / one_row_bytes(served)

    def propose(self, rows: Sequence[Guessing]) -> list[tuple[int, ...]]:
        """Each row's guesses, up to its `count` (fewer where the draft's context ends, none while a long
        prompt still catches up). A pass that fails drafts nothing this step: the rows decode as without
        drafts, and their draft rows start again."""
        try:
            return self._guess(rows)
        except Exception:
            log.exception("the draft model's pass failed: no drafts this step")
            for row in rows:
                self.held[row.index] = ()
            return [() for _ in rows]

    @torch.inference_mode()
    def _guess(self, rows: Sequence[Guessing]) -> list[tuple[int, ...]]:
        counts = [min(row.count, self.max_seq_len - 1 - len(row.tokens)) for row in rows]
        chunks, budget = [], CATCH_UP_TOKENS
        for row, count in zip(rows, counts, strict=True):
            if count > 0 and budget > 0:
                held = common_prefix(self.held[row.index], row.tokens, len(row.tokens) - 1)
                end = min(len(row.tokens), held + budget)
                budget -= end - held
                chunks.append(_Chunk(row.index, held, end, row.tokens))
                self.held[row.index] = row.tokens[:end]
        guesses: dict[int, list[int]] = {}
        if chunks:
            inputs = self.runner.prepare([], chunks)
            firsts = self.runner.run(inputs).argmax(dim=-1).tolist()
            guesses = {index: [token] for index, token in zip(inputs.completing, firsts, strict=True)}
        wanted = {row.index: count for row, count in zip(rows, counts, strict=True)}
        while going := sorted(index for index, tokens in guesses.items() if len(tokens) < wanted[index]):
            queries = [_Query(index, len(self.held[index]), guesses[index][-1]) for index in going]
            tokens = self.runner.run(self.runner.prepare(queries, [])).argmax(dim=-1).tolist()
            for index, token in zip(going, tokens, strict=True):
                self.held[index] += (guesses[index][-1],)
                guesses[index].append(token)
        return [self._verifiable(guesses.get(row.index, ())) for row in rows]

    def _verifiable(self, guesses: Sequence[int]) -> tuple[int, ...]:
        """The guesses up to the first the served model has no logit for (a draft vocabulary padded
        further than the served model's)."""
        cut = next((i for i, token in enumerate(guesses) if token >= self.vocab_size), len(guesses))
        return tuple(guesses[:cut])


def one_row_bytes(model: PreTrainedModel) -> int:
    """The bytes of the weights a one-row step reads."""
    resident = resident_bytes(model)
    return resident["quantized"] + resident["floats"]


def common_prefix(held: Sequence[int], tokens: Sequence[int], most: int) -> int:
    """How many first tokens `held` and `tokens` share, at most `most`."""
    length = 0
    for a, b in zip(held[:most], tokens[:most], strict=False):
        if a != b:
            break
        length += 1
    return length
