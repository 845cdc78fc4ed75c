"""Resumable training state on disk: atomic saves and a JSONL log that matches them.

Owns: writing a state dict through a temporary file and ``os.replace`` (a run killed at any
moment leaves the previous save or the new one, never half of one), reading it back, the step
log, and the stop flag that SIGTERM / SIGINT set so a loop saves before it exits. Must not: know
what the state holds.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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
