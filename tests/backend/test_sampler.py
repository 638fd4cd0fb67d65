"""The sampling functions on their own."""

import math
from unittest import mock

import pytest
import torch

from backend.layers.sampler import (
    SamplingBatch,
    apply_temperature,
    gumbel_noise,
    lowbias32,
    row_keys,
    sample,
    splitmix64_of,
    top_k_top_p,
)


def probs_to_logits(probs):
    return torch.tensor([probs]).log()


def kept(values):
    return torch.isfinite(values[0]).sum().item()


def test_top_k_keeps_exactly_k_best_tokens():
    logits = torch.randn(3, 100)
    values, token_ids = top_k_top_p(logits, torch.tensor([1, 5, 17]), torch.ones(3))
    for row, k in enumerate([1, 5, 17]):
        kept_ids = token_ids[row][torch.isfinite(values[row])]
        assert set(kept_ids.tolist()) == set(logits[row].topk(k).indices.tolist())


def test_top_k_zero_keeps_the_whole_vocabulary():
    values, _ = top_k_top_p(torch.randn(1, 50), torch.tensor([0]), torch.ones(1))
    assert kept(values) == 50


def test_top_p_keeps_the_nucleus():
    logits = probs_to_logits([0.05, 0.5, 0.15, 0.3])
    values, token_ids = top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.8]))
    # 0.5 + 0.3 reaches 0.8: the nucleus is those two tokens, best first.
    assert token_ids[0][torch.isfinite(values[0])].tolist() == [1, 3]
    values, token_ids = top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.81]))
    assert token_ids[0][torch.isfinite(values[0])].tolist() == [1, 3, 2]


def test_top_p_always_keeps_the_most_likely_token():
    values, token_ids = top_k_top_p(probs_to_logits([0.9, 0.1]), torch.tensor([0]), torch.tensor([0.01]))
    assert kept(values) == 1 and token_ids[0, 0].item() == 0


def test_temperature_divides_logits_and_leaves_greedy_rows_alone():
    logits = torch.tensor([[2.0, 4.0], [2.0, 4.0]])
    scaled = apply_temperature(logits, torch.tensor([2.0, 0.0]))
    assert scaled.tolist() == [[1.0, 2.0], [2.0, 4.0]]


def batch(temperature, top_k=0, top_p=1.0, seeds=None, rows=1, counters=None):
    seeds = seeds or [1234] * rows
    counters = counters or [0] * rows
    return SamplingBatch([float(temperature)] * rows, [top_k] * rows, [top_p] * rows, seeds, counters)


def test_temperature_zero_is_argmax():
    logits = torch.randn(4, 1000)
    assert sample(logits, batch(0, rows=4)).tolist() == logits.argmax(-1).tolist()


