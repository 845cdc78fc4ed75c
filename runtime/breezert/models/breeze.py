"""The Breeze-TTS-2 language model as one module whose ``state_dict`` uses the released names.

Owns: wiring of text encoder, projection, backbone, fp32 ``lm_head`` and depth decoder; prompt
embeddings; the tied audio table (``depth_decoder.model.embed_tokens``, registered once); random
init and parameter counting. Must not: sample, hold KV or read checkpoint files.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from breezert.constants import AUDIO_EOS_TOKEN_ID, AUDIO_TOKEN_ID, CODEBOOK_EOS_ID
from breezert.host_copy import upload
from breezert.layers.norms import GemmaRMSNorm, RMSNorm
from breezert.models.backbone import Qwen3Backbone
from breezert.models.config import BreezeConfig, ConfigError
from breezert.models.depth import DepthDecoder
from breezert.models.prompt import Prompt
from breezert.models.text_encoder import T5Gemma2TextEncoder


class BreezeModel(nn.Module):
    """Text encoder + projection + Qwen3 backbone + ``lm_head`` + depth decoder (live tensors)."""

    def __init__(self, cfg: BreezeConfig) -> None:
        super().__init__()
        if cfg.depth.audio_embed_size != cfg.hidden_size:
            raise ConfigError(
                f"depth audio_embed_size={cfg.depth.audio_embed_size} != "
                f"hidden_size={cfg.hidden_size}: the audio table feeds the backbone directly"
            )
        if cfg.depth.backbone_hidden_size != cfg.hidden_size:
            raise ConfigError(
                f"depth backbone_hidden_size={cfg.depth.backbone_hidden_size} != "
                f"hidden_size={cfg.hidden_size}"
            )
        self.cfg = cfg
        self.text_encoder = T5Gemma2TextEncoder(cfg.text_encoder)
        self.text_encoder_proj = nn.Linear(
            cfg.text_encoder.hidden_size, cfg.hidden_size, bias=False
        )
        self.backbone_model = Qwen3Backbone(cfg.backbone)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.backbone.vocab_size, bias=False)
        self.depth_decoder = DepthDecoder(cfg.depth)
        self.lm_head_fp32: torch.Tensor | None = None  # set by fuse_projections_()

    @property
    def audio_embedding(self) -> nn.Embedding:
        """The single tied audio table ``[16 * 2051, D]``, shared by backbone and depth decoder."""
        return self.depth_decoder.model.embed_tokens

    def audio_frame_embeds(self, codes: torch.Tensor) -> torch.Tensor:
        """Backbone input rows ``[R, D]`` of ``codes [R, 16]``: ``sum_k E[code_k + 2051 k]``."""
        vocab = self.cfg.audio_vocab_size
        offsets = torch.arange(codes.shape[-1], device=codes.device) * vocab  # [16]
        return self.audio_embedding(codes + offsets).sum(dim=-2)

    def encode_text_segments(
        self, input_ids: torch.Tensor, seg_lens: Sequence[int] | torch.Tensor
    ) -> torch.Tensor:
        """Encodes a packed batch of independent segments and projects it -> ``[N, D]``."""
        return self.text_encoder_proj(self.text_encoder(input_ids, seg_lens))

    def prompt_embeds(self, prompt: Prompt) -> torch.Tensor:
        """Prefill rows ``[L, D]`` of one branch (SPEC §2.2)."""
        return self.prompt_embeds_many([prompt])[0]

    def prompt_embeds_many(self, prompts: Sequence[Prompt]) -> list[torch.Tensor]:
        """Prefill rows of several branches, with all their text segments in one encoder call."""
        segments = [seg for p in prompts for seg in p.text_segments()]
        encoded = None
        if segments:
            device = self.text_encoder_proj.weight.device
            encoded = self.encode_text_segments(
                upload(torch.cat(segments), device), [int(s.shape[0]) for s in segments]
            )  # [N, D]
        return self.assemble_prompt_embeds(prompts, encoded)

    def assemble_prompt_embeds(
        self, prompts: Sequence[Prompt], encoded: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """Places encoded text rows (``prompts``' segments in order, packed) and reference /
        audio-EOS frame rows into one ``[L, D]`` tensor per prompt."""
        weight = self.text_encoder_proj.weight
        outs = [torch.zeros(p.num_tokens, self.cfg.hidden_size, dtype=weight.dtype,
                            device=weight.device) for p in prompts]
        # The positions of audio rows are found on the host (the prompts' ids live there): on
        # CUDA an upload and two nonzero() per branch each waited for the GPU.
        positions = [_audio_positions(p) for p in prompts]
        eos_row = None  # the same row for every prompt: 16 table rows summed once per call
        if any(eos for _, eos in positions):
            eos_frame = torch.full((1, self.cfg.num_codebooks), CODEBOOK_EOS_ID,
                                   dtype=torch.long, device=weight.device)
            eos_row = self.audio_frame_embeds(eos_frame)
        offset = 0
        for out, prompt, (audio_pos, eos_pos) in zip(outs, prompts, positions):
            for start, length in prompt.text_spans:
                assert encoded is not None
                out[start : start + length] = encoded[offset : offset + length]
                offset += length
            if audio_pos:
                assert prompt.ref_codes is not None
                frames = self.audio_frame_embeds(upload(prompt.ref_codes, out.device))
                _place_rows(out, audio_pos, frames)
            if eos_pos:
                assert eos_row is not None
                _place_rows(out, eos_pos, eos_row)
        return outs

    def first_code_logits(self, h_last: torch.Tensor) -> torch.Tensor:
        """fp32 backbone logits ``[R, 2052]`` (2051 = frame EOS) from final-normed ``h_last``."""
        weight = self.lm_head_fp32 if self.lm_head_fp32 is not None else self.lm_head.weight.float()
        return F.linear(h_last.float(), weight)

    @torch.no_grad()
    def init_random_(
        self, generator: torch.Generator | None = None, std: float = 0.02
    ) -> BreezeModel:
        """Random init: N(0, std) everywhere, Gemma ``(1+w)`` norms 0, Llama/Qwen norms 1."""
        for module in self.modules():
            for param in module.parameters(recurse=False):
                if isinstance(module, GemmaRMSNorm):
                    param.zero_()
                elif isinstance(module, RMSNorm):
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, std, generator=generator)
        return self

    @torch.no_grad()
    def fuse_projections_(self) -> BreezeModel:
        """Prepares the loaded weights for serving, with ``state_dict`` unchanged: packs q/k/v and
        gate/up into one GEMM each (weights become views of the packed tensors) and keeps fp32
        copies of the output heads, so no step converts them again (+142 MB at full size)."""
        for module in self.modules():
            if module is not self and hasattr(module, "fuse_"):
                module.fuse_()
        self.lm_head_fp32 = self.lm_head.weight.detach().float()
        self.depth_decoder.heads_fp32 = self.depth_decoder.codebooks_head.weight.detach().float()
        return self

    def count_parameters(self) -> int:
        """Number of live parameters (the tied audio table counted once)."""
        return sum(p.numel() for p in self.parameters())


def _audio_positions(prompt: Prompt) -> tuple[list[int], list[int]]:
    """Host positions of ``prompt``'s AUDIO rows (one per reference frame, checked) and of its
    audio end-of-speech rows."""
    ids = prompt.input_ids.cpu()
    audio_pos = (ids == AUDIO_TOKEN_ID).nonzero().flatten().tolist()
    eos_pos = (ids == AUDIO_EOS_TOKEN_ID).nonzero().flatten().tolist()
    num_ref = 0 if prompt.ref_codes is None else int(prompt.ref_codes.shape[0])
    if len(audio_pos) != num_ref:
        raise ValueError(f"prompt has {len(audio_pos)} AUDIO ids but {num_ref} ref frames")
    return audio_pos, eos_pos


def _place_rows(out: torch.Tensor, positions: list[int], rows: torch.Tensor) -> None:
    """``out[positions] = rows`` for ascending, non-negative ``positions`` (as ``nonzero``
    gives them) and ``rows [len(positions), D]`` or ``[1, D]`` (one row for every position),
    as one slice copy per run of consecutive positions: no index upload."""
    if rows.shape[0] not in (1, len(positions)) or positions != sorted(positions) or (
            positions and positions[0] < 0):
        raise ValueError(f"{rows.shape[0]} rows for positions {positions}")
    i = 0
    while i < len(positions):
        j = i + 1
        while j < len(positions) and positions[j] == positions[j - 1] + 1:
            j += 1
        piece = rows if rows.shape[0] == 1 else rows[i:j]
        out[positions[i] : positions[i] + (j - i)] = piece
        i = j
