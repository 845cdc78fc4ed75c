"""What ``make test`` installs for the suite, and what a missing one means.

Owns ``missing`` and ``needs``: a real component the Makefile installs or builds (livekit-server,
livekit-sip, Redis, baresip, CAP_NET_RAW for the caller's capture, Chromium, node, the train
extras, triton where the Makefile adds it) that is not there. Under ``CI=true`` the test FAILS,
with the install or build log's last lines: a broken build must not turn into a green run with
fewer tests. Elsewhere (a developer's partial checkout) it skips with the same reason.

Must not: skip for anything that ``make test`` does not provide (CUDA is ``tests/conftest.py``'s).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import NoReturn

import pytest

REPO = Path(__file__).resolve().parents[1]
LOG_LINES = 25


def is_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def log_tail(log: Path | None, lines: int = LOG_LINES) -> str:
    """The last ``lines`` of ``log``, or why there are none."""
    if log is None:
        return ""
    if not log.exists():
        return f"\n(no log at {log}: make never tried)"
    text = log.read_text(errors="replace").splitlines()[-lines:]
    return f"\nlast {len(text)} lines of {log}:\n" + "\n".join(text)


def missing(what: str, make_target: str, log: Path | None = None) -> NoReturn:
    """``what`` (installed by ``make make_target``) is not there: fails under ``CI=true`` with
    ``log``'s last lines, skips elsewhere."""
    message = f"{what} (make {make_target} installs it){log_tail(log)}"
    print(f"MISSING: {message}")  # in the log too, not only in -rs
    if is_ci():
        pytest.fail(f"CI=true and the Makefile did not provide it: {message}", pytrace=False)
    pytest.skip(message)


def needs(*modules: str, binary: str | None = None, make_target: str = "install",
          provided: bool = True) -> pytest.MarkDecorator:
    """A marker for a test that needs ``modules`` (importable) and ``binary`` (on PATH), which
    ``make make_target`` provides where ``provided`` (e.g. triton only on Linux x86_64): skips
    while one is absent outside CI; under ``CI=true`` the test runs where the Makefile provides
    them, and fails on the absence itself."""
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    if binary is not None and shutil.which(binary) is None:
        absent.append(binary)
    if provided:
        reason = f"{', '.join(absent)} not installed (make {make_target} installs it)"
    else:
        reason = (f"{', '.join(absent)} not installed, and make {make_target} provides none on "
                  "this platform")
    return pytest.mark.skipif(bool(absent) and (not is_ci() or not provided), reason=reason)
