"""WER scored inside a GPU call, on that machine's CPU cores, while training goes on.

Owns: the dev set (``dev_sentences``: 20 fixed sentences of the corpus's held-out split, never
synthesised for training), the scorer's language model (``build_lm``: a trigram model of the
corpus's first ``LM_SENTENCES`` training texts, built on the machine, so the 23.5 MB
``en-us.lm.bin`` need not travel), the pool of scoring processes (``InRunWer``: the teacher's own
dev audio and WER once per call, then each snapshot a stage hands in: a codec on the teacher's dev
audio, or a whole voice from text), the curve (``wer_curve.jsonl``, one JSON line per score,
carried across calls) and the rule that says whether a stage goes on, changes or stops
(``decide``). Must not: train, or block the training loop (everything slow runs in the pool and
its coordinator thread).

The figures are this scorer's, not the quality gate's (``asr_gate``: pocketsphinx 5.1.1 with its
own language model, on the benchmark's sentences): another language model, another sentence set,
and the pocketsphinx that travels (5.0.4 on Python 3.12: 5.1.1 has no wheel for it). The teacher's
own WER under the same scorer, on every call's curve, is the yardstick.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from breezert_train.wer import normalise, word_errors

CURVE_FILE = "wer_curve.jsonl"
DEV_SIZE = 20
DEV_WORDS = (6, 16)
"""Words of a dev sentence, inclusive: long enough to score, short enough to synthesise fast."""
LM_SENTENCES = 40_000
"""Training texts the scorer's language model is built from (the corpus's first, seeded order)."""
TEACHER, CODEC, VOICE = "teacher", "codec", "voice"
"""What a score is of: the teacher's audio, a codec's resynthesis of it, a voice from text."""


@dataclass(frozen=True)
class DevSentence:
    sentence_id: str
    text: str


def dev_sentences(heldout: Sequence[tuple[int, str]], num: int = DEV_SIZE,
                  vocabulary: set[str] | None = None) -> list[DevSentence]:
    """``num`` held-out ``(utterance id, text)`` with ``DEV_WORDS`` words, those with the fewest
    words outside ``vocabulary`` first (the scorer's language model and dictionary: a word it
    cannot hear is an error for the teacher too, noise in the yardstick), then in held-out
    order. The corpus's held-out order is seeded and fixed: the same corpus gives the same dev
    set."""
    low, high = DEV_WORDS
    fits = [(i, text, normalise(text)) for i, text in heldout]
    fits = [(len(set(w) - vocabulary) if vocabulary is not None else 0, n, i, text)
            for n, (i, text, w) in enumerate(fits) if low <= len(w) <= high]
    if len(fits) < num:
        raise ValueError(f"the held-out split has {len(fits)} sentences of {low}-{high} words, "
                         f"fewer than {num}")
    return [DevSentence(f"heldout-{i}", text) for _, _, i, text in sorted(fits)[:num]]


def lm_vocabulary(texts: Sequence[str]) -> set[str]:
    """The words ``build_lm`` gives the model, less those pocketsphinx's bundled dictionary
    cannot pronounce (it drops them) where pocketsphinx is installed."""
    words = {w for t in texts for w in normalise(t)}
    try:
        import pocketsphinx
    except ImportError:
        return words
    path = Path(pocketsphinx.get_model_path("en-us")) / "cmudict-en-us.dict"
    if not path.is_file():
        return words
    known = {line.split(" ", 1)[0] for line in path.read_text().splitlines() if line}
    return words & known


def build_lm(texts: Sequence[str], out: Path) -> Path:
    """A trigram ARPA model (pocketsphinx's ``ArpaBoLM``, Good-Turing-like absolute discount
    0.5) of ``texts`` normalised as WER compares them; written to ``out``."""
    from pocketsphinx.lm import ArpaBoLM

    lines = [" ".join(words) for words in map(normalise, texts) if words]
    if not lines:
        raise ValueError("no words to build a language model from")
    lm = ArpaBoLM(text="\n".join(lines), add_start=True)
    lm.compute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w") as f:
        lm.write(f)
    tmp.replace(out)
    return out


# ------------------------------------------------------------------------------- the rule
@dataclass(frozen=True)
class WerRule:
    """When a stage stops or changes, from its curve (minutes = the stage's training minutes,
    summed over calls):

    * ``stop`` (the stage reached its goal): the latest WER is at most the teacher's + ``goal``;
    * ``change`` (the recipe stalled): the scores span at least ``window_min`` minutes past the
      first, and the best WER of the last ``window_min`` minutes is not ``min_gain`` below the
      best before them;
    * ``continue`` otherwise (also with fewer than ``min_scores`` scores).
    """

    goal: float = 0.05
    """Above the teacher's own WER (same scorer, same sentences)."""
    min_gain: float = 0.03
    """WER (absolute, 3 points) the last window must gain over the best before it."""
    window_min: float = 6.0
    """Training minutes of that window."""
    min_scores: int = 3


