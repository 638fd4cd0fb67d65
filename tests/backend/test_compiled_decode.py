"""`--compile`: decode steps of few rows run compiled by torch.compile, with the eager step's results.

Each decode step an eager engine takes is run again through a compiled runner on a copy of the cache
as it was before the step: the logits and the keys and values written must be the eager step's, for
one row, for rows with a free row among them, and with 4-bit weights.
"""

from __future__ import annotations

import pytest
import torch

from backend.engine.engine import Engine
from backend.layers.row_cache import KVShape, RowCache
from backend.messages import SamplingParams, Submit
from backend.model.decoder_runner import DecoderRunner
from backend.model.model_runner import ModelRunner
from backend.quant.quantize import quantize_model
from tests.backend.models import MarkerTokenizer, drive, tiny_model


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def record_decode_steps(engine: Engine) -> list[tuple]:
    """Every decode-only forward of the engine: inputs, the cache before, the logits, the cache after."""
    forward, steps = engine._forward, []

    def recording(inputs):
        before = [t.clone() for t in engine.runner.cache.keys + engine.runner.cache.values]
        logits = forward(inputs)
        if not inputs.layout.prompts:
            after = [t.clone() for t in engine.runner.cache.keys + engine.runner.cache.values]
            step = (inputs.token_ids, inputs.positions, inputs.layout, inputs.keep)
            steps.append((*step, before, logits.clone(), after))
        return logits

    engine._forward = recording
    return steps


def replay_decode_steps(
    runner: DecoderRunner,
    cache: RowCache,
    steps: list[tuple],
    logits_tolerance: float,
    cache_tolerance: float,
) -> None:
    """Each recorded step (`record_decode_steps`) through `runner`, from a copy of the cache as it was
    before: its logits and the cache after, held to the recorded ones."""
    for input_ids, positions, layout, keep, before, logits, after in steps:
        for tensor, saved in zip(cache.keys + cache.values, before, strict=True):
            tensor.copy_(saved)
        with torch.inference_mode():
            cache.plan_step(layout)
            replayed, _ = runner(input_ids, positions, layout, cache, keep)
        torch.testing.assert_close(replayed, logits, atol=logits_tolerance, rtol=logits_tolerance)
        for tensor, expected in zip(cache.keys + cache.values, after, strict=True):
            torch.testing.assert_close(tensor, expected, atol=cache_tolerance, rtol=cache_tolerance)


def test_compiled_decode_steps_give_the_eager_steps_logits_and_cache_writes():
    model = tiny_model("llama")
    quantize_model(model, "int4")  # the served default's kernels, with float32 activations
    engine = Engine(model, MarkerTokenizer(), rows=4, max_seq_len=64)
    steps = record_decode_steps(engine)
    # Three rows decode together; the middle one ends first, leaving a free row inside the span;
    # then the first ends and the last decodes alone.
    drive(
        engine,
        [
            (0, Submit("a", (5, 6, 7), greedy(6))),
            (0, Submit("b", (8, 9), greedy(2))),
            (0, Submit("c", (10, 11, 12, 13), greedy(9))),
        ],
    )
    shapes = {(layout.decode_queries, layout.decode_rows) for _, _, layout, *_ in steps}
    assert {(3, 3), (2, 3), (1, 3)} <= shapes and any(layout.has_free_rows for _, _, layout, *_ in steps)

    compiled = DecoderRunner(model, compile_decode=True)
    cache = RowCache(
        KVShape.of(model.config), 4, 64, engine.runner.cache_dtype, engine.device, spare_rows=1
    )  # as the engine\'s: its embedding row too
    replay_decode_steps(compiled, cache, steps, logits_tolerance=1e-4, cache_tolerance=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it did compile


def test_after_warm_up_no_decode_step_compiles_again_and_the_text_is_the_eager_engines():
    """Warm-up compiles every graph: traffic of 1 to 8 rows, some of them scattered, compiles none
    (a compile in a server is a minute with every stream stalled)."""
    model = tiny_model("llama")
    quantize_model(model, "int4")
    eager = Engine(model, MarkerTokenizer(), rows=10, max_seq_len=64)
    compiled = Engine(model, MarkerTokenizer(), rows=10, max_seq_len=64, compile_decode=True)
    compiled.warm_up()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # Eight rows ending one after another, and one arriving late into a free row among them.
    arrivals = [(0, Submit(f"r{i}", (5 + i, 6, 7), greedy(3 + 2 * i))) for i in range(8)]
    arrivals.append((6, Submit("late", (9, 9), greedy(12))))
    results = []
    for engine in (eager, compiled):
        pieces = drive(engine, arrivals)
        results.append({key: [piece.text for piece in value] for key, value in pieces.items()})
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert results[0] == results[1]


def test_each_compiled_runner_runs_its_own_graphs():
    """The compiled step skips its guards on the weights and the cache (fixed for a runner's life), so
    a graph compiled for one runner (here a cache of other sizes) must never run for another."""
    texts = {}
    for compile_decode in (False, True):
        for seed, max_seq_len in ((0, 64), (1, 96)):
            model = tiny_model("llama", seed=seed)
            engine = Engine(
                model, MarkerTokenizer(), rows=4, max_seq_len=max_seq_len, compile_decode=compile_decode
            )
            engine.warm_up()
            pieces = drive(
                engine, [(0, Submit("a", (5, 6, 7), greedy(8))), (0, Submit("b", (9,), greedy(5)))]
            )
            texts[compile_decode, seed] = {
                key: [piece.text for piece in value] for key, value in pieces.items()
            }
    assert texts[True, 0] == texts[False, 0] and texts[True, 1] == texts[False, 1]
    assert texts[False, 0] != texts[False, 1]  # two different models: a shared graph would show


@pytest.mark.parametrize(
    "architecture, what", [("qwen3_moe", "a mixture of experts"), ("lfm2", "convolution")]
)
def test_a_mixture_of_experts_or_convolution_layers_are_served_uncompiled_with_a_warning(
    architecture, what, caplog
):
    """The experts' routing loops over the experts each step chose, and LFM2's convolution layers advance
    the rows' states in place: torch.compile has no whole graph of either, so --compile leaves such a
    model's decode steps eager, and says so."""
    runner = ModelRunner(tiny_model(architecture), rows=2, max_seq_len=64, compile_decode=True).decoder
    assert runner.compiled_decode is None and not runner.whole_graph
    assert f"the decode steps of a model with {what}" in caplog.text
