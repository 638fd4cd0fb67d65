"""Decode steps at static shapes (backend/model/decode_graphs.py): padded rows, bucketed spans, the eager
step's results.

On a CPU the static buffers and the step function run without capture, so what a CUDA graph would
replay is held here to the eager step: logits, cache writes (the padding queries' only at the
positions no query reads) and whole texts. Where CUDA is present the graphs are captured and
replayed for real.
"""

from __future__ import annotations

import pytest
import torch

from backend.engine.engine import Engine
from backend.layers.row_cache import KVShape, RowCache
from backend.messages import SamplingParams, Submit
from backend.model.decode_graphs import bucket, row_buckets, span_buckets
from backend.model.decoder_runner import DecoderRunner
from backend.model.step_plan import GRAPH
from tests.backend.models import TINY_WINDOW, MarkerTokenizer, drive, tiny_model
from tests.backend.test_compiled_decode import greedy, record_decode_steps

MAX_SEQ_LEN = 300  # spans bucketed as 128, 256 and 300


def test_buckets_cover_every_count_of_rows_and_every_span():
    assert row_buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert row_buckets(10) == (1, 2, 4, 8, 10)
    assert row_buckets(1) == (1,)
    assert span_buckets(2048) == (128, 256, 512, 1024, 2048)
    assert span_buckets(300) == (128, 256, 300)
    assert span_buckets(100) == (100,)
    assert [bucket(n, row_buckets(32)) for n in (1, 3, 9, 17, 25, 32)] == [1, 4, 16, 24, 32, 32]


def steps_of_an_eager_engine(model: torch.nn.Module) -> tuple[Engine, list[tuple]]:
    """Decode steps of 1 to 5 rows among 6, with free rows among them, spans in two buckets."""
    engine = Engine(model, MarkerTokenizer(), rows=6, max_seq_len=MAX_SEQ_LEN)
    steps = record_decode_steps(engine)
    long_prompt = tuple(range(2, 142))  # its row decodes at positions past 128
    drive(
        engine,
        [
            (0, Submit("a", (5, 6, 7), greedy(6))),
            (0, Submit("b", (8, 9), greedy(2))),
            (0, Submit("c", (10, 11, 12, 13), greedy(12))),
            (2, Submit("d", long_prompt, greedy(5))),
            (3, Submit("e", (14,), greedy(4))),
            (3, Submit("f", (15, 16), greedy(3))),
        ],
    )
    return engine, steps


def test_static_shape_steps_give_the_eager_steps_logits_and_cache_writes():
    model = tiny_model("llama")
    engine, steps = steps_of_an_eager_engine(model)
    shapes = {(layout.decode_queries, layout.has_free_rows, layout.span > 128) for _, _, layout, *_ in steps}
    # (queries, a free row among them, a span past the first bucket)
    assert {(1, True, False), (3, False, False), (3, True, True), (5, False, False)} <= shapes

    runner = DecoderRunner(model)
    cache = RowCache(
        KVShape.of(model.config), 6, MAX_SEQ_LEN, engine.runner.cache_dtype, engine.device, spare_rows=1
    )  # as the engine\'s: its embedding row too
    runner.use_graphs(cache, capture=False)
    last = MAX_SEQ_LEN - 1  # where padding queries write: a position no query reads
    for input_ids, positions, layout, keep, before, logits, after in steps:
        for tensor, saved in zip(cache.keys + cache.values, before, strict=True):
            tensor.copy_(saved)
        assert runner.plan.path(layout).layers is GRAPH
        with torch.inference_mode():
            cache.plan_step(layout)
            static_logits, _ = runner(input_ids, positions, layout, cache, keep)
        torch.testing.assert_close(static_logits, logits, atol=1e-5, rtol=1e-5)
        for tensor, expected in zip(cache.keys + cache.values, after, strict=True):
            # Padded rows change how the matrix products block their sums: the last bit may differ.
            torch.testing.assert_close(tensor[:, :, :last], expected[:, :, :last], atol=1e-6, rtol=1e-5)


# Gemma 3: windows, two rotations; Phi-3: q, k and v one layer, a window in every layer, part of each
# head rotated
FAMILIES = {
    "llama": {},
    "gemma3_text": {},
    "phi3": {"partial_rotary_factor": 0.75, "sliding_window": TINY_WINDOW},
}


