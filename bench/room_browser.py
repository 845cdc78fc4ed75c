"""The room benchmark's browser listener: one caller in headless Chromium with livekit-client.

Owns: ``BrowserListenerRoom``, the counterpart of ``room_listener.ListenerRoom`` (same
``join``/``turn``/``close`` and the same turn record, ``listener_kind`` aside) played by the
listener page ``bench/web/index.html`` in its own Chromium (``breezert_bench.chromium``), and
``heard_from_edges``, the turn as that page played it. Must not: touch the engine or the agent's
process (it sees the agent only through the room, as the Python listener does).

What it measures, and how. The page plays the agent's track as a browser does (an ``<audio>``
element) and, in variant ``listener``, runs ``examples/playout_reporter.js`` unchanged. Beside
that the track feeds an AudioWorklet (``bench/web/energy_worklet.js``) that takes the RMS of
every 10 ms of decoded audio as the WebAudio graph renders it (after the browser's jitter
buffer and concealment) and posts each loud/quiet edge: the Python listener's energy rule
(``ENERGY_RMS`` over 10 ms frames; the first window above ``SOUND_RMS`` after the trigger dates
the first sound). The page stamps an edge in epoch milliseconds when its main thread receives
it; they are mapped onto this machine's ``time.monotonic()``, the clock of the agent's stamps.

* first audio: the first loud edge after the trigger, plus the same modelled speaker prebuffer
  as the Python listener (``prebuffer_s``: the device buffer after the render point), so the
  two kinds differ only by their receiving stacks;
* gaps: quiet runs between loud ones, in rendered samples (``quiet``). A browser has no
  ``late`` gap: where the jitter buffer runs dry it conceals, and the page's ``getStats()``
  counts that (``concealed_s``). Headless Chromium renders on a fake output device whose FIFO
  from the track under-runs now and then and adds quiet runs of 5-50 ms with nothing concealed
  (``tests/livekit/test_room_browser.py``): those count as gaps here, as a caller would not hear
  them on a real device, so a browser's quiet gaps bound what it heard from above.
* ``jitter_buffer_s`` and ``concealed_s`` from the page's 100 ms ``getStats()`` series, as the
  Python listener takes them from its receiver's stats.

The trigger is the Python listener's ``bench.say`` message, sent by the page and stamped there
just before it leaves (``sent``); the agent's ``bench.ready`` and ``bench.turn`` answers come
back through the page.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from breezert_bench import chromium as page
from room_listener import (ENERGY_RMS, SOUND_RMS, Gap, ReceiverLog, dispatch_agent,
                           listener_token)

TURN_SETTLE_S = 0.3
"""The page's track quiet for this long after its last loud edge ends a turn there (the Python
listener waits ``tail_s`` after ``bench.turn``; the page plays behind it by its jitter buffer)."""


def heard_from_edges(edges: list[dict[str, Any]], sounds: list[dict[str, Any]], rate: float,
                     since_epoch: float, epoch_offset: float,
                     prebuffer_s: float) -> dict[str, Any] | None:
    """The ``heard`` entry of a turn record (``room_listener.TurnHeard``'s fields) from the
    page's edges and first-sound marks after ``since_epoch`` (epoch seconds); times in
    ``time.monotonic()`` (``epoch_offset``: ``time.time() - time.monotonic()``); ``None`` when
    no loud run ended after it."""
    runs = page.loud_runs(edges, since_epoch)
    if not runs:
        return None
    first = runs[0][0]
    first_arrival = first["t"] / 1000 - epoch_offset
    sound = next((s for s in sounds if s["t"] / 1000 >= since_epoch), None)
    first_sound = min(sound["t"] / 1000 - epoch_offset, first_arrival) if sound else first_arrival
    gaps = [Gap(round((quiet["frame"] - first["frame"]) / rate, 4),
                round((loud["frame"] - quiet["frame"]) / rate, 4), "quiet")
            for (_, quiet), (loud, _) in zip(runs, runs[1:])]
    span = round((runs[-1][1]["frame"] - first["frame"]) / rate, 4)
    return {"first_arrival": first_arrival, "first_heard": first_arrival + prebuffer_s,
            "first_sound_arrival": first_sound, "span_s": span, "audio_s": span,
            "gaps": [vars(g) for g in gaps],
            "min_rms": round(min(q.get("minRms") or 0.0 for _, q in runs) * 32768, 1)}


class BrowserListenerRoom:
    """One caller in its own headless Chromium: joins ``room`` as ``listener``, dispatches the
    bench agent with ``variant`` in its metadata and runs turns, as ``ListenerRoom`` does."""

    kind = "browser"

    def __init__(self, *, url: str, api_url: str, api_key: str, api_secret: str, room: str,
                 agent_name: str, variant: str, report: bool, web_root: str,
                 prebuffer_s: float, energy_rms: float = ENERGY_RMS,
                 settle_s: float = TURN_SETTLE_S) -> None:
        self.url, self.api_url, self.api_key, self.api_secret = url, api_url, api_key, api_secret
        self.name, self.agent_name, self.variant, self.report = room, agent_name, variant, report
        self.web_root, self.prebuffer_s, self.settle_s = web_root, prebuffer_s, settle_s
        self.energy = {"threshold": energy_rms / 32768, "windowMs": 10,
                       "sound": SOUND_RMS / 32768}
        self.reports_sent = 0
        self.frames = 0
        self._stack = contextlib.AsyncExitStack()
        self._devtools: page.DevTools | None = None
        self._session = ""
        self._n = 0
        self._epoch_offset = time.time() - time.monotonic()

    async def _eval(self, expression: str, **kwargs: Any) -> Any:
        assert self._devtools is not None
        return await self._devtools.evaluate(self._session, expression, **kwargs)

    async def _state(self, *keys: str) -> dict[str, Any]:
        return await self._eval("({" + ", ".join(f"{k}: {page.LISTENER}.{k}" for k in keys)
                                + "})")

    async def join(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Starts Chromium on the listener page, joins, dispatches the agent and waits until it
        is ready and its track plays; the agent's ``bench.ready`` with ``join_s`` added."""
        started = time.monotonic()
        binary = page.find_chromium()
        if binary is None:
            raise RuntimeError(page.listener_page_missing())
        self._devtools = await self._stack.enter_async_context(page.chromium(binary, []))
        self._session = await page.join_listener(
            self._devtools, self.web_root, self.url,
            listener_token(self.api_key, self.api_secret, self.name),
            {"report": self.report, "energy": self.energy})
        await dispatch_agent(self.api_url, self.api_key, self.api_secret, self.agent_name,
                             self.name, self.variant)
        ready = await self._message("bench.ready", None, started + timeout_s)
        await page.wait_subscribed(self._devtools, self._session,
                                   max(started + timeout_s - time.monotonic(), 1.0))
        return {**ready, "join_s": round(time.monotonic() - started, 3)}

    async def _message(self, topic: str, turn_id: str | None, deadline: float) -> dict[str, Any]:
        """The first ``topic`` message from the agent (for ``turn_id`` when given)."""
        while True:
            messages = await self._eval(f"{page.LISTENER}.messages")
            for message in messages:
                body = message["body"]
                if message["topic"] == topic and (turn_id is None or body.get("id") == turn_id):
                    return dict(body)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no {topic} from the agent")
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            state = await self._state("reportsSent", "stats")
            self.reports_sent = int(state["reportsSent"])
            if state["stats"]:  # 10 ms frames the jitter buffer handed out
                self.frames = int((state["stats"][-1].get("emitted") or 0) // 480)
            await self._eval(f"{page.LISTENER}.leave()", await_promise=True)
        await self._stack.aclose()

    async def turn(self, text: str, max_frames: int, seed: int,
                   timeout_s: float = 120.0) -> dict[str, Any]:
        """One turn: asks the agent to say ``text``, plays it, returns its record."""
        self._n += 1
        turn_id = f"t{self._n}"
        await self._eval(f"{page.LISTENER}.armSound()")
        body = {"id": turn_id, "text": text, "max_frames": max_frames, "seed": seed}
        sent_epoch = await self._eval(f"{page.LISTENER}.say({json.dumps(body)})",
                                      await_promise=True) / 1000
        sent = sent_epoch - self._epoch_offset
        record: dict[str, Any] = {"room": self.name, "id": turn_id, "variant": self.variant,
                                  "chars": len(text), "max_frames": max_frames, "sent": sent}
        try:
            done = await self._message("bench.turn", turn_id, time.monotonic() + timeout_s)
        except TimeoutError:
            record["error"] = f"no bench.turn from the agent in {timeout_s} s"
            return record
        record["agent"] = done
        state = await self._settled(sent_epoch)
        heard = heard_from_edges(state["edges"], state["sounds"], state["sampleRate"],
                                 sent_epoch, self._epoch_offset, self.prebuffer_s)
        if heard is None:
            record["error"] = "no audio heard"
            return record
        record["heard"] = heard
        receiver = ReceiverLog()
        origin = state["timeOrigin"] / 1000 - self._epoch_offset
        for s in state["stats"]:
            receiver.add(origin + s["t"] / 1000,
                         {"jitterBufferDelay": s["delay"], "jitterBufferEmittedCount": s["emitted"],
                          "concealedSamples": s["concealed"]})
        first = heard["first_arrival"]
        record["jitter_buffer_s"] = receiver.delay_after(first)
        record["concealed_s"] = receiver.concealed_between(first, first + heard["span_s"],
                                                           int(state["sampleRate"]))
        return record

    async def _settled(self, since_epoch: float, timeout_s: float = 5.0) -> dict[str, Any]:
        """The page's state once its track has been quiet for ``settle_s`` after the turn's
        last loud edge (the page plays behind the agent's ``bench.turn``), or after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = await self._state("edges", "sounds", "stats", "sampleRate", "timeOrigin")
            edges = [e for e in state["edges"] if e["t"] / 1000 >= since_epoch]
            if (edges and not edges[-1]["loud"]
                    and time.time() - edges[-1]["t"] / 1000 >= self.settle_s) \
                    or time.monotonic() >= deadline:
                return state
            await asyncio.sleep(0.05)
