"""Codec training at the tiny size on CPU: losses, quantizer, learning, resume, export, CLI.

Owns CPU-only checks of ``breezert_train`` (data, losses, quantizer, codec_train) on synthetic
audio written to a temporary folder. Must not: need a GPU, the teacher or downloaded data.
"""

from __future__ import annotations

import json
import wave
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from breezert.loader import load_checkpoint
from breezert.models.codec import StreamingCodec
from breezert_train.checkpoint import LOG_FILE, STATE_FILE
from breezert_train.codec_train import (
    CodecTrainConfig,
    CodecTrainer,
    export_checkpoint,
    main,
    recipe_config,
    train,
)
from breezert_train.data import AudioFolderCrops, read_audio
from breezert_train.losses import (
    MultiScaleMelLoss,
    MultiScaleStftDiscriminator,
    PlateauDetector,
    discriminator_hinge_loss,
    feature_matching_loss,
    generator_hinge_loss,
    mr_stft_loss,
)
from breezert_train.quantizer import VQTrainConfig, _ema_update_, quantize

pytestmark = pytest.mark.unit

RATE = 24000
# Small and fast: 4 frames (0.32 s) per crop, a thin discriminator that starts at step 1.
CFG = CodecTrainConfig(batch_size=2, crop_frames=4, disc_start_step=1, disc_channels=4)


