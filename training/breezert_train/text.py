"""Training text: Debian-packaged public-domain/permissive sources split into bounded utterances.

Owns reading the sources (KJV Bible through Debian's ``bible`` program, ``fortunes``, WordNet
glosses and examples), sentence splitting, normalisation, filtering, deduplication, the held-out
split and the seeded order. Must not read the evaluation set (``texts_en.tsv``) for anything but
excluding its sentences, and does no synthesis.
"""

from __future__ import annotations

import hashlib
import random
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

FORTUNES_DIR = Path("/usr/share/games/fortunes")
WORDNET_DIR = Path("/usr/share/wordnet")
FORTUNES_SKIPPED = frozenset({"ascii-art"})
"""Fortune files that hold pictures, not prose."""

SOURCES: dict[str, dict[str, str]] = {
    "bible-kjv": {
        "debian_package": "bible-kjv-text (read with bible-kjv's `bible`)",
        "license": "public domain (King James Version, 1611); the BRS data file is free to use",
    },
    "fortunes": {
        "debian_package": "fortunes",
        "license": "BSD-3-Clause (fortune-mod; quotations as collected there)",
    },
    "wordnet": {
        "debian_package": "wordnet-base",
        "license": "WordNet 3.0 license (Princeton University, permissive, BSD-like)",
    },
}
"""Every text source: where it comes from and its license (mirrored in NOTICE)."""

_ALLOWED = re.compile(r"^[A-Za-z0-9 ,.;:!?'\"()\-]+$")
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')]*\s+(?=[\"'(]?[A-Z0-9])")
_CLAUSE = re.compile(r"(?<=[;:])\s+")
_WORD = re.compile(r"[A-Za-z0-9']+")
_ATTRIBUTION = re.compile(r"\s--\s.*$|^\s*--.*$")
_VERSE_REF = re.compile(r"^[1-3]?[A-Za-z]+\d+:\d+\s+")


@dataclass(frozen=True)
class Utterance:
    """One line of training text."""

    utterance_id: int
    """Position in the seeded training (or held-out) order; stable for a given corpus and seed."""
    source: str
    """A key of ``SOURCES``."""
    text: str


