"""scripts/benchmark.py runs end to end (tiny settings): the figures are the script's job, not a test's."""

import subprocess
import sys

from tests.conftest import ROOT


def test_the_benchmark_runs_and_writes_its_report_and_plots(tmp_path):
    out = tmp_path / "performance.md"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "benchmark.py"),
            "--concurrency",
            "1",
            "2",
            "--requests",
            "1",
            "--tokens",
            "4",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = out.read_text()
    assert "| 1 | " in report and "| 2 | " in report
    assert "Engine ceiling (32 full rows" in report and "Naive server" in report
    assert (tmp_path / "performance-throughput.png").stat().st_size > 1000
    assert (tmp_path / "performance-latency.png").stat().st_size > 1000
