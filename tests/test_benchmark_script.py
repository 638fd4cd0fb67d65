"""The benchmark scripts run end to end (tiny settings): the figures are the scripts' job, not a test's."""

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT


def run_script(name: str, *args: str) -> str:
    """Run scripts/<name> with these options; its standard output, once it has exited cleanly."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random two-layer Llama as a GGUF file, with the default model's tokenizer cut to its vocabulary
    and room for 1,024 positions: the scripts' every step at once, not their figures. On the default
    model these tests took 4 minutes of the suite's 2 cores."""
    from backend.model.source import default_model_path
    from tests.backend.gguf_files import write_tiny_gguf
    from tests.backend.models import tiny_model

    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    return write_tiny_gguf(path, tiny_model("llama", max_position_embeddings=1024), default_model_path())


def test_the_benchmark_runs_and_writes_its_report_and_plots(tmp_path, tiny_gguf):
    out = tmp_path / "report" / "performance.md"  # in a folder not there yet
    run_script(
        "benchmark.py", "--model", str(tiny_gguf), "--concurrency", "1", "32", "--requests", "1",
        "--spread-requests", "2", "--tokens", "4", "--out", str(out),
    )  # fmt: skip
    report = out.read_text()
    assert "| 1 | " in report and "| 32 | " in report
    # measured for its latencies only, which each client's second request gives
    spread = r"^\| 32, arrivals spread out \| - \| \d+ \| \d+ \| \d+ \| \d+ \|$"
    assert re.search(spread, report, re.MULTILINE), report
    assert "TTFT bound at 32 streams" in report
    waits = re.search(r"its own /metrics at 32 streams: (\d+) ms on average .*, (\d+) ms of it", report)
    assert waits and int(waits[1]) >= int(waits[2]), report  # the wait for a row is a part of the whole
    assert "Engine ceiling (32 full rows" in report and "Naive server" in report
    # sampled on both sides of the 32 streams, so that the machine's drift between them shows
    assert "the mean of 6 samples of 4 steps, half just before and half just after" in report
    assert (out.parent / "performance-throughput.png").stat().st_size > 1000
    assert (out.parent / "performance-latency.png").stat().st_size > 1000


def test_the_load_memory_script_gives_a_starts_peak_beside_what_the_check_required(tiny_gguf):
    output = run_script("load_memory.py", "--model", str(tiny_gguf), "--dtype", "float32", "--starts", "1")
    row = r"^\| 1 \(the conversion\) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \|$"
    figures = re.search(row, output, re.MULTILINE)
    assert figures, output
    peak, loaded, required = (float(figure.replace(",", "")) for figure in figures.groups())
    assert peak >= loaded > 0 and required > 0, output
    assert "machine: " in output


def test_the_frontend_benchmark_gives_each_servers_tokens_and_its_workers_time_a_token():
    output = run_script(  # 1,024 tokens a round: the worker's CPU time is counted in 10 ms ticks
        "bench_frontend.py", "--streams", "2", "--tokens", "256", "--rate", "1000", "--rounds", "2",
        "--against", str(ROOT),
    )  # fmt: skip
    rows = re.findall(r"^\| (.+) \| ([\d,]+), ([\d,]+) \| (\d+), (\d+) \(median (\d+)\) \|$", output, re.M)
    assert [row[0] for row in rows] == ["this checkout", str(ROOT)], output
    for _, *figures in rows:
        assert all(int(figure.replace(",", "")) > 0 for figure in figures), output


def test_spread_arrivals_take_two_requests_a_client_at_least():
    """Each spread client's first request is not counted: with one, the row would be all NaN."""
    from scripts.benchmark import more_than_one

    assert more_than_one("2") == 2
    with pytest.raises(argparse.ArgumentTypeError, match="at least 2"):
        more_than_one("1")


