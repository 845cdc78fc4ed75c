"""The demo page in headless Chromium, in a network namespace the test creates, against the server.

Owns: the browser path end to end: the page connects (host candidates only, no STUN), speaks a
sentence, and the test reads the first audible time (AnalyserNode onset on the page) and
``concealmentEvents`` (must not grow during speech), and checks that the page's 100 ms playout
stats reached ``report_playback``. Chromium runs in its own netns joined to the host by a veth
pair; without the privileges for that it falls back to loopback and says so. It is driven over
the DevTools protocol on a pipe (``breezert_bench.chromium``), so no port crosses namespaces.
Without a Chromium binary (``make chromium`` installs Debian's ``chromium``) it fails under
``CI=true`` with the install log's last lines, and skips elsewhere (``tests/components``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from breezert.async_engine import AsyncEngine
from breezert_bench.chromium import CHROMIUM_NAMES, chromium, find_chromium, open_page

from tests import latency
from tests.components import REPO, missing
from tests.integration._server import close_engine, make_engine, serve
from tests.latency import LatencyMiss
from tests.realtime import retried_when_starved

pytestmark = pytest.mark.integration

INSTALL_HINT = "apt-get install -y --no-install-recommends chromium"
CHROMIUM_LOG = REPO / ".cache" / "chromium-install.log"  # make chromium's apt output
SENTENCE = "Hello from BreezeRT in a headless browser."


PLOT_INK_JS = """(() => {
  breezert.drawPlots();
  const ink = (id, rgb) => {
    const c = document.getElementById(id), d = c.getContext("2d")
      .getImageData(0, 0, c.width, c.height).data;
    let n = 0;
    for (let i = 0; i < d.length; i += 4) {  // near the colour (lines are antialiased)
      const off = Math.abs(d[i] - rgb[0]) + Math.abs(d[i + 1] - rgb[1]) + Math.abs(d[i + 2] - rgb[2]);
      if (off < 90 && d[i + 3] > 100) n++;
    }
    return n;
  };
  return {bufferPlot: ink("bufferPlot", [0x44, 0xaa, 0x88]),
          firstPlot: ink("firstPlot", [0x22, 0xaa, 0x77])};
})()"""
"""Pixels of the buffer line's and the heard-first-audio bars' colours on the two canvases."""


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    engine = make_engine()
    yield engine
    close_engine(engine)


# ----------------------------------------------------------------------------- network namespace


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextlib.contextmanager
def network_namespace() -> Iterator[tuple[list[str], str]]:
    """Yields (command prefix that runs inside the namespace, host address the page dials).

    Creates netns ``brz<pid>`` with a veth pair 10.213.N.1 (host) <-> 10.213.N.2 (namespace).
    Falls back to ([], "127.0.0.1") with a printed notice when that is not permitted.
    """
    pid = os.getpid() % 100000
    ns, host_if, ns_if = f"brz{pid}", f"brzh{pid}", f"brzn{pid}"
    subnet = f"10.213.{pid % 250}"
    try:
        _ip("netns", "add", ns)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or str(exc)
        print(f"\nnetwork namespace not available ({detail!r}); falling back to loopback")
        yield [], "127.0.0.1"
        return
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"{subnet}.1/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"{subnet}.2/30", "dev", ns_if)
        _ip("-n", ns, "link", "set", ns_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        print(f"\nChromium runs in netns {ns} ({subnet}.2) via veth to the server at {subnet}.1")
        yield ["ip", "netns", "exec", ns], f"{subnet}.1"
    finally:
        with contextlib.suppress(Exception):
            _ip("link", "del", host_if)  # deletes both ends
        with contextlib.suppress(Exception):
            _ip("netns", "del", ns)


# ----------------------------------------------------------------------------- the test


@retried_when_starved(LatencyMiss)
async def test_demo_page_speaks_without_concealment(engine: AsyncEngine, monkeypatch) -> None:
    binary = find_chromium()
    if binary is None:
        missing(f"no Chromium binary ({', '.join(CHROMIUM_NAMES)}) on PATH; install it with: "
                f"{INSTALL_HINT}", "chromium", CHROMIUM_LOG)
    reports: list[tuple[float, str]] = []
    real = engine.report_playback

    def record(request_id: str, buffered_s: float, measured_at: float, source: str) -> None:
        reports.append((buffered_s, source))
        real(request_id, buffered_s, measured_at, source)

    monkeypatch.setattr(engine, "report_playback", record)
    options = {"max_frames": 25, "ignore_eos": True}  # 2 s of speech
    with network_namespace() as (prefix, host):
        async with serve(engine, host=host, request_options=options) as (url, _), \
                chromium(binary, prefix) as devtools:
            session = await open_page(devtools, f"{url}/", "typeof window.breezert === 'object'")
            await devtools.evaluate(session, "breezert.connect()", await_promise=True)
            await asyncio.sleep(0.5)  # let the jitter buffer settle on the silence stream
            await devtools.evaluate(session, f"breezert.speak({json.dumps(SENTENCE)})",
                                    await_promise=True)
            state: dict[str, Any] = {}
            for _ in range(150):
                state = await devtools.evaluate(session, "breezert.state")
                if state["turnDone"] is not None:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.4)  # the tail plays out and two more playout reports go up
            state = await devtools.evaluate(session, "breezert.state")
            inked = await devtools.evaluate(session, PLOT_INK_JS)
            shot = os.environ.get("BREEZERT_DEMO_SCREENSHOT")  # a PNG of the page, to look at
            if shot:
                await devtools.call("Emulation.setDeviceMetricsOverride", {
                    "width": 1200, "height": 900, "deviceScaleFactor": 1, "mobile": False},
                    session_id=session)
                await devtools.evaluate(session, "breezert.drawPlots()")
                png = await devtools.call("Page.captureScreenshot", {"format": "png"},
                                          session_id=session)
                Path(shot).write_bytes(base64.b64decode(png["data"]))
    assert state["turnDone"] is not None, f"no turn_done; page log: {state['log'][-10:]}"
    assert state["turnDone"]["status"] == "finished" and not state["errors"], state["errors"]
    first_ms = state["firstAudibleMs"]
    assert first_ms is not None, "the AnalyserNode never heard the speech"
    growth = state["concealmentEvents"] - state["concealmentAtFirstAudio"]
    print(f"Chromium ({'netns' if prefix else 'loopback'}): first audible {first_ms:.0f} ms "
          f"after say (server sent first frame {state['serverFirstAudioMs']:.0f} ms after say), "
          f"jitter buffer {state['jitterBufferMs']:.0f} ms, concealment events during speech "
          f"{growth}, engine-late ticks {state['turnDone']['starved_frames']}, "
          f"{len(reports)} playout reports")
    latency.check("chromium_first_audible", first_ms / 1000)
    if growth or state["turnDone"]["starved_frames"]:  # real time, as test_server_webrtc's
        raise LatencyMiss(f"not real-time: the browser concealed {growth} times during speech "
                          f"(lost or late packets), the engine was late for "
                          f"{state['turnDone']['starved_frames']} ticks")
    assert reports and all(source == "webrtc" and 0 <= b < 2.0 for b, source in reports)
    # the live plots: a playout-buffer line and a first-audio bar for the turn, drawn
    assert len(state["bufferSeries"]) >= 3 and len(state["turns"]) == 1, state["turns"]
    assert state["turns"][0]["heardMs"] and state["turns"][0]["serverMs"] is not None
    assert inked["bufferPlot"] > 20 and inked["firstPlot"] > 50, inked
