"""Codec training losses: multi-resolution STFT, multi-scale log-mel, a complex multi-scale STFT
discriminator, the latent's log-mel probe, and the plateau detector that starts the discriminator.

Owns: the reconstruction losses (spectral convergence + log magnitude at several resolutions;
``MultiScaleMelLoss``, the log-mel L1 at several FFT sizes that recipe 2 makes its main term,
since a recognizer hears mel-like bands, not linear bins), the log-mel spectrogram (its own
triangular filterbank), ``PlateauDetector`` and ``LatentMelHead`` (a training-only
linear read-out of the spectrogram from the codec's latent, so the encoder learns to carry it
from the first steps instead of only through the whole decoder), and the adversarial terms
(hinge losses, feature matching) whose discriminator sees real and imaginary parts, so phase is
judged, not only magnitude. Must not: know the codec or the data.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

STFT_RESOLUTIONS = ((256, 64), (512, 128), (1024, 256), (2048, 512))
"""``(n_fft, hop)`` pairs of the reconstruction loss (Hann window of ``n_fft``) at 24 kHz."""
DISC_N_FFTS = (2048, 1024, 512)
"""Window sizes of the discriminator's scales (hop ``n_fft // 4``), as EnCodec's MS-STFT-D."""


def _stft(x: Tensor, n_fft: int, hop: int) -> Tensor:
    window = torch.hann_window(n_fft, device=x.device, dtype=x.dtype)
    return torch.stft(x, n_fft, hop, window=window, return_complex=True)  # [B, F, frames]


def stft_magnitude(x: Tensor, n_fft: int, hop: int) -> Tensor:
    """``|STFT(x)|`` of ``x [B, T]``, floored so its gradient stays finite at silence."""
    spec = torch.view_as_real(_stft(x, n_fft, hop))  # [B, F, frames, 2]
    return spec.pow(2).sum(-1).clamp(min=1e-10).sqrt()


def mr_stft_loss(
    fake: Tensor, real: Tensor, resolutions: tuple[tuple[int, int], ...] = STFT_RESOLUTIONS
) -> tuple[Tensor, Tensor]:
    """``(spectral convergence, log-magnitude L1)``, each averaged over ``resolutions``;
    both exactly 0 when ``fake`` equals ``real`` ([B, T] each)."""
    sc = fake.new_zeros(())
    mag = fake.new_zeros(())
    for n_fft, hop in resolutions:
        s_fake, s_real = stft_magnitude(fake, n_fft, hop), stft_magnitude(real, n_fft, hop)
        sc = sc + torch.linalg.norm(s_real - s_fake) / torch.linalg.norm(s_real).clamp(min=1e-7)
        mag = mag + F.l1_loss(s_fake.clamp(min=1e-5).log(), s_real.clamp(min=1e-5).log())
    return sc / len(resolutions), mag / len(resolutions)


MEL_BINS = 80
MEL_HOP = 240
"""10 ms at 24 kHz: 8 mel frames per 80 ms codec frame."""
MEL_N_FFT = 1024
MEL_SAMPLE_RATE = 24000
LOG_MEL_MEAN, LOG_MEL_STD = -2.72, 3.73
"""The teacher's log-mel statistics (three sentences, measured once): the probe's target is
standardised with them, so a zero-initialised read-out starts near its target's scale."""


def mel_filterbank(n_fft: int, n_mels: int, sample_rate: int, f_min: float = 0.0,
                   f_max: float | None = None) -> Tensor:
    """``[n_mels, n_fft // 2 + 1]`` triangular filters, equally spaced on the HTK mel scale."""
    f_max = f_max if f_max is not None else sample_rate / 2

    def mel(f: Tensor) -> Tensor:
        return 2595.0 * torch.log10(1.0 + f / 700.0)

    edges = torch.linspace(float(mel(torch.tensor(f_min))), float(mel(torch.tensor(f_max))),
                           n_mels + 2)
    hz = 700.0 * (10.0 ** (edges / 2595.0) - 1.0)  # [n_mels + 2]
    bins = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1)  # [F]
    lower, centre, upper = hz[:-2, None], hz[1:-1, None], hz[2:, None]
    rising = (bins - lower) / (centre - lower)
    falling = (upper - bins) / (upper - centre)
    return torch.clamp(torch.minimum(rising, falling), min=0.0)


