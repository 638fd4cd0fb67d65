"""What runs each step shape (backend/model/step_plan.py): decided once, logged at warm-up, and what the
runner actually dispatches to."""

from __future__ import annotations

import logging

import pytest
import torch

from backend.engine.engine import Engine
from backend.layers.decode_ops import EAGER
from backend.messages import Submit
from backend.model import step_plan
from backend.model.decoder_runner import DecoderRunner
from backend.model.native_decode import NativeDecode
from backend.model.step_plan import BATCH_ATTENTION, FORWARD, LOOP, LOOP_ATTENTION, NATIVE, TRANSFORMERS
from backend.quant import block_weights
from tests.backend.models import MarkerTokenizer, drive, tiny_model
from tests.backend.test_compiled_decode import greedy
from tests.backend.test_native_decode import served_like_the_default

needs_blocks = pytest.mark.skipif(
    not block_weights.available(torch.device("cpu")),
    reason="this CPU has no AVX2 (or no compiler): no weights in blocks, so no native decode steps",
)


@needs_blocks
def test_a_model_served_like_the_default_runs_native_steps_below_the_many_rows_switch():
    """The question nobody could answer: what runs a 20-row bfloat16 step? The Python loop over the layers,
    its projections by their path for many rows; below 16 rows, the layers in one C++ call on blocks."""
    runner = DecoderRunner(served_like_the_default(), rows=32)
    projections = runner.projections()
    switch = min(p.many_rows_from() for p in projections)
    assert switch == 16
    assert [runner.plan.decode[n - 1].layers for n in (1, 15, 16, 20, 32)] == [
        NATIVE,
        NATIVE,
        LOOP,
        LOOP,
        LOOP,
    ]
    twenty = runner.plan.decode[19]
    assert twenty.attention == LOOP_ATTENTION
    assert "blocks" in runner.plan.decode[0].projections and "blocks" not in twenty.projections
    assert twenty.projections == ", ".join(dict.fromkeys(p.path_at(20) for p in projections))


@needs_blocks
def test_the_runner_runs_what_its_plan_says(monkeypatch):
    """Steps of 1 to 17 rows through an engine: the native loop ran for the shapes the plan gave it only."""
    engine = Engine(served_like_the_default(), MarkerTokenizer(), rows=20, max_seq_len=64)
    native_rows, call = [], NativeDecode.__call__

    def counting(self, hidden, *args):
        native_rows.append(hidden.shape[0])
        return call(self, hidden, *args)

    monkeypatch.setattr(NativeDecode, "__call__", counting)
    many = [(6, Submit(f"many-{i}", (20 + i, 21, 22), greedy(3))) for i in range(16)]
    drive(engine, [(0, Submit("a", (5, 6, 7), greedy(12))), *many])
    planned = {n for n in range(1, 21) if engine.runner.plan.decode[n - 1].layers is NATIVE}
    assert set(native_rows) and set(native_rows) <= planned
    assert max(native_rows) < 16 and 17 not in native_rows


@needs_blocks
def test_new_operations_give_a_new_plan():
    """Switching the runner to PyTorch's operations replans: no native step is left behind (a test that
    set the operations alone compared the C++ loop with itself)."""
    runner = DecoderRunner(served_like_the_default(), rows=32)
    runner.use_ops(EAGER)
    assert runner.native is None
    assert {path.layers for path in runner.plan.decode[:15]} == {LOOP}
    assert {path.layers for path in runner.plan.decode[15:]} == {FORWARD}
    assert runner.plan.decode[0].attention != LOOP_ATTENTION


def test_a_head_size_the_loop_lacks_attends_by_pytorchs_kernel_in_every_step():
    runner = DecoderRunner(served_like_the_default(head_dim=16), rows=8)
    assert runner.attend is EAGER.attend
    assert {path.attention for path in runner.plan.decode} == {BATCH_ATTENTION}


def test_a_model_outside_the_runner_runs_transformers_forward_for_every_shape():
    engine = Engine(tiny_model("gpt2"), MarkerTokenizer(), rows=4, max_seq_len=32)
    assert engine.runner.decoder is None
    plan = engine.runner.plan
    assert {path.layers for path in (*plan.decode, plan.long_rows, plan.prompts)} == {TRANSFORMERS}


def test_the_plan_is_logged_by_bucket_at_warm_up(caplog):
    engine = Engine(tiny_model("llama"), MarkerTokenizer(), rows=20, max_seq_len=64)
    with caplog.at_level(logging.INFO, logger=step_plan.__name__):
        engine.warm_up()
    lines = engine.runner.plan.describe()
    assert any(line.startswith("decode steps of 1-") for line in lines)
    assert lines[-1].startswith("steps with prompts")
    buckets = [line for line in lines if line.startswith("decode steps of ")]
    covered = [int(n) for line in buckets for n in line.split(" rows:")[0].split(" of ")[1].split("-")]
    assert covered[0] == 1 and covered[-1] == 20  # every row count, in order
    assert "step plan of model:\n  " + "\n  ".join(lines) in caplog.text


def test_a_step_past_the_plan_is_refused():
    runner = DecoderRunner(tiny_model("llama"), rows=4)
    layout = type("Layout", (), {"prompts": (), "long_rows": (), "decode_queries": 5})()
    with pytest.raises(ValueError, match="a step of 5 rows: the plan goes up to 4"):
        runner.plan.path(layout)
