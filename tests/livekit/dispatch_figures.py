"""The dispatch tests' figures, written as JSON when ``BREEZERT_DISPATCH_RESULTS`` names a file.

Owns: the figures dict the dispatch tests fill (one entry per test), and writing it with the
commit, date and machine. Not a test module.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FIGURES: dict[str, Any] = {}
"""Test name -> its figures; each dispatch test adds its own."""


def _git(*args: str) -> str:
    result = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                            check=False)
    return result.stdout.strip()


def write_figures() -> Path | None:
    """Merges ``FIGURES`` into ``$BREEZERT_DISPATCH_RESULTS`` (each module adds its tests)."""
    target = os.environ.get("BREEZERT_DISPATCH_RESULTS")
    if not target or not FIGURES:
        return None
    path = Path(target)
    body: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    changed = [line for line in _git("status", "--porcelain").splitlines()
               if not line.endswith(path.name)]  # the figures file itself does not count
    body.setdefault("metadata", {}).update({
        "commit": _git("rev-parse", "--short", "HEAD"), "dirty": bool(changed),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "engine": "cpu-tiny (random tiny model, float32, 1 torch thread)",
    })
    body.setdefault("tests", {}).update(FIGURES)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=1) + "\n")
    return path
