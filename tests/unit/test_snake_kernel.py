"""The fused SnakeBeta + history kernel (kernels/snake.py) against the eager arithmetic, on CPU
through Triton's interpreter (tests/gpu checks it compiled, inside the whole codec)."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_helpers import needs_triton, run_in_interpreter

pytestmark = pytest.mark.unit


def check(history: int, dtype: str) -> None:
    from breezert.kernels.snake import snake_cat_reference, snake_cat_triton

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    x = (torch.randn(2, 3, 1100) * 2).to(dt)[:, :, 50:]  # strided rows, 1050 columns (2 blocks)
    hist = torch.randn(2, 3, history).to(dt) if history else None
    log_alpha, log_beta = torch.randn(3) * 0.1, torch.randn(3) * 0.1
    got = snake_cat_triton(x, log_alpha, log_beta, hist)
    want = snake_cat_reference(x.float(), log_alpha, log_beta,
                               None if hist is None else hist.float()).to(dt)
    assert got.shape == (2, 3, history + 1050) and got.dtype == dt
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dt]  # 16-bit: ~2 ulps
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    if hist is not None:
        assert torch.equal(got[..., :history], hist)  # the history is copied, not recomputed


@needs_triton
@pytest.mark.parametrize("history,dtype", [(0, "float32"), (54, "float32"), (6, "bfloat16"),
                                           (6, "float16")])
def test_snake_cat_matches_eager(history: int, dtype: str) -> None:
    run_in_interpreter(__name__, f"check({history}, {dtype!r})")
