"""Codec decoder unit tests on a tiny random decoder: streaming == offline, slots, reset, sizes.

Owns CPU-only checks of ``breezert.models.codec``; golden weights are tested in
``tests/golden/test_codec_golden.py``. Must not read fixtures or need a GPU.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from breezert.models.codec import (
    CodecDecoder,
    SnakeBeta,
    StreamingCodec,
    init_codec_random_,
    stream_state_numel,
)
from breezert.models.config import BreezeConfig

pytestmark = pytest.mark.unit

SPF = 1920  # samples per frame
NUM_FRAMES = 100  # longer than the 72-frame attention window
ATOL = 1e-5


@pytest.fixture(scope="module")
def decoder() -> CodecDecoder:
    dec = CodecDecoder(BreezeConfig.tiny().codec)
    init_codec_random_(dec, torch.Generator().manual_seed(0))
    return dec.eval()


@pytest.fixture(scope="module")
def codes() -> torch.Tensor:
    return torch.randint(0, 2048, (3, NUM_FRAMES, 16), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def full_wav(decoder: CodecDecoder, codes: torch.Tensor) -> torch.Tensor:
    return decoder.decode(codes)  # [3, NUM_FRAMES * SPF]


def _schedule(kind: str, total: int) -> list[int]:
    if kind == "ramp":
        sizes = [1, 2, 4, 8, 16]
    elif kind == "ones":
        sizes = [1]
    else:
        gen = torch.Generator().manual_seed(7)
        sizes = torch.randint(1, 12, (total,), generator=gen).tolist()
    out: list[int] = []
    while sum(out) < total:
        size = sizes[len(out)] if len(out) < len(sizes) else sizes[-1]
        out.append(min(size, total - sum(out)))
    return out


def _stream(sc: StreamingCodec, slot: int, codes: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    # codes [T, 16] -> wav [sum(sizes) * SPF], decoding one chunk per call in slot ``slot``.
    wavs, start = [], 0
    for size in sizes:
        wavs.append(sc.decode(torch.tensor([slot]), codes[None, start : start + size])[0])
        start += size
    return torch.cat(wavs)


def test_full_decode_shape_and_range(full_wav: torch.Tensor) -> None:
    assert full_wav.shape == (3, NUM_FRAMES * SPF)
    assert full_wav.dtype == torch.float32
    assert full_wav.abs().max() <= 1.0


def test_random_init_gives_audible_unclipped_audio(full_wav: torch.Tensor) -> None:
    assert torch.isfinite(full_wav).all()
    assert full_wav.pow(2).mean().sqrt() > 1e-4
    assert full_wav.abs().max() <= 1.0
    assert (full_wav.abs() >= 1.0).float().mean() < 0.01  # not clipping everywhere


@pytest.mark.parametrize("kind", ["ramp", "ones", "random"])
def test_streaming_equals_full(
    decoder: CodecDecoder, codes: torch.Tensor, full_wav: torch.Tensor, kind: str
) -> None:
    frames = 80 if kind == "ones" else NUM_FRAMES  # 80 one-frame calls still pass the window
    sc = StreamingCodec(decoder, max_slots=4)
    wav = _stream(sc, 2, codes[0, :frames], _schedule(kind, frames))
    torch.testing.assert_close(wav, full_wav[0, : frames * SPF], atol=ATOL, rtol=0)
    assert sc.positions.tolist() == [0, 0, frames, 0]


def test_batched_slots_at_different_positions(
    decoder: CodecDecoder, codes: torch.Tensor, full_wav: torch.Tensor
) -> None:
    sc = StreamingCodec(decoder, max_slots=8)
    arena = (sc.state.conv.data_ptr(), sc.state.kv.data_ptr(), sc.state.pos.data_ptr())
    slots, warm_sizes = [4, 1, 6], [[], [5] * 6, [1, 2, 2, 2, 68]]
    # Bring each slot to its own history (0, 30, 75 frames), each with its own chunk sizes.
    parts = [
        [_stream(sc, s, codes[i, : sum(sizes)], sizes)] if sizes else []
        for i, (s, sizes) in enumerate(zip(slots, warm_sizes, strict=True))
    ]
    cursor = [sum(sizes) for sizes in warm_sizes]
    for size in [1, 2, 4, 3, 1]:  # one batched forward per call, different histories per row
        batch = torch.stack([codes[i, c : c + size] for i, c in enumerate(cursor)])
        wav = sc.decode(torch.tensor(slots), batch)
        for i in range(3):
            parts[i].append(wav[i])
            cursor[i] += size
    wav = sc.decode(
        torch.tensor([6, 4]),
        torch.stack([codes[2, cursor[2] : cursor[2] + 5], codes[0, cursor[0] : cursor[0] + 5]]),
    )
    parts[2].append(wav[0])
    parts[0].append(wav[1])
    cursor[2] += 5
    cursor[0] += 5
    for i in range(3):
        got = torch.cat(parts[i])
        torch.testing.assert_close(got, full_wav[i, : cursor[i] * SPF], atol=ATOL, rtol=0)
    assert sc.positions[slots].tolist() == cursor
    assert arena == (sc.state.conv.data_ptr(), sc.state.kv.data_ptr(), sc.state.pos.data_ptr())


def test_grouped_kv_heads_stream_exactly(codes: torch.Tensor) -> None:
    cfg = dataclasses.replace(BreezeConfig.tiny().codec, num_kv_heads=1)
    dec = init_codec_random_(CodecDecoder(cfg), torch.Generator().manual_seed(2))
    full = dec.decode(codes[:1, :80])
    sc = StreamingCodec(dec, max_slots=1)
    wav = _stream(sc, 0, codes[0, :80], [8] * 10)
    torch.testing.assert_close(wav, full[0], atol=ATOL, rtol=0)


def test_reset_makes_a_slot_fresh(
    decoder: CodecDecoder, codes: torch.Tensor, full_wav: torch.Tensor
) -> None:
    sc = StreamingCodec(decoder, max_slots=3)
    _stream(sc, 0, codes[1, :40], [8] * 5)
    first = _stream(sc, 1, codes[2, :10], [10])
    sc.reset(torch.tensor([0]))
    assert sc.positions.tolist() == [0, 10, 0]
    wav = _stream(sc, 0, codes[0, :20], [1, 3, 16])
    torch.testing.assert_close(wav, full_wav[0, : 20 * SPF], atol=ATOL, rtol=0)
    rest = _stream(sc, 1, codes[2, 10:20], [4, 6])  # the untouched slot carries on exactly
    torch.testing.assert_close(torch.cat([first, rest]), full_wav[2, : 20 * SPF], atol=ATOL, rtol=0)


def test_decode_is_causal(decoder: CodecDecoder, codes: torch.Tensor) -> None:
    changed = codes[:1].clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 2048
    a, b = decoder.decode(codes[:1, :30]), decoder.decode(changed[:, :30])
    torch.testing.assert_close(a[:, : 20 * SPF], b[:, : 20 * SPF], atol=0, rtol=0)
    assert not torch.equal(a[:, 20 * SPF :], b[:, 20 * SPF :])


def test_codebook_buffers_are_read_live(decoder: CodecDecoder, codes: torch.Tensor) -> None:
    # The embedding is embedding_sum / clamp(cluster_usage): scaling both must change nothing.
    dec = CodecDecoder(decoder.cfg)
    state = {k: v.clone() for k, v in decoder.state_dict().items()}
    for k in state:
        if k.endswith(("embedding_sum", "cluster_usage")):
            state[k] *= 4.0
    dec.load_state_dict(state, strict=True)
    torch.testing.assert_close(dec.decode(codes[:1, :6]), decoder.decode(codes[:1, :6]))


def test_arena_size_matches_state_numel(decoder: CodecDecoder) -> None:
    sc = StreamingCodec(decoder, max_slots=5)
    per_slot = sc.state.conv[0].numel() + sc.state.kv[0].numel()
    assert per_slot == stream_state_numel(decoder.cfg)
    assert sc.state.kv.shape == (5, 2, 2, 2, 71, 8)  # [S, L, K/V, Hkv, window - 1, D]


def test_full_size_builds_on_meta_with_spec_state_size() -> None:
    cfg = BreezeConfig.full().codec
    with torch.device("meta"):
        dec = CodecDecoder(cfg)
    assert dec.pre_conv.conv.weight.shape == (1024, 512, 3)
    assert abs(stream_state_numel(dec.cfg) - 1.30e6) / 1.30e6 < 0.01  # SPEC §3.3
    sc = StreamingCodec(dec, max_slots=2)
    assert sc.state.kv.shape == (2, 8, 2, 16, 71, 64)
    assert sc.state.conv.device.type == "meta"


def test_bad_codes_shape_is_rejected(decoder: CodecDecoder) -> None:
    with pytest.raises(ValueError, match="codes must be"):
        decoder.decode(torch.zeros(1, 4, 8, dtype=torch.long))


def _stream_mixed(sc: StreamingCodec, codes: torch.Tensor, schedules: list[list[int]]) -> torch.Tensor:
    """Rows ``0..B-1`` of ``codes [B, T, 16]`` decoded together in slots 0..B-1, each step
    padding every row to the step's largest chunk (a row past its schedule decodes 0 frames)."""
    rows, total = codes.shape[0], codes.shape[1]
    slots = torch.arange(rows)
    sc.reset(slots)
    done, outs, step = [0] * rows, [[] for _ in range(rows)], 0
    while min(done) < total:
        want = [min(s[step] if step < len(s) else 0, total - d)
                for s, d in zip(schedules, done, strict=True)]
        width = max(want)
        chunk = torch.zeros(rows, width, 16, dtype=torch.long)
        for i, n in enumerate(want):
            chunk[i, :n] = codes[i, done[i] : done[i] + n]
        wav = sc.decode(slots, chunk, torch.tensor(want))
        for i, n in enumerate(want):
            outs[i].append(wav[i, : n * SPF])
            done[i] += n
        step += 1
    return torch.stack([torch.cat(o) for o in outs])


