"""The backend's compute threads on a CPU, each bound to a core of its own.

On a CPU a pass runs each of its operations on torch's threads, one a core by default, and an
operation ends when its slowest thread does. Left to the scheduler, a burst of other work on one core
(the frontend tokenizing a long prompt, a grammar compiling on its thread, another process) could stop
the pass for as long as the burst lasted: on 2 cores a stream's next token waited 183-218 ms beside
another process's 0.2 s busy loop and 790-834 ms beside a 1 s one, where a step takes 5
(docs/performance.md). Each thread bound to its core (OpenMP's `OMP_PROC_BIND`, as vLLM binds its CPU
workers), the pass shares that core and goes on: 40-44 and 42-65 ms.

Bound only where the pass has one thread a core of this process's: fewer threads (`--torch-threads`,
`OMP_NUM_THREADS`) leave the other cores to something the operator chose; on a GPU the threads carry
little; an operator's own OpenMP binding is left as it is.
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

# Where an operator binds threads already (GNU's and Intel's OpenMP runtimes read these)
BINDING_SETTINGS = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
# The CPUs this process may run on, read before any binding narrows its main thread's
PROCESS_CPUS = frozenset(os.sched_getaffinity(0))
# The first core's CPUs, the engine's thread's once the model is loaded, where binding took place
_engine_core: frozenset[int] | None = None


def bind_compute_threads(device: str, torch_threads: int | None) -> str | None:
    """Import torch with its threads bound, one to each core, where the backend's `device` and
    `torch_threads` (its config's) run the pass on one thread a core of a CPU; the places bound (for the
    log), or None where the threads are left to the scheduler. Before anything else imports torch:
    OpenMP's runtime reads its settings as torch loads it (and binds this thread to the first place, which
    is undone here until the model is loaded: `hold_engine_thread`)."""
    cores = cores_of(PROCESS_CPUS)
    if not binds(device, torch_threads, len(cores)):
        return None
    places = ",".join("{" + ",".join(map(str, core)) + "}" for core in cores)
    os.environ.update(OMP_PROC_BIND="close", OMP_PLACES=places)  # neither was set (`binds`)
    try:
        import torch

        torch.set_num_threads(len(cores))
    finally:  # read already; the processes this one starts (compile workers) are not bound by them
        del os.environ["OMP_PROC_BIND"], os.environ["OMP_PLACES"]
    # This thread on every core while the model loads: the processes it starts take its affinity (the
    # C++ operations' compiler, torch's compile workers) and would all queue on the first core. The
    # pass's other threads, made at its first operation, are bound by OpenMP meanwhile.
    global _engine_core
    _engine_core = frozenset(cores[0])
    os.sched_setaffinity(0, PROCESS_CPUS)
    return places


def hold_engine_thread() -> None:
    """Once the model is loaded, the engine's thread (OpenMP's first) back on the first core, where
    binding put it: left free, the stream beside a busy process waited as long as unbound (175-221 ms
    beside 0.2 s of it, 664-732 beside 1 s, against 40-44 and 42-65 held). Nothing where nothing was
    bound."""
    if _engine_core is not None:
        os.sched_setaffinity(0, _engine_core)


def spread_this_thread() -> None:
    """Let the calling thread run on any of the process's CPUs: a thread takes the affinity of the one
    that starts it, the engine's held to the first core, and a helper thread that computes (a grammar's
    build) should not queue there behind the pass."""
    os.sched_setaffinity(0, PROCESS_CPUS)


def binds(device: str, torch_threads: int | None, cores: int) -> bool:
    """Whether the pass's threads get a core each: on a CPU, one thread a core, nothing bound already."""
    threads = torch_threads or openmp_threads() or cores
    on_cpu = device == "cpu" or (device == "auto" and not gpu_present())
    unset = not any(name in os.environ for name in BINDING_SETTINGS)
    return on_cpu and unset and cores > 1 and threads == cores and "torch" not in sys.modules


def openmp_threads() -> int | None:
    """The threads `OMP_NUM_THREADS` asks for at the outer level ("4", or "4,2" nested), else None; -1
    where it asks for what binding cannot tell (not a number)."""
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if not value:
        return None
    return int(value) if value.isdigit() else -1


def gpu_present() -> bool:
    """An NVIDIA or AMD GPU's device files (torch, not yet imported, would pick it under `auto`)."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def cores_of(cpus: frozenset[int]) -> list[list[int]]:
    """The CPUs by the core they are hardware threads of (a core's SMT siblings together), in order;
    each CPU a core of its own where the topology cannot be read."""
    by_core: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(cpus):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = ((topology / "physical_package_id").read_text(), (topology / "core_id").read_text())
        except OSError:
            key = ("", str(cpu))
        by_core.setdefault(key, []).append(cpu)
    return sorted(by_core.values())
