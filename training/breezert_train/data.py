"""Random fixed-length crops of 24 kHz speech for codec training.

Owns: reading a folder of ``.wav`` (PCM16) and ``.npy`` (int16 or float) files, or of the teacher
shards ``teacher_data`` writes, into memory and drawing seeded crops. Must not: know models or
losses; another source plugs in by offering the same ``sample`` / ``state_dict`` /
``load_state_dict``.
"""

from __future__ import annotations

import wave
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from breezert.constants import SAMPLE_RATE
from breezert_train import shards

AUDIO_SUFFIXES = (".wav", ".npy")


class CropSource(Protocol):
    """What the codec trainer reads: seeded batches of equal-length float crops in [-1, 1]."""

    def sample(self, batch_size: int) -> Tensor: ...  # [batch_size, crop_samples] float32

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def read_audio(path: Path) -> np.ndarray:
    """A mono float32 waveform in [-1, 1] at 24 kHz from ``.wav`` (PCM16) or ``.npy``."""
    if path.suffix == ".npy":
        data, rate = np.load(path), SAMPLE_RATE
        if data.ndim != 1:
            raise ValueError(f"{path}: expected a 1-D waveform, got shape {data.shape}")
    else:
        with wave.open(str(path), "rb") as f:
            if f.getsampwidth() != 2:
                raise ValueError(f"{path}: {8 * f.getsampwidth()}-bit WAV; use 16-bit PCM")
            rate, channels = f.getframerate(), f.getnchannels()
            data = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").reshape(-1, channels)
    scale = 1.0 / 32768.0 if data.dtype == np.int16 else 1.0
    wav = data.astype(np.float32) * scale
    if wav.ndim == 2:  # WAV frames [T, channels]: the channel mean
        wav = wav.mean(axis=1)
    if rate != SAMPLE_RATE:
        import soxr

        wav = soxr.resample(wav, rate, SAMPLE_RATE).astype(np.float32)
    return wav


class AudioFolderCrops:
    """Every utterance of the teacher shards in ``root`` (kept as int16), else every ``.wav`` /
    ``.npy`` under it, in memory; crops drawn with a seeded generator (clips picked in
    proportion to their length, shorter ones zero-padded on the right)."""

    def __init__(self, root: str | Path, crop_samples: int, seed: int = 0) -> None:
        root = Path(root)
        if any(root.glob(shards.SHARD_GLOB)):
            self.clips = [torch.from_numpy(audio) for _, audio in shards.iter_audio(root)]
        else:
            files = sorted(p for p in root.rglob("*") if p.suffix in AUDIO_SUFFIXES)
            self.clips = [torch.from_numpy(read_audio(p)) for p in files]
        if not self.clips:
            raise ValueError(f"no teacher shards and no {'/'.join(AUDIO_SUFFIXES)} audio under "
                             f"{root}")
        self.crop_samples = crop_samples
        lengths = torch.tensor([max(len(c), 1) for c in self.clips], dtype=torch.float64)
        self._weights = lengths / lengths.sum()
        self._gen = torch.Generator().manual_seed(seed)

    def sample(self, batch_size: int) -> Tensor:
        picks = torch.multinomial(self._weights, batch_size, replacement=True, generator=self._gen)
        out = torch.zeros(batch_size, self.crop_samples)
        for row, i in enumerate(picks.tolist()):
            clip = self.clips[i]
            span = max(len(clip) - self.crop_samples, 0)
            start = int(torch.randint(0, span + 1, (1,), generator=self._gen))
            piece = clip[start : start + self.crop_samples]
            if piece.dtype == torch.int16:  # teacher shards: PCM16
                piece = piece.float() / 32768.0
            out[row, : len(piece)] = piece
        return out  # [batch_size, crop_samples]

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self._gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._gen.set_state(state["generator"])
