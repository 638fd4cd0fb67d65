"""Log-probabilities of chosen tokens and their most likely alternatives, from raw logits.

They are the model's own distribution, log_softmax of the logits before
penalties, temperature and top-k/top-p/min-p cuts (vLLM's default), so
that scores do not depend on how a request samples.
"""

from __future__ import annotations

import torch

from backend.messages import TokenLogprob

# Positions turned into float32 log-probabilities at a time. On a GPU many (a 2,000-token prompt over a
# 150,000-token vocabulary at once would take over a gigabyte); on a CPU as many as keep these bytes of
# float32 within its caches: each position is five passes over its row, which from memory cost three
# times what they cost from a cache (a scored chunk of 128 positions over 49,152 tokens: 34 ms as one,
# 11 ms 21 at a time; over 151,936 tokens 110 ms at 64, 42 ms at 6; a 2-core Xeon, 2026-12-06).
GPU_CHUNK = 256
CPU_CHUNK_BYTES = 4 * 2**20


def positions_at_a_time(logits: torch.Tensor) -> int:
    """How many of the [n, vocab] logits' positions `token_logprobs` takes at once."""
    if logits.device.type != "cpu":
        return GPU_CHUNK
    return max(1, CPU_CHUNK_BYTES // (logits.shape[-1] * 4))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, tops: list[int]) -> list[TokenLogprob]:
    """[n, vocab] logits and the [n] tokens chosen at them: each token's logprob and the tops[i]
    most likely tokens at position i."""
    entries: list[TokenLogprob] = []
    widest = max(tops, default=0)
    chunk = positions_at_a_time(logits)
    for start in range(0, logits.shape[0], chunk):
        logprobs = logits[start : start + chunk].float().log_softmax(dim=-1)
        chosen = logprobs.gather(-1, tokens[start : start + chunk, None])
        ranks = (logprobs >= chosen).sum(dim=-1)
        top_values, top_ids = logprobs.topk(widest, dim=-1)
        for token, logprob, rank, ids, values, top in zip(
            tokens[start : start + chunk].tolist(),
            chosen[:, 0].tolist(),
            ranks.tolist(),
            top_ids.tolist(),
            top_values.tolist(),
            tops[start : start + chunk],
            strict=True,
        ):
            alternatives = tuple(zip(ids[:top], values[:top], strict=True))
            entries.append(TokenLogprob(token, logprob, alternatives, rank))
    return entries