def _synthetic_speechlike(seconds: float, seed: int) -> np.ndarray:
    """A gliding harmonic tone (pitch 110-220 Hz, 8 partials) under a syllable-rate envelope."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    f0 = 110 + 110 * (0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(0.3, 0.8) * t))
    phase = 2 * np.pi * np.cumsum(f0) / RATE
    wav = sum(np.sin(k * phase) / k for k in range(1, 9))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4.0 * t + rng.uniform(0, 6.28))
    return (0.3 * wav * envelope / 2.0).astype(np.float32)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("audio")
    pcm = (_synthetic_speechlike(2.0, 0) * 32767).astype("<i2")
    with wave.open(str(root / "a.wav"), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(RATE)
        f.writeframes(pcm.tobytes())
    np.save(root / "b.npy", (_synthetic_speechlike(2.0, 1) * 32767).astype(np.int16))
    return root


@pytest.fixture(scope="module")
def clip() -> torch.Tensor:
    return torch.from_numpy(_synthetic_speechlike(CFG.crop_samples / RATE, 2))[None]  # [1, T]


# ------------------------------------------------------------------------------- losses
def test_stft_loss_is_zero_for_equal_signals_and_positive_otherwise(clip: torch.Tensor) -> None:
    sc, mag = mr_stft_loss(clip, clip.clone())
    assert float(sc) == 0.0 and float(mag) == 0.0
    sc, mag = mr_stft_loss(0.5 * clip, clip)
    assert float(sc) == pytest.approx(0.5, abs=1e-4)  # ||S - S/2|| / ||S||
    assert 0.1 < float(mag) <= np.log(2.0) + 1e-4  # log 2 where neither side hits the floor
    noise = 0.01 * torch.randn(clip.shape, generator=torch.Generator().manual_seed(0))
    sc, mag = mr_stft_loss(noise, clip)
    assert float(sc) > 0.5 and float(mag) > 0.5


def test_hinge_signs_and_feature_matching() -> None:
    high, low = [torch.full((2, 5), 2.0)], [torch.full((2, 5), -2.0)]
    assert float(discriminator_hinge_loss(high, low)) == 0.0  # real >= 1, fake <= -1: done
    assert float(discriminator_hinge_loss(low, high)) == 6.0  # (1 + 2) + (1 + 2)
    assert float(generator_hinge_loss(high)) == 0.0
    assert float(generator_hinge_loss(low)) == 3.0
    feats = [[torch.randn(2, 3, 4, 5)]]
    assert float(feature_matching_loss(feats, feats)) == 0.0
    assert float(feature_matching_loss(feats, [[feats[0][0] + 1.0]])) > 0.0


def test_discriminator_is_phase_aware(clip: torch.Tensor) -> None:
    # Same magnitude spectrum, different phase: a magnitude-only critic could not tell these.
    spec = torch.fft.rfft(clip)
    shifted = torch.fft.irfft(spec * torch.exp(1j * torch.rand(spec.shape) * 6.28), clip.shape[-1])
    disc = MultiScaleStftDiscriminator(channels=4)
    a = disc(clip)[0][0]
    b = disc(shifted.float())[0][0]
    assert not torch.allclose(a, b, atol=1e-3)


# ------------------------------------------------------------------------------- data
def test_folder_crops_read_wav_and_npy_with_a_seed(data_dir: Path) -> None:
    a = AudioFolderCrops(data_dir, crop_samples=5000, seed=3)
    assert len(a.clips) == 2 and all(len(c) == 2 * RATE for c in a.clips)
    batch = a.sample(4)
    assert batch.shape == (4, 5000) and batch.abs().max() <= 1.0 and batch.std() > 0.01
    b = AudioFolderCrops(data_dir, crop_samples=5000, seed=3)
    assert torch.equal(b.sample(4), batch)
    state = a.state_dict()
    nxt = a.sample(2)
    a.load_state_dict(state)
    assert torch.equal(a.sample(2), nxt)
    long = AudioFolderCrops(data_dir, crop_samples=3 * RATE)  # longer than the files: padded
    assert long.sample(1)[0, 2 * RATE :].abs().max() == 0.0


def test_read_audio_scales_int16_mixes_stereo_and_resamples(tmp_path: Path) -> None:
    left = np.full(1600, 16384, dtype="<i2")
    frames = np.stack([left, np.zeros_like(left)], axis=1)  # [T, 2]
    with wave.open(str(tmp_path / "s.wav"), "wb") as f:
        f.setnchannels(2)
        f.setsampwidth(2)
        f.setframerate(16000)
        f.writeframes(frames.tobytes())
    wav = read_audio(tmp_path / "s.wav")
    assert wav.dtype == np.float32 and len(wav) == 2400  # 0.1 s at 24 kHz
    assert abs(float(wav[800:1600].mean()) - 0.25) < 1e-3  # (0.5 + 0) / 2


# ------------------------------------------------------------------------------- quantizer
def test_quantizer_codes_are_the_encoders_codes(clip: torch.Tensor) -> None:
    trainer = CodecTrainer(CFG)
    x = trainer.encoder.embed(clip)
    q = quantize(trainer.encoder, trainer.decoder, x, CFG.vq, trainer.vq_gen)  # inits, learns
    assert q.codes.shape == (1, CFG.crop_frames, 16)
    frozen = quantize(trainer.encoder, trainer.decoder, x, CFG.vq)
    assert torch.equal(frozen.codes, trainer.encoder.encode(clip))
    assert float(frozen.commitment.detach()) > 0.0
    # The straight-through latent carries a gradient back to the encoder.
    frozen.latent.sum().backward()
    assert trainer.encoder.downsample.conv.weight.grad.abs().sum() > 0


def test_ema_update_moves_codes_and_restarts_dead_ones() -> None:
    from breezert.models.codec_encoder import _Codebook

    book = _Codebook(8, 2)
    book.embed_sum.copy_(torch.arange(16.0).view(8, 2))
    book.cluster_usage.fill_(1.0)
    book.cluster_usage[5] = 1e-4  # dead
    x = torch.tensor([[0.5, 0.5], [0.5, 1.5]])
    cfg = VQTrainConfig(decay=0.5, dead_ratio=0.1)
    restarted = _ema_update_(book, x, torch.tensor([0, 0]), cfg, torch.Generator().manual_seed(0))
    assert int(restarted) == 1
    usage = book.cluster_usage
    assert float(usage[0]) == pytest.approx(0.5 * 1 + 0.5 * 2)  # EMA of the count
    # embed_sum: 0.5 * [0, 1] + 0.5 * (sum of the two rows [1, 2]) = [0.5, 1.5]; / usage 1.5
    assert torch.allclose(book.embed()[0], torch.tensor([1 / 3, 1.0]), atol=1e-6)
    assert float(usage[5]) == pytest.approx(float(usage.mean()), rel=0.2)  # restarted: mean usage
    assert any(torch.allclose(book.embed()[5], row) for row in x)  # a vector of the batch


# ------------------------------------------------------------------------------- training
def test_a_few_steps_lower_the_mr_stft_loss_on_a_fixed_clip(data_dir: Path,
                                                            clip: torch.Tensor) -> None:
    cfg = replace(CFG, learning_rate=3e-3, disc_start_step=10**9)
    trainer = CodecTrainer(cfg)
    data = AudioFolderCrops(data_dir, cfg.crop_samples, seed=0)
    trainer.train_step(data.sample(cfg.batch_size))  # codebooks take their first vectors
    before = trainer.evaluate(clip)
    for _ in range(15):
        trainer.train_step(data.sample(cfg.batch_size))
    after = trainer.evaluate(clip)
    print(before, after)
    assert after["stft_mag"] + after["stft_sc"] < 0.8 * (before["stft_mag"] + before["stft_sc"])


def _flat_state(trainer: CodecTrainer) -> dict[str, torch.Tensor]:
    out = {}
    for part in ("encoder", "decoder", "disc"):
        out.update({f"{part}.{k}": v for k, v in getattr(trainer, part).state_dict().items()})
    for part in ("opt_g", "opt_d"):
        for pid, st in getattr(trainer, part).state_dict()["state"].items():
            out.update({f"{part}.{pid}.{k}": torch.as_tensor(v) for k, v in st.items()})
    return out


def test_resume_gives_the_state_of_an_uninterrupted_run(data_dir: Path, tmp_path: Path) -> None:
    def data() -> AudioFolderCrops:
        return AudioFolderCrops(data_dir, CFG.crop_samples, seed=CFG.seed)

    whole = train(data(), tmp_path / "whole", CFG, minutes=5, max_steps=4)
    train(data(), tmp_path / "split", CFG, minutes=5, max_steps=2)
    # A run killed after its save leaves log lines the state does not hold: they go on resume.
    with open(tmp_path / "split" / LOG_FILE, "a") as f:
        f.write(json.dumps({"step": 3, "time_s": 0.0}) + "\n")
    resumed = train(data(), tmp_path / "split", CFG, minutes=5, max_steps=4)
    assert resumed.step == whole.step == 4
    a, b = _flat_state(whole), _flat_state(resumed)
    assert a.keys() == b.keys()
    unequal = [k for k in a if not torch.equal(a[k], b[k])]
    assert not unequal, f"differ after resume: {unequal[:5]}"
    lines = [json.loads(x) for x in (tmp_path / "split" / LOG_FILE).read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert {"stft_sc", "stft_mag", "commitment", "disc_hinge", "gen_hinge",
            "feature_match"} <= lines[-1].keys()
    assert lines[-1]["time_s"] >= lines[0]["time_s"] > 0


def test_resume_refuses_another_config(data_dir: Path, tmp_path: Path) -> None:
    data = AudioFolderCrops(data_dir, CFG.crop_samples)
    train(data, tmp_path, CFG, minutes=5, max_steps=0)
    with pytest.raises(ValueError, match="batch_size: saved 2, now 3"):
        train(data, tmp_path, replace(CFG, batch_size=3), minutes=5, max_steps=1)


def test_export_loads_with_the_loader_and_streams(data_dir: Path, tmp_path: Path,
                                                  clip: torch.Tensor) -> None:
    trainer = train(AudioFolderCrops(data_dir, CFG.crop_samples), tmp_path / "run", CFG,
                    minutes=5, max_steps=2)
    ckpt = load_checkpoint(export_checkpoint(trainer, tmp_path / "ckpt"))
    assert ckpt.codec_encoder is not None and ckpt.codec.cfg == trainer.decoder.cfg
    codes = ckpt.codec_encoder.encode(clip)  # [1, K, 16]: the loaded encoder's own codes
    with torch.no_grad():
        want, q = trainer.reconstruct(clip, training=False)
    assert torch.equal(codes, q.codes)
    offline = ckpt.codec.decode(codes)
    assert torch.allclose(offline, want, atol=1e-5)  # the codes decode as in training
    assert offline.abs().max() > 0
    sc = StreamingCodec(ckpt.codec, max_slots=2)
    slot = torch.tensor([1])
    pieces, start = [], 0
    for size in (1, 2, 1):
        pieces.append(sc.decode(slot, codes[:, start : start + size]))
        start += size
    assert torch.allclose(torch.cat(pieces, dim=-1), offline, atol=1e-5)


def test_snapshot_carries_bf16_weights_and_rewarms_the_rates(data_dir: Path,
                                                             tmp_path: Path) -> None:
    """A carry snapshot holds bf16 weights (usage counts exact), no optimiser state; a trainer
    on another machine goes on from it at the same step with its rates warming up again, and a
    larger batch is allowed there."""
    data = AudioFolderCrops(data_dir, CFG.crop_samples, seed=CFG.seed)
    first = train(data, tmp_path / "a", CFG, minutes=5, max_steps=3)
    snap = first.snapshot()
    assert "opt_g" not in snap and "opt_d" not in snap
    usage = [k for k in snap["encoder"] if k.endswith("cluster_usage")]
    assert usage and all(snap["encoder"][k].dtype == torch.float32 for k in usage)
    assert snap["decoder"]["pre_conv.conv.weight"].dtype == torch.bfloat16
    bigger = replace(CFG, batch_size=3, rewarmup_steps=4)
    second = train(data, tmp_path / "b", bigger, minutes=5, max_steps=5,
                   warm_start=lambda t: t.load_snapshot(snap))
    assert (second.step, second.reset_step) == (5, 3)
    lines = [json.loads(x) for x in (tmp_path / "b" / LOG_FILE).read_text().splitlines()]
    assert [x["step"] for x in lines] == [4, 5]
    # steps 4 and 5 ran at 1/4 and 2/4 of the rate
    assert second.opt_g.param_groups[0]["lr"] == pytest.approx(CFG.learning_rate * 2 / 4)
    restored = CodecTrainer(bigger)
    restored.load_snapshot(snap)
    want = first.decoder.state_dict()["pre_conv.conv.weight"].to(torch.bfloat16).float()
    assert torch.equal(restored.decoder.state_dict()["pre_conv.conv.weight"], want)
    with pytest.raises(ValueError, match="disc_channels"):
        CodecTrainer(replace(CFG, disc_channels=8)).load_snapshot(snap)


def test_an_export_warm_starts_a_run_with_its_codebooks(data_dir: Path, tmp_path: Path,
                                                        clip: torch.Tensor) -> None:
    """A codec export (no optimiser, no discriminator) goes on training: the loaded codec gives
    the export's codes and audio, and its codebooks are not re-initialised from data."""
    data = AudioFolderCrops(data_dir, CFG.crop_samples, seed=CFG.seed)
    first = train(data, tmp_path / "a", CFG, minutes=5, max_steps=2)
    ckpt = load_checkpoint(export_checkpoint(first, tmp_path / "ckpt"))
    warm = CodecTrainer(CFG)
    warm.load_export(tmp_path / "ckpt", step=2, train_time_s=1.5)
    assert (warm.step, warm.train_time_s, warm.reset_step) == (2, 1.5, 2)
    with torch.no_grad():
        y, q = warm.reconstruct(clip, training=False)
    assert torch.equal(q.codes, ckpt.codec_encoder.encode(clip))
    assert torch.allclose(y, ckpt.codec.decode(q.codes), atol=1e-5)
    before = q.codes
    with torch.no_grad():  # a training pass keeps the codebooks (no data init of "fresh" ones)
        _, q2 = warm.reconstruct(clip, training=True)
    assert (q2.codes == before).float().mean() > 0.9
    with pytest.raises(ValueError, match="preset"):
        CodecTrainer(replace(CFG, preset="small")).load_export(tmp_path / "ckpt", 2, 1.5)