def log_mel(wav: Tensor, sample_rate: int = MEL_SAMPLE_RATE, n_fft: int = MEL_N_FFT,
            hop: int = MEL_HOP, n_mels: int = MEL_BINS,
            filterbank: Tensor | None = None) -> Tensor:
    """``wav [B, T]`` -> natural-log mel magnitudes ``[B, n_mels, T // hop + 1]`` (floored);
    ``filterbank``: ``mel_filterbank(n_fft, n_mels, sample_rate)`` already on ``wav``'s device
    (built here when not given)."""
    fb = mel_filterbank(n_fft, n_mels, sample_rate).to(wav) if filterbank is None else filterbank
    return (fb @ stft_magnitude(wav, n_fft, hop)).clamp(min=1e-5).log()


MEL_SCALES = ((512, 128, 40), (1024, 256, 80), (2048, 512, 128))
"""``(n_fft, hop, n_mels)`` of ``MultiScaleMelLoss`` at 24 kHz: fewer bands at the short window
(its 47 Hz bins cannot fill 80 narrow low bands), more at the long one."""
MEL_LOSS_F_MAX = 12000.0


class MultiScaleMelLoss(nn.Module):
    """Mean over ``scales`` of the L1 between natural-log mel magnitudes of ``fake`` and ``real``
    ([B, T] each); exactly 0 when they are equal. Filterbanks are buffers (built once, moved with
    the module, not saved)."""

    def __init__(self, scales: tuple[tuple[int, int, int], ...] = MEL_SCALES,
                 sample_rate: int = MEL_SAMPLE_RATE, f_max: float = MEL_LOSS_F_MAX) -> None:
        super().__init__()
        self.scales = tuple(scales)
        for i, (n_fft, _, n_mels) in enumerate(self.scales):
            self.register_buffer(f"fb{i}", mel_filterbank(n_fft, n_mels, sample_rate, 0.0, f_max),
                                 persistent=False)

    def forward(self, fake: Tensor, real: Tensor) -> Tensor:
        total = fake.new_zeros(())
        for i, (n_fft, hop, _) in enumerate(self.scales):
            fb = getattr(self, f"fb{i}")
            total = total + F.l1_loss(log_mel(fake, n_fft=n_fft, hop=hop, filterbank=fb),
                                      log_mel(real, n_fft=n_fft, hop=hop, filterbank=fb))
        return total / len(self.scales)


class PlateauDetector:
    """Says when a loss stops falling: after ``2 * window`` values, the mean of the last
    ``window`` is compared with the mean of the ``window`` before it; a plateau is a relative
    fall below ``min_improvement`` (0.01: less than 1 % per window). Its state (the last
    ``2 * window`` values) travels with a snapshot, so a plateau spans GPU calls."""

    def __init__(self, window: int, min_improvement: float,
                 history: list[float] | None = None) -> None:
        if window < 1 or not 0.0 <= min_improvement < 1.0:
            raise ValueError(f"window={window} must be >= 1 and min_improvement="
                             f"{min_improvement} in [0, 1)")
        self.window, self.min_improvement = window, min_improvement
        self.history: list[float] = list(history or [])[-2 * window:]

    def add(self, value: float) -> bool:
        """Records ``value``; True when the loss has plateaued (see the class)."""
        self.history.append(float(value))
        del self.history[:-2 * self.window]
        if len(self.history) < 2 * self.window:
            return False
        before = sum(self.history[: self.window]) / self.window
        last = sum(self.history[self.window:]) / self.window
        return before - last < self.min_improvement * abs(before)


