"""The C++ extension: the fused decode-step loops (fused_ops.cpp), the products of few rows by weights
in blocks (block_matmul.cpp) and a decode step's layers in one call (decode_layers.cpp), built and
loaded.

The extension is built at the first start on a machine (about 30 s with
g++), in PyTorch's extension directory (`$TORCH_EXTENSIONS_DIR`, else
~/.cache/torch_extensions), under a name that changes with the source, the
CPU (it is compiled for the CPU it runs on), Python and torch. A lock file
that a killed build left behind is cleared after ten minutes, not waited
on for ever. Where it cannot be built (no compiler, say) `extension()` is
None and every caller runs PyTorch's operations instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

# One extension: the fused loops, the products of few rows by weights in blocks (quant/block_weights.py),
# and a decode step's layers in one call (model/native_decode.py); the header they share.
SOURCES = [
    Path(__file__).with_name(name) for name in ("fused_ops.cpp", "block_matmul.cpp", "decode_layers.cpp")
]
HEADERS = [Path(__file__).with_name("fused_ops.h")]
# Built where it runs: the CPU's own vector instructions; OpenMP for at::parallel_for's threads.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
DISABLE_VARIABLE = "INFERENCE_FUSED_CPU_OPS"  # "0": PyTorch's operations only
STALE_LOCK_SECONDS = 600
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
    clear_stale_lock(directory / "lock")
    started = time.perf_counter()
    module = load(
        name=directory.name,
        sources=[str(source) for source in SOURCES],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        verbose=False,
    )
    log.info(
        "fused CPU operations ready in %.1f s; quantized weights in blocks: %s",
        time.perf_counter() - started,
        module.block_matmul_kernel() or "none (no AVX2: PyTorch's kernels)",
    )
    return module


def build_directory() -> Path:
    """Where this source, built with these flags for this CPU, Python and torch, lives: PyTorch's extension
    directory. The key changes with any of them: a build for another torch would load and then crash."""
    built_for = [" ".join(CFLAGS), cpu_fingerprint(), sys.version, torch.__version__]
    code = b"".join(source.read_bytes() for source in SOURCES + HEADERS)
    key = hashlib.sha256(code + "\n".join(built_for).encode()).hexdigest()[:12]
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or "~/.cache/torch_extensions").expanduser()
    return root / f"fused_cpu_ops_{key}"


def clear_stale_lock(lock: Path) -> None:
    """PyTorch's build holds a lock file in the build directory while it compiles, and a process that
    waits for it waits as long as the file is there: one left by a build that was killed (a start
    stopped during its first minute) would hang every later start. A build takes under a minute."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        log.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


def cpu_fingerprint() -> str:
    """What the compiled code depends on: the processor's model and instruction-set flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "".join(dict.fromkeys(line for line in lines if line.startswith(("model name", "flags"))))
    except OSError:
        return platform.processor() or platform.machine()
