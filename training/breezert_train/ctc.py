"""CTC loss that never waits for the host: the forward (alpha) recursion in log space on the device.

Owns: ``ctc_loss``, the value of ``F.ctc_loss(..., blank=0, reduction="mean",
zero_infinity=True)`` computed by tensor ops whose shapes come from the inputs' shapes only
(gradients by autograd through the recursion). Torch's native CUDA CTC copies its per-sample
offsets host -> device and back (10 host syncs in an LM step on the H200), so the training step
uses this one. Must not: read a device value on the host (``.item()``, ``.tolist()``, boolean
masks, ``nonzero``), or know the model or the data.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

BLANK = 0
"""The blank class."""
LOG_ZERO = -1e30
"""``log 0`` kept finite: with ``-inf`` a state that no path reaches makes logsumexp's backward
NaN (``exp(-inf - -inf)``); an infeasible sample is found from the lengths instead."""


def ctc_loss(log_probs: Tensor, targets: Tensor, input_lengths: Tensor,
             target_lengths: Tensor) -> Tensor:
    """``F.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0,
    reduction="mean", zero_infinity=True)``: each sample's negative log-likelihood divided by its
    target length (at least 1), averaged over the batch; a sample whose input is too short for
    its targets (one row per label, one more between repeated labels) adds 0 and no gradient.

    Args:
        log_probs: ``[T, B, C]`` float, finite (a ``log_softmax``), class 0 the blank; rows
            past a sample's length are ignored.
        targets: ``[B, L]`` long, padded (the values past a sample's length are ignored).
        input_lengths: ``[B]`` long, on ``log_probs``'s device, each 1..T.
        target_lengths: ``[B]`` long, on the same device, each 0..L.
    """
    num_steps, batch, _ = log_probs.shape
    max_len = targets.shape[1]
    num_states = 2 * max_len + 1  # blank, label 1, blank, ..., label L, blank
    ext = targets.new_full((batch, num_states), BLANK)
    ext[:, 1::2] = targets
    # T x [B, S]; unbound once, so the backward stacks their gradients once (indexing ``emit[t]``
    # made each step's backward fill and add a whole [T, B, S] gradient)
    emit = log_probs.gather(2, ext.expand(num_steps, -1, -1)).unbind(0)
    # a label state may come from two states back unless that is the same label (or it is blank)
    can_skip = torch.zeros_like(ext, dtype=torch.bool)
    can_skip[:, 2:] = (ext[:, 2:] != BLANK) & (ext[:, 2:] != ext[:, :-2])
    skip_bias = torch.zeros_like(emit[0]).masked_fill(~can_skip, LOG_ZERO)  # [B, S]
    state = torch.arange(num_states, device=ext.device)
    alpha = emit[0].masked_fill(state >= 2, LOG_ZERO)  # [B, S]: start at blank or label 1
    alphas = [alpha]
    for t in range(1, num_steps):
        prev = F.pad(alpha, (2, 0), value=LOG_ZERO)  # [B, S + 2]: prev[:, s + 2] is alpha[s]
        alpha = torch.stack([alpha, prev[:, 1:-1], prev[:, :-2] + skip_bias]).logsumexp(0) \
            + emit[t]
        alphas.append(alpha)
    # each sample's alpha at its last row (the rows after it only extend the padding)
    last = (input_lengths - 1).clamp(min=0).view(1, batch, 1).expand(1, batch, num_states)
    final = torch.stack(alphas).gather(0, last)[0]  # [B, S]
    ends = torch.stack([2 * target_lengths, 2 * target_lengths - 1], dim=1)  # blank, label L
    end_alpha = final.gather(1, ends.clamp(min=0)).masked_fill(ends < 0, LOG_ZERO)  # [B, 2]
    nll = -end_alpha.logsumexp(1)  # [B]
    per_sample = torch.where(_feasible(targets, input_lengths, target_lengths), nll, 0.0)
    return (per_sample / target_lengths.clamp(min=1)).mean()


def _feasible(targets: Tensor, input_lengths: Tensor, target_lengths: Tensor) -> Tensor:
    """``[B]`` bool: the input has a row per label and one more per repeated label (the blank
    between them); otherwise no path exists and torch's loss is infinite."""
    pos = torch.arange(targets.shape[1], device=targets.device)[1:]
    repeats = ((targets[:, 1:] == targets[:, :-1]) & (pos < target_lengths[:, None])).sum(1)
    return input_lengths >= target_lengths + repeats
