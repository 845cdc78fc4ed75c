"""Telephony set-up of the SIP tests: Redis, the server on it, LiveKit SIP, a baresip caller.

Owns: finding (or building through ``make livekit-sip``) the pinned ``livekit-sip``; Redis on a
free loopback port with nothing persisted; ``livekit-sip`` on loopback, talking to the server
through that Redis; the inbound trunk and dispatch rules (``livekit-api``) that put a call into
a fresh room with the agent dispatched; a ``baresip`` caller driven over its ``ctrl_tcp``
interface that sends a prompt and records what it decodes; and what reaches the caller's
sockets, stamped by the kernel (``AF_PACKET`` on ``lo``): the SIP answer and every RTP packet;
and, at the server's media port, the agent's RTP as it left the agent and as it reached LiveKit
SIP (``MediaWatch``), so that a gap the caller hears is placed where it arose.
A component that cannot be built or installed fails the tests under ``CI=true`` with its log's
last lines, and skips them elsewhere (``tests/components.missing``).

Plain context managers, so that ``bench/sip_first_audio.py`` runs the same calls as the tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
from livekit import api

from breezert_bench.ports import free_port
from tests.components import missing
from tests.livekit.machine import agent_priority
from tests.realtime import processes, tree

from .conftest import (
    AGENT_NAME,
    API_KEY,
    API_SECRET,
    REPO,
    Server,
    Worker,
    _keep_last_log,
    _stop,
    built_binary,
    run_server,
    run_worker,
)

SIP_BIN = REPO / ".cache" / "livekit" / "livekit-sip"
SIP_BUILD_LOG = REPO / ".cache" / "livekit" / "sip-build.log"
TELEPHONY_LOG = REPO / ".cache" / "livekit" / "telephony-deps.log"
GREETING_ATTRIBUTE = "breezert.greeting"  # set on the SIP participant by the dispatch rule;
#                                           room_worker.py says it once the call is answered
SAMPLE_RATE_ATTRIBUTE = "breezert.sample_rate"  # likewise: TTS(sample_rate=) for that call
PAYLOAD_TYPES = {"PCMU": 0, "PCMA": 8}  # RFC 3551 static payload types, both 8 kHz
G711_RATE = 8000
RTCP_TYPES = range(72, 77)  # RTCP packet types 200-204 read as an RTP payload type
CALLER_ENERGY_RMS = 50.0
"""int16 RMS above which a 20 ms packet at the caller counts as speech. Not the Opus
listener's 200 (``listening.ENERGY_RMS``): through the 4 kHz telephone band the tiny model's
noise keeps a median RMS of ~800 but dips to 80-170 in its first 160 ms, which 200 would call
gaps; the bridge's silence decodes to |x| <= 8 (RMS <= 12 measured between turns), and a
packet it fills in when the agent's audio is late is that silence."""
RTP_RANGE = 16  # UDP ports for the caller's RTP (one call per baresip)
SIP_RTP_RANGE = 128  # LiveKit SIP's: it keeps a closed call's port draining (30 s without
#                      packets, 10 min at most), so each call in a run takes a fresh one


def sip_binary() -> Path:
    """The built ``livekit-sip`` (``make livekit-sip``; ``BREEZERT_LIVEKIT_SIP`` overrides)."""
    return built_binary(SIP_BIN, SIP_BUILD_LOG, "livekit-sip", "BREEZERT_LIVEKIT_SIP")


def require_tools() -> None:
    """Debian's redis-server and baresip (``make telephony-deps``, whose apt log is
    ``TELEPHONY_LOG``) and the right to capture on loopback (root, as ``make test`` runs in CI),
    else ``components.missing``: a failure under ``CI=true``, a skip elsewhere."""
    for tool, package in (("redis-server", "redis-server"), ("baresip", "baresip-core")):
        if shutil.which(tool) is None:
            missing(f"{tool} not found (Debian's {package})", "telephony-deps", TELEPHONY_LOG)
    try:
        socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(0x0800)).close()
    except (PermissionError, AttributeError) as exc:
        missing(f"capturing the caller's packets on lo needs CAP_NET_RAW (root): {exc}",
                "test (as root)")


def _wait_for(check: object, what: str, proc: subprocess.Popen[bytes], log: Path,
              timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)


def _sip_port() -> int:
    """A loopback port free now for UDP and TCP, with the next one free for TCP: baresip and
    LiveKit SIP listen on both at their SIP port, and baresip puts its SIP/TLS listener on the
    port after it. A port free for UDP was once taken for TCP, and once the next one was
    (baresip did not start: "tcp: sock_bind: Address already in use", then "SIP/TLS transport
    failed")."""
    for _ in range(200):
        port = free_port(socket.SOCK_DGRAM)
        if all(_tcp_free(p) for p in (port, port + 1)):
            return port
    raise RuntimeError("no loopback port free for UDP and TCP with the next free for TCP")


