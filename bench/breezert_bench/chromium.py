"""Headless Chromium driven over the DevTools protocol, and the listener page it opens: what the
real-room tests (``tests/livekit/browser.py``, ``tests/integration/test_server_chromium.py``) and
the room benchmark's browser listeners (``bench/room_browser.py``) share.

Owns: finding a Chromium binary, starting it headless with DevTools on a pipe
(``--remote-debugging-pipe``, so no port crosses a network namespace), a minimal DevTools
client, opening a page and waiting for it to load, serving the repository on loopback (the
listener page ``bench/web/index.html``, ``examples/``, the npm-installed livekit-client) and
reading the page's loud/quiet edges back as runs of speech. Must not: import the runtime, the
plugin or pytest (a missing Chromium is the caller's to report: a test fails or skips, the
benchmark exits with an error).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import json
import os
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WEB = REPO / "bench" / "web"
"""The listener page (``index.html``, ``energy_worklet.js``) and its npm package (``make
livekit-web``: ``npm ci`` here)."""
CLIENT = WEB / "node_modules" / "livekit-client" / "dist" / "livekit-client.esm.mjs"
PAGE_PATH = "/bench/web/index.html"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """The first of ``CHROMIUM_NAMES`` on PATH (``make chromium`` installs Debian's)."""
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def listener_page_missing() -> str | None:
    """What the listener page lacks to run here (Chromium, livekit-client), or ``None``."""
    if find_chromium() is None:
        return f"no Chromium binary on PATH ({', '.join(CHROMIUM_NAMES)}; make chromium)"
    if not CLIENT.exists():
        return (f"livekit-client is not installed ({CLIENT.relative_to(REPO)}; make livekit-web: "
                f"npm ci in {WEB.relative_to(REPO)})")
    return None


class DevTools:
    """A minimal Chrome DevTools Protocol client over ``--remote-debugging-pipe`` (fds 3/4)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.WriteTransport) -> None:
        self._reader, self._writer = reader, writer
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.console: list[str] = []
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            try:
                raw = await self._reader.readuntil(b"\0")
            except (asyncio.IncompleteReadError, ConnectionError):
                for future in self._pending.values():
                    future.done() or future.set_exception(ConnectionError("browser exited"))
                return
            message = json.loads(raw[:-1])
            future = self._pending.pop(message.get("id", -1), None)
            if future is not None and not future.done():
                future.set_result(message)
            elif message.get("method") == "Runtime.consoleAPICalled":
                args = message["params"]["args"]
                self.console.append(" ".join(str(a.get("value", "")) for a in args))

    async def call(self, method: str, params: dict[str, Any] | None = None,
                   session_id: str | None = None, timeout_s: float = 20.0) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session_id:
            message["sessionId"] = session_id
        future = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = future
        self._writer.write(json.dumps(message).encode() + b"\0")
        reply = await asyncio.wait_for(future, timeout_s)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    async def evaluate(self, session_id: str, expression: str, *, await_promise: bool = False,
                       timeout_s: float = 20.0) -> Any:
        result = await self.call("Runtime.evaluate", {
            "expression": expression, "returnByValue": True, "awaitPromise": await_promise,
        }, session_id, timeout_s)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page error: {result['exceptionDetails']}")
        return result["result"].get("value")

    def close(self) -> None:
        self._task.cancel()
        self._writer.close()


@contextlib.asynccontextmanager
async def chromium(binary: str, prefix: list[str]) -> AsyncIterator[DevTools]:
    """Headless Chromium (inside ``prefix``'s namespace) with DevTools on fds 3 and 4."""
    profile = tempfile.mkdtemp(prefix="breezert-chromium-")
    cmd_r, cmd_w = os.pipe()
    resp_r, resp_w = os.pipe()
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--use-fake-ui-for-media-stream",
        "--autoplay-policy=no-user-gesture-required", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run",
        "--disable-dev-shm-usage", "--disable-features=WebRtcHideLocalIpsWithMdns",
        f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank",
    ]
    # Chromium reads DevTools commands on fd 3 and writes replies on fd 4.
    shell = f'exec 3<&{cmd_r} 4>&{resp_w} {cmd_r}<&- {resp_w}>&-; exec "$@"'
    log = os.open(os.path.join(profile, "stderr.log"), os.O_WRONLY | os.O_CREAT, 0o600)
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", shell, "bash", *prefix, binary, *flags,
        pass_fds=(cmd_r, resp_w), stdout=log, stderr=log,
    )
    os.close(cmd_r)
    os.close(resp_w)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                 os.fdopen(resp_r, "rb", 0))
    writer, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(cmd_w, "wb", 0))
    devtools = DevTools(reader, writer)
    try:
        yield devtools
    finally:
        with contextlib.suppress(Exception):
            await devtools.call("Browser.close", timeout_s=5)
        devtools.close()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
        os.close(log)
        shutil.rmtree(profile, ignore_errors=True)


