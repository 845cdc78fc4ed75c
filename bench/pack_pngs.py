"""Packs the result plots: each RGB(A) PNG under ``bench/results`` over ``MAX_BYTES`` becomes a
256-colour palette PNG in place (median-cut, no dither).

    .venv/bin/python bench/pack_pngs.py [FILE ...]   # default: every such plot in git

The tracked tree travels with every device call, and with the voice call's state, wheels and
corpus it must stay under the 64 MiB a call may carry; the plots were most of the tree (133
files, 13.0 MB on 7 Dec; 7.2 MB with those over 100 KB packed). A matplotlib figure has a few
flat colours and their antialiased edges, so 256 colours keep it as drawn: the 66 plots it
packed on 7 Dec differ from their originals (commit 2d6af65) by at most 0.18 of 255 per
channel on average, up to 90 on a few edge pixels (``tests/unit/test_pack_pngs.py`` holds a
figure's mean under ``MAX_MEAN_ERROR``).
The data of every plot is in the JSON beside it. Pack a new plot before committing it.

Owns: the repacking. Must not: touch anything but PNG files, or a plot already packed.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
from pathlib import Path

from PIL import Image

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
MAX_BYTES = 100_000
"""A plot larger than this is packed (``tests/unit/test_pack_pngs.py`` holds the tree to it)."""
MAX_MEAN_ERROR = 0.5
"""The mean difference per channel (of 255) the packing may make on a figure: the antialiased
edges' in-between shades are where a palette rounds."""


def packed(data: bytes) -> bytes | None:
    """``data`` (a PNG) as a palette PNG, or None where it is one already."""
    image = Image.open(io.BytesIO(data))
    if image.mode == "P":
        return None
    rgb = image.convert("RGB")
    palette = rgb.quantize(colors=256, method=Image.Quantize.MEDIANCUT,
                           dither=Image.Dither.NONE)
    out = io.BytesIO()
    palette.save(out, format="PNG", optimize=True)
    return out.getvalue()


def tracked_plots() -> list[Path]:
    """The PNGs under ``bench/results`` that git tracks."""
    names = subprocess.run(["git", "ls-files", "*.png"], cwd=RESULTS, capture_output=True,
                           text=True, check=True).stdout.split()
    return [RESULTS / name for name in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path)
    args = parser.parse_args(argv)
    before = after = 0
    for path in args.files or tracked_plots():
        data = path.read_bytes()
        if path.suffix != ".png" or len(data) <= MAX_BYTES:
            continue
        smaller = packed(data)
        if smaller is None or len(smaller) >= len(data):
            continue
        path.write_bytes(smaller)
        before, after = before + len(data), after + len(smaller)
        print(f"{path.name}: {len(data)} -> {len(smaller)} bytes")
    print(f"packed {before} -> {after} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