def _tcp_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _port_range(count: int) -> int:
    """The first of ``count`` consecutive UDP ports that are free now (even, for RTP)."""
    for _ in range(200):
        start = free_port(socket.SOCK_DGRAM) & ~1
        if start + count > 65535:
            continue
        socks = []
        try:
            for port in range(start, start + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return start
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free UDP ports")


# ----------------------------------------------------------------------------- services


@contextlib.contextmanager
def run_redis() -> Iterator[str]:
    """``redis-server`` on a free loopback port, no RDB/AOF, its dir a temp one; yields
    ``host:port``."""
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="breezert-redis-"))
    log_path = work / "redis.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(work), "--protected-mode", "yes"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: "Ready to accept connections" in log_path.read_text(errors="replace"),
                  "redis-server", proc, log_path)
        yield f"127.0.0.1:{port}"
    finally:
        _stop(proc, 10)
        log.close()
        shutil.rmtree(work, ignore_errors=True)


@dataclass
class SipService:
    sip_port: int
    rtp_ports: tuple[int, int]
    health_port: int
    log_path: Path
    pid: int = 0

    def uri(self, number: str) -> str:
        return f"sip:{number}@127.0.0.1:{self.sip_port}"

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def run_sip(server: Server, redis_address: str) -> Iterator[SipService]:
    """``livekit-sip`` for ``server``: SIP (UDP and TCP) and RTP on 127.0.0.1 only, the
    addresses it announces 127.0.0.1 (never a STUN look-up: ``use_external_ip`` stays off).
    ``max_cpu_utilization: 1``: its health page, which says it started, otherwise answers 429
    "under load" while the machine's CPUs are over 90 % busy (whoever uses them), and on this
    shared two-core box other work kept them so for the fixture's 30 s once (4 Dec): it did not
    start. The limit gates only calls it places (``CreateSIPParticipant``), none of ours.
    It runs at the agent's priority, as the server does: it carries the agent's audio to the
    caller on its own 20 ms clock, and at nice 0 beside 1.6 cores of other work that clock once
    ran 75 ms late (the caller heard a 75 ms gap while the agent's RTP left at most 34 ms apart
    and the machine never stopped)."""
    binary = sip_binary()
    sip_port, health_port = _sip_port(), free_port()
    rtp = _port_range(SIP_RTP_RANGE)
    config = (f"api_key: {API_KEY}\napi_secret: {API_SECRET}\nws_url: {server.ws_url}\n"
              f"redis:\n  address: {redis_address}\n"
              f"sip_port: {sip_port}\nrtp_port: {rtp}-{rtp + SIP_RTP_RANGE - 1}\n"
              f"health_port: {health_port}\nlisten_ip: 127.0.0.1\nnat_1_to_1_ip: 127.0.0.1\n"
              "use_external_ip: false\nmax_cpu_utilization: 1\nlogging:\n  level: info\n")
    log_path = Path(tempfile.mkdtemp(prefix="breezert-sip-")) / "sip.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([str(binary), "--config-body", config], stdout=log,
                            stderr=subprocess.STDOUT, preexec_fn=agent_priority)
    try:
        _wait_for(lambda: _healthy(health_port), "livekit-sip", proc, log_path)
        yield SipService(sip_port, (rtp, rtp + SIP_RTP_RANGE - 1), health_port, log_path,
                         proc.pid)
    finally:
        _stop(proc, 10)
        log.close()
        _keep_last_log(log_path, "breezert-livekit-sip.log")


async def create_dispatch(server: Server, number: str, greeting: str,
                          sample_rate: int | None = None) -> None:
    """An inbound trunk for calls from loopback to ``number`` and its dispatch rule: each call
    in a room of its own (``call-...``) with the agent dispatched, and the SIP participant
    carrying the text the agent greets it with (and the rate of the plugin's audio for it,
    ``None``: the worker's default)."""
    attributes = {GREETING_ATTRIBUTE: greeting}
    if sample_rate is not None:
        attributes[SAMPLE_RATE_ATTRIBUTE] = str(sample_rate)
    async with api.LiveKitAPI(server.http_url, API_KEY, API_SECRET) as lkapi:
        trunk = await lkapi.sip.create_inbound_trunk(api.CreateSIPInboundTrunkRequest(
            trunk=api.SIPInboundTrunkInfo(name=f"breezert-{number}", numbers=[number],
                                          allowed_addresses=["127.0.0.1/32"])))
        await lkapi.sip.create_dispatch_rule(api.CreateSIPDispatchRuleRequest(
            dispatch_rule=api.SIPDispatchRuleInfo(
                name=f"breezert-{number}", trunk_ids=[trunk.sip_trunk_id],
                rule=api.SIPDispatchRule(dispatch_rule_individual=api.SIPDispatchRuleIndividual(
                    room_prefix="call-")),
                attributes=attributes,
                # the room goes 1 s after the call and the agent left it (default: 20 s)
                room_config=api.RoomConfiguration(
                    departure_timeout=1,
                    agents=[api.RoomAgentDispatch(agent_name=AGENT_NAME)]))))


