"""Host -> device copies for training steps that do not wait for the GPU work already queued.

A copy from pageable memory (``t.to("cuda")``) first waits for every kernel queued on the stream;
in the middle of a training step that stalls the host until the GPU has caught up, so the next
kernels are launched only then. Through pinned memory with ``non_blocking`` the copy queues behind
that work instead (PyTorch's caching host allocator keeps the pinned block until it is done).
Owns: ``upload``. Must not: synchronize, or be used by serving code (``worker/device_copy.py`` is
serving's, behind its switch).
"""

from __future__ import annotations

import torch


def upload(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` (on the CPU) on ``device``; to CUDA through pinned memory, without a wait."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