def test_command_line_trains_saves_and_continues(data_dir: Path, tmp_path: Path) -> None:
    args = ["--data", str(data_dir), "--out", str(tmp_path), "--minutes", "5",
            "--batch-size", "1", "--crop-frames", "2", "--disc-channels", "4",
            "--disc-start-step", "1", "--save-every", "1"]
    main([*args, "--max-steps", "2"])
    assert (tmp_path / STATE_FILE).is_file() and not (tmp_path / (STATE_FILE + ".tmp")).exists()
    main([*args, "--max-steps", "3", "--export", str(tmp_path / "ckpt")])
    steps = [json.loads(x)["step"] for x in (tmp_path / LOG_FILE).read_text().splitlines()]
    assert steps == [1, 2, 3]
    main([*args, "--max-steps", "3", "--export", str(tmp_path / "bf16"),
          "--export-dtype", "bfloat16"])  # no step left: exports the saved state
    full, half = load_checkpoint(tmp_path / "ckpt"), load_checkpoint(tmp_path / "bf16")
    assert full.codec_encoder is not None and half.codec_encoder is not None
    codec_file = "audio_tokenizer/model.safetensors"
    assert (tmp_path / "bf16" / codec_file).stat().st_size < 0.6 * (
        (tmp_path / "ckpt" / codec_file).stat().st_size)
    codes = torch.randint(0, 2048, (1, 3, 16), generator=torch.Generator().manual_seed(0))
    a, b = full.codec.decode(codes), half.codec.decode(codes)
    assert torch.corrcoef(torch.stack([a[0], b[0]]))[0, 1] > 0.99


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_presets_pair_the_encoder_and_decoder_quantizers(preset: str) -> None:
    from breezert.models.codec import CodecDecoder
    from breezert.models.codec_encoder import CodecEncoder
    from breezert.models.config import BreezeConfig
    from breezert_train.codec_train import codec_preset
    from breezert_train.quantizer import group_pairs

    codec, enc_json = codec_preset(preset)
    BreezeConfig(codec=codec, codec_encoder_json=enc_json)  # 1920 samples a frame
    with torch.device("meta"):
        encoder, decoder = CodecEncoder(enc_json), CodecDecoder(codec)
    for enc_group, dec_group, num in group_pairs(encoder, decoder):
        assert len(dec_group.vq.layers) == num
        for enc_vq, dec_vq in zip(enc_group.layers, dec_group.vq.layers, strict=True):
            assert enc_vq.codebook.embed_sum.shape == dec_vq._codebook.embedding_sum.shape
        assert enc_group.input_proj.weight.shape == dec_group.input_proj.weight.shape
        assert enc_group.output_proj.weight.shape == dec_group.output_proj.weight.shape