@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_an_engine_on_static_shapes_writes_the_eager_engines_text(architecture):
    """Greedy and seeded sampling, rows joining and leaving mid-flight, a prompt long enough to change
    the span's bucket, and the cache full to its last position: the same pieces either way."""
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True)
    arrivals = [(0, Submit(f"r{i}", (5 + i, 6, 7), greedy(3 + 3 * i))) for i in range(5)]
    arrivals += [
        (1, Submit("sampled", (20, 21), params)),
        (4, Submit("long", tuple(range(2, 200)), greedy(200))),  # runs into max_seq_len
        (9, Submit("late", (9, 9), greedy(12))),
    ]
    results = []
    for static in (False, True):
        model = tiny_model(architecture, **FAMILIES[architecture])
        engine = Engine(model, MarkerTokenizer(), rows=8, max_seq_len=MAX_SEQ_LEN)
        if static:
            engine.runner.decoder.use_graphs(engine.runner.cache, capture=False)
        pieces = drive(engine, arrivals)
        results.append({key: [(p.text, p.finish_reason) for p in value] for key, value in pieces.items()})
    assert results[1]["long"][-1][1] == "length"
    assert results[0] == results[1]


@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_with_compile_the_static_shape_step_is_the_compiled_one_and_writes_the_eager_text(architecture):
    """On a GPU `--compile` has the graphs capture the compiled step; here the same static step runs
    compiled without capture, over row buckets and two span buckets, with the eager engine's text."""
    arrivals = [(0, Submit(f"r{i}", (5 + i, 6, 7), greedy(3 + 4 * i))) for i in range(4)]
    arrivals.append((2, Submit("long", tuple(range(2, 140)), greedy(8))))
    torch._dynamo.utils.counters.clear()
    results = []
    for static in (False, True):
        engine = Engine(
            tiny_model(architecture, **FAMILIES[architecture]),
            MarkerTokenizer(),
            rows=6,
            max_seq_len=MAX_SEQ_LEN,
            compile_decode=static,
        )
        if static:
            engine.runner.decoder.use_graphs(engine.runner.cache, capture=False)
        results.append({key: [p.text for p in value] for key, value in drive(engine, arrivals).items()})
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it did compile
    assert results[0] == results[1]


def test_a_step_that_cannot_be_captured_is_served_eagerly(caplog):
    """A model whose decode step capture refuses (here: no CUDA at all to capture on, where there is
    none) starts all the same, with eager steps and the reason in the log."""
    if torch.cuda.is_available():
        pytest.skip("here capture would succeed")
    model = tiny_model("llama")
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=64)
    engine.runner.decoder.use_graphs(engine.runner.cache, capture=True)
    engine.warm_up()
    assert engine.runner.decoder.graphs is None
    assert "CUDA graphs could not be captured: decode steps run eagerly" in caplog.text
    eager = Engine(tiny_model("llama"), MarkerTokenizer(), rows=4, max_seq_len=64)
    arrivals = [(0, Submit("a", (5, 6, 7), greedy(6))), (1, Submit("b", (8,), greedy(4)))]
    texts = [
        {key: [p.text for p in value] for key, value in drive(e, arrivals).items()} for e in (engine, eager)
    ]
    assert texts[0] == texts[1]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@needs_cuda
def test_captured_graphs_replay_the_eager_engines_text_on_cuda():
    arrivals = [(0, Submit(f"r{i}", (5 + i, 6, 7), greedy(4 + 5 * i))) for i in range(6)]
    arrivals.append((3, Submit("long", tuple(range(2, 150)), greedy(30))))
    results = []
    for graphs in (False, True):
        model = tiny_model("llama").to("cuda")
        engine = Engine(model, MarkerTokenizer(), rows=8, max_seq_len=MAX_SEQ_LEN, cuda_graphs=graphs)
        engine.warm_up()
        assert (engine.runner.decoder.graphs is not None) == graphs
        if graphs:  # every (rows, span) bucket, captured before the first request
            buckets = len(row_buckets(8)) * len(span_buckets(MAX_SEQ_LEN))
            assert len(engine.runner.decoder.graphs.graphs) == buckets
        pieces = drive(engine, arrivals)
        results.append({key: [p.text for p in value] for key, value in pieces.items()})
    assert results[0] == results[1]


@needs_cuda
def test_a_replayed_step_and_its_sampling_make_the_host_wait_for_nothing_on_cuda():
    """The host waits for the GPU once a step, to read the sampled tokens (engine._sample); the decode
    graph, its inputs' copies and sampling itself must not wait (set_sync_debug_mode raises)."""
    from backend.layers.sampler import SamplingBatch, sample

    model = tiny_model("llama").to("cuda")
    engine = Engine(model, MarkerTokenizer(), rows=8, max_seq_len=MAX_SEQ_LEN)
    engine.warm_up()
    steps = record_decode_steps(engine)
    drive(engine, [(0, Submit(f"r{i}", (5 + i, 6), greedy(4))) for i in range(3)])
    input_ids, positions, layout, keep, *_ = steps[-1]
    batch = SamplingBatch([0, 0.8, 0.8], [0, 40, 0], [1, 0.9, 0.9], [1, 2, 3], [4, 4, 4])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            engine.runner.cache.plan_step(layout)
            logits, _ = engine.runner.decoder(input_ids, positions, layout, engine.runner.cache, keep)
            tokens = sample(logits[:1].expand(3, -1).float(), batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == (3,)