def decide(curve: Sequence[dict[str, Any]], stage: str, rule: WerRule = WerRule(),
           recipe: str | None = None) -> dict[str, Any]:
    """``{"verdict": continue|stop|change, "reason": ...}`` for ``stage`` (``codec`` or
    ``voice``) from the curve's records of that stage (and of ``recipe`` when given: a new
    recipe starts a new curve) and the latest teacher record."""
    teacher = [r for r in curve if r["subject"] == TEACHER]
    points = [r for r in curve if r["subject"] == stage
              and (recipe is None or r.get("recipe") == recipe)]
    if not points or not teacher:
        return {"verdict": "continue", "reason": "no score yet"}
    target = teacher[-1]["mean_wer"] + rule.goal
    last = points[-1]
    if last["mean_wer"] <= target:
        return {"verdict": "stop", "reason": f"WER {last['mean_wer']:.3f} <= teacher "
                f"{teacher[-1]['mean_wer']:.3f} + {rule.goal:.2f}"}
    if len(points) < rule.min_scores:
        return {"verdict": "continue", "reason": f"{len(points)} of {rule.min_scores} scores"}
    cut = last["minutes"] - rule.window_min
    before = [p["mean_wer"] for p in points if p["minutes"] < cut]
    recent = [p["mean_wer"] for p in points if p["minutes"] >= cut]
    if not before:
        return {"verdict": "continue", "reason": f"under {rule.window_min} min of scores"}
    if min(recent) > min(before) - rule.min_gain:
        return {"verdict": "change", "reason": f"best WER {min(recent):.3f} of the last "
                f"{rule.window_min} min is not {rule.min_gain:.2f} below {min(before):.3f}"}
    return {"verdict": "continue", "reason": f"best WER {min(recent):.3f} of the last "
            f"{rule.window_min} min, {min(before):.3f} before"}