def test_a_non_finite_loss_stops_without_saving_over_the_last_state(
        data_dir: Path, tmp_path: Path) -> None:
    class Broken(AudioFolderCrops):
        def sample(self, batch_size: int) -> torch.Tensor:
            return torch.full((batch_size, self.crop_samples), float("nan"))

    train(AudioFolderCrops(data_dir, CFG.crop_samples), tmp_path, CFG, minutes=5, max_steps=1)
    saved = (tmp_path / STATE_FILE).read_bytes()
    with pytest.raises(FloatingPointError, match="step 2: non-finite"):
        train(Broken(data_dir, CFG.crop_samples), tmp_path, CFG, minutes=5, max_steps=3)
    assert (tmp_path / STATE_FILE).read_bytes() == saved


def test_crops_read_the_teacher_shards(tmp_path: Path) -> None:
    """A folder of teacher shards (``train.shards``) is a crop source as it is: PCM16 scaled to
    [-1, 1], every crop a piece of one utterance, the same crops for the same seed."""
    from breezert_train import shards

    writer = shards.ShardWriter(tmp_path, max_bytes=1 << 20)
    utterances = [np.arange(i * 7000, i * 7000 + 6000, dtype=np.int16) for i in range(3)]
    for i, audio in enumerate(utterances):
        writer.add(i, "fortunes", f"text {i}", "ph", audio, np.arange(4, dtype=np.int16),
                   np.full(4, 2, np.int16))
    writer.flush()
    crops = AudioFolderCrops(tmp_path, crop_samples=2000, seed=5)
    assert len(crops.clips) == 3
    batch = crops.sample(8)
    assert batch.shape == (8, 2000) and batch.dtype == torch.float32
    for row in (batch * 32768.0).round().to(torch.int64):
        start = int(row[0])
        assert any(start in range(int(u[0]), int(u[-1]) + 1) for u in utterances)
        assert torch.equal(row, torch.arange(start, start + 2000))  # one contiguous piece
    again = AudioFolderCrops(tmp_path, crop_samples=2000, seed=5)
    assert torch.equal(again.sample(8), batch)


