"""Penalties and biases on each row's logits before sampling, for a batch of rows in a few operations.

As OpenAI and vLLM define them, for a row whose generated tokens hold t
c[t] times and whose prompt is P:

    logit_bias          l[t] += bias[t]
    allowed_token_ids   l[t] = -inf for every t not in the list
    bad_words           l[t] = -inf for a word's last token t when the row's last tokens are its others
    min_tokens          l[t] = -inf for EOS and stop_token_ids while fewer tokens were generated
    repetition_penalty  l[t] = l[t] / r if l[t] > 0 else l[t] * r, for t in P or with c[t] > 0
    frequency_penalty   l[t] -= f * c[t]
    presence_penalty    l[t] -= p * (c[t] > 0)

The penalties touch only tokens a row has seen, a few hundred of a
vocabulary of tens of thousands, so they work on each row's token history
(prompt then generated ids, [rows, max_seq_len] on the device, written at
admission and with every step's tokens): gather those logits, change them,
scatter them back. A pass over [rows, vocab] costs about half a
millisecond on a small CPU; the history is a hundred times smaller. Biases
are a dense [rows, vocab] table, added only to the rows that have one (a
row with allowed_token_ids has -inf in it for every other token). The
tensors are made at the first penalized request: a server whose clients
send none pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from backend.messages import SamplingParams


class LogitsProcessors:
    def __init__(self, rows: int, max_seq_len: int, vocab: int, device: torch.device):
        self.rows, self.max_seq_len, self.vocab, self.device = rows, max_seq_len, vocab, device
        self.history: torch.Tensor | None = None  # [rows, max_seq_len] token ids: prompt, then generated
        self.bias: torch.Tensor | None = None  # [rows, vocab] float32

    def admit(self, row: int, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        if not params.penalized:
            return
        if self.history is None:
            self.history = torch.zeros(self.rows, self.max_seq_len, dtype=torch.long, device=self.device)
            self.bias = torch.zeros(self.rows, self.vocab, dtype=torch.float32, device=self.device)
        self.history[row, : len(prompt_ids)] = torch.tensor(prompt_ids, device=self.device)
        self.bias[row].zero_()
        if params.allowed_token_ids:
            self.bias[row].fill_(float("-inf"))
            self.bias[row, list(params.allowed_token_ids)] = 0.0
        if params.logit_bias:  # added: a token allowed_token_ids leaves out stays out
            ids, biases = zip(*params.logit_bias, strict=True)
            self.bias[row, list(ids)] += torch.tensor(biases, device=self.device)

    def record(self, rows: list[int], positions: list[int], tokens: torch.Tensor) -> None:
        """Write penalized rows' new tokens (in the order of `rows`) at their positions."""
        if rows:
            index = (torch.tensor(rows, device=self.device), torch.tensor(positions, device=self.device))
            self.history.index_put_(index, tokens)

    def apply(
        self,
        logits: torch.Tensor,  # [step rows, vocab] float32, changed in place
        positions: list[int],  # which of them are penalized...
        rows: list[int],  # ...their rows of the cache...
        params: list[SamplingParams],
        prompt_lengths: list[int],
        generated_ids: list[Sequence[int]],  # ...and the tokens each has generated so far
        end_ids: frozenset[int],  # EOS: what min_tokens holds back, with each row's stop_token_ids
    ) -> None:
        every_row = len(positions) == logits.shape[0]  # then the logits change in place, uncopied
        index = torch.tensor(positions, device=logits.device)
        x = logits if every_row else logits.index_select(0, index)
        generated = [len(ids) for ids in generated_ids]
        self._add_biases(x, rows, params)
        self._hold_back_ends(x, params, generated, end_ids)
        self._ban_bad_words(x, params, generated_ids)
        self._penalize_seen(x, rows, params, prompt_lengths, generated)
        if not every_row:
            logits.index_copy_(0, index, x)

    def _add_biases(self, x: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> None:
        biased = [i for i, p in enumerate(params) if p.logit_bias or p.allowed_token_ids]
        if biased:
            index = torch.tensor(biased, device=x.device)
            row_index = torch.tensor([rows[i] for i in biased], device=self.device)
            x.index_add_(0, index, self.bias.index_select(0, row_index))

    @staticmethod
    def _hold_back_ends(
        x: torch.Tensor, params: list[SamplingParams], generated: list[int], end_ids: frozenset[int]
    ) -> None:
        early = [
            (i, token)
            for i, (p, n) in enumerate(zip(params, generated, strict=True))
            if n < p.min_tokens
            for token in end_ids | set(p.stop_token_ids)
            if token < x.shape[-1]
        ]
        if early:
            at = torch.tensor(early, device=x.device)
            x.index_put_((at[:, 0], at[:, 1]), torch.tensor(float("-inf"), device=x.device))

    @staticmethod
    def _ban_bad_words(
        x: torch.Tensor, params: list[SamplingParams], generated_ids: list[Sequence[int]]
    ) -> None:
        """vLLM's rule: a word's last token is banned where the generated tokens end with its others (a
        one-token word, always); the prompt does not count."""
        banned = [
            (i, words[-1])
            for i, (p, ids) in enumerate(zip(params, generated_ids, strict=True))
            for words in p.bad_words
            if len(words) == 1 or (len(ids) >= len(words) - 1 and tuple(ids[1 - len(words) :]) == words[:-1])
        ]
        if banned:
            at = torch.tensor(banned, device=x.device)
            x.index_put_((at[:, 0], at[:, 1]), torch.tensor(float("-inf"), device=x.device))

    def _penalize_seen(
        self,
        x: torch.Tensor,
        rows: list[int],
        params: list[SamplingParams],
        prompt_lengths: list[int],
        generated: list[int],
    ) -> None:
        """Repetition over prompt and generated tokens, then frequency and presence over generated."""
        if all(
            p.repetition_penalty == 1 and not p.frequency_penalty and not p.presence_penalty for p in params
        ):
            return
        device = x.device
        ends = torch.tensor([p + g for p, g in zip(prompt_lengths, generated, strict=True)], device=device)
        starts = torch.tensor(prompt_lengths, device=device)
        span = int(max(p + g for p, g in zip(prompt_lengths, generated, strict=True)))
        ids = self.history.index_select(0, torch.tensor(rows, device=self.device))[:, :span]
        column = torch.arange(span, device=device)
        seen = column < ends[:, None]
        is_generated = seen & (column >= starts[:, None])
        # Past its end, a row points at its first token again: a harmless repeat for gather/scatter.
        ids = torch.where(seen, ids, ids[:, :1])

        repetition = self._column([p.repetition_penalty for p in params])
        logits = x.gather(1, ids)
        x.scatter_(1, ids, torch.where(logits > 0, logits / repetition, logits * repetition))

        frequency = self._column([p.frequency_penalty for p in params])
        x.scatter_add_(1, ids, -frequency * is_generated)
        # Presence counts each generated token once: sort, and keep each id's first place.
        ordered = torch.where(is_generated, ids, -1).sort(dim=-1).values
        first = torch.ones_like(ordered, dtype=torch.bool)
        first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
        presence = self._column([p.presence_penalty for p in params])
        x.scatter_add_(1, ordered.clamp(min=0), -presence * (first & (ordered >= 0)))

    def _column(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)[:, None]
