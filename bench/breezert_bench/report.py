"""Benchmark output: the JSON document, the PNG plot and markdown / plain-text tables.

Owns: writing results (atomically, so a killed run leaves the last complete document), the
tables quoted in ``bench/README.md`` and the plot. Must not: run anything; it reads the result
document only. ``python -m breezert_bench.report RESULT.json`` prints the markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STAGES = ("text_encode", "prefill", "decode", "depth", "codec")
_GIB = 1024**3


def write_json(doc: dict[str, Any], path: Path) -> None:
    """Writes ``doc`` to ``path`` via a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(doc), encoding="utf-8")
    os.replace(tmp, path)


def dumps(doc: dict[str, Any]) -> str:
    """Indented JSON, except each run's per-request records: one compact line per request."""
    runs = [dict(run) for run in doc.get("runs", [])]
    records = [run.pop("requests", None) for run in runs]
    for i, run in enumerate(runs):
        if records[i] is not None:
            run["requests"] = f"@@requests:{i}@@"
    text = json.dumps({**doc, "runs": runs}, indent=1, default=str)
    for i, rows in enumerate(records):
        if rows is not None:
            body = ",\n   ".join(json.dumps(r, separators=(",", ":"), default=str) for r in rows)
            text = text.replace(f'"@@requests:{i}@@"', f"[\n   {body}\n  ]" if rows else "[]", 1)
    return text + "\n"


def merge(docs: Sequence[dict[str, Any]], sources: Sequence[str]) -> dict[str, Any]:
    """One document from several (e.g. variants run in separate device calls): the first one's
    metadata and config, every variant and run in order, and where each came from."""
    merged = {**docs[0], "variants": [], "runs": []}
    shards = {d["metadata"].get("shards") for d in docs}
    merged["metadata"] = {**docs[0]["metadata"], "shards": shards.pop() if len(shards) == 1
                          else "some"}
    merged["merged_from"] = [{"path": src, "metadata": d["metadata"]}
                             for src, d in zip(sources, docs)]
    for doc in docs:
        merged["variants"] += doc.get("variants", [])
        merged["runs"] += doc.get("runs", [])
    return merged


SHARD_RUN_FIELDS = ("num_requests", "wall_s", "audio_s_per_s", "requests_per_s",
                    "delivery_lag_s", "feedback_reports", "gpu_max_memory_bytes",
                    "frame_step_s_p50", "engine_metrics", "warmup_s", "startup_s", "load_avg_1m")


