"""How many operators one serving-codec step issues on its fast path, counted on the CPU.

Usage: ``TRITON_INTERPRET=1 PYTHONPATH=<tree>/runtime python bench/codec_op_count.py ROWS
FRAMES`` (a tree: this checkout, or an old commit's ``git archive ... runtime``). Runs one
``StreamingCodec.decode`` of the full-size random codec with ``fast`` (the Triton kernels under
the interpreter; the CUDA-only branches of trees before 5 Dec's sixth session forced on, so
they take their GPU path) and prints JSON: the aten operators that launch work on a GPU (views
and metadata left out, and nothing inside a Triton launch), the Triton launches, and the most
frequent operators. A proxy for a graph replay's kernel nodes: cuDNN and cuBLAS may launch
more than one kernel per operator (``bench/profile_stages.py`` counts those on a GPU).

Owns: this count only. Must not: be imported by the runtime.
"""
from __future__ import annotations

import collections
import importlib.util
import json
import sys
import types

import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

VIEWS = {"view", "_unsafe_view", "select", "slice", "expand", "transpose", "t", "unsqueeze",
         "squeeze", "reshape", "detach", "alias", "split", "split_with_sizes", "narrow",
         "as_strided", "permute", "unbind", "lift_fresh", "empty", "empty_strided"}
"""Operators that launch no work on a GPU."""


def load(name: str, *swaps: tuple[str, str]) -> types.ModuleType:
    """Imports module ``name`` of the tree on the path with each ``(old, new)`` text swapped."""
    spec = importlib.util.find_spec(name)
    src = open(spec.origin).read()
    for old, new in swaps:
        src = src.replace(old, new)
    mod = types.ModuleType(name)
    mod.__file__ = spec.origin
    sys.modules[name] = mod
    exec(compile(src, spec.origin, "exec"), mod.__dict__)
    return mod


class Count(TorchDispatchMode):
    """Counts the aten operators that launch work, outside Triton launches, and the launches."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.launches: collections.Counter[str] = collections.Counter()
        self.inside = False
        run = triton.runtime.interpreter.InterpretedFunction.run
        count = self

        def counted(fn, *args, **kwargs):  # noqa: ANN001, ANN202
            count.launches[fn.fn.__name__] += 1
            count.inside = True
            try:
                return run(fn, *args, **kwargs)
            finally:
                count.inside = False

        triton.runtime.interpreter.InterpretedFunction.run = counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        if name not in VIEWS and not self.inside:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    rows, frames = int(sys.argv[1]), int(sys.argv[2])
    from breezert.models.config import CodecConfig

    load("breezert.kernels.snake", ("if not x.is_cuda:", "if False:"))  # older trees' CUDA check
    codec = load("breezert.models.codec", ("self.fast and x.is_cuda", "self.fast"))
    dec = codec.init_codec_random_(codec.CodecDecoder(CodecConfig()),
                                   torch.Generator().manual_seed(0)).eval()
    sc = codec.StreamingCodec(dec, rows + 1, fast=True)
    codes = torch.randint(0, 2048, (rows, frames, 16), generator=torch.Generator().manual_seed(1))
    num_frames = torch.full((rows,), frames, dtype=torch.long)
    sc.decode(torch.arange(rows), codes, num_frames)  # the first call makes lazy tables
    count = Count()
    with torch.inference_mode(), count:
        sc.decode(torch.arange(rows), codes, num_frames)
    ops, launches = sum(count.ops.values()), sum(count.launches.values())
    print(json.dumps({"rows": rows, "frames": frames, "aten_ops": ops, "triton_launches": launches,
                      "total": ops + launches, "kernels": dict(count.launches),
                      "top_aten": count.ops.most_common(10)}))


if __name__ == "__main__":
    main()
