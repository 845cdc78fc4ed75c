"""Teacher-forced forward of the Breeze LM for training: the serving modules over whole utterances.

Owns: the training ``KVCache`` (causal SDPA over a padded batch, plus the guided-attention
diagonal prior on chosen layers), the depth decoder run over all 16 positions of every frame at
once, the training-only phoneme heads (``PhonemeHeads``: the teacher's phoneme of each frame
from the backbone state that predicts its code 0, and CTC of the phoneme sequence from the
text encoder's prompt rows; never exported), and the losses (code 0 with end of speech, the 15
depth codes, the prior, the phonemes; the CTC from ``ctc``, which needs no host sync). Serving
runs the same modules step by step (``models/generate.py``); ``tests/unit/test_lm_train.py``
checks both give the same logits. Must not: define modules or weights of its own, sample, or
touch files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from breezert.constants import FRAME_EOS_ID
from breezert.host_copy import upload
from breezert.layers.rope import apply_rope
from breezert.models.breeze import BreezeModel
from breezert.models.depth import DepthDecoder
from breezert_train.ctc import ctc_loss
from breezert_train.lm_data import PHONEME_CLASSES, Utterance


@dataclass(frozen=True)
class Layout:
    """Where each utterance sits in the padded ``[B, S]`` batch."""

    prompt_lens: Tensor  # [B] long
    frame_lens: Tensor  # [B] long
    seq_len: int  # S

    @property
    def batch_size(self) -> int:
        return int(self.prompt_lens.shape[0])


class TrainAttention:
    """``KVCache`` for one teacher-forced forward: each row of the padded batch attends causally
    to itself (padding sits after every real position, so it is never read). On
    ``guided_layers`` it also scores the prior (``guided_losses``)."""

    def __init__(self, layout: Layout, guided_layers: Sequence[int], sigma: float) -> None:
        self.layout, self.guided_layers, self.sigma = layout, tuple(guided_layers), sigma
        self.guided_losses: list[Tensor] = []
        self._prior: tuple[Tensor, Tensor, Tensor] | None = None  # the same for every layer

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b, s = self.layout.batch_size, self.layout.seq_len
        heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
        q4 = q.view(b, s, heads, dim).transpose(1, 2)  # [B, H, S, D]
        k4 = k.view(b, s, kv_heads, dim).transpose(1, 2)  # [B, KVH, S, D]
        v4 = v.view(b, s, kv_heads, dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True,
                                             enable_gqa=heads != kv_heads)
        if layer_idx in self.guided_layers:
            self.guided_losses.append(self._guided(q4, k4))
        return out.transpose(1, 2).reshape(b * s, heads, dim)

    def _guided(self, q: Tensor, k: Tensor) -> Tensor:
        """Guided attention (Tachibana et al. 2018) over the prompt keys only: the rows that
        predict frame t (and end of speech) should look near prompt position ``t / T`` of the
        way through; ``1 - exp(-(n/N - t/T)^2 / 2 sigma^2)`` weighs what they read elsewhere."""
        lay = self.layout
        max_prompt = int(lay.prompt_lens.max())
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)[:, :, :max_prompt]
        scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B,H,S,P]
        if self._prior is None:
            self._prior = _prior(lay, max_prompt, self.sigma, q.device)
        weight, key_ok, row_ok = self._prior
        probs = scores.masked_fill(~key_ok, float("-inf")).softmax(dim=-1)
        per_row = (probs * weight).sum(-1)  # [B, H, S]
        return (per_row * row_ok).sum() / (row_ok.sum() * q.shape[1]).clamp(min=1)


def _prior(lay: Layout, max_prompt: int, sigma: float, device: torch.device
           ) -> tuple[Tensor, Tensor, Tensor]:
    lp = upload(lay.prompt_lens, device)[:, None, None]
    lt = upload(lay.frame_lens, device)[:, None, None]
    pos = torch.arange(lay.seq_len, device=device)[None, :, None]  # [1, S, 1]
    key = torch.arange(max_prompt, device=device)[None, None, :]  # [1, 1, P]
    frame = pos - (lp - 1)  # the row at L - 1 + t predicts frame t; t = T is end of speech
    row_ok = (frame >= 0) & (frame <= lt)  # [B, S, 1]
    t_norm = frame.float() / lt.float()
    n_norm = key.float() / (lp - 1).clamp(min=1).float()
    weight = 1.0 - torch.exp(-((n_norm - t_norm) ** 2) / (2 * sigma**2))  # [B, S, P]
    return weight[:, None], (key < lp)[:, None], row_ok[:, None, :, 0].float()


def depth_hidden(depth: DepthDecoder, x: Tensor) -> Tensor:
    """All positions of many frames at once: ``x [R, P, backbone_hidden]`` (position 0 the
    backbone state, position p the embedding of code p - 1) -> final-normed ``[R, P, d]``, the
    values ``DepthDecoder.step`` gives position by position."""
    rows, num_pos = x.shape[0], x.shape[1]
    cos, sin = depth.rope.cos_sin(torch.arange(num_pos, device=x.device), x.dtype)  # [P, D]
    h = depth.model.inputs_embeds_projector(x)  # [R, P, d]
    for layer in depth.model.layers:
        attn = layer.self_attn
        q, k, v = attn.project(layer.input_layernorm(h))
        q = apply_rope(q.view(rows, num_pos, attn.num_heads, attn.head_dim), cos, sin)
        k = apply_rope(k.view(rows, num_pos, attn.num_kv_heads, attn.head_dim), cos, sin)
        v = v.view(rows, num_pos, attn.num_kv_heads, attn.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=attn.num_heads != attn.num_kv_heads)  # [R, H, P, D]
        h = h + attn.o_proj(out.transpose(1, 2).reshape(rows, num_pos, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return depth.model.norm(h)


class PhonemeHeads(torch.nn.Module):
    """Training-only linear read-outs of the teacher's phonemes (``lm_data.PHONEME_CLASSES``):
    ``frame`` from the backbone state that predicts a frame's code 0 (so code 0 carries what
    is said, frame by frame, from the durations), ``ctc`` from each prompt row the text
    encoder gives the backbone (so the text rows carry the phonemes in order; class 0 is the
    blank)."""

    def __init__(self, hidden: int, classes: int = PHONEME_CLASSES) -> None:
        super().__init__()
        self.frame = torch.nn.Linear(hidden, classes)
        self.ctc = torch.nn.Linear(hidden, classes)


@dataclass
class ForwardOut:
    code0_logits: Tensor  # [sum(T + 1), 2052] fp32: frames 0..T-1, then the EOS row
    code0_targets: Tensor  # [sum(T + 1)]
    is_eos_row: Tensor  # [sum(T + 1)] bool
    depth_logits: Tensor  # [sum T, 15, vocab] fp32
    depth_targets: Tensor  # [sum T, 15]
    guided: Tensor  # scalar (0 when no layer is guided)
    eos_rows: Tensor  # [B] long: where ``is_eos_row`` is set (an index: a mask reads back)
    phoneme_frame: Tensor | None = None  # scalar: frame phoneme cross-entropy
    phoneme_ctc: Tensor | None = None  # scalar: CTC of the prompt rows (per target phoneme)


def teacher_forced(model: BreezeModel, batch: Sequence[Utterance], guided_layers: Sequence[int],
                   sigma: float, phoneme_heads: PhonemeHeads | None = None) -> ForwardOut:
    """Runs prompt + frames of every utterance through text encoder, backbone and depth; with
    ``phoneme_heads`` and every utterance carrying phonemes, scores them too."""
    device = model.lm_head.weight.device
    # Every index is made on the host and uploaded through pinned memory before the forward
    # is queued (a pageable copy or a boolean mask in the middle of it waited for the GPU); the
    # guided prior's lengths go the same way at its first layer (``_prior``).
    if any(u.codes.device.type != "cpu" for u in batch):
        raise ValueError("teacher_forced: utterance codes must be CPU tensors (uploaded here)")
    frame_lens = [int(u.codes.shape[0]) for u in batch]
    all_codes = upload(torch.cat([u.codes for u in batch]), device)  # [R, 16]
    text_rows = model.prompt_embeds_many([u.prompt for u in batch])  # B x [L, D]
    frame_rows = model.audio_frame_embeds(all_codes).split(frame_lens)
    rows = [torch.cat([t, f.to(t.dtype)]) for t, f in zip(text_rows, frame_rows)]
    x = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # [B, S, D]
    lay = Layout(torch.tensor([len(t) for t in text_rows]), torch.tensor(frame_lens), x.shape[1])
    starts = torch.arange(lay.batch_size) * lay.seq_len + lay.prompt_lens - 1  # row of frame 0
    pred_rows = torch.cat([s + torch.arange(n + 1) for s, n in zip(starts.tolist(), frame_lens)])
    is_eos_cpu = torch.cat([torch.arange(n + 1) == n for n in frame_lens])
    eos = torch.full((1,), FRAME_EOS_ID, dtype=torch.long)
    targets0 = upload(torch.cat([torch.cat([u.codes[:, 0], eos]) for u in batch]), device)
    is_eos, pred_rows = upload(is_eos_cpu, device), upload(pred_rows, device)
    eos_rows = upload(is_eos_cpu.nonzero().flatten(), device)
    frame_pred = upload((~is_eos_cpu).nonzero().flatten(), device)
    attn = TrainAttention(lay, guided_layers, sigma)
    positions = torch.arange(lay.seq_len, device=device).repeat(lay.batch_size)
    hidden = model.backbone_model(x.reshape(-1, x.shape[-1]), positions, attn)  # [B*S, D]

    h_pred = hidden[pred_rows]  # [sum(T+1), D]
    with torch.autocast(device.type, enabled=False):
        logits0 = model.first_code_logits(h_pred.float())

    depth = model.depth_decoder
    vocab, num_books = depth.cfg.vocab_size, depth.cfg.num_codebooks
    offsets = torch.arange(num_books - 1, device=device) * vocab
    code_rows = depth.model.embed_tokens(all_codes[:, : num_books - 1] + offsets)  # [R, 15, D]
    h_frames = h_pred[frame_pred]  # the state that predicted code 0 of each frame
    depth_in = torch.cat([h_frames[:, None], code_rows.to(h_frames.dtype)], dim=1)  # [R, 16, D]
    hd = depth_hidden(depth, depth_in)[:, 1:]  # [R, 15, d]: position j gives codebook j
    with torch.autocast(device.type, enabled=False):
        heads = depth.codebooks_head.weight.float()  # [15, d, vocab]
        depth_logits = torch.einsum("rjd,jdv->rjv", hd.float(), heads)
    guided = torch.stack(attn.guided_losses).mean() if attn.guided_losses else hidden.new_zeros(())
    out = ForwardOut(logits0, targets0, is_eos, depth_logits, all_codes[:, 1:], guided.float(),
                     eos_rows)
    if phoneme_heads is not None and all(u.frame_phonemes is not None and u.phonemes is not None
                                         for u in batch):
        out.phoneme_frame, out.phoneme_ctc = _phoneme_losses(phoneme_heads, batch, h_frames,
                                                             text_rows)
    return out


def _phoneme_losses(heads: PhonemeHeads, batch: Sequence[Utterance], h_frames: Tensor,
                    text_rows: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    device = h_frames.device
    targets = upload(torch.cat([u.frame_phonemes for u in batch]), device)  # [R]
    with torch.autocast(device.type, enabled=False):
        frame = F.cross_entropy(heads.frame(h_frames.float()), targets)
        rows = torch.nn.utils.rnn.pad_sequence([t.float() for t in text_rows])  # [L, B, D]
        log_probs = heads.ctc(rows).log_softmax(-1)
        # a prompt shorter than its phonemes (CTC needs at least one row each) adds 0; the
        # lengths go up with the targets (torch's CUDA CTC copied them back and forth, a sync)
        phonemes = torch.nn.utils.rnn.pad_sequence([u.phonemes for u in batch], batch_first=True)
        lengths = torch.tensor([[len(t) for t in text_rows], [len(u.phonemes) for u in batch]])
        input_lengths, target_lengths = upload(lengths, device).unbind()
        ctc = ctc_loss(log_probs, upload(phonemes, device), input_lengths, target_lengths)
    return frame, ctc


def losses(out: ForwardOut) -> dict[str, Tensor]:
    """Mean cross-entropies: code 0 over frames and EOS rows together, EOS rows alone, depth."""
    ce0 = F.cross_entropy(out.code0_logits, out.code0_targets, reduction="none")
    depth = F.cross_entropy(out.depth_logits.flatten(0, 1), out.depth_targets.flatten())
    parts = {"code0": ce0.mean(), "eos": ce0[out.eos_rows].mean(), "depth": depth,
             "guided": out.guided}
    if out.phoneme_frame is not None:
        parts.update(phoneme_frame=out.phoneme_frame, phoneme_ctc=out.phoneme_ctc)
    return parts
