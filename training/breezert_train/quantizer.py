"""Training of the split residual quantizer: straight-through codes, commitment, EMA codebooks.

Owns: quantizing encoder embeddings with the encoder's own codebook buffers (Mimi's EMA layout,
``embed_sum / cluster_usage``, is the EMA state itself), data init of fresh codebooks, dead-code
restarts, the codebooks left out of a run with fewer active ones (every code vector zero, so each
frame's code there is 0 and adds nothing: the 16-codebook layout stays exact and the LM learns
them trivially), and copying the learned tensors into the decoder's quantizer. Must not: own
optimisers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from breezert.host_copy import upload
from breezert.models.codec import CodecDecoder
from breezert.models.codec_encoder import CodecEncoder, _Codebook, _ResidualVectorQuantizer


@dataclass(frozen=True)
class VQTrainConfig:
    """How the codebooks learn."""

    decay: float = 0.99
    """EMA decay of ``cluster_usage`` and ``embed_sum`` per step."""
    dead_ratio: float = 0.1
    """A code whose EMA usage falls below this fraction of the mean usage is restarted."""

    def __post_init__(self) -> None:
        if not 0.0 < self.decay < 1.0:
            raise ValueError(f"decay={self.decay} must be in (0, 1)")
        if not 0.0 <= self.dead_ratio < 1.0:
            raise ValueError(f"dead_ratio={self.dead_ratio} must be in [0, 1)")


@dataclass
class QuantizerOutput:
    latent: Tensor  # [B, codebook_dim, K] decoder-side latent (both groups, projected, summed)
    codes: Tensor  # [B, K, num_quantizers] int64, what ``CodecEncoder.encode`` would return
    commitment: Tensor  # scalar: mean over codebooks of ||residual - sg(code)||^2
    num_restarted: Tensor  # scalar int64 on x's device: codes restarted this step


def group_pairs(encoder: CodecEncoder, decoder: CodecDecoder):  # noqa: ANN201
    """``(encoder group, decoder group, number of codebooks)`` for the semantic then acoustic
    group: the same split as ``CodecDecoder.quantizer`` (``rvq_first`` / ``rvq_rest``)."""
    enc, dec = encoder.quantizer, decoder.quantizer
    return (
        (enc.semantic_residual_vector_quantizer, dec.rvq_first, dec.num_first),
        (enc.acoustic_residual_vector_quantizer, dec.rvq_rest,
         decoder.cfg.num_quantizers - dec.num_first),
    )


def mark_codebooks_fresh_(encoder: CodecEncoder, fresh: bool = True) -> None:
    """Fresh codebooks take their first vectors from the first batch they see; ``fresh=False``
    marks them trained (loaded from an export, which does not store the flag)."""
    for module in encoder.modules():
        if isinstance(module, _Codebook):
            module.initialized.fill_(0.0 if fresh else 1.0)
            _note_initialized(module, not fresh)


def _is_initialized(book: _Codebook) -> bool:
    """``book.initialized`` as a bool, read from the device only when that tensor was written
    since the last read: one GPU sync per codebook per step, 16 in all, stalled the training
    step's queue on CUDA. Kept as (the tensor itself, its version counter, the value), so an
    in-place write (``fill_``, a state-dict load) or a new tensor reads it again; this module's
    own writes record what they wrote (``_note_initialized``)."""
    flag = book.initialized
    seen = getattr(book, "_initialized_seen", None)
    if (not flag.is_inference() and seen is not None and seen[0] is flag
            and seen[1] == flag._version):
        return seen[2]
    value = bool(flag.item())
    _note_initialized(book, value)
    return value


def _note_initialized(book: _Codebook, value: bool) -> None:
    flag = book.initialized
    if not flag.is_inference():  # (inference tensors keep no version counter)
        book._initialized_seen = (flag, flag._version, value)  # the tensor: an id can recur


@torch.no_grad()
def _init_from_data_(book: _Codebook, x: Tensor, gen: torch.Generator) -> None:
    # x [N, dim]: rows drawn with replacement plus a little noise, so duplicates separate.
    if _is_initialized(book):
        return
    size = book.cluster_usage.shape[0]
    pick = upload(torch.randint(0, x.shape[0], (size,), generator=gen), x.device)
    noise = (upload(torch.randn(size, x.shape[1], generator=gen), x.device).to(x.dtype)
             * x.std().clamp(min=1e-6) * 0.01)
    book.embed_sum.copy_(x[pick] + noise)
    book.cluster_usage.fill_(1.0)
    book.initialized.fill_(1.0)
    _note_initialized(book, True)


@torch.no_grad()
def _ema_update_(book: _Codebook, x: Tensor, indices: Tensor, cfg: VQTrainConfig,
                 gen: torch.Generator) -> Tensor:
    """EMA of usage and sums for ``x [N, dim]`` assigned to ``indices [N]``, then restarts of
    dead codes from random rows of ``x``; returns how many were restarted. No host sync: the
    restart is a ``where`` over every code, so the RNG draws the same whatever dies."""
    size = book.cluster_usage.shape[0]
    # (not torch.bincount: on CUDA it reads the largest index back to size its output)
    counts = x.new_zeros(size).index_add_(0, indices, x.new_ones(indices.shape[0]))  # [size]
    sums = torch.zeros_like(book.embed_sum).index_add_(0, indices, x)  # [size, dim]
    book.cluster_usage.mul_(cfg.decay).add_(counts, alpha=1 - cfg.decay)
    book.embed_sum.mul_(cfg.decay).add_(sums, alpha=1 - cfg.decay)
    mean_usage = book.cluster_usage.mean()
    dead = book.cluster_usage < cfg.dead_ratio * mean_usage  # [size]
    pick = upload(torch.randint(0, x.shape[0], (size,), generator=gen), x.device)
    book.embed_sum.copy_(torch.where(dead[:, None], x[pick] * mean_usage, book.embed_sum))
    book.cluster_usage.copy_(torch.where(dead, mean_usage, book.cluster_usage))
    return dead.sum()


def _quantize_group(group: _ResidualVectorQuantizer, x: Tensor, num: int, cfg: VQTrainConfig,
                    gen: torch.Generator | None, active: int | None = None
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Residual VQ of ``x [B, hidden, K]`` with ``num`` codebooks, the first ``active`` of them
    coding (default all; the others give code 0 and nothing, see ``zero_inactive_codebooks_``);
    ``gen`` set = training."""
    active = num if active is None else active
    z = group.input_proj(x) if group.input_proj is not None else x  # [B, dim, K]
    b, d, k = z.shape
    flat = z.permute(0, 2, 1).reshape(b * k, d)  # [N, dim]
    residual, summed = flat, torch.zeros_like(flat)
    commitment, codes = flat.new_zeros(()), []
    restarted = torch.zeros((), dtype=torch.long, device=flat.device)
    for vq in group.layers[:active]:
        book = vq.codebook
        if gen is not None:
            _init_from_data_(book, residual.detach(), gen)
        indices, quantized = book.encode(residual.detach())  # [N], [N, dim]
        commitment = commitment + F.mse_loss(residual, quantized)
        if gen is not None:
            restarted = restarted + _ema_update_(book, residual.detach(), indices, cfg, gen)
        summed = summed + quantized
        residual = residual - quantized
        codes.append(indices.view(b, k))
    codes += [torch.zeros(b, k, dtype=torch.long, device=flat.device)] * (num - active)
    # Straight-through: the forward value is the codes' sum, the gradient is the identity.
    out = flat + (summed - flat).detach()
    commitment = commitment / max(active, 1)
    return out.view(b, k, d).permute(0, 2, 1), torch.stack(codes, -1), commitment, restarted


