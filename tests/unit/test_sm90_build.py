"""Every fused Triton kernel variant the engine can select builds for the H200 (sm_90) within
Hopper's per-block limits, and each module's ``warm()`` builds every variant its serving shapes
launch (tests/sm90_build.py: built, never run, on this GPU-less machine)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.kernel_helpers import REPO, needs_triton, sm90_build_env

pytestmark = pytest.mark.unit

# What a config or the tuning script can select, in two halves of about equal build time (the
# two halves build side by side: ~2 min of builds in one process on two cores).
SELECTABLE = (["depth by-rows", "depth by-rows qkv-split-2", "decode", "text encoder pdl",
               "snake", "prefill", "codec attention", "depth by-rows prenorm inline pdl"],
              ["depth by-rows pdl", "decode pdl", "text encoder", "text encoder pdl wide",
               "depth by-rows prenorm pdl", "depth draw"])


@needs_triton
def test_every_selectable_kernel_builds_for_sm90_within_hopper_limits(tmp_path) -> None:
    from tests.sm90_build import Built

    env = sm90_build_env(tmp_path)
    outs = [tmp_path / f"builds-{i}.json" for i in range(len(SELECTABLE))]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.sm90_build", "--json", str(out),
                               *half], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for out, half in zip(outs, SELECTABLE)]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
        print(stdout)
    reports = [r for out in outs for r in json.loads(out.read_text())["variants"]]
    assert [r["variant"] for r in reports] == [v for half in SELECTABLE for v in half]
    for report in reports:
        builds = [Built(**{k: v for k, v in b.items() if k != "blocks_per_sm"})
                  for b in report["builds"]]
        assert builds, f"{report['variant']}: nothing was built"
        failing = {b.kernel: b.problems() for b in builds if b.problems()}
        assert not failing, f"{report['variant']}: would not launch on an H200: {failing}"
        assert not report["not_warmed"], (
            f"{report['variant']}: warm() leaves {report['not_warmed']} to be built mid-serving")
