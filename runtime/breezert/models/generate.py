"""Sequential reference generator: prompt -> frames of 16 codes, one request, optional CFG.

Owns: the ground-truth generation order of SPEC §2.3-2.6 (prefill, first-code sampling, depth
loop, EOS and length limits) on a ``DenseKVCache``. Must not: batch requests or be fast; the
engine reproduces it and is tested against it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from breezert.constants import FRAME_EOS_ID
from breezert.layers.attention import DenseKVCache
from breezert.layers.sampling import (
    apply_repetition_penalty,
    cfg_mix,
    draw_counter,
    sample,
    seen_mask,
    suppress_reserved,
)
from breezert.options import SamplingParams
from breezert.models.breeze import BreezeModel
from breezert.models.prompt import Prompt


def cfg_branches(prompt: Prompt, cfg_scale: float) -> list[Prompt]:
    """Cond (+ negative) prompts to run; scale 0 runs only the negative (SPEC §2.4)."""
    if cfg_scale == 1.0 or prompt.negative is None:
        # NOTE: plain and clone prompts define no negative, so CFG does not apply to them.
        return [prompt]
    if cfg_scale == 0.0:
        return [prompt.negative]
    return [prompt, prompt.negative]


def _mix(logits: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    """``[B, V]`` branch logits -> ``[1, V]``: cond alone, or ``u + s (c - u)`` with CFG."""
    if logits.shape[0] == 1:
        return logits
    return cfg_mix(logits[0:1], logits[1:2], cfg_scale)


@torch.no_grad()
def generate_frames(
    model: BreezeModel,
    prompt: Prompt,
    params: SamplingParams,
    seed: int = 0,
    max_frames: int = 1500,
    cfg_scale: float = 1.0,
    ignore_eos: bool = False,
    *,
    max_seq_len: int | None = None,
    frame_offset: int = 0,
) -> Iterator[torch.Tensor]:
    """Yields frames ``[16]`` (long, codes < 2048) one by one until EOS or a limit.

    Args:
        seed: the request's RNG seed; frame t's draws use counters ``draw_counter(t, j)``.
        cfg_scale: guidance scale s; CFG runs only when s != 1 and the prompt has a negative.
        ignore_eos: never stop on EOS (2051 is masked out instead of sampled).
        max_seq_len: stop once ``prefill_len + t >= max_seq_len - 1`` (default: model config).
        frame_offset: frames the request produced before this prompt (earlier segments), so the
            RNG stream continues across segments.
    """
    limit = model.cfg.max_seq_len if max_seq_len is None else max_seq_len
    branches = cfg_branches(prompt, cfg_scale)
    bb = model.cfg.backbone
    weight = model.lm_head.weight
    kv = DenseKVCache(
        bb.num_layers, bb.num_kv_heads, bb.head_dim, dtype=weight.dtype, device=weight.device
    )
    seq_ids = [kv.add_sequence() for _ in branches]
    lens = [p.num_tokens for p in branches]
    positions = kv.begin_step(seq_ids, lens)
    embeds = torch.cat(model.prompt_embeds_many(branches))  # [sum L, D]
    hidden = model.backbone_model(embeds, positions, kv)
    last = torch.tensor(lens).cumsum(0) - 1
    h_last = hidden[last.to(hidden.device)]  # [B, D]
    history: list[int] = []
    seeds = torch.tensor([seed], dtype=torch.long, device=weight.device)
    for t in range(max_frames):
        if max(lens) + t >= limit - 1:
            return
        logits = _mix(model.first_code_logits(h_last), cfg_scale)  # [1, 2052]
        if history and params.repetition_penalty != 1.0:
            seen = seen_mask([history], logits.shape[-1], logits.device)
            logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
        logits = suppress_reserved(logits)
        if ignore_eos:
            logits[:, FRAME_EOS_ID] = float("-inf")
        counter = torch.tensor([draw_counter(frame_offset + t, 0)], device=weight.device)
        code0 = sample(logits, params.temperature, params.top_k, params.top_p, seeds, counter)
        if int(code0[0]) == FRAME_EOS_ID:
            return
        frame = depth_frame(model, h_last, code0, params, seeds, frame_offset + t, cfg_scale)
        yield frame
        history.append(int(code0[0]))
        step_embeds = model.audio_frame_embeds(frame[None].to(weight.device))  # [1, D]
        positions = kv.begin_step(seq_ids, [1] * len(branches))
        h_last = model.backbone_model(step_embeds.expand(len(branches), -1), positions, kv)


def depth_frame(
    model: BreezeModel,
    h_last: torch.Tensor,
    code0: torch.Tensor,
    params: SamplingParams,
    seeds: torch.Tensor,
    frame_index: int,
    cfg_scale: float = 1.0,
) -> torch.Tensor:
    """Fills codebooks 1..15 for one logical request with B = 1 or 2 (CFG) branch rows.

    Args:
        h_last: ``[B, D]`` backbone states (cond first, then uncond).
        code0: ``[1]`` the sampled first code, fed to every branch.
        seeds: ``[1]`` the request's seed; ``frame_index`` its frame counter.
    """
    depth = model.depth_decoder
    num_rows = h_last.shape[0]
    cache = depth.new_cache(num_rows)
    depth.step(h_last, 0, cache)
    codes = [code0.to(h_last.device)]
    for j in range(1, model.cfg.num_codebooks):
        x = depth.embed_code(codes[-1].expand(num_rows), j - 1)  # [B, D]
        logits = _mix(depth.logits(depth.step(x, j, cache), j), cfg_scale)  # [1, 2051]
        logits = suppress_reserved(logits)
        counter = torch.tensor([draw_counter(frame_index, j)], device=h_last.device)
        p = params
        codes.append(
            sample(logits, p.depth_temperature, p.depth_top_k, p.depth_top_p, seeds, counter)
        )
    return torch.cat(codes).cpu()  # [16]
