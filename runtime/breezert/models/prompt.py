"""Breeze-TTS-2 prompt templates (SPEC §2.1) over already-tokenized text, with CFG negatives.

Owns: the four templates (plain, voice design, voice clone, voice direction), speaker ids, and the
``Prompt`` layout (placeholder ids, text segment spans, reference codes). Must not: tokenize text,
embed anything or decide whether CFG runs (the generator does, from ``cfg_scale``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from breezert.constants import (
    AUDIO_EOS_TOKEN_ID,
    AUDIO_TOKEN_ID,
    CODEBOOK_SIZE,
    INS_BOS_TOKEN_ID,
    INS_EOS_TOKEN_ID,
    NUM_CODEBOOKS,
    SPEAKER_NAMES,
    SPEAKER_TOKEN_IDS,
    TEXT_BOS_ID,
)
from breezert.models.config import TextEncoderConfig
from breezert.options import speaker_name

TEXT_VOCAB_SIZE = TextEncoderConfig.vocab_size
SPEAKERS = dict(zip(SPEAKER_NAMES, SPEAKER_TOKEN_IDS, strict=True))
TokenIds = Sequence[int] | torch.Tensor


@dataclass(frozen=True, eq=False)
class Prompt:
    """One backbone branch: ``[text seg | K AUDIO | AUDIO_EOS | text seg]`` or a single segment.

    Attributes:
        input_ids: ``[L]`` ids; AUDIO (262144) / AUDIO_EOS (262145) mark reference-frame rows.
        text_spans: ``(start, length)`` of each text segment, in order; each is encoded alone.
        ref_codes: ``[K, 16]`` reference frames for the K AUDIO rows, or None.
        negative: the CFG negative branch, where the template defines one.
    """

    input_ids: torch.Tensor
    text_spans: tuple[tuple[int, int], ...]
    ref_codes: torch.Tensor | None = None
    negative: Prompt | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def text_ids_mask(self) -> torch.Tensor:
        """``[L]`` uint8, 1 on text-segment positions (the golden ``text_ids_mask``)."""
        mask = torch.zeros(self.num_tokens, dtype=torch.uint8)
        for start, length in self.text_spans:
            mask[start : start + length] = 1
        return mask

    @property
    def text_ids_len(self) -> torch.Tensor:
        """``[S]`` long, the length of each text segment (the golden ``text_ids_len``)."""
        return torch.tensor([length for _, length in self.text_spans], dtype=torch.long)

    def text_segments(self) -> list[torch.Tensor]:
        """The ids of each text segment, in order."""
        return [self.input_ids[start : start + length] for start, length in self.text_spans]


def speaker_token_id(speaker: str) -> int:
    """Maps ``"S3"`` or ``"[S3]"`` to its token id; raises ValueError naming ``speaker``."""
    if not isinstance(speaker, str):
        raise ValueError(f"speaker={speaker!r} must be a string like '[S0]'")
    name = speaker_name(speaker)
    if name not in SPEAKERS:
        raise ValueError(f"speaker={speaker!r} is unknown; expected one of [S0]..[S9]")
    return SPEAKERS[name]


def plain_prompt(text_ids: TokenIds, *, speaker: str = "[S0]") -> Prompt:
    """``spk+text``; no CFG negative."""
    return _plain(speaker_token_id(speaker), _ids(text_ids, "text_ids"))


def design_prompt(
    text_ids: TokenIds, instruction_ids: TokenIds, *, speaker: str = "[S0]"
) -> Prompt:
    """``spk<ins_bos>{instr}<ins_eos>{text}``; negative ``spk+text``."""
    spk, text = speaker_token_id(speaker), _ids(text_ids, "text_ids")
    builder = _Builder()
    builder.add_text(spk, _ids(instruction_ids, "instruction_ids"), text)
    return builder.build(negative=_plain(spk, text))


def clone_prompt(
    text_ids: TokenIds, ref_text_ids: TokenIds, ref_codes: torch.Tensor, *, speaker: str = "[S0]"
) -> Prompt:
    """``spk+ref_text`` · AUDIO×K · AUDIO_EOS · ``spk+text``; no negative (none upstream)."""
    return _clone(
        speaker_token_id(speaker),
        _ids(ref_text_ids, "ref_text_ids"),
        _codes(ref_codes),
        _ids(text_ids, "text_ids"),
    )


def direction_prompt(
    text_ids: TokenIds,
    instruction_ids: TokenIds,
    ref_text_ids: TokenIds,
    ref_codes: torch.Tensor,
    *,
    speaker: str = "[S0]",
) -> Prompt:
    """Reference prefix · ``spk<ins_bos>{instr}<ins_eos>{text}``; negative = the clone prompt."""
    spk, codes = speaker_token_id(speaker), _codes(ref_codes)
    ref_text, text = _ids(ref_text_ids, "ref_text_ids"), _ids(text_ids, "text_ids")
    builder = _Builder()
    builder.add_text(spk, [], ref_text)
    builder.add_audio(codes)
    builder.add_text(spk, _ids(instruction_ids, "instruction_ids"), text)
    return builder.build(negative=_clone(spk, ref_text, codes, text))


def build_prompt(
    text_ids: TokenIds,
    *,
    speaker: str = "[S0]",
    instruction_ids: TokenIds | None = None,
    ref_text_ids: TokenIds | None = None,
    ref_codes: torch.Tensor | None = None,
) -> Prompt:
    """Picks the template from what is given (reference and/or instruction).

    Every id list is the tokenizer's output with ``add_special_tokens=True``: one leading bos (2)
    is dropped if present. An empty instruction counts as none.
    """
    has_instruction = instruction_ids is not None and len(_ids(instruction_ids, "instruction_ids"))
    if (ref_codes is None) != (ref_text_ids is None):
        missing = "ref_text_ids" if ref_text_ids is None else "ref_codes"
        raise ValueError(f"{missing}: a reference needs both ref_text_ids and ref_codes")
    if ref_codes is not None and ref_text_ids is not None:
        if has_instruction:
            assert instruction_ids is not None
            return direction_prompt(
                text_ids, instruction_ids, ref_text_ids, ref_codes, speaker=speaker
            )
        return clone_prompt(text_ids, ref_text_ids, ref_codes, speaker=speaker)
    if has_instruction:
        assert instruction_ids is not None
        return design_prompt(text_ids, instruction_ids, speaker=speaker)
    return plain_prompt(text_ids, speaker=speaker)


def _plain(spk: int, text: list[int]) -> Prompt:
    builder = _Builder()
    builder.add_text(spk, [], text)
    return builder.build()


def _clone(spk: int, ref_text: list[int], codes: torch.Tensor, text: list[int]) -> Prompt:
    builder = _Builder()
    builder.add_text(spk, [], ref_text)
    builder.add_audio(codes)
    builder.add_text(spk, [], text)
    return builder.build()


class _Builder:
    def __init__(self) -> None:
        self.ids: list[int] = []
        self.spans: list[tuple[int, int]] = []
        self.ref_codes: torch.Tensor | None = None

    def add_text(self, speaker_id: int, instruction: list[int], text: list[int]) -> None:
        segment = [TEXT_BOS_ID, speaker_id]
        if instruction:
            segment += [INS_BOS_TOKEN_ID, *instruction, INS_EOS_TOKEN_ID]
        segment += text
        self.spans.append((len(self.ids), len(segment)))
        self.ids += segment

    def add_audio(self, codes: torch.Tensor) -> None:
        self.ref_codes = codes
        self.ids += [AUDIO_TOKEN_ID] * codes.shape[0] + [AUDIO_EOS_TOKEN_ID]

    def build(self, negative: Prompt | None = None) -> Prompt:
        input_ids = torch.tensor(self.ids, dtype=torch.long)
        return Prompt(input_ids, tuple(self.spans), self.ref_codes, negative)


def _ids(ids: TokenIds, field: str) -> list[int]:
    """Validates one tokenized string and drops its leading bos."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{field}: ids must be ints, got {value!r}")
        if not 0 <= value < TEXT_VOCAB_SIZE:
            raise ValueError(f"{field}: id {value} outside the text vocabulary")
        if value in (AUDIO_TOKEN_ID, AUDIO_EOS_TOKEN_ID):
            raise ValueError(f"{field}: id {value} is an audio placeholder, not text")
    if values and values[0] == TEXT_BOS_ID:
        values = values[1:]
    return values


def _codes(ref_codes: torch.Tensor) -> torch.Tensor:
    if not isinstance(ref_codes, torch.Tensor) or ref_codes.dim() != 2:
        raise ValueError("ref_codes: expected a [K, 16] integer tensor")
    if ref_codes.shape[0] < 1 or ref_codes.shape[1] != NUM_CODEBOOKS:
        raise ValueError(f"ref_codes: shape {tuple(ref_codes.shape)} is not [K>=1, 16]")
    if ref_codes.is_floating_point() or ref_codes.dtype == torch.bool:
        raise ValueError(f"ref_codes: dtype {ref_codes.dtype} is not an integer type")
    if bool(((ref_codes < 0) | (ref_codes >= CODEBOOK_SIZE)).any()):
        raise ValueError(f"ref_codes: codes must be in 0..{CODEBOOK_SIZE - 1}")
    return ref_codes.to(torch.long).cpu()
