"""The backend as the frontend sees it: a process behind an inbox and an outbox."""

import os
import subprocess
import sys

import psutil
import pytest

from backend.messages import BackendConfig, SamplingParams, StepOutput
from backend.model.loader import pick_device, pick_dtype
from backend.process import BackendDied, BackendProcess, BackendStartError, _mp
from backend.utils.thread_binding import PROCESS_CPUS, cores_of
from tests.backend.dying_backend import send_then_die_mid_message


def collect(backend, request_ids, timeout=60):
    """Read the outbox until every request has finished; return their pieces."""
    pieces = {request_id: [] for request_id in request_ids}
    open_requests = set(request_ids)
    while open_requests:
        message = backend.receive(timeout)
        assert isinstance(message, StepOutput)
        for piece in message.pieces:
            pieces[piece.request_id].append(piece)
            if piece.finished:
                open_requests.discard(piece.request_id)
    return pieces


@pytest.fixture(scope="module")
def model_backend():
    # One thread a core, as a server runs by default (the suite's OMP_NUM_THREADS=1 aside): bound to them.
    threads = len(cores_of(PROCESS_CPUS))
    backend = BackendProcess(BackendConfig(rows=4, max_seq_len=256, torch_threads=threads)).start()
    yield backend, backend.wait_ready(timeout=300)
    backend.stop()


def test_the_real_backend_serves_requests_over_its_queues(model_backend):
    backend, ready = model_backend
    assert ready.model_name == "SmolLM2-135M-Instruct"
    assert ready.rows == 4 and ready.max_seq_len == 256
    # The default mode: bf16 where the CPU multiplies it natively (or on a GPU), float32 elsewhere.
    device = pick_device("auto")
    assert ready.dtype == str(pick_dtype("auto", device)).removeprefix("torch.") and ready.device == str(
        device
    )

    from transformers import AutoTokenizer  # the frontend will do the same with tokenizer_path

    tokenizer = AutoTokenizer.from_pretrained(ready.tokenizer_path)
    prompt = tokenizer("The capital of France is").input_ids
    backend.submit("paris", prompt, SamplingParams(temperature=0, max_tokens=8))
    backend.submit("cut", prompt, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    backend.cancel("cut")
    pieces = collect(backend, ["paris", "cut"])
    assert "".join(p.text for p in pieces["paris"]).startswith(" Paris")
    assert pieces["paris"][-1].prompt_tokens == len(prompt)
    assert pieces["cut"][-1].finish_reason == "cancelled"


@pytest.mark.skipif(len(cores_of(PROCESS_CPUS)) < 2, reason="one core: no thread to keep off another's")
def test_the_backends_threads_hold_a_core_each(model_backend):
    """The pass's threads bound to a core each (backend/utils/thread_binding.py), so that work beside
    them on one core cannot stop the step for as long as it lasts; the other threads on every core."""
    backend, _ = model_backend
    process = psutil.Process(backend.process.pid)
    cores = cores_of(PROCESS_CPUS)
    assert os.sched_getaffinity(process.pid) == set(cores[0])  # the engine's thread, OpenMP's first
    affinities = [os.sched_getaffinity(thread.id) for thread in process.threads()]
    assert set(PROCESS_CPUS) in affinities  # the others, those the model's loading started among them
    for core in cores[1:]:
        assert set(core) in affinities, f"no thread bound to core {core} alone: {affinities}"


def test_a_backend_short_of_memory_refuses_to_start_and_says_what_is_missing():
    backend = BackendProcess(BackendConfig(rows=1_000_000, max_seq_len=2048)).start()
    with pytest.raises(BackendStartError) as failure:
        backend.wait_ready(timeout=120)
    message = str(failure.value)
    assert "RAM: needs" in message and "GiB short" in message and "1000000 rows" in message
    backend.process.join(10)
    assert backend.process.exitcode == 1


def test_an_unknown_model_path_is_a_clear_start_error(tmp_path):
    backend = BackendProcess(BackendConfig(model=str(tmp_path / "missing" / "model.gguf"))).start()
    with pytest.raises(BackendStartError, match="does not exist"):
        backend.wait_ready(timeout=60)


def test_the_mock_backend_speaks_the_same_messages():
    backend = BackendProcess(BackendConfig(mock=True, rows=2, mock_tokens_per_second=200)).start()
    try:
        ready = backend.wait_ready(timeout=30)
        assert ready.model_name == "mock" and ready.tokenizer_path is None
        for i in range(3):
            backend.submit(f"m{i}", [1, 2, i], SamplingParams(max_tokens=4))
        pieces = collect(backend, ["m0", "m1", "m2"])
        assert all(p[-1].finish_reason == "length" and p[-1].completion_tokens == 4 for p in pieces.values())
    finally:
        backend.stop()


def test_the_mock_backend_refuses_what_the_engine_refuses_as_the_requests_fault():
    backend = BackendProcess(BackendConfig(mock=True, rows=2, max_seq_len=16)).start()
    try:
        backend.wait_ready(timeout=30)
        backend.submit("empty", [], SamplingParams(max_tokens=4))
        backend.submit("full", list(range(16)), SamplingParams(max_tokens=0))
        backend.submit("fits", list(range(15)), SamplingParams(max_tokens=0))
        pieces = collect(backend, ["empty", "full", "fits"])
        for name in ("empty", "full"):
            [refused] = pieces[name]
            assert refused.finish_reason == "error" and refused.invalid == "prompt_ids", refused
        assert "16 tokens" in pieces["full"][0].error
        assert pieces["fits"][-1].finish_reason == "length" and pieces["fits"][-1].invalid is None
    finally:
        backend.stop()


def test_a_dead_backend_wakes_its_reader():
    backend = BackendProcess(BackendConfig(mock=True)).start()
    backend.wait_ready(timeout=30)
    backend.process.kill()
    with pytest.raises(BackendDied):
        backend.receive(timeout=30)
    backend.stop()


def test_the_frontend_side_never_imports_torch():
    code = (
        "import sys, backend.process, backend.mock, backend.messages, backend.engine.stop_matcher\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_backend_exits_when_its_parent_is_killed():
    code = (
        "from backend.process import BackendProcess\n"
        "from backend.messages import BackendConfig\n"
        "import time\n"
        "if __name__ == '__main__':\n"
        "    backend = BackendProcess(BackendConfig(mock=True)).start()\n"
        "    backend.wait_ready(30)\n"
        "    print(backend.process.pid, flush=True)\n"
        "    time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    backend_pid = int(parent.stdout.readline())
    backend = psutil.Process(backend_pid)
    parent.kill()  # SIGKILL: no atexit, no multiprocessing clean-up
    parent.wait()
    backend.wait(timeout=10)  # raises psutil.TimeoutExpired if the orphan lives on


def test_what_a_backend_sent_before_dying_is_read_and_the_message_it_died_in_is_its_death():
    """The backend writes its outbox itself: a message larger than the pipe holds arrives whole, and one
    cut short by its death is BackendDied, not a read that waits for ever for the rest."""
    backend = BackendProcess(BackendConfig(mock=True))
    backend.process = _mp.Process(target=send_then_die_mid_message, args=(backend._outbox_writer,))
    backend.start()
    message = backend.receive(timeout=30)
    assert isinstance(message, StepOutput) and message.pieces[0].text == "x" * 300_000
    with pytest.raises(BackendDied, match="exited with code 3"):
        backend.receive(timeout=30)
    backend.stop()
