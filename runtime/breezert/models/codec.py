"""Qwen3-TTS-Tokenizer-12Hz decoder (codes -> 24 kHz waveform) with exact slot-arena streaming.

Owns: the decoder modules under the released ``decoder.*`` names, one step function shared by the
full and the incremental decode, the per-slot stream state arena and a random init. Must not: know
requests or schedules, read files, or call ``.item()`` on the decode path.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from breezert.layers.rope import apply_rope_signed, fold_rotation_sign
from breezert.models.config import CodecConfig

_RESIDUAL_DILATIONS = (1, 3, 9)
_CONV_KERNEL = 7  # decoder[0], residual conv1, ConvNeXt depthwise and final conv
_PRE_CONV_KERNEL = 3
GEMM_UPSAMPLE_MIN_CHANNELS = 1024
"""Input channels from which a decoder block's upsampler runs as a GEMM on the fast path."""


# ------------------------------------------------------------------------------- state layout
def _conv_state_spec(cfg: CodecConfig) -> tuple[tuple[str, int, int], ...]:
    """``(name, channels, length)`` of every conv input history, in the order a step visits them.

    Causal convs keep ``(k - 1) * dilation`` input samples; a DecoderBlock transposed conv keeps
    ``(k - 1) // s`` = 1 input frame (the official runtime's choice, smaller than the output tail).
    Upsample transposed convs (k == s) keep nothing.
    """
    spec: list[tuple[str, int, int]] = [("pre_conv", cfg.codebook_dim, _PRE_CONV_KERNEL - 1)]
    for i, _ in enumerate(cfg.upsampling_ratios):
        spec.append((f"upsample.{i}.1.dwconv", cfg.latent_dim, _CONV_KERNEL - 1))
    spec.append(("decoder.0", cfg.latent_dim, _CONV_KERNEL - 1))
    for b, _ in enumerate(cfg.upsample_rates):
        in_dim, out_dim = cfg.decoder_dim // 2**b, cfg.decoder_dim // 2 ** (b + 1)
        spec.append((f"decoder.{b + 1}.block.1", in_dim, 1))
        for j, d in enumerate(_RESIDUAL_DILATIONS):
            spec.append((f"decoder.{b + 1}.block.{j + 2}.conv1", out_dim, (_CONV_KERNEL - 1) * d))
    out_dim = cfg.decoder_dim // 2 ** len(cfg.upsample_rates)
    spec.append((f"decoder.{len(cfg.upsample_rates) + 2}", out_dim, _CONV_KERNEL - 1))
    return tuple(spec)


def _kv_state_shape(cfg: CodecConfig) -> tuple[int, ...]:
    # [num_layers, 2 (K, V), num_kv_heads, window - 1, head_dim]
    return (cfg.num_layers, 2, cfg.num_kv_heads, cfg.sliding_window - 1, cfg.head_dim)


def stream_state_numel(cfg: CodecConfig) -> int:
    """Values of exact decoder state one stream carries (conv histories plus the K/V window)."""
    conv = sum(c * n for _, c, n in _conv_state_spec(cfg))
    return conv + math.prod(_kv_state_shape(cfg))


@dataclass
class CodecStreamState:
    """Exact decoder state of a batch of streams; the leading dim is the slot (or batch row)."""

    conv: Tensor  # [S, num_conv_values]  flat causal-conv input histories
    kv: Tensor  # [S, num_layers, 2, num_kv_heads, R, head_dim]  RoPE'd keys, values of the
    #             last R = window - 1 frames in a ring: frame p at entry p % R
    pos: Tensor  # [S] int64  frames decoded so far (absolute RoPE position of the next frame)

    @staticmethod
    def zeros(
        cfg: CodecConfig, num_slots: int, device: torch.device | str | None, dtype: torch.dtype
    ) -> CodecStreamState:
        num_conv = sum(c * n for _, c, n in _conv_state_spec(cfg))
        return CodecStreamState(
            conv=torch.zeros(num_slots, num_conv, device=device, dtype=dtype),
            kv=torch.zeros(num_slots, *_kv_state_shape(cfg), device=device, dtype=dtype),
            pos=torch.zeros(num_slots, device=device, dtype=torch.long),
        )

    def reset_(self, slot_ids: Tensor) -> None:
        # NOTE: zeroing K/V is not needed for exactness (pos 0 masks every cached key), but it
        # keeps stale non-finite values out of the masked matmul.
        self.conv.index_fill_(0, slot_ids, 0)
        self.kv.index_fill_(0, slot_ids, 0)
        self.pos.index_fill_(0, slot_ids, 0)