def test_log_mel_filterbank_and_the_latent_probe(data_dir: Path, clip: torch.Tensor) -> None:
    """The filterbank's triangles cover the band and peak at 1; the probe reads 8 mel frames per
    codec frame and its loss falls as the codec trains with it."""
    from breezert_train.losses import LatentMelHead, log_mel, mel_filterbank

    fb = mel_filterbank(1024, 80, 24000)
    assert fb.shape == (80, 513) and float(fb.max()) <= 1.0 + 1e-6
    assert bool((fb.max(dim=1).values > 0.5).all())  # every filter has bins near its peak
    assert bool((fb.sum(dim=0)[5:-5] > 0).all())  # no hole in the band
    tone = torch.sin(2 * torch.pi * 1000 * torch.arange(24000) / 24000)[None]
    peak = int(log_mel(tone)[0, :, 50].argmax())
    centres = 700.0 * (10.0 ** (torch.linspace(0, 2595 * np.log10(1 + 12000 / 700), 82)
                                / 2595.0) - 1.0)[1:-1]
    assert abs(float(centres[peak]) - 1000) < 80  # the 1 kHz tone lands in its own band
    head = LatentMelHead(16)
    assert head(torch.zeros(2, 16, 3)).shape == (2, 80, 24)
    cfg = replace(CFG, latent_mel_weight=1.0, disc_start_step=100)
    data = AudioFolderCrops(data_dir, cfg.crop_samples, seed=cfg.seed)
    trainer = CodecTrainer(cfg)
    with torch.no_grad():
        _, q = trainer.reconstruct(clip, training=False)
        before = float(trainer.mel_head.loss(q.latent, clip))
    for _ in range(40):
        record = trainer.train_step(data.sample(cfg.batch_size))
    assert "latent_mel" in record
    with torch.no_grad():
        _, q = trainer.reconstruct(clip, training=False)
        after = float(trainer.mel_head.loss(q.latent, clip))
    assert after < 0.9 * before
    snap = trainer.snapshot()
    assert "mel_head" in snap and "mel_head" in trainer.state_dict()
    other = CodecTrainer(cfg)
    other.load_snapshot(snap)
    assert torch.equal(other.mel_head.proj.weight,
                       trainer.mel_head.proj.weight.to(torch.bfloat16).float())


