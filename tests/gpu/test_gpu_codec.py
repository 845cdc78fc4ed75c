"""GPU: the serving codec (fused kernels, TF32 / bf16 / fp16, mixed-size replays under CUDA
graphs) on the full-size random codec, against strict fp32 and against itself for any chunking.

Run on a CUDA machine: ``python -m pytest tests/gpu -q`` (skipped without CUDA).
"""

from __future__ import annotations

import copy

import pytest
import torch

from breezert.models.codec import StreamingCodec
from breezert.random_init import build_random
from breezert.worker.cuda_graphs import GraphRunner
from breezert.stages.codec import codec_step

pytestmark = pytest.mark.gpu

SPF = 1920
FRAMES = 64
# Waveform SNR against a strict-fp32 one-shot decode, over 4 streams of 64 frames streamed in
# chunks 1, 2, 4, 8, 16, ...: the bound each serving precision must keep (measured on the H200:
# TF32 51 dB, bf16 27 dB; bench/results/h200-codec-precision-*.json). fp16 must be as precise as
# the served TF32, so it keeps TF32's bound (not measured on the GPU yet).
MIN_SNR_DB = {"tf32": 40.0, "bf16": 20.0, "fp16": 40.0}


@pytest.fixture(scope="module")
def decoder() -> torch.nn.Module:
    """The eager paths' weights; a fast codec takes a copy (its ``prepare_fast`` restrides the
    conv weights in place)."""
    _, _, codec = build_random("full", seed=0, device="cuda")
    return codec


@pytest.fixture(scope="module")
def codes() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 2048, (4, FRAMES, 16), generator=gen).cuda()


@pytest.fixture(scope="module")
def strict(decoder: torch.nn.Module, codes: torch.Tensor) -> torch.Tensor:
    sc = StreamingCodec.for_serving(decoder, 5, "fp32", fast=False)
    return sc.decode(torch.arange(4, device="cuda"), codes).float()


def _ramp(sc: StreamingCodec, codes: torch.Tensor) -> torch.Tensor:
    slots = torch.arange(codes.shape[0], device="cuda")
    sc.reset(slots)
    pieces, start, size = [], 0, 1
    while start < codes.shape[1]:
        pieces.append(sc.decode(slots, codes[:, start : start + size]).float())
        start += size
        size = min(2 * size, 16)
    return torch.cat(pieces, dim=1)


def _snr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.double().pow(2).sum() / (x - ref).double().pow(2).sum()))


@pytest.mark.parametrize("precision", ["tf32", "bf16", "fp16"])
def test_fast_codec_within_its_snr_bound_and_chunking_invariant(
    decoder: torch.nn.Module, codes: torch.Tensor, strict: torch.Tensor, precision: str
) -> None:
    sc = StreamingCodec.for_serving(copy.deepcopy(decoder), 5, precision, fast=True)
    streamed = _ramp(sc, codes)
    snr = _snr_db(strict, streamed)
    print(f"\n{precision} fast codec: {snr:.1f} dB against strict fp32")
    assert snr >= MIN_SNR_DB[precision]
    sc.reset(torch.arange(4, device="cuda"))
    one_shot = sc.decode(torch.arange(4, device="cuda"), codes).float()
    # any chunking gives that precision's one-shot waveform (up to its rounding)
    assert _snr_db(one_shot, streamed) >= MIN_SNR_DB[precision] + 6


def test_fast_kernels_match_the_reference_at_tf32(
    decoder: torch.nn.Module, codes: torch.Tensor
) -> None:
    """Same precision, fused kernels against the eager modules: rounding differences only."""
    ref = _ramp(StreamingCodec.for_serving(decoder, 5, "tf32", fast=False), codes)
    fast = _ramp(StreamingCodec.for_serving(copy.deepcopy(decoder), 5, "tf32", fast=True), codes)
    assert _snr_db(ref, fast) >= 50.0


@pytest.mark.parametrize("precision", ["tf32", "fp16"])
def test_fast_codec_streams_the_eager_codecs_waveform(
    decoder: torch.nn.Module, codes: torch.Tensor, strict: torch.Tensor, precision: str
) -> None:
    """The fast codec (channels-last, on its own copy of the weights: it restrides them)
    against the eager modules at the same precision: rounding differences only (the two as
    close as any chunking is to one shot), as close to strict fp32 as the eager codec within
    1 dB and within its precision's bound, any chunking its one-shot waveform."""
    eager = _ramp(StreamingCodec.for_serving(decoder, 5, precision, fast=False), codes)
    sc = StreamingCodec.for_serving(copy.deepcopy(decoder), 5, precision, fast=True)
    streamed = _ramp(sc, codes)
    print(f"\n{precision}: fast {_snr_db(strict, streamed):.1f} dB against strict fp32, "
          f"eager {_snr_db(strict, eager):.1f}, the two {_snr_db(eager, streamed):.1f}")
    assert _snr_db(eager, streamed) >= MIN_SNR_DB[precision] + 6
    assert _snr_db(strict, streamed) >= max(MIN_SNR_DB[precision],
                                            _snr_db(strict, eager) - 1.0)
    sc.reset(torch.arange(4, device="cuda"))
    one_shot = sc.decode(torch.arange(4, device="cuda"), codes).float()
    assert _snr_db(one_shot, streamed) >= MIN_SNR_DB[precision] + 6