def test_the_hashes_wrap_around_as_unsigned_integers_do():
    """The device hashes equal their references on Python integers, so draws are the same on any device."""

    def splitmix64_reference(x):
        mask = 2**64 - 1
        z = (x + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    def lowbias32_reference(x):
        mask = 2**32 - 1
        x = ((x ^ (x >> 16)) * 0x7FEB352D) & mask
        x = ((x ^ (x >> 15)) * 0x846CA68B) & mask
        return x ^ (x >> 16)

    inputs = [0, 1, 7, 2**31 - 1, 2**30 + 12345]
    assert [splitmix64_of(x) for x in inputs + [2**63 - 1, 2**64 + 5]] == [
        splitmix64_reference(x) for x in inputs + [2**63 - 1, 5]
    ]
    assert [v % 2**32 for v in lowbias32(torch.tensor(inputs, dtype=torch.int32)).tolist()] == [
        lowbias32_reference(x) for x in inputs
    ]


def test_the_noise_is_gumbel_distributed_across_rows_and_columns():
    seeds = [i * 7919 for i in range(400)]
    noise = gumbel_noise(row_keys(seeds, [0] * 400, torch.device("cpu")), 100).flatten()
    uniform = torch.exp(-torch.exp(-noise))  # the Gumbel CDF: uniform if the noise is Gumbel
    histogram = torch.histc(uniform, bins=10, min=0, max=1) / len(uniform)
    assert (histogram - 0.1).abs().max() < 0.01
    assert abs(noise.mean().item() - 0.5772) < 0.03  # the Euler-Mascheroni constant


def test_the_noise_is_finite_everywhere():
    """Every uniform number the hash can give, the largest included, is below 1 in float32 (1.0 would
    be infinite noise: a column that wins whatever its logit, a masked token too)."""
    bits = torch.tensor([-1, 2**31 - 1, 0, -(2**31)], dtype=torch.int32)  # all ones, and the extremes
    with mock.patch("backend.layers.sampler.lowbias32", return_value=bits):
        assert torch.isfinite(gumbel_noise(torch.tensor([0], dtype=torch.int32), 4)).all()
    # Seed 19 at its 30th draw hashed column 18,701 to the largest number once, which then won.
    assert torch.isfinite(gumbel_noise(row_keys([19], [30], torch.device("cpu")), 49152)).all()


def test_a_row_with_one_token_left_always_draws_it():
    logits = torch.full((300, 49152), float("-inf"))
    logits[:, 109] = 25.0
    draws = sample(logits, batch(1.0, rows=300, seeds=list(range(300)), counters=[30] * 300))
    assert set(draws.tolist()) == {109}


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (0, 0.99), (4, 1.0)])
def test_sampling_follows_the_distribution(top_k, top_p):
    """4,000 draws, each its own counter (as a row's successive tokens are), in every kind of row."""
    probs = [0.1, 0.2, 0.3, 0.4]
    logits = probs_to_logits(probs).repeat(4000, 1)
    draws = sample(logits, batch(1.0, top_k, top_p, rows=4000, counters=list(range(4000)))).tolist()
    for token, p in enumerate(probs):
        frequency = draws.count(token) / len(draws)
        assert math.isclose(frequency, p, abs_tol=0.03), (token, frequency)


def test_sampling_never_picks_a_token_that_was_cut():
    logits = probs_to_logits([0.4, 0.3, 0.2, 0.1]).repeat(300, 1)
    cut = batch(1.0, top_k=2, rows=300, counters=list(range(300)))
    assert set(sample(logits, cut).tolist()) == {0, 1}
    tiny = probs_to_logits([0.5, 0.5, 1e-30, 1e-30]).repeat(300, 1)  # probabilities that round to 0
    assert set(sample(tiny, batch(1.0, rows=300, counters=list(range(300)))).tolist()) == {0, 1}


def test_a_seeded_row_draws_the_same_tokens_whatever_its_neighbours():
    """Fifty successive draws of one seeded row, alone and among rows of every other kind."""
    torch.manual_seed(0)
    logits = torch.randn(50, 300)
    for top_k, top_p in ((0, 1.0), (0, 0.95), (50, 0.95)):
        alone = [
            sample(logits[n : n + 1], batch(0.9, top_k, top_p, seeds=[7], counters=[n])).item()
            for n in range(50)
        ]
        crowd = []
        for n in range(50):
            crowd_logits = torch.cat([torch.randn(2, 300), logits[n : n + 1], torch.randn(3, 300)])
            neighbours = SamplingBatch(
                [0.0, 1.5, 0.9, 0.7, 0.0, 1.0],
                [0, 1000, top_k, 3, 0, 0],
                [1.0, 0.5, top_p, 1.0, 1.0, 0.9],
                [1, 2, 7, 3, 4, 5],
                [n + 3, 0, n, 9, 1, n],
            )
            crowd.append(sample(crowd_logits, neighbours)[2].item())
        assert crowd == alone
        assert len(set(alone)) > 10  # fifty real draws, not one token repeated


