"""Llama depth decoder of Breeze-TTS-2: fills codebooks 1..15 of one frame, R rows at a time.

Owns: the decoder (names = checkpoint ``depth_decoder.*`` minus the prefix), including the single
tied audio table ``model.embed_tokens`` that the backbone reads too, and a frame-local step API.
Must not: sample, mix CFG branches or keep KV between frames (the caller owns the cache tensor).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from breezert.layers.attention import sdpa_gqa
from breezert.layers.fused import PackedQKV
from breezert.layers.norms import RMSNorm, rms_norm
from breezert.layers.rope import Rope, apply_rope_signed, fold_rotation_sign, llama3_inv_freq
from breezert.models.backbone import SiluMLP
from breezert.models.config import DepthConfig


class StepRope(NamedTuple):
    """One depth position's attention inputs, made once per step for every layer: ``cos`` and
    the sign-folded ``sin_signed`` (``apply_rope_signed``), both ``[R, 1, D]`` or ``[1, D]``
    (broadcast over the q and k heads, and the rows), and the slot mask ``[1, 1, 1, P]``
    (slot <= position)."""

    cos: torch.Tensor
    sin_signed: torch.Tensor
    mask: torch.Tensor


class DepthAttention(nn.Module, PackedQKV):
    """The attention weights of a depth layer (``DepthLayer.forward`` runs them)."""

    def __init__(self, cfg: DepthConfig) -> None:
        super().__init__()
        self.init_projections(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)


class DepthLayer(nn.Module):
    def __init__(self, cfg: DepthConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DepthAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SiluMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, x: torch.Tensor, rope: StepRope, layer_cache: torch.Tensor, position: torch.Tensor,
    ) -> torch.Tensor:
        """One position of ``R`` rows: ``x [R, d]``, ``layer_cache [2, R, KVH, P, D]`` written
        at ``position`` (a 1-element long tensor, so one compiled graph serves every step).

        Written out on the weights rather than through the submodules' calls: on the CPU a
        tiny model's step is bound by per-call overhead, and this form takes half the time of
        the module calls for the same bits (q and k are rotated as one tensor).
        """
        attn, mlp = self.self_attn, self.mlp
        r, heads, kv_heads, dim = x.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
        h = rms_norm(x, self.input_layernorm.weight, self.input_layernorm.eps)
        if attn.qkv_weight is not None:
            qkv = F.linear(h, attn.qkv_weight)
        else:
            qkv = torch.cat([F.linear(h, attn.q_proj.weight), F.linear(h, attn.k_proj.weight),
                             F.linear(h, attn.v_proj.weight)], dim=-1)
        split = (heads + kv_heads) * dim
        qk = apply_rope_signed(qkv[:, :split].reshape(r, heads + kv_heads, dim), rope.cos,
                               rope.sin_signed)
        layer_cache[0].index_copy_(2, position, qk[:, heads:, None, :])  # [2, R, KVH, P, D]
        layer_cache[1].index_copy_(2, position, qkv[:, split:].reshape(r, kv_heads, 1, dim))
        # All P slots with the step's mask: fixed shapes whatever the step.
        keys, values = layer_cache[0], layer_cache[1]
        if keys.dtype != qk.dtype:
            keys, values = keys.to(qk.dtype), values.to(qk.dtype)
        q = qk[:, :heads].contiguous()  # the layout q had when rotated on its own
        out = sdpa_gqa(q[:, :, None, :], keys, values, rope.mask)  # [R, H, 1, D]
        x = x + F.linear(out.reshape(r, -1), attn.o_proj.weight)
        h = rms_norm(x, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        if mlp.gate_up_weight is not None:
            gate, up = F.linear(h, mlp.gate_up_weight).chunk(2, dim=-1)
        else:
            gate, up = F.linear(h, mlp.gate_proj.weight), F.linear(h, mlp.up_proj.weight)
        return x + F.linear(F.silu(gate) * up, mlp.down_proj.weight)


class DepthModel(nn.Module):
    """``depth_decoder.model``: tied audio table, input projector, layers, final norm."""

    def __init__(self, cfg: DepthConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.num_codebooks * cfg.vocab_size, cfg.audio_embed_size)
        self.inputs_embeds_projector = nn.Linear(
            cfg.backbone_hidden_size, cfg.hidden_size, bias=False
        )
        self.layers = nn.ModuleList(DepthLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _step_rope(cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, num_slots: int,
               dtype: torch.dtype) -> StepRope:
    """A position's ``StepRope`` from its ``cos``/``sin`` rows (``[R, D]`` per row, or ``[D]``
    for every row) and its one-element ``pos``, over a frame cache of ``num_slots``."""
    slots = torch.arange(num_slots, device=pos.device)
    return StepRope(cos.to(dtype).unsqueeze(-2), fold_rotation_sign(sin.to(dtype)).unsqueeze(-2),
                    (slots <= pos).view(1, 1, 1, -1))


FrameRope = tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]
"""A frame's ``(positions, cos, sin)``: one-element position tensors and ``[P, head_dim]``."""


