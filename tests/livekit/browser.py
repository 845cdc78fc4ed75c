"""The browser participant of the real-room tests: headless Chromium running livekit-client.

Owns: driving the listener page (``bench/web/index.html``, served and opened by
``breezert_bench.chromium``, which the room benchmark's browser listeners share) into a room,
and reading back what the page kept: its ``getStats()`` series and the loud/quiet edges of the
decoded track (``bench/web/energy_worklet.js``), turned into a ``Heard`` like the Python
participant's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
from breezert_bench import chromium as page

from tests.livekit.listening import Heard
from tests.livekit.machine import CpuSplit
from tests.realtime import wait_below

if TYPE_CHECKING:
    from tests.livekit.conftest import Server

@contextlib.contextmanager
def serve_repository() -> Iterator[str]:
    """The repository over HTTP on loopback; fails without livekit-client or Chromium (``make
    test`` installs both: a missing one is a broken set-up, not a reason to skip)."""
    lacking = page.listener_page_missing()
    if lacking is not None:
        pytest.fail(lacking)
    with page.serve_repository() as url:
        yield url


PLAYOUT_COUNTERS = ("received", "concealed", "silent", "inserted", "removed")
SETTLE_S = 0.3
"""Quiet at the page for this long after a loud run ends the turn there: longer than any quiet
run inside speech (``MAX_GAP_S``, 60 ms, bounds those)."""


class Browser:
    """One joined page; ``evaluate`` runs JavaScript in it."""

    def __init__(self, devtools: page.DevTools, session: str) -> None:
        self.devtools, self.session = devtools, session
        # the page stamps edges with epoch milliseconds; this maps them onto time.monotonic()
        self._epoch_offset = time.time() - time.monotonic()

    async def evaluate(self, expression: str, **kwargs: Any) -> Any:
        return await self.devtools.evaluate(self.session, expression, **kwargs)

    async def state(self) -> dict[str, Any]:
        return await self.evaluate("({stats: breezertListener.stats, "
                                   "errors: breezertListener.errors, "
                                   "edges: breezertListener.edges, "
                                   "rate: breezertListener.sampleRate})")

    async def playout_counters(self, since: dict[str, int] | None = None) -> dict[str, int]:
        """The jitter buffer's sample counters (``getStats``, the newest sample): received
        (decoded from packets), concealed, silent (concealed as silence), inserted (to slow
        playout), removed (to speed it up); less ``since`` (an earlier call's result) when
        given."""
        newest = (await self.state())["stats"][-1]
        counters = {k: newest.get(k) or 0 for k in PLAYOUT_COUNTERS}
        return counters if since is None else {k: counters[k] - since[k] for k in counters}

    async def heard(self, since: float, settle_s: float = SETTLE_S,
                    timeout_s: float = 5.0) -> Heard | None:
        """The speech whose first loud edge reached the page after ``since`` (monotonic), once
        the page's track has been quiet for ``settle_s`` after it: a page that plays behind the
        agent (Chromium's renderer short of CPU) is measured whole, not up to its open last run.
        After ``timeout_s`` it measures what there is (``None`` if nothing was heard)."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = await self.state()
            edges = [e for e in state["edges"] if e["t"] / 1000 >= since + self._epoch_offset]
            settled = bool(edges) and not edges[-1]["loud"] and (
                time.time() - edges[-1]["t"] / 1000 >= settle_s)
            if settled or time.monotonic() >= deadline:
                return edges_heard(state["edges"], state["rate"], since + self._epoch_offset,
                                   self._epoch_offset)
            await asyncio.sleep(0.05)


def edges_heard(edges: list[dict[str, Any]], rate: float | None, since_epoch: float,
                epoch_offset: float) -> Heard | None:
    """A ``Heard`` from the page's loud/quiet edges after ``since_epoch`` (seconds since the
    epoch): spans and gaps in the context's samples, ``first`` in ``time.monotonic()``."""
    if not rate:
        return None
    runs = page.loud_runs(edges, since_epoch)
    if not runs:
        return None
    first, last = runs[0][0], runs[-1][1]
    gaps = [(b[0]["frame"] - a[1]["frame"], b[0]["t"] - a[1]["t"])
            for a, b in zip(runs, runs[1:])]
    return Heard(first=first["t"] / 1000 - epoch_offset,
                 span_s=(last["frame"] - first["frame"]) / rate,
                 gap_s=max((g[0] for g in gaps), default=0) / rate,
                 arrival_gap_s=max((g[1] for g in gaps), default=0) / 1000,
                 quiet_s=sum(g[0] for g in gaps) / rate,
                 quiet_runs=tuple((round((quiet["frame"] - first["frame"]) / rate, 3),
                                   round(g[0] / rate, 3))
                                  for (_, quiet), g in zip(runs, gaps)))


BROWSER_SETTLED_CORES = 0.25
"""Chromium's whole process tree under this many cores over ``SETTLE_WINDOW_S``: its start-up
(page load, the WebRTC and audio set-up) is over. Measured on the two-core box (4 Dec): 0.40
cores in the first window after the fixed 0.5 s wait, 0.13-0.15 once settled and through the
turns that followed."""
SETTLE_WINDOW_S = 0.5


async def settle(timeout_s: float = 10.0) -> None:
    """Waits (up to ``timeout_s``) until Chromium's start-up is over: a window of
    ``SETTLE_WINDOW_S`` in which its processes used under ``BROWSER_SETTLED_CORES``. Its
    start-up is this test's own load, not the product's: on two cores a first turn played while
    Chromium still set up starved the ``livekit.rtc`` listener beside it."""
    cores, settled = await wait_below(lambda: _browser_cores(CpuSplit({})),
                                      BROWSER_SETTLED_CORES, SETTLE_WINDOW_S, timeout_s)
    print(f"the browser settled: {cores:.2f} cores" if settled
          else f"the browser never settled: {cores:.2f} cores after {timeout_s} s")


def _browser_cores(split: CpuSplit) -> Callable[[], float]:
    return lambda: split.cores()["browser"]


@contextlib.asynccontextmanager
async def join_browser(web_root: str, server: Server, room: str,
                       identity: str = "browser") -> AsyncIterator[Browser]:
    """Chromium on the listener page, joined to ``room`` and subscribed to the agent's track
    (the jitter buffer given 0.5 s to settle and the reporter to start)."""
    binary = page.find_chromium()
    assert binary is not None
    async with page.chromium(binary, []) as devtools:
        session = await page.join_listener(devtools, web_root, server.ws_url,
                                           server.token(identity, room))
        browser = Browser(devtools, session)
        try:
            await page.wait_subscribed(devtools, session)
        except RuntimeError as exc:
            raise AssertionError(f"{exc}: {await browser.state()}") from None
        await asyncio.sleep(0.5)
        await settle()
        yield browser
