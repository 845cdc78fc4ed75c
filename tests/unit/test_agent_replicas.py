"""``RemoteRuntimeClient`` over several replicas (in-test ``breezert serve`` stand-ins with a
``/readyz``): the least loaded by readiness, failover before the first audio, never after.

Owns: the replica choice (status, then load counting this process's turns since the sample),
moving a turn that was refused, lost or never connected before any audio (with every text it
had), and the clear error once audio came. The protocol itself is ``test_agent_remote``'s.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from livekit.agents import APIConnectionError

from breezert_agent import TTS
from breezert_agent.client import RemoteRuntimeClient, TurnOptions
from breezert_agent.client.remote import readiness_url

from tests.unit.test_agent_remote import NO_RETRY, SAMPLES_PER_SEGMENT, FakeServe, _serve

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("virtual_clock")]


class Replica(FakeServe):
    """A ``FakeServe`` with ``/readyz``: ``ready_status`` and ``running`` of 4 slots."""

    ready_status: int = 200
    running: int = 0

    async def readyz(self, request: web.Request) -> web.Response:
        load = {"fraction": min(self.running / 4, 1.0), "running": self.running, "queued": 0,
                "max_running": 4, "max_queued": 8}
        status = "ready" if self.ready_status == 200 else "full"
        return web.json_response({"ready": self.ready_status == 200, "status": status,
                                  "load": load}, status=self.ready_status)


async def _replica() -> AsyncIterator[Replica]:
    fake = Replica()
    async for served in _serve(fake, readyz=fake.readyz):
        yield served  # type: ignore[misc]


@pytest.fixture
async def a() -> AsyncIterator[Replica]:
    async for fake in _replica():
        yield fake


@pytest.fixture
async def b() -> AsyncIterator[Replica]:
    async for fake in _replica():
        yield fake


def dead_url() -> str:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


async def play(client: RemoteRuntimeClient, texts: list[str], **kwargs: Any) -> tuple[Any, int]:
    """One closed turn; returns (turn, samples received)."""
    turn = await client.open_turn(texts, TurnOptions(), request_id=f"t{id(texts)}",
                                  input_closed=True, timeout=5.0, **kwargs)
    samples = 0
    async for item in turn.audio():
        if isinstance(item, bytes):
            samples += len(item) // 2
    return turn, samples


def test_readiness_url() -> None:
    assert readiness_url("http://h:8080") == "http://h:8080/readyz"
    assert readiness_url("wss://h/api/") == "https://h/api/readyz"
    assert readiness_url("ws://h:1/v1/audio/speech/stream") == "http://h:1/readyz"


async def test_a_turn_goes_to_the_least_loaded_replica(a: Replica, b: Replica) -> None:
    a.running = 3  # 0.75 of its slots
    client = RemoteRuntimeClient([a.url, b.url], readiness_interval=0.05)
    turn, samples = await play(client, ["One."])
    assert turn.base_url == b.url and samples == SAMPLES_PER_SEGMENT
    assert a.of_type("say") == []
    a.running, b.running = 0, 4
    b.ready_status = 503  # full: /readyz 503
    await asyncio.sleep(0.2)  # the next samples
    turn, _ = await play(client, ["Two."])
    assert turn.base_url == a.url
    await client.aclose()


async def test_concurrent_turns_spread_before_the_next_sample(a: Replica, b: Replica) -> None:
    client = RemoteRuntimeClient([a.url, b.url], readiness_interval=60.0)  # one sample only
    results = await asyncio.gather(*(play(client, [f"Turn {i}."]) for i in range(4)))
    assert sorted(turn.base_url for turn, _ in results) == sorted([a.url, a.url, b.url, b.url])
    await client.aclose()


async def test_a_replica_that_is_down_is_skipped(b: Replica) -> None:
    dead = dead_url()
    client = RemoteRuntimeClient([dead, b.url], readiness_interval=60.0)
    for _ in range(2):
        turn, samples = await play(client, ["Hello."])
        assert turn.base_url == b.url and samples == SAMPLES_PER_SEGMENT
    await client.aclose()


async def test_refused_or_lost_before_audio_moves_with_every_text(a: Replica,
                                                                  b: Replica) -> None:
    b.running = 2  # a is preferred
    client = RemoteRuntimeClient([a.url, b.url], readiness_interval=60.0)
    a.reject_says = ["overloaded"]
    turn, samples = await play(client, ["Refused here."])
    assert turn.base_url == b.url and samples == SAMPLES_PER_SEGMENT
    await client.aclose()

    # an open turn: its replica drops the socket before any audio; the texts sent so far,
    # appended ones included, go to the other one in a single say
    client = RemoteRuntimeClient([a.url, b.url], readiness_interval=60.0)
    await client.poll_readiness()  # a is ready again (the refusal marked it full, process-wide)
    a.close_after_segments = 0
    turn = await client.open_turn(["First."], TurnOptions(), request_id="open-1",
                                  input_closed=False, timeout=5.0)
    assert turn.base_url == a.url
    await turn.append("Second.")
    await turn.close_input()
    samples = sum([len(x) // 2 async for x in turn.audio() if isinstance(x, bytes)])
    assert turn.base_url == b.url and samples == 2 * SAMPLES_PER_SEGMENT
    says = b.of_type("say")
    assert says[-1]["text"] == ["First.", "Second."] and says[-1]["input_closed"] is True
    assert says[-1]["request_id"] == "open-1"
    await client.aclose()


async def test_lost_after_audio_is_a_clear_error_and_never_replayed(a: Replica,
                                                                    b: Replica) -> None:
    b.running = 2
    a.close_after_segments = 1  # one segment of audio, then the socket drops
    tts = TTS(base_url=[a.url, b.url])
    with pytest.raises(APIConnectionError, match="mid-turn after 0.10 s of audio") as caught:
        await tts.synthesize("One. Two.", conn_options=NO_RETRY).collect()
    assert "not replayed" in str(caught.value) and a.url in str(caught.value)
    assert caught.value.retryable is False
    assert b.of_type("say") == []  # no duplicate audio from the other replica
    await tts.aclose()
