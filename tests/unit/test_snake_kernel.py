"""The fused SnakeBeta + history kernel (kernels/snake.py) against the eager arithmetic, on CPU
through Triton's interpreter (tests/gpu checks it compiled, inside the whole codec)."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_helpers import needs_triton, run_in_interpreter

pytestmark = pytest.mark.unit


def check(history: int, dtype: str, rows: int = 2, channels: int = 3, width: int = 1050) -> None:
    from breezert.kernels.snake import snake_cat_reference, snake_cat_triton

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    # strided rows (x is a slice of wider rows); 1050 columns: each row spans program blocks,
    # 7 x 5 rows of 9: each program spans rows
    x = (torch.randn(rows, channels, width + 50) * 2).to(dt)[:, :, 50:]
    hist = torch.randn(rows, channels, history).to(dt) if history else None
    log_alpha, log_beta = torch.randn(channels) * 0.1, torch.randn(channels) * 0.1
    got = snake_cat_triton(x, log_alpha, log_beta, hist)
    want = snake_cat_reference(x.float(), log_alpha, log_beta,
                               None if hist is None else hist.float()).to(dt)
    assert got.shape == (rows, channels, history + width) and got.dtype == dt
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dt]  # 16-bit: ~2 ulps
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    if hist is not None:
        assert torch.equal(got[..., :history], hist)  # the history is copied, not recomputed


@needs_triton
@pytest.mark.parametrize("history,dtype,shape", [
    (0, "float32", (2, 3, 1050)), (54, "float32", (2, 3, 1050)), (6, "bfloat16", (2, 3, 1050)),
    (6, "float16", (2, 3, 1050)), (6, "float32", (7, 5, 9)), (0, "float32", (7, 5, 9))])
def test_snake_cat_matches_eager(history: int, dtype: str, shape: tuple[int, int, int]) -> None:
    run_in_interpreter(__name__, f"check({history}, {dtype!r}, *{shape})")
