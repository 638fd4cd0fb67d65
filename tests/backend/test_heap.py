"""The backend keeps freed memory for the next step (glibc, as on every machine this project runs on)."""

from backend.utils.heap import reuse_freed_memory
from tests.conftest import ROOT


def test_glibc_takes_the_new_thresholds():
    assert reuse_freed_memory() is True


def test_memory_freed_after_loading_goes_back_to_the_kernel():
    """With the thresholds raised, freed memory stays resident until give_back_freed_memory returns it."""
    import subprocess
    import sys

    script = """
import ctypes, psutil
from backend.utils.heap import give_back_freed_memory, reuse_freed_memory
reuse_freed_memory()
rss = lambda: psutil.Process().memory_info().rss
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
blocks = [libc.malloc(1 << 20) for _ in range(200)]
for block in blocks:
    ctypes.memset(block, 1, 1 << 20)
for block in blocks:
    libc.free(ctypes.c_void_p(block))
kept = rss()
assert give_back_freed_memory()
print(kept - rss())
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) > 150 * 2**20  # most of the 200 MiB freed went back
