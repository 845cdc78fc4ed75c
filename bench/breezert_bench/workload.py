"""The benchmark workload: texts, each request's fixed length, seeds and Poisson arrivals.

Owns: reading ``id<TAB>text`` files, the frames-from-text rule (EOS is ignored so runs are
comparable), per-request seeds and seeded open-loop arrival offsets. Must not: touch the engine,
torch or the clock.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

FRAMES_PER_SECOND = 12.5
"""Codec frames per second of audio (80 ms each)."""
CHARS_PER_SECOND = 15.0
"""Speaking rate used to turn text length into audio length."""
TEXTS_FILE = Path("bench") / "texts_en.tsv"

# Used when no texts file is found (e.g. on a machine without ../shared): 4-10 s each.
BUILTIN_TEXTS = (
    "The train left the station a little after nine, and nobody on board said a word.",
    "She folded the letter twice, slipped it into her coat, and walked out into the rain.",
    "Our small garden produced more tomatoes this summer than the whole street could eat.",
    "He promised to call as soon as the meeting ended, but the phone stayed silent all evening.",
    "A narrow path climbed through the pines toward the old lighthouse on the hill.",
    "Please remember to turn off the lights and lock the back door before you leave.",
    "The museum opens at ten, and the guided tour of the north wing starts an hour later.",
    "Every morning the baker set out fresh bread before the first customers arrived.",
    "They argued for an hour about the map, then discovered they had been holding it upside down.",
    "When the storm finally passed, the whole village came out to clear the fallen branches.",
    "I would rather walk the long way home than wait another twenty minutes for the bus.",
    "The children built a fort of blankets and chairs and refused to come out for dinner.",
)


@dataclass(frozen=True)
class WorkItem:
    """One benchmark request: its text, fixed length and seed."""

    index: int
    """Position in the run (0-based); the text is ``texts[index % len(texts)]``."""
    text: str
    num_frames: int
    """Frames to generate (``max_frames`` with EOS ignored)."""
    seed: int


def frames_for_text(text: str) -> int:
    """``max(1, round(len(text) / 15 chars/s * 12.5 frames/s))`` (Python's round: half to
    even, so 15 characters give 12 frames)."""
    return max(1, round(len(text) / CHARS_PER_SECOND * FRAMES_PER_SECOND))


def request_seed(base_seed: int, index: int) -> int:
    """The seed of request ``index``: the same index gets the same seed in every run."""
    return (base_seed * 1_000_003 + index) % 2**63


def load_texts(path: str | Path) -> list[str]:
    """Texts of an ``id<TAB>text`` file with a header line (a line without a tab is taken whole).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file holds no text.
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    texts = []
    for number, line in enumerate(lines):
        if number == 0 and line.lower().startswith("id\t"):
            continue
        text = line.split("\t", 1)[-1].strip()
        if text:
            texts.append(text)
    if not texts:
        raise ValueError(f"texts={str(path)!r} holds no text lines")
    return texts


def default_texts_path(repo_root: Path) -> Path | None:
    """``../shared/bench/texts_en.tsv`` next to the repo (or ``shared/`` inside it), if present."""
    for candidate in (repo_root.parent / "shared" / TEXTS_FILE, repo_root / "shared" / TEXTS_FILE):
        if candidate.is_file():
            return candidate
    return None


def make_workload(texts: Sequence[str], num_requests: int, seed: int) -> list[WorkItem]:
    """``num_requests`` items, texts cycled in order from the first, seeded per index."""
    if not texts:
        raise ValueError("texts must not be empty")
    return [
        WorkItem(i, texts[i % len(texts)], frames_for_text(texts[i % len(texts)]),
                 request_seed(seed, i))
        for i in range(num_requests)
    ]


def shard_items(items: Sequence[WorkItem], shard: tuple[int, int] | None) -> list[WorkItem]:
    """Shard ``(i, n)`` (1-based) of ``items``: the i-th of n contiguous, near-equal slices. Each
    item keeps its index and seed, so n shards run on n GPUs hold exactly the requests of one
    unsharded run; ``None`` returns every item."""
    if shard is None:
        return list(items)
    i, n = shard
    if not 1 <= i <= n:
        raise ValueError(f"shard {i}/{n}: needs 1 <= i <= n")
    return list(items[len(items) * (i - 1) // n: len(items) * i // n])


def poisson_offsets(rate_rps: float, num_requests: int, seed: int) -> list[float]:
    """Seeded arrival offsets (seconds from the run's start) of a Poisson process at ``rate_rps``;
    the first request arrives at 0."""
    if not rate_rps > 0:
        raise ValueError(f"rate={rate_rps!r} must be > 0 requests/s")
    rng = random.Random(f"{seed}:{rate_rps!r}")
    offsets, t = [], 0.0
    for i in range(num_requests):
        if i:
            t += rng.expovariate(rate_rps)
        offsets.append(t)
    return offsets
