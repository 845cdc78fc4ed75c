"""``breezert-bench --server``: the benchmark's load driven at a running server over its
WebSocket (tiny CPU model, in-process server on loopback).

Owns: that every request of a closed loop is one turn whose chunks are timed at the client, the
server's first-audio time lands beside it, the simulated listener's reports reach the server,
and the server's ``/metrics`` samples are read. Must not: need a GPU.
"""

from __future__ import annotations

import aiohttp
import pytest

from breezert.async_engine import AsyncEngine
from breezert.profiles import EMBEDDED_PROFILE, profile_path
from breezert_bench.listener import summarize_requests
from breezert_bench.options import BenchOptions
from breezert_bench.remote import RemoteSpeech
from breezert_bench.runner import _closed_loop
from breezert_bench.workload import BUILTIN_TEXTS, make_workload
from tests.integration._server import serve, wait_idle

pytestmark = pytest.mark.integration


async def test_closed_loop_against_a_running_server(engine: AsyncEngine) -> None:
    options = BenchOptions(config_path=profile_path(EMBEDDED_PROFILE), feedback_period_s=0.05)
    items = make_workload(list(BUILTIN_TEXTS), 4, seed=0)
    reports_before = engine.metrics()["counters"].get("playback_reports_simulated", 0)
    async with serve(engine) as (url, _), aiohttp.ClientSession() as session:
        target = RemoteSpeech(url, session)
        results = await _closed_loop(target, items, 2, options, "remote-test", None)
        metrics = await target.server_metrics()
    summary = summarize_requests(results)
    assert summary["num_ok"] == 4, [r.error for r in results]
    for result, item in zip(results, items, strict=True):
        assert result.num_frames == item.num_frames  # every frame arrived, timed at the client
        assert result.ttfb_s is not None and result.server_ttfb_s is not None
        assert 0 < result.server_ttfb_s <= result.ttfb_s + 0.05
    assert summary["server_ttfb_s"]["count"] == 4
    reports = engine.metrics()["counters"].get("playback_reports_simulated", 0)
    assert reports > reports_before  # the listener's reports crossed the socket
    assert "breezert_active_streams" in metrics
    await wait_idle(engine)
