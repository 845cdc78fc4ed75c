"""Where a benchmark ran: machine, software, commit and date, recorded with every result.

Owns the one reading of the git commit (and of the GPU, torch and CUDA versions, CPU and load)
for ``breezert-bench`` and for the scripts under ``bench/``. Must not: import torch at import
(a remote run needs none) or fail a benchmark over missing metadata (unknown values are
recorded as ``None`` or ``"unknown"``).
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

COMMIT_ENV = "BREEZERT_GIT_COMMIT"
"""The commit to record where the tree is a copy whose ``.git`` is absent or stale (the device
machine; ``bench/h200_session.sh`` sets it)."""


def repo_root() -> Path:
    """The checkout holding this package (``bench/breezert_bench`` → two levels up)."""
    return Path(__file__).resolve().parents[2]


def git_commit() -> tuple[str, bool | None]:
    """The short commit and whether the tree has uncommitted changes (``None``: not known).
    ``BREEZERT_GIT_COMMIT`` wins over ``git``."""
    if commit := os.environ.get(COMMIT_ENV):
        return commit, None
    root = str(repo_root())
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True)
        status = subprocess.run(["git", "-C", root, "status", "--porcelain"],
                                capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown", None
    return head.stdout.strip() or "unknown", bool(status.stdout.strip())


def load_avg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _torch_facts(device: str | None) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"gpu": None, "torch_version": None, "cuda_version": None}
    cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    return {"gpu": torch.cuda.get_device_name(0) if cuda else None,
            "torch_version": torch.__version__, "cuda_version": torch.version.cuda}


def provenance(*, device: str | None = None, git_commit_override: str | None = None,
               **extra: Any) -> dict[str, Any]:
    """GPU, CPU, torch / CUDA / Python versions, commit, date and host of a run, then ``extra``.

    Args:
        device: The run's device (``"cpu"``, ``"cuda:0"``); ``None``: CUDA where available.
            ``gpu`` is recorded for a CUDA device only.
        git_commit_override: Record this commit instead (``breezert-bench --git-commit``).
        **extra: More fields of the run (they may replace the ones above).
    """
    commit, dirty = (git_commit_override, None) if git_commit_override else git_commit()
    return {
        **_torch_facts(device),
        "cpu": cpu_model(),
        "num_cpus": os.cpu_count(),
        "load_avg_1m": load_avg(),
        "python_version": platform.python_version(),
        "git_commit": commit,
        "git_dirty": dirty,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        **extra,
    }