def test_rows_without_a_cut_nucleus_rows_and_top_k_rows_share_a_step():
    torch.manual_seed(1)
    logits = torch.randn(4, 200)
    draws = [
        sample(
            logits,
            SamplingBatch([1.0, 1.0, 1.0, 0.0], [0, 0, 5, 0], [1.0, 0.5, 1.0, 1.0], [1, 2, 3, 4], [n] * 4),
        )
        for n in range(200)
    ]
    draws = [d.tolist() for d in draws]
    top5 = set(logits[2].topk(5).indices.tolist())
    probs = logits[1].softmax(-1).sort(descending=True)
    nucleus_size = int((probs.values.cumsum(-1) - probs.values < 0.5).sum())
    nucleus = set(probs.indices[:nucleus_size].tolist())
    assert {d[2] for d in draws} <= top5
    assert {d[1] for d in draws} <= nucleus
    assert len({d[0] for d in draws}) > 20  # the whole vocabulary is in play
    assert {d[3] for d in draws} == {logits[3].argmax().item()}


def test_a_draw_survives_the_rounding_differences_of_another_batch():
    """Logits that differ in the last bits (a matrix product of another shape) keep nearly every draw:
    the race changes its winner only on a near tie, where one uniform number in the cumulative
    probabilities of a flat distribution would move with every change."""
    torch.manual_seed(4)
    logits = torch.randn(500, 49152) * 2
    nudged = logits * (1 + 1e-6 * torch.randn_like(logits))
    settings = batch(1.0, rows=500, counters=list(range(500)))
    same = (sample(logits, settings) == sample(nudged, settings)).float().mean().item()
    assert same > 0.99


def test_a_seed_gives_the_same_draws_again_and_another_seed_others():
    logits = torch.randn(1, 1000).repeat(40, 1)
    for top_k, top_p in ((0, 1.0), (0, 0.9), (40, 1.0), (40, 0.9)):
        draws = [
            sample(logits, batch(1.0, top_k, top_p, seeds=[seed] * 40, counters=list(range(40)))).tolist()
            for seed in (5, 5, 6)
        ]
        assert draws[0] == draws[1] and draws[0] != draws[2]


def test_the_nucleus_without_a_full_sort_is_the_same_cut():
    from backend.layers.sampler import nucleus_cut

    torch.manual_seed(2)
    peaked = torch.randn(3, 5000) * 4  # the nucleus lies among the best few hundred tokens
    flat = torch.randn(1, 5000) * 0.01  # it does not: the whole vocabulary is sorted
    for logits, top_p in ((peaked, [0.9, 0.5, 0.99]), (flat, [0.9])):
        top_p = torch.tensor(top_p)
        full_values, full_ids = top_k_top_p(logits, torch.zeros(len(top_p), dtype=torch.long), top_p)
        # The CPU's guesses, and the GPU's one sort of the whole vocabulary (no guesses: no host wait).
        for guesses in (None, ()):
            values, token_ids = nucleus_cut(logits, top_p, guesses)
            if guesses == ():
                assert values.shape[-1] == 5000  # the whole vocabulary, sorted
            for row in range(len(top_p)):
                kept = set(token_ids[row][torch.isfinite(values[row])].tolist())
                assert kept == set(full_ids[row][torch.isfinite(full_values[row])].tolist())
                assert kept


def test_a_flat_row_widens_its_own_nucleus_only():
    from backend.layers.sampler import nucleus_cut

    torch.manual_seed(3)
    peaked = torch.randn(1, 5000) * 4
    flat = torch.randn(1, 5000) * 0.01
    mixed, top_p = torch.cat([peaked, flat]), torch.tensor([0.9, 0.9])
    values, token_ids = nucleus_cut(mixed, top_p)
    full_values, full_ids = top_k_top_p(mixed, torch.zeros(2, dtype=torch.long), top_p)
    for row in range(2):
        kept = token_ids[row][torch.isfinite(values[row])].tolist()
        assert set(kept) == set(full_ids[row][torch.isfinite(full_values[row])].tolist())
    assert torch.isfinite(values[1]).sum() > 256  # the flat row looked past the first guess
    alone_values, alone_ids = nucleus_cut(peaked, top_p[:1])
    width = alone_values.shape[-1]
    assert torch.equal(token_ids[0, :width], alone_ids[0]) and torch.equal(values[0, :width], alone_values[0])
    assert not torch.isfinite(values[0, width:]).any()  # past its own look, nothing is a candidate


