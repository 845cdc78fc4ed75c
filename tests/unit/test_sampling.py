"""Sampling functions on hand-made logits, SamplingParams validation, and the reference generator's
seeding, EOS and length limits on a tiny random model."""

from __future__ import annotations

import math

import pytest
import torch

from breezert.layers.sampling import (
    apply_repetition_penalty,
    RowSampling,
    cfg_mix,
    filter_top_k_top_p,
    gumbel_noise,
    sample,
    seen_mask,
    suppress_reserved,
)
from breezert.options import SamplingParams
from breezert.models.breeze import BreezeModel
from breezert.models.config import BreezeConfig
from breezert.models.generate import generate_frames
from breezert.models.prompt import Prompt, design_prompt, plain_prompt
from breezert.stages.depth import depth_frames

pytestmark = pytest.mark.unit


NEG_INF = float("-inf")


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    seen = seen_mask([[0, 1, 1, 0]], 4)  # duplicates count once
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert torch.equal(out, torch.tensor([[1.0, -4.0, 1.0, 0.5]]))
    assert torch.equal(apply_repetition_penalty(logits, seen_mask([[]], 4), 2.0), logits)


def test_repetition_penalty_per_row() -> None:
    logits = torch.tensor([[3.0, 1.0], [3.0, 1.0]])
    out = apply_repetition_penalty(logits, seen_mask([[0], [0]], 2), torch.tensor([1.0, 3.0]))
    assert torch.equal(out, torch.tensor([[3.0, 1.0], [1.0, 1.0]]))


def test_suppress_reserved_keeps_eos() -> None:
    backbone = suppress_reserved(torch.zeros(2, 2052))
    assert torch.isinf(backbone[:, 2048:2051]).all() and (backbone[:, 2048:2051] < 0).all()
    assert (backbone[:, 2051] == 0).all() and (backbone[:, :2048] == 0).all()
    depth = suppress_reserved(torch.zeros(1, 2051))
    assert torch.isinf(depth[:, 2048:]).all() and (depth[:, :2048] == 0).all()


def test_top_k_keeps_ties_and_zero_is_off() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0]])
    assert torch.equal(filter_top_k_top_p(logits, 2, 1.0), torch.tensor([[3.0, 2.0, 2.0, NEG_INF]]))
    assert torch.equal(filter_top_k_top_p(logits, 1, 1.0),
                       torch.tensor([[3.0, NEG_INF, NEG_INF, NEG_INF]]))
    assert torch.equal(filter_top_k_top_p(logits, 0, 1.0), logits)
    assert torch.equal(filter_top_k_top_p(logits, 10, 1.0), logits)


def test_top_p_keeps_first_token_crossing() -> None:
    logits = torch.tensor([[0.3, 0.5, 0.2]]).log()
    assert torch.isinf(filter_top_k_top_p(logits, 0, 0.6)[0, 2])  # 0.5 + 0.3 crosses 0.6: keep both
    assert torch.isfinite(filter_top_k_top_p(logits, 0, 0.6)[0, :2]).all()
    kept = torch.isfinite(filter_top_k_top_p(logits, 0, 0.4)).tolist()
    assert kept == [[False, True, False]]
    assert torch.equal(filter_top_k_top_p(logits, 0, 1.0), logits)


def test_temperature_cfg_and_greedy() -> None:
    logits = torch.tensor([[1.0, 4.0], [2.0, 6.0]])
    rows = RowSampling.of(torch.tensor([2.0, 0.0]), 0, 1.0, 2, 2, logits.device)
    assert torch.equal(logits / rows.divisor, torch.tensor([[0.5, 2.0], [2.0, 6.0]]))
    mixed = cfg_mix(torch.tensor([2.0, 1.0]), torch.tensor([1.0, 1.0]), 3.0)
    assert torch.equal(mixed, torch.tensor([4.0, 1.0]))
    zeros = torch.zeros(2, dtype=torch.long)
    assert sample(logits, 0.0, 50, 1.0, zeros, zeros).tolist() == [1, 1]


def test_sample_masked_ids_never_drawn_and_seeded() -> None:
    logits = suppress_reserved(torch.zeros(3, 2052))
    seeds = torch.tensor([1, 2, 1])
    counters = torch.zeros(3, dtype=torch.long)
    first = sample(logits, 1.0, 0, 1.0, seeds, counters)
    assert ((first < 2048) | (first == 2051)).all()
    assert first[0] == first[2]  # same seed and counter -> same draw
    assert torch.equal(sample(logits, 1.0, 0, 1.0, seeds, counters), first)
    # A row's draw depends on its own (seed, counter) only, never on its batch neighbours.
    alone = sample(logits[1:2], 1.0, 0, 1.0, seeds[1:2], counters[1:2])
    assert alone.item() == first[1].item()


def test_sample_counters_and_seeds_give_independent_draws() -> None:
    logits = torch.zeros(1, 2051)
    draws = {
        sample(logits, 1.0, 0, 1.0, torch.tensor([seed]), torch.tensor([counter])).item()
        for seed in (0, 1, 2) for counter in range(20)
    }
    assert len(draws) > 50  # 60 draws over 2051 equally likely ids: nearly all distinct


