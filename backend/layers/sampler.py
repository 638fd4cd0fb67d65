"""Per-row sampling: greedy, temperature, top-k, top-p, min-p, typical-p and seed, rows grouped by what
they need.

The functions are pure and work on a batch of rows ([rows, vocab]), so rows
with different settings share one step. Randomness is counter-based: a row's
draw at its n-th token is the Gumbel-max race over its candidates (its top-k,
its nucleus, or the whole vocabulary), argmax(logit + Gumbel noise), the
noise of token t hashed from (its seed, n, t): the same on any device and in
any batch, whichever path or cut found t and in whatever place, with no
generator object per row and no Python loop over rows. A seeded row so
samples the same tokens whatever else is in the batch. The
race, unlike one uniform number placed in the cumulative probabilities, only
changes its winner when two candidates' logits plus noise come within a
rounding error of each other; the cumulative sum over a vocabulary of tiny
probabilities moves past token boundaries at the slightest change of the
logits, such as a matrix product of another shape gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from backend.kernels.extension import extension
from backend.messages import GREEDY_BELOW
from backend.utils.host_lists import to_device

# `sample`'s token for a row whose logits are not finite, a NaN anywhere or a +inf (a model or a logits
# processor gone wrong): no token drawn from them would mean anything, so the caller is told instead.
NOT_FINITE = -1


@dataclass
class SamplingBatch:
    """The sampling settings of the rows in one step, as host lists (no device sync to read them)."""

    temperature: list[float]  # 0 (below GREEDY_BELOW) for greedy rows
    top_k: list[int]  # 0 means no cut
    top_p: list[float]  # 1 means no cut
    seeds: list[int]  # each row's seed, 0 to 2**63 - 1 (unused for greedy rows)
    counters: list[int]  # each row's draw number: the tokens it has generated so far
    min_p: list[float] | None = None  # per row, 0 for no cut; None: no row has one
    typical_p: list[float] | None = None  # per row, 1 for no cut; None: no row has one

    def rows(self, predicate) -> list[int]:
        """The sampled (not greedy) rows that `predicate` holds for."""
        sampled = (r for r, temperature in enumerate(self.temperature) if temperature >= GREEDY_BELOW)
        return [r for r in sampled if predicate(r)]


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature (greedy rows, temperature 0, are left as they are)."""
    safe = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return logits / safe.unsqueeze(-1)


def top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, widest: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate tokens of each row, best first, with the cut ones at -inf.

    Returns (values, token_ids), both [rows, k] where k is the largest top_k in
    the batch (the whole vocabulary if a row has no top-k cut); `widest` gives
    that largest top_k from the host, which saves reading it from the device.
    A token stays if it is within its row's top_k and the probability mass
    ranked above it is still under top_p, so the most likely token always stays
    (tied tokens count the mass above the first of them: `probability_above`).
    """
    values, token_ids, k_for_row = top_k_candidates(logits, top_k, widest)
    return cut_top_k_top_p(values, k_for_row, top_p), token_ids


def top_k_candidates(
    logits: torch.Tensor, top_k: torch.Tensor, widest: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's best k tokens, best first, k the largest top_k (`widest`, from the host, where given;
    the whole vocabulary for a row with no cut): (values, token_ids, each row's own k)."""
    vocab = logits.shape[-1]
    k_for_row = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    k = min(widest, vocab) if widest else int(k_for_row.max())
    values, token_ids = logits.topk(k, dim=-1)
    return values, token_ids, k_for_row


