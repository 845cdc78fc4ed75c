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


class PackedQKV:
    """Mixin for attention modules with ``q_proj``, ``k_proj`` and ``v_proj`` linears over the
    same input: ``fuse_()`` packs them, ``project(x)`` runs one GEMM (or three, unpacked)."""

    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    qkv_weight: torch.Tensor | None = None

    def fuse_(self) -> None:
        self.qkv_weight = fuse_linears_(self.q_proj, self.k_proj, self.v_proj)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [N, d]`` → q ``[N, H*D]``, k and v ``[N, KVH*D]``."""
        if self.qkv_weight is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q_size, kv_size = self.q_proj.weight.shape[0], self.k_proj.weight.shape[0]
        q, k, v = torch.nn.functional.linear(x, self.qkv_weight).split(
            [q_size, kv_size, kv_size], dim=-1
        )
        return q, k, v
