"""The text front end: a request's (text, options, reference) -> its engine segments, built once.

Owns: tokenizing and the prompt templates (``prompting.make_prompt``), cutting a text whose
prompt does not fit (``text.split_text``, measured on the very prompts it keeps, so each piece's
prompt is built once), the per-segment token limit, the prompt-token count (OpenAI ``usage``)
and reference-audio encoding (the checkpoint's codec encoder). Holds no lock and no state
between calls: ``AsyncEngine`` runs it on its one prepare thread (reference encoding on a worker
thread), never on an event loop. Must not: touch the scheduler, the engine lock or the worker.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from breezert.errors import InvalidRequest
from breezert.models.generate import cfg_branches
from breezert.models.prompt import Prompt
from breezert.options import SynthesisOptions
from breezert.prompting import check_fits, make_prompt
from breezert.request import Reference, Segment, SynthesisRequest
from breezert.text import Split, cut_text
from breezert.tokenizer import BreezeTokenizer


@dataclass(frozen=True)
class PreparedText:
    """Texts as engine segments (single use: the scheduler takes the segments over)."""

    segments: tuple[Segment, ...]
    owners: tuple[int, ...]
    """The text (index into the texts prepared) each segment was cut from."""
    num_prompt_tokens: int
    """Prompt tokens over every segment, the longest CFG branch of each."""


@dataclass(frozen=True)
class PreparedRequest:
    """A ``SynthesisRequest`` with its text prepared (``TextFrontEnd.prepare``)."""

    request: SynthesisRequest
    text: PreparedText
    num_branches: int
    """CFG branches of every segment (the template decides: a turn with no text yet too)."""


class TextFrontEnd:
    """Builds every segment's prompt once, cutting text that does not fit one prompt.

    Args:
        tokenizer: The checkpoint's tokenizer.
        max_seq_len: The context of one segment, tokens (prompt plus frames).
        codec_encoder: The checkpoint's audio-tokenizer encoder (``None``: the model cannot
            take reference audio).
    """

    def __init__(self, tokenizer: BreezeTokenizer, max_seq_len: int,
                 codec_encoder: Any | None) -> None:
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.codec_encoder = codec_encoder

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt one segment may have: room for at least one frame."""
        return self.max_seq_len - 2

    def prepare(self, request: SynthesisRequest, split: Split = Split.NONE) -> PreparedRequest:
        """``request``'s segments; raises ``InvalidRequest`` naming the field at fault."""
        text = self.prepare_text(request.segments, request.options, request.reference, split)
        num_branches = (text.segments[0].num_branches if text.segments else
                        len(cfg_branches(self._build("probe", request.options,
                                                     request.reference),
                                         float(request.options.cfg_scale))))
        return PreparedRequest(request, text, num_branches)

    def prepare_text(self, texts: Sequence[str], options: SynthesisOptions,
                     reference: Reference | None, split: Split = Split.NONE) -> PreparedText:
        """``texts`` as segments, each cut as ``split`` says; raises ``InvalidRequest``."""
        cfg_scale = float(options.cfg_scale)
        segments: list[Segment] = []
        owners: list[int] = []
        for owner, text in enumerate(texts):
            for prompt in self._prompts(text, options, reference, split):
                branches = cfg_branches(prompt, cfg_scale)
                segments.append(Segment(
                    prompt_lens=tuple(p.num_tokens for p in branches), prompt=branches,
                    num_text_tokens=sum(n for p in branches for _, n in p.text_spans)))
                owners.append(owner)
        return PreparedText(tuple(segments), tuple(owners),
                            sum(max(s.prompt_lens) for s in segments))

    def encode_reference(self, samples: Any, sample_rate: int, ref_text: str) -> Reference:
        """Reference audio -> ``Reference(ref_text, ref_codes)`` for voice clone / direction.

        Runs the codec encoder (fp32) under ``torch.inference_mode`` on its own device; any
        thread may call it while the engine steps.

        Args:
            samples: ``[num_samples]`` or ``[num_samples, num_channels]``; float, int16 or int32.
            sample_rate: Hz (resampled to 24 kHz).
            ref_text: the reference audio's transcript.

        Raises:
            InvalidRequest: naming ``reference_text``, ``samples`` / ``sample_rate`` (bad audio)
                or ``reference_audio`` (the model has no encoder).
        """
        import torch

        from breezert.reference_audio import encode_reference

        if not isinstance(ref_text, str) or not ref_text.strip():
            raise InvalidRequest("reference_text: must be non-empty text (the reference's "
                                 "transcript)")
        if self.codec_encoder is None:
            raise InvalidRequest("reference_audio: this model has no reference-audio encoder "
                                 "(its checkpoint lacks the audio-tokenizer encoder weights)")
        with torch.inference_mode():
            codes = encode_reference(self.codec_encoder, samples, sample_rate)
        return Reference(ref_text=ref_text, ref_codes=codes)

    # ------------------------------------------------------------------ helpers
    def _prompts(self, text: str, options: SynthesisOptions, reference: Reference | None,
                 split: Split) -> list[Prompt]:
        """The prompts of ``text``'s pieces; each piece's prompt is built once, whether the
        fit check or the segment asks first."""
        built: dict[str, Prompt] = {}
        cfg_scale = float(options.cfg_scale)

        def build(piece: str) -> Prompt:
            if piece not in built:
                built[piece] = self._build(piece, options, reference)
            return built[piece]

        def fits(piece: str) -> bool:
            try:
                prompt = build(piece)
            except InvalidRequest:  # not a length problem: building the segment reports it
                return True
            return max(p.num_tokens for p in cfg_branches(prompt, cfg_scale)) \
                <= self.max_prompt_tokens

        prompts = [build(piece) for piece in cut_text(text, split, fits)]
        for prompt in prompts:
            check_fits(prompt, self.max_seq_len)
        return prompts

    def _build(self, text: str, options: SynthesisOptions,
               reference: Reference | None) -> Prompt:
        # the limit is checked by the caller (a fit check measures the prompt first)
        return make_prompt(self.tokenizer, text, speaker=options.speaker,
                           instructions=options.instructions, reference=reference,
                           max_seq_len=sys.maxsize)
