"""The serving front against abuse (issue 16, items 1-3), on the tiny CPU model or a replay engine.

Owns: inputs that used to crash (a lone surrogate, deep nesting) answered 4xx / an ``error``
event with the socket kept; cross-site checks (``application/json`` only, ``Origin``
allow-list, ``Host`` on a loopback bind); auth (empty tokens, a bare ``Bearer``, tokens kept
out of the access log, ``breezert serve`` refusing an unauthenticated public bind, WebRTC
peers that never connect freed by ``webrtc_connect_timeout_s``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest
from breezert.async_engine import AsyncEngine
from breezert.config import EngineConfig, ServingConfig

from tests.fake_engine import FakeEngine
from tests.integration._server import recvonly_offer, serve, state_of, ws_turn

pytestmark = pytest.mark.integration

# ----------------------------------------------------------------------------- 1: parsing


async def _ready_ws(http: aiohttp.ClientSession, url: str,
                    **kwargs: Any) -> aiohttp.ClientWebSocketResponse:
    ws = await http.ws_connect(f"{url}/v1/audio/speech/stream", **kwargs)
    assert json.loads((await ws.receive()).data)["type"] == "ready"
    return ws


async def _error_event(ws: aiohttp.ClientWebSocketResponse) -> dict[str, Any]:
    msg = await asyncio.wait_for(ws.receive(), 10)
    assert msg.type == aiohttp.WSMsgType.TEXT, msg  # not a dropped socket (1006)
    return json.loads(msg.data)


@pytest.mark.parametrize("body, param", [
    (b'{"input": "\\ud800"}', "input"),
    (b'{"input": "Hi", "instructions": "a\\udfffb"}', "instructions"),
    (b"[" * 100_000, None),
    (b'{"input": "Hi", "seed": ' + b"9" * 5000 + b"}", "seed"),
    (b'{"input": "Hi", "speed": Infinity}', None),
])
async def test_bodies_that_crashed_get_400(engine: AsyncEngine, body: bytes,
                                           param: str | None) -> None:
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http, \
            http.post(f"{url}/v1/audio/speech", data=body,
                      headers={"Content-Type": "application/json"}) as r:
        error = (await r.json())["error"]
    assert r.status == 400 and error["param"] == param and error["message"], error


async def test_websocket_keeps_the_socket_on_surrogates_and_deep_nesting(
    engine: AsyncEngine
) -> None:
    async with serve(engine) as (url, _), aiohttp.ClientSession() as http:
        ws = await _ready_ws(http, url)
        await ws.send_str('{"type": "say", "text": "\\ud800"}')
        error = await _error_event(ws)
        assert error["type"] == "error" and error["field"] == "text", error
        await ws.send_str("[" * 60_000)
        assert (await _error_event(ws))["code"] == "bad_json"
        await ws.send_str('{"type": "say", "text": ["Hi."], "more": true}')
        assert (await _error_event(ws))["type"] == "turn_started"
        await ws.send_str('{"type": "append", "text": " \\udc00"}')
        error = await _error_event(ws)
        assert error["type"] == "error" and error["field"] == "text", error
        await ws.send_str('{"type": "end"}')
        events, audio = await ws_turn(ws)
        assert events[-1]["type"] == "turn_done" and audio  # the turn and the socket go on
        await ws.close()


# ----------------------------------------------------------------------------- 2: cross-site


async def test_v1_accepts_only_application_json() -> None:
    async with serve(FakeEngine(), warmup=False) as (url, _), \
            aiohttp.ClientSession() as http:
        for path in ("/v1/audio/speech", "/v1/webrtc/offer"):
            for headers in ({"Content-Type": "text/plain"}, {},
                            {"Content-Type": "application/x-www-form-urlencoded"}):
                async with http.post(f"{url}{path}", data=b'{"input": "Hi"}',
                                     headers=headers) as r:
                    error = (await r.json())["error"]
                    assert r.status == 415 and error["param"] == "Content-Type", error
        async with http.post(f"{url}/v1/audio/speech", data=b'{"input": "Hi"}',
                             headers={"Content-Type": "application/json; charset=utf-8"}) as r:
            assert r.status == 200


async def test_origin_is_checked_against_the_allow_list() -> None:
    async with serve(FakeEngine(), warmup=False,
                     serving={"allowed_origins": ("https://app.example.com",)}) as (url, _), \
            aiohttp.ClientSession() as http:
        for origin, ok in [("https://evil.example", False), ("null", False),
                           ("http://localhost:3000", True), ("http://127.0.0.1:9", True),
                           ("http://[::1]:8000", True), ("https://app.example.com", True),
                           (url, True)]:
            async with http.post(f"{url}/v1/audio/speech", json={"input": "Hi"},
                                 headers={"Origin": origin}) as r:
                assert (r.status == 200) == ok, (origin, r.status)
                if not ok:
                    assert r.status == 403 and (await r.json())["error"]["param"] == "Origin"
            if ok:
                ws = await _ready_ws(http, url, origin=origin)
                await ws.close()
            else:
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await http.ws_connect(f"{url}/v1/audio/speech/stream", origin=origin)
                assert refused.value.status == 403


async def test_a_foreign_host_is_refused_on_a_loopback_bind() -> None:
    async with serve(FakeEngine(), warmup=False) as (url, _), \
            aiohttp.ClientSession() as http:
        port = int(url.rsplit(":", 1)[1])
        for host, ok in [(f"evil.example:{port}", False), (f"localhost.evil.example:{port}", False),
                         (f"10.0.0.1:{port}", False), (f"localhost:{port + 1}", False),
                         ("", False), (f"localhost:{port}", True), (f"127.0.0.1:{port}", True),
                         (f"127.1.2.3:{port}", True), (f"LOCALHOST:{port}", True)]:
            for path in ("/", "/metrics", "/v1/audio/speech"):
                method = http.post if path.startswith("/v1") else http.get
                async with method(f"{url}{path}", json={"input": "Hi"},
                                  headers={"Host": host}) as r:
                    assert (r.status < 400) == ok, (host, path, r.status)
                    if not ok:
                        assert r.status == 403 and (await r.json())["error"]["param"] == "Host"
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(f"{url}/v1/audio/speech/stream",
                                  headers={"Host": f"evil.example:{port}"})
        assert refused.value.status == 403


# ----------------------------------------------------------------------------- 3: auth


def test_an_empty_token_is_a_config_error() -> None:
    for token in ("", "   "):
        with pytest.raises(ValueError, match="auth_token"):
            ServingConfig(auth_token=token)
        with pytest.raises(ValueError, match="serving.auth_token"):
            EngineConfig.from_dict({"serving": {"auth_token": token}})


async def test_a_bare_bearer_never_passes() -> None:
    async with serve(FakeEngine(), warmup=False, serving={"auth_token": "s3cret"}) as (url, _), \
            aiohttp.ClientSession() as http:
        for header in ("Bearer", "Bearer ", "bearer   ", " Bearer"):
            async with http.post(f"{url}/v1/audio/speech", json={"input": "Hi"},
                                 headers={"Authorization": header}) as r:
                assert r.status == 401, header
        with pytest.raises(aiohttp.WSServerHandshakeError):
            await http.ws_connect(f"{url}/v1/audio/speech/stream?access_token=")


async def test_tokens_never_reach_the_access_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    async with serve(FakeEngine(), warmup=False, serving={"auth_token": "s3cret"}) as (url, _), \
            aiohttp.ClientSession() as http:
        ws = await _ready_ws(http, url, params={"access_token": "s3cret"})
        await ws.close()
        async with http.post(f"{url}/v1/audio/speech?access_token=s3cret&x=1",
                             json={"input": "Hi"}) as r:
            assert r.status == 401
        await asyncio.sleep(0.05)
    logged = "\n".join(f"{r.getMessage()} {vars(r)}" for r in caplog.records
                       if r.name == "aiohttp.access")
    assert "/v1/audio/speech" in logged and "access_token=REDACTED" in logged
    assert "s3cret" not in logged


def test_serve_refuses_a_public_bind_without_a_token(monkeypatch, capsys) -> None:
    from breezert import cli

    class Started(Exception):
        pass

    async def no_server(*args: Any, **kwargs: Any) -> int:  # what runs once the checks pass
        raise Started

    monkeypatch.setattr(cli, "_serve", no_server)
    for host in ("0.0.0.0", "::", "192.0.2.7"):
        assert cli.main(["serve", "--host", host, "--port", "0"]) == 2
        assert "--allow-unauthenticated" in capsys.readouterr().err
    with pytest.raises(Started):  # loopback, a token or the flag: it goes on to start
        cli.main(["serve", "--host", "0.0.0.0", "--port", "0", "--allow-unauthenticated"])
    with pytest.raises(Started):
        cli.main(["serve", "--host", "127.0.0.1", "--port", "0"])
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "--allow-unauthenticated" in help_text


async def test_peers_that_never_connect_are_freed_by_the_deadline() -> None:
    assert ServingConfig().webrtc_connect_timeout_s <= 10
    serving = {"max_peers": 3, "webrtc_connect_timeout_s": 0.5}
    async with serve(FakeEngine(), warmup=False, serving=serving,
                     ice_addresses=["127.0.0.1"]) as (url, app), \
            aiohttp.ClientSession() as http:
        for _ in range(3):
            async with http.post(f"{url}/v1/webrtc/offer",
                                 json={"sdp": await recvonly_offer()}) as r:
                assert r.status == 200
        async with http.post(f"{url}/v1/webrtc/offer",
                             json={"sdp": await recvonly_offer()}) as r:
            assert r.status == 503  # max_peers is full...
        for _ in range(60):
            if not state_of(app).peers:
                break
            await asyncio.sleep(0.05)
        assert not state_of(app).peers  # ...until the deadline frees every place
        async with http.post(f"{url}/v1/webrtc/offer",
                             json={"sdp": await recvonly_offer()}) as r:
            assert r.status == 200
