"""Start-up warm-up: capture every configured graph bucket before serving.

Owns: enumerating each stage's bucket keys (largest first, so smaller graphs reuse the pool)
and capturing them with the stage's example inputs. Must not: run requests or know the
``ModelRunner``: it gets the graph config and the stage runners it captures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from breezert.config import GraphConfig
from breezert.constants import Stage

PHASE_CAPTURE = "capturing graphs"

Progress = Callable[[str, int, int, str], None]
"""Start-up progress callback: ``(phase, done, total, detail)``, e.g. ``("capturing graphs", 12,
40, "decode (8, 512)")``; ``total`` 0 when the phase has no steps to count. Called on the
thread doing the work; it must be quick and must not raise."""



def capture_all(
    graph: GraphConfig, stages: Mapping[Stage, Any], max_codec_frames: int,
    progress: Progress | None = None, max_codec_step_frames: int | None = None,
) -> dict[str, float]:
    """Captures all buckets of all stages; returns seconds spent per stage. ``progress`` is
    called once before the first capture and after each one (``"capturing graphs"``).
    CODEC captures only the (rows, frames) keys a step of ``max_codec_step_frames`` can reach
    (all of them when ``None``).

    ``stages`` maps each stage to its runner: each has ``graphs`` (its ``GraphRunner``) and
    ``example_inputs(*key)``; DEPTH also ``full_sort_graphs``, CODEC ``graph_keys(max,
    max_step)``.
    """
    g, s = graph, stages
    contexts = sorted(g.decode_context_buckets, reverse=True)
    plan = {
        Stage.TEXT_ENCODE: [(n, lambda n=n: s[Stage.TEXT_ENCODE].example_inputs(n))
                            for n in sorted(g.text_encode_buckets, reverse=True)],
        Stage.PREFILL: [((n, k), lambda n=n, k=k: s[Stage.PREFILL].example_inputs(n, k))
                        for n in sorted(g.prefill_token_buckets, reverse=True)
                        for k in contexts if k >= n],
        Stage.DECODE: [((r, t), lambda r=r, t=t: s[Stage.DECODE].example_inputs(r, t))
                       for r in sorted(g.decode_batch_buckets, reverse=True) for t in contexts],
        Stage.DEPTH: [((b, cfg), lambda b=b, cfg=cfg: s[Stage.DEPTH].example_inputs(b, cfg))
                      for b in sorted(g.depth_batch_buckets, reverse=True) for cfg in (True, False)],
        Stage.CODEC: [((b, f), lambda b=b, f=f: s[Stage.CODEC].example_inputs(b, f))
                      for b, f in s[Stage.CODEC].graph_keys(
                          max_codec_frames, max_codec_step_frames or 1 << 30)],
    }
    report = progress or (lambda phase, done, total, detail: None)
    total = sum(len(keys) * (2 if stage is Stage.DEPTH else 1) for stage, keys in plan.items())
    done = 0
    report(PHASE_CAPTURE, done, total, "")
    seconds: dict[str, float] = {}
    for stage, keys in plan.items():
        start = time.monotonic()
        runners = [s[stage].graphs]
        if stage is Stage.DEPTH:
            runners.append(s[Stage.DEPTH].full_sort_graphs)
        for graphs in runners:
            for key, make_inputs in keys:
                graphs.capture(key, make_inputs())
                done += 1
                report(PHASE_CAPTURE, done, total, f"{stage.value} {key}")
        seconds[stage.value] = time.monotonic() - start
    return seconds
