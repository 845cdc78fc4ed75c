"""Teacher data generation, one resumable command:
``python -m breezert_train.teacher_data --out DIR --hours H --workers N --shard-mb 16``.

Owns the run: the corpus file in DIR (built once from the Debian sources, reused on resume),
fanning utterances out to worker processes in a fixed order, shards through ``ShardWriter`` and
``manifest.json`` (rewritten atomically after every shard). Re-running continues after the last
complete shard. Must not hold model or training code.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from breezert_train import shards as shard_io
from breezert_train.text import (
    SOURCES,
    SplitConfig,
    Utterance,
    build_corpus,
    read_excluded,
    read_sources,
)

CORPUS_NAME = "corpus.json.gz"
MANIFEST_NAME = "manifest.json"
SAMPLE_RATE = 24_000
EVAL_SET = Path(__file__).resolve().parents[2].parent / "shared" / "bench" / "texts_en.tsv"
"""The benchmark/quality-gate sentences: excluded from training, never read otherwise."""
UTTERANCES_PER_TASK = 16
TASKS_IN_FLIGHT = 4
"""Tasks submitted ahead per worker."""


class TeacherLike(Protocol):
    model_sha256: str

    def synthesize(self, text: str, seed: int) -> Any: ...


# -- corpus ------------------------------------------------------------------------------------
def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + shard_io.TMP_SUFFIX)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_corpus(path: Path, train: list[Utterance], heldout: list[Utterance],
                settings: dict[str, Any]) -> None:
    body = {"settings": settings,
            "train": [[u.source, u.text] for u in train],
            "heldout": [[u.source, u.text] for u in heldout]}
    _write_atomic(path, gzip.compress(json.dumps(body, ensure_ascii=False).encode(), mtime=0))


def load_corpus(path: Path) -> tuple[list[Utterance], list[Utterance], dict[str, Any]]:
    body = json.loads(gzip.decompress(path.read_bytes()))
    train = [Utterance(i, s, t) for i, (s, t) in enumerate(body["train"])]
    heldout = [Utterance(i, s, t) for i, (s, t) in enumerate(body["heldout"])]
    return train, heldout, body["settings"]


def ensure_corpus(out: Path, config: SplitConfig, seed: int, exclude: Path | None,
                  passages: Callable[[], dict[str, Any]] = read_sources,
                  ) -> tuple[list[Utterance], list[Utterance], dict[str, Any]]:
    """The corpus in ``out``; built (and saved) on the first run. A resume with other settings
    is refused: the utterance ids in the shards would mean other texts."""
    settings = {"seed": seed, **asdict(config)}
    path = out / CORPUS_NAME
    if path.exists():
        train, heldout, saved = load_corpus(path)
        if saved != settings:
            raise ValueError(f"{path} was built with {saved}, this run asks for {settings}: "
                             "use another --out or the same settings")
        return train, heldout, saved
    train, heldout = build_corpus(passages(), config, seed, read_excluded(exclude))
    save_corpus(path, train, heldout, settings)
    return train, heldout, settings


# -- workers -----------------------------------------------------------------------------------
_TEACHER: TeacherLike | None = None


def _init_worker(factory: Callable[[], TeacherLike]) -> None:
    global _TEACHER
    _TEACHER = factory()


def utterance_seed(seed: int, utterance_id: int) -> int:
    return (seed << 32) | utterance_id


def _synthesize_task(task: tuple[int, list[tuple[int, str, str]]]) -> tuple[list[tuple], float]:
    """A run of utterances in one worker: (results, CPU seconds this process spent on them)."""
    seed, items = task
    assert _TEACHER is not None, "worker not initialised"
    start = time.process_time()
    results = []
    for utterance_id, source, text in items:
        out = _TEACHER.synthesize(text, utterance_seed(seed, utterance_id))
        results.append((utterance_id, source, text, out.phonemes, out.audio, out.phoneme_ids,
                        out.durations))
    return results, time.process_time() - start


def _results(tasks: list[tuple[int, list[tuple[int, str, str]]]], workers: int,
             factory: Callable[[], TeacherLike]) -> Iterator[tuple[list[tuple], float]]:
    """Task results in task order, in ``workers`` processes (0 or 1: in this process), with at
    most ``TASKS_IN_FLIGHT`` tasks per worker submitted ahead (memory stays bounded)."""
    if not tasks:
        return
    if workers <= 1:
        _init_worker(factory)
        yield from map(_synthesize_task, tasks)
        return
    # NOTE(i19): an executor, not multiprocessing.Pool: a worker that dies raises
    # BrokenProcessPool here instead of leaving imap waiting for ever.
    executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=(factory,))
    try:
        remaining = iter(tasks)
        window = deque(executor.submit(_synthesize_task, task)
                       for task in itertools.islice(remaining, TASKS_IN_FLIGHT * workers))
        while window:
            result = window.popleft().result()
            task = next(remaining, None)
            if task is not None:
                window.append(executor.submit(_synthesize_task, task))
            yield result
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def default_teacher() -> TeacherLike:
    from breezert_train.teacher import Teacher

    return Teacher(threads=1)


# -- manifest ----------------------------------------------------------------------------------
def teacher_info(model_sha256: str) -> dict[str, str]:
    from breezert_train import teacher

    return {"package": teacher.TEACHER_PACKAGE, "version": teacher.TEACHER_VERSION,
            "voice": teacher.TEACHER_VOICE, "onnx_sha256": model_sha256,
            "durations": f"{teacher.DURATION_TENSOR}, 40 Hz units, one per phoneme id"}


def write_manifest(out: Path, found: list[shard_io.ShardInfo], settings: dict[str, Any],
                   num_heldout: int, teacher: dict[str, str], runs: list[dict[str, Any]]) -> dict:
    sources: dict[str, int] = {}
    for shard in found:
        for name, count in shard.sources.items():
            sources[name] = sources.get(name, 0) + count
    manifest = {
        "format": "breezert-teacher-shards-1",
        "sample_rate": SAMPLE_RATE,
        "teacher": teacher,
        "corpus": {"file": CORPUS_NAME, "settings": settings, "num_heldout": num_heldout},
        "sources": {name: {**SOURCES[name], "num_utterances": sources.get(name, 0)}
                    for name in sorted(SOURCES)},
        "num_shards": len(found),
        "num_utterances": sum(s.num_utterances for s in found),
        "seconds": sum(s.num_samples for s in found) / SAMPLE_RATE,
        "num_bytes": sum(s.num_bytes for s in found),
        "shards": [{"name": s.name, "num_utterances": s.num_utterances,
                    "seconds": s.num_samples / SAMPLE_RATE, "num_bytes": s.num_bytes,
                    "first_utterance_id": s.utterance_ids[0],
                    "last_utterance_id": s.utterance_ids[-1]} for s in found],
        "runs": runs,
    }
    _write_atomic(out / MANIFEST_NAME, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


# -- the run ----------------------------------------------------------------------------------
class _Run:
    """One invocation's bookkeeping: the shards found and written, this run's throughput record,
    and the manifest rewritten after every shard."""

    def __init__(self, out: Path, found: list[shard_io.ShardInfo], settings: dict[str, Any],
                 num_heldout: int, teacher: dict[str, str], hours: float, workers: int,
                 shard_mb: float, log: Callable[[str], None]) -> None:
        self.out, self.found, self.settings, self.num_heldout = out, found, settings, num_heldout
        self.teacher, self.log = teacher, log
        previous = out / MANIFEST_NAME
        self.runs = json.loads(previous.read_text())["runs"] if previous.exists() else []
        self.record = {"started_unix": round(time.time(), 1), "target_hours": hours,
                       "workers": max(workers, 1), "num_utterances": 0,
                       "is_corpus_exhausted": False, "audio_s": 0.0, "worker_cpu_s": 0.0,
                       "wall_s": 0.0}
        self.writer = shard_io.ShardWriter(out, int(shard_mb * 2**20))
        self.start_time = time.monotonic()

    def add(self, result: tuple) -> int:
        """Buffer one synthesised utterance (writing a shard when full); returns its samples."""
        utterance_id, source, text, phonemes, audio, phoneme_ids, durations = result
        self._wrote(self.writer.add(utterance_id, source, text, phonemes, np.asarray(audio),
                                    np.asarray(phoneme_ids), np.asarray(durations)))
        self.record["num_utterances"] += 1
        self.record["audio_s"] += len(audio) / SAMPLE_RATE
        return len(audio)

    def _wrote(self, shard: shard_io.ShardInfo | None) -> None:
        if shard is None:
            return
        self.found.append(shard)
        self._write_manifest()
        total_h = sum(s.num_samples for s in self.found) / SAMPLE_RATE / 3600
        self.log(f"{shard.name}: {shard.num_utterances} utterances, "
                 f"{shard.num_bytes / 2**20:.1f} MiB; total {total_h:.3f} h")

    def _write_manifest(self) -> None:
        record = self.record
        record["wall_s"] = round(time.monotonic() - self.start_time, 3)
        audio_s = record["audio_s"]
        record["x_realtime_per_core"] = round(audio_s / max(record["worker_cpu_s"], 1e-9), 2)
        record["x_realtime_wall"] = round(audio_s / max(record["wall_s"], 1e-9), 2)
        runs = [*self.runs, record] if record["num_utterances"] else self.runs
        write_manifest(self.out, sorted(self.found, key=lambda s: s.name), self.settings,
                       self.num_heldout, self.teacher, runs)

    def finish(self) -> dict:
        """Flush the last shard; the manifest is written even when there was nothing to add."""
        last = self.writer.flush()
        self._wrote(last)
        if last is None:
            self._write_manifest()
        return json.loads((self.out / MANIFEST_NAME).read_text())


def generate(out: Path, hours: float, workers: int = 1, shard_mb: float = 16.0, seed: int = 0,
             config: SplitConfig | None = None, exclude: Path | None = EVAL_SET,
             teacher_factory: Callable[[], TeacherLike] = default_teacher,
             passages: Callable[[], dict[str, Any]] = read_sources,
             stop_after: int | None = None, log: Callable[[str], None] = print,
             after_id: int = -1) -> dict:
    """Synthesise training utterances in corpus order until the shards hold ``hours`` of audio.

    Resumable: utterances already in a complete shard are skipped. ``stop_after`` ends the run
    abruptly after that many new utterances, without flushing (what a kill leaves behind).
    ``after_id``: only utterances whose id is above it (ids follow corpus order): the next
    hours after those another folder holds, e.g. an LM call's fresh hours past the carried
    codes'."""
    out.mkdir(parents=True, exist_ok=True)
    for name in shard_io.remove_partial(out):
        log(f"removed partial {name}")
    train, heldout, settings = ensure_corpus(out, config or SplitConfig(), seed, exclude, passages)
    found = shard_io.scan(out)
    done = {i for shard in found for i in shard.utterance_ids}
    samples = sum(shard.num_samples for shard in found)
    target = int(hours * 3600 * SAMPLE_RATE)
    pending = [(u.utterance_id, u.source, u.text) for u in train
               if u.utterance_id not in done and u.utterance_id > after_id]
    log(f"{len(found)} shards, {samples / SAMPLE_RATE:.1f} s already; target {hours} h, "
        f"{len(pending)} utterances left in the corpus")
    if samples >= target:
        pending = []
        previous = json.loads((out / MANIFEST_NAME).read_text()) if found else {}
        teacher = previous.get("teacher", {})
    else:
        teacher = teacher_info(teacher_factory().model_sha256)
    run = _Run(out, found, settings, len(heldout), teacher, hours, workers, shard_mb, log)
    tasks = [(seed, pending[i:i + UTTERANCES_PER_TASK])
             for i in range(0, len(pending), UTTERANCES_PER_TASK)]
    stream = _results(tasks, workers, teacher_factory)
    try:
        for results, cpu_s in stream:
            run.record["worker_cpu_s"] += cpu_s
            for result in results:
                if samples >= target:
                    break
                if stop_after is not None and run.record["num_utterances"] >= stop_after:
                    return {"stopped_after": run.record["num_utterances"]}
                samples += run.add(result)
            if samples >= target:
                break
    finally:
        stream.close()  # terminates the pool now, not when the generator is collected
    if samples < target:
        run.record["is_corpus_exhausted"] = True
        log(f"corpus exhausted at {samples / SAMPLE_RATE / 3600:.3f} h of the {hours} h asked for")
    return run.finish()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m breezert_train.teacher_data",
                                     description=__doc__)
    parser.add_argument("--out", type=Path, required=True,
                        help="data directory (resumed if it exists)")
    parser.add_argument("--hours", type=float, required=True, help="hours of audio wanted in total")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes")
    parser.add_argument("--shard-mb", type=float, default=16.0, help="largest shard, MiB")
    parser.add_argument("--seed", type=int, default=0, help="corpus order and teacher noise")
    parser.add_argument("--min-words", type=int, default=3)
    parser.add_argument("--max-words", type=int, default=20)
    parser.add_argument("--heldout-percent", type=float, default=1.0)
    parser.add_argument("--exclude", type=Path, default=EVAL_SET,
                        help="TSV whose `text` sentences are never trained on (the eval set)")
    args = parser.parse_args(argv)
    config = SplitConfig(args.min_words, args.max_words, args.heldout_percent)
    manifest = generate(args.out, args.hours, args.workers, args.shard_mb, args.seed, config,
                        args.exclude, log=lambda line: print(line, file=sys.stderr, flush=True))
    summary = {k: manifest[k] for k in ("num_shards", "num_utterances", "seconds", "num_bytes")}
    print(json.dumps({**summary, "last_run": (manifest["runs"] or [None])[-1]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