def test_the_cpus_nucleus_loop_draws_what_the_cut_and_race_draw():
    """fused_ops.cpp's nucleus_draw, which `sample` takes for nucleus rows on a CPU, against PyTorch's
    nucleus_cut and race: the same token for every seed and draw, on peaked rows and on rows with
    tokens masked to -inf, which it never draws, and on flat rows (a random-weight model's), whose nucleus
    is most of the vocabulary and whose race skips the tokens that cannot win (rows with ties:
    test_tied_tokens_draw_the_same...)."""
    from backend.kernels.extension import extension
    from backend.layers.sampler import nucleus_cut, nucleus_loop, race

    draw = nucleus_loop(torch.device("cpu"))
    assert draw is not None and draw is extension().nucleus_draw
    assert nucleus_loop(torch.device("meta")) is None
    torch.manual_seed(4)
    peaked = torch.randn(4, 49152) * 3
    masked = torch.randn(2, 5000) * 2
    masked[:, ::2] = float("-inf")
    flat = torch.randn(3, 49152) * 0.3
    cases = ((peaked, [0.95, 0.5, 0.99, 0.05]), (masked, [0.9, 0.999]), (flat, [0.95, 0.6, 1.0]))
    for logits, top_p in cases:
        top_p = torch.tensor(top_p)
        for counter in range(25):
            seeds = torch.randint(0, 2**62, (len(top_p),))
            counters = torch.full((len(top_p),), counter)
            values, token_ids = nucleus_cut(logits, top_p)
            keys = row_keys(seeds.tolist(), counters.tolist(), logits.device)
            winner = race(values, keys, token_ids).indices
            expected = token_ids.gather(-1, winner.unsqueeze(-1)).squeeze(-1)
            got = draw(logits, top_p, seeds, counters)
            assert torch.equal(got, expected)
            assert torch.isfinite(logits.gather(-1, got[:, None])).all()


def test_the_cpus_nucleus_loop_looks_further_where_its_first_look_falls_short():
    """The loop first looks only at tokens within 16 of the best logit; a row whose nucleus reaches
    below that (one token far ahead of 5,000 equal ones, each 16.2 below it, and a top_p above the
    first token's own probability) is drawn from its whole nucleus: the equal tokens, a tie that stays
    whole, win about once in 2,000 draws (with the first look alone, never), and the 5,000 tokens far
    below them (each 30 below the best), past the nucleus, never."""
    from backend.layers.sampler import nucleus_loop

    draw = nucleus_loop(torch.device("cpu"))
    logits = torch.cat([torch.zeros(1), torch.full((5000,), -16.2), torch.full((5000,), -30.0)])[None]
    probs = logits.double().softmax(-1)[0]
    top_p = 0.9999
    assert probs[0] < top_p < probs[:5001].sum()  # the first token alone is not the nucleus; the tie ends it
    draws = [
        draw(logits, torch.tensor([top_p]), torch.tensor([seed]), torch.tensor([0])).item()
        for seed in range(10_000)
    ]
    others = [token for token in draws if token != 0]
    assert 2 <= len(others) <= 20  # the tie holds 4.6e-4 of the nucleus: some 5 in 10,000
    assert max(others) <= 5000


