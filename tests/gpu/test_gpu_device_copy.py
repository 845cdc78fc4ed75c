"""GPU: ``worker.device_copy`` uploads queue behind the GPU work already on the stream instead of
waiting for it (the reason the stages use it), and copy the same values.

Run on a CUDA machine: ``python -m pytest tests/gpu -q`` (skipped without CUDA).
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.gpu


def _seconds_while_busy(upload) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(seconds the upload call took, seconds of GPU work queued before it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of a spinning kernel
    t0 = time.perf_counter()
    upload()
    took = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    return took, start.elapsed_time(end) / 1000


def test_upload_does_not_wait_for_queued_work() -> None:
    from breezert.worker import device_copy
    from breezert.worker.device_copy import tensor_to_device, to_device

    device_copy.set_async_uploads(True)
    dev = torch.device("cuda")
    host = torch.arange(4096, dtype=torch.long)
    blocking, busy = _seconds_while_busy(lambda: host.to(dev))
    assert blocking > 0.5 * busy  # a pageable copy waits for the sleeping kernel
    ours, busy = _seconds_while_busy(lambda: to_device(host, dev))
    assert ours < 0.1 * busy, (ours, busy)
    out = to_device(host, dev)
    assert torch.equal(out.cpu(), host)
    assert torch.equal(tensor_to_device([1, 2, 3], dev, torch.float32).cpu(),
                       torch.tensor([1.0, 2.0, 3.0]))
    device_copy.set_async_uploads(False)
    plain, busy = _seconds_while_busy(lambda: to_device(host, dev))
    assert plain > 0.5 * busy  # off: today's pageable copy
