"""``breezert_train.ctc.ctc_loss`` against torch's ``F.ctc_loss``, and its freedom from host syncs.

Owns CPU checks of the value and gradient (float64 and float32; varied input and target lengths,
repeated labels, an empty target, an input too short for its targets) and of the sync-free
construction: the loss and its backward run on fake tensors, which have shapes but no values.
Must not: need a GPU (``tests/gpu/test_gpu_host_syncs.py`` counts the LM step's real syncs).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from breezert_train.ctc import ctc_loss
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

pytestmark = pytest.mark.unit

NUM_CLASSES = 9
INPUT_LENGTHS = [15, 15, 11, 7, 4, 15, 2, 9]
TARGETS = [[5, 1, 8, 2, 2, 7], [3, 3, 3], [1, 2], [], [6, 6, 6], [4, 1, 4, 1], [7], [2, 3, 2, 3]]
"""Sample 4 needs 5 rows (3 labels, a blank between each repeated pair) and has 4: infeasible;
sample 3 has no label; 1 and 4 repeat one label."""


def _batch(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits ``[T, B, C]`` (the gradient is compared on them), padded targets, lengths."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(max(INPUT_LENGTHS), len(TARGETS), NUM_CLASSES, generator=gen,
                         dtype=dtype) * 2
    targets = torch.nn.utils.rnn.pad_sequence([torch.tensor(t, dtype=torch.long)
                                               for t in TARGETS], batch_first=True)
    return (logits.requires_grad_(), targets, torch.tensor(INPUT_LENGTHS),
            torch.tensor([len(t) for t in TARGETS]))


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_the_loss_and_its_gradient_equal_torchs(dtype: torch.dtype, tol: float) -> None:
    """The gradient is the logits' (through ``log_softmax``): torch's CTC backward returns
    ``exp(log_probs) - occupancy``, the gradient the logits get, not ``d loss / d log_probs``;
    through ``log_softmax``, as the training step uses it, the two are the same."""
    logits, targets, input_lengths, target_lengths = _batch(dtype)
    flat = torch.cat([targets[b, :n] for b, n in enumerate(target_lengths.tolist())])
    per_sample = F.ctc_loss(logits.log_softmax(-1), flat, input_lengths, target_lengths,
                            reduction="none")
    assert per_sample[4].isinf() and per_sample.isfinite().sum() == len(TARGETS) - 1
    want = F.ctc_loss(logits.log_softmax(-1), flat, input_lengths, target_lengths, blank=0,
                      reduction="mean", zero_infinity=True)
    (want_grad,) = torch.autograd.grad(want, logits)
    got = ctc_loss(logits.log_softmax(-1), targets, input_lengths, target_lengths)
    (got_grad,) = torch.autograd.grad(got, logits)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(got_grad, want_grad, rtol=tol, atol=tol)
    assert got_grad[:, 4].abs().max() == 0  # the infeasible sample: no gradient
    assert got_grad[INPUT_LENGTHS[2]:, 2].abs().max() == 0  # rows past a sample's length


def test_the_infeasible_sample_adds_nothing() -> None:
    logits, targets, input_lengths, target_lengths = _batch(torch.float64)
    keep = [b for b in range(len(TARGETS)) if b != 4]
    with_it = ctc_loss(logits.log_softmax(-1), targets, input_lengths, target_lengths)
    without = ctc_loss(logits[:, keep].log_softmax(-1), targets[keep], input_lengths[keep],
                       target_lengths[keep])
    torch.testing.assert_close(with_it * len(TARGETS), without * len(keep))


def test_a_batch_without_labels_scores_the_blanks() -> None:
    logits = torch.randn(5, 3, NUM_CLASSES, dtype=torch.float64, requires_grad=True)
    input_lengths, target_lengths = torch.tensor([5, 3, 1]), torch.zeros(3, dtype=torch.long)
    want = F.ctc_loss(logits.log_softmax(-1), torch.zeros(0, dtype=torch.long), input_lengths,
                      target_lengths, zero_infinity=True)
    got = ctc_loss(logits.log_softmax(-1), torch.zeros(3, 0, dtype=torch.long), input_lengths,
                   target_lengths)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(got, logits)[0],
                               torch.autograd.grad(want, logits)[0], rtol=1e-12, atol=1e-12)


def _on_shapes_only(fn: Callable[[], object]) -> None:
    """Runs ``fn`` on fake tensors: an op that needs a tensor's values on the host (``.item()``,
    ``.tolist()``, ``bool()``, Python ``max``, a boolean mask, ``nonzero``, a length read to
    size its output) raises. What it does not see: a bare copy to the host."""
    with FakeTensorMode():
        fn()


def _fake_step(loss: Callable[..., torch.Tensor]) -> Callable[[], object]:
    def step() -> object:
        logits = torch.randn(24, 6, NUM_CLASSES, requires_grad=True)
        targets = torch.randint(1, NUM_CLASSES, (6, 10))
        lengths = torch.randint(1, 11, (2, 6))
        loss(logits.log_softmax(-1), targets, lengths[0] + 14, lengths[1]).backward()
        return logits.grad
    return step


def test_the_loss_and_its_backward_need_no_value_on_the_host() -> None:
    _on_shapes_only(_fake_step(ctc_loss))


@pytest.mark.parametrize("syncing", [
    lambda lp, tg, il, tl: F.ctc_loss(lp, tg, il, tl, zero_infinity=True),
    lambda lp, tg, il, tl: ctc_loss(lp, tg, il, tl) * float(tl.max().item()),
    lambda lp, tg, il, tl: ctc_loss(lp[:max(il)], tg, il, tl),
    lambda lp, tg, il, tl: ctc_loss(lp, tg, il, tl) + lp[lp > 0].sum(),
], ids=["torch-ctc", "item", "python-max", "boolean-mask"])
def test_the_check_sees_a_read_back(syncing: Callable[..., torch.Tensor]) -> None:
    """The control: a check that saw nothing would pass the test above."""
    with pytest.raises((DataDependentOutputException, DynamicOutputShapeException)):
        _on_shapes_only(_fake_step(syncing))
