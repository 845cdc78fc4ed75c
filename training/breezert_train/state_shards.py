"""Training state moved between GPU calls as files of bounded size: a folder <-> numbered parts.

Owns: packing a folder as one deterministic tar stream, xz-compressed (the logs shrink about
4x, bf16 weights a little: the voice's state of 7 Dec 19.0 MB gzip'd, 16.2 xz'd, which the LM
calls' carry needs; parts written gzip'd or before compression was added still join), cut into
``<prefix>.NNN`` parts of at most ``max_bytes`` (16 MiB by default, what a device call returns
per file), a
``<prefix>.json`` manifest with each part's size and SHA-256, and the reverse (parts checked
against the manifest before anything is written). Must not: know what the folder holds, or be
imported by serving code.

    python -m breezert_train.state_shards split SRC_DIR PARTS_DIR [--prefix state]
    python -m breezert_train.state_shards join PARTS_DIR DST_DIR [--prefix state]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import tarfile
from pathlib import Path

MAX_PART_BYTES = 16 * 1024 * 1024


class StateShardError(ValueError):
    """The parts are missing, corrupt or do not match their manifest."""


def _tar_bytes(src: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(p for p in src.rglob("*") if p.is_file()):
            info = tarfile.TarInfo(path.relative_to(src).as_posix())
            info.size, info.mode, info.mtime = path.stat().st_size, 0o644, 0
            with open(path, "rb") as f:
                tar.addfile(info, f)
    return buffer.getvalue()


def split_dir(src: str | Path, dst: str | Path, prefix: str = "state",
              max_bytes: int = MAX_PART_BYTES, compress: bool = True) -> list[Path]:
    """Writes ``dst/<prefix>.000 ...`` and ``dst/<prefix>.json`` (the parts of an earlier split
    there are removed first); returns every file written. Equal folders give byte-equal parts."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise StateShardError(f"not a folder: {src}")
    dst.mkdir(parents=True, exist_ok=True)
    for old in dst.glob(f"{prefix}.[0-9][0-9][0-9]"):
        old.unlink()
    data = _tar_bytes(src)
    if compress:  # one thread, a fixed preset: the same folder gives the same bytes
        data = lzma.compress(data, format=lzma.FORMAT_XZ, preset=6)
    parts = []
    for index, start in enumerate(range(0, max(len(data), 1), max_bytes)):
        piece = data[start : start + max_bytes]
        path = dst / f"{prefix}.{index:03d}"
        path.write_bytes(piece)
        parts.append({"name": path.name, "bytes": len(piece),
                      "sha256": hashlib.sha256(piece).hexdigest()})
    manifest = dst / f"{prefix}.json"
    manifest.write_text(json.dumps({"total_bytes": len(data), "parts": parts,
                                    **({"compression": "xz"} if compress else {})}, indent=1))
    return [dst / p["name"] for p in parts] + [manifest]


def join_dir(src: str | Path, dst: str | Path, prefix: str = "state") -> Path:
    """Checks every part against ``src/<prefix>.json`` and unpacks them into ``dst``."""
    src, dst = Path(src), Path(dst)
    manifest = src / f"{prefix}.json"
    if not manifest.is_file():
        raise StateShardError(f"missing manifest {manifest}")
    pieces = []
    for part in json.loads(manifest.read_text())["parts"]:
        path = src / part["name"]
        if not path.is_file():
            raise StateShardError(f"missing part {path}")
        piece = path.read_bytes()
        if len(piece) != part["bytes"] or hashlib.sha256(piece).hexdigest() != part["sha256"]:
            raise StateShardError(f"part {path} does not match {manifest.name}")
        pieces.append(piece)
    dst.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(b"".join(pieces)), mode="r:*") as tar:  # xz, gz, none
        tar.extractall(dst, filter="data")
    return dst


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m breezert_train.state_shards", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("verb", choices=("split", "join"))
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--prefix", default="state")
    p.add_argument("--max-bytes", type=int, default=MAX_PART_BYTES)
    args = p.parse_args(argv)
    if args.verb == "split":
        for path in split_dir(args.src, args.dst, args.prefix, args.max_bytes):
            print(f"{path} ({path.stat().st_size} bytes)")
    else:
        print(join_dir(args.src, args.dst, args.prefix))


if __name__ == "__main__":
    main()
