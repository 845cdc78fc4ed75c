"""``worker.device_copy`` on the CPU: plain copies, same values and dtypes (the pinned,
non-blocking path is CUDA's: tests/gpu/test_gpu_device_copy.py)."""

from __future__ import annotations

import pytest
import torch

from breezert.worker import device_copy
from breezert.worker.device_copy import tensor_to_device, to_device

pytestmark = pytest.mark.unit


def test_cpu_copies_are_plain() -> None:
    cpu = torch.device("cpu")
    t = torch.arange(5)
    assert to_device(t, cpu) is t  # nothing to move
    out = tensor_to_device([True, False], cpu)
    assert out.dtype == torch.bool and out.tolist() == [True, False]
    assert tensor_to_device([1, 2], cpu, torch.float32).dtype == torch.float32


def test_the_switch_never_changes_cpu_copies() -> None:
    cpu = torch.device("cpu")
    try:
        device_copy.set_async_uploads(True)
        assert tensor_to_device([3, 4], cpu).tolist() == [3, 4]
    finally:
        device_copy.set_async_uploads(False)


class _Recorder:
    """Stands in for a CPU tensor: records how it is copied."""

    device = torch.device("cpu")

    def to(self, device: torch.device, non_blocking: bool = False) -> "_Recorder":
        self.copied = (device.type, non_blocking)
        return self


def test_off_keeps_each_callers_own_copy() -> None:
    """Async uploads off: the copy the call site made before (blocking or not), unchanged."""
    device_copy.set_async_uploads(False)
    cuda = torch.device("cuda")
    for non_blocking in (False, True):
        t = _Recorder()
        assert to_device(t, cuda, non_blocking) is t  # type: ignore[arg-type]
        assert t.copied == ("cuda", non_blocking)
