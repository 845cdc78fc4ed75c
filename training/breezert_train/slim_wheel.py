"""A wheel without some of its files, for the GPU call's carry (64 MiB with the whole tree).

Owns: rewriting ``SRC.whl`` into ``DST_DIR`` under the same name (pip reads name, version and
tags from it) without the members named, their ``RECORD`` lines dropped too, so pip installs
what is left. ``make train-wheels`` uses it on pocketsphinx: its 23.5 MB word language model
(``en-us.lm.bin``) stays home, since the in-run scorer (``run_wer``) builds its own. Must not:
touch anything but the named members.

    python -m breezert_train.slim_wheel SRC.whl DST_DIR --drop pocketsphinx/model/en-us/en-us.lm.bin
"""

from __future__ import annotations

import argparse
import zipfile
from pathlib import Path


def slim_wheel(src: str | Path, dst_dir: str | Path, drop: list[str]) -> Path:
    """Writes ``dst_dir/<src name>`` without the ``drop`` members (each must exist)."""
    src, dst = Path(src), Path(dst_dir) / Path(src).name
    dst.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(src) as zin:
        names = zin.namelist()
        missing = sorted(set(drop) - set(names))
        if missing:
            raise ValueError(f"{src.name} has no {missing}")
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        tmp = dst.with_name(dst.name + ".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
            for info in zin.infolist():
                if info.filename in drop:
                    continue
                data = zin.read(info.filename)
                if info.filename == record:
                    data = "".join(line for line in data.decode().splitlines(keepends=True)
                                   if line.split(",", 1)[0] not in drop).encode()
                zout.writestr(info, data)
    tmp.replace(dst)
    return dst


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m breezert_train.slim_wheel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src")
    p.add_argument("dst_dir")
    p.add_argument("--drop", action="append", required=True, help="a member path (repeat)")
    args = p.parse_args(argv)
    out = slim_wheel(args.src, args.dst_dir, args.drop)
    print(f"{out} ({out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
