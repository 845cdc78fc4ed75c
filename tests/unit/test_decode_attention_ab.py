"""``bench/decode_attention_ab.py`` on the CPU (Triton's interpreter, small heads): every launch
shape of the served tensor-core kernel and of the elementwise kernel it replaced computes the
DECODE attention of a paged cache within bf16 rounding of an fp32 reference; the verdict marks a
variant further from the reference than the served one; every default variant builds for sm_90a
within Hopper's limits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_every_variant_matches_the_fp32_reference(tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO / "runtime"), str(REPO / "bench"), str(REPO)])}
    variants = "32/128/4,16/32/4,16/64/2,64/64/8,dot:16/32/4/2,dot:32/64/4/3,dot:64/64/8/1"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "decode_attention_ab.py"), "--rows", "2,3",
         "--contexts", "48,96", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
         "--variants", variants, "--out", str(out)],
        env=env, timeout=300, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["git_commit"] and doc["date"]
    assert (doc["serving"], doc["before"]) == ("dot:64/256/4/3", "32/128/4")
    rows = doc["results"]
    assert {(r["rows"], r["context"]) for r in rows} == {(2, 48), (2, 96), (3, 48), (3, 96)}
    assert {r["variant"] for r in rows} == {*variants.split(","), "dot:64/256/4/3"}
    for r in rows:
        assert r["max_abs_diff_vs_fp32"] < 5e-3, r
        assert r["max_abs_diff_vs_serving"] < 5e-3, r
        assert r["wrong"] is False
        assert "ms" not in r  # the interpreter times nothing
        # K and V of every cached token (lengths in [context/2, context)), bf16
        assert r["context"] // 2 * r["rows"] * 2 * 32 * 2 * 2 <= r["kv_bytes"]
        assert r["kv_bytes"] < r["context"] * r["rows"] * 2 * 32 * 2 * 2


def test_a_variant_off_the_reference_is_marked_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    ab = _module()
    case = ab.Case(2, 32, 4, 2, 16, "cpu")
    exact = case.reference().to(torch.bfloat16)

    def launch(kernel: str, bt: int, split: int, warps: int, stages: int | None) -> None:
        off = (kernel, bt, split, warps) == ("elementwise", 64, 64, 8)  # the others exact
        case.out.copy_(exact + (0.05 if off else 0.0))

    monkeypatch.setattr(case, "launch", launch)
    rows = {r["variant"]: r for r in ab.measure(case, ["32/128/4", "dot:16/32/4/2", "64/64/8"],
                                                 timed=False)}
    assert list(rows) == [ab.SERVING, "32/128/4", "dot:16/32/4/2", "64/64/8"]  # served first
    assert not any(rows[v]["wrong"] for v in (ab.SERVING, "32/128/4", "dot:16/32/4/2"))
    assert rows["64/64/8"]["wrong"] is True
    assert rows["64/64/8"]["max_abs_diff_vs_serving"] == pytest.approx(0.05, abs=1e-2)


def test_variant_names() -> None:
    ab = _module()
    assert ab.parse_variant("32/128/4") == ("elementwise", 32, 128, 4, None)
    assert ab.parse_variant("dot:64/256/8/3") == ("dot", 64, 256, 8, 3)
    assert ab.SERVING == "dot:64/256/4/3"  # fused_decode's served shape


def _module():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import decode_attention_ab as ab
    finally:
        sys.path.remove(str(REPO / "bench"))
    return ab


@pytest.mark.parametrize("text", ["32/128", "24/128/4", "32/100/4", "32/128/3", "a/b/c",
                                  "dot:32/128/4", "dot:8/64/4/2", "dot:64/256/4/9",
                                  "wgmma:64/256/4/3"])
def test_a_shape_the_kernel_cannot_take_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="variant"):
        _module().parse_variant(text)


def test_every_default_variant_builds_for_sm90(tmp_path: Path) -> None:
    """The full-size kernels (16 query heads, 8 KV heads, head_dim 128) build for the H200 here:
    a shape the compiler refuses or one past Hopper's per-block limits fails now, not in a
    device call."""
    from tests.kernel_helpers import run_compile_only

    out = tmp_path / "builds.json"
    run_compile_only(tmp_path, "decode_attention_ab.py", "--out", str(out), timeout_s=600)
    builds = {b["variant"]: b for b in json.loads(out.read_text())["builds"]}
    assert set(builds) >= {"32/128/4", "dot:64/256/4/3"}
    for name, b in builds.items():
        assert b["problems"] == [] and b["local_bytes"] == 0, (name, b)
        assert (b["mma"] > 0) == name.startswith("dot:"), (name, b)  # the dots on tensor cores