def test_bf16_autocast_trains_with_fp32_masters_and_close_losses(data_dir: Path) -> None:
    """``autocast_bf16``: the same first step's losses within bf16 rounding of fp32's, weights
    kept fp32, and steps that learn (the switch exists for the GPU, where the codec's training
    is compute-bound)."""
    cfg = replace(CFG, latent_mel_weight=1.0)
    batch = AudioFolderCrops(data_dir, cfg.crop_samples, seed=cfg.seed).sample(cfg.batch_size)
    plain = CodecTrainer(cfg).train_step(batch)
    fast_trainer = CodecTrainer(replace(cfg, autocast_bf16=True))
    fast = fast_trainer.train_step(batch)
    assert fast.keys() == plain.keys()
    for key in ("stft_sc", "stft_mag", "latent_mel"):
        assert fast[key] == pytest.approx(plain[key], rel=0.05), key
    # The first step's commitment loss is a squared distance between latents and the codes they
    # initialised (~1e-7): below bf16's rounding of unit-scale latents ((2**-8)**2 ~ 1.5e-5), so
    # it is checked against that floor, not relative to its own size (2.2e-8 against 8.5e-8 in
    # one run: both zero at bf16 precision).
    assert fast["commitment"] == pytest.approx(plain["commitment"], rel=0.05, abs=2.0 ** -16)
    assert all(p.dtype == torch.float32 for p in fast_trainer.decoder.parameters())
    data = AudioFolderCrops(data_dir, cfg.crop_samples, seed=cfg.seed)
    first = fast_trainer.train_step(data.sample(cfg.batch_size))
    for _ in range(12):
        last = fast_trainer.train_step(data.sample(cfg.batch_size))
    assert last["stft_mag"] < first["stft_mag"]
    assert {"disc_hinge", "gen_hinge", "feature_match"} <= last.keys()  # the discriminator too