def test_the_engine_benchmark_reports_steps_and_their_bandwidth_floor(tiny_gguf):
    output = run_script(
        "bench_engine.py", "--model", str(tiny_gguf), "--rows", "1", "2", "--max-tokens", "4",
        "--baseline-requests", "0",
    )  # fmt: skip
    # no baseline asked for: no generate row, and no ratio to it (it divided by zero)
    assert "generate, 1 request at a time" not in output
    assert re.search(r"^\| 1 \| [\d.]+ \| [\d.]+ \| - \|$", output, re.M) and "| 2 | " in output, output
    floor = re.search(r"= ([\d.]+) ms; measured step ([\d.]+) ms, ([\d.]+)x the floor", output)
    assert floor, output
    floor_ms, step_ms, ratio = map(float, floor.groups())
    assert floor_ms > 0 and abs(step_ms / floor_ms - ratio) < 0.05 * ratio


def test_the_engine_benchmark_takes_prompts_longer_than_its_rows_were(tiny_gguf):
    """Rows were 512 positions whatever --prompt-tokens said: 600-token prompts were refused, the timings
    were of nothing and the greedy comparison raised KeyError. Now the rows have room, and the decode
    step is the steps where every row decodes (not the prefill's)."""
    output = run_script(
        "bench_engine.py",
        *("--model", str(tiny_gguf), "--rows", "1", "--max-tokens", "4", "--prompt-tokens", "600"),
        *("--baseline-requests", "0", "--speculative-tokens", "0"),
    )
    step = re.search(r"^\| 1 \| [\d.]+ \| ([\d.]+) \| - \|$", output, re.M)
    assert step and float(step.group(1)) > 0, output
    assert "(positions up to 602)" in output and "identical to float32" in output, output


def test_a_profiled_steps_kernels_are_summed_by_what_they_do():
    """bench_engine's kinds of CUDA kernels (a GPU's profile only, so not run here end to end), on names
    as torch.profiler reports them on an H200."""
    from scripts.bench_engine import busy_summary, kernel_kinds

    busy = {
        "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNN": 2.0,
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>()": 1.5,
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<>::Params)": 0.5,
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>(float*)": 0.25,
        "void at::native::bitonicSortKVInPlace<2, -1, 16, 16, float, long>(T5, T6)": 0.25,
        "Memcpy HtoD (Pinned -> Device)": 0.125,
        "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<>>(long, T3)": 0.125,
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": 0.5,
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int)": 1.0,
    }
    assert kernel_kinds(busy) == [
        ("matrix products", 3.5, 2),
        ("other", 1.0, 1),
        ("attention", 0.5, 1),
        ("sampling", 0.5, 2),
        ("compiled (triton)", 0.5, 1),
        ("copies", 0.25, 2),
    ]
    summary = busy_summary(busy, step_ms=7.5)
    assert summary.startswith("the GPU busy 6.25 ms of a 7.50 ms step (profiled); by kind: ")
    assert "matrix products 3.500 ms (2 kernel names); other 1.000 ms (1 kernel names)" in summary
    assert "; most time: nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNN 2.000 ms; void cutlass" in summary


def test_the_perplexity_script_scores_every_mode_against_the_exact_one(tmp_path):
    from scripts.perplexity import MODES
    from tests.backend.models import write_tiny_causal_lm

    directory = write_tiny_causal_lm(tmp_path / "tiny", "llama")
    output = run_script("perplexity.py", "--model", str(directory), "--window", "64")
    rows = re.findall(r"^\| (.+) \| torch\.\w+ \| ([\d.]+) \| ([+-][\d.]+)% \|$", output, re.MULTILINE)
    assert [name for name, _, _ in rows] == [name for name, *_ in MODES], output
    assert rows[0][2] == "+0.00" and all(float(value) > 1 for _, value, _ in rows)


