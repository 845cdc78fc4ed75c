"""Where the shared golden fixtures live, for every test under ``tests/golden/``.

Owns the single lookup rule (``BREEZE_GOLDEN_DIR`` else ``<repo>/../shared/breeze/golden``) and the
skip-or-fail policy when the folder is missing. Must not load or interpret any fixture.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def golden_dir() -> Path:
    """Returns the golden folder; skips the test if it is absent, or fails when ``CI=true``."""
    env = os.environ.get("BREEZE_GOLDEN_DIR")
    path = Path(env) if env else REPO_ROOT.parent / "shared" / "breeze" / "golden"
    if not path.is_dir():
        msg = f"golden fixtures not found at {path} (set BREEZE_GOLDEN_DIR to override)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return path
