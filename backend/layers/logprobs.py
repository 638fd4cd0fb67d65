"""Log-probabilities of chosen tokens and their most likely alternatives, from raw logits.

They are the model's own distribution, log_softmax of the logits before
penalties, temperature and top-k/top-p/min-p cuts (vLLM's default), so
that scores do not depend on how a request samples.
"""

from __future__ import annotations

import torch

from backend.messages import TokenLogprob

# Positions turned into float32 log-probabilities at a time: a 2,000-token prompt over a
# 150,000-token vocabulary would otherwise take over a gigabyte at once.
CHUNK = 256


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, tops: list[int]) -> list[TokenLogprob]:
    """[n, vocab] logits and the [n] tokens chosen at them: each token's logprob and the tops[i]
    most likely tokens at position i."""
    entries: list[TokenLogprob] = []
    widest = max(tops, default=0)
    for start in range(0, logits.shape[0], CHUNK):
        logprobs = logits[start : start + CHUNK].float().log_softmax(dim=-1)
        chosen = logprobs.gather(-1, tokens[start : start + CHUNK, None])
        ranks = (logprobs >= chosen).sum(dim=-1)
        top_values, top_ids = logprobs.topk(widest, dim=-1)
        for token, logprob, rank, ids, values, top in zip(
            tokens[start : start + CHUNK].tolist(),
            chosen[:, 0].tolist(),
            ranks.tolist(),
            top_ids.tolist(),
            top_values.tolist(),
            tops[start : start + CHUNK],
            strict=True,
        ):
            alternatives = tuple(zip(ids[:top], values[:top], strict=True))
            entries.append(TokenLogprob(token, logprob, alternatives, rank))
    return entries