def test_sample_matches_softmax_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4).contiguous()
    seeds = torch.full((4000,), 11)
    draws = sample(logits, 1.0, 0, 1.0, seeds, torch.arange(4000))
    freq = torch.bincount(draws, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)
    # top-k 2 renormalises over the two most likely ids; top-p 0.6 keeps ids 0 and 1 as well.
    for k, p in ((2, 1.0), (0, 0.6)):
        draws = sample(logits, 1.0, k, p, seeds, torch.arange(4000))
        freq = torch.bincount(draws, minlength=4).float() / 4000
        assert torch.allclose(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.03)


def _reference_filter(logits: torch.Tensor, t: torch.Tensor, k: torch.Tensor,
                      p: torch.Tensor) -> torch.Tensor:
    """``sample``'s documented filtering spelled out row by row, with a full sort and none of
    the module's helpers: temperature (0: unchanged), top-k (ties kept, 0: off), then top-p
    (the first id to reach p kept, 1: off); dropped ids -inf."""
    rows = []
    for row in range(logits.shape[0]):
        scores = logits[row].float() / (t[row] if t[row] > 0 else 1.0)
        if k[row] > 0:
            kth = scores.sort(descending=True).values[min(int(k[row]), scores.numel()) - 1]
            scores = scores.masked_fill(scores < kth, NEG_INF)
        if p[row] < 1:
            values, order = scores.sort(descending=True)
            probs = values.softmax(-1)
            scores = scores.clone()
            scores[order[probs.cumsum(-1) - probs >= p[row]]] = NEG_INF
        rows.append(scores)
    return torch.stack(rows)


def test_sample_filters_and_draws_in_the_documented_order() -> None:
    """``sample`` (and so ``RowSampling``, which it runs) against the order it documents,
    written independently: the same ids kept, the same draw (greedy rows, top-k off, top-p
    off, and the bounded-k path)."""
    gen = torch.Generator().manual_seed(7)
    t = torch.tensor([0.9, 0.0, 1.3, 0.7, 1.0, 0.5])
    k = torch.tensor([50, 50, 0, 1, 64, 7])
    p = torch.tensor([1.0, 0.9, 0.8, 0.5, 0.95, 1.0])
    bounded = [0, 1, 3, 4, 5]  # rows whose k is in 1..64: the topk path
    for trial in range(40):
        logits = torch.randn(6, 2052, generator=gen) * (0.5 + trial % 5)
        want = _reference_filter(logits, t, k, p)
        tempered = logits / torch.where(t > 0, t, 1.0)[:, None]
        kept = torch.isfinite(filter_top_k_top_p(tempered, k, p))
        assert torch.equal(kept, torch.isfinite(want))
        kept = filter_top_k_top_p(tempered[bounded], k[bounded], p[bounded], max_k=64)
        assert torch.equal(torch.isfinite(kept), torch.isfinite(want[bounded]))
        seeds = torch.randint(0, 2**40, (6,), generator=gen)
        counters = torch.randint(0, 10_000, (6,), generator=gen)
        drawn = (want + gumbel_noise(seeds, counters, 2052)).argmax(-1)
        expected = torch.where(t > 0, drawn, logits.argmax(-1))
        assert torch.equal(sample(logits, t, k, p, seeds, counters), expected)
        got = sample(logits[bounded], t[bounded], k[bounded], p[bounded], seeds[bounded],
                     counters[bounded], max_k=64)
        assert torch.equal(got, expected[bounded])


def test_cpu_noise_has_the_bits_of_the_int64_path() -> None:
    """The CPU's 32-bit numpy noise equals the int64 torch operators (the graph-safe path every
    other device takes) bit for bit, over full 64-bit seeds, large counters and odd widths."""
    from breezert.layers.sampling import _cpu_counter_uniform, _torch_counter_uniform

    gen = torch.Generator().manual_seed(3)
    for rows, width in ((1, 2052), (33, 2052), (5, 7), (4, 0)):
        seeds = torch.randint(-2**63, 2**63 - 1, (rows,), generator=gen)
        counters = torch.randint(0, 2**40, (rows,), generator=gen)
        want = _torch_counter_uniform(seeds, counters, width)
        got = _cpu_counter_uniform(seeds, counters, width)
        assert got.dtype == want.dtype and torch.equal(got, want), (rows, width)
        assert torch.equal(gumbel_noise(seeds, counters, width), -torch.log(-torch.log(want)))
        assert bool(((got > 0) & (got < 1)).all())


def test_sample_top_k_one_is_argmax() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    seeds = torch.arange(4)
    assert torch.equal(sample(logits, 0.9, 1, 1.0, seeds, seeds * 0), logits.argmax(-1))


def test_sampling_params_defaults() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty) == (0.9, 50, 1.0, 1.1)
    assert (p.depth_temperature, p.depth_top_k, p.depth_top_p) == (0.9, 50, 1.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.inf),
        ("repetition_penalty", math.nan),
        ("depth_temperature", -1.0),
        ("depth_top_k", -3),
        ("depth_top_p", 0.0),
        ("depth_top_p", math.nan),
        ("temperature", "hot"),
    ],
)
def test_sampling_params_validation_names_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


