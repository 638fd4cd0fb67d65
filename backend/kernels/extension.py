"""The C++ extension: the fused decode-step loops (fused_ops.cpp), the products of few rows by weights
in blocks (block_matmul.cpp), a decode step's layers in one call (decode_layers.cpp) and a mixture of
experts' layer in one call (experts.cpp), built and loaded.

The extension is built at the first start of a checkout on a machine (about
30 s with g++), in PyTorch's extension directory (`$TORCH_EXTENSIONS_DIR`,
else ~/.cache/torch_extensions), under a name that changes with the source,
the CPU (it is compiled for the CPU it runs on), Python and torch, and with
where the sources and torch are: PyTorch writes a build's absolute paths
into its build.ninja, so two checkouts sharing one directory rebuilt it at
every start, each in turn. Starts take turns at a build directory under a
lock the kernel releases when its holder dies (`build_lock`): one that finds
it held waits, saying so in the log, and takes PyTorch's operations after
`BUILD_WAIT_SECONDS`; the holder clears the lock file a killed build of
PyTorch's left behind, on which a start would otherwise wait for ever. Where
it cannot be built (no compiler, say) `extension()` is None and every caller
runs PyTorch's operations instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

# One extension: the fused loops, the products of few rows by weights in blocks (quant/block_weights.py),
# a decode step's layers in one call (model/native_decode.py) and a mixture's layer; the header they share.
SOURCES = [
    Path(__file__).with_name(name)
    for name in ("fused_ops.cpp", "block_matmul.cpp", "decode_layers.cpp", "experts.cpp")
]
HEADERS = [Path(__file__).with_name("fused_ops.h")]
# Built where it runs: the CPU's own vector instructions; OpenMP for at::parallel_for's threads.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
DISABLE_VARIABLE = "INFERENCE_FUSED_CPU_OPS"  # "0": PyTorch's operations only
BUILD_WAIT_SECONDS = 900  # another start's build taking longer than this: PyTorch's operations meanwhile
WAIT_LOG_SECONDS = 15  # how often a start waiting for another's build says so
_extension: ModuleType | None = None
_unavailable: str | None = None


def extension() -> ModuleType | None:
    """The built extension, building it on first use; None (the reason logged once) where it cannot be."""
    global _extension, _unavailable
    if _extension is not None or _unavailable is not None:
        return _extension
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        _unavailable = f"{DISABLE_VARIABLE}=0"
    else:
        try:
            _extension = build()
        except Exception as error:  # no compiler, no ninja, a failed build: PyTorch's operations still work
            last_line = (str(error).strip().splitlines() or [""])[-1]  # ninja's or the compiler's reason
            _unavailable = f"{type(error).__name__}: {last_line}"
    if _unavailable is not None:
        log.warning(
            "fused CPU operations unavailable (%s): decode steps use PyTorch's operations", _unavailable
        )
    return _extension


def build() -> ModuleType:
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # requirements.txt's ninja, in a virtual environment not on PATH
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if not list(directory.glob("*.so")):  # else loaded at once, with nothing to say
        log.info("building the fused CPU operations: a first start of this checkout, 30 s to 2 minutes")
    with build_lock(directory):
        clear_left_lock(directory / "lock")
        module = load(
            name=directory.name,
            sources=[str(source) for source in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=False,
        )
    log.info(
        "fused CPU operations ready in %.1f s; quantized weights in blocks: %s; attention's scores over a "
        "bfloat16 cache: %s",
        time.perf_counter() - started,
        module.block_matmul_kernel() or "none (no AVX2: PyTorch's kernels)",
        "AVX-512 BF16 dot products" if module.attention_by_dots() else "in float",
    )
    return module


def build_directory(sources: list[Path] = SOURCES) -> Path:
    """Where these sources, built with these flags for this CPU, Python and torch, live: PyTorch's
    extension directory. The key changes with any of them (a build for another torch would load and
    then crash) and with where the sources and torch are, since a build's files name them."""
    built_for = [" ".join(CFLAGS), cpu_fingerprint(), sys.version, torch.__version__]
    built_for += [str(sources[0].resolve().parent), str(Path(torch.__file__).resolve().parent)]
    code = b"".join(source.read_bytes() for source in sources + HEADERS)
    key = hashlib.sha256(code + "\n".join(built_for).encode()).hexdigest()[:12]
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or "~/.cache/torch_extensions").expanduser()
    return root / f"fused_cpu_ops_{key}"


@contextlib.contextmanager
def build_lock(directory: Path, wait_seconds: float | None = None) -> Iterator[None]:
    """The build directory to this process alone: an exclusive `flock` on a file in it, which the kernel
    releases when its holder exits, however it dies. Waiting for another start's build is logged
    every `WAIT_LOG_SECONDS`; past `wait_seconds` (`BUILD_WAIT_SECONDS`) it raises TimeoutError, and
    the start runs PyTorch's operations."""
    wait_seconds = BUILD_WAIT_SECONDS if wait_seconds is None else wait_seconds
    with open(directory / "build.flock", "a") as handle:
        started = time.monotonic()
        said = None
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - started
                if waited > wait_seconds:
                    raise TimeoutError(
                        f"another process has been building {directory} for over {wait_seconds:.0f} s"
                    ) from None
                if said is None or waited - said >= WAIT_LOG_SECONDS:
                    log.info("waiting %.0f s for another process's build of the fused CPU operations", waited)
                    said = waited
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def clear_left_lock(lock: Path) -> None:
    """PyTorch's build holds a lock file while it compiles, and a process that finds the file waits as
    long as it is there. Called under `build_lock`, no other build is running: a file found is one a
    killed build (a first start stopped midway, the OOM killer) left behind, and would hang every
    later start."""
    if lock.exists():
        log.warning("removing %s, left by a build that did not finish", lock)
        lock.unlink(missing_ok=True)


def cpu_fingerprint() -> str:
    """What the compiled code depends on: the processor's model and instruction-set flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "".join(dict.fromkeys(line for line in lines if line.startswith(("model name", "flags"))))
    except OSError:
        return platform.processor() or platform.machine()
