"""The ``breezert-bench`` command line: the serving benchmark, and ``soak``.

``breezert-bench ARGS`` is the benchmark (what ``breezert bench ARGS`` was before the harness left
the runtime), ``breezert-bench soak ARGS`` the soak check (formerly ``breezert soak``); the flags
are unchanged. ``python -m breezert_bench`` is the same command.

Owns: argument parsing and printing. Must not: drive engines or servers itself; every command
calls into the harness (``runner``, ``soak``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from breezert.cli import config_argument
from breezert.errors import BreezeRTError


def bench_parser() -> argparse.ArgumentParser:
    """``breezert-bench``'s flags (the benchmark)."""
    bench = argparse.ArgumentParser(
        prog="breezert-bench",
        description="Serving benchmark: TTFB, underruns, RTF per variant/load.",
        epilog="breezert-bench soak --help: the soak check (faulty traffic, then a leak check).")
    bench.add_argument("--config", type=config_argument, default=None,
                       help="engine profile, a TOML path or a packaged profile name (default: "
                            "configs/h200-latency.toml with CUDA, else cpu-tiny)")
    bench.add_argument("--texts", type=Path, default=None,
                       help="id<TAB>text file (default: ../shared/bench/texts_en.tsv, else a "
                            "built-in list)")
    bench.add_argument("--concurrency", default=None,
                       help="closed loop: callers, each with one request in flight (a refused "
                            "one is said again after its Retry-After), comma list (default "
                            "1,4,8,16,32,64 unless --rate is given)")
    bench.add_argument("--rate", default=None,
                       help="open loop: Poisson arrivals in requests/s, comma list")
    bench.add_argument("--num-requests", type=int, default=300, help="measured requests per run")
    bench.add_argument("--warmup", type=int, default=2, help="unmeasured requests before each run")
    bench.add_argument("--variants", default=None,
                       help="comma list of fixed16-eager, progressive-eager, "
                            "progressive-compiled, progressive-graphs, naive, config (the "
                            "profile as is), or names defined with --variant")
    bench.add_argument("--variant", action="append", default=[],
                       metavar="NAME=[BASE;]SECTION.KEY=VALUE;...",
                       help="define a variant (BASE: a builtin variant, or @PATH: another "
                            "profile in place of --config)")
    bench.add_argument("--out", type=Path, default=None,
                       help="result JSON (default bench/results/<config>-<date>.json); PNG beside")
    bench.add_argument("--server", default=None, metavar="URL",
                       help="drive a running `breezert serve` at this base URL (http://host:port)"
                            " over its WebSocket: client-side TTFB and gaps beside the server's "
                            "first-audio times (token: BREEZERT_AUTH_TOKEN)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--feedback", action=argparse.BooleanOptionalAction, default=True,
                       help="the simulated listener calls report_playback every "
                            "--feedback-period seconds while its request streams")
    bench.add_argument("--feedback-period", type=float, default=0.1,
                       help="seconds between the simulated listener's reports (default 0.1)")
    bench.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    bench.add_argument("--run-budget", type=float, default=None,
                       help="seconds per run after which no new request starts")
    bench.add_argument("--naive-requests", type=int, default=20,
                       help="requests of the naive baseline (sequential)")
    bench.add_argument("--model", default=None, help="checkpoint folder (sets model.path)")
    bench.add_argument("--tokenizer", default=None,
                       help="tokenizer.json for random weights (default: "
                            "../shared/breeze/tokenizer/tokenizer.json when present)")
    bench.add_argument("--device", choices=["cpu", "cuda", "auto"], default=None,
                       help="sets model.device")
    bench.add_argument("--torch-threads", type=int, default=None,
                       help="intra-op threads (default: 1 on CPU, torch's default on GPU)")
    bench.add_argument("--shard", default=None, metavar="I/N",
                       help="run only the I-th of N slices of each run's requests (one GPU per "
                            "shard; join them with python -m breezert_bench.report "
                            "--merge-shards)")
    bench.add_argument("--git-commit", default=None,
                       help="commit to record when the tree is not a git checkout")
    return bench


def soak_parser() -> argparse.ArgumentParser:
    """``breezert-bench soak``'s flags."""
    soak = argparse.ArgumentParser(
        prog="breezert-bench soak",
        description="Runs streams over HTTP and WebSocket, aborts mid-stream, cancels, idle open "
                    "turns, bad inputs and bursts past capacity against a server on loopback, "
                    "then checks that /metrics gauges return to idle (running 0, queued 0, KV "
                    "blocks and codec slots all free, open turns 0, peers 0) and that the "
                    "server's RSS grew less than --max-rss-growth-mb. Prints a JSON report; "
                    "exit status 1 on a leak or an unexpected answer.")
    soak.add_argument("--url", default=None,
                      help="target server (default: start breezert serve on a free loopback "
                           "port and read its RSS from /proc)")
    soak.add_argument("--config", type=config_argument, default=None,
                      help="TOML path or packaged profile of the started server (default: "
                           "cpu-tiny)")
    soak.add_argument("--duration", type=float, default=30.0, help="seconds of traffic")
    soak.add_argument("--concurrency", type=int, default=4, help="scenarios at once")
    soak.add_argument("--max-frames", type=int, default=25,
                      help="frames per request of the started server (keeps turns short)")
    soak.add_argument("--burst-size", type=int, default=48,
                      help="HTTP streams at once in each burst (past running + queued limits)")
    soak.add_argument("--burst-every", type=int, default=5, help="a burst every N rounds (0: none)")
    soak.add_argument("--max-rss-growth-mb", type=float, default=150.0,
                      help="RSS growth (after the first round -> end) that counts as a leak")
    soak.add_argument("--token", default=None, help="bearer token of the target server")
    soak.add_argument("--out", type=Path, default=None, help="also write the report here")
    return soak


def cmd_bench(args: argparse.Namespace) -> int:
    from breezert_bench.options import options_from_args
    from breezert_bench.report import plot, text_report, write_json
    from breezert_bench.runner import run_benchmark

    options, out = options_from_args(args)
    doc = run_benchmark(options, on_update=lambda partial: write_json(partial, out))
    write_json(doc, out)
    png = plot(doc, out.with_suffix(".png"))
    print(text_report(doc))
    print(f"wrote {out}" + (f" and {png}" if png else " (no PNG: matplotlib is not installed)"))
    return 0 if doc["runs"] else 1


def cmd_soak(args: argparse.Namespace) -> int:
    import json

    from breezert_bench.soak import SoakOptions, run_soak

    report = run_soak(SoakOptions(
        url=args.url, config=args.config, duration_s=args.duration,
        concurrency=args.concurrency, max_frames=args.max_frames, burst_size=args.burst_size,
        burst_every=args.burst_every, max_rss_growth_mb=args.max_rss_growth_mb,
        token=args.token))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if report["ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    soak = argv[:1] == ["soak"]
    name, command = ("breezert-bench soak", cmd_soak) if soak else ("breezert-bench", cmd_bench)
    args = (soak_parser().parse_args(argv[1:]) if soak else bench_parser().parse_args(argv))
    try:
        return command(args)
    except (BreezeRTError, ValueError, FileNotFoundError) as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
