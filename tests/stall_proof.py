"""Proof that the real-time checks go red when the agent is late: ``make test-stall``.

    PYTHONPATH=runtime:. .venv/bin/python -m tests.stall_proof [--stall-ms 150]

Runs the room, SIP and WebRTC real-time checks once each with ``BREEZERT_INJECT_STALL_MS``
(``breezert.async_engine``'s test hook: every engine request's audio held that long after its
first chunk, in the test process and in the room worker it starts) and reads their JUnit XML:
each must FAIL, on a real-time miss (``NotRealTime`` / ``LatencyMiss``: a gap, a late tick, a
short or long turn), not on anything else. Exits 0 when every check went red that way, 1 when
one passed or failed for another reason. The same checks pass in ``make test`` without the stall.
Not a test module: each check takes a LiveKit server, a worker and a call (about 3 minutes).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECKS = {
    "room": "tests/livekit/test_room_python.py::"
            "test_turn_reaches_the_listener_whole_and_steers_the_predictor",
    "SIP": "tests/livekit/test_sip.py::test_a_call_hears_the_agents_greeting_whole[PCMU-24000]",
    "WebRTC": "tests/integration/test_server_webrtc.py::test_opus_turn_first_audio_then_cancel",
}
MISSES = ("NotRealTime", "LatencyMiss")


def run(name: str, node: str, stall_ms: int) -> tuple[bool, str]:
    """Runs ``node`` with the stall: (went red on a real-time miss, what happened)."""
    with tempfile.TemporaryDirectory() as folder:
        junit = Path(folder) / "junit.xml"
        env = {**os.environ, "BREEZERT_INJECT_STALL_MS": str(stall_ms),
               "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), str(REPO / "bench"),
                                              str(REPO), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"--junitxml={junit}", node], cwd=REPO, env=env, check=False,
                       capture_output=True)
        if not junit.exists():
            return False, "pytest wrote no report"
        case = ET.parse(junit).getroot().find(".//testcase")
    if case is None:
        return False, "no test ran"
    failure = case.find("failure")
    if failure is None:
        skipped = case.find("skipped")
        return False, ("skipped: " + (skipped.get("message") or "")) if skipped is not None \
            else "PASSED with the stall"
    message = failure.get("message") or ""
    return any(kind in message for kind in MISSES), message[:400]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stall-ms", type=int, default=150)
    parser.add_argument("--only", choices=list(CHECKS), action="append")
    args = parser.parse_args(argv)
    red = True
    for name in args.only or list(CHECKS):
        ok, what = run(name, CHECKS[name], args.stall_ms)
        red &= ok
        print(f"{name}: {'red on a real-time miss' if ok else 'NOT RED AS EXPECTED'}: {what}",
              flush=True)
    return 0 if red else 1


if __name__ == "__main__":
    raise SystemExit(main())