class _Carry:
    """Hands out the conv histories of one step in visiting order and keeps the new ones.

    Two homes for the histories: rows (``_Carry(flat)``: ``flat [B, num_conv_values]``, left
    untouched; ``flat()`` joins the new ones, autograd flowing) or the state arena (with
    ``slot_ids [B]``: ``flat`` is the arena ``[S, num_conv_values]``, each new history written
    into its slot as soon as its conv has read the old one, nothing gathered).
    ``num_frames [B]`` (optional): frames each row really decodes this step, at most the step's
    ``total_frames``; a row's new history then ends at its own last real sample (the padded
    frames after it are computed and dropped), so rows of different chunk sizes share one step.
    ``fast``: the convs run as 2-D channels-last convolutions (``_conv_cl``); where the kernels
    run (CUDA, or the CPU interpreter), SnakeBeta, the history concatenation and the write-back
    run as Triton kernels that build each conv's input channels-last (``kernels/snake.py``), so
    no conv transposes its input or output; elsewhere the eager arithmetic.
    """

    def __init__(self, flat: Tensor, spec: tuple[tuple[str, int, int], ...],
                 num_frames: Tensor | None = None, total_frames: int = 0,
                 fast: bool = False, slot_ids: Tensor | None = None) -> None:
        sizes = [c * n for _, c, n in spec]
        chunks = flat.split(sizes, dim=1)  # each [B or S, C * n]
        self._old = [x.view(flat.shape[0], c, n) for x, (_, c, n) in zip(chunks, spec, strict=True)]
        self._spec = spec
        self._new: list[Tensor] = []
        self._visited = 0
        self.slot_ids = slot_ids
        self.num_frames, self.total_frames, self.fast = num_frames, total_frames, fast

    def _kernels(self, x: Tensor) -> bool:
        return self.fast and _kernels_run_on(x)

    def extend(self, x: Tensor, length: int, act: SnakeBeta | None = None) -> Tensor:
        """Prepends the stored history to ``act(x)`` [B, C, T] and keeps the last ``length``
        samples of each row (of its real frames when rows differ)."""
        i = self._visited
        self._visited += 1
        name, channels, expect = self._spec[i]
        assert (channels, expect) == (x.shape[1], length), f"state spec mismatch at {name}"
        old, rows = self._old[i], self.slot_ids
        if self._kernels(x):
            full = _snake().snake_cat_cl_triton(x, None if act is None else act.alpha,
                                                None if act is None else act.beta, old, rows)
            if rows is not None:
                _snake().keep_tail_triton(full, old, rows, self.num_frames, self.total_frames)
                return full
        else:
            full = torch.cat([old if rows is None else old[rows],
                              x if act is None else act(x)], dim=-1)
        new = real_tail(full, length, self.num_frames, self.total_frames)
        if rows is None:
            self._new.append(new)
        else:
            old.index_copy_(0, rows, new)
        return full  # [B, C, length + T]

    def activate(self, x: Tensor, act: SnakeBeta, bias: Tensor | None = None) -> Tensor:
        """``act(x)`` for a conv that keeps no history; ``bias`` (``fast`` only): ``x`` is a
        conv's output without its bias, ``act(x + bias)``."""
        assert bias is None or self.fast, "a conv leaves its bias out only on the fast path"
        if self._kernels(x):
            return _snake().snake_cat_cl_triton(x, act.alpha, act.beta, None, bias=bias)
        return act(x if bias is None else x + bias[:, None])

    def bias_residual(self, x: Tensor, y: Tensor, bias: Tensor) -> Tensor:
        """``x + (y + bias)``: a residual unit's skip and its last conv's output ``y`` without
        that conv's bias (one kernel pass where the kernels run and both are channels-last)."""
        snake = _snake() if self._kernels(x) else None
        if snake is not None and snake.rows_channels_last(x) and snake.rows_channels_last(y):
            return snake.bias_residual_triton(x, y, bias)
        return x + (y + bias[:, None])

    def flat(self) -> Tensor:
        """The new histories of rows ``_Carry(flat)`` joined: ``[B, num_conv_values]``."""
        assert self.slot_ids is None, "an arena's histories are written in place"
        assert len(self._new) == len(self._spec), "step did not visit every stateful conv"
        b = self._old[0].shape[0]
        return torch.cat([h.reshape(b, -1) for h in self._new], dim=1)  # [B, num_conv_values]

    def finish(self) -> None:
        assert self._visited == len(self._spec), "step did not visit every stateful conv"


def real_tail(full: Tensor, length: int, num_frames: Tensor | None, total_frames: int) -> Tensor:
    """The ``length`` samples of a conv's input ``full [B, C, length + T]`` (the old history, then
    the step's ``T`` samples over ``total_frames`` frames) that end at each row's last real frame
    (``num_frames [B]``; ``None``: all are real): the new history. ``keep_tail_triton`` is this
    arithmetic written into the state arena."""
    if num_frames is None:
        return full[..., full.shape[-1] - length:]
    scale = (full.shape[-1] - length) // total_frames  # samples per frame at this layer
    index = (num_frames * scale)[:, None] + torch.arange(length, device=full.device)
    return full.gather(2, index[:, None, :].expand(full.shape[0], full.shape[1], length))


def _kernels_run_on(x: Tensor) -> bool:
    """Whether the fast path's Triton kernels run on ``x``'s device here: CUDA, or the CPU under
    ``TRITON_INTERPRET=1`` (tests). Elsewhere the eager arithmetic, and Triton is not imported."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _snake():  # noqa: ANN202 - the kernel module imports Triton: only where its kernels run
    from breezert.kernels import snake

    return snake


# ------------------------------------------------------------------------------- conv modules
def _conv_cl(conv: nn.Conv1d | nn.ConvTranspose1d, x: Tensor, bias: bool = True) -> Tensor:
    """``conv(x)`` for ``x [B, C, T]`` as a 2-D convolution over ``[B, C, 1, T]``: given a
    channels-last input and the weight restrided by ``channels_last_weights_``, cuDNN runs its
    NHWC kernels on them directly (the 1-D path makes every input contiguous and transposes it
    to NHWC and back around each conv: 52 launches of a CODEC step at 256 streams on the H200,
    ``bench/results/h200-census-256-20261206-10.txt``). The output is channels-last too.
    ``bias=False``: without the conv's bias (cuDNN's convs add it in a pass over the output of
    their own: 38 launches, 2.6 ms of that step), for a consumer that adds it as it reads."""
    w, b = conv.weight.unsqueeze(2), conv.bias if bias else None
    if isinstance(conv, nn.ConvTranspose1d):
        y = F.conv_transpose2d(x.unsqueeze(2), w, b, stride=(1, conv.stride[0]))
    else:
        y = F.conv2d(x.unsqueeze(2), w, b, dilation=(1, conv.dilation[0]), groups=conv.groups)
    return y.squeeze(2)


def channels_last_weights_(module: nn.Module) -> None:
    """Restrides every conv weight under ``module`` in place as a 2-D channels-last weight
    (``[O, I, k]`` stored as ``[O, k, I]``): the same values, so every path still reads them,
    but ``_conv_cl`` hands cuDNN an NHWC weight it need not convert on each call."""
    for conv in module.modules():
        if isinstance(conv, (nn.Conv1d, nn.ConvTranspose1d)):
            w = conv.weight.data.unsqueeze(2).contiguous(memory_format=torch.channels_last)
            conv.weight.data = w.squeeze(2)


class _CausalConv(nn.Module):
    """Causal stride-1 Conv1d: left context comes from the carried history, never zero padding."""

    def __init__(
        self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1
    ) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.history = (kernel - 1) * dilation

    def forward(self, x: Tensor, carry: _Carry, act: SnakeBeta | None = None,
                bias: bool = True) -> Tensor:
        """``conv(act(x))`` with the carried history in front; ``bias=False`` (``fast`` only):
        without the conv's bias, which the consumer adds in a pass it makes anyway."""
        if self.history:
            x = carry.extend(x, self.history, act)
        elif act is not None:
            x = carry.activate(x, act)
        if carry.fast:
            return _conv_cl(self.conv, x, bias)
        assert bias, "a conv leaves its bias out only on the fast path"
        return self.conv(x)  # [B, cout, T]


