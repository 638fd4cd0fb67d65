"""The backend keeps freed memory for the next step (glibc, as on every machine this project runs on)."""

from backend.heap import reuse_freed_memory


def test_glibc_takes_the_new_thresholds():
    assert reuse_freed_memory() is True
