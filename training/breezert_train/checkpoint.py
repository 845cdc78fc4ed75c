"""Resumable training state on disk: atomic saves and a JSONL log that matches them.

Owns: writing a state dict through a temporary file and ``os.replace`` (a run killed at any
moment leaves the previous save or the new one, never half of one), reading it back, the step
log, the stop flag that SIGTERM / SIGINT set so a loop saves before it exits, and the timed loop
both trainers run (``timed_loop``), and their command lines' flag for a config field
(``add_default_flag``). Must not: know what the state holds or what a step does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch

STATE_FILE = "state.pt"
LOG_FILE = "log.jsonl"


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """``torch.save`` to ``path.tmp``, flushed to disk, then renamed over ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_state(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


class StepLog:
    """Appends one JSON object a line; on resume drops lines past the saved step, so the log
    holds each step once even when a run died between saves."""

    def __init__(self, path: Path, resume_step: int | None) -> None:
        self.path = path
        if resume_step is None:
            path.write_text("")
        elif path.is_file():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))
        self._file = open(path, "a")  # noqa: SIM115 - held for the run, closed by close()

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class StopFlag:
    """Set by SIGTERM / SIGINT: a training loop ends after the step in flight and saves."""

    def __init__(self) -> None:
        self.is_set = False

    def __call__(self, signum: int, frame: object) -> None:
        self.is_set = True


@contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """A ``StopFlag`` that SIGTERM and SIGINT set while the block runs (handlers restored)."""
    stop = StopFlag()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def add_default_flag(parser: argparse.ArgumentParser, name: str, default: Any) -> None:
    """``--name-with-dashes`` for a config field with ``default``: a bool becomes a ``--x`` /
    ``--no-x`` pair (``type=bool`` would read any value, "False" too, as True)."""
    flag = "--" + name.replace("_", "-")
    if isinstance(default, bool):
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
    else:
        parser.add_argument(flag, type=type(default), default=default)


class Trainer(Protocol):
    step: int  # optimiser steps so far, resumed runs included
    train_time_s: float  # seconds spent in steps so far (evaluation and saves left out)


def timed_loop(trainer: Trainer, step: Callable[[], dict[str, float]], save: Callable[[], None],
               log: StepLog, minutes: float, max_steps: int | None, save_every: int,
               stop: StopFlag | None, after_step: Callable[[dict[str, float]], None] | None = None,
               at_end: Callable[[], None] | None = None) -> None:
    """Runs ``step`` until ``minutes`` pass, ``trainer.step`` reaches ``max_steps`` or ``stop``
    is set; logs each step's record (after ``after_step`` may add to it, e.g. a held-out score,
    whose time is not training time), saves every ``save_every`` steps, then ``at_end`` and a
    last save. Saves only between steps; a non-finite loss raises ``FloatingPointError`` before
    its step is logged or saved, so the last save (before the weights went bad) stays the one to
    resume. Closes ``log``."""
    start = last = time.monotonic()
    try:
        while time.monotonic() - start < minutes * 60 and not (stop and stop.is_set):
            if max_steps is not None and trainer.step >= max_steps:
                break
            record = step()
            if not all(math.isfinite(v) for v in record.values()):
                raise FloatingPointError(f"step {trainer.step}: non-finite loss {record}")
            now = time.monotonic()
            trainer.train_time_s += now - last
            if after_step is not None:
                after_step(record)
            last = time.monotonic()
            log.write({"step": trainer.step, "time_s": round(trainer.train_time_s, 3), **record})
            if trainer.step % save_every == 0:
                save()
        if at_end is not None:
            at_end()
        save()
    finally:
        log.close()
