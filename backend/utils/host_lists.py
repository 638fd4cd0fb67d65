"""Host lists to device tensors without making the host wait for the GPU."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def to_device(values: Sequence, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.tensor(values, device=device)`; on CUDA through pinned memory, copied without blocking.

    A copy from pageable host memory to the GPU first waits for everything queued on the stream (CUDA's
    documented behaviour), so each of a step's small index tensors stalled the host until the GPU had
    caught up: 13 waits a step in an H100 trial (issue 13). From pinned memory the copy is queued like a
    kernel; PyTorch's pinned-memory cache keeps the host buffer until the copy has run.
    """
    if device.type != "cuda":
        return torch.tensor(values, device=device, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def read_later(values: torch.Tensor) -> Callable[[], list]:
    """`values.tolist()`, as a function to call later, that waits for the work queued before this call
    and no more: on CUDA a copy into pinned memory queued now and an event recorded after it (a
    `.tolist()` then would wait for everything queued by then: a step launched ahead, say); elsewhere
    the list at once."""
    if values.device.type != "cuda":
        listed = values.tolist()
        return lambda: listed
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> list:
        copied.synchronize()
        return host.tolist()

    return read