class _CausalTransConv(nn.Module):
    """ConvTranspose1d trimmed to ``T * s`` outputs; keeps ``(k - 1) // s`` input frames."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.stride = stride
        self.history = (kernel - 1) // stride
        self.gemm_weight: Tensor | None = None  # [Cin, k * Cout], set by prepare_fast
        self.gemm_bias: Tensor | None = None  # [k * Cout] where kernel == stride

    def prepare_fast(self) -> None:
        """Wide upsamplers (kernel 2s, Cin >= 1024) run as one GEMM on the fast path: on the
        H200 1536 -> 768 took 1.17 ms as a cuDNN transposed conv and 0.21 ms as a GEMM (TF32,
        256 frames); narrower ones are faster in cuDNN (h200-codec-conv-kernels-20261201)."""
        w = self.conv.weight  # [Cin, Cout, k]
        if (w.shape[2] == 2 * self.stride and self.history == 1
                and w.shape[0] >= GEMM_UPSAMPLE_MIN_CHANNELS) or w.shape[2] == self.stride:
            # kernel == stride (the latent upsamplers): outputs do not overlap, so one GEMM of
            # the rows as they lie, [B * T, Cin] @ [Cin, s * Cout]
            self.gemm_weight = w.permute(0, 2, 1).reshape(w.shape[0], -1).contiguous()
            if self.history == 0:
                self.gemm_bias = self.conv.bias.detach().repeat(self.stride)

    def forward(self, x: Tensor, carry: _Carry, act: SnakeBeta | None = None) -> Tensor:
        num_new = x.shape[-1]
        if self.history:
            x = carry.extend(x, self.history, act)
        elif act is not None:
            x = carry.activate(x, act)
        if carry.fast and self.gemm_weight is not None:
            return self._gemm(x, num_new)
        start = self.history * self.stride
        y = _conv_cl(self.conv, x) if carry.fast else self.conv(x)
        return y[..., start : start + num_new * self.stride]  # [B, cout, T * s]

    def _gemm(self, x: Tensor, num_new: int) -> Tensor:
        # x [B, Cin, 1 + T]: output block i (samples i*s .. i*s+s-1 after the history's) takes
        # taps 0..s-1 of input 1 + i and taps s..2s-1 of input i.
        b, s = x.shape[0], self.stride
        cout = self.conv.weight.shape[1]
        # The rows of a channels-last ``x`` as they lie, no copy (where the kernels do not run,
        # ``x`` is channels-first and ``reshape`` copies it row-major: a transposed view's
        # leading dimension, 1 + T, is odd and sends cuBLAS to its unaligned kernels); the
        # result stays channels-last.
        if self.history == 0:  # kernel == stride: every output block from one input
            rows = x.transpose(1, 2).reshape(b * num_new, x.shape[1])
            out = torch.addmm(self.gemm_bias, rows, self.gemm_weight)
            return out.view(b, num_new * s, cout).transpose(1, 2)  # [B, cout, T * s]
        rows = x.transpose(1, 2).reshape(b * (num_new + 1), x.shape[1])
        y = (rows @ self.gemm_weight).view(b, num_new + 1, 2, s, cout)
        out = (y[:, 1:, 0] + y[:, :-1, 1]).reshape(b, num_new * s, cout)
        return (out + self.conv.bias).transpose(1, 2)  # [B, cout, T * s]


class SnakeBeta(nn.Module):
    """``x + sin^2(x * e^alpha) / (e^beta + 1e-9)`` with per-channel log-space alpha and beta."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))
        self._kept: tuple[tuple[object, ...], Tensor, Tensor] | None = None
        """(what the scales were made from, the scales)."""

    def scales(self) -> tuple[Tensor, Tensor]:
        """``(e^alpha, 1 / (e^beta + 1e-9))``, each ``[1, C, 1]``. Serving on the CPU keeps
        them while the parameters hold the same data (a tiny model's codec step is bound by
        per-operator overhead, and these are 6 of its 11 operators); they are made on each
        call whenever gradients are on (the codec trainer: a kept tensor must never enter an
        autograd graph), on CUDA (where graphs capture the step) and for inference-mode
        parameters (they keep no version to check)."""
        alpha, beta = self.alpha, self.beta
        keep = (not torch.is_grad_enabled() and not alpha.is_cuda
                and not torch.is_inference(alpha) and not torch.is_inference(beta))
        if keep and self._kept is not None and self._same_data(self._kept[0]):
            return self._kept[1], self._kept[2]
        made = alpha.exp()[None, :, None], 1.0 / (beta.exp()[None, :, None] + 1e-9)
        if keep:
            # detached views pin the old storage: a new tensor cannot reuse its address
            source = (alpha, beta, alpha.detach(), beta.detach(), alpha._version, beta._version)
            self._kept = (source, *made)
        return made

    def _same_data(self, source: tuple[object, ...]) -> bool:
        """Whether the parameters are the objects, storages and versions ``source`` records
        (an in-place update, ``.data =``, ``.to()`` or a load each change one of them)."""
        alpha, beta, alpha_data, beta_data, alpha_version, beta_version = source
        return (alpha is self.alpha and beta is self.beta
                and self.alpha.data_ptr() == alpha_data.data_ptr()  # type: ignore[attr-defined]
                and self.beta.data_ptr() == beta_data.data_ptr()  # type: ignore[attr-defined]
                and self.alpha._version == alpha_version and self.beta._version == beta_version)

    def forward(self, x: Tensor) -> Tensor:
        alpha, inv_beta = self.scales()
        return x + inv_beta * torch.sin(x * alpha).pow(2)


