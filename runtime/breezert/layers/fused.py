"""Packed projections: linears that read the same input run as one GEMM.

Owns: ``fuse_linears_``, which concatenates the weights of such linears and re-points each
linear's weight at a view of the packed tensor (same values, same ``state_dict`` names, no extra
memory). Must not: change numerics beyond the GEMM's own blocking.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def fuse_linears_(*linears: nn.Linear) -> torch.Tensor:
    """Returns the packed weight ``[sum(out), in]``; each linear's weight becomes a view of it."""
    packed = torch.cat([linear.weight.detach() for linear in linears])
    offset = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = nn.Parameter(packed[offset : offset + rows], requires_grad=False)
        offset += rows
    return packed
