"""A virtual clock for unit tests that wait on time: idle waits cost no real time.

Owns ``VirtualClock`` and the ``virtual_clock`` fixture (``tests/conftest.py``). Under it,
``time.monotonic``, ``time.perf_counter`` and ``time.time`` read real time plus an offset, and
the running event loop's selector, asked to wait ``t`` seconds for I/O with a timer due after
``t``, polls once (a short real grace, so that same-process sockets and thread wake-ups land) and
then moves the offset on by ``t`` instead of sleeping. So ``asyncio.sleep(0.5)`` returns at once
with the clocks (the loop's, the product's ``time.monotonic()`` stamps, livekit-agents'
``perf_counter`` TTFB) half a second later, while real work still takes its real time. What the
test measures is what the code computed from those clocks: a TTFB that wrongly counted an LLM's
0.5 s pause shows 0.5 s, as it would in real time.

Must not: be used with a component that keeps time elsewhere (``livekit.rtc.AudioSource`` paces
in the Rust SDK on real time): such tests are integration tests.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Iterator
from typing import Any

import pytest

REAL_GRACE_S = 0.002
"""Real seconds a virtual wait first polls for I/O (a reply on a loopback socket written by the
same loop, a ``call_soon_threadsafe`` wake-up from a quick thread)."""


class VirtualClock:
    """Real clocks plus ``offset_s``, which grows by every wait the loop skips."""

    def __init__(self) -> None:
        self.offset_s = 0.0
        self.skipped = 0
        self._monotonic, self._perf, self._time = time.monotonic, time.perf_counter, time.time

    def monotonic(self) -> float:
        return self._monotonic() + self.offset_s

    def perf_counter(self) -> float:
        return self._perf() + self.offset_s

    def time(self) -> float:
        return self._time() + self.offset_s

    def advance(self, seconds: float) -> None:
        self.offset_s += max(seconds, 0.0)
        self.skipped += 1


class _SkippingSelector:
    """The loop's selector, whose timed waits become a short poll and a clock jump."""

    def __init__(self, inner: selectors.BaseSelector, clock: VirtualClock) -> None:
        self._inner, self._clock = inner, clock

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None or timeout <= 0:  # nothing timed: wait for I/O as ever
            return self._inner.select(timeout)
        start = self._clock._monotonic()
        events = self._inner.select(min(timeout, REAL_GRACE_S))
        if not events:
            self._clock.advance(timeout - (self._clock._monotonic() - start))
        return events

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture
def virtual_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[VirtualClock]:
    """Virtual time for the test's event loop (created for it by pytest-asyncio) and the
    ``time`` module's clocks; the loop's selector is wrapped when the test starts running."""
    clock = VirtualClock()
    monkeypatch.setattr(time, "monotonic", clock.monotonic)
    monkeypatch.setattr(time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(time, "time", clock.time)
    original = asyncio.BaseEventLoop.run_until_complete

    def run_until_complete(loop: Any, future: Any) -> Any:
        selector = getattr(loop, "_selector", None)
        if selector is not None and not isinstance(selector, _SkippingSelector):
            loop._selector = _SkippingSelector(selector, clock)
        return original(loop, future)

    monkeypatch.setattr(asyncio.BaseEventLoop, "run_until_complete", run_until_complete)
    yield clock
