"""Host -> device copies that do not make the host wait for the GPU work already queued.

A copy from pageable host memory (``t.to("cuda")``, ``torch.tensor(..., device="cuda")``) returns
only once every kernel queued before it on the stream has run: a step's input uploads then wait
for the previous step's graph (an asynchronous DECODE or PREFILL), and the GPU idles while the
host finishes preparing and launching. Staged in pinned memory and copied with ``non_blocking``,
the copy queues behind that work instead and the host runs ahead; PyTorch's caching host
allocator keeps the pinned block until the copy has been done.

Owns: ``to_device`` and ``tensor_to_device`` for the per-step inputs of the stages and the slot
table, and the process-wide switch ``set_async_uploads`` (``graph.async_uploads``; off: today's
pageable copies, so one benchmark run can compare both). Must not: synchronize, or change what is
copied (on the CPU both are plain ``.to``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from breezert.host_copy import upload

_ASYNC = False


def set_async_uploads(enabled: bool) -> None:
    """Turns the pinned, non-blocking path on or off for the whole process (the model runner
    sets it from ``graph.async_uploads`` when it is built: the last engine built decides)."""
    global _ASYNC
    _ASYNC = bool(enabled)


def to_device(tensor: torch.Tensor, device: torch.device,
              non_blocking: bool = False) -> torch.Tensor:
    """With async uploads on, a CPU tensor bound for CUDA goes through pinned memory, without
    waiting for the stream; off (and for anything else), the caller's own copy,
    ``tensor.to(device, non_blocking=non_blocking)``."""
    if not _ASYNC or device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device, non_blocking=non_blocking)
    return upload(tensor, device)


def tensor_to_device(values: Sequence | torch.Tensor, device: torch.device,
                     dtype: torch.dtype | None = None, non_blocking: bool = False) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device`` as ``to_device`` copies it."""
    return to_device(torch.tensor(values, dtype=dtype), device, non_blocking)
