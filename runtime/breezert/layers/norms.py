"""RMS norms of the three sub-models: Llama/Qwen ``w * x̂`` and Gemma ``(1 + w) * x̂``.

Owns: the two norm modules (and the Llama/Qwen one as a function) and their init convention
(Llama/Qwen weights start at 1, Gemma at 0).
Must not: fuse residual adds or know which sub-model uses them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama/Qwen RMSNorm of ``x`` over its last dim (``RMSNorm``'s arithmetic, for hot loops
    that call it without the module)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and not x.is_cuda:
        # fp32 on the CPU: the same bits with the weight inside the one call (a tiny CPU
        # model's step is bound by per-operator overhead; tests/unit/test_model_shapes.py)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # NOTE: HF casts the normalized value back to the input dtype before the weight multiply.
    # F.rms_norm accumulates in fp32 and is one fused kernel on CUDA (vs ~6 launches for the
    # spelled-out formula), which matters inside launch-bound graphs.
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


class RMSNorm(nn.Module):
    """Llama/Qwen RMSNorm: ``w * (x / rms(x))``; the weight is initialised to 1."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma RMSNorm: ``(1 + w) * (x / rms(x))`` in fp32; the weight is initialised to 0."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), scale, self.eps).to(x.dtype)
