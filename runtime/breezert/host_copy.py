"""Host -> device copies that do not wait for the GPU work already queued.

A copy from pageable memory (``t.to("cuda")``) first waits for every kernel queued on the stream:
in the middle of a step that stalls the host until the GPU has caught up, and the next kernels
are launched only then. Through pinned memory with ``non_blocking`` the copy queues behind that
work instead; PyTorch's caching host allocator keeps the pinned block until the copy is done.

Owns: ``upload``, for the models' own input copies and the training steps. Must not:
synchronize, or hold a policy (the stages' per-step inputs are a few row indices, copied with
plain ``.to``: through pinned memory they measured no different on the H200, bench/README.md).
"""

from __future__ import annotations

import torch


def upload(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``; from the CPU to CUDA through pinned memory, without a wait.

    A tensor already in pinned memory is copied from as it is: the caller must not change it
    until the copy has run (a fresh CPU tensor, as every caller here passes, is copied into a
    new pinned block first)."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