def group_active(decoder: CodecDecoder, active: int | None) -> tuple[int, int]:
    """How many of the semantic and of the acoustic group's codebooks code when the first
    ``active`` of all 16 do (None: all)."""
    total, first = decoder.cfg.num_quantizers, decoder.quantizer.num_first
    active = total if active is None else active
    if not first <= active <= total:
        raise ValueError(f"active codebooks {active}: choose {first}..{total}")
    return first, active - first


def quantize(encoder: CodecEncoder, decoder: CodecDecoder, x: Tensor, cfg: VQTrainConfig,
             gen: torch.Generator | None = None, active: int | None = None) -> QuantizerOutput:
    """Split RVQ of encoder embeddings ``x [B, hidden, K]`` into the decoder's latent.

    Both groups quantize the same ``x`` (Mimi's split); each group's sum goes through the
    decoder's ``output_proj``. With ``gen`` the codebooks learn (init, EMA, restarts). Only the
    first ``active`` codebooks code (None: all); the codes of the others are 0."""
    latent, codes = None, []
    commitment = x.new_zeros(())
    restarted = torch.zeros((), dtype=torch.long, device=x.device)
    pairs = group_pairs(encoder, decoder)
    for (enc_group, dec_group, num), act in zip(pairs, group_active(decoder, active),
                                                strict=True):
        q, c, commit, n = _quantize_group(enc_group, x, num, cfg, gen, act)
        proj = dec_group.output_proj(q)  # [B, codebook_dim, K]
        latent = proj if latent is None else latent + proj
        codes.append(c)
        commitment, restarted = commitment + commit, restarted + n
    return QuantizerOutput(latent, torch.cat(codes, -1), commitment / len(pairs), restarted)


@torch.no_grad()
def zero_inactive_codebooks_(encoder: CodecEncoder, decoder: CodecDecoder, active: int) -> None:
    """Every code vector of the codebooks past the first ``active`` becomes zero (usage 1, marked
    initialised), in the encoder and the decoder: ``CodecEncoder.encode`` then gives code 0
    there (all distances tie; the first wins) and any code the LM draws there decodes to
    nothing."""
    for (enc_group, dec_group, num), act in zip(group_pairs(encoder, decoder),
                                                group_active(decoder, active), strict=True):
        for enc_vq, dec_vq in list(zip(enc_group.layers[:num], dec_group.vq.layers,
                                       strict=True))[act:]:
            enc_vq.codebook.embed_sum.zero_()
            enc_vq.codebook.cluster_usage.fill_(1.0)
            enc_vq.codebook.initialized.fill_(1.0)
            _note_initialized(enc_vq.codebook, True)
            dec_vq._codebook.embedding_sum.zero_()
            dec_vq._codebook.cluster_usage.fill_(1.0)


@torch.no_grad()
def sync_decoder_quantizer_(encoder: CodecEncoder, decoder: CodecDecoder) -> None:
    """Writes the learned codebooks and projections where the other module keeps its copy:
    codebooks and ``input_proj`` encoder -> decoder, ``output_proj`` decoder -> encoder, so
    both files' quantizers are the same tensors (as in the released tokenizer)."""
    for enc_group, dec_group, num in group_pairs(encoder, decoder):
        for enc_vq, dec_vq in zip(enc_group.layers[:num], dec_group.vq.layers, strict=True):
            dec_vq._codebook.embedding_sum.copy_(enc_vq.codebook.embed_sum)
            dec_vq._codebook.cluster_usage.copy_(enc_vq.codebook.cluster_usage)
        if enc_group.input_proj is not None:
            dec_group.input_proj.weight.copy_(enc_group.input_proj.weight)
            enc_group.output_proj.weight.copy_(dec_group.output_proj.weight)