MIXED = [[1, 2, 4, 8, 16, 16, 16, 16, 16, 5], [16] * 6 + [4], [3] * 34]


@pytest.mark.parametrize("fast", [False, True])
def test_rows_of_different_chunk_sizes_share_a_step(
    decoder: CodecDecoder, codes: torch.Tensor, full_wav: torch.Tensor, fast: bool,
) -> None:
    """Per-row frame counts (``num_frames``): each row equals its one-shot decode, and a row
    that decodes 0 frames in a step keeps its state (rows finish at different steps here).
    ``fast``: the convs as 2-D channels-last convolutions on restrided weights (the kernels
    that build their inputs channels-last: ``test_codec_attention_kernel.py``)."""
    dec = copy.deepcopy(decoder) if fast else decoder
    sc = StreamingCodec(dec, max_slots=3, fast=fast)
    wav = _stream_mixed(sc, codes, MIXED)
    torch.testing.assert_close(wav, full_wav, atol=ATOL, rtol=0)
    assert sc.positions.tolist() == [NUM_FRAMES] * 3


def test_the_fast_path_restrides_the_weights_keeping_their_values(
        decoder: CodecDecoder) -> None:
    """``StreamingCodec(fast=True)`` stores every conv weight as a 2-D channels-last weight,
    the same values; the latent upsamplers become GEMMs."""
    dec = copy.deepcopy(decoder)
    StreamingCodec(dec, max_slots=1, fast=True)
    convs = [m for m in dec.modules() if isinstance(m, (torch.nn.Conv1d,
                                                         torch.nn.ConvTranspose1d))]
    assert all(m.weight.unsqueeze(2).is_contiguous(memory_format=torch.channels_last)
               for m in convs)
    want = decoder.state_dict()
    assert all(torch.equal(t, want[name]) for name, t in dec.state_dict().items())
    latent = [m for m, _ in dec.upsample]
    assert all(m.gemm_weight is not None and m.gemm_bias is not None for m in latent)