def merge_shards(docs: Sequence[dict[str, Any]], sources: Sequence[str]) -> dict[str, Any]:
    """One document from the n ``--shard I/N`` results of one benchmark (each shard on its own
    GPU, at the same concurrency): each variant's runs at one load point become one run over all
    the shards' requests.

    Request-level numbers (TTFB, RTF, underruns, audio) are recomputed from the joined
    per-request records. Throughput is per GPU (audio seconds over the shards' summed wall
    time); the frame step is the shards' mean p50; GPU memory the largest. Each shard's own
    numbers stay under ``shards``.

    Raises:
        ValueError: the documents are not the shards 1..n of one run.
    """
    from breezert_bench.listener import summarize_records

    def shard_of(doc: dict[str, Any]) -> tuple[int, ...]:
        return tuple(doc["metadata"]["options"].get("shard") or ())

    n = len(docs)
    order = sorted(range(n), key=lambda i: shard_of(docs[i]))
    docs, sources = [docs[i] for i in order], [sources[i] for i in order]
    if [shard_of(d) for d in docs] != [(i, n) for i in range(1, n + 1)]:
        raise ValueError(f"expected shards 1/{n}..{n}/{n} of one run, got "
                         f"{[shard_of(d) for d in docs]}")
    for key in ("num_requests", "seed", "load_points"):
        values = {json.dumps(d["metadata"]["options"].get(key)) for d in docs}
        if len(values) > 1:
            raise ValueError(f"the shards differ in {key}: {sorted(values)}")
    naive = {v["name"] for d in docs for v in d.get("variants", []) if v.get("naive")}
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for doc in docs:
        for run in doc["runs"]:
            groups.setdefault((run["variant"], run["load"]["label"]), []).append(run)
    for (variant, label), parts in groups.items():
        indices = [r["index"] for part in parts for r in part.get("requests", [])]
        if len(parts) != (1 if variant in naive else n) or len(set(indices)) != len(indices):
            raise ValueError(f"{variant} {label}: {len(parts)} of {n} shards ran it (or they "
                             "overlap); the join would not be one run")
    runs = []
    for parts in groups.values():
        records = sorted((r for part in parts for r in part.get("requests", [])),
                         key=lambda r: r["index"])
        wall = sum(p["wall_s"] for p in parts)
        steps = [p["frame_step_s_p50"] for p in parts if p.get("frame_step_s_p50") is not None]
        peaks = [p["gpu_max_memory_bytes"] for p in parts if p.get("gpu_max_memory_bytes")]
        run = {key: parts[0][key] for key in ("variant", "load", "feedback")}
        run["truncated"] = any(p.get("truncated") for p in parts)
        run.update(summarize_records(records))
        run.update({
            "wall_s": max(p["wall_s"] for p in parts),
            "audio_s_per_s": run["audio_s_total"] / wall if wall > 0 else None,
            "requests_per_s": run["num_ok"] / wall if wall > 0 else None,
            "feedback_reports": sum(p.get("feedback_reports", 0) for p in parts),
            "frame_step_s_p50": sum(steps) / len(steps) if steps else None,
            "gpu_max_memory_bytes": max(peaks, default=None),
            "startup_s": max((p.get("startup_s") or 0.0) for p in parts),
            "engine_metrics": parts[0].get("engine_metrics"),
            "shards": [{key: p.get(key) for key in SHARD_RUN_FIELDS} for p in parts],
            "requests": records,
        })
        runs.append(run)
    variants: dict[str, dict[str, Any]] = {}
    for doc in docs:  # a variant that failed or was skipped in any shard says so
        for variant in doc.get("variants", []):
            kept = variants.setdefault(variant["name"], variant)
            if variant.get("status") not in (None, "ok") and not (
                    variant.get("naive") and variant.get("status") == "skipped"):
                variants[variant["name"]] = {**kept, "status": variant["status"],
                                             "error": variant.get("error")}
    merged = {**docs[0], "variants": list(variants.values()), "runs": runs}
    merged["metadata"] = {**docs[0]["metadata"], "shards": n,
                          "options": {**docs[0]["metadata"]["options"], "shard": None}}
    merged["merged_from"] = [{"path": src, "metadata": d["metadata"]}
                             for src, d in zip(sources, docs)]
    return merged


def load_json(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------ tables


def _ms(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value * 1000:.{digits}f}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


COLUMNS = ("variant", "load", "ok/n", "TTFB p50 ms", "p95 ms", "p99 ms", "underrun reqs",
           "max extra buf ms", "RTF p50", "RTF p95", "audio s/s", "frame step ms",
           "busy", "codec ms/frame", "GPU peak GiB", "startup s")


def run_row(run: dict[str, Any]) -> list[str]:
    """One table row of a run (columns ``COLUMNS``)."""
    ttfb, rtf = run["ttfb_s"], run["rtf"]
    ok = f"{run['num_ok']}/{run['num_requests']}" + ("*" if run.get("truncated") else "")
    peak = run.get("gpu_max_memory_bytes")
    return [
        run["variant"], run["load"]["label"], ok,
        _ms(ttfb["p50"]), _ms(ttfb["p95"]), _ms(ttfb["p99"]),
        str(run["underrun_requests"]), _ms(run["max_extra_buffer_s"]),
        _num(rtf["p50"], ".3f"), _num(rtf["p95"], ".3f"), _num(run["audio_s_per_s"], ".1f"),
        _ms(run.get("frame_step_s_p50"), 1),
        _num(run.get("step_busy_fraction"), ".2f"), _num(run.get("codec_ms_per_frame"), ".3f"),
        "-" if peak is None else f"{peak / _GIB:.1f}", _num(run.get("startup_s"), ".1f"),
    ]


def stage_row(run: dict[str, Any]) -> list[str]:
    """``step p50 ms (mean rows)`` per stage, then the non-routine engine counters."""
    metrics = run.get("engine_metrics") or {}
    stages = metrics.get("stages", {})
    cells = [run["variant"], run["load"]["label"]]
    for stage in STAGES:
        entry = stages.get(stage)
        if not entry or entry["step_s"].get("p50") is None:
            cells.append("-")
            continue
        cells.append(f"{entry['step_s']['p50'] * 1000:.1f} ({entry['rows']['mean']:.1f})")
    counters = {k: v for k, v in metrics.get("counters", {}).items()
                if not k.startswith("requests_") and k != "chunks_emitted"}
    cells.append(", ".join(f"{k}={v}" for k, v in sorted(counters.items())) or "-")
    return cells


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*row) for row in [header, *rows])