async def open_page(devtools: DevTools, url: str, loaded: str, timeout_s: float = 10.0) -> str:
    """Navigates the browser's first page to ``url`` and waits until the JavaScript expression
    ``loaded`` is true there; returns the page's DevTools session."""
    targets = await devtools.call("Target.getTargets")
    page = next(t for t in targets["targetInfos"] if t["type"] == "page")
    session = (await devtools.call("Target.attachToTarget",
                                   {"targetId": page["targetId"], "flatten": True}))["sessionId"]
    await devtools.call("Runtime.enable", session_id=session)
    await devtools.call("Page.navigate", {"url": url}, session)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if await devtools.evaluate(session, loaded):
            return session
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} did not load ({loaded} stayed false for {timeout_s} s)")


class _Handler(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map,
                      ".mjs": "text/javascript", ".js": "text/javascript"}

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serve_repository() -> Iterator[str]:
    """The repository over HTTP on loopback (the page at ``PAGE_PATH``): its base URL."""
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Handler, directory=str(REPO)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def loud_runs(edges: list[dict[str, Any]],
              since_epoch: float) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The page's loud/quiet edges (``{loud, frame, t}``: ``t`` in epoch ms) from
    ``since_epoch`` (seconds) on, as (loud edge, the quiet edge after it) pairs; a loud run
    still open is left out."""
    runs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    opened: dict[str, Any] | None = None
    for edge in edges:
        if edge["t"] / 1000 < since_epoch:
            continue
        if edge["loud"]:
            opened = edge
        elif opened is not None:
            runs.append((opened, edge))
            opened = None
    return runs


LISTENER = "breezertListener"
"""The listener page's global (``bench/web/index.html``)."""


async def join_listener(devtools: DevTools, web_root: str, ws_url: str, token: str,
                        options: dict[str, Any] | None = None) -> str:
    """The listener page (from ``web_root``, ``serve_repository``'s URL) joined to the room
    ``token`` admits to (``options``: the page's ``join`` options); its DevTools session."""
    session = await open_page(devtools, f"{web_root}{PAGE_PATH}",
                              f"typeof window.{LISTENER} === 'object'")
    await devtools.evaluate(
        session, f"{LISTENER}.join({json.dumps(ws_url)}, {json.dumps(token)}, "
                 f"{json.dumps(options or {})})", await_promise=True)
    return session


async def wait_subscribed(devtools: DevTools, session: str, timeout_s: float = 10.0) -> None:
    """Until the page plays the agent's track (its level meter running); raises with the page's
    errors after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if await devtools.evaluate(session, f"{LISTENER}.subscribed"):
            return
        await asyncio.sleep(0.1)
    errors = await devtools.evaluate(session, f"{LISTENER}.errors")
    raise RuntimeError(f"the browser never subscribed to the agent's track (errors: {errors})")