# ----------------------------------------------------------------------------- capture


SO_TIMESTAMPNS, SO_ATTACH_FILTER = 35, 26  # <asm-generic/socket.h>
PACKET_OUTGOING = 4  # <linux/if_packet.h>: lo shows each packet once outgoing, once incoming


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def _udp_port_filter(port: int, first: int, last: int) -> list[tuple[int, int, int, int]]:
    """Classic BPF over an IPv4 packet (no link header): UDP, not a later fragment, to ``port``
    or to ``first..last``; so the kernel, not this process, drops the rest of lo's traffic."""
    accept, drop = 9, 10
    program = [  # (code, jump-if-true target, jump-if-false target, k); targets are indexes
        (0x30, 1, 1, 9),            # 0 ldb [9]             IP protocol
        (0x15, 2, drop, 17),        # 1 jeq #17 (UDP)
        (0x28, 3, 3, 6),            # 2 ldh [6]             flags + fragment offset
        (0x45, drop, 4, 0x1FFF),    # 3 jset #0x1fff        a later fragment: drop
        (0xB1, 5, 5, 0),            # 4 ldxb 4*([0]&0xf)    IP header length
        (0x48, 6, 6, 2),            # 5 ldh [x+2]           UDP destination port
        (0x15, accept, 7, port),    # 6 jeq #port
        (0x35, 8, drop, first),     # 7 jge #first
        (0x25, drop, accept, last),  # 8 jgt #last
        (0x06, 0, 0, 1 << 18),      # 9 ret #262144         accept
        (0x06, 0, 0, 0),            # 10 ret #0             drop
    ]
    return _relative(program)


def _udp_either_family_filter(port: int) -> list[tuple[int, int, int, int]]:
    """Classic BPF over an IPv4 or IPv6 packet (no link header, no IPv6 extension headers): UDP
    from or to ``port``. The agent's WebRTC may reach the server over either family (IPv6 here)."""
    accept, drop = 17, 18
    program = [
        (0x30, 1, 1, 0),            # 0 ldb [0]             version << 4 | ...
        (0x54, 2, 2, 0xF0),         # 1 and #0xf0
        (0x15, 3, 9, 0x40),         # 2 jeq #0x40 (IPv4)
        (0x30, 4, 4, 9),            # 3 ldb [9]             protocol
        (0x15, 5, drop, 17),        # 4 jeq #17 (UDP)
        (0x28, 6, 6, 6),            # 5 ldh [6]             flags + fragment offset
        (0x45, drop, 7, 0x1FFF),    # 6 jset #0x1fff        a later fragment: drop
        (0xB1, 8, 8, 0),            # 7 ldxb 4*([0]&0xf)    x: the UDP header's offset
        (0x45, drop, 13, 0),        # 8 jset #0             never set: on to 13
        (0x15, 10, drop, 0x60),     # 9 jeq #0x60 (IPv6)
        (0x30, 11, 11, 6),          # 10 ldb [6]            next header
        (0x15, 12, drop, 17),       # 11 jeq #17 (UDP)
        (0x01, 13, 13, 40),         # 12 ldx #40            x: the UDP header's offset
        (0x48, 14, 14, 0),          # 13 ldh [x+0]          source port
        (0x15, accept, 15, port),   # 14 jeq #port
        (0x48, 16, 16, 2),          # 15 ldh [x+2]          destination port
        (0x15, accept, drop, port),  # 16 jeq #port
        (0x06, 0, 0, 1 << 18),      # 17 ret #262144        accept
        (0x06, 0, 0, 0),            # 18 ret #0             drop
    ]
    return _relative(program)