class _CountReads(torch.overrides.TorchFunctionMode):
    """Counts ``Tensor.item`` calls on ``watched`` tensors (each a GPU sync on CUDA)."""

    def __init__(self, watched: list[torch.Tensor]) -> None:
        super().__init__()
        self.watched, self.count = {id(t) for t in watched}, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.item and id(args[0]) in self.watched:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_codebook_flag_is_read_again_after_every_write() -> None:
    """``_is_initialized`` keeps the flag it read (no GPU sync per codebook and step): a step
    after the first reads no flag back, the first step's own initialisation included; a fresh
    mark, a state-dict load, an outside write or a new tensor are read again."""
    from breezert.models.codec_encoder import _Codebook
    from breezert_train.quantizer import _is_initialized, mark_codebooks_fresh_

    trainer = CodecTrainer(CFG)
    books = [m for m in trainer.encoder.modules() if isinstance(m, _Codebook)]
    book = books[0]
    flags = [b.initialized for b in books]
    wav = torch.randn(CFG.batch_size, CFG.crop_samples, generator=torch.Generator().manual_seed(0))
    with _CountReads(flags) as first:
        trainer.train_step(wav * 0.1)
    with _CountReads(flags) as second:
        trainer.train_step(wav * 0.1)
    with _CountReads(flags) as control:
        flags[0].item()
    assert control.count == 1  # the counter sees a read
    assert first.count == 0 and second.count == 0  # mark_codebooks_fresh_ noted the flags
    assert _is_initialized(book) is True and book.initialized.item() == 1.0
    mark_codebooks_fresh_(trainer.encoder)
    assert _is_initialized(book) is False
    book.load_state_dict({**book.state_dict(), "initialized": torch.ones_like(book.initialized)})
    assert _is_initialized(book) is True
    book.initialized.zero_()
    assert _is_initialized(book) is False
    book.initialized = torch.ones(1)
    assert _is_initialized(book) is True


# ------------------------------------------------------------------------------- recipe 2
RECIPE2 = recipe_config(2, batch_size=2, crop_frames=4, disc_channels=4, disc_start_step=0,
                        plateau_window=2, plateau_min_improvement=0.5, rewarmup_steps=1)
"""Recipe 2 at the test size; its plateau comes after a few steps (a fall of < 50 % a window)."""


def test_multi_scale_mel_loss_and_the_plateau_detector(clip: torch.Tensor) -> None:
    loss = MultiScaleMelLoss()
    assert float(loss(clip, clip.clone())) == 0.0
    # log 2 in every band above the floor (bands floored on both sides add 0)
    assert 0.3 < float(loss(0.5 * clip, clip)) <= np.log(2.0) + 1e-4
    detector = PlateauDetector(window=3, min_improvement=0.1)
    assert not any(detector.add(v) for v in (10, 9, 8, 7, 6))  # fewer than 2 windows
    assert not detector.add(5)  # window means 9 -> 6: a fall of 33 %
    # means 8 -> 5.3 (33 %), 7 -> 5 (29 %), 6 -> 5 (17 %), then 5.3 -> 5 (6 %): the plateau
    assert [detector.add(5) for _ in range(4)] == [False, False, False, True]
    assert PlateauDetector(3, 0.1, history=detector.history).add(5)  # the state travels
    with pytest.raises(ValueError, match="window"):
        PlateauDetector(0, 0.1)


