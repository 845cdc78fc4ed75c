"""``bench/pack_pngs.py``: result plots as palette PNGs, drawn as before, and the tree's plots
kept small (the tracked tree travels with every device call)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tests.bench_scripts import bench_script

pytestmark = pytest.mark.unit

pack = bench_script("pack_pngs")


def _figure_png() -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    x = np.linspace(0, 10, 200)
    for k, ax in enumerate(axes):
        for j in range(4):
            ax.plot(x, np.sin(x + j) * (k + 1), label=f"run {j}", linestyle="--" if j % 2 else "-")
        ax.set_yscale("symlog")
        ax.legend()
        ax.set_title("TTFB p50 / p95 (ms)")
    fig.suptitle("NVIDIA H200 · torch · commit")
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=110)
    plt.close(fig)
    return out.getvalue()


def test_a_packed_figure_is_a_smaller_palette_png_drawn_as_before() -> None:
    original = _figure_png()
    packed = pack.packed(original)
    assert packed is not None and len(packed) < len(original)
    before, after = Image.open(io.BytesIO(original)), Image.open(io.BytesIO(packed))
    assert after.mode == "P" and after.size == before.size
    diff = np.abs(np.asarray(before.convert("RGB"), dtype=np.int16)
                  - np.asarray(after.convert("RGB"), dtype=np.int16))
    assert diff.mean() <= pack.MAX_MEAN_ERROR
    assert pack.packed(packed) is None  # packed once: left alone


def test_the_trees_plots_are_small_or_packed() -> None:
    """Every tracked plot under bench/results is at most ``MAX_BYTES`` or already a palette
    PNG: run ``bench/pack_pngs.py`` before committing a new one."""
    loose = [p.name for p in pack.tracked_plots()
             if p.stat().st_size > pack.MAX_BYTES and Image.open(p).mode != "P"]
    assert not loose, f"pack them: .venv/bin/python bench/pack_pngs.py ({loose})"
