"""``bench/room_loop_lag.py``'s pure parts: how a point's rooms spread over processes, how the
processes' samples merge, and the per-loop fan-out experiment (no LiveKit, no server)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tests.bench_scripts import bench_script

pytestmark = pytest.mark.unit

room_loop_lag = bench_script("room_loop_lag")


def spec(**overrides: Any) -> dict[str, Any]:
    base = {"tag": "p0", "rooms": 16, "idle": 32, "duty": 1.0, "switch_ms": 5.0,
            "frame_ms": 50, "monitor": 100, "processes": 1, "reports_hz": 0.0,
            "pace": "realtime", "fanout": "livekit", "seconds": 10.0, "repeat": 0}
    return {**base, **overrides}


def test_one_process_keeps_the_engine_beside_its_rooms() -> None:
    (part,) = room_loop_lag.child_specs(spec())
    assert (part["rooms"], part["idle"], part["duty"]) == (16, 32, 1.0)


def test_processes_share_the_rooms_and_the_engine_and_listeners_get_their_own() -> None:
    parts = room_loop_lag.child_specs(spec(rooms=9, idle=5, processes=2, reports_hz=10.0))
    rooms, engine, reporters = parts[:2], parts[2], parts[3]
    assert [(p["rooms"], p["idle"], p["duty"]) for p in rooms] == [(5, 3, 0.0), (4, 2, 0.0)]
    assert (engine["rooms"], engine["idle"], engine["duty"]) == (0, 0, 1.0)
    assert (reporters["rooms"], reporters["duty"]) == (0, 0.0)
    # a listener for every room, named as each room process names its rooms
    assert reporters["report_rooms"] == ([f"p0-0-r{i}" for i in range(5)]
                                         + [f"p0-1-r{i}" for i in range(4)])
    assert len({p["tag"] for p in parts}) == len(parts)


def part(lags: list[float], captures: int, dropped: int = 0) -> dict[str, Any]:
    raw = {key: [] for key in ("capture", "capture_late", "split_request", "split_to_put",
                               "split_put_to_loop", "put", "put_subscribers", "subscribe",
                               "wake", "gc_full", "monitor_stalls")}
    return {"setup_s": 1.0, "process_cpu_s": 2.0, "cpu_by_thread_name": {"python": 1.0},
            "machine": [10.0, 20.0], "threads_alive_end": 0, "errors": [],
            "captures": captures, "rooms": 2, "dropped": dropped,
            "lag_max_per_room_ms": [max(lags), max(lags)], "loops_cpu_s": 1.0,
            "put_cpu_s": 0.5, "engine_cpu_s": 0.0, "engine_steps_per_s": 0.0,
            "engine_busy_share": 0.0, "raw": {**raw, "lag": lags}}


def test_merge_pools_the_processes_samples() -> None:
    point = room_loop_lag.merge(spec(rooms=4, processes=2, seconds=10.0),
                                [part([1.0, 2.0], captures=400), part([150.0, 3.0], 300, 5)])
    assert point["lag_ms"]["count"] == 4 and point["lag_ms"]["max"] == 150.0
    assert point["lag_over_100ms"] == 1
    # 700 frames of 50 ms over 4 rooms x 10 s
    assert point["realtime_share"] == pytest.approx(0.875)
    assert point["frames_dropped"] == 5
    assert point["python_cpu_share"]["total"] == pytest.approx(0.3)
    assert point["cpu_share_by_thread_name"] == {"python": 0.2}


class FakeLoop:
    """Records ``call_soon_threadsafe`` and whether the queue's lock was held meanwhile."""

    def __init__(self, lock: threading.Lock, closed: bool = False) -> None:
        self.lock, self.closed = lock, closed
        self.calls: list[tuple[Any, ...]] = []
        self.lock_held: list[bool] = []

    def call_soon_threadsafe(self, callback: Any, *args: Any) -> None:
        self.lock_held.append(self.lock.locked())
        if self.closed:
            raise RuntimeError("Event loop is closed")
        self.calls.append(args)
        callback(*args)


class FakeQueue:
    def __init__(self) -> None:
        self.items: list[Any] = []

    def put_nowait(self, item: Any) -> None:
        self.items.append(item)


class FakeFfiQueue:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscribers: list[tuple[FakeQueue, FakeLoop, Any]] = []


def test_per_loop_put_wakes_each_loop_once_outside_the_lock() -> None:
    ffi = FakeFfiQueue()
    a, b, closed = FakeLoop(ffi._lock), FakeLoop(ffi._lock), FakeLoop(ffi._lock, closed=True)
    a1, a2, b1, b_filtered, gone = (FakeQueue() for _ in range(5))
    ffi._subscribers = [(a1, a, None), (gone, closed, None), (a2, a, None),
                        (b1, b, lambda item: item == "event"),
                        (b_filtered, b, lambda item: item == "other")]
    room_loop_lag.per_loop_put(ffi)("event")
    assert a1.items == a2.items == b1.items == ["event"]
    assert b_filtered.items == [] and gone.items == []  # filtered out; a closed loop skipped
    assert len(a.calls) == len(b.calls) == 1  # one wake-up per loop, not per subscriber
    assert a.lock_held + b.lock_held + closed.lock_held == [False, False, False]


def test_per_loop_put_delivers_when_a_filter_fails() -> None:
    ffi = FakeFfiQueue()
    loop, target = FakeLoop(ffi._lock), FakeQueue()
    ffi._subscribers = [(target, loop, lambda item: item.missing)]
    room_loop_lag.per_loop_put(ffi)("event")
    assert target.items == ["event"]