def test_recipe_2_codes_in_4_codebooks_and_exports_zero_vectors_for_the_rest(
        data_dir: Path, tmp_path: Path, clip: torch.Tensor) -> None:
    """Codes past the 4th are 0 in training, in the export's encoder and in the LM's codes; every
    vector of those codebooks is zero, so whatever code the LM draws there decodes to nothing."""
    data = AudioFolderCrops(data_dir, RECIPE2.crop_samples, seed=0)
    trainer = train(data, tmp_path / "run", RECIPE2, minutes=5, max_steps=2)
    with torch.no_grad():
        _, q = trainer.reconstruct(clip, training=False)
    assert bool((q.codes[..., 4:] == 0).all()) and bool((q.codes[..., :4] > 0).any())
    ckpt = load_checkpoint(export_checkpoint(trainer, tmp_path / "ckpt"))
    codes = ckpt.codec_encoder.encode(clip)
    assert torch.equal(codes, q.codes)
    books = ckpt.codec.quantizer.rvq_rest.vq.layers
    assert all(float(b._codebook.embedding_sum.abs().sum()) == 0 for b in books[3:])
    assert all(float(b._codebook.embedding_sum.abs().sum()) > 0 for b in books[:3])
    noisy = codes.clone()
    noisy[..., 4:] = torch.randint(0, 2048, noisy[..., 4:].shape)
    with torch.no_grad():
        assert torch.equal(ckpt.codec.decode(noisy), ckpt.codec.decode(codes))
    with pytest.raises(ValueError, match="active_codebooks"):
        replace(RECIPE2, active_codebooks=17)


def test_the_discriminator_waits_for_the_plateau_and_the_snapshot_is_slim(
        data_dir: Path, tmp_path: Path) -> None:
    """Recipe 2 trains without the discriminator until the mel loss plateaus; until then the
    snapshot carries no discriminator, never the decoder's codebook copies nor the inactive
    codebooks; a recipe-1 snapshot (16 codebooks) warm-starts recipe 2."""
    data = AudioFolderCrops(data_dir, RECIPE2.crop_samples, seed=0)
    one = train(data, tmp_path / "one", CFG, minutes=5, max_steps=1)
    full = one.snapshot()
    two = CodecTrainer(RECIPE2)
    disc_before = [p.detach().clone() for p in two.disc.parameters()]
    two.load_snapshot(full)  # 16 -> 4 codebooks; its discriminator is recipe 1's
    assert two.disc_started_at is None and not two.disc_active
    slim = two.snapshot()
    assert "disc" not in slim and not any("._codebook." in k for k in slim["decoder"])
    assert not any(".layers.5.codebook" in k for k in slim["encoder"])
    size = sum(v.numel() * v.element_size() for part in ("encoder", "decoder")
               for v in slim[part].values())
    assert size < sum(v.numel() * v.element_size() for part in ("encoder", "decoder")
                      for v in full[part].values())
    fresh = CodecTrainer(RECIPE2)
    fresh.load_snapshot(slim)  # loads what the slim snapshot holds, nothing missing beyond it
    assert torch.equal(fresh.encoder.state_dict()["quantizer.acoustic_residual_vector_quantizer"
                                                  ".layers.5.codebook.embed_sum"],
                       torch.zeros_like(full["encoder"]["quantizer.acoustic_residual_vector_"
                                                        "quantizer.layers.5.codebook.embed_sum"],
                                        dtype=torch.float32))
    records = [fresh.train_step(data.sample(2)) for _ in range(6)]
    started = fresh.disc_started_at
    assert started is not None and fresh.step > started > one.step + 1  # after the re-warmup
    assert [r["disc_on"] for r in records] == [float(one.step + i + 1 > started)
                                               for i in range(6)]
    assert all("disc_hinge" in r for r in records if r["disc_on"])
    assert all("disc_hinge" not in r for r in records if not r["disc_on"])
    again = CodecTrainer(RECIPE2)
    again.load_snapshot(fresh.snapshot())
    assert again.disc_started_at == started and again.disc_active
    assert not all(torch.equal(a, b) for a, b in zip(disc_before, fresh.disc.parameters()))