def test_the_cpus_race_loop_draws_what_the_race_over_the_whole_vocabulary_draws():
    """fused_ops.cpp's race_draw, which `sample` takes on a CPU for rows with no cut (OpenAI's defaults),
    against PyTorch's race over every token: the same token for every seed and draw, on peaked, flat
    and masked rows, and where the best token holds a third of the mass and 49,151 tokens 12 below it the
    rest, so that the loop must not skip the many tokens far below, each unlikely, that win together."""
    from backend.kernels.extension import extension
    from backend.layers.sampler import race, race_loop

    draw = race_loop(torch.device("cpu"))
    assert draw is not None and draw is extension().race_draw
    assert race_loop(torch.device("meta")) is None
    torch.manual_seed(5)
    masked = torch.randn(3, 5001) * 2  # and a width no whole number of the loop's chunks
    masked[:, ::2] = float("-inf")
    far_below = torch.cat([torch.zeros(2, 1), torch.full((2, 49151), -10.5)], dim=1)
    cases = (torch.randn(4, 49152) * 3, torch.randn(3, 49152) * 0.3, masked, far_below)
    best_won = 0
    for logits in cases:
        for counter in range(40):
            seeds = torch.randint(0, 2**62, (len(logits),))
            counters = torch.full((len(logits),), counter)
            expected = race(logits, row_keys(seeds.tolist(), counters.tolist(), logits.device)).indices
            drawn = draw(logits, seeds, counters)
            assert torch.equal(drawn, expected)
            best_won += int((drawn == 0).sum()) if logits is far_below else 0
    assert far_below[0].softmax(-1)[0].item() == pytest.approx(0.425, abs=0.001)
    assert 20 <= best_won <= 50  # of 80 draws: some 34, and the tokens far below won the rest


def test_top_k_rows_scale_and_cut_their_candidates_as_the_whole_row_would_be():
    """A top-k row's temperature and min_p apply to its candidates alone (draw_top_k), not to its whole
    vocabulary first: the same draws as the whole row divided, cut by min_p, then cut to its top-k and
    top-p and raced, for rows of every setting side by side (no tied logits here: of tied tokens on
    either side of a row's k, torch.topk keeps either)."""
    from backend.layers.sampler import min_p_cut, race

    torch.manual_seed(11)
    logits = torch.randn(12, 3000) * 3
    logits[2, ::3] = float("-inf")  # masked tokens, as a grammar leaves them
    temperature = [0.3, 0.8, 1.0, 1.7] * 3
    top_k = [1, 5, 40, 3000, 40, 100] * 2
    top_p = [1.0, 0.9, 0.5, 0.95] * 3
    min_p = [0.0, 0.05, 0.2] * 4
    for counter in range(30):
        seeds = [int(s) for s in torch.randint(0, 2**62, (12,))]
        counters = [counter] * 12
        drawn = sample(logits, SamplingBatch(temperature, top_k, top_p, seeds, counters, min_p)).tolist()
        scaled = min_p_cut(apply_temperature(logits, torch.tensor(temperature)), torch.tensor(min_p))
        values, token_ids = top_k_top_p(scaled, torch.tensor(top_k), torch.tensor(top_p))
        winner = race(values, row_keys(seeds, counters, logits.device), token_ids).indices
        assert drawn == token_ids.gather(-1, winner[:, None]).squeeze(-1).tolist()
        assert drawn[2] % 3 != 0  # never a masked token


def settings(rows, top_k, top_p, seeds=None, counters=None, temperature=1.0):
    seeds = seeds or list(range(rows))
    counters = counters or [0] * rows
    return SamplingBatch([temperature] * rows, [top_k] * rows, [top_p] * rows, seeds, counters)


def draws_by_every_path(logits, sampling, monkeypatch):
    """`sample`'s draws by the CPU's loops (a nucleus's, the whole vocabulary's), and by PyTorch's
    operations alone, as a GPU or a machine without the C++ extension draws them."""
    from backend.layers import sampler

    by_the_loop = sample(logits, sampling).tolist()
    with monkeypatch.context() as patched:
        patched.setattr(sampler, "nucleus_loop", lambda device: None)
        patched.setattr(sampler, "race_loop", lambda device: None)
        by_pytorch = sample(logits, sampling).tolist()
    return by_the_loop, by_pytorch


