"""First audio at a phone caller against the agent's TTFB, over real calls through LiveKit SIP.

    flock /work/cpu.lock env PYTHONPATH=runtime:. .venv/bin/python bench/sip_first_audio.py \
        --calls 10 --out bench/results/sip-cpu-tiny-$(date -u +%Y%m%d).json

The set-up of ``tests/livekit/test_sip.py`` (Redis, livekit-server, livekit-sip, the agent
worker on the embedded tiny CPU model, a baresip caller over G.711): ``--calls`` calls for each
plugin rate, interleaved (24000, 8000, 24000, ...) so both see the same machine. Each call
greets the caller with one 2 s sentence. Per call: first audio at the caller (the kernel's
arrival stamps: the 200 OK, then the first energetic RTP packet), the agent's TTFB of the same
turn, when the greeting started (SIP's media wait and the ``sip.callStatus`` signalling), the
longest gap and the span at the caller, the agent's own playout (its source queue), and the
CPU seconds of the worker and of livekit-sip during the call. Writes one JSON and prints the
table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "runtime"), str(REPO)]

from breezert_bench.provenance import load_avg, provenance  # noqa: E402
from tests.livekit.telephony import (  # noqa: E402
    SIP_BIN,
    Telephony,
    create_dispatch,
    greeted_call,
    run_telephony,
)

GREETING = "Hello from the agent."  # one segment: 25 frames = 2.0 s of tiny-model noise
NUMBERS = {24000: "+15550124", 8000: "+15550108"}
MAX_GAP_S, DURATION_TOLERANCE_S = 0.060, 0.100  # as tests/livekit/test_sip.py


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def version(command: list[str]) -> str:
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=10)
    except OSError:
        return "unknown"
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr) \
        else "unknown"


async def one_call(telephony: Telephony, rate: int, codec: str) -> dict[str, Any]:
    worker_cpu, sip_cpu = cpu_s(telephony.worker.pid), cpu_s(telephony.sip.pid)
    started = time.monotonic()
    _, heard = await greeted_call(telephony, codec, NUMBERS[rate], rate)
    row = asdict(heard)
    row.update(
        wall_s=time.monotonic() - started,
        worker_cpu_s=cpu_s(telephony.worker.pid) - worker_cpu,
        sip_cpu_s=cpu_s(telephony.sip.pid) - sip_cpu,
        after_ttfb_s=heard.first_audio_s - heard.greet_s - heard.ttfb_s,
        real_time=(heard.gap_s <= MAX_GAP_S
                   and abs(heard.span_s - heard.expected_s) <= DURATION_TOLERANCE_S),
        agent_real_time=heard.agent_real_time(DURATION_TOLERANCE_S),
    )
    print(heard.line(), flush=True)
    return row


def opus_from_the_room(sip_log: Path) -> dict[str, list[int]]:
    """Opus bytes LiveKit SIP received from the agent's track, per call, by called number (its
    ``call statistics`` log line at the end of each call)."""
    calls: dict[str, list[int]] = {}
    for line in sip_log.read_text(errors="replace").splitlines():
        if "call statistics" not in line:
            continue
        fields = json.loads(line[line.index("{"):])
        calls.setdefault(fields.get("toUser", "?"), []).append(
            int(fields["stats"]["room"]["input_bytes"]))
    return calls


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(key: str, scale: float = 1.0) -> dict[str, float]:
        values = sorted(row[key] * scale for row in rows)
        return {"p50": round(statistics.median(values), 3),
                "p90": round(values[min(len(values) - 1, int(0.9 * len(values)))], 3),
                "min": round(values[0], 3), "max": round(values[-1], 3)}

    return {
        "calls": len(rows),
        "first_audio_at_caller_ms": stats("first_audio_s", 1000),
        "agent_ttfb_ms": stats("ttfb_s", 1000),
        "greeting_after_answer_ms": stats("greet_s", 1000),
        "after_ttfb_ms": stats("after_ttfb_s", 1000),
        "longest_gap_ms": stats("gap_s", 1000),
        "heard_span_s": stats("span_s"),
        "agent_played_s": stats("agent_played_s"),
        "worker_cpu_s": stats("worker_cpu_s"),
        "sip_cpu_s": stats("sip_cpu_s"),
        "real_time_calls": sum(row["real_time"] for row in rows),
        "agent_real_time_calls": sum(row["agent_real_time"] for row in rows),
    }


def table(summaries: dict[str, dict[str, Any]]) -> str:
    lines = ["| plugin rate | calls | first audio at caller p50 (p90) | agent TTFB p50 (p90) | "
             "greeting after answer p50 | after TTFB p50 | longest gap p50 (max) | "
             "heard span p50 | worker CPU/call p50 | Opus to SIP/call p50 | "
             "real-time calls (agent real-time) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for rate, s in summaries.items():
        lines.append(
            f"| {rate} Hz | {s['calls']} | {s['first_audio_at_caller_ms']['p50']:.0f} "
            f"({s['first_audio_at_caller_ms']['p90']:.0f}) ms | {s['agent_ttfb_ms']['p50']:.0f} "
            f"({s['agent_ttfb_ms']['p90']:.0f}) ms | {s['greeting_after_answer_ms']['p50']:.0f} "
            f"ms | {s['after_ttfb_ms']['p50']:.0f} ms | {s['longest_gap_ms']['p50']:.0f} "
            f"({s['longest_gap_ms']['max']:.0f}) ms | {s['heard_span_s']['p50']:.2f} s | "
            f"{s['worker_cpu_s']['p50']:.2f} s | "
            f"{s.get('opus_bytes_per_call_p50', float('nan')) / 1000:.1f} kB | "
            f"{s['real_time_calls']} "
            f"({s['agent_real_time_calls']}) |")
    return "\n".join(lines)


async def run(telephony: Telephony, args: argparse.Namespace) -> dict[str, Any]:
    for rate, number in NUMBERS.items():
        await create_dispatch(telephony.server, number, GREETING, sample_rate=rate)
    rates = [int(r) for r in args.rates.split(",")]
    for rate in rates:  # one warm-up call each: first jobs pay imports and the engine's warm-up
        await one_call(telephony, rate, args.codec)
    calls: dict[int, list[dict[str, Any]]] = {rate: [] for rate in rates}
    for _ in range(args.calls):
        for rate in rates:
            calls[rate].append(await one_call(telephony, rate, args.codec))
            await asyncio.sleep(args.pause_s)
    engine = telephony.worker.metrics()["engine"]
    opus = opus_from_the_room(telephony.sip.log_path)
    summaries = {str(r): summary(rows) for r, rows in calls.items()}
    for rate, number in NUMBERS.items():
        if str(rate) in summaries and opus.get(number):
            summaries[str(rate)]["opus_bytes_per_call_p50"] = statistics.median(opus[number])
    return {"calls": {str(r): rows for r, rows in calls.items()},
            "summary": summaries,
            "engine": {"rtf": engine.get("rtf"), "ttfb_s": engine.get("ttfb_s"),
                       "counters": engine.get("counters")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10, help="calls per plugin rate")
    parser.add_argument("--rates", default="24000,8000", help="plugin rates, interleaved")
    parser.add_argument("--codec", default="PCMU", choices=("PCMU", "PCMA"))
    parser.add_argument("--pause-s", type=float, default=0.5, help="between calls")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    metadata = {
        "schema": "breezert-sip-bench/1",
        **provenance(device="cpu"),
        "command_line": " ".join(sys.argv),
        "model": "embedded cpu-tiny profile (random tiny checkpoint), Predictor on, "
                 "torch 1 thread (tests/livekit/room_worker.py)",
        "components": {
            "livekit_server": version([os.environ.get(
                "BREEZERT_LIVEKIT_SERVER", str(REPO / ".cache/livekit/livekit-server")),
                "--version"]),
            "livekit_sip": f"github.com/livekit/sip v1.8.0 ({SIP_BIN.name})",
            "baresip": version(["dpkg-query", "-W", "-f", "${Version}", "baresip-core"]),
            "redis": version(["redis-server", "--version"]),
        },
        "codec": args.codec, "greeting": GREETING,
    }
    # run_telephony skips through pytest when a component is missing: say why and stop
    import pytest

    try:
        with run_telephony(GREETING) as telephony:
            result = asyncio.run(run(telephony, args))
    except pytest.skip.Exception as exc:
        sys.exit(f"cannot run: {exc}")
    result = {"metadata": metadata, **result}
    result["metadata"]["load_avg_1m_after"] = load_avg()
    print(table({f"{r}": s for r, s in result["summary"].items()}))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
