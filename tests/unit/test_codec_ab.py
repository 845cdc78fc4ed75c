"""``bench/codec_ab.py``'s ``before`` paths on the CPU: each computes what the runtime computes,
so the GPU A/B times two ways of the same arithmetic. (Its ``upsampler`` path once took the
GEMM's old signature and failed only on the GPU, inside a device call.) The timing itself needs
CUDA graphs; these check the paths it swaps in, on a tiny codec."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from breezert.models import codec as codec_module
from breezert.models.codec import CodecDecoder, StreamingCodec, init_codec_random_
from breezert.models.config import BreezeConfig

pytestmark = pytest.mark.unit

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import codec_ab  # noqa: E402 - bench/ is not a package


@pytest.mark.parametrize("taps", [1, 2], ids=["kernel-is-stride", "kernel-twice-stride"])
def test_transposed_view_gemm_gives_the_runtimes_upsampling(
        monkeypatch: pytest.MonkeyPatch, taps: int) -> None:
    """Both upsampler kinds the fast codec runs as GEMMs (the latent ones, kernel == stride, and
    the wide ones, kernel 2 x stride with one frame of history) on a channels-last input: the
    A/B's transposed-view GEMM gives the runtime's values, channels-first."""
    monkeypatch.setattr(codec_module, "GEMM_UPSAMPLE_MIN_CHANNELS", 8)  # the tiny one is wide
    torch.manual_seed(0)
    up = codec_module._CausalTransConv(16, 8, kernel=4 * taps, stride=4)
    up.prepare_fast()
    assert up.gemm_weight is not None
    num_new = 5
    # the fast codec's activations: [B, C, T] views of contiguous [B, T, C]
    x = torch.randn(3, num_new + up.history, 16).transpose(1, 2)
    want = codec_ab.RUNTIME_GEMM(up, x, num_new)
    got = codec_ab.transposed_view_gemm(up, x, num_new)
    assert got.shape == want.shape == (3, 8, num_new * 4)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got.is_contiguous() == (taps == 2)  # the wide one's result made channels-first


def test_patched_upsampler_and_gathered_state_decode_the_runtimes_waveform(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A streamed fast codec with the A/B's ``before`` paths installed (the transposed-view
    upsampler; the state gathered and scattered around the step) decodes the runtime's
    waveform and leaves its slots where the runtime does."""
    monkeypatch.setattr(codec_module, "GEMM_UPSAMPLE_MIN_CHANNELS", 1)  # every wide one a GEMM
    dec = CodecDecoder(BreezeConfig.tiny().codec)
    init_codec_random_(dec, torch.Generator().manual_seed(0))
    codes = torch.randint(0, 2048, (2, 6, 16), generator=torch.Generator().manual_seed(1))
    slots = torch.arange(2)

    def streamed() -> tuple[torch.Tensor, torch.Tensor]:
        sc = StreamingCodec(dec.eval(), max_slots=2, fast=True)
        sc.reset(slots)
        with torch.inference_mode():
            wav = torch.cat([sc.decode(slots, codes[:, i:i + 2]) for i in (0, 2, 4)], dim=-1)
        return wav, sc.positions.clone()

    want, want_pos = streamed()
    assert any(m.gemm_weight is not None and m.history == 1 for m in dec.modules()
               if isinstance(m, codec_module._CausalTransConv))
    for change in ("upsampler", "state"):
        with codec_ab.CHANGES[change][2]():
            got, got_pos = streamed()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=change)
        assert torch.equal(got_pos, want_pos), change
