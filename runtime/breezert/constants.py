"""Fixed numbers of the Breeze-TTS-2 checkpoint and the ``Stage`` enum: the bottom of the graph.

Owns: the special token ids and the audio geometry (codebooks, codebook size, sample rate, frame
length) that the tokenizer and the codec fix for every model size, and the five ``Stage``s.
Must not: import torch or any BreezeRT module, so the scheduler, the requests, the metrics and
the model code can all share these without importing each other.
"""

from __future__ import annotations

import enum

# Special ids of the released checkpoint (SPEC §1.2, §1.5). They are fixed by the tokenizer and
# the audio vocabulary, not by the model size, so both presets share them.
AUDIO_TOKEN_ID = 262144  # <|AUDIO|>
AUDIO_EOS_TOKEN_ID = 262145  # <|audio_eos|>
SPEAKER_TOKEN_IDS = tuple(range(262146, 262156))  # [S0]..[S9]
SPEAKER_NAMES = tuple(f"[S{i}]" for i in range(len(SPEAKER_TOKEN_IDS)))
"""The built-in speakers, in token order."""
INS_BOS_TOKEN_ID = 262156  # <ins_bos>
INS_EOS_TOKEN_ID = 262157  # <ins_eos>
EOI_TOKEN_ID = 256000  # <end_of_image>, replaced by the encoder's eoi_embedding
TEXT_BOS_ID = 2
TEXT_EOS_ID = 1
TEXT_PAD_ID = 0
CODEBOOK_SIZE = 2048  # codec codes are 0..2047
AUDIO_VOCAB_SIZE = 2051  # per-codebook embedding rows; 2048..2050 reserved, 2050 = pad
CODEBOOK_PAD_ID = 2050
CODEBOOK_EOS_ID = 0  # prompt audio-EOS frame uses code 0 in all 16 codebooks
FRAME_EOS_ID = 2051  # generation EOS, sampled by the backbone's 2052-wide lm_head
NUM_CODEBOOKS = 16
SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920
FRAME_RATE_HZ = SAMPLE_RATE / SAMPLES_PER_FRAME  # 12.5
FRAME_S = SAMPLES_PER_FRAME / SAMPLE_RATE  # 0.08 s of audio per codec frame


class Stage(str, enum.Enum):
    """The five stages; the values double as metrics keys, log fields and graph keys."""

    TEXT_ENCODE = "text_encode"
    PREFILL = "prefill"
    DECODE = "decode"
    DEPTH = "depth"
    CODEC = "codec"

MAX_REFERENCE_S = 30.0
"""Longest reference audio (voice clone) accepted, seconds."""
