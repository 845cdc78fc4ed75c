"""``breezert-bench`` end to end on the tiny CPU profile: one engine variant and the naive
baseline, two closed-loop load points, JSON + PNG + printed table + markdown report.

Owns: the benchmark's output contract (fields the README and the lead's tables rely on). Must
not: need a GPU; it runs in well under a minute on two cores.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from breezert_bench.cli import main
from breezert_bench.report import main as report_main

pytestmark = pytest.mark.integration

RUN_FIELDS = (
    "variant", "load", "num_requests", "num_ok", "num_errors", "errors", "ttfb_s", "rtf",
    "underrun_requests", "max_extra_buffer_s", "extra_buffer_s", "audio_s_per_s", "wall_s",
    "gpu_max_memory_bytes", "startup_s", "feedback_reports", "engine_metrics", "requests",
)
META_FIELDS = ("gpu", "cpu", "torch_version", "cuda_version", "git_commit", "date", "hostname",
               "command_line", "config_path", "texts", "options")
# Short texts (a few frames each): the output contract needs requests, not long ones. The
# benchmark's own 800 sentences took 47 s here for 12 requests.
SHORT_TEXTS = ["Good morning.", "It is late.", "Come in, please.", "Thank you all.",
               "See you soon.", "The door is open."]


def short_texts(folder: Path) -> str:
    path = folder / "short.tsv"
    path.write_text("id\ttext\n" + "".join(f"{i}\t{t}\n" for i, t in enumerate(SHORT_TEXTS)))
    return str(path)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    folder = tmp_path_factory.mktemp("bench")
    out = folder / "tmp" / "x.json"
    argv = ["--config", "cpu-tiny", "--concurrency", "1,2", "--texts",
            short_texts(folder), "--num-requests", "4", "--variants", "progressive-eager,naive",
            # the tiny engine streams a short text in ~0.1 s on a fast core: report every 10 ms
            # so each request reports while it streams
            "--feedback-period", "0.01", "--out", str(out)]
    start = time.monotonic()
    status = main(argv)
    elapsed = time.monotonic() - start
    assert status == 0
    return out, elapsed


def test_bench_writes_json_png_and_table(bench_run: tuple[Path, float]) -> None:
    out, elapsed = bench_run
    assert elapsed < 90, f"the smoke benchmark took {elapsed:.0f} s"
    doc = json.loads(out.read_text())
    assert doc["schema"] == "breezert-bench/1"
    for field in META_FIELDS:
        assert field in doc["metadata"], field
    assert doc["metadata"]["gpu"] is None and doc["metadata"]["torch_version"]
    assert doc["config"]["model"]["preset"] == "tiny"
    assert [(r["variant"], r["load"]["label"]) for r in doc["runs"]] == [
        ("progressive-eager", "c=1"), ("progressive-eager", "c=2"), ("naive", "seq")]
    for run in doc["runs"]:
        for field in RUN_FIELDS:
            assert field in run, (run["variant"], field)
        assert run["num_ok"] == run["num_requests"] == 4, run["errors"]
        assert 0 < run["ttfb_s"]["p50"] <= run["ttfb_s"]["p95"] <= run["ttfb_s"]["p99"]
        assert run["rtf"]["p50"] > 0 and run["audio_s_per_s"] > 0
        assert run["gpu_max_memory_bytes"] is None
        assert run["startup_s"] > 0
        assert len(run["requests"]) == 4
        submitted = [r["submit_s"] for r in run["requests"]]  # from the run's first submit
        assert min(submitted) == 0 and all(s >= 0 for s in submitted)
        # fixed lengths from the text: every request got exactly its frames
        assert all(r["num_frames"] == r["num_frames_target"] for r in run["requests"])
    assert doc["metadata"]["options"]["feedback_period_s"] == 0.01
    engine_runs = doc["runs"][:2]
    for run in engine_runs:
        assert run["feedback_reports"] > 0
        assert {"decode", "depth", "codec"} <= set(run["engine_metrics"]["stages"])
        assert run["engine_metrics"]["counters"]["requests_finished"] == 4
        assert run["frame_step_s_p50"] > 0
        # every first packet's time by part: its own steps by stage, others', host
        path = run["first_packet_path"]
        assert path["num_requests"] == 4
        own = {k for k in path if k.startswith("own_")}
        assert {"own_text_encode_ms", "own_prefill_ms", "own_depth_ms", "own_codec_ms"} <= own
        assert path["host_ms"]["mean"] >= 0
    # c=1 against the engine's own step timings (EngineMetrics.step_s, kept apart from the step
    # log the parts come from): one request at a time, so no other request's step is on a
    # first packet's path, and every TEXT_ENCODE and PREFILL step of the run (each request's
    # own, all before its first audio) is in exactly one request's parts
    alone = engine_runs[0]
    path, stages = alone["first_packet_path"], alone["engine_metrics"]["stages"]
    assert path.get("others_ms", {"mean": 0.0})["mean"] == pytest.approx(0.0, abs=1e-6)
    for stage in ("text_encode", "prefill"):
        engine_ms = stages[stage]["step_s"]["mean"] * stages[stage]["step_s"]["count"] * 1000
        assert path[f"own_{stage}_ms"]["mean"] * 4 == pytest.approx(engine_ms, rel=1e-3,
                                                                    abs=0.01), stage
    # c=2's opening burst: both requests, the steps until the later first chunk
    burst = engine_runs[1]["opening_burst"]
    assert burst["num_requests"] == 2 and len(burst["first_chunk_ms"]) == 2
    assert {s["stage"] for s in burst["steps"]} >= {"text_encode", "depth", "codec"}
    # the last step ends with the later first chunk (each figure is rounded to the microsecond:
    # a start and a length rounded apart can sum to 1 us less, 38.251 against 38.252 once)
    last_end = max(s["start_ms"] + s["ms"] for s in burst["steps"])
    assert last_end >= burst["first_chunk_ms"][-1] - 0.002
    assert engine_runs[0]["opening_burst"] == {}  # c=1 has no burst
    naive = doc["runs"][2]
    # the naive baseline hands over the whole utterance at once: TTFB = the synthesis time
    assert all(r["num_chunks"] == 1 for r in naive["requests"])
    assert naive["ttfb_s"]["p50"] > engine_runs[0]["ttfb_s"]["p50"]
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_prints_markdown(bench_run: tuple[Path, float], capsys) -> None:
    out, _ = bench_run
    assert report_main([str(out)]) == 0
    text = capsys.readouterr().out
    assert "| variant | load | ok/n | TTFB p50 ms |" in text
    assert "| progressive-eager | c=2 | 4/4 |" in text
    assert "| naive | seq | 4/4 |" in text
    assert "Per-stage step time" in text


def test_bench_rejects_bad_arguments(tmp_path: Path, capsys) -> None:
    base = ["--config", "cpu-tiny",
            "--out", str(tmp_path / "x.json"), "--num-requests", "1"]
    assert main([*base, "--concurrency", "0"]) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert main([*base, "--variants", "warp-drive"]) == 2
    assert "unknown warp-drive" in capsys.readouterr().err
    assert main([*base, "--texts", str(tmp_path / "none.tsv")]) == 2
    assert main([*base, "--feedback-period", "0"]) == 2
    assert "--feedback-period" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_shards_of_one_run_merge_into_that_run(tmp_path: Path, capsys) -> None:
    """Two ``--shard`` halves (as two GPUs would run them) join into one run over every
    request, with the request-level numbers recomputed from the joined records; the naive
    baseline runs in shard 1 only."""
    base = ["--config", "cpu-tiny", "--concurrency", "2", "--texts",
            short_texts(tmp_path), "--num-requests", "5", "--warmup", "0", "--variants",
            "progressive-eager,naive", "--naive-requests", "2"]
    parts = [tmp_path / "s1.json", tmp_path / "s2.json"]
    for i, part in enumerate(parts, start=1):
        assert main([*base, "--shard", f"{i}/2", "--out", str(part)]) == 0
    halves = [json.loads(p.read_text()) for p in parts]
    assert [[r["index"] for r in h["runs"][0]["requests"]] for h in halves] == [[0, 1], [2, 3, 4]]
    assert [r["variant"] for r in halves[1]["runs"]] == ["progressive-eager"]
    assert halves[1]["variants"][1]["status"] == "skipped"
    merged_path = tmp_path / "merged.json"
    # the shards in any order
    assert report_main([str(parts[1]), str(parts[0]), "--merge-shards", str(merged_path)]) == 0
    assert "2 shards of each run" in capsys.readouterr().out
    doc = json.loads(merged_path.read_text())
    run, naive = doc["runs"]
    assert [r["index"] for r in run["requests"]] == [0, 1, 2, 3, 4]
    assert run["num_ok"] == run["num_requests"] == 5
    ttfbs = sorted(r["ttfb_s"] for r in run["requests"])
    assert run["ttfb_s"]["p50"] == pytest.approx(ttfbs[2])
    assert run["ttfb_s"]["max"] == pytest.approx(ttfbs[-1])
    assert run["audio_s_total"] == pytest.approx(sum(r["audio_s"] for r in run["requests"]))
    walls = [h["runs"][0]["wall_s"] for h in halves]
    assert run["audio_s_per_s"] == pytest.approx(run["audio_s_total"] / sum(walls))
    assert [s["num_requests"] for s in run["shards"]] == [2, 3]
    assert (naive["variant"], naive["num_ok"]) == ("naive", 2)
    assert [v.get("status") for v in doc["variants"]] == ["ok", "ok"]
    assert merged_path.with_suffix(".png").is_file()
    # not one run: the same shard twice, or a shard without the engine variant's run
    assert pytest.raises(SystemExit, report_main,
                         [str(parts[0]), str(parts[0]), "--merge-shards", str(merged_path)])
    assert "expected shards 1/2..2/2" in capsys.readouterr().err
    halves[1]["runs"] = []
    (tmp_path / "empty.json").write_text(json.dumps(halves[1]))
    assert pytest.raises(SystemExit, report_main, [str(parts[0]), str(tmp_path / "empty.json"),
                                                   "--merge-shards", str(merged_path)])
    assert "1 of 2 shards ran it" in capsys.readouterr().err
    assert main([*base, "--shard", "3/2", "--out", str(tmp_path / "x.json")]) == 2
    assert "--shard" in capsys.readouterr().err
    assert main([*base, "--num-requests", "1", "--shard", "1/2",
                 "--out", str(tmp_path / "x.json")]) == 2
    assert "more shards than --num-requests" in capsys.readouterr().err


def test_the_runtime_cli_has_no_benchmark_and_points_at_breezert_bench(capsys) -> None:
    """The harness left the runtime (issue 32): ``breezert bench`` is a usage error, ``breezert
    --help`` names ``breezert-bench``, and ``breezert-bench soak`` keeps the soak check's flags."""
    from breezert.cli import build_parser
    from breezert.cli import main as runtime_main
    from breezert_bench.cli import soak_parser

    for command in ("bench", "soak"):
        with pytest.raises(SystemExit) as exit_:
            runtime_main([command, "--config", "cpu-tiny"])
        assert exit_.value.code == 2
        assert f"invalid choice: '{command}'" in capsys.readouterr().err
    assert "breezert-bench" in build_parser().format_help()
    args = soak_parser().parse_args(["--duration", "5", "--burst-every", "0", "--token", "t"])
    assert (args.duration, args.burst_every, args.token, args.url) == (5.0, 0, "t", None)