class _ConvNeXt(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = _CausalConv(dim, dim, _CONV_KERNEL, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: Tensor, carry: _Carry) -> Tensor:
        h = self.dwconv(x, carry).transpose(1, 2)  # [B, T, C]
        h = self.pwconv2(self.act(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)  # [B, C, T]


class _ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = _CausalConv(dim, dim, _CONV_KERNEL, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = _CausalConv(dim, dim, 1)

    def forward(self, x: Tensor, carry: _Carry) -> Tensor:
        if carry.fast:  # each conv's bias added by the pass that reads its output
            h = self.conv1(x, carry, self.act1, bias=False)
            y = _conv_cl(self.conv2.conv, carry.activate(h, self.act2, self.conv1.conv.bias),
                         bias=False)
            return carry.bias_residual(x, y, self.conv2.conv.bias)
        h = self.conv1(x, carry, self.act1)
        return x + self.conv2(h, carry, self.act2)


class _DecoderBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, rate: int) -> None:
        super().__init__()
        units = [_ResidualUnit(out_dim, d) for d in _RESIDUAL_DILATIONS]
        self.block = nn.ModuleList(
            [SnakeBeta(in_dim), _CausalTransConv(in_dim, out_dim, 2 * rate, rate), *units]
        )

    def forward(self, x: Tensor, carry: _Carry) -> Tensor:
        x = self.block[1](x, carry, self.block[0])  # [B, out_dim, T * rate]
        for unit in self.block[2:]:
            x = unit(x, carry)
        return x


# ------------------------------------------------------------------------------- quantizer
class _Codebook(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("embedding_sum", torch.zeros(size, dim))
        self.register_buffer("cluster_usage", torch.ones(size))

    def decode(self, codes: Tensor) -> Tensor:
        # Gathering rows first gives the same values as dividing the whole table, for B*T rows.
        usage = self.cluster_usage.clamp(min=1e-5)[codes]  # [B, T]
        return self.embedding_sum[codes] / usage[..., None]  # [B, T, dim]


class _VectorQuantization(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self._codebook = _Codebook(size, dim)


class _ResidualVQ(nn.Module):
    def __init__(self, size: int, dim: int, num_quantizers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_VectorQuantization(size, dim) for _ in range(num_quantizers)])


class _ResidualVectorQuantizer(nn.Module):
    def __init__(self, cfg: CodecConfig, num_quantizers: int) -> None:
        super().__init__()
        dim = cfg.codebook_dim // 2
        self.input_proj = nn.Conv1d(cfg.codebook_dim, dim, 1, bias=False)  # encode only
        self.output_proj = nn.Conv1d(dim, cfg.codebook_dim, 1, bias=False)
        self.vq = _ResidualVQ(cfg.codebook_size, dim, num_quantizers)

    def decode(self, codes: Tensor, table: Tensor | None = None) -> Tensor:
        # codes [B, T, K] -> [B, codebook_dim, T]; summed in codebook order like the reference.
        # ``table``: the codebooks divided by their usage, stacked ([K * size, dim]): the same
        # rows in one gather, summed in the same order (the same bits).
        if table is not None:
            size = self.vq.layers[0]._codebook.embedding_sum.shape[0]
            offsets = torch.arange(codes.shape[-1], device=codes.device) * size
            rows = F.embedding(codes + offsets, table).unbind(2)  # K x [B, T, dim]
            quantized = rows[0]
            for row in rows[1:]:
                quantized = quantized + row
        else:
            quantized = self.vq.layers[0]._codebook.decode(codes[..., 0])
            for k in range(1, codes.shape[-1]):
                quantized = quantized + self.vq.layers[k]._codebook.decode(codes[..., k])
        return self.output_proj(quantized.transpose(1, 2))


class _SplitQuantizer(nn.Module):
    def __init__(self, cfg: CodecConfig) -> None:
        super().__init__()
        self.num_first = cfg.num_semantic_quantizers
        self.rvq_first = _ResidualVectorQuantizer(cfg, self.num_first)
        self.rvq_rest = _ResidualVectorQuantizer(cfg, cfg.num_quantizers - self.num_first)
        self.tables: tuple[Tensor, Tensor] | None = None  # set by prepare_fast

    def decode(self, codes: Tensor, tables: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``tables`` (``prepare_fast``'s): the same sums from pre-divided codebooks."""
        first_table, rest_table = tables if tables is not None else (None, None)
        first = self.rvq_first.decode(codes[..., : self.num_first], first_table)
        return first + self.rvq_rest.decode(codes[..., self.num_first :], rest_table)

    def divided_tables(self) -> tuple[Tensor, Tensor]:
        """Each group's codebooks divided by their usage ([K * size, dim] per group): the rows
        ``_Codebook.decode`` gives, bit for bit."""
        def divided(vq: _VectorQuantization) -> Tensor:
            book = vq._codebook
            return book.embedding_sum / book.cluster_usage.clamp(min=1e-5)[:, None]

        return tuple(  # type: ignore[return-value]
            torch.cat([divided(vq) for vq in group.vq.layers])
            for group in (self.rvq_first, self.rvq_rest))

    def prepare_fast(self) -> None:
        """Divides each group's codebooks by their usage once."""
        self.tables = self.divided_tables()

    def decode_fast(self, codes: Tensor) -> Tensor:
        """``decode`` with one gather per group (the sum's order may differ in the last bit),
        each group's 1x1 projection as a GEMM of the rows as they lie: the result channels-last."""
        assert self.tables is not None, "prepare_fast() first"
        out = None
        for table, group, part in zip(self.tables, (self.rvq_first, self.rvq_rest),
                                      (codes[..., : self.num_first], codes[..., self.num_first :]),
                                      strict=True):
            size = group.vq.layers[0]._codebook.embedding_sum.shape[0]
            offsets = torch.arange(part.shape[-1], device=codes.device) * size
            summed = F.embedding(part + offsets, table).sum(dim=2)  # [B, T, dim]
            proj = F.linear(summed, group.output_proj.weight[..., 0]).transpose(1, 2)
            out = proj if out is None else out + proj
        return out  # [B, codebook_dim, T]


# ------------------------------------------------------------------------------- transformer
def _ring_mask(pos: Tensor, num_new: int, window: int) -> Tensor:
    """The keep-mask [B, 1, T, window - 1 + T] of the queries at ``pos + t`` over a row's ring
    (``R = window - 1`` entries) followed by its ``T`` new frames.

    Ring entry ``r`` holds the latest frame ``p < pos`` with ``p % R == r`` (negative: never
    written). A query at q sees keys with ``q - window < k <= q``, k >= 0.
    """
    ring = window - 1
    q_pos = pos[:, None] + torch.arange(num_new, device=pos.device)  # [B, T]
    r = torch.arange(ring, device=pos.device)
    ring_pos = pos[:, None] - 1 - torch.remainder(pos[:, None] - 1 - r, ring)  # [B, R]
    k_pos = torch.cat([ring_pos, q_pos], dim=1)  # [B, R + T]
    rel = q_pos[:, :, None] - k_pos[:, None, :]  # [B, T, R + T]
    keep = (k_pos[:, None, :] >= 0) & (rel >= 0) & (rel < window)
    return keep[:, None]


def _ring_update(ring: Tensor, new: Tensor, pos: Tensor, num_frames: Tensor | None) -> Tensor:
    """The rows' rings after a step: ``ring [B, 2, Hkv, R, D]`` with the step's K/V ``new [B, 2,
    Hkv, T, D]`` of the real frames (``num_frames [B]``, or all ``T``) written at ``(pos + t) %
    R``; where several frames of a step share an entry the last one stays. No host sync."""
    b, _, _, size, _ = ring.shape
    t = new.shape[3]
    n = torch.full_like(pos, t) if num_frames is None else num_frames.to(pos.device)
    first = torch.remainder(torch.arange(size, device=pos.device) - pos[:, None], size)  # [B, R]
    last = first + size * torch.div(n[:, None] - 1 - first, size, rounding_mode="floor")
    hit = last >= first  # entry r gets a frame of this step: the latest t <= n - 1 at r
    index = last.clamp(0, t - 1)[:, None, None, :, None].expand(b, 2, new.shape[2], size,
                                                                  new.shape[4])
    return torch.where(hit[:, None, None, :, None], new.gather(3, index), ring)


class _RowsRing:
    """The K/V rings of one step's rows, gathered (``[B, L, 2, Hkv, R, D]``): attention in torch
    over them, the new rings kept aside (``new()``). Functional: autograd flows through the
    step's keys, the rows' inputs stay untouched."""

    def __init__(self, rings: Tensor, pos: Tensor, num_frames: Tensor | None,
                 window: int) -> None:
        self.rings, self.pos, self.num_frames, self.window = rings, pos, num_frames, window
        self._keep: Tensor | None = None
        self._new: list[Tensor] = []

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, cos: Tensor,
               sin: Tensor) -> Tensor:
        """``q [B, H, T, D]``, ``k``/``v [B, Hkv, T, D]`` from the projections, RoPE's ``cos``
        and signed ``sin`` ``[B, 1, T, D]`` -> ``[B, T, H * D]``."""
        q, k = apply_rope_signed(q, cos, sin), apply_rope_signed(k, cos, sin)
        b, heads, t, _ = q.shape
        if self._keep is None:
            self._keep = _ring_mask(self.pos, t, self.window)
        ring = self.rings[:, layer]  # [B, 2, Hkv, R, D]
        self._new.append(_ring_update(ring, torch.stack([k, v], dim=1), self.pos,
                                      self.num_frames))
        k, v = torch.cat([ring[:, 0], k], dim=2), torch.cat([ring[:, 1], v], dim=2)
        rep = heads // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self._keep)  # [B, H, T, D]
        return out.transpose(1, 2).reshape(b, t, -1)

    def new(self) -> Tensor:
        return torch.stack(self._new, dim=1)


class _ArenaRing:
    """The K/V rings of one step's rows read and written in place in the arena ``[S, L, 2, Hkv,
    R, D]`` at ``slot_ids``: with ``fast``, ``kernels/codec_attention.py`` where it runs (CUDA,
    or the CPU interpreter); else ``_RowsRing``'s arithmetic one layer at a time, written back
    by slot."""

    def __init__(self, arena: Tensor, slot_ids: Tensor, pos: Tensor,
                 num_frames: Tensor | None, window: int, fast: bool) -> None:
        self.arena, self.slot_ids, self.pos = arena, slot_ids, pos
        self.num_frames, self.window, self.fast = num_frames, window, fast

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, cos: Tensor,
               sin: Tensor) -> Tensor:
        kernel = _codec_attention() if self.fast and _kernels_run_on(q) else None
        if kernel is not None and q.shape[2] <= kernel.MAX_NEW_FRAMES:
            return kernel.ring_attention(
                q, k, v, cos, sin, self.arena[:, layer], self.slot_ids, self.pos,
                self.num_frames, self.window)
        rows = _RowsRing(self.arena[self.slot_ids, layer][:, None], self.pos, self.num_frames,
                         self.window)
        out = rows.attend(0, q, k, v, cos, sin)
        self.arena[:, layer].index_copy_(0, self.slot_ids, rows.new()[:, 0])
        return out


def _codec_attention():  # noqa: ANN202 - imports Triton: only on the fast path
    from breezert.kernels import codec_attention

    return codec_attention


_INV_FREQ: dict[tuple[int, float, torch.device], Tensor] = {}


def _inv_freq(head_dim: int, theta: float, device: torch.device) -> Tensor:
    """The transformers "default" rope's ``1 / theta^(2i/d)`` (fp32), made once per device."""
    key = (head_dim, theta, device)
    if key not in _INV_FREQ:
        exponent = torch.arange(0, head_dim, 2, device=device).float() / head_dim
        inv_freq = 1.0 / (theta**exponent)  # [head_dim / 2]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return inv_freq  # never keep a graph pool's tensor
        _INV_FREQ[key] = inv_freq
    return _INV_FREQ[key]


def _rope(q_pos: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(cos, sin_signed)`` [B, 1, T, head_dim]: the transformers "default" rope (fp32, then
    cast), the rotate-half sign folded into sin (``apply_rope_signed``)."""
    freqs = q_pos[..., None].float() * _inv_freq(head_dim, theta, q_pos.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos().to(dtype)[:, None],
            fold_rotation_sign(emb.sin().to(dtype))[:, None])


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # the same math in one operator: on the CPU the same bits as below; on CUDA torch's
            # fused kernel (one launch instead of five; 17 norms a codec step)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LayerScale(nn.Module):
    """Per-channel residual scale (Mimi / Qwen3-TTS tokenizer transformers)."""

    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


class _Attention(nn.Module):
    def __init__(self, cfg: CodecConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.qkv_weight: Tensor | None = None  # prepare_fast: q, k, v weights in one matrix

    def prepare_fast(self) -> None:
        self.qkv_weight = torch.cat([self.q_proj.weight, self.k_proj.weight,
                                     self.v_proj.weight]).detach()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ring: _RowsRing | _ArenaRing,
                layer: int, fast: bool = False) -> Tensor:
        # x [B, T, hidden]; ``ring`` applies RoPE, attends over the cached window and keeps
        # the new keys; ``fast``: q, k and v from one GEMM
        b, t, _ = x.shape
        if fast and self.qkv_weight is not None:
            q, k, v = F.linear(x, self.qkv_weight).split(
                [self.q_proj.out_features, self.k_proj.out_features,
                 self.v_proj.out_features], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return self.o_proj(ring.attend(layer, q, k, v, cos, sin))


class _Mlp(nn.Module):
    def __init__(self, cfg: CodecConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_weight: Tensor | None = None  # prepare_fast: gate and up in one matrix

    def prepare_fast(self) -> None:
        self.gate_up_weight = torch.cat([self.gate_proj.weight, self.up_proj.weight]).detach()

    def forward(self, x: Tensor, fast: bool = False) -> Tensor:
        if fast and self.gate_up_weight is not None:  # gate and up from one GEMM
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class _TransformerLayer(nn.Module):
    def __init__(self, cfg: CodecConfig) -> None:
        super().__init__()
        self.input_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _Mlp(cfg)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ring: _RowsRing | _ArenaRing,
                layer: int, fast: bool = False) -> Tensor:
        """``fast``: packed q/k/v and gate/up GEMMs, each scaled residual in one ``addcmul``
        (the same arithmetic, in fewer launches; rounding may differ in the last place)."""
        h = self.self_attn(self.input_layernorm(x), cos, sin, ring, layer, fast)
        x = (torch.addcmul(x, self.self_attn_layer_scale.scale, h) if fast
             else x + self.self_attn_layer_scale(h))
        h = self.mlp(self.post_attention_layernorm(x), fast)
        return (torch.addcmul(x, self.mlp_layer_scale.scale, h) if fast
                else x + self.mlp_layer_scale(h))


class _PreTransformer(nn.Module):
    def __init__(self, cfg: CodecConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.layers = nn.ModuleList([_TransformerLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)

    def forward(self, x: Tensor, pos: Tensor, ring: _RowsRing | _ArenaRing,
                fast: bool = False) -> Tensor:
        # x [B, T, latent]; pos [B] frames before the step -> [B, T, latent]
        h = self.input_proj(x)
        q_pos = pos[:, None] + torch.arange(x.shape[1], device=pos.device)  # [B, T]
        cos, sin = _rope(q_pos, self.cfg.head_dim, self.cfg.rope_theta, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, ring, i, fast)
        return self.output_proj(self.norm(h))


# ------------------------------------------------------------------------------- decoder
class CodecDecoder(nn.Module):
    """Qwen3-TTS-Tokenizer-12Hz decoder; ``state_dict()`` keys are the file's ``decoder.*`` keys."""

    def __init__(self, cfg: CodecConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.quantizer = _SplitQuantizer(cfg)
        self.pre_conv = _CausalConv(cfg.codebook_dim, cfg.latent_dim, _PRE_CONV_KERNEL)
        self.pre_transformer = _PreTransformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList(
                [_CausalTransConv(cfg.latent_dim, cfg.latent_dim, f, f), _ConvNeXt(cfg.latent_dim)]
            )
            for f in cfg.upsampling_ratios
        )
        dims = [cfg.decoder_dim // 2**i for i in range(len(cfg.upsample_rates) + 1)]
        blocks = [_DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(cfg.upsample_rates)]
        self.decoder = nn.ModuleList(
            [
                _CausalConv(cfg.latent_dim, cfg.decoder_dim, _CONV_KERNEL),
                *blocks,
                SnakeBeta(dims[-1]),
                _CausalConv(dims[-1], 1, _CONV_KERNEL),
            ]
        )
        self._state_spec = _conv_state_spec(cfg)

    def new_state(
        self,
        num_streams: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> CodecStreamState:
        """Fresh (position 0, zero history) state for ``num_streams`` streams."""
        ref = self.pre_conv.conv.weight
        return CodecStreamState.zeros(
            self.cfg,
            num_streams,
            ref.device if device is None else device,
            ref.dtype if dtype is None else dtype,
        )

    @torch.no_grad()
    def prepare_fast(self) -> None:
        """Precomputes what the fast path reads (per-group codebook tables, GEMM layouts of the
        latent and the wide upsamplers, the transformer's packed q/k/v and gate/up weights) and
        restrides every conv weight for channels-last convolutions (``channels_last_weights_``);
        call after the weights are loaded and cast."""
        self.quantizer.prepare_fast()
        for module in self.modules():
            if isinstance(module, (_CausalTransConv, _Attention, _Mlp)):
                module.prepare_fast()
        channels_last_weights_(self)

    @torch.no_grad()
    def step(self, codes: Tensor, state: CodecStreamState, num_frames: Tensor | None = None,
             fast: bool = False, tables: tuple[Tensor, Tensor] | None = None,
             ) -> tuple[Tensor, CodecStreamState]:
        """Decodes the next ``F`` frames of ``B`` streams exactly, given their state.

        Args:
            codes: ``[B, F, num_quantizers]`` int64 codes in 0..codebook_size-1.
            state: per-row state (``B`` leading); left untouched.
            num_frames: ``[B]`` int64, frames of each row that are real (1..F; the rest are
                padding: decoded, then dropped from the state); ``None``: all ``F``.
            fast: the serving path (channels-last activations and convs, fused SnakeBeta +
                history, codebook tables, GEMM upsamplers; ``prepare_fast`` first): the same
                arithmetic up to rounding order.
            tables: without ``fast``, the quantizer's ``divided_tables()`` made once: the
                same bits as without them, in fewer operators.

        Returns:
            ``(wav [B, F * samples_per_frame] in [-1, 1], state after the F frames)``; with
            ``num_frames`` only each row's first ``num_frames * samples_per_frame`` are audio.
        """
        return self.decode_latent(self.latent(codes, fast, tables), state, num_frames, fast)

    def latent(self, codes: Tensor, fast: bool = False,
               tables: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """The quantizer's ``[B, codebook_dim, F]`` for ``codes [B, F, num_quantizers]``
        (``fast``, ``tables``: as ``step`` takes them; with ``fast`` laid out ``[B, F,
        codebook_dim]``); ValueError on another shape."""
        if codes.dim() != 3 or codes.shape[-1] != self.cfg.num_quantizers:
            raise ValueError(
                f"codes must be [B, F, {self.cfg.num_quantizers}], got {tuple(codes.shape)}"
            )
        if fast:
            return self.quantizer.decode_fast(codes)
        return self.quantizer.decode(codes, tables)

    def decode_latent(self, latent: Tensor, state: CodecStreamState,
                      num_frames: Tensor | None = None,
                      fast: bool = False) -> tuple[Tensor, CodecStreamState]:
        """``step`` after the quantizer: ``latent [B, codebook_dim, F]`` (summed, projected
        codebook vectors) -> ``(wav [B, F * samples_per_frame], state)``. Keeps autograd on, so
        the codec trainer (``breezert_train``) drives the same graph the runtime decodes with."""
        carry = _Carry(state.conv, self._state_spec, num_frames, latent.shape[-1], fast)
        ring = _RowsRing(state.kv, state.pos, num_frames, self.cfg.sliding_window)
        wav = self.forward_rows(latent, carry, state.pos, ring)
        advance = latent.shape[-1] if num_frames is None else num_frames
        return wav, CodecStreamState(carry.flat(), ring.new(), state.pos + advance)

    def forward_rows(self, latent: Tensor, carry: _Carry, pos: Tensor,
                     ring: _RowsRing | _ArenaRing) -> Tensor:
        """The decoder over one step's rows: their conv histories behind ``carry``, positions
        ``pos [B]``, K/V rings behind ``ring`` -> ``wav [B, F * samples_per_frame]``; the new
        histories and rings stay with ``carry`` and ``ring``."""
        x = self.pre_conv(latent, carry)  # [B, latent, F]
        x = self.pre_transformer(x.transpose(1, 2), pos, ring, carry.fast)
        x = x.transpose(1, 2)  # [B, latent, F]
        for tconv, convnext in self.upsample:
            x = convnext(tconv(x, carry), carry)  # [B, latent, F * prod(ratios)]
        x = self.decoder[0](x, carry)  # [B, decoder_dim, ...]
        for block in self.decoder[1:-2]:
            x = block(x, carry)
        x = self.decoder[-1](x, carry, self.decoder[-2])  # [B, 1, F * samples_per_frame]
        carry.finish()
        return x.squeeze(1).clamp(-1.0, 1.0)

    @torch.no_grad()
    def decode(self, codes: Tensor) -> Tensor:
        """Full causal decode: codes ``[B, T, 16]`` -> waveform ``[B, T * 1920]`` in [-1, 1].

        NOTE: unlike qwen_tts ``chunked_decode`` this never re-windows past 300 frames; the two
        agree up to 300 frames, and this one equals the streaming decoder at any length.
        """
        wav, _ = self.step(codes, self.new_state(codes.shape[0]))
        return wav


CODEC_PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
"""Serving precisions: ``fp32`` (TF32 off for the codec's convolutions and matmuls), ``tf32``
(fp32 storage, TF32 tensor-core math), ``bf16`` and ``fp16`` (weights, activations and stream
state in bfloat16 / float16: bf16's rate on tensor cores; fp16 keeps 10 mantissa bits, as TF32
does, but overflows past 65504)."""

HALF_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The precisions that serve a copy of the decoder in a 16-bit dtype, and that dtype."""


@contextlib.contextmanager
def tf32_math(enabled: bool | None) -> Iterator[None]:
    """TF32 on or off for cuDNN convolutions and CUDA matmuls while the block runs (``None``:
    the process's flags). Read when kernels are chosen, so a CUDA graph captured inside keeps
    them."""
    if enabled is None:
        yield
        return
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


class StreamingCodec:
    """Exact incremental decode for up to ``max_slots`` streams held in a preallocated arena.

    Rows of one ``decode`` call may sit at different positions and decode different numbers of
    frames; they run as one batched forward.
    """

    def __init__(
        self,
        decoder: CodecDecoder,
        max_slots: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        fast: bool = False,
        tf32: bool | None = None,
    ) -> None:
        """``fast``: the serving path (``CodecDecoder.step``); its ``prepare_fast`` restrides
        ``decoder``'s conv weights in place (the same values) for its channels-last convs."""
        self.decoder = decoder
        self.max_slots = max_slots
        self.fast, self.tf32 = fast, tf32
        if fast:
            decoder.prepare_fast()
        self.tables = None if fast else decoder.quantizer.divided_tables()
        """The codebooks divided once: like ``fast``'s tables, a snapshot of the decoder's
        codebooks at construction (serving weights do not change; build a new
        ``StreamingCodec`` after loading others). Codes must be in 0..codebook_size-1, which
        neither path checks on the step (no host sync)."""
        self.state = decoder.new_state(max_slots, device=device, dtype=dtype)

    @classmethod
    def for_serving(cls, decoder: CodecDecoder, max_slots: int, precision: str = "tf32",
                    fast: bool = True) -> StreamingCodec:
        """The serving codec at ``precision`` (one of ``CODEC_PRECISIONS``); ``bf16`` and
        ``fp16`` work on a copy of ``decoder`` in that dtype (the original stays fp32 for the
        reference paths). Raises ValueError when a weight or buffer (a codebook's
        ``embedding_sum``, say) does not fit the 16-bit dtype: fp16 stops at 65504."""
        if precision not in CODEC_PRECISIONS:
            raise ValueError(f"codec precision must be one of {CODEC_PRECISIONS}, got "
                             f"{precision!r}")
        device = decoder.pre_conv.conv.weight.device
        if precision in HALF_PRECISION_DTYPES:
            decoder = copy.deepcopy(decoder).to(HALF_PRECISION_DTYPES[precision])
            bad = [name for name, t in decoder.state_dict().items() if not t.isfinite().all()]
            if bad:  # once, at load: the copy of a finite fp32 codec overflowed
                raise ValueError(f"codec precision {precision!r}: {bad[0]} (and {len(bad) - 1} "
                                 f"more) overflow {HALF_PRECISION_DTYPES[precision]}; serve "
                                 f"this codec at tf32 or bf16")
        tf32 = None if device.type != "cuda" else precision == "tf32"
        return cls(decoder, max_slots, device=device, fast=fast, tf32=tf32)

    @property
    def positions(self) -> Tensor:
        """[max_slots] int64 frames decoded so far per slot."""
        return self.state.pos

    def reset(self, slot_ids: Tensor) -> None:
        """Zeroes the histories of ``slot_ids`` and rewinds them to frame 0."""
        self.state.reset_(slot_ids.to(self.state.pos.device))

    @torch.no_grad()
    def decode(self, slot_ids: Tensor, codes: Tensor, num_frames: Tensor | None = None) -> Tensor:
        """Decodes ``codes [B, F, 16]`` for the distinct ``slot_ids [B]``; returns ``[B, F*1920]``
        (row ``i``'s first ``num_frames[i] * 1920`` samples when ``num_frames`` is given).

        One batched step over the slots' state in place: each conv's history is read from the
        arena and its new one written back as the step goes (``_Carry`` with ``slot_ids``), the
        K/V rings likewise (``_ArenaRing``); with ``fast``, Triton kernels for both where they
        run.
        """
        # The kernels read slot ids and frame counts by raw pointer (element b at b): the stage
        # passes a column of its [B, 1 + F] rows (stride 1 + F), which they would read as other
        # rows' frame indices (another stream's slot, or past the arena).
        state, slot_ids = self.state, slot_ids.to(self.state.pos.device).contiguous()
        if num_frames is not None:
            num_frames = num_frames.contiguous()
        pos = state.pos[slot_ids]
        frames = codes.shape[1]
        carry = _Carry(state.conv, self.decoder._state_spec, num_frames, frames, self.fast,
                       slot_ids=slot_ids)
        ring = _ArenaRing(state.kv, slot_ids, pos, num_frames, self.decoder.cfg.sliding_window,
                          self.fast)
        with tf32_math(self.tf32):
            latent = self.decoder.latent(codes, self.fast, self.tables)
            wav = self.decoder.forward_rows(latent, carry, pos, ring)
        state.pos.index_copy_(0, slot_ids, pos + (frames if num_frames is None else num_frames))
        return wav


# ------------------------------------------------------------------------------- random init
def _normal_(t: Tensor, std: float, generator: torch.Generator | None) -> None:
    # Draw on CPU in fp32 so a seed gives the same weights on every device and dtype.
    t.copy_(torch.randn(t.shape, generator=generator) * std)


def _init_codebooks_(quantizer: _SplitQuantizer, generator: torch.Generator | None) -> None:
    for group in (quantizer.rvq_first, quantizer.rvq_rest):
        for vq in group.vq.layers:
            book = vq._codebook
            usage = 0.5 + torch.rand(book.cluster_usage.shape, generator=generator)  # > 0
            emb = torch.randn(book.embedding_sum.shape, generator=generator)
            book.cluster_usage.copy_(usage)
            book.embedding_sum.copy_(emb * usage[:, None])  # embedding rows ~ N(0, 1)
        # Unit-variance group output whatever the number of summed codebooks.
        dim, num_books = group.output_proj.weight.shape[1], len(group.vq.layers)
        _normal_(group.output_proj.weight, (dim * num_books) ** -0.5, generator)
        _normal_(group.input_proj.weight, group.input_proj.weight.shape[1] ** -0.5, generator)


@torch.no_grad()
def init_codec_random_(
    decoder: CodecDecoder, generator: torch.Generator | None = None, out_gain: float = 0.05
) -> CodecDecoder:
    """Random weights under which random codes give finite, audible, mostly unclipped audio.

    Convs and linears get ``N(0, 1 / fan_in)`` (transposed convs count ``in * k / s``), biases 0,
    norms 1, layer scales and ConvNeXt gammas ``layer_scale_initial_scale``, SnakeBeta log-params
    ``N(0, 0.1^2)``; the final conv is scaled by ``out_gain`` to keep the waveform well inside
    [-1, 1]. Returns ``decoder`` (modified in place).
    """
    scale = decoder.cfg.layer_scale_initial_scale
    for module in decoder.modules():
        if isinstance(module, (nn.Conv1d, nn.ConvTranspose1d, nn.Linear)):
            w = module.weight
            if isinstance(module, nn.ConvTranspose1d):
                fan_in = w.shape[0] * w.shape[2] // module.stride[0]
            else:
                fan_in = w[0].numel()
            _normal_(w, fan_in**-0.5, generator)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, (_RMSNorm, nn.LayerNorm)):
            module.weight.fill_(1.0)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, LayerScale):
            module.scale.fill_(scale)
        elif isinstance(module, _ConvNeXt):
            module.gamma.fill_(scale)
        elif isinstance(module, SnakeBeta):
            _normal_(module.alpha, 0.1, generator)
            _normal_(module.beta, 0.1, generator)
    _init_codebooks_(decoder.quantizer, generator)
    for module in decoder.modules():
        if isinstance(module, _ResidualUnit):  # keep 12 stacked residual adds from compounding
            module.conv2.conv.weight.mul_(0.3)
    decoder.decoder[-1].conv.weight.mul_(out_gain)
    return decoder
