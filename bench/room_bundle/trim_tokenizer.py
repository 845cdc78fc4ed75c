"""A ``tokenizer.json`` cut down to the BPE merges that the bench texts need, for the room
benchmark's bundle (``bench/room_bundle/build.sh``): the full one (16 MB, 3.1 MB in xz) leaves
the H200 call over its 64 MiB with the tree, livekit-server and the wheels.

    python bench/room_bundle/trim_tokenizer.py FULL.json TEXTS.tsv OUT.json

Keeps the whole vocabulary (same ids), the added tokens and the pipeline, and of the merges
those whose result is a token of the closure below. BPE applies, at each step, the
lowest-ranked merge among the adjacent pairs; any subset of merges that holds every merge the
full tokenizer applied to a text gives that text the same tokens (the chosen merge is still the
lowest-ranked one present). The closure: every token the full tokenizer produced for the texts,
their sentences and their words (alone and with the spaces around them), and, recursively, both
halves of every merge that produces a token of it, so every merge applied on the way is kept.
Checked on every text, sentence and word before it is written: the ids must equal the full
tokenizer's. Must not: be used for anything but random-weight benchmarks of these texts.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def pieces(texts: list[str]) -> list[str]:
    """The texts, their sentences, and their words alone and with the spaces around them."""
    out: set[str] = set()
    for text in texts:
        out.add(text)
        out.update(s for s in re.split(r"(?<=[.!?;:])\s+", text) if s)
        for word in text.split():
            out.update((word, word + " ", " " + word, " " + word + " "))
    return sorted(out)


def main(argv: list[str]) -> int:
    from tokenizers import Tokenizer

    full_path, texts_path, out_path = (Path(a) for a in argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
    from breezert_bench.workload import load_texts

    samples = pieces(load_texts(texts_path))
    full = Tokenizer.from_file(str(full_path))
    doc = json.loads(full_path.read_text(encoding="utf-8"))
    merges = doc["model"]["merges"]
    pairs = [m.split(" ", 1) if isinstance(m, str) else m for m in merges]
    by_result: dict[str, list[int]] = {}
    for i, (a, b) in enumerate(pairs):
        by_result.setdefault(a + b, []).append(i)
    wanted = {tok for s in samples for tok in full.encode(s).tokens}
    keep: set[int] = set()
    stack = list(wanted)
    while stack:
        token = stack.pop()
        for i in by_result.get(token, ()):
            if i not in keep:
                keep.add(i)
                for half in pairs[i]:
                    if half not in wanted:
                        wanted.add(half)
                        stack.append(half)
    doc["model"]["merges"] = [merges[i] for i in sorted(keep)]
    trimmed = Tokenizer.from_str(json.dumps(doc))
    for s in samples:
        if trimmed.encode(s).ids != full.encode(s).ids:
            raise SystemExit(f"the trimmed tokenizer differs on {s!r}")
    out_path.write_text(json.dumps(doc, ensure_ascii=False, separators=(",", ":")),
                        encoding="utf-8")
    print(f"tokenizer: {len(keep)} of {len(merges)} merges kept, same ids on {len(samples)} "
          f"texts, sentences and words")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
