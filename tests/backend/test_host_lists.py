"""Host lists to device tensors (backend/utils/host_lists.py): what torch.tensor would make, on any device."""

from __future__ import annotations

import pytest
import torch

from backend.utils.host_lists import read_later, to_device

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_a_list_arrives_with_its_values_and_dtype(device):
    ids = to_device([3, 1, 2**62], torch.device(device), torch.long)
    assert ids.device.type == device and ids.dtype == torch.long and ids.tolist() == [3, 1, 2**62]
    floats = to_device([0.5, 0.25], torch.device(device), torch.float32)
    assert floats.dtype == torch.float32 and floats.tolist() == [0.5, 0.25]
    assert to_device([], torch.device(device), torch.long).shape == (0,)  # a step with no prompt to keep


@pytest.mark.parametrize("device", DEVICES)
def test_a_tensor_read_later_gives_its_values_when_it_was_read_not_later_ones(device):
    """read_later's list is the tensor as it stood at the call: work queued after it (a step launched
    ahead, here a write into the same tensor) does not show, and need not run before it is read."""
    values = torch.tensor([5, -1, 7], device=device)
    read = read_later(values)
    values.add_(100)  # queued after: on CUDA, still running or not yet run when read() returns
    assert read() == [5, -1, 7]
    assert read_later(values[:0])() == []