def describe(doc: dict[str, Any]) -> str:
    """One line: machine, software, commit, date, workload."""
    meta = doc["metadata"]
    if meta.get("server_url"):
        opts = meta.get("options", {})
        return (f"server {meta['server_url']} (client on {meta.get('cpu')}) · commit "
                f"{meta.get('git_commit')} · {meta.get('date')} · {opts.get('num_requests')} "
                f"requests per run, warmup {opts.get('warmup')}, feedback "
                f"{'on' if opts.get('feedback') else 'off'} · TTFB and gaps at this client; "
                "server TTFB is the server's own say -> first audio")
    machine = meta.get("gpu") or f"CPU: {meta.get('cpu')} ({meta.get('torch_threads')} threads)"
    dirty = " (dirty tree)" if meta.get("git_dirty") else ""
    opts = meta.get("options", {})
    shards = {None: "", "some": " · some runs in shards, one GPU each (see merged_from)"}.get(
        meta.get("shards"), f" · {meta.get('shards')} shards of each run, one GPU each")
    if doc.get("merged_from"):
        shards += f" · merged from {len(doc['merged_from'])} result files"
    return (f"{machine} · torch {meta.get('torch_version')} · CUDA {meta.get('cuda_version')} · "
            f"commit {meta.get('git_commit')}{dirty} · {meta.get('date')} · "
            f"{opts.get('num_requests')} requests per run (naive: "
            f"{opts.get('naive_requests')}), warmup {opts.get('warmup')}, "
            f"feedback {'on' if opts.get('feedback') else 'off'} · config "
            f"{Path(str(meta.get('config_path'))).name}{shards}")


def variant_notes(doc: dict[str, Any]) -> list[str]:
    return [f"{v['name']}: {v.get('status')}: {v.get('error')}"
            for v in doc.get("variants", []) if v.get("status") not in (None, "ok")]


def markdown_report(doc: dict[str, Any]) -> str:
    """Markdown: the description line, the main table, per-stage step times, variant notes."""
    runs = doc["runs"]
    parts = [describe(doc), "", markdown_table(COLUMNS, [run_row(r) for r in runs])]
    engine_runs = [r for r in runs if r.get("engine_metrics")]
    if engine_runs:
        header = ["variant", "load", *(f"{s} ms (rows)" for s in STAGES), "counters"]
        parts += ["", "Per-stage step time p50 in ms (mean batch rows):", "",
                  markdown_table(header, [stage_row(r) for r in engine_runs])]
    notes = variant_notes(doc)
    if notes:
        parts += ["", *(f"- {n}" for n in notes)]
    return "\n".join(parts)


def text_report(doc: dict[str, Any]) -> str:
    """The compact table printed after a run (with the server's TTFB beside the client's when
    the runs drove a server)."""
    parts = [describe(doc), text_table(COLUMNS, [run_row(r) for r in doc["runs"]])]
    served = [r for r in doc["runs"] if r.get("server_ttfb_s")]
    if served:
        parts.append(text_table(
            ("variant", "load", "client TTFB p50 ms", "p95 ms", "server TTFB p50 ms", "p95 ms"),
            [[r["variant"], r["load"]["label"], _ms(r["ttfb_s"]["p50"]), _ms(r["ttfb_s"]["p95"]),
              _ms(r["server_ttfb_s"]["p50"]), _ms(r["server_ttfb_s"]["p95"])] for r in served]))
    parts += variant_notes(doc)
    return "\n".join(parts)


# ------------------------------------------------------------------------------------ plot