def test_mixed_size_graph_replay_equals_per_size_decoding(
    decoder: torch.nn.Module, codes: torch.Tensor
) -> None:
    """One captured (4 streams, 16 frames) replay with per-row counts 16, 1, 5, 0 leaves every
    slot where per-size eager decoding leaves it, and gives its audio."""
    # strict fp32: the comparison sees the per-row bookkeeping, not TF32's shape-dependent rounding
    dec = copy.deepcopy(decoder)  # both codecs' weights (each restrides them the same way)
    mixed = StreamingCodec.for_serving(dec, 5, "fp32", fast=True)
    plain = StreamingCodec.for_serving(dec, 5, "fp32", fast=True)
    graphs = GraphRunner("codec", lambda **kw: codec_step(mixed, **kw), enabled=True,
                         device=torch.device("cuda"))
    slots = torch.arange(4, device="cuda")
    example = {"slot_ids": torch.full((4,), 4, device="cuda"),
               "codes": torch.zeros(4, 16, 16, dtype=torch.long, device="cuda"),
               "num_frames": torch.full((4,), 16, dtype=torch.long, device="cuda")}
    graphs.capture((4, 16), example)
    mixed.reset(torch.arange(5, device="cuda"))
    plain.reset(torch.arange(5, device="cuda"))
    done = [0, 0, 0, 0]
    for counts in ([16, 1, 5, 0], [3, 16, 2, 16], [16, 7, 16, 1]):
        chunk = torch.zeros(4, 16, 16, dtype=torch.long, device="cuda")
        for i, n in enumerate(counts):
            chunk[i, :n] = codes[i, done[i] : done[i] + n]
        wav = graphs((4, 16), {"slot_ids": slots, "codes": chunk,
                               "num_frames": torch.tensor(counts, device="cuda")})["wav"].float()
        for i, n in enumerate(counts):
            if n == 0:
                continue
            want = plain.decode(slots[i : i + 1], codes[i : i + 1, done[i] : done[i] + n]).float()
            got = wav[i : i + 1, : n * SPF]
            assert _snr_db(want, got) >= 80.0, (counts, i)
            done[i] += n
    assert graphs.num_replays == 3
    assert mixed.positions[:4].tolist() == plain.positions[:4].tolist() == done


@pytest.mark.parametrize("dtype,tf32", [(torch.float32, False), (torch.float32, True),
                                        (torch.bfloat16, False)])
def test_ring_attention_kernel_matches_the_torch_ring_at_full_size(dtype: torch.dtype,
                                                                    tf32: bool) -> None:
    """The compiled in-place ring attention (RoPE inside) against ``_RowsRing`` at the full
    codec's shapes: one frame and 16-frame pieces, rows fresh, mid-ring, at the wrap and far
    past it, padding frames; the ring's values written bit for bit, its keys within a rounding,
    every other slot and entry untouched."""
    from breezert.kernels.codec_attention import ring_attention
    from breezert.models.codec import _rope, _RowsRing
    from breezert.models.config import CodecConfig

    cfg = CodecConfig()
    window, ring = cfg.sliding_window, cfg.sliding_window - 1
    gen = torch.Generator(device="cuda").manual_seed(3)
    arena = torch.randn(9, 2, cfg.num_kv_heads, ring, cfg.head_dim, device="cuda",
                        generator=gen).to(dtype)
    slot_ids = torch.tensor([7, 0, 3, 5, 2, 8], device="cuda")
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        for t, pos, frames in ((1, [0, 5, 70, 71, 300, 9], [1, 1, 1, 1, 1, 0]),
                               (16, [0, 60, 64, 71, 500, 3], [16, 16, 9, 1, 16, 0])):
            pos = torch.tensor(pos, device="cuda")
            frames = torch.tensor(frames, device="cuda")
            shape = (6, t, cfg.num_heads, cfg.head_dim)
            q = torch.randn(shape, device="cuda", generator=gen).to(dtype).transpose(1, 2)
            k, v = (torch.randn(6, t, cfg.num_kv_heads, cfg.head_dim, device="cuda",
                                generator=gen).to(dtype).transpose(1, 2) for _ in range(2))
            want_arena = arena.clone()
            cos, sin = _rope(pos[:, None] + torch.arange(t, device="cuda"), cfg.head_dim,
                             cfg.rope_theta, dtype)
            got = ring_attention(q, k, v, cos, sin, arena, slot_ids, pos, frames,
                                 window).float()
            torch.backends.cuda.matmul.allow_tf32 = False  # the reference in fp32
            rows = _RowsRing(want_arena[slot_ids][:, None].float(), pos, frames, window)
            want = rows.attend(0, q.float(), k.float(), v.float(), cos.float(), sin.float())
            torch.backends.cuda.matmul.allow_tf32 = tf32
            want_arena[slot_ids] = rows.new()[:, 0].to(dtype)
            tol = {(torch.float32, False): 1e-5, (torch.float32, True): 5e-3,
                   (torch.bfloat16, False): 3e-2}[(dtype, tf32)]
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
            # values bit for bit; keys rotated in the kernel (fp32, one rounding, FMA)
            assert torch.equal(arena[:, 1], want_arena[:, 1])
            key_tol = 1e-6 if dtype == torch.float32 else 8e-3
            torch.testing.assert_close(arena[:, 0], want_arena[:, 0], atol=key_tol,
                                       rtol=key_tol)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
