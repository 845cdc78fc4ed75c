"""Real room, browser participant: headless Chromium with livekit-client plays the agent's track
and runs ``examples/playout_reporter.js``; its reports cross the server to the plugin and the
engine's Predictor uses them.

Owns: the ``breezert.playout`` data topic end to end (livekit-client -> SFU -> agent), the
``livekit-client`` source counted in the engine, and the agreement between the jitter-buffer
delay the agent received and the browser's own ``getStats()``. Skips only without Chromium or
without the npm-installed livekit-client (``make livekit-web``), saying which.
"""

from __future__ import annotations

import asyncio
import functools
import http.server
import json
import statistics
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_server_chromium import _chromium, chromium
from tests.livekit.test_room_python import SENTENCE, delta, idle, speak

pytestmark = pytest.mark.livekit

REPO = Path(__file__).resolve().parents[2]
CLIENT = REPO / "tests/livekit/web/node_modules/livekit-client/dist/livekit-client.esm.mjs"
AGREE_S = 0.020  # both are Δ jitterBufferDelay / Δ emitted over ~100 ms windows of the same
#                  counters at different phases; on loopback the buffer is steady, so their
#                  medians differ by less than one 20 ms Opus packet


class _Handler(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map,
                      ".mjs": "text/javascript", ".js": "text/javascript"}

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def web_root() -> Iterator[str]:
    """The repository over HTTP on loopback (the page, the reporter, livekit-client)."""
    if not CLIENT.exists():
        pytest.skip("livekit-client is not installed (make livekit-web: npm ci in tests/livekit/web)")
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Handler, directory=str(REPO)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


async def test_browser_reports_reach_the_predictor_and_agree_with_getstats(
        room_factory: Any, agent_worker: Any, livekit_server: Any, web_root: str) -> None:
    binary = _chromium()
    if binary is None:
        pytest.skip("no Chromium binary on PATH (make test installs Debian's chromium)")
    room = await room_factory()
    async with chromium(binary, []) as devtools:
        targets = await devtools.call("Target.getTargets")
        page = next(t for t in targets["targetInfos"] if t["type"] == "page")
        session = (await devtools.call("Target.attachToTarget",
                                       {"targetId": page["targetId"], "flatten": True}))["sessionId"]
        await devtools.call("Runtime.enable", session_id=session)
        await devtools.call("Page.navigate", {"url": f"{web_root}/tests/livekit/web/index.html"},
                            session)
        for _ in range(200):
            if await devtools.evaluate(session, "typeof window.breezertTest") == "object":
                break
            await asyncio.sleep(0.05)
        token = livekit_server.token("browser", room.name)
        await devtools.evaluate(
            session, f"breezertTest.join({json.dumps(livekit_server.ws_url)}, {json.dumps(token)})",
            await_promise=True)
        for _ in range(100):
            if await devtools.evaluate(session, "breezertTest.subscribed"):
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # the jitter buffer settles; reporter packets start
        before = agent_worker.metrics()
        sent, tts_metrics = await speak(room, agent_worker, SENTENCE)
        after = await idle(agent_worker)
        state = await devtools.evaluate(session, "({stats: breezertTest.stats, errors: breezertTest.errors})")
    assert not state["errors"], state["errors"]
    reports = [e for e in agent_worker.events(room.name) if e["type"] == "report"]
    client = [e for e in reports if e["source"] == "livekit-client"]
    used = delta(after, before, "predictor_feedback_used")
    counted = delta(after, before, "playback_reports_livekit-client")
    received = [d for e in client for k, d in e["listeners"].items() if k.startswith("browser/")]
    series = state["stats"]
    browser = [(b["delay"] - a["delay"]) / (b["emitted"] - a["emitted"])
               for a, b in zip(series, series[1:]) if b["emitted"] > a["emitted"]]
    print(f"browser: {counted} livekit-client reports counted by the engine, predictor used "
          f"{used} reports; listener delay at the agent median "
          f"{statistics.median(received) * 1000:.0f} ms, getStats median "
          f"{statistics.median(browser) * 1000:.0f} ms")
    assert counted >= 5 and used >= 5
    assert client, "no report used the browser's jitter buffer"
    assert abs(statistics.median(received) - statistics.median(browser)) <= AGREE_S