def test_the_perplexity_script_scores_an_fp8_checkpoints_fp8_products(tmp_path):
    from tests.backend.fp8_files import write_fp8_checkpoint

    write_fp8_checkpoint(tmp_path / "tiny-FP8", hidden_size=256, intermediate_size=384, head_dim=64)
    output = run_script(
        "perplexity.py", "--model", str(tmp_path / "tiny-FP8"), "--window", "64", "--fp8-products"
    )
    rows = dict(re.findall(r"^\| (.+?) \| torch\.\w+ \| ([\d.]+) \| [+-][\d.]+% \|$", output, re.MULTILINE))
    fp8, exact = (
        float(rows["FP8 products, as on a GPU with FP8 (`_scaled_mm` on this CPU)"]),
        float(rows["float32, dequantized (exact mode, the reference)"]),
    )
    assert abs(fp8 / exact - 1) < 0.05, output  # (a random model's, near its vocabulary's 512 either way)


def test_perplexity_is_the_exponent_of_the_mean_loss_of_each_window():
    from scripts.perplexity import TEXT, perplexity
    from tests.backend.models import tiny_model

    model = tiny_model("llama")
    token_ids = [(7 * i) % 500 + 2 for i in range(40)]
    losses = []
    for start in (0, 16, 32):  # windows of 16: each scores every token after its first
        chunk = torch.tensor([token_ids[start : start + 16]])
        log_probs = model(chunk).logits[0, :-1].log_softmax(-1)
        losses += (-log_probs.gather(-1, chunk[0, 1:, None])).squeeze(-1).tolist()
    expected = torch.tensor(losses).mean().exp().item()
    assert abs(perplexity(model, token_ids, window=16) - expected) < 1e-3 * expected
    assert len(TEXT.read_text().split()) > 3000  # the fixed text ships with the script


def test_a_report_replaces_its_own_block_only(tmp_path):
    """Another benchmark's end marker before this one's block must not make the block repeat what lies
    between (docs/performance.md once grew a copy of its sections that way)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from benchmark import write_report

    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- b:start -->\nold b\n<!-- b:end -->\nmiddle\n<!-- a:end -->\ntail\n")
    write_report(page, "A1", "<!-- a:start -->", "<!-- a:end -->")  # a stray end: the block goes last
    write_report(page, "A2", "<!-- a:start -->", "<!-- a:end -->")
    write_report(page, "B2", "<!-- b:start -->", "<!-- b:end -->")
    text = page.read_text()
    assert text.count("middle") == 1 and text.count("tail") == 1 and text.count("intro") == 1
    assert "A2" in text and "A1" not in text and "B2" in text and "old b" not in text


FAKE_LLAMA_SERVER = '''#!{python}
"""Stands in for llama.cpp's server, which CI does not build: /health, and /v1/completions streaming one
text chunk a token, a few milliseconds apart."""
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port = int(sys.argv[sys.argv.index("--port") + 1])


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        body = b'{{"status": "ok"}}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for _ in range(request["max_tokens"]):
            time.sleep(0.005)
            chunk = {{"choices": [{{"text": "a"}}]}}
            self.wfile.write(f"data: {{json.dumps(chunk)}}\\n\\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\\n\\n")

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def test_the_side_by_side_benchmark_measures_both_servers_in_turn(tmp_path):
    """The real server (the default model) and a stand-in for llama-server, both up at once: every round
    measures each, and the medians and their ratio come out."""
    fake = tmp_path / "llama-server"
    fake.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable))
    fake.chmod(0o755)
    output = run_script(
        "bench_side_by_side.py", "--llama-server", str(fake), "--rounds", "2", "--tokens", "8",
        "--prompt-words", "40",
    )  # fmt: skip
    assert len(re.findall(r"round \d this server: [\d.]+ tokens/s", output)) == 2
    assert len(re.findall(r"round \d llama-server: [\d.]+ tokens/s", output)) == 2
    figures = re.search(r"one stream: ([\d.]+) against llama-server's ([\d.]+) tokens/s \(([\d.]+)x", output)
    assert figures, output
    ours, theirs, ratio = map(float, figures.groups())
    assert ours > 0 and theirs > 0 and abs(ours / theirs - ratio) < 0.01 + 0.01 * ratio
    assert re.search(r"a fresh prompt's first token: [\d.]+ against [\d.]+ s", output)
