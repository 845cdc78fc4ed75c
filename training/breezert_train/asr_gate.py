"""Issue 19's quality gate: a voice's audio through pocketsphinx on fixed sentences, scored by WER.

Owns: the gate's sentences (``asr_gate_sentences.tsv``: every 40th line of
``../shared/bench/texts_en.tsv`` from the first, i.e. lines 1, 41, ..., 761 of its 800, kept here
so a fresh clone has them), running a subject's paths through the ASR, the JSON report, the
pass/fail rule (``gate_failures``) and the command line::

    python -m breezert_train.asr_gate --teacher | --model DIR | --codec DIR [--sentences 20]
        [--out FILE]

Must not: synthesise or transcribe itself (``gate_audio``, ``asr``), or be imported by serving
code.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from breezert_train.asr import ASR_PACKAGE, ASR_VERSION, Transcriber
from breezert_train.gate_audio import (
    OFFLINE,
    BreezeSubject,
    CodecSubject,
    Subject,
    TeacherSubject,
)
from breezert_train.wer import WordErrors, word_errors

GATE_SENTENCES = Path(__file__).with_name("asr_gate_sentences.tsv")
MAX_MEAN_WER = 0.40
"""Offline and every delivery path: mean per-sentence WER at most this (issue 19)."""
MAX_DELTA = 0.05
"""Every delivery path (streamed, Opus): mean WER at most this above offline."""


@dataclass(frozen=True)
class Sentence:
    sentence_id: str
    text: str


def read_sentences(path: Path) -> list[Sentence]:
    """``id<TAB>text`` lines after a header line."""
    lines = path.read_text(encoding="utf-8").splitlines()[1:]
    sentences = [Sentence(*line.split("\t", 1)) for line in lines if line.strip()]
    if not sentences:
        raise ValueError(f"{path} holds no sentences")
    return sentences


def select(sentences: Sequence[Sentence], num: int) -> list[Sentence]:
    """``num`` sentences evenly spaced from the first: every ``len // num``-th."""
    if not 1 <= num <= len(sentences):
        raise ValueError(f"sentences={num}: choose 1..{len(sentences)}")
    return list(sentences[:: len(sentences) // num][:num])


def _summary(errors: list[WordErrors]) -> dict[str, float]:
    num_ref = sum(e.num_ref_words for e in errors)
    return {"mean_wer": sum(e.wer for e in errors) / len(errors),
            "corpus_wer": sum(e.num_errors for e in errors) / num_ref}


def run_gate(subject: Subject, sentences: Sequence[Sentence], transcriber: Transcriber,
             log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Every path of ``subject`` on every sentence (seed = its position), transcribed and scored.

    Returns the report: ``mean_wer`` per path (the mean of per-sentence WERs, the gate's figure),
    ``corpus_wer`` per path (errors over all reference words), each sentence's transcripts and
    error counts, and the seconds spent synthesising and transcribing.
    """
    start = time.monotonic()
    synth_s = asr_s = 0.0
    errors: dict[str, list[WordErrors]] = {path: [] for path in subject.paths}
    rows = []
    for seed, sentence in enumerate(sentences):
        t0 = time.monotonic()
        audio = subject.render(sentence.text, seed)
        t1 = time.monotonic()
        row: dict[str, Any] = {"id": sentence.sentence_id, "text": sentence.text, "seed": seed,
                               "paths": {}}
        for path in subject.paths:
            transcript = transcriber.transcribe(audio[path].pcm, audio[path].sample_rate)
            e = word_errors(sentence.text, transcript)
            errors[path].append(e)
            row["paths"][path] = {
                "transcript": transcript, "wer": round(e.wer, 4),
                "seconds": round(len(audio[path].pcm) / audio[path].sample_rate, 3),
                "substitutions": e.substitutions, "deletions": e.deletions,
                "insertions": e.insertions, "ref_words": e.num_ref_words,
            }
        synth_s += t1 - t0
        asr_s += time.monotonic() - t1
        rows.append(row)
        log(f"[{seed + 1}/{len(sentences)}] " + " ".join(
            f"{path}={row['paths'][path]['wer']:.2f}" for path in subject.paths))
    summaries = {path: _summary(errs) for path, errs in errors.items()}
    return {
        "subject": subject.name, "asr": f"{ASR_PACKAGE} {ASR_VERSION} en-us (bundled)",
        "num_sentences": len(sentences),
        "mean_wer": {p: round(s["mean_wer"], 4) for p, s in summaries.items()},
        "corpus_wer": {p: round(s["corpus_wer"], 4) for p, s in summaries.items()},
        "timing_s": {"total": round(time.monotonic() - start, 2), "synthesis": round(synth_s, 2),
                     "asr": round(asr_s, 2)},
        "sentences": rows,
    }


def gate_failures(report: dict[str, Any], max_mean_wer: float = MAX_MEAN_WER,
                  max_delta: float = MAX_DELTA) -> list[str]:
    """Why ``report`` fails the gate (empty: it passes): offline and every other path must have a
    mean WER <= ``max_mean_wer``, and every other path at most ``max_delta`` above offline."""
    wer = report["mean_wer"]
    failures = [f"{path}: mean WER {value:.3f} > {max_mean_wer:.3f}"
                for path, value in wer.items() if value > max_mean_wer]
    failures += [f"{path}: mean WER {value:.3f} is {value - wer[OFFLINE]:+.3f} from offline "
                 f"(allowed +{max_delta:.3f})"
                 for path, value in wer.items() if value - wer[OFFLINE] > max_delta]
    return failures


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m breezert_train.asr_gate", description=(
        "ASR round trip (pocketsphinx) of a voice: mean WER offline, streamed at fixed chunk "
        "sizes and over WebRTC Opus, as JSON on stdout; exit status 1 when the gate fails"))
    who = parser.add_mutually_exclusive_group(required=True)
    who.add_argument("--teacher", action="store_true", help="hibari-tts 0.2.1 (offline, Opus)")
    who.add_argument("--model", type=Path, help="Breeze checkpoint folder (every path, on CPU)")
    who.add_argument("--codec", type=Path, help="Breeze checkpoint folder: the teacher's audio "
                                                "through its codec (encode, decode)")
    parser.add_argument("--sentences", type=int, default=20, help="how many, evenly spaced")
    parser.add_argument("--texts", type=Path, default=GATE_SENTENCES,
                        help="id<TAB>text file (default: the gate's 20, every 40th of "
                             "texts_en.tsv)")
    parser.add_argument("--max-frames-scale", type=float, default=2.0,
                        help="model frame limit over the 15 chars/s length rule")
    parser.add_argument("--max-wer", type=float, default=MAX_MEAN_WER)
    parser.add_argument("--max-delta", type=float, default=MAX_DELTA)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    torch.set_num_threads(1)
    sentences = select(read_sentences(args.texts), args.sentences)
    subject: Subject
    if args.teacher:
        subject = TeacherSubject()
    elif args.codec is not None:
        subject = CodecSubject(args.codec)
    else:
        subject = BreezeSubject(args.model, max_frames_scale=args.max_frames_scale)
    report = run_gate(subject, sentences, Transcriber(),
                      log=lambda line: print(line, file=sys.stderr, flush=True))
    failures = gate_failures(report, args.max_wer, args.max_delta)
    report["gate"] = {"max_mean_wer": args.max_wer, "max_delta": args.max_delta,
                      "passed": not failures, "failures": failures}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
