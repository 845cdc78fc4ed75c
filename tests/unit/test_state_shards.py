"""State split into bounded parts and joined back: sizes, round trip, determinism, corruption.

Owns CPU-only checks of ``breezert_train.state_shards`` on a folder of random files made in the
test. Must not: need a GPU or training.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from breezert_train import state_shards
from breezert_train.state_shards import StateShardError, join_dir, main, split_dir

pytestmark = pytest.mark.unit


def _folder(root: Path) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    files = {"codec/audio_tokenizer/model.safetensors": rng.bytes(30_000),
             "codes/codes-00000000.npz": rng.bytes(12_345), "lm/snapshot.pt": rng.bytes(9_000),
             "lm/log.jsonl": b'{"step": 1}\n', "empty.txt": b""}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def _read(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_split_bounds_every_part_and_join_restores_the_folder(tmp_path: Path) -> None:
    files = _folder(tmp_path / "src")
    written = split_dir(tmp_path / "src", tmp_path / "parts", max_bytes=10_000)
    parts = [p for p in written if p.suffix != ".json"]
    assert len(parts) >= 5 and all(p.stat().st_size <= 10_000 for p in parts)
    assert _read(join_dir(tmp_path / "parts", tmp_path / "dst")) == files
    again = split_dir(tmp_path / "dst", tmp_path / "parts2", max_bytes=10_000)  # deterministic
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in written]


def test_join_refuses_a_corrupt_or_missing_part_and_writes_nothing(tmp_path: Path) -> None:
    _folder(tmp_path / "src")
    split_dir(tmp_path / "src", tmp_path / "parts", max_bytes=10_000)
    part = tmp_path / "parts" / "state.001"
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(StateShardError, match="state.001"):
        join_dir(tmp_path / "parts", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()
    part.unlink()
    with pytest.raises(StateShardError, match="missing part"):
        join_dir(tmp_path / "parts", tmp_path / "dst")


def test_a_new_split_replaces_the_old_parts_and_the_cli_round_trips(tmp_path: Path) -> None:
    files = _folder(tmp_path / "src")
    split_dir(tmp_path / "src", tmp_path / "parts", max_bytes=5_000)  # more, smaller parts
    main(["split", str(tmp_path / "src"), str(tmp_path / "parts"), "--max-bytes", "20000"])
    manifest = json.loads((tmp_path / "parts" / "state.json").read_text())
    names = sorted(p.name for p in (tmp_path / "parts").glob("state.[0-9]*"))
    assert names == [p["name"] for p in manifest["parts"]]
    main(["join", str(tmp_path / "parts"), str(tmp_path / "dst")])
    assert _read(tmp_path / "dst") == files


def test_parts_are_xz_compressed_and_gzip_or_uncompressed_ones_still_join(
        tmp_path: Path) -> None:
    """A log-like file shrinks several times; parts split before compression (the snapshot
    committed on 4 Dec) or gzip'd (7 Dec's) join as before."""
    files = _folder(tmp_path / "src")
    log = "".join(f'{{"step": {i}, "loss": {1 / (i + 1):.4f}}}\n' for i in range(3000)).encode()
    (tmp_path / "src" / "codec_log.jsonl").write_bytes(log)
    files["codec_log.jsonl"] = log
    packed = split_dir(tmp_path / "src", tmp_path / "gz")
    plain = split_dir(tmp_path / "src", tmp_path / "plain", compress=False)
    size = {name: sum(p.stat().st_size for p in parts if p.suffix != ".json")
            for name, parts in (("gz", packed), ("plain", plain))}
    assert size["gz"] < size["plain"] - len(log) // 2
    assert json.loads((tmp_path / "gz" / "state.json").read_text())["compression"] == "xz"
    assert _read(join_dir(tmp_path / "plain", tmp_path / "dst1")) == files
    assert _read(join_dir(tmp_path / "gz", tmp_path / "dst2")) == files
    # a gzip'd pack as 7 Dec's calls left them: one part of the gzip'd tar, its manifest
    import gzip
    import hashlib

    old = gzip.compress(state_shards._tar_bytes(tmp_path / "src"), mtime=0)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "state.000").write_bytes(old)
    (tmp_path / "old" / "state.json").write_text(json.dumps({
        "total_bytes": len(old), "compression": "gzip", "parts": [
            {"name": "state.000", "bytes": len(old),
             "sha256": hashlib.sha256(old).hexdigest()}]}))
    assert _read(join_dir(tmp_path / "old", tmp_path / "dst3")) == files
