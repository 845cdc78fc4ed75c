"""The persistent depth frame (kernels/persistent_depth.py) on CPU through Triton's
interpreter, one phase per launch (the GPU tests run it as one launch with its grid barriers):
its logits against the eager depth decoder fed the same codes, its draws against
``layers.sampling.sample`` on those logits, batch invariance, the switches that must change
no bit (L2 prefetch, attention folded into o_proj), and its refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from breezert.models.depth import DepthDecoder
from tests.kernel_helpers import (
    guided_depth_logits,
    needs_triton,
    random_bf16_fused_,
    rel_error,
    run_in_interpreter,
    teacher_forced_depth_logits,
)
from tests.unit.test_fused_depth_kernels import SMALL

pytestmark = pytest.mark.unit

RESERVED = 2048  # ids 2048.. are never drawn in the depth codebooks
MAX_K = 4  # the interpreter's top-k sort is slow: a small bound keeps a frame near a minute


def _decoder(seed: int) -> DepthDecoder:
    torch.manual_seed(seed)
    return random_bf16_fused_(DepthDecoder(SMALL))


def _inputs(num: int, cfg: bool, temperature: float, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * num if cfg else num
    return {
        "hidden": torch.randn(rows, SMALL.backbone_hidden_size, generator=gen).to(torch.bfloat16),
        "code0": torch.randint(0, 2048, (num,), generator=gen).index_fill_(0, torch.tensor([0]),
                                                                           2051),  # EOS: clamped
        "has_cfg": torch.tensor([i % 2 == 0 for i in range(num)]) & cfg,
        "cfg_scale": torch.linspace(1.5, 3.0, num),
        "depth_sampling": torch.tensor([[temperature, float(MAX_K), 0.9]]).repeat(num, 1),
        "seeds": torch.arange(num, dtype=torch.long) * 7919 + seed,
        "frames_at": torch.arange(num, dtype=torch.long) + 3,
    }


def check_greedy_frame(num: int, cfg: bool) -> None:
    """Greedy draws: each position's logits close to the eager decoder's on the same codes,
    each code the argmax of the guided logits (the eager argmax too, unless a near tie)."""
    from breezert.kernels.persistent_depth import PersistentDepthFrame

    depth = _decoder(1)
    inputs = _inputs(num, cfg, temperature=0.0, seed=2)
    frame = PersistentDepthFrame(depth, max_rows=8, programs=3, max_k=MAX_K)
    with torch.inference_mode():
        codes = frame(**inputs)
        logits = frame.frame_logits(inputs["hidden"].shape[0]).clone()
        want = teacher_forced_depth_logits(depth, inputs["hidden"], codes)
    assert torch.equal(codes[:, 0], inputs["code0"])
    assert int(codes[:, 1:].max()) < RESERVED and int(codes.min()) >= 0
    for pos in range(1, 16):
        got, ref = logits[pos], want[pos - 1]
        assert rel_error(got, ref) < 2e-2, (pos, rel_error(got, ref))
        guided, ref_guided = guided_depth_logits(got, inputs), guided_depth_logits(ref, inputs)
        assert torch.equal(codes[:, pos], guided.argmax(-1)), pos
        picked = ref_guided.gather(1, codes[:, pos : pos + 1])[:, 0]
        margin = ref_guided.max(-1).values - picked  # 0 where eager picks the same code
        assert (margin <= 0.02 * ref_guided.max(-1).values.abs() + 1e-3).all(), (pos, margin)
    assert torch.count_nonzero(frame.counters) == 0


def check_sampled_frame() -> None:
    """Sampled draws equal ``layers.sampling.sample`` on the kernel's own guided logits with
    counter ``frame * 16 + position``; a request alone gets the bits it gets in a crowd."""
    from breezert.kernels.persistent_depth import PersistentDepthFrame
    from breezert.layers.sampling import draw_counter, sample

    depth = _decoder(3)
    inputs = _inputs(2, cfg=True, temperature=0.9, seed=5)
    frame = PersistentDepthFrame(depth, max_rows=8, programs=2, max_k=MAX_K)
    with torch.inference_mode():
        codes = frame(**inputs)
        logits = frame.frame_logits(4).clone()
        params = inputs["depth_sampling"]
        for pos in range(1, 16):
            want = sample(guided_depth_logits(logits[pos], inputs), params[:, 0],
                          params[:, 1].long(), params[:, 2], inputs["seeds"],
                          draw_counter(inputs["frames_at"], pos), max_k=MAX_K)
            assert torch.equal(codes[:, pos], want), pos
        alone = {k: (v[[1, 3]] if k == "hidden" else v[1:2]) for k, v in inputs.items()}
        codes_alone = frame(**alone)
        logits_alone = frame.frame_logits(2)
    assert torch.equal(codes_alone[0], codes[1])
    assert torch.equal(logits_alone[1:, 0], logits[1:, 1])
    assert torch.equal(logits_alone[1:, 1], logits[1:, 3])


def _prefetch_targets(frame, pos: int, r: int) -> list[torch.Tensor]:
    """The weights the phase after (``pos``, ``r``) that reads weights streams (q/k/v with
    its o_proj: attention, in between or folded into o_proj, reads none), as
    ``_prefetch_next`` must ask for them."""
    layers, per_layer = frame.cfg.num_layers, frame.phases_per_layer
    per = 1 + per_layer * layers + 2
    layer, kind = divmod(r - 1, per_layer)
    if per_layer == 4:  # attention folded: q/k/v, o_proj, gate/up, down
        kind += kind > 0
    if r == 0 or (r < per - 2 and kind == 4 and layer < layers - 1):
        nxt = 0 if r == 0 else layer + 1
        return [frame.qkv[nxt], frame.o[nxt]]
    if r == per - 2:
        return [frame.proj] if 0 < pos < frame.cfg.num_codebooks - 1 else []
    if r == per - 1 or kind < 2:
        return []
    if kind < 4:
        return [(frame.gate_up, frame.down)[kind - 2][layer]]
    if pos > 0:
        return [frame.head[pos - 1]]
    return [frame.proj]


def check_prefetch_frame() -> None:
    """The L2 prefetch switch changes no code and no logit bit, and asks for exactly the next
    weight-reading phase's bytes (``_check_prefetch_log``)."""
    from breezert.kernels.persistent_depth import FrameTiles, PersistentDepthFrame

    depth = _decoder(3)
    inputs = _inputs(2, cfg=True, temperature=0.9, seed=5)
    programs, cap = 3, 16 * 1024
    with torch.inference_mode():
        off = PersistentDepthFrame(depth, max_rows=8, programs=programs, max_k=MAX_K)
        codes_off = off(**inputs)
        logits_off = off.frame_logits(4).clone()
        on = PersistentDepthFrame(depth, max_rows=8, programs=programs, max_k=MAX_K,
                                  tiles=FrameTiles(prefetch_kb=cap // 1024))
        codes_on = on(**inputs)
        logits_on = on.frame_logits(4)
    assert torch.equal(codes_on, codes_off)
    assert torch.equal(logits_on[1:], logits_off[1:])
    _check_prefetch_log(on, programs, cap)


def _check_prefetch_log(on, programs: int, cap: int) -> None:
    """Each phase asked L2 for the next weight-reading phase's bytes: each program its 1/P
    share (rounded up to 16 bytes), cut at ``prefetch_kb``; the shares of an uncut range tile it
    without gaps (the interpreter logs the (address, size) pairs that the GPU hands
    ``cp.async.bulk.prefetch.L2``)."""
    per = 1 + on.phases_per_layer * SMALL.num_layers + 2
    log = on.prefetch_log  # [phase, program, pair, (address, bytes)]
    cut = uncut = 0
    for s in range(on.phases):
        targets = _prefetch_targets(on, s // per, s % per)
        for j in range(2):
            asked = log[s, :, j]
            if j >= len(targets):
                assert not asked.any(), (s, j)
                continue
            w = targets[j]
            assert w.is_contiguous()
            nbytes = w.numel() * w.element_size()
            share = -(-(-(-nbytes // programs)) // 16) * 16
            starts = w.data_ptr() + share * torch.arange(programs)
            sizes = (nbytes - share * torch.arange(programs)).clamp(0, min(share, cap))
            assert torch.equal(asked[:, 1], sizes), (s, j)
            assert torch.equal(asked[sizes > 0, 0], starts[sizes > 0]), (s, j)
            if share <= cap:
                assert int(sizes.sum()) == nbytes, (s, j)
                uncut += 1
            else:
                cut += 1
    assert cut and uncut  # both kinds of range were checked


def check_fold_frame(cases: list[tuple[int, bool]], o_split: int = 4,
                     prefetch: bool = False) -> None:
    """``FrameTiles.fold_attention`` (no attention phase: each o_proj item attends for its
    own K range and rows) changes no code and no logit bit, at each (requests, CFG) of
    ``cases``; ``prefetch``: the last case also with the L2 prefetch on, whose ranges follow
    the 4 phases a layer. ``o_split`` sets the heads an item's K range holds (SMALL: 4 heads
    of 32, 2 a KV head: split 4 is one head, 8 half a head, 1 every head). A frame takes
    ~40 s in the interpreter."""
    from breezert.kernels.persistent_depth import FrameTiles, PersistentDepthFrame

    depth = _decoder(3)
    programs, cap = 3, 16 * 1024
    tiles = FrameTiles(o_split=o_split)
    off = PersistentDepthFrame(depth, max_rows=8, programs=programs, max_k=MAX_K, tiles=tiles)
    folded = [PersistentDepthFrame(depth, max_rows=8, programs=programs, max_k=MAX_K,
                                   tiles=replace(tiles, fold_attention=True, prefetch_kb=kb))
              for kb in ((0, cap // 1024) if prefetch else (0,))]
    per_layer_phases = 16 * SMALL.num_layers  # positions x layers: one attention phase each
    assert [f.phases for f in folded] == [off.phases - per_layer_phases] * len(folded)
    with torch.inference_mode():
        for i, (num, cfg) in enumerate(cases):
            inputs = _inputs(num, cfg, temperature=0.9, seed=11 + i)
            rows = inputs["hidden"].shape[0]
            codes = off(**inputs)
            logits = off.frame_logits(rows).clone()
            for frame in folded if i == len(cases) - 1 else folded[:1]:
                assert torch.equal(frame(**inputs), codes), (num, cfg, frame.tiles)
                assert torch.equal(frame.frame_logits(rows)[1:], logits[1:]), (num, cfg)
                assert torch.count_nonzero(frame.counters) == 0
    if prefetch:
        _check_prefetch_log(folded[1], programs, cap)


@needs_triton
def test_greedy_frame_matches_eager() -> None:
    run_in_interpreter(__name__, "check_greedy_frame(2, True)")


@needs_triton
def test_sampled_frame_matches_sample_and_is_batch_invariant() -> None:
    run_in_interpreter(__name__, "check_sampled_frame()")


@needs_triton
def test_prefetch_changes_no_bit_and_asks_for_the_next_weights() -> None:
    run_in_interpreter(__name__, "check_prefetch_frame()")


@needs_triton
# Two K-range mappings of the three, one request each (an interpreted frame takes ~40 s; the
# 3-request cases, o_split 4 and 8, ran once on 5 Dec, bit-identical): o_split 8 puts half a
# head in a split (with the L2 prefetch on), o_split 1 every head and KV group in one (CFG).
@pytest.mark.parametrize(("o_split", "num", "cfg", "prefetch"),
                         [(8, 1, False, True), (1, 1, True, False)])
def test_folded_attention_changes_no_bit(o_split: int, num: int, cfg: bool,
                                         prefetch: bool) -> None:
    run_in_interpreter(__name__, f"check_fold_frame([({num}, {cfg})], o_split={o_split}, "
                                 f"prefetch={prefetch})")


def test_refuses_what_it_cannot_run() -> None:
    from breezert.kernels.persistent_depth import FrameTiles, PersistentDepthFrame

    depth = _decoder(0)
    unpacked = DepthDecoder(SMALL).to(torch.bfloat16)
    with pytest.raises(ValueError, match="fuse_projections_"):
        PersistentDepthFrame(unpacked, max_rows=4)
    with pytest.raises(ValueError, match="bfloat16"):
        PersistentDepthFrame(DepthDecoder(SMALL), max_rows=4)
    with pytest.raises(ValueError, match="down_proj"):
        PersistentDepthFrame(depth, max_rows=4, tiles=FrameTiles(down_split=3))
    with pytest.raises(ValueError, match="prefetch_kb"):
        PersistentDepthFrame(depth, max_rows=4, tiles=FrameTiles(prefetch_kb=-1))
    frame = PersistentDepthFrame(depth, max_rows=4)
    inputs = _inputs(2, cfg=True, temperature=0.0, seed=0)
    with pytest.raises(ValueError, match="3 rows for 2 requests"):
        frame(**dict(inputs, hidden=inputs["hidden"][:3]))
    with pytest.raises(ValueError, match="6 rows past"):
        frame(**_inputs(3, cfg=True, temperature=0.0, seed=0))