def cut_top_k_top_p(values: torch.Tensor, k_for_row: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`top_k_candidates`' values with those past each row's own k, then past its top_p, at -inf."""
    rank = torch.arange(values.shape[-1], device=values.device)
    values = values.masked_fill(rank.unsqueeze(0) >= k_for_row.unsqueeze(-1), float("-inf"))
    above = probability_above(values.softmax(dim=-1), values)
    return values.masked_fill(above >= top_p.unsqueeze(-1), float("-inf"))


def probability_above(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Each candidate's probability ranked strictly above it, given the candidates best first (`values`
    their logits, `probs` their probabilities). Tied tokens all get what is above the first of them, so a
    tie stays or goes whole under a top_p: torch.topk orders ties as it likes (and differently on a GPU),
    fused_ops.cpp's loop by token id, and each must keep the same tokens to draw the same one."""
    above = probs.cumsum(dim=-1) - probs
    first_of_tie = torch.searchsorted(-values, -values)  # the values descend: -values ascend
    # A NaN (a row `sample` reports NOT_FINITE) unsorts them, and searchsorted may answer past the end.
    return above.gather(-1, first_of_tie.clamp(max=values.shape[-1] - 1))


# How far a nucleus is first looked for on a CPU (nucleus_cut).
CPU_NUCLEUS_GUESSES = (256, 4096)


def nucleus_cut(
    logits: torch.Tensor, top_p: torch.Tensor, guesses: tuple[int, ...] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """top_p alone: the smallest set of best tokens whose probability reaches top_p, best first.

    Like top_k_top_p with no top-k, without sorting the whole vocabulary when
    the nucleus lies within the best 256 tokens, as it nearly always does: the
    probabilities are the whole vocabulary's, so the cut is the same. Only the
    rows whose nucleus is wider look further (4,096, then a full sort), so one
    flat row neither slows the others nor changes their candidates. Returns
    [rows, k] like top_k_top_p, k the widest look any row took; a row's
    places past its own look are -inf.

    On a GPU (`guesses` None there means none) the whole vocabulary is sorted at once: a GPU sorts
    [32, 128k] in well under a millisecond, where asking whether a row needs a wider look would make
    the host wait for the GPU every step.
    """
    if guesses is None:
        guesses = CPU_NUCLEUS_GUESSES if logits.device.type == "cpu" else ()
    probs = logits.softmax(dim=-1)
    vocab = probs.shape[-1]
    looks = [guess for guess in guesses if guess < vocab] + [vocab]
    if looks[0] < vocab:
        values, token_ids = logits.topk(looks[0], dim=-1)
    else:
        values, token_ids = logits.sort(dim=-1, descending=True)
    looked = torch.full_like(top_p, looks[0], dtype=torch.long)
    above = probability_above(probs.gather(-1, token_ids), values)
    for look in looks[1:]:
        # Its last token kept, a row may keep more: those past its look, a tie with that token among them.
        short = (above.gather(-1, looked.unsqueeze(-1) - 1).squeeze(-1) < top_p).nonzero().squeeze(-1)
        if not len(short):
            break
        values, token_ids = pad(values, look, float("-inf")), pad(token_ids, look)
        wider_values, wider_ids = logits.index_select(0, short).topk(look, dim=-1)
        values.index_copy_(0, short, wider_values)
        token_ids.index_copy_(0, short, wider_ids)
        looked.index_fill_(0, short, look)
        above = probability_above(probs.gather(-1, token_ids), values)
    rank = torch.arange(values.shape[-1], device=logits.device)
    cut = (above >= top_p.unsqueeze(-1)) | (rank >= looked.unsqueeze(-1))
    return values.masked_fill(cut, float("-inf")), token_ids


def draw_nucleus(
    scaled: torch.Tensor, top_p: list[float], seeds: list[int], counters: list[int]
) -> torch.Tensor:
    """The draws of rows with a nucleus alone (top_p, no top_k): by the CPU's loop where there is one, else
    `nucleus_cut` and the race among it."""
    device = scaled.device
    top_p_tensor = to_device(top_p, device, torch.float32)
    if (draw := nucleus_loop(device)) is not None:
        return draw(scaled.contiguous(), top_p_tensor, *seeds_and_counters(seeds, counters, device))
    values, token_ids = nucleus_cut(scaled, top_p_tensor)
    return race_among(values, token_ids, seeds, counters)


def draw_top_k(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    min_p: list[float],
    top_p: list[float],
    top_k: list[int],
    seeds: list[int],
    counters: list[int],
    typical_p: list[float] | None = None,
) -> torch.Tensor:
    """The draws of rows with a top-k (then maybe top-p), from their raw logits: the candidates first,
    then their temperature and min_p cut, which leave the same candidates in the same order (a division
    by a positive number, and a cut below the best token, which is a candidate) on [rows, k] instead of
    [rows, vocab]: on a CPU those two passes over 32 rows of 49,152 were most of a step's sampling.
    Rows with a `typical_p` come here too, top-k or not (a row with none sorts its whole vocabulary), and
    `typical_cut` takes what the other cuts leave: no fused loop takes that cut, and few requests ask for
    it (TGI's and llama.cpp's clients)."""
    device = logits.device
    widest = max(top_k) if all(k > 0 for k in top_k) else logits.shape[-1]
    values, token_ids, k_for_row = top_k_candidates(logits, to_device(top_k, device, torch.long), widest)
    values = apply_temperature(values, temperature)
    if any(min_p):
        values = min_p_cut(values, to_device(min_p, device, torch.float32))
    values = cut_top_k_top_p(values, k_for_row, to_device(top_p, device, torch.float32))
    if typical_p is not None:
        values = typical_cut(values, to_device(typical_p, device, torch.float32))
    return race_among(values, token_ids, seeds, counters)


def typical_cut(values: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022), as transformers' TypicalLogitsWarper cuts: over each
    row's candidates renormalized (`values`, -inf for those cut), a token's distance from the typical is
    |-log p - H|, H the entropy; the nearest stay, as many as it takes for their probability to reach
    typical_p, with every token as near as the last of them (a tie stays or goes whole, whatever order a
    sort gives it) and the nearest one always."""
    log_probs = values.log_softmax(dim=-1)
    probs = log_probs.exp()
    entropy = -(log_probs * probs).nansum(dim=-1, keepdim=True)  # a cut token's 0 * -inf is NaN: no part
    distance = (-log_probs - entropy).abs()  # inf for a cut token
    nearest, order = distance.sort(dim=-1)
    mass = probs.gather(-1, order).cumsum(dim=-1)
    last = (mass < typical_p.unsqueeze(-1)).sum(dim=-1, keepdim=True).clamp(max=values.shape[-1] - 1)
    return values.masked_fill(distance > nearest.gather(-1, last), float("-inf"))


def race_among(
    values: torch.Tensor, token_ids: torch.Tensor, seeds: list[int], counters: list[int]
) -> torch.Tensor:
    """Each row's draw among its candidates (`values` of `token_ids`, -inf for those cut): their token."""
    raced = race(values, row_keys(seeds, counters, values.device), token_ids)
    return unless_not_finite(raced.values, token_ids.gather(-1, raced.indices.unsqueeze(-1)).squeeze(-1))


def draw_whole(scaled: torch.Tensor, seeds: list[int], counters: list[int]) -> torch.Tensor:
    """The draws of rows with no cut, each from its whole vocabulary: by the CPU's loop where there is
    one (`race_loop`), else the race over every token."""
    device = scaled.device
    if (draw := race_loop(device)) is not None:
        return draw(scaled.contiguous(), *seeds_and_counters(seeds, counters, device))
    raced = race(scaled, row_keys(seeds, counters, device))
    return unless_not_finite(raced.values, raced.indices)


def seeds_and_counters(
    seeds: list[int], counters: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' seeds and counters for the CPU's loops, which hash each row's key from them (as
    `row_keys` does) and give NOT_FINITE themselves."""
    return to_device(seeds, device, torch.long), to_device(counters, device, torch.long)


def race_loop(device: torch.device) -> Callable | None:
    """On a CPU, the fused operations' loop for rows with no cut (fused_ops.cpp, `race_draw`): `race`'s
    draw over the whole vocabulary (but for a rounding of the noise's logarithms), the noise drawn only
    for the tokens that could still win, where `race` hashes every token and takes two logarithms of
    each: 32 rows of 49,152 tokens 18.7 ms of PyTorch's operations (docs/performance.md). None
    elsewhere (a GPU races every token in a few kernels), and where the extension is not built."""
    if device.type != "cpu":
        return None
    built = extension()
    return None if built is None else built.race_draw


def nucleus_loop(device: torch.device) -> Callable | None:
    """On a CPU, the fused operations' loop for nucleus rows (fused_ops.cpp, `nucleus_draw`): the same
    cut and race as `nucleus_cut` and `race` (but for a rounding of the probabilities and the noise's
    logarithms), a few passes over a row and a ranking of where its nucleus ends instead of some forty
    PyTorch operations, about half a millisecond of a one-row step (docs/performance.md). None elsewhere,
    and where the extension is not built."""
    if device.type != "cpu":
        return None
    built = extension()
    return None if built is None else built.nucleus_draw


def pad(rows: torch.Tensor, width: int, fill: float = 0) -> torch.Tensor:
    """`rows` widened with `fill` to `width` columns."""
    return torch.nn.functional.pad(rows, (0, width - rows.shape[-1]), value=fill)


def min_p_cut(values: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Cut the candidates less likely than min_p times the row's most likely one: p_i < min_p * p_max
    is values_i < max(values) + log(min_p), the same in logits (min_p 0 cuts nothing)."""
    floor = values.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(-1)
    return values.masked_fill(values < floor, float("-inf"))


def race(
    values: torch.Tensor, keys: torch.Tensor, token_ids: torch.Tensor | None = None
) -> torch.return_types.max:
    """Each row's draw from softmax(values): the max of values + Gumbel noise (NaN or +inf exactly where
    the winner's value is: the noise is finite) and its index, the draw; -inf never wins.

    A candidate's noise is hashed from its token id (`token_ids`, [rows, k], of a cut's candidates; the
    column where None, over the whole vocabulary), not its place: tied tokens come in another order from
    torch.topk than from fused_ops.cpp's loop, and a token must draw the same noise either way."""
    tokens = values.shape[-1] if token_ids is None else token_ids
    return (values + gumbel_noise(keys, tokens)).max(dim=-1)


def row_keys(seeds: list[int], counters: list[int], device: torch.device) -> torch.Tensor:
    """Each row's key for its draw at `counters` (the tokens it has generated), [rows] int32 on `device`:
    31 bits of splitmix64(splitmix64(seed) + counter), hashed on the host, where the numbers are, since on
    a GPU the same hash over [rows] tensors was some 25 kernels a step, each launched from Python."""
    keys = [
        splitmix64_of(splitmix64_of(seed) + counter) >> 33
        for seed, counter in zip(seeds, counters, strict=True)
    ]
    return to_device(keys, device, torch.int32)


def gumbel_noise(keys: torch.Tensor, tokens: int | torch.Tensor) -> torch.Tensor:
    """Gumbel noise, -log(-log(u)), u hashed from the row's key (`row_keys`: from its seed and counter)
    and a token id: `tokens` the ids, [width] or [rows, width], or a width (the ids 0 to width - 1);
    [rows, width].

    Each token's uniform number comes from a 32-bit integer hash (Chris
    Wellons' lowbias32) of key ^ token, cheap enough for a whole vocabulary.
    """
    if isinstance(tokens, int):
        tokens = torch.arange(tokens, device=keys.device, dtype=torch.int32)
    bits = lowbias32(keys.unsqueeze(-1) ^ tokens.to(torch.int32))
    # 23 bits, in (0, 1) in float32 too: with 24, the largest, 1 - 2**-25, rounds to 1.0, whose noise is
    # +inf: that token won the race whatever its logit (once in 2**24 columns: 0.3% of draws over a
    # 49,152-token vocabulary), even a token a grammar or logit_bias had set to -inf.
    u = (logical_right_shift(bits, 9).to(torch.float32) + 0.5) / 2**23
    return -torch.log(-torch.log(u))


UINT64 = 2**64 - 1


def splitmix64_of(x: int) -> int:
    """Sebastiano Vigna's splitmix64 finalizer on a Python integer, as uint64 arithmetic wraps."""
    z = (x + 0x9E3779B97F4A7C15) & UINT64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & UINT64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & UINT64
    return z ^ (z >> 31)


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int32 tensors (wrapping multiplies, as uint32's)."""
    x = (x ^ logical_right_shift(x, 16)) * signed(0x7FEB352D, 32)
    x = (x ^ logical_right_shift(x, 15)) * signed(0x846CA68B, 32)
    return x ^ logical_right_shift(x, 16)


def signed(constant: int, bits: int) -> int:
    """An unsigned constant as the signed integer of the same bits."""
    return constant - 2**bits if constant >= 2 ** (bits - 1) else constant


def logical_right_shift(x: torch.Tensor, shift: int) -> torch.Tensor:
    """`>>` on signed integers keeps the sign; the hashes need the unsigned shift."""
    bits = torch.iinfo(x.dtype).bits
    return (x >> shift) & ((1 << (bits - shift)) - 1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The next token of every row: [rows, vocab] logits to [rows] token ids.

    A row whose logits hold a NaN anywhere or a +inf (after any division by its temperature) gets
    NOT_FINITE (-1), on every path, not a token: the caller must not take it as one (the engine ends that
    request with an error). -inf is a masked token and is drawn around as ever."""
    logits = logits.float()
    device = logits.device
    tokens = torch.zeros(logits.shape[0], dtype=torch.long, device=device)
    greedy = [r for r, temperature in enumerate(batch.temperature) if temperature < GREEDY_BELOW]
    if greedy:  # argmax costs about 1 ms over [32, 49152] on a small CPU: only where needed
        index = to_device(greedy, device, torch.long)
        rows = logits if len(greedy) == logits.shape[0] else logits.index_select(0, index)
        best = rows.max(dim=-1)  # the argmax (the first of a tie too) and its logit
        tokens.index_copy_(0, index, unless_not_finite(best.values, best.indices))
    typical_p = batch.typical_p or [1.0] * len(batch.temperature)
    # Rows with a typical cut, whatever else they have: their sorted candidates (draw_top_k).
    typical = batch.rows(lambda r: typical_p[r] < 1)
    # Rows with no cut draw from the whole vocabulary: no sort needed.
    whole = batch.rows(lambda r: batch.top_k[r] == 0 and batch.top_p[r] >= 1 and typical_p[r] >= 1)
    # Rows with a cut: top-k (then maybe top-p) among few candidates, or a nucleus alone.
    with_k = batch.rows(lambda r: batch.top_k[r] > 0 and typical_p[r] >= 1)
    nucleus = batch.rows(lambda r: batch.top_k[r] == 0 and batch.top_p[r] < 1 and typical_p[r] >= 1)
    for rows in (whole, with_k, nucleus, typical):
        if not rows:
            continue
        index = to_device(rows, device, torch.long)
        temperature = to_device([batch.temperature[r] for r in rows], device, torch.float32)
        every_row = len(rows) == logits.shape[0]  # then no copy of the [rows, vocab] logits
        selected = logits if every_row else logits.index_select(0, index)
        seeds, counters = [batch.seeds[r] for r in rows], [batch.counters[r] for r in rows]
        min_p = [batch.min_p[r] for r in rows] if batch.min_p else []
        top_p = [batch.top_p[r] for r in rows]
        if rows is with_k or rows is typical:  # the candidates first, then their temperature and cuts
            top_k = [batch.top_k[r] for r in rows]
            typical_ps = [typical_p[r] for r in rows] if rows is typical else None
            chosen = draw_top_k(selected, temperature, min_p, top_p, top_k, seeds, counters, typical_ps)
        else:
            scaled = apply_temperature(selected, temperature)
            if any(min_p):
                scaled = min_p_cut(scaled, to_device(min_p, device, torch.float32))
            if rows is whole:
                chosen = draw_whole(scaled, seeds, counters)
            else:
                chosen = draw_nucleus(scaled, top_p, seeds, counters)
        tokens.index_copy_(0, index, chosen)
    return tokens


def unless_not_finite(picked: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """`chosen`, but NOT_FINITE for the rows whose logits hold a NaN or a +inf. The max and the race pick
    a NaN wherever there is one, else a +inf (torch.topk ranks them first, so every cut keeps them too):
    the value they `picked` tells, which they give with the token. Two operations on [rows], 0.02-0.03 ms
    over [32, 49152] on a small CPU (a gather of the chosen logits cost 0.15 more), where looking for NaN
    and +inf would be another pass over [rows, vocab]."""
    return torch.where(picked < float("inf"), chosen, NOT_FINITE)  # NaN < inf is false too
