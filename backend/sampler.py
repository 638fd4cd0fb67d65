"""Per-row sampling: greedy, temperature, top-k, top-p and seed, all rows in one pass.

Each function is pure and works on a batch of rows ([rows, vocab]), so rows
with different settings share one step. Randomness comes from one generator
per row, drawn over the whole vocabulary, so that a seeded row samples the
same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """The sampling settings of the rows in one step, as tensors."""

    temperature: torch.Tensor  # [rows] float; 0 for greedy rows
    top_k: torch.Tensor  # [rows] long; 0 means no cut
    top_p: torch.Tensor  # [rows] float in (0, 1]
    generators: list[torch.Generator | None]  # None for greedy rows

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature == 0


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature (greedy rows, temperature 0, are left as they are)."""
    safe = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return logits / safe.unsqueeze(-1)


def top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate tokens of each row, best first, with the cut ones at -inf.

    Returns (values, token_ids), both [rows, k] where k is the largest top_k in
    the batch (the whole vocabulary if a row has no top-k cut). A token stays
    if it is within its row's top_k and the probability mass ranked above it
    is still under top_p, so the most likely token always stays.
    """
    vocab = logits.shape[-1]
    k_for_row = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    k = int(k_for_row.max())
    values, token_ids = logits.topk(k, dim=-1)
    rank = torch.arange(k, device=logits.device)
    values = values.masked_fill(rank.unsqueeze(0) >= k_for_row.unsqueeze(-1), float("-inf"))
    probs = values.softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs
    values = values.masked_fill(mass_above >= top_p.unsqueeze(-1), float("-inf"))
    return values, token_ids


def exponential_noise(
    generators: list[torch.Generator | None], vocab: int, device: torch.device
) -> torch.Tensor:
    """One Exp(1) draw per row and token from that row's own generator (ones for greedy rows)."""
    noise = torch.ones(len(generators), vocab, device=device)
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return noise


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The next token of every row: [rows, vocab] logits to [rows] token ids."""
    logits = logits.float()
    greedy_tokens = logits.argmax(dim=-1)
    if bool(batch.greedy.all()):
        return greedy_tokens
    values, token_ids = top_k_top_p(apply_temperature(logits, batch.temperature), batch.top_k, batch.top_p)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p. Reading the
    # noise at each candidate's token id keeps it independent of the batch.
    noise = exponential_noise(batch.generators, logits.shape[-1], logits.device).gather(-1, token_ids)
    choice = (values.softmax(dim=-1) / noise).argmax(dim=-1, keepdim=True)
    sampled_tokens = token_ids.gather(-1, choice).squeeze(-1)
    return torch.where(batch.greedy, greedy_tokens, sampled_tokens)