def test_tied_tokens_draw_the_same_by_every_path_and_cut(monkeypatch):
    """bfloat16 logits tie often. The CPU's loop ranks tied tokens by id, torch.topk as it likes; a token's
    noise is hashed from its id, and a tie stays or goes whole, so every path draws the same token for a
    seed: the loop, nucleus_cut and race, the top-k path (a top_k that cuts nothing), and, where the cut
    keeps every token, the draw from the whole vocabulary."""
    torch.manual_seed(6)
    logits = (torch.randn(64, 2000) * 2).bfloat16().float()  # the sampler gets float32
    assert logits[0].unique().numel() < 1200  # half the tokens tie with another
    seeds, counters = [int(s) for s in torch.randint(0, 2**62, (64,))], list(range(64))
    for top_p in (0.3, 0.8, 0.95):
        nucleus = draws_by_every_path(logits, settings(64, 0, top_p, seeds, counters), monkeypatch)
        with_top_k = draws_by_every_path(logits, settings(64, 2000, top_p, seeds, counters), monkeypatch)
        assert nucleus[0] == nucleus[1] == with_top_k[0] == with_top_k[1], top_p
    small = (torch.randn(64, 50) * 0.5).bfloat16().float()  # every token holds over 1e-5 of the mass
    whole = sample(small, settings(64, 0, 1.0, seeds, counters)).tolist()
    assert len(set(whole)) > 20
    for top_k, top_p in ((0, 0.99999), (50, 1.0), (50, 0.99999)):
        assert draws_by_every_path(small, settings(64, top_k, top_p, seeds, counters), monkeypatch) == (
            whole,
            whole,
        )


def test_a_tie_at_the_edge_of_the_nucleus_stays_whole(monkeypatch):
    """0.4 then three tokens of 0.2: with top_p 0.5 the tie reaches past it, and whatever order a sort gave
    the three, all three stay (the probability strictly above each is 0.4)."""
    from backend.layers.sampler import nucleus_cut

    logits = probs_to_logits([0.2, 0.2, 0.4, 0.2, 0.0001])
    top_p = torch.tensor([0.5])
    for values, token_ids in (top_k_top_p(logits, torch.tensor([0]), top_p), nucleus_cut(logits, top_p)):
        assert set(token_ids[0][torch.isfinite(values[0])].tolist()) == {0, 1, 2, 3}
    by_the_loop, by_pytorch = draws_by_every_path(logits.repeat(400, 1), settings(400, 0, 0.5), monkeypatch)
    assert by_the_loop == by_pytorch and set(by_the_loop) == {0, 1, 2, 3}


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (0, 0.9), (20, 1.0), (20, 0.9)])
def test_a_temperature_below_1e5_is_greedy(top_k, top_p, monkeypatch):
    """logits / 1e-40 overflow to +inf, whose race the lowest such id won: temperatures below 1e-5 take the
    argmax (vLLM's rule), on every path."""
    torch.manual_seed(7)
    logits = torch.randn(8, 1000) * 3
    for temperature in (1e-40, 1e-6):
        sampling = settings(8, top_k, top_p, temperature=temperature)
        assert draws_by_every_path(logits, sampling, monkeypatch) == (logits.argmax(-1).tolist(),) * 2


@pytest.mark.parametrize("temperature, top_k, top_p", [(0, 0, 1.0), (1, 0, 1.0), (1, 0, 0.9), (1, 20, 0.9)])
def test_a_row_whose_logits_are_not_finite_draws_not_finite(temperature, top_k, top_p, monkeypatch):
    """A NaN anywhere in a row, or a +inf, and the row draws NOT_FINITE (-1), on every path (greedy, the
    whole vocabulary, the nucleus by the CPU's loop and by PyTorch, top-k), a row of one NaN among -inf
    too; rows beside it draw as ever, one with tokens masked to -inf among them, and one with a min_p cut."""
    from backend.layers.sampler import NOT_FINITE

    torch.manual_seed(8)
    logits = torch.randn(7, 1000) * 3
    logits[1, 517] = float("nan")
    logits[2, 3] = float("inf")
    logits[3, ::2] = float("-inf")  # masked tokens: legitimate
    logits[4, 999] = float("nan")
    logits[4, 0] = float("inf")
    logits[6] = float("-inf")
    logits[6, 10] = float("nan")
    sampling = settings(7, top_k, top_p, temperature=temperature)
    sampling.min_p = [0.0, 0.0, 0.0, 0.0, 0.05, 0.05, 0.0]
    finite = settings(2, top_k, top_p, seeds=[0, 3], temperature=temperature)
    finite.min_p = [0.0, 0.0]
    expected = sample(logits[[0, 3]], finite).tolist()
    for draws in draws_by_every_path(logits, sampling, monkeypatch):
        assert draws[1:3] == [NOT_FINITE] * 2 and draws[4] == draws[6] == NOT_FINITE
        assert [draws[0], draws[3]] == expected and draws[3] % 2 == 1
        assert draws[5] != NOT_FINITE