@dataclass(frozen=True)
class SplitConfig:
    min_words: int = 3
    """Shortest utterance kept, in words."""
    max_words: int = 20
    """Longest utterance kept, in words; longer sentences are cut at ``;`` / ``:`` first."""
    heldout_percent: float = 1.0
    """Share of distinct utterances held out, chosen by a hash of the text (seed-independent)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_words <= self.max_words:
            raise ValueError("need 1 <= min_words <= max_words, "
                             f"got {self.min_words}, {self.max_words}")
        if not 0.0 <= self.heldout_percent < 100.0:
            raise ValueError(f"heldout_percent must be in [0, 100), got {self.heldout_percent}")


def normalise(text: str) -> str:
    """Unicode quotes/dashes to ASCII, whitespace collapsed, stripped."""
    table = {"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2014": " - ",
             "\u2013": "-", "\u2026": "...", "`": "'", "\t": " ", "\n": " "}
    for old, new in table.items():
        text = text.replace(old, new)
    text = re.sub(r"\s+", " ", text).strip()
    return text


def dedup_key(text: str) -> str:
    """Case- and punctuation-free form: two utterances with the same key are one."""
    return " ".join(_WORD.findall(text.lower()))


def _acceptable(sentence: str, config: SplitConfig) -> bool:
    balanced = sentence.count('"') % 2 == 0 and sentence.count("(") == sentence.count(")")
    if not _ALLOWED.match(sentence) or not balanced:
        return False
    words = _WORD.findall(sentence)
    if not config.min_words <= len(words) <= config.max_words:
        return False
    letters = sum(ch.isalpha() for ch in sentence)
    shouting = sum(len(w) > 1 and w.isupper() for w in words)
    return letters >= 0.6 * len(sentence) and shouting * 2 <= len(words)


def _finish(piece: str) -> str:
    piece = piece.strip().strip(",;:- ").strip()
    if piece and piece[-1] not in ".!?\"')":
        piece += "."
    return piece[:1].upper() + piece[1:]


def split_utterances(text: str, config: SplitConfig) -> list[str]:
    """Sentences of ``text`` within the word bounds, clause-cut where a sentence is too long."""
    out: list[str] = []
    for sentence in _SENTENCE_END.split(normalise(text)):
        pieces = [sentence]
        if len(_WORD.findall(sentence)) > config.max_words:
            pieces = _CLAUSE.split(sentence)
        for piece in pieces:
            piece = _finish(piece)
            if piece and _acceptable(piece, config):
                out.append(piece)
    return out


def read_bible(bible_program: str | None = None) -> Iterator[str]:
    """Verses of the KJV, reference prefix removed (``bible`` decodes bible-kjv-text's data)."""
    program = bible_program or shutil.which("bible")
    if program is None:
        raise FileNotFoundError("`bible` not found: apt-get install -y bible-kjv bible-kjv-text")
    result = subprocess.run([program, "-f", "gen1:1-rev22:21"], stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, check=True)
    for line in result.stdout.splitlines():
        if _VERSE_REF.match(line):
            yield _VERSE_REF.sub("", line)


def parse_fortunes(text: str) -> Iterator[str]:
    """The entries of one fortune file (``%`` lines separate them), attributions removed."""
    for entry in re.split(r"^%\s*$", text, flags=re.MULTILINE):
        lines = [_ATTRIBUTION.sub("", line) for line in entry.splitlines()]
        body = " ".join(line for line in lines if line.strip())
        if body.strip():
            yield body


def read_fortunes(directory: Path = FORTUNES_DIR) -> Iterator[str]:
    for path in sorted(directory.glob("*.u8")):
        if path.stem not in FORTUNES_SKIPPED:
            yield from parse_fortunes(path.read_text(encoding="utf-8", errors="replace"))


def parse_wordnet_line(line: str) -> Iterator[str]:
    """Gloss and quoted examples of one ``data.*`` line: ``... | gloss; "example"; "example"``."""
    if line.startswith(" ") or " | " not in line:
        return
    gloss = line.split(" | ", 1)[1].strip()
    examples = re.findall(r'"([^"]+)"', gloss)
    definition = re.sub(r'"[^"]*"', "", gloss).strip(" ;")
    if definition:
        yield definition
    yield from examples


def read_wordnet(directory: Path = WORDNET_DIR) -> Iterator[str]:
    for part in ("noun", "verb", "adj", "adv"):
        with open(directory / f"data.{part}", encoding="utf-8", errors="replace") as f:
            for line in f:
                yield from parse_wordnet_line(line)


def read_sources() -> dict[str, Iterable[str]]:
    """Every source's raw passages, by ``SOURCES`` key (the Debian packages must be installed)."""
    return {"bible-kjv": read_bible(), "fortunes": read_fortunes(), "wordnet": read_wordnet()}


def read_excluded(path: Path | None) -> set[str]:
    """Dedup keys of the evaluation sentences (a TSV with a ``text`` column), never trained on."""
    if path is None or not path.exists():
        return set()
    rows = path.read_text(encoding="utf-8").splitlines()
    column = rows[0].split("\t").index("text")
    return {dedup_key(row.split("\t")[column]) for row in rows[1:] if row.strip()}


def _is_heldout(key: str, percent: float) -> bool:
    digest = int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big")
    return digest % 10_000 < percent * 100


def build_corpus(passages: dict[str, Iterable[str]], config: SplitConfig, seed: int,
                 excluded: set[str] | None = None) -> tuple[list[Utterance], list[Utterance]]:
    """(train, held-out) utterances: split, filtered, deduplicated across sources (first source
    in sorted order wins), evaluation sentences dropped, train shuffled by ``seed``."""
    seen: set[str] = set(excluded or ())
    train: list[tuple[str, str]] = []
    heldout: list[tuple[str, str]] = []
    for source in sorted(passages):
        for passage in passages[source]:
            for text in split_utterances(passage, config):
                key = dedup_key(text)
                if key in seen:
                    continue
                seen.add(key)
                is_heldout = _is_heldout(key, config.heldout_percent)
                (heldout if is_heldout else train).append((source, text))
    random.Random(seed).shuffle(train)
    return ([Utterance(i, s, t) for i, (s, t) in enumerate(train)],
            [Utterance(i, s, t) for i, (s, t) in enumerate(heldout)])
