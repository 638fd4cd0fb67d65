"""scripts/gpu_check.sh stays runnable: a lent GPU machine gives 15 minutes in all, so the check it runs
must not be debugged there. Here, without CUDA, it runs its parts on a tiny Llama and says so. Those parts
are also this suite's run of the scripts they call with these options: bench_engine.py on a random Llama
quantized to int4 at load, with graphs, a profile and transformers' static-cache baseline, and
random_llama.py's model directory, which the HTTP part serves."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_check_runs_every_part_on_a_cpu_and_writes_its_figures(tmp_path):
    env = dict(
        os.environ,
        OUT=str(tmp_path),
        PYTHON=sys.executable,
        CUDA_VISIBLE_DEVICES="",  # the CPU's path, even on a machine with a GPU
        GPU_CHECK_SKIP="cuda-tests",  # pytest within pytest: those tests are in this suite already
    )
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert "no CUDA device: the CUDA parts are skipped" in summary
    assert "cuda-tests: skipped (GPU_CHECK_SKIP)" in summary
    for part in ("greedy-exact", "engine-tiny", "write-model", "http-4", "frontend"):
        assert f"{part}: exit 0 after" in summary, summary
    assert summary.rstrip().endswith("done")
    assert "token for token model.generate's" in (tmp_path / "exact.log").read_text()
    engine = (tmp_path / "engine_tiny.log").read_text()
    # On a CPU both engines run eager steps (graphs need CUDA); the table, the floor, the baseline and
    # the profile are what the GPU's run prints too.
    assert "random Llama tiny (int4 weights), torch.float32" in engine
    assert "| active rows | eager tokens/s | graphs tokens/s |" in engine and "| 4 |" in engine
    assert "x the floor" in engine and re.search(r"host, 10 steps: [\d.]+ ms a step in Python", engine)
    assert "by tottime:" in engine and "by cumulative:" in engine and "engine.py" in engine
    static = re.findall(r"transformers' generate, static cache, a batch of (\d): ([\d.]+) tokens/s", engine)
    assert [batch for batch, _ in static] == ["4"] and float(static[0][1]) > 0
    counts = re.findall(r"(eager|graphs): (\d+) PyTorch operations \(aten\) a \d-row step", engine)
    assert [name for name, _ in counts] == ["eager", "graphs"] and all(int(n) > 50 for _, n in counts)
    first_tokens = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \|$", engine, re.MULTILINE)
    assert [int(length) for length, _, _ in first_tokens] == [37, 61, 93, 130, 201], engine
    report = (tmp_path / "http_report.md").read_text()
    assert "| 4 |" in report and "Engine ceiling" in report
    assert "backend ready" in (tmp_path / "server.log").read_text()
    assert re.search(
        r"^\| this checkout \| [\d,]+, [\d,]+, [\d,]+ \| ", (tmp_path / "frontend.log").read_text(), re.M
    )