def _relative(program: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Rows with absolute jump targets, as the kernel takes them: relative to the next
    instruction (unused by loads and returns: 0)."""
    return [(code, jt - i - 1 if code & 0x07 == 0x05 else 0,
             jf - i - 1 if code & 0x07 == 0x05 else 0, k)
            for i, (code, jt, jf, k) in enumerate(program)]


def _attach_filter(sock: socket.socket, program: list[tuple[int, int, int, int]]) -> object:
    """Attaches ``program`` to ``sock``; returns what must stay alive as long as it does."""
    array = (_SockFilter * len(program))(*(_SockFilter(*row) for row in program))
    fprog = _SockFprog(len(program), ctypes.cast(array, ctypes.POINTER(_SockFilter)))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(fprog))
    return array


@dataclass(frozen=True)
class Packet:
    t: float  # the kernel's arrival stamp, on time.monotonic()'s clock
    src_port: int
    dst_port: int
    payload: bytes


class Capture:
    """Every UDP packet on ``lo`` to ``port`` or ``first..last`` (IPv4), stamped by the kernel
    on arrival (so a busy test process does not move the stamps). Needs CAP_NET_RAW.
    ``Capture.either_way(port)``: IPv4 and IPv6, from or to ``port``."""

    def __init__(self, port: int, first: int, last: int, *, either_way: bool = False) -> None:
        self.ports = {port, *range(first, last + 1)}
        self._either_way = either_way
        self.packets: list[Packet] = []
        protocol, program = ((0x0003, _udp_either_family_filter(port)) if either_way  # ETH_P_ALL
                             else (0x0800, _udp_port_filter(port, first, last)))  # ETH_P_IP
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(protocol))
        self._filter = _attach_filter(self._sock, program)
        self._sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self._sock.bind(("lo", 0))
        self._sock.settimeout(0.2)
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="lo-capture", daemon=True)
        self._thread.start()

    @classmethod
    def either_way(cls, port: int) -> Capture:
        return cls(port, port, port, either_way=True)

    def close(self) -> None:
        self._running = False
        self._thread.join(2)
        self._sock.close()

    def _loop(self) -> None:
        while self._running:
            try:
                data, ancdata, _flags, addr = self._sock.recvmsg(65536, 64)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            if addr[2] == PACKET_OUTGOING or len(data) < 28:
                continue
            if data[0] >> 4 == 6:  # the filter let only UDP without extension headers through
                header = 40
            elif data[0] >> 4 == 4 and data[9] == socket.IPPROTO_UDP:
                header = (data[0] & 0x0F) * 4
            else:
                continue
            src, dst = struct.unpack_from("!HH", data, header)
            if dst not in self.ports and not (self._either_way and src in self.ports):
                continue
            stamp = time.time()
            for level, kind, value in ancdata:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = struct.unpack("qq", value[:16])
                    stamp = sec + nsec * 1e-9
            # realtime -> monotonic, both read now (the offset moves only if the clock is set)
            t = stamp - time.time() + time.monotonic()
            self.packets.append(Packet(t, src, dst, data[header + 8:]))


# ----------------------------------------------------------------------------- G.711 + RTP


def _ulaw_table() -> np.ndarray:
    codes = ~np.arange(256, dtype=np.int32) & 0xFF
    sign, exponent, mantissa = codes & 0x80, (codes >> 4) & 0x07, codes & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(sign, -magnitude, magnitude).astype(np.int16)


def _alaw_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int32) ^ 0x55
    sign, exponent, mantissa = codes & 0x80, (codes >> 4) & 0x07, codes & 0x0F
    magnitude = np.where(exponent == 0, (mantissa << 4) + 8,
                         ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0))
    return np.where(sign, magnitude, -magnitude).astype(np.int16)


G711_DECODE = {0: _ulaw_table(), 8: _alaw_table()}


@dataclass(frozen=True)
class RtpPacket:
    t: float
    payload_type: int
    seq: int
    timestamp: int
    samples: np.ndarray  # int16, decoded

    @property
    def rms(self) -> float:
        x = self.samples.astype(np.float32)
        return float(np.sqrt(np.mean(x * x))) if x.size else 0.0


def _rtp_header(data: bytes) -> tuple[int, int, int, int] | None:
    """(payload type, sequence number, timestamp, payload offset) of an RTP packet; ``None``
    for anything else on the port (STUN, DTLS)."""
    if len(data) < 12 or data[0] >> 6 != 2:
        return None
    csrc, has_ext = data[0] & 0x0F, data[0] & 0x10
    seq, timestamp = struct.unpack_from("!HI", data, 2)
    offset = 12 + 4 * csrc
    if has_ext and len(data) >= offset + 4:
        offset += 4 + 4 * struct.unpack_from("!H", data, offset + 2)[0]
    return data[1] & 0x7F, seq, timestamp, offset


def parse_rtp(packet: Packet) -> RtpPacket | None:
    data = packet.payload
    header = _rtp_header(data)
    if header is None:
        return None
    payload_type, seq, timestamp, offset = header
    end = len(data) - (data[-1] if data[0] & 0x20 else 0)
    table = G711_DECODE.get(payload_type)
    samples = table[np.frombuffer(data[offset:end], dtype=np.uint8)] if table is not None \
        else np.zeros(0, np.int16)
    return RtpPacket(packet.t, payload_type, seq, timestamp, samples)


@dataclass(frozen=True)
class MediaPacket:
    """One SRTP packet through the server's media port: its header is clear, its audio not."""

    t: float  # the kernel's stamp as it went through lo, on time.monotonic()'s clock
    seq: int
    timestamp: int
    size: int  # payload bytes (encrypted audio and the SRTP tag)


def udp_ports_of(pid: int) -> set[int]:
    """The local UDP ports (IPv4 and IPv6) of process ``pid``'s sockets, from ``/proc``."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/udp", "/proc/net/udp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                fields = row.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


class MediaWatch:
    """The agent's audio on its way to the caller, at the server's media port (``Capture``,
    either way): what the agent sent (its RTP to the server, stamped as it left the agent) and
    what LiveKit SIP received of it (the server's RTP to the bridge). Who sent or got a packet is
    told by who owns its port (``own``, called while the call is up: each call's WebRTC takes
    fresh ports)."""

    def __init__(self, server_port: int, agent_pid: int, bridge_pid: int) -> None:
        self._server_port, self._pids = server_port, (agent_pid, bridge_pid)
        self._owned: tuple[set[int], set[int]] = (set(), set())
        self._capture = Capture.either_way(server_port)

    def own(self) -> None:
        table = processes()
        for ports, root in zip(self._owned, self._pids):
            for pid in tree(table, root):  # a job in a process of its own owns its sockets
                ports |= udp_ports_of(pid)

    def close(self) -> tuple[list[MediaPacket], list[MediaPacket]]:
        """(what the agent sent, what LiveKit SIP received), each in time order."""
        self._capture.close()
        agent, bridge = self._owned
        sent: list[MediaPacket] = []
        received: list[MediaPacket] = []
        for packet in self._capture.packets:
            header = _rtp_header(packet.payload)
            if header is None or header[0] in RTCP_TYPES:
                continue
            row = MediaPacket(packet.t, header[1], header[2], len(packet.payload) - header[3])
            if packet.src_port in agent and packet.dst_port == self._server_port:
                sent.append(row)
            elif packet.src_port == self._server_port and packet.dst_port in bridge:
                received.append(row)
        return sent, received


def longest_step(packets: list[MediaPacket], since: float, until: float) -> tuple[float, float]:
    """(the longest time between consecutive packets, the stamp of the packet that ended it),
    of the steps that ended in [since, until]; (0.0, since) when none did."""
    times = sorted(p.t for p in packets)
    return max(((b - a, b) for a, b in zip(times, times[1:]) if since <= b <= until),
               default=(0.0, since))


# ----------------------------------------------------------------------------- caller


def _netstring(body: dict[str, object]) -> bytes:
    raw = json.dumps(body).encode()
    return f"{len(raw)}:".encode() + raw + b","


@dataclass
class Call:
    """What one call brought the caller."""

    codec: str
    answered_at: float | None = None  # kernel stamp of the 200 OK to the INVITE
    answer_sdp: str = ""
    rtp: list[RtpPacket] = field(default_factory=list)
    events: list[dict[str, object]] = field(default_factory=list)
    recording: tuple[np.ndarray, int] | None = None  # baresip's decoded-audio dump: int16 PCM, rate
    agent_sent: list[MediaPacket] = field(default_factory=list)  # ``MediaWatch``: the agent's RTP
    bridge_received: list[MediaPacket] = field(default_factory=list)  # and LiveKit SIP's of it

    def energetic(self, since: float = 0.0, until: float = float("inf")) -> list[RtpPacket]:
        return [p for p in self.rtp if p.rms > CALLER_ENERGY_RMS and since <= p.t <= until]

    def longest_gap_s(self, since: float, until: float) -> float:
        """Longest time between the arrivals of consecutive energetic packets in [since, until]
        (20 ms when nothing is missing; a quiet packet counts as a gap, as does one that never
        came)."""
        times = [p.t for p in self.energetic(since, until)]
        return max((b - a for a, b in zip(times, times[1:])), default=0.0)

    def gap_window(self, since: float, until: float) -> tuple[float, float]:
        """The arrivals of the two energetic packets around the longest gap in [since, until]."""
        times = [p.t for p in self.energetic(since, until)]
        if len(times) < 2:
            return (since, since)
        start = max(range(len(times) - 1), key=lambda i: times[i + 1] - times[i])
        return times[start], times[start + 1]

    def describe_gap(self, since: float, until: float) -> str:
        """The packets around the longest gap: arrival step, sequence number and RMS of each
        (tells a late or lost packet from a quiet one)."""
        a, b = self.gap_window(since, until)
        if a == b:
            return "no gap"
        around = [p for p in self.rtp if a - 0.1 <= p.t <= b + 0.1 and p.samples.size]
        rows = [f"{(p.t - a) * 1000:+6.0f} ms seq {p.seq} rms {p.rms:.0f}" for p in around]
        return "; ".join(rows)


class Caller:
    """One ``baresip`` (SIP on loopback, G.711 ``codec`` only), its prompt from a WAV
    (``aufile``), what it decodes dumped to a WAV (``sndfile``), no sound device: its player is
    an ``aubridge`` device nothing reads. Driven over ``ctrl_tcp``; what reaches its SIP and
    RTP ports is captured (``Capture``)."""

    def __init__(self, codec: str, prompt_s: float = 30.0) -> None:
        if codec not in PAYLOAD_TYPES:
            raise ValueError(f"codec {codec!r} is not one of {sorted(PAYLOAD_TYPES)}")
        self.codec = codec
        self.work = Path(tempfile.mkdtemp(prefix="breezert-baresip-"))
        self.sip_port, self.ctrl_port = _sip_port(), free_port()
        self.rtp_start = _port_range(RTP_RANGE)
        self.prompt_s = prompt_s
        self.log_path = self.work / "baresip.log"
        self.call = Call(codec)
        self._proc: subprocess.Popen[bytes] | None = None
        self._capture: Capture | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._events: asyncio.Queue[dict[str, object]] = asyncio.Queue()
        self._token = 0
        self._replies: dict[str, asyncio.Future[dict[str, object]]] = {}
        self._read_task: asyncio.Task[None] | None = None
        self._unreadable: list[bytes] = []

    def _write_config(self) -> None:
        # the prompt: a 1 s tone then silence, long enough that LiveKit SIP's media timeout
        # never fires during a call (aufile stops sending at the end of the file)
        t = np.arange(int(G711_RATE * self.prompt_s)) / G711_RATE
        prompt = np.where(t < 1.0, 0.3 * np.sin(2 * np.pi * 440.0 * t), 0.0)
        sf.write(self.work / "prompt.wav", prompt, G711_RATE, subtype="PCM_16")
        (self.work / "config").write_text("\n".join((
            "poll_method epoll",
            f"sip_listen 127.0.0.1:{self.sip_port}",
            "net_interface 127.0.0.1",
            f"rtp_ports {self.rtp_start}-{self.rtp_start + RTP_RANGE - 1}",
            "rtcp_mux no",
            "jitter_buffer_delay 1-5",
            f"audio_source aufile,{self.work / 'prompt.wav'}",
            "audio_player aubridge,nowhere",
            "audio_alert aubridge,nowhere",
            "ausrc_srate 8000", "auplay_srate 8000", "ausrc_channels 1", "auplay_channels 1",
            "module_path /usr/lib/baresip/modules",
            "module g711.so", "module aufile.so", "module aubridge.so", "module sndfile.so",
            f"snd_path {self.work}",
            "module_tmp account.so",
            "module_app menu.so", "module_app ctrl_tcp.so",
            f"ctrl_tcp_listen 127.0.0.1:{self.ctrl_port}",
            "ringback_disabled yes",
            "call_local_timeout 60",
            "")))
        (self.work / "accounts").write_text(
            f"<sip:caller@127.0.0.1>;regint=0;audio_codecs={self.codec}/8000/1\n")

    async def __aenter__(self) -> Caller:
        self._write_config()
        self._capture = Capture(self.sip_port, self.rtp_start, self.rtp_start + RTP_RANGE - 1)
        log = open(self.log_path, "wb")
        self._proc = subprocess.Popen(["baresip", "-f", str(self.work), "-v"], stdout=log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                self._reader, self._writer = await asyncio.open_connection(
                    "127.0.0.1", self.ctrl_port)
                break
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"baresip did not start: {self.log_tail()}") from None
                await asyncio.sleep(0.05)
        self._read_task = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.command("quit"), 2)
            self._writer.close()
        if self._read_task is not None:
            self._read_task.cancel()
            await asyncio.gather(self._read_task, return_exceptions=True)
        if self._proc is not None:
            _stop(self._proc, 5)
        if self._capture is not None:
            self._capture.close()
        self._collect()
        _keep_last_log(self.log_path, "breezert-baresip.log")

    async def _read(self) -> None:
        assert self._reader is not None
        while True:
            length = int((await self._reader.readuntil(b":"))[:-1])
            raw = (await self._reader.readexactly(length + 1))[:-1]
            try:
                body = json.loads(raw)
            except ValueError:  # one unreadable message (bad UTF-8, say) must not stop replies
                self._unreadable.append(raw[:200])
                continue
            body["t"] = time.monotonic()
            if body.get("response"):
                future = self._replies.pop(str(body.get("token")), None)
                if future is not None and not future.done():
                    future.set_result(body)
            elif body.get("event"):
                self.call.events.append(body)
                await self._events.put(body)

    async def command(self, command: str, params: str = "") -> dict[str, object]:
        assert self._writer is not None
        self._token += 1
        token = str(self._token)
        future: asyncio.Future[dict[str, object]] = asyncio.get_running_loop().create_future()
        self._replies[token] = future
        self._writer.write(_netstring({"command": command, "params": params, "token": token}))
        await self._writer.drain()
        try:
            return await asyncio.wait_for(future, 5)
        except asyncio.TimeoutError:  # say why: the 4 Dec fresh clone saw one dial go unanswered
            self._replies.pop(token, None)
            task = self._read_task
            reader = ("stopped: " + repr(task.exception()) if task is not None and task.done()
                      and not task.cancelled() else "alive")
            raise AssertionError(
                f"baresip: no reply to {command} {params!r} in 5 s (its control reader is "
                f"{reader}; unreadable messages {self._unreadable}; events "
                f"{[e.get('type') for e in self.call.events]})\n{self.log_tail()}") from None

    async def wait_event(self, kind: str, timeout_s: float = 30.0) -> dict[str, object]:
        for event in self.call.events:
            if event.get("type") == kind:
                return event
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"baresip: no {kind} in {timeout_s} s; events "
                                     f"{[e.get('type') for e in self.call.events]}\n"
                                     f"{self.log_tail()}")
            try:
                event = await asyncio.wait_for(self._events.get(), remaining)
            except asyncio.TimeoutError:
                continue
            if event.get("type") == kind:
                return event

    async def dial(self, uri: str) -> None:
        reply = await self.command("dial", uri)
        assert reply.get("ok"), f"baresip refused to dial {uri}: {reply}"

    async def hangup(self) -> float:
        hung_up = time.monotonic()
        await self.command("hangup")
        return hung_up

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def snapshot(self) -> Call:
        """The call as captured so far (answer, RTP received); ``__aexit__`` adds the dump."""
        self._collect()
        return self.call

    def _collect(self) -> None:
        if self._capture is None:
            return
        packets = list(self._capture.packets)
        rtp = [parse_rtp(p) for p in packets if p.dst_port != self.sip_port]
        self.call.rtp = [p for p in rtp if p is not None and p.payload_type not in RTCP_TYPES]
        for packet in packets:
            if packet.dst_port != self.sip_port or self.call.answered_at is not None:
                continue
            text = packet.payload.decode(errors="replace")
            head, _, body = text.partition("\r\n\r\n")
            lines = head.split("\r\n")
            cseq = next((ln for ln in lines if ln.lower().startswith("cseq:")), "")
            if lines[0].startswith("SIP/2.0 200") and "INVITE" in cseq:
                self.call.answered_at, self.call.answer_sdp = packet.t, body
        dumps = sorted(self.work.glob("dump-*dec*.wav"))
        # read now: the folder is removed when the caller exits
        self.call.recording = sf.read(dumps[-1], dtype="int16") if dumps else None


# ----------------------------------------------------------------------------- one call


@dataclass
class Telephony:
    """A server with Redis, LiveKit SIP for it, and the agent worker registered with it."""

    server: Server
    worker: Worker
    sip: SipService


@contextlib.contextmanager
def run_telephony(greeting: str) -> Iterator[Telephony]:
    """Redis, a livekit-server on it, livekit-sip, and ``room_worker.py`` greeting callers
    (``BREEZERT_TEST_GREETING``); ``components.missing`` where a component cannot be had."""
    require_tools()
    sip_binary()
    with (run_redis() as redis, run_server(f"redis:\n  address: {redis}\n") as server,
          run_sip(server, redis) as sip,
          run_worker(server, BREEZERT_TEST_GREETING=greeting) as worker):
        yield Telephony(server, worker, sip)


def all_events(worker: Worker) -> list[dict[str, Any]]:
    """Every event the worker wrote, of all rooms."""
    path = worker.state_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


async def wait_greeting(worker: Worker, since: float, timeout_s: float = 30.0) -> dict[str, Any]:
    """The worker's ``greet`` event of the call dialled at ``since`` (calls run one at a time)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in all_events(worker):
            if event["type"] == "greet" and event["t"] > since:
                return event
        await asyncio.sleep(0.05)
    raise AssertionError(f"the agent never greeted the call: {all_events(worker)[-8:]}\n"
                         f"{worker.log_tail()}")


@dataclass
class Heard:
    """One greeting's figures: at the caller, and at the agent for comparison."""

    codec: str
    plugin_rate: int  # TTS(sample_rate=)
    first_audio_s: float  # answer -> first energetic packet at the caller
    greet_s: float  # answer -> the agent's greet event (SIP's media wait + attribute signalling)
    ttfb_s: float  # the agent's TTFB for the turn (text sent -> first audio from the engine)
    span_s: float  # first -> last energetic packet at the caller, plus one packet
    gap_s: float  # longest time between energetic packets at the caller
    expected_s: float  # the audio the engine made for the turn
    agent_played_s: float  # the turn's playout at the agent (first source report -> done)
    agent_dry: int  # mid-turn source reports under 20 ms: the agent's own queue ran dry
    agent_reports: int

    def line(self) -> str:
        return (f"{self.codec}, plugin at {self.plugin_rate} Hz: first audio at the caller "
                f"{self.first_audio_s * 1000:.0f} ms after the answer (greeting "
                f"{self.greet_s * 1000:.0f} ms after it, agent TTFB {self.ttfb_s * 1000:.0f} "
                f"ms); heard {self.span_s:.3f} s of {self.expected_s:.3f} s, longest gap "
                f"{self.gap_s * 1000:.0f} ms; the agent played it in {self.agent_played_s:.3f} "
                f"s, its source queue under 20 ms in {self.agent_dry} of {self.agent_reports} "
                "reports mid-turn")

    def agent_real_time(self, tolerance_s: float) -> bool:
        """The agent played the turn in real time: its queue never ran dry mid-turn and the
        playout lasted the audio's length."""
        return self.agent_dry == 0 and abs(self.agent_played_s - self.expected_s) <= tolerance_s


def measure(call: Call, worker: Worker, greet: dict[str, Any], done: dict[str, Any],
            metrics: dict[str, Any], plugin_rate: int) -> Heard:
    """The greeting at the caller, and the same turn's playout at the agent: its RoomIO
    source's queue as reported every 50 ms (the last 300 ms aside, where it drains by design);
    a queue near zero mid-turn means the agent itself fell behind real time, before any
    network or bridge."""
    assert call.answered_at is not None, "no 200 OK to the INVITE reached the caller"
    heard = call.energetic(since=call.answered_at)
    assert heard, "the caller never heard the greeting"
    reports = [e for e in worker.events(greet["room"]) if e["type"] == "report"]
    assert reports, "the agent reported no playout"
    middle = [e for e in reports if reports[0]["t"] + 0.2 < e["t"] < done["t"] - 0.3]
    return Heard(
        codec=call.codec, plugin_rate=plugin_rate,
        first_audio_s=heard[0].t - call.answered_at, greet_s=greet["t"] - call.answered_at,
        ttfb_s=metrics["ttfb"], span_s=heard[-1].t - heard[0].t + 0.020,
        gap_s=call.longest_gap_s(heard[0].t, heard[-1].t),
        expected_s=metrics["audio_duration"], agent_played_s=done["t"] - reports[0]["t"],
        agent_dry=sum(e["buffered_s"] < 0.02 for e in middle), agent_reports=len(middle))


async def greeted_call(telephony: Telephony, codec: str, number: str,
                       plugin_rate: int) -> tuple[Call, Heard]:
    """Dials ``number`` (a dispatch rule with the plugin at ``plugin_rate``), waits until the
    agent's greeting played out and its tail reached the caller, hangs up; returns the call
    (with baresip's recording, and the agent's RTP as it left and as LiveKit SIP received it:
    ``MediaWatch``) and its figures."""
    worker = telephony.worker
    caller = Caller(codec)
    media = MediaWatch(telephony.server.udp_port, worker.pid, telephony.sip.pid)
    try:
        async with caller:
            dialled = time.monotonic()
            await caller.dial(telephony.sip.uri(number))
            await caller.wait_event("CALL_ESTABLISHED")
            greet = await wait_greeting(worker, dialled)
            ready = await worker.wait_event(greet["room"], "ready")
            assert ready["sample_rate"] == plugin_rate, f"the agent ran at {ready['sample_rate']}"
            media.own()
            turn = f"greet-{greet['identity']}"
            done = await worker.wait_event(greet["room"], "done", id=turn, timeout_s=30)
            metrics = await worker.wait_event(greet["room"], "tts_metrics", id=turn)
            await asyncio.sleep(0.5)  # the tail reaches the caller
            media.own()
            heard = measure(caller.snapshot(), worker, greet, done, metrics, plugin_rate)
            await caller.hangup()
            await caller.wait_event("CALL_CLOSED", timeout_s=10)
    finally:
        caller.call.agent_sent, caller.call.bridge_received = media.close()
    return caller.call, heard
