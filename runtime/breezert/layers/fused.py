"""Packed projections: linears that read the same input run as one GEMM.

Owns: ``fuse_linears_``, which concatenates the weights of such linears and re-points each
linear's weight at a view of the packed tensor (same values, same ``state_dict`` names, no extra
memory). Must not: change numerics beyond the GEMM's own blocking.
"""

from __future__ import annotations

from collections.abc import Callable

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
    o_proj: nn.Linear
    qkv_weight: torch.Tensor | None = None

    def init_projections(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> None:
        """Creates ``q/k/v/o_proj`` (no bias) and the head counts; call after ``Module``
        init."""
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.qkv_weight = None  # set by fuse_(): one GEMM for q, k, v

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


class GatedMLP(nn.Module):
    """``down(activation(gate(x)) * up(x))``; ``fuse_()`` packs gate and up into one GEMM."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        self.activation = activation
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # set by fuse_(): one GEMM

    def fuse_(self) -> None:
        self.gate_up_weight = fuse_linears_(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = torch.nn.functional.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return self.down_proj(self.activation(gate) * up)
