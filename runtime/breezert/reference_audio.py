"""Reference audio (voice clone / direction) -> codec codes, as SPEC §2.7 prescribes.

Owns: validating a caller's PCM, mono mean, soxr HQ resampling to 24 kHz with the exact target
length, and one FP32 pass through ``CodecEncoder``. Must not: read files, build requests or touch
the synthesis loop (the codes go into ``breezert.request.Reference``).
"""

from __future__ import annotations

import math

import numpy as np
import soxr
import torch

from breezert.constants import MAX_REFERENCE_S, SAMPLE_RATE
from breezert.errors import InvalidRequest
from breezert.models.codec_encoder import CodecEncoder

MAX_CHANNELS = 8
"""More columns than this means the array is most likely [channels, samples]: refused."""
_INT_SCALE = {np.dtype(np.int16): 2.0**15, np.dtype(np.int32): 2.0**31}


def num_resampled(num_samples: int, sample_rate: int) -> int:
    """Length after resampling to 24 kHz: ``ceil(num_samples * 24000 / sample_rate)``."""
    return -(-num_samples * SAMPLE_RATE // sample_rate)


def to_mono_24k(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    """Validated mono float32 at 24 kHz, padded with zeros or trimmed to ``num_resampled``.

    Args:
        samples: ``[num_samples]`` or ``[num_samples, num_channels]`` (the soundfile layout);
            float, or int16 / int32 PCM (scaled to [-1, 1)).
        sample_rate: input rate in Hz.

    Raises:
        InvalidRequest: (a ``ValueError``) naming ``samples`` or ``sample_rate``.
    """
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or (
        sample_rate <= 0
    ):
        raise InvalidRequest(f"sample_rate={sample_rate!r}: must be a positive integer (Hz)")
    sample_rate = int(sample_rate)
    x = np.asarray(samples)
    if x.ndim not in (1, 2):
        raise InvalidRequest(
            f"samples: expected [num_samples] or [num_samples, num_channels], got shape {x.shape}"
        )
    if x.ndim == 2 and not 1 <= x.shape[1] <= MAX_CHANNELS:
        raise InvalidRequest(
            f"samples: shape {x.shape} has {x.shape[1]} channels (at most {MAX_CHANNELS}); "
            "pass [num_samples, num_channels] (transpose a [channels, samples] array)"
        )
    if x.shape[0] == 0:
        raise InvalidRequest("samples: empty reference audio (0 samples)")
    if x.shape[0] / sample_rate > MAX_REFERENCE_S:
        raise InvalidRequest(
            f"samples: {x.shape[0] / sample_rate:.2f} s of audio at sample_rate={sample_rate} "
            f"exceeds the {MAX_REFERENCE_S:g} s limit"
        )
    if x.dtype in _INT_SCALE:
        x = x.astype(np.float64) / _INT_SCALE[x.dtype]
    elif not np.issubdtype(x.dtype, np.floating):
        raise InvalidRequest(f"samples: dtype {x.dtype} is not float, int16 or int32 PCM")
    if not np.isfinite(x).all():
        raise InvalidRequest("samples: contains NaN or infinite values")

    mono = (x.mean(axis=1) if x.ndim == 2 else x).astype(np.float32)  # [n]
    target = num_resampled(mono.shape[0], sample_rate)
    if sample_rate != SAMPLE_RATE:
        mono = soxr.resample(mono, sample_rate, SAMPLE_RATE, quality="HQ").astype(np.float32)
    if mono.shape[0] < target:
        mono = np.pad(mono, (0, target - mono.shape[0]))
    return np.ascontiguousarray(mono[:target])


def encode_reference(
    encoder: CodecEncoder, samples: np.ndarray, sample_rate: int
) -> np.ndarray:
    """Reference PCM -> ``[K, 16]`` int64 codes for ``Reference(ref_text, ref_codes)``.

    ``K = ceil(n24 / 1920)`` where ``n24 = ceil(num_samples * 24000 / sample_rate)``. The encoder
    must hold float32 weights (the loader keeps it fp32); it runs with a full causal mask.

    Raises:
        InvalidRequest: bad ``samples`` or ``sample_rate`` (see ``to_mono_24k``).
    """
    weight = encoder.downsample.conv.weight
    if weight.dtype != torch.float32:
        raise ValueError(f"encoder weights are {weight.dtype}; reference encoding needs float32")
    wav = torch.from_numpy(to_mono_24k(samples, sample_rate)).to(weight.device)[None]  # [1, T]
    codes = encoder.encode(wav)[0]  # [K, 16]
    assert codes.shape[0] == math.ceil(wav.shape[-1] / encoder.samples_per_frame)
    return codes.to(torch.int64).cpu().numpy()