class LatentMelHead(nn.Module):
    """A linear read-out of the 8 log-mel frames of each codec frame from the latent.

    ``latent [B, dim, K]`` -> ``[B, n_mels, 8 K]``. Training only (never exported): its L1 to the
    real log-mel gives the encoder and codebooks a short gradient path to spectral content."""

    def __init__(self, dim: int, samples_per_frame: int = 1920, n_mels: int = MEL_BINS) -> None:
        super().__init__()
        if samples_per_frame % MEL_HOP:
            raise ValueError(f"samples_per_frame={samples_per_frame} is not a multiple of "
                             f"{MEL_HOP}")
        self.per_frame, self.n_mels = samples_per_frame // MEL_HOP, n_mels
        self.proj = nn.Conv1d(dim, n_mels * self.per_frame, 1)
        # built once and moved with the module, not per step; not saved (a constant)
        self.register_buffer("filterbank", mel_filterbank(MEL_N_FFT, n_mels, MEL_SAMPLE_RATE),
                             persistent=False)

    def forward(self, latent: Tensor) -> Tensor:
        b, _, k = latent.shape
        out = self.proj(latent).view(b, self.n_mels, self.per_frame, k)
        return out.permute(0, 1, 3, 2).reshape(b, self.n_mels, k * self.per_frame)

    def loss(self, latent: Tensor, wav: Tensor) -> Tensor:
        """L1 between the read-out and the standardised ``log_mel(wav)`` over the latent's
        frames."""
        pred = self(latent)
        target = log_mel(wav, n_mels=self.n_mels, filterbank=self.filterbank)
        target = (target[..., : pred.shape[-1]] - LOG_MEL_MEAN) / LOG_MEL_STD
        return F.l1_loss(pred, target)


class _StftScale(nn.Module):
    """One scale: complex STFT as 2 channels -> 2-D convs striding over frequency -> logits."""

    def __init__(self, n_fft: int, channels: int) -> None:
        super().__init__()
        self.n_fft, self.hop = n_fft, n_fft // 4
        act = nn.LeakyReLU(0.2)
        convs = [nn.Conv2d(2, channels, (3, 9), padding=(1, 4))]
        for dilation in (1, 2, 4):
            convs.append(nn.Conv2d(channels, channels, (3, 9), stride=(1, 2),
                                   dilation=(dilation, 1), padding=(dilation, 4)))
        convs.append(nn.Conv2d(channels, channels, (3, 3), padding=(1, 1)))
        self.convs = nn.ModuleList(convs)
        self.act = act
        self.out = nn.Conv2d(channels, 1, (3, 3), padding=(1, 1))

    def forward(self, wav: Tensor) -> tuple[Tensor, list[Tensor]]:
        spec = torch.view_as_real(_stft(wav, self.n_fft, self.hop))  # [B, F, frames, 2]
        x = spec.permute(0, 3, 2, 1)  # [B, 2, frames, F]
        features = []
        for conv in self.convs:
            x = self.act(conv(x))
            features.append(x)
        return self.out(x), features  # logits [B, 1, frames, F']


class MultiScaleStftDiscriminator(nn.Module):
    """EnCodec-style MS-STFT discriminator: one ``_StftScale`` per window size."""

    def __init__(self, channels: int = 32, n_ffts: tuple[int, ...] = DISC_N_FFTS) -> None:
        super().__init__()
        self.scales = nn.ModuleList(_StftScale(n, channels) for n in n_ffts)

    def forward(self, wav: Tensor) -> list[tuple[Tensor, list[Tensor]]]:
        """``wav [B, T]`` -> per scale ``(logits, feature maps)``."""
        return [scale(wav) for scale in self.scales]


def discriminator_hinge_loss(real_logits: list[Tensor], fake_logits: list[Tensor]) -> Tensor:
    """``mean(relu(1 - D(real))) + mean(relu(1 + D(fake)))`` averaged over scales: 0 once real
    scores >= 1 and fake scores <= -1."""
    loss = real_logits[0].new_zeros(())
    for real, fake in zip(real_logits, fake_logits, strict=True):
        loss = loss + F.relu(1 - real).mean() + F.relu(1 + fake).mean()
    return loss / len(real_logits)


def generator_hinge_loss(fake_logits: list[Tensor]) -> Tensor:
    """``mean(relu(1 - D(fake)))`` averaged over scales (EnCodec's generator hinge)."""
    return sum(F.relu(1 - fake).mean() for fake in fake_logits) / len(fake_logits)


def feature_matching_loss(real_features: list[list[Tensor]],
                          fake_features: list[list[Tensor]]) -> Tensor:
    """L1 between the discriminator's feature maps of real and fake, each map normalised by the
    mean magnitude of its real one (EnCodec), averaged over maps and scales."""
    total, count = real_features[0][0].new_zeros(()), 0
    for reals, fakes in zip(real_features, fake_features, strict=True):
        for real, fake in zip(reals, fakes, strict=True):
            real = real.detach()
            total = total + F.l1_loss(fake, real) / real.abs().mean().clamp(min=1e-7)
            count += 1
    return total / count