def test_fast_path_matches_the_reference_with_the_gemm_upsampler(
    codes: torch.Tensor, full_wav: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast path (codebook tables, the decoder blocks' upsamplers as GEMMs: forced on for
    the tiny decoder's narrow blocks) streams the reference's waveform."""
    import breezert.models.codec as codec_module

    monkeypatch.setattr(codec_module, "GEMM_UPSAMPLE_MIN_CHANNELS", 0)
    dec = CodecDecoder(BreezeConfig.tiny().codec)
    init_codec_random_(dec, torch.Generator().manual_seed(0))
    sc = StreamingCodec(dec.eval(), max_slots=3, fast=True)
    gemms = [m for m in dec.decoder.modules() if getattr(m, "gemm_weight", None) is not None]
    assert len(gemms) == len(dec.cfg.upsample_rates)
    wav = _stream_mixed(sc, codes, MIXED)
    torch.testing.assert_close(wav, full_wav, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", torch.bfloat16),
                                                  ("fp16", torch.float16)])
def test_serving_codec_precisions(decoder: CodecDecoder, precision: str,
                                  dtype: torch.dtype) -> None:
    half = StreamingCodec.for_serving(decoder, 2, precision)
    assert half.state.conv.dtype == half.state.kv.dtype == dtype and half.decoder is not decoder
    assert half.decoder.pre_conv.conv.weight.dtype == dtype
    assert decoder.pre_conv.conv.weight.dtype == torch.float32  # the reference stays fp32
    fp32 = StreamingCodec.for_serving(decoder, 2, "tf32", fast=False)
    assert fp32.decoder is decoder and fp32.tf32 is None  # CPU: no TF32 to switch
    with pytest.raises(ValueError, match="codec precision"):
        StreamingCodec.for_serving(decoder, 2, "fp8")


def test_fp16_refuses_a_codec_that_overflows_it(decoder: CodecDecoder) -> None:
    """Codebook sums past fp16's 65504 (bf16 has fp32's range) are refused at load, naming the
    tensor, rather than decoding inf."""
    big = copy.deepcopy(decoder)
    book = big.quantizer.rvq_rest.vq.layers[0]._codebook
    with torch.no_grad():
        book.embedding_sum.mul_(1e5)
        book.cluster_usage.mul_(1e5)  # the same embedding
    StreamingCodec.for_serving(big, 1, "bf16")
    with pytest.raises(ValueError, match="embedding_sum.*overflow torch.float16"):
        StreamingCodec.for_serving(big, 1, "fp16")


def _snr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    noise = (x.double() - ref.double()).pow(2).sum().clamp_min(1e-300)
    return float(10 * torch.log10(ref.double().pow(2).sum() / noise))


@pytest.fixture(scope="module")
def half_precision_wavs(decoder: CodecDecoder, codes: torch.Tensor,
                        full_wav: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per 16-bit precision, the serving codec's (one-shot, streamed in chunks 1, 2, 4, 8, 16,
    16, ...) waveforms of the first 40 frames of every row, as fp32."""
    frames, slots = 40, torch.arange(codes.shape[0])
    out = {}
    for precision in ("bf16", "fp16"):
        sc = StreamingCodec.for_serving(decoder, codes.shape[0], precision)
        one_shot = sc.decode(slots, codes[:, :frames]).float()
        sc.reset(slots)
        pieces, start = [], 0
        for size in _schedule("ramp", frames):
            pieces.append(sc.decode(slots, codes[:, start:start + size]).float())
            start += size
        out[precision] = one_shot, torch.cat(pieces, dim=1)
    return out


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_streams_its_one_shot_waveform(
    half_precision_wavs: dict[str, tuple[torch.Tensor, torch.Tensor]],
    full_wav: torch.Tensor, precision: str,
) -> None:
    """Chunking changes a 16-bit codec's waveform only by summation order, far below that
    precision's own error: its streamed audio is its one-shot audio up to rounding. (Not bit
    for bit in fp16 on CPU: the attention kernel's fp32 sums follow where the valid keys sit
    in the key blocks, and fp16 keeps enough bits for that to show.)"""
    one_shot, streamed = half_precision_wavs[precision]
    own_error = _snr_db(full_wav[:, : one_shot.shape[1]], one_shot)
    chunking = _snr_db(one_shot, streamed)
    print(f"\n{precision}: one-shot {own_error:.1f} dB against fp32, streamed "
          f"{chunking:.1f} dB against its one-shot")
    assert torch.isfinite(streamed).all()
    assert chunking >= own_error + 6.0


def test_fp16_codec_is_at_least_as_close_to_fp32_as_bf16(
    half_precision_wavs: dict[str, tuple[torch.Tensor, torch.Tensor]], full_wav: torch.Tensor,
) -> None:
    """fp16 is offered for TF32-like precision at bf16's rate: on the same codes its streamed
    waveform must be at least as close to the fp32 decode as bf16's."""
    ref = full_wav[:, : half_precision_wavs["fp16"][1].shape[1]]
    snr = {p: _snr_db(ref, wavs[1]) for p, wavs in half_precision_wavs.items()}
    print(f"\nstreamed SNR against fp32: fp16 {snr['fp16']:.1f} dB, bf16 {snr['bf16']:.1f} dB")
    assert snr["fp16"] >= snr["bf16"]


def test_serving_shortcuts_give_the_same_bits(decoder: CodecDecoder, codes: torch.Tensor) -> None:
    """The serving codec's CPU shortcuts change no bit: codebooks divided once (summed in the
    same order), SnakeBeta's per-channel scales kept between steps."""
    sc = StreamingCodec(copy.deepcopy(decoder), max_slots=2)
    assert sc.tables is not None
    plain = copy.deepcopy(decoder)  # no tables (SnakeBeta's kept scales: the test below)
    state = plain.new_state(1)
    for start, size in ((0, 1), (1, 3), (4, 8)):
        part = codes[:1, start:start + size]
        assert torch.equal(plain.quantizer.decode(part, sc.tables), plain.quantizer.decode(part))
        expected, state = plain.step(part, state)
        assert torch.equal(sc.decode(torch.tensor([1]), part), expected)


def test_snake_scales_follow_their_parameters() -> None:
    """SnakeBeta keeps its scales while serving, and makes them again after anything that
    changes its parameters; never inside an autograd graph."""
    snake = SnakeBeta(4)

    def fresh(module: SnakeBeta) -> tuple[torch.Tensor, torch.Tensor]:
        alpha, beta = module.alpha.detach(), module.beta.detach()
        return alpha.exp()[None, :, None], 1.0 / (beta.exp()[None, :, None] + 1e-9)

    with torch.inference_mode():  # as the engine serves
        first = snake.scales()
        assert snake.scales()[0] is first[0]  # kept
    with torch.no_grad():
        snake.alpha.add_(0.5)  # an in-place update (an optimizer step, a load)
        assert all(torch.equal(a, b) for a, b in zip(snake.scales(), fresh(snake)))
        snake.beta.data = torch.full((4,), 0.3)  # new data under the same parameter
        assert all(torch.equal(a, b) for a, b in zip(snake.scales(), fresh(snake)))
        half = copy.deepcopy(snake).to(torch.bfloat16)  # the bf16 serving copy
        assert half.scales()[0].dtype == torch.bfloat16
        assert all(torch.equal(a, b) for a, b in zip(half.scales(), fresh(half)))
    with torch.inference_mode():  # parameters made in inference mode keep no version
        made_here = SnakeBeta(4)
        assert all(torch.equal(a, b) for a, b in zip(made_here.scales(), fresh(made_here)))
    x = torch.randn(2, 4, 5)
    snake(x).sum().backward()  # with gradients wanted the scales are made in the graph
    assert snake.alpha.grad is not None and snake.beta.grad is not None
    for param in snake.parameters():  # a frozen codec under a loss: kept scales stay out
        param.requires_grad_(False)
    x.requires_grad_(True)
    snake(x).sum().backward()
    assert x.grad is not None
