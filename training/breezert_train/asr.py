"""Offline speech recognition for the quality gate: pocketsphinx 5 with its bundled en-US model.

Owns: one pocketsphinx decoder (the acoustic model, dictionary and language model inside the
wheel, or another language model file: the in-run scorer's, ``run_wer``; nothing is downloaded)
and turning a mono PCM array at any rate into its transcript, through
the project's ``soxr`` resampler to the model's 16 kHz. Must not: score transcripts (``wer``
does) or know where the audio came from.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import numpy as np

from breezert.audio import float_to_int16, new_resampler, resample_chunk

ASR_PACKAGE = "pocketsphinx"
ASR_VERSION = "5.1.1"
ASR_SAMPLE_RATE = 16000
"""The en-US acoustic model's rate (Hz)."""
RESAMPLE_QUALITY = "HQ"
"""Whole utterances are resampled at once, so soxr's hold-back costs nothing here."""


def to_asr_rate(pcm: np.ndarray, sample_rate: int) -> np.ndarray:
    """Mono float32 ``pcm`` at ``sample_rate`` -> float32 at 16 kHz (the whole buffer, flushed)."""
    resampler = new_resampler(sample_rate, ASR_SAMPLE_RATE, RESAMPLE_QUALITY)
    return resample_chunk(resampler, np.asarray(pcm, dtype=np.float32), last=True)


class Transcriber:
    """pocketsphinx's default en-US decoder, one utterance at a time.

    Each call decodes a whole utterance (``full_utt``), so cepstral mean normalisation is computed
    over that utterance alone: a transcript does not depend on what was decoded before it.
    """

    def __init__(self, lm: str | Path | None = None, pinned: bool = True) -> None:
        """``lm``: an ARPA or binary language model instead of the bundled ``en-us.lm.bin``;
        ``pinned``: refuse any pocketsphinx but ``ASR_VERSION`` (the gate's figures; the
        in-run scorer records the version it found instead)."""
        import pocketsphinx

        self.version = version(ASR_PACKAGE)
        if pinned and self.version != ASR_VERSION:  # another version is another gate figure
            raise RuntimeError(f"the gate's ASR is pocketsphinx {ASR_VERSION}, "
                               f"found {self.version}")
        model = Path(pocketsphinx.get_model_path("en-us"))
        if not (model / "en-us").is_dir():
            raise RuntimeError(f"pocketsphinx's bundled en-US model is missing under {model}")
        if lm is None and not (model / "en-us.lm.bin").is_file():
            raise RuntimeError(f"pocketsphinx's bundled language model {model / 'en-us.lm.bin'} "
                               "is missing (a slim wheel): give a language model file")
        self.model_path = str(model)
        extra = {"lm": str(lm)} if lm is not None else {}
        self._decoder = pocketsphinx.Decoder(samprate=ASR_SAMPLE_RATE, loglevel="FATAL", **extra)

    def transcribe(self, pcm: np.ndarray, sample_rate: int) -> str:
        """Mono float32 samples in [-1, 1] at ``sample_rate`` -> lower-case words ("" for none)."""
        pcm16 = float_to_int16(to_asr_rate(pcm, sample_rate))
        decoder = self._decoder
        decoder.start_utt()
        decoder.process_raw(pcm16.tobytes(), no_search=False, full_utt=True)
        decoder.end_utt()
        hyp = decoder.hyp()
        return hyp.hypstr if hyp is not None else ""