# ------------------------------------------------------------------ generation on a tiny model
@pytest.fixture(scope="module")
def tiny() -> BreezeModel:
    return BreezeModel(BreezeConfig.tiny()).init_random_(torch.Generator().manual_seed(0)).eval()


@pytest.fixture(scope="module")
def prompt() -> Prompt:
    return plain_prompt([2, 100, 200, 300, 256000, 400])


def _run(model: BreezeModel, prompt: Prompt, seed: int, **kwargs: object) -> torch.Tensor:
    frames = generate_frames(
        model, prompt, SamplingParams(), seed, **kwargs
    )
    return torch.stack(list(frames))


def test_same_seed_same_codes_different_seed_different(tiny: BreezeModel, prompt: Prompt) -> None:
    a = _run(tiny, prompt, 7, max_frames=3, ignore_eos=True)
    b = _run(tiny, prompt, 7, max_frames=3, ignore_eos=True)
    c = _run(tiny, prompt, 8, max_frames=3, ignore_eos=True)
    assert a.shape == (3, 16) and a.dtype == torch.long
    assert ((a >= 0) & (a < 2048)).all()
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_eos_stops_generation(
    tiny: BreezeModel, prompt: Prompt, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}
    original = tiny.first_code_logits

    def forced_eos_at_frame_2(h_last: torch.Tensor) -> torch.Tensor:
        logits = original(h_last)
        calls["n"] += 1
        if calls["n"] == 3:
            logits[:, 2051] = 1e4
        return logits

    monkeypatch.setattr(tiny, "first_code_logits", forced_eos_at_frame_2)
    assert _run(tiny, prompt, 0, max_frames=10).shape == (2, 16)
    calls["n"] = 0
    assert _run(tiny, prompt, 0, max_frames=4, ignore_eos=True).shape == (4, 16)


def test_max_seq_len_limit(tiny: BreezeModel, prompt: Prompt) -> None:
    frames = _run(
        tiny, prompt, 0, max_frames=10, ignore_eos=True, max_seq_len=prompt.num_tokens + 3
    )
    assert frames.shape == (2, 16)  # stops once prefill_len + t >= max_seq_len - 1


def test_cfg_scale_zero_runs_negative_only(tiny: BreezeModel) -> None:
    design = design_prompt([2, 100, 200, 300], [2, 7, 8], speaker="S1")
    assert design.negative is not None
    greedy = SamplingParams.greedy()
    only_neg = list(generate_frames(tiny, design, greedy, 0, 2, cfg_scale=0.0, ignore_eos=True))
    plain = list(generate_frames(tiny, design.negative, greedy, 0, 2, ignore_eos=True))
    assert torch.equal(torch.stack(only_neg), torch.stack(plain))


def frame_inputs(model: BreezeModel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A depth frame of 3 requests for ``depth_frames``: hidden rows (cond, then uncond) and
    per-request inputs with guidance on and off, penalties, EOS allowed or not, and settings with
    top-k and top-p on and off (also ``test_depth_draw_kernel.py``'s frame)."""
    gen = torch.Generator().manual_seed(3)
    num = 3
    hidden = torch.randn(2 * num, model.cfg.backbone.hidden_size, generator=gen)
    inputs = dict(
        has_cfg=torch.tensor([True, False, True]), cfg_scale=torch.tensor([1.5, 1.0, 3.0]),
        seen=torch.rand(num, 2052, generator=gen) < 0.01, penalty=torch.tensor([1.1, 1.0, 1.3]),
        no_eos=torch.tensor([True, True, False]),
        sampling=torch.tensor([[0.9, 50, 1.0, 0.9, 50, 1.0], [1.2, 0, 0.8, 0.7, 5, 1.0],
                               [0.5, 64, 0.95, 1.0, 0, 0.9]]),
        seeds=torch.tensor([1, 2**40 + 7, 12345]), frames_at=torch.tensor([0, 5, 311]))
    return hidden, inputs


def test_noise_made_per_frame_draws_the_same_codes(tiny: BreezeModel) -> None:
    """``depth_frames(noise_per_frame=True)`` (the CPU path) makes the 16 draws' noise in one
    call: the codes are the per-draw path's, bit for bit (CFG rows, top-k and top-p included),
    and both are what ``sample`` draws when called per draw."""
    hidden, inputs = frame_inputs(tiny)
    for max_k in (None, 64):
        per_draw = depth_frames(tiny, hidden, **inputs, max_k=max_k)["codes"]
        per_frame = depth_frames(tiny, hidden, **inputs, max_k=max_k, noise_per_frame=True)
        assert torch.equal(per_frame["codes"], per_draw)
        # the settings turned into tensors once per frame (RowSampling) draw what ``sample``,
        # called per draw with the raw settings, draws
        by_sample = depth_frames(tiny, hidden, **inputs, max_k=max_k, sampler=sample)
        assert torch.equal(by_sample["codes"], per_draw)