def read_curve(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------- the workers
_WORKER: dict[str, Any] = {}
"""Per scoring process (or thread): the transcriber and the last subject loaded."""


def _transcriber(lm: str | None, factory: Callable[[str | None], Any] | None) -> Any:
    if _WORKER.get("asr_key") != (lm, factory):
        if factory is None:
            from breezert_train.asr import Transcriber

            _WORKER["asr"] = Transcriber(lm, pinned=False)
        else:
            _WORKER["asr"] = factory(lm)
        _WORKER["asr_key"] = (lm, factory)
    return _WORKER["asr"]


def _render_codec(snapshot: str, clips: list[np.ndarray]) -> list[np.ndarray]:
    """The teacher's int16 clips through the codec a ``CodecTrainer.snapshot`` file holds."""
    import torch

    from breezert_train.checkpoint import load_state
    from breezert_train.codec_train import CodecTrainer, config_from_json

    if _WORKER.get("subject") != snapshot:
        snap = load_state(Path(snapshot))
        trainer = CodecTrainer(config_from_json(snap["config"]), "cpu")
        trainer.load_snapshot(snap)
        _WORKER["subject"], _WORKER["codec"] = snapshot, trainer
    trainer, out = _WORKER["codec"], []
    for clip in clips:
        frames = max(1, -(-len(clip) // 1920))
        wav = torch.zeros(1, frames * 1920)
        wav[0, : len(clip)] = torch.from_numpy(clip.astype(np.float32) / 32768.0)
        with torch.no_grad():
            y, _ = trainer.reconstruct(wav, training=False)
        out.append(y[0, : len(clip)].numpy())
    return out


def _render_voice(folder: str, texts: list[str], seeds: list[int]) -> list[np.ndarray]:
    """A voice checkpoint's one-shot synthesis (its own sampling, 2x the length rule)."""
    from breezert_bench.workload import frames_for_text
    from breezert.loader import load_checkpoint
    from breezert.offline import synthesize_whole
    from breezert.options import SynthesisOptions
    from breezert.request import SynthesisRequest

    if _WORKER.get("subject") != folder:
        _WORKER["subject"], _WORKER["voice"] = folder, load_checkpoint(folder, device="cpu")
    return [synthesize_whole(_WORKER["voice"], SynthesisRequest(
        text=text, options=SynthesisOptions(seed=seed), max_frames=2 * frames_for_text(text)))
        for text, seed in zip(texts, seeds, strict=True)]


def score_task(kind: str, subject: str | None, items: list[tuple[str, int, np.ndarray | None]],
               lm: str | None, factory: Callable[[str | None], Any] | None = None
               ) -> list[dict[str, Any]]:
    """One worker's share of a score: ``items`` are ``(text, seed, teacher int16 clip)``; the
    audio is the teacher clip itself (``teacher``), its resynthesis (``codec``, ``subject`` a
    snapshot file) or the voice's synthesis (``voice``, ``subject`` a checkpoint folder)."""
    import torch

    torch.set_num_threads(1)
    if kind == TEACHER:
        audio = [clip.astype(np.float32) / 32768.0 for _, _, clip in items]
    elif kind == CODEC:
        audio = _render_codec(subject, [clip for _, _, clip in items])
    elif kind == VOICE:
        audio = _render_voice(subject, [t for t, _, _ in items], [s for _, s, _ in items])
    else:
        raise ValueError(f"unknown subject kind {kind!r}")
    asr = _transcriber(lm, factory)
    rows = []
    for (text, _, _), pcm in zip(items, audio, strict=True):
        transcript = asr.transcribe(pcm, 24000) if len(pcm) else ""
        e = word_errors(text, transcript)
        rows.append({"transcript": transcript, "wer": e.wer, "errors": e.num_errors,
                     "ref_words": e.num_ref_words})
    return rows


def teacher_task(texts: list[str], seeds: list[int],
                 teacher_factory: Callable[[], Any] | None) -> list[np.ndarray]:
    """The teacher's int16 audio of the dev sentences."""
    if teacher_factory is None:
        from breezert_train.teacher import Teacher

        teacher_factory = Teacher
    teacher = teacher_factory()
    return [np.asarray(teacher.synthesize(t, s).audio) for t, s in zip(texts, seeds, strict=True)]


def lm_task(texts: list[str], out: str) -> str:
    return str(build_lm(texts, Path(out)))


# ------------------------------------------------------------------------------- the scorer
class InRunWer:
    """The scorer of one call: a pool of ``workers`` processes (0: one thread, for tests) and a
    coordinator thread that first builds the language model and (``teacher``) the teacher's dev
    audio and scores it, then each subject ``submit`` hands it, in order, appending to
    ``curve``. ``verdict`` is the rule's latest word on a stage. Without ``teacher`` (a call
    that trains only the LM, carrying no teacher wheel) codecs cannot be scored and the rule
    reads the teacher's WER from the curve's earlier calls."""

    def __init__(self, work: Path, curve: Path, dev: Sequence[DevSentence],
                 lm_texts: Sequence[str] | None, workers: int, rule: WerRule = WerRule(),
                 recipe: str | None = None, teacher_factory: Callable[[], Any] | None = None,
                 transcriber_factory: Callable[[str | None], Any] | None = None,
                 log: Callable[[str], None] = print, teacher: bool = True) -> None:
        self.work, self.curve, self.dev = Path(work), Path(curve), list(dev)
        self.rule, self.recipe, self.log = rule, recipe, log
        self.work.mkdir(parents=True, exist_ok=True)
        self._factory = transcriber_factory
        self._pool: Executor = (ThreadPoolExecutor(1) if workers <= 0 else ProcessPoolExecutor(
            workers, mp_context=__import__("multiprocessing").get_context("spawn")))
        self._shares = max(1, workers)
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.verdicts: dict[str, dict[str, Any]] = {}
        self.pending = 0
        self.error: BaseException | None = None
        seeds = list(range(len(self.dev)))
        texts = [d.text for d in self.dev]
        self._lm: Future | None = (self._pool.submit(lm_task, list(lm_texts),
                                                     str(self.work / "dev_lm.arpa"))
                                   if lm_texts is not None else None)
        self._clips = (self._pool.submit(teacher_task, texts, seeds, teacher_factory)
                       if teacher else None)
        self._thread = threading.Thread(target=self._run, name="in-run-wer", daemon=True)
        self._thread.start()
        if teacher:
            self.submit(TEACHER, None, minutes=0.0, step=0)

    def submit(self, kind: str, subject: Path | None, minutes: float, step: int) -> None:
        """Queues a score of ``subject`` (a codec snapshot file or a voice folder that stays
        in place until scored) at the stage's ``minutes`` / ``step``; returns at once."""
        with self._lock:
            self.pending += 1
        self._jobs.put((kind, str(subject) if subject else None, minutes, step))

    def verdict(self, stage: str) -> dict[str, Any]:
        with self._lock:
            return dict(self.verdicts.get(stage, {"verdict": "continue",
                                                  "reason": "no score yet"}))

    def drain(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for every queued score; True when none is left."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self._lock:
                if not self.pending or self.error is not None:
                    return not self.pending
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        try:
            lm = self._lm.result() if self._lm is not None else None
            clips = self._clips.result() if self._clips is not None else None
            while (job := self._jobs.get()) is not None:
                self._score(*job, lm=lm, clips=clips)
                with self._lock:
                    self.pending -= 1
        except BaseException as exc:  # noqa: BLE001 - reported in the log and the summary
            self.error = exc
            self.log(f"[wer] scorer failed: {exc!r}")

    def _score(self, kind: str, subject: str | None, minutes: float, step: int,
               lm: str | None, clips: list[np.ndarray] | None) -> None:
        start = time.monotonic()
        if clips is None and kind != VOICE:
            raise ValueError(f"a {kind} score needs the teacher's audio (teacher=False)")
        items = [(d.text, i, clips[i] if clips is not None else None)
                 for i, d in enumerate(self.dev)]
        shares = [items[i::self._shares] for i in range(self._shares)]
        futures = [self._pool.submit(score_task, kind, subject, share, lm, self._factory)
                   for share in shares if share]
        rows: list[dict[str, Any]] = [None] * len(items)  # type: ignore[list-item]
        for offset, future in enumerate(futures):
            for j, row in enumerate(future.result()):
                rows[offset + j * self._shares] = row
        mean = sum(r["wer"] for r in rows) / len(rows)
        record = {"subject": kind, "recipe": self.recipe, "step": step,
                  "minutes": round(minutes, 3), "mean_wer": round(mean, 4),
                  "corpus_wer": round(sum(r["errors"] for r in rows)
                                      / sum(r["ref_words"] for r in rows), 4),
                  "score_s": round(time.monotonic() - start, 2), "lm": "corpus" if lm else
                  "bundled", "unix": round(time.time(), 1),
                  "transcripts": [r["transcript"] for r in rows]}
        with self._lock:
            if kind != TEACHER:
                curve = read_curve(self.curve) + [record]
                record["decision"] = self.verdicts[kind] = decide(curve, kind, self.rule,
                                                                  self.recipe)
            with open(self.curve, "a") as f:
                f.write(json.dumps(record) + "\n")
        verdict = record.get("decision", {}).get("verdict", "")
        self.log(f"[wer] {kind} step {step} at {minutes:.2f} min: mean WER {mean:.3f} "
                 f"({record['score_s']} s) {verdict}")