def plot(doc: dict[str, Any], path: Path) -> Path | None:
    """TTFB p50/p95, underrun requests, RTF p50/p95 and audio s/s against load, per variant.

    Load points are categorical on x (``c=N`` closed loop, ``r=R/s`` open loop, in run order);
    the naive baseline, which has one sequential point, is drawn as a horizontal line. Returns
    the path, or ``None`` without matplotlib (redraw later with ``report RESULT.json --plot``).
    """
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    loads = [r["load"] for r in runs if r["load"]["mode"] != "sequential"]
    labels = list(dict.fromkeys(load["label"] for load in loads))
    x_of = {label: i for i, label in enumerate(labels)}
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    (ax_ttfb, ax_under), (ax_rtf, ax_tput) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(variants):
        color = colors[i % len(colors)]
        mine = [r for r in runs if r["variant"] == name]
        seq = [r for r in mine if r["load"]["mode"] == "sequential"]
        pts = [r for r in mine if r["load"]["mode"] != "sequential"]
        if seq:
            _hline(ax_ttfb, seq[0]["ttfb_s"]["p50"], 1000, color, f"{name} p50 (seq)")
            _hline(ax_rtf, seq[0]["rtf"]["p50"], 1, color, f"{name} p50 (seq)")
            _hline(ax_tput, seq[0]["audio_s_per_s"], 1, color, f"{name} (seq)")
            continue
        xs = [x_of[r["load"]["label"]] for r in pts]
        for q, style in (("p50", "-"), ("p95", "--")):
            ys = [_scale(r["ttfb_s"][q], 1000) for r in pts]
            _line(ax_ttfb, xs, ys, color, style, f"{name} {q}")
        _line(ax_rtf, xs, [r["rtf"]["p50"] for r in pts], color, "-", f"{name} p50")
        _line(ax_rtf, xs, [r["rtf"]["p95"] for r in pts], color, "--", f"{name} p95")
        _line(ax_tput, xs, [r["audio_s_per_s"] for r in pts], color, "-", name)
        _underrun_bars(ax_under, xs, pts, i, len(variants), color, name)
    for ax, title, ylabel in (
        (ax_ttfb, "TTFB (enqueue → first chunk)", "ms (log)"),
        (ax_under, "requests with an underrun (label: largest extra buffer needed)",
         "requests"),
        (ax_rtf, "RTF per request (wall / audio)", "RTF"),
        (ax_tput, "aggregate audio seconds per wall second", "audio s / s"),
    ):
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.set_xticks(range(len(labels)), labels)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if any(r["ttfb_s"]["p50"] for r in runs):
        ax_ttfb.set_yscale("log")
    ax_under.set_ylim(0, max([1] + [r["underrun_requests"] for r in runs]) * 1.25)
    ax_under.yaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(describe(doc), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _underrun_bars(ax: Any, xs: list[int], runs: list[dict[str, Any]], index: int,
                   num_variants: int, color: str, name: str) -> None:
    """Bars of requests with an underrun, labelled with the largest extra buffer in ms."""
    width = 0.8 / max(1, num_variants)
    lefts = [x + (index - (num_variants - 1) / 2) * width for x in xs]
    heights = [r["underrun_requests"] for r in runs]
    ax.bar(lefts, heights, width=width, color=color, label=name)
    for left, height, run in zip(lefts, heights, runs):
        if height:
            ax.annotate(f"+{run['max_extra_buffer_s'] * 1000:.0f} ms", (left, height),
                        ha="center", va="bottom", fontsize=6)


def _scale(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _line(ax: Any, xs: list[int], ys: list[float | None], color: str, style: str,
          label: str) -> None:
    pairs = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if pairs:
        ax.plot(*zip(*pairs), style, color=color, marker="o", markersize=3, label=label)


def _hline(ax: Any, value: float | None, factor: float, color: str, label: str) -> None:
    if value is not None:
        ax.axhline(value * factor, color=color, linestyle=":", label=label)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m breezert_bench.report",
                                     description="Print a benchmark result as markdown tables.")
    parser.add_argument("result", type=Path, nargs="+", help="bench/results/*.json")
    parser.add_argument("--plot", action="store_true", help="also (re)draw the PNG beside it")
    parser.add_argument("--merge", type=Path, default=None, metavar="OUT.json",
                        help="merge the results into one document (and its PNG) and print it")
    parser.add_argument("--merge-shards", type=Path, default=None, metavar="OUT.json",
                        help="join the --shard I/N results of one run into one document")
    args = parser.parse_args(argv)
    if args.merge is not None or args.merge_shards is not None:
        join = merge if args.merge is not None else merge_shards
        out = args.merge if args.merge is not None else args.merge_shards
        try:
            doc = join([load_json(p) for p in args.result], [str(p) for p in args.result])
        except ValueError as exc:
            parser.error(str(exc))
        write_json(doc, out)
        plot(doc, out.with_suffix(".png"))
        print(markdown_report(doc))
        return 0
    for i, path in enumerate(args.result):
        doc = load_json(path)
        if i:
            print()
        print(f"### {path.stem}\n")
        print(markdown_report(doc))
        if args.plot:
            plot(doc, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
