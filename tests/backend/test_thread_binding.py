"""The backend's compute threads bound one to each core on a CPU, and only there (backend/utils/
thread_binding.py); a real backend's threads are checked in test_process.py."""

import os
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path

import pytest

from backend.engine.engine import Engine
from backend.messages import BackendConfig
from backend.utils import thread_binding
from backend.utils.thread_binding import PROCESS_CPUS, binds, cores_of
from tests.backend.models import byte_tokenizer, tiny_model
from tests.server_fixture import ROOT


@pytest.fixture
def no_binding_settings(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (*thread_binding.BINDING_SETTINGS, "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(thread_binding, "gpu_present", lambda: False)
    monkeypatch.delitem(thread_binding.sys.modules, "torch")  # as in a backend process before its import
    return monkeypatch


def test_a_cpu_pass_with_a_thread_a_core_is_bound(no_binding_settings):
    assert binds("auto", None, cores=4)
    assert binds("cpu", 4, cores=4)
    no_binding_settings.setenv("OMP_NUM_THREADS", "4")
    assert binds("auto", None, cores=4)
    no_binding_settings.setenv("OMP_NUM_THREADS", "4,2")  # nested levels: the outer one is the pass's
    assert binds("auto", None, cores=4)


@pytest.mark.parametrize(
    "config, setting",
    [
        (BackendConfig(torch_threads=2), None),  # fewer threads: the other cores are the operator's
        (BackendConfig(), ("OMP_NUM_THREADS", "1")),  # the suite's, say
        (BackendConfig(), ("OMP_NUM_THREADS", "many")),  # a value OpenMP itself would refuse
        (BackendConfig(), ("OMP_PROC_BIND", "spread")),  # the operator binds them already
        (BackendConfig(), ("GOMP_CPU_AFFINITY", "0-3")),
        (BackendConfig(device="cuda"), None),
    ],
)
def test_the_threads_are_left_to_the_scheduler_elsewhere(no_binding_settings, config, setting):
    if setting is not None:
        no_binding_settings.setenv(*setting)
    assert not binds(config.device, config.torch_threads, cores=4)


def test_auto_on_a_machine_with_a_gpu_and_a_single_core_are_not_bound(no_binding_settings):
    assert not binds("auto", None, cores=1)
    no_binding_settings.setattr(thread_binding, "gpu_present", lambda: True)
    assert not binds("auto", None, cores=4)
    assert binds("cpu", None, cores=4)


def test_torch_already_loaded_cannot_be_bound(no_binding_settings):
    no_binding_settings.setitem(thread_binding.sys.modules, "torch", types.ModuleType("torch"))
    assert not binds("auto", None, cores=4)


def test_the_cores_hold_every_cpu_of_the_process_once_with_their_smt_siblings():
    cores = cores_of(PROCESS_CPUS)
    assert sorted(cpu for core in cores for cpu in core) == sorted(PROCESS_CPUS)
    for core in cores:
        siblings = Path(f"/sys/devices/system/cpu/cpu{core[0]}/topology/core_cpus_list")
        if siblings.exists():  # "0-1" or "0,32": the CPUs of that core, of which the process has these
            listed = set()
            for part in siblings.read_text().strip().split(","):
                first, _, last = part.partition("-")
                listed.update(range(int(first), int(last or first) + 1))
            assert set(core) == listed & PROCESS_CPUS


@pytest.mark.skipif(len(cores_of(PROCESS_CPUS)) < 2, reason="one core: nothing to bind")
def test_torch_is_imported_with_a_thread_a_core_and_the_engines_held_on_the_first_once_loaded():
    """In a fresh interpreter, as a backend process starts: torch's threads one a core, those besides
    this one bound to theirs. This thread on every CPU while the model loads (the processes it starts,
    the C++ operations' compiler and torch's compile workers, take its affinity), then on the first core
    (`hold_engine_thread`); no setting left in the environment for those processes, which would bind
    their own threads to the first cores too."""
    cores = cores_of(PROCESS_CPUS)
    script = textwrap.dedent(
        f"""
        import os, threading
        from backend.utils.thread_binding import bind_compute_threads, hold_engine_thread
        places = bind_compute_threads("cpu", {len(cores)})
        import torch
        torch.randn(256, 256) @ torch.randn(256, 256)  # the pass's threads are made at its first operation
        print(places, "OMP_PROC_BIND" in os.environ or "OMP_PLACES" in os.environ)
        print(torch.get_num_threads(), sorted(os.sched_getaffinity(0)))
        tasks = [int(task) for task in os.listdir("/proc/self/task")]
        tasks.remove(threading.get_native_id())
        print(sorted(sorted(os.sched_getaffinity(task)) for task in tasks))
        hold_engine_thread()
        print(sorted(os.sched_getaffinity(0)))
        """
    )
    environment = {k: v for k, v in os.environ.items() if k not in thread_binding.BINDING_SETTINGS}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    places = ",".join("{" + ",".join(map(str, core)) + "}" for core in cores)
    lines = result.stdout.split("\n")
    assert lines[:2] == [f"{places} False", f"{len(cores)} {sorted(PROCESS_CPUS)}"]
    for core in cores[1:]:
        assert str(core) in lines[2], f"no thread bound to core {core} alone: {lines[2]}"
    assert lines[3] == str(cores[0])


def test_nothing_bound_leaves_the_engines_thread_where_it_was(monkeypatch):
    monkeypatch.setattr(thread_binding, "_engine_core", None)
    before = os.sched_getaffinity(0)
    thread_binding.hold_engine_thread()
    assert os.sched_getaffinity(0) == before


@pytest.mark.skipif(len(PROCESS_CPUS) < 2, reason="one CPU: a thread can run nowhere else")
def test_a_grammars_build_runs_on_any_cpu_though_the_engines_thread_is_held(monkeypatch):
    """A thread takes the affinity of the one that starts it: the builds' threads, started from the
    engine's thread (held on the first core), would queue behind the pass there."""
    engine = Engine(tiny_model("qwen2"), byte_tokenizer(("<|endoftext|>",)), rows=2, max_seq_len=32)
    monkeypatch.setattr(engine.grammars, "make_tokenizer", lambda: os.sched_getaffinity(0))
    seen = []

    def held_engine_thread() -> None:
        os.sched_setaffinity(0, {min(PROCESS_CPUS)})
        seen.append(engine.grammar_builds.make_tokenizer().result(timeout=30))

    thread = threading.Thread(target=held_engine_thread)
    thread.start()
    thread.join()
    assert seen == [set(PROCESS_CPUS)]
