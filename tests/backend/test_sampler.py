"""The sampling functions on their own."""

import math

import torch

from backend.sampler import SamplingBatch, apply_temperature, sample, top_k_top_p


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


def batch(temperature, top_k=0, top_p=1.0, seeds=None, rows=1):
    seeds = seeds or [None] * rows
    generators = [
        None if temperature == 0 else torch.Generator().manual_seed(seed if seed is not None else 1234)
        for seed in seeds
    ]
    return SamplingBatch([float(temperature)] * rows, [top_k] * rows, [top_p] * rows, generators)


def test_temperature_zero_is_argmax():
    logits = torch.randn(4, 1000)
    assert sample(logits, batch(0, rows=4)).tolist() == logits.argmax(-1).tolist()


def test_sampling_follows_the_distribution():
    probs = [0.1, 0.2, 0.3, 0.4]
    logits = probs_to_logits(probs)
    generator_batch = batch(1.0)
    draws = [sample(logits, generator_batch).item() for _ in range(4000)]
    for token, p in enumerate(probs):
        frequency = draws.count(token) / len(draws)
        assert math.isclose(frequency, p, abs_tol=0.03), (token, frequency)


def test_sampling_never_picks_a_token_that_was_cut():
    logits = probs_to_logits([0.4, 0.3, 0.2, 0.1])
    cut = batch(1.0, top_k=2)
    assert {sample(logits, cut).item() for _ in range(300)} == {0, 1}


def test_a_seeded_row_draws_the_same_tokens_whatever_its_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(1, 300)
    alone = [sample(logits, batch(0.9, 50, 0.95, seeds=[7])).item() for _ in range(1)]
    crowd_logits = torch.cat([torch.randn(2, 300), logits, torch.randn(3, 300)])
    crowd = SamplingBatch(
        [0.0, 1.5, 0.9, 0.7, 0.0, 1.0],
        [0, 1000, 50, 3, 0, 0],
        [1.0, 0.5, 0.95, 1.0, 1.0, 0.9],
        [
            None,
            torch.Generator().manual_seed(1),
            torch.Generator().manual_seed(7),
            torch.Generator(),
            None,
            torch.Generator().manual_seed(2),
        ],
    )
    assert sample(crowd_logits, crowd)[2].item() == alone[0]


def test_rows_without_a_cut_nucleus_rows_and_top_k_rows_share_a_step():
    torch.manual_seed(1)
    logits = torch.randn(4, 200)
    mixed = SamplingBatch(
        [1.0, 1.0, 1.0, 0.0],
        [0, 0, 5, 0],
        [1.0, 0.5, 1.0, 1.0],
        [torch.Generator().manual_seed(i) for i in range(3)] + [None],
    )
    draws = [sample(logits, mixed).tolist() for _ in range(200)]
    top5 = set(logits[2].topk(5).indices.tolist())
    probs = logits[1].softmax(-1).sort(descending=True)
    nucleus_size = int((probs.values.cumsum(-1) - probs.values < 0.5).sum())
    nucleus = set(probs.indices[:nucleus_size].tolist())
    assert {d[2] for d in draws} <= top5
    assert {d[1] for d in draws} <= nucleus
    assert len({d[0] for d in draws}) > 20  # the whole vocabulary is in play
    assert {d[3] for d in draws} == {logits[3].argmax().item()}


def test_each_seeded_row_is_reproducible_alone():
    logits = torch.randn(1, 1000)
    for top_k, top_p in ((0, 1.0), (0, 0.9), (40, 1.0), (40, 0.9)):
        first = [sample(logits, batch(1.0, top_k, top_p, seeds=[5])).item() for _ in range(1)]
        again = [sample(logits, batch(1.0, top_k, top_p, seeds=[5])).item() for _ in range(1)]
        assert first == again


def test_the_nucleus_without_a_full_sort_is_the_same_cut():
    from backend.sampler import nucleus_cut

    torch.manual_seed(2)
    peaked = torch.randn(3, 5000) * 4  # the nucleus lies among the best few hundred tokens
    flat = torch.randn(1, 5000) * 0.01  # it does not: the whole vocabulary is sorted
    for logits, top_p in ((peaked, [0.9, 0.5, 0.99]), (flat, [0.9])):
        top_p = torch.tensor(top_p)
        values, token_ids = nucleus_cut(logits, top_p)
        full_values, full_ids = top_k_top_p(logits, torch.zeros(len(top_p), dtype=torch.long), top_p)
        for row in range(len(top_p)):
            kept = set(token_ids[row][torch.isfinite(values[row])].tolist())
            assert kept == set(full_ids[row][torch.isfinite(full_values[row])].tolist())
            assert kept


def test_a_flat_row_widens_its_own_nucleus_only():
    from backend.sampler import nucleus_cut

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
