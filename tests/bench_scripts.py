"""``bench_script``: a script under ``bench/`` imported as a module (``room``, ``room_listener``,
``room_scaleout``, ...), for the unit tests of its pure parts.

Owns: putting ``bench/`` on ``sys.path`` while the script (and the siblings it imports) is
imported, and only then. Must not: run a script's ``main`` or start anything. Not a test module.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_script(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