class CodebooksHead(nn.Module):
    """Per-codebook output heads ``weight [15, d, vocab]``, applied as ``h @ weight[j - 1]``."""

    def __init__(self, cfg: DepthConfig) -> None:
        super().__init__()
        num_heads = cfg.num_codebooks - 1
        self.weight = nn.Parameter(torch.zeros(num_heads, cfg.hidden_size, cfg.vocab_size))


class DepthDecoder(nn.Module):
    """Frame-local depth decoder.

    Position 0 takes the backbone's last hidden state, position ``p >= 1`` the embedding of code
    ``c_{p-1}`` (codebook ``p - 1``); the hidden state at position ``j`` gives codebook ``j``.
    """

    def __init__(self, cfg: DepthConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DepthModel(cfg)
        self.codebooks_head = CodebooksHead(cfg)
        self.heads_fp32: torch.Tensor | None = None  # fp32 copy, set by fuse_projections_()
        self._frame_tables: dict[tuple[torch.device, torch.dtype], FrameRope] = {}
        self._step_rope_tables: dict[tuple[torch.device, torch.dtype],
                                     list[tuple[StepRope, torch.Tensor]]] = {}
        self.rope = Rope(
            llama3_inv_freq(
                cfg.head_dim,
                cfg.rope_theta,
                cfg.rope_factor,
                cfg.rope_low_freq_factor,
                cfg.rope_high_freq_factor,
                cfg.rope_original_max_position,
            )
        )

    @property
    def max_positions(self) -> int:
        """Positions per frame: 0 (backbone state) .. num_codebooks - 1."""
        return self.cfg.num_codebooks

    def new_cache(
        self, num_rows: int, *, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> torch.Tensor:
        """Returns an empty frame cache ``[L, 2, R, KVH, num_codebooks, D]``."""
        c = self.cfg
        shape = (c.num_layers, 2, num_rows, c.num_kv_heads, self.max_positions, c.head_dim)
        weight = self.model.norm.weight
        return torch.zeros(shape, dtype=dtype or weight.dtype, device=device or weight.device)

    def embed_code(self, codes: torch.Tensor, codebook: int) -> torch.Tensor:
        """Audio-table rows of ``codes [R]`` in ``codebook``: ``E[code + vocab * codebook]``."""
        return self.model.embed_tokens(codes + self.cfg.vocab_size * codebook)  # [R, audio_embed]

    def step(self, x: torch.Tensor, position: int, cache: torch.Tensor) -> torch.Tensor:
        """Runs one position for R rows and returns the final-normed hidden ``[R, d]``.

        Args:
            x: ``[R, backbone_hidden]``: the backbone ``h_last`` at position 0, else
                ``embed_code(c_{p-1}, p - 1)``.
            position: 0..num_codebooks-1; earlier positions of ``cache`` must be filled.
            cache: ``[L, 2, R, KVH, num_codebooks, D]``, written in place at ``position``.
        """
        if not 0 <= position < self.max_positions:
            raise ValueError(f"depth position {position} outside 0..{self.max_positions - 1}")
        if "run_layers" not in vars(self):  # not swapped for a compiled or fused unit
            ropes = self._step_ropes(x.device, x.dtype)
            if ropes is not None:
                rope, pos = ropes[position]
                return self._layers(x, rope, cache, pos)
        positions, cos, sin = self._frame_rope(x.device, x.dtype)
        rows = x.shape[0]
        return self.run_layers(x, cos[position].expand(rows, -1), sin[position].expand(rows, -1),
                               cache, positions[position])

    def _step_ropes(self, device: torch.device,
                    dtype: torch.dtype) -> list[tuple[StepRope, torch.Tensor]] | None:
        """Each position's ``StepRope`` (broadcast over rows) and position tensor, made once per
        device and dtype for the eager ``step``: ``run_layers`` builds its step's from tensor
        inputs (the compiled unit's contract), ~100 us of tiny operators a step on the CPU, a
        sixth of the tiny model's step. Same values, so the same bits. None while a graph
        capture runs without them (that call builds its own, as ``_frame_rope``)."""
        key = (device, dtype)
        if key in self._step_rope_tables:
            return self._step_rope_tables[key]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        positions, cos, sin = self._frame_rope(device, dtype)
        with torch.inference_mode(False), torch.no_grad():
            ropes = [(_step_rope(cos[p], sin[p], positions[p], self.max_positions, dtype),
                      positions[p]) for p in range(self.max_positions)]
        self._step_rope_tables[key] = ropes
        return ropes

    def _frame_rope(self, device: torch.device, dtype: torch.dtype) -> FrameRope:
        """``(positions, cos, sin)`` of the frame's positions: ``[P]`` one-element long tensors
        and ``[P, head_dim]`` tables, the values ``rope.cos_sin`` gives position by position.
        Built once per device and dtype outside a graph capture (so a captured step reads them
        instead of recomputing them: ~10 kernels a step); inside a capture without them, built
        for that call only."""
        key = (device, dtype)
        if key in self._frame_tables:
            return self._frame_tables[key]
        # Normal tensors even when first asked for under inference mode (the warm-up): an
        # inference tensor would fail any later call that autograd records (a test's eager run).
        with torch.inference_mode(False), torch.no_grad():
            steps = torch.arange(self.max_positions, device=device, dtype=torch.long)
            cos, sin = self.rope.cos_sin(steps, dtype)
            tables = (list(steps[:, None].unbind(0)), cos, sin)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:
            self._frame_tables[key] = tables
        return tables

    def run_layers(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
        pos: torch.Tensor,
    ) -> torch.Tensor:
        """Projector, layers and final norm for one position (``pos`` a 1-element tensor): the
        unit ``worker/compile.py`` compiles, identical for every step and batch size. The
        step's RoPE tables and slot mask are made here once for all layers."""
        return self._layers(x, _step_rope(cos, sin, pos, cache.shape[4], x.dtype), cache, pos)

    def _layers(self, x: torch.Tensor, rope: StepRope, cache: torch.Tensor,
                pos: torch.Tensor) -> torch.Tensor:
        """Projector, layers and final norm with the step's ``rope`` made."""
        h = F.linear(x, self.model.inputs_embeds_projector.weight)  # [R, d]
        for i, layer in enumerate(self.model.layers):
            h = layer.forward(h, rope, cache[i], pos)  # (no module-call overhead)
        return rms_norm(h, self.model.norm.weight, self.model.norm.eps)

    def logits(self, hidden: torch.Tensor, codebook: int) -> torch.Tensor:
        """fp32 logits ``[R, vocab]`` of ``codebook`` (1..15): ``hidden @ codebooks_head[j-1]``."""
        if not 1 <= codebook < self.cfg.num_codebooks:
            raise ValueError(f"codebook {codebook} outside 1..{self.cfg.num_codebooks - 1}")
        heads = self.heads_fp32 if self.heads_fp32 is not None else self.codebooks_head.weight
        return hidden.float() @ heads[codebook - 1].float()
