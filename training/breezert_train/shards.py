"""Teacher data shards: size-bounded ``.npz`` files written atomically, and the scan that resumes.

Owns the shard format, the writer (buffer, flush to ``*.tmp``, fsync, rename) and reading shards
back. A shard on disk under its final name is complete; anything else (``*.tmp``) is a run that was
killed and is deleted on the next start. Must not synthesise or choose texts.

Shard ``shard-<first utterance id>.npz`` (``numpy.load(..., allow_pickle=False)``):
``audio`` int16 [num_samples] 24 kHz, ``audio_offsets`` int64 [n + 1], ``utterance_ids`` int64 [n],
``phoneme_ids`` / ``durations`` int16 [num_ids] (durations in 40 Hz units), ``phoneme_offsets``
int64 [n + 1], ``meta`` uint8: UTF-8 JSON list of {utterance_id, source, text, phonemes}.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SHARD_GLOB = "shard-*.npz"
TMP_SUFFIX = ".tmp"
_ENTRY_OVERHEAD = 512
"""Bytes per array in an uncompressed .npz beyond its data: .npy header, zip local and central
directory records (measured ~250; kept generous)."""


@dataclass(frozen=True)
class ShardInfo:
    name: str
    num_utterances: int
    num_samples: int
    num_bytes: int
    utterance_ids: tuple[int, ...] = field(repr=False)
    sources: dict[str, int] = field(default_factory=dict)
    """Utterances per text source."""


@dataclass
class _Pending:
    utterance_id: int
    source: str
    text: str
    phonemes: str
    audio: np.ndarray
    phoneme_ids: np.ndarray
    durations: np.ndarray


def _arrays(items: list[_Pending]) -> dict[str, np.ndarray]:
    meta = [{"utterance_id": p.utterance_id, "source": p.source, "text": p.text,
             "phonemes": p.phonemes} for p in items]
    return {
        "audio": np.concatenate([p.audio for p in items]).astype(np.int16),
        "audio_offsets": np.cumsum([0] + [len(p.audio) for p in items], dtype=np.int64),
        "utterance_ids": np.asarray([p.utterance_id for p in items], np.int64),
        "phoneme_ids": np.concatenate([p.phoneme_ids for p in items]).astype(np.int16),
        "durations": np.concatenate([p.durations for p in items]).astype(np.int16),
        "phoneme_offsets": np.cumsum([0] + [len(p.durations) for p in items], dtype=np.int64),
        "meta": np.frombuffer(json.dumps(meta, ensure_ascii=False).encode(), np.uint8),
    }


def _item_bytes(item: _Pending) -> int:
    meta = len(item.text.encode()) + len(item.phonemes.encode()) + len(item.source) + 96
    return 2 * len(item.audio) + 4 * len(item.durations) + 16 + meta


class ShardWriter:
    """Buffers utterances and writes a shard before the next one would pass ``max_bytes``."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._items: list[_Pending] = []
        self._bytes = 7 * _ENTRY_OVERHEAD + 64

    @property
    def num_buffered(self) -> int:
        return len(self._items)

    def add(self, utterance_id: int, source: str, text: str, phonemes: str, audio: np.ndarray,
            phoneme_ids: np.ndarray, durations: np.ndarray) -> ShardInfo | None:
        """Buffer one utterance; returns the shard written first to make room, if any."""
        item = _Pending(utterance_id, source, text, phonemes, audio, phoneme_ids, durations)
        size = _item_bytes(item)
        if 7 * _ENTRY_OVERHEAD + 64 + size > self.max_bytes:
            raise ValueError(f"utterance {utterance_id} alone ({size} bytes) exceeds the shard "
                             f"limit of {self.max_bytes} bytes")
        written = self.flush() if self._bytes + size > self.max_bytes else None
        self._items.append(item)
        self._bytes += size
        return written

    def flush(self) -> ShardInfo | None:
        """Write the buffer as one shard: temp name, fsync, rename. Nothing buffered: None."""
        if not self._items:
            return None
        items, self._items = self._items, []
        self._bytes = 7 * _ENTRY_OVERHEAD + 64
        buffer = io.BytesIO()
        np.savez(buffer, **_arrays(items))
        data = buffer.getvalue()
        if len(data) > self.max_bytes:
            raise AssertionError(f"shard of {len(data)} bytes over the {self.max_bytes} limit")
        name = f"shard-{items[0].utterance_id:08d}.npz"
        tmp = self.directory / (name + TMP_SUFFIX)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.directory / name)
        return _info(name, items, len(data))


def _info(name: str, items: list[_Pending], num_bytes: int) -> ShardInfo:
    sources: dict[str, int] = {}
    for item in items:
        sources[item.source] = sources.get(item.source, 0) + 1
    return ShardInfo(name, len(items), sum(len(p.audio) for p in items), num_bytes,
                     tuple(p.utterance_id for p in items), sources)


def remove_partial(directory: Path) -> list[str]:
    """Delete what a killed run left half-written; returns the names removed."""
    removed = []
    for path in sorted(directory.glob("*" + TMP_SUFFIX)):
        path.unlink()
        removed.append(path.name)
    return removed


def read_shard(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {key: data[key] for key in data.files}


def iter_audio(directory: Path) -> Iterator[tuple[int, np.ndarray]]:
    """(utterance id, int16 [num_samples] audio) of every utterance in the complete shards, in
    shard order: what a codec trainer's crop source reads."""
    for path in sorted(directory.glob(SHARD_GLOB)):
        arrays = read_shard(path)
        offsets = arrays["audio_offsets"]
        for row, utterance_id in enumerate(arrays["utterance_ids"].tolist()):
            yield utterance_id, arrays["audio"][offsets[row]:offsets[row + 1]]


def scan(directory: Path) -> list[ShardInfo]:
    """Every complete shard in ``directory``, in name order."""
    shards = []
    for path in sorted(directory.glob(SHARD_GLOB)):
        with np.load(path, allow_pickle=False) as data:
            ids = tuple(int(i) for i in data["utterance_ids"])
            num_samples = int(data["audio_offsets"][-1])
            meta = json.loads(bytes(data["meta"]).decode())
        sources: dict[str, int] = {}
        for row in meta:
            sources[row["source"]] = sources.get(row["source"], 0) + 1
        num_bytes = path.stat().st_size
        shards.append(ShardInfo(path.name, len(ids), num_samples, num_bytes, ids, sources))
    return shards