@pytest.mark.parametrize("typical_p", [0.2, 0.5, 0.9, 0.95])
def test_the_typical_cut_keeps_what_transformers_typical_warper_keeps(typical_p):
    """Rows of every sharpness, and a row with ties (tokens of equal probability stay or go together)."""
    from transformers.generation.logits_process import TypicalLogitsWarper

    from backend.layers.sampler import typical_cut

    torch.manual_seed(9)
    logits = torch.cat([torch.randn(40, 300) * scale for scale in (0.5, 1, 3, 8)])
    logits[0, :100] = logits[0, 0]  # a hundred-way tie
    warped = TypicalLogitsWarper(mass=typical_p)(None, logits.clone())
    values, token_ids = logits.sort(dim=-1, descending=True)
    ours = typical_cut(values, torch.full((len(logits),), typical_p))
    for row in range(len(logits)):
        expected = set(torch.isfinite(warped[row]).nonzero().flatten().tolist())
        assert set(token_ids[row][torch.isfinite(ours[row])].tolist()) == expected, row


def test_typical_rows_draw_from_their_cut_after_top_k_and_temperature_beside_other_rows():
    """The typical cut takes what top-k and the temperature leave, renormalized (transformers' warpers in
    that order); every token of that set is drawn and no other, and the rows beside draw as alone."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TypicalLogitsWarper,
    )

    torch.manual_seed(10)
    logits = torch.randn(1, 200)
    warped = logits.clone()
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(40), TypicalLogitsWarper(mass=0.5)):
        warped = warper(None, warped)
    expected = set(torch.isfinite(warped[0]).nonzero().flatten().tolist())
    crowd = torch.cat([torch.randn(2, 200), logits])
    drawn, neighbours = set(), []
    for n in range(3000):
        sampling = SamplingBatch([1.0, 0.0, 0.7], [0, 0, 40], [0.9, 1.0, 1.0], [1, 2, 3], [n] * 3)
        sampling.typical_p = [1.0, 1.0, 0.5]
        draws = sample(crowd, sampling).tolist()
        drawn.add(draws[2])
        neighbours.append(draws[:2])
    assert drawn == expected and 10 < len(expected) < 40
    alone = [
        sample(crowd[:2], SamplingBatch([1.0, 0.0], [0, 0], [0.9, 1.0], [1, 2], [n] * 2)).tolist()
        for n in range(3000)
    ]
    assert neighbours == alone


def test_a_typical_row_follows_the_renormalized_distribution_and_a_seed_repeats_it():
    """Probabilities 0.4, 0.3, 0.2, 0.1: entropy 1.28 nats, distances from it 0.36, 0.08, 0.33, 1.02; at
    typical_p 0.8 the three nearest (0.3, 0.2, 0.4: 0.9) stay, drawn in proportion 3:4:2 renormalized."""
    logits = probs_to_logits([0.4, 0.3, 0.2, 0.1]).repeat(4000, 1)
    sampling = batch(1.0, rows=4000, counters=list(range(4000)))
    sampling.typical_p = [0.8] * 4000
    draws = sample(logits, sampling).tolist()
    assert sample(logits, sampling).tolist() == draws
    for token, p in enumerate([0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0.0]):
        assert math.isclose(draws.count(token) / len(draws), p, abs_tol=0.03), token


def test_a_typical_row_whose_logits_are_not_finite_draws_not_finite():
    from backend.layers.sampler import NOT_FINITE

    logits = torch.randn(3, 100)
    logits[0, 7] = float("nan")
    logits[1, 3] = float("inf")
    sampling = batch(1.0, rows=3)
    sampling.typical_p = [0.5] * 3
    assert sample(logits, sampling).tolist()[:2] == [NOT_FINITE] * 2
