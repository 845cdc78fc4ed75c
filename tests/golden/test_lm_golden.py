"""The plain-PyTorch LM against ``lm_golden.safetensors``: prompts, prefill, depth logits, codes.

Loads the tiny golden checkpoint with a minimal local safetensors read (not ``breezert.loader``),
dropping the dead ``codec_model.*`` / ``embed_text_tokens`` tensors, then ``strict=True``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from breezert.constants import INS_BOS_TOKEN_ID, INS_EOS_TOKEN_ID
from breezert.layers.attention import DenseKVCache
from breezert.options import SamplingParams
from breezert.models.breeze import BreezeModel
from breezert.models.config import BreezeConfig
from breezert.models.generate import generate_frames
from breezert.models.prompt import Prompt, build_prompt
from tests.golden._paths import golden_dir

pytestmark = pytest.mark.golden


CASES = [
    "design_cfg1",
    "plain_cfg1",
    "clone_cfg1",
    "direction_cfg1",
    "design_cfg3",
    "direction_cfg3",
]
DEAD_PREFIXES = ("codec_model.", "embed_text_tokens.")


@dataclass
class Golden:
    model: BreezeModel
    tensors: dict[str, torch.Tensor]
    cases: dict[str, dict]


@pytest.fixture(scope="module")
def golden() -> Golden:
    root = golden_dir()
    state: dict[str, torch.Tensor] = {}
    for shard in sorted((root / "model").glob("model-*-of-*.safetensors")):
        state.update(load_file(shard))
    state = {k: v for k, v in state.items() if not k.startswith(DEAD_PREFIXES)}
    model = BreezeModel(BreezeConfig.tiny())
    model.load_state_dict(state, strict=True)
    model.eval()
    meta = json.loads(Path(root / "lm_golden.json").read_text())
    return Golden(model, load_file(root / "lm_golden.safetensors"), meta["cases"])


def _segments(ids: torch.Tensor, mask: torch.Tensor, lens: torch.Tensor) -> list[list[int]]:
    """Text segments = the masked positions split by ``text_ids_len``."""
    positions = mask.nonzero().flatten().tolist()
    segments, offset = [], 0
    for n in lens.tolist():
        segments.append(ids[positions[offset : offset + n]].tolist())
        offset += n
    return segments


def _prompt(g: Golden, case: str) -> Prompt:
    """Rebuilds the case's raw tokenized inputs from its golden ids, then runs the templates."""
    t = g.tensors
    segments = _segments(
        t[f"{case}.input_ids"], t[f"{case}.text_ids_mask"], t[f"{case}.text_ids_len"]
    )
    target = segments[-1]
    assert target[:2] == [2, 262146]  # bos, [S0]
    instruction = None
    text = [2, *target[2:]]
    if INS_BOS_TOKEN_ID in target:
        start, end = target.index(INS_BOS_TOKEN_ID), target.index(INS_EOS_TOKEN_ID)
        instruction, text = [2, *target[start + 1 : end]], [2, *target[end + 1 :]]
    ref_text, ref_codes = None, None
    if len(segments) == 2:
        ref_text, ref_codes = [2, *segments[0][2:]], t["ref_codes"]
    return build_prompt(
        text,
        speaker="[S0]",
        instruction_ids=instruction,
        ref_text_ids=ref_text,
        ref_codes=ref_codes,
    )


def _prefill(model: BreezeModel, prompt: Prompt) -> tuple[torch.Tensor, torch.Tensor]:
    bb = model.cfg.backbone
    kv = DenseKVCache(bb.num_layers, bb.num_kv_heads, bb.head_dim)
    seq_id = kv.add_sequence()
    positions = kv.begin_step([seq_id], [prompt.num_tokens])
    embeds = model.prompt_embeds(prompt)
    return embeds, model.backbone_model(embeds, positions, kv)[-1]


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.mark.parametrize("case", CASES)
def test_prompt_ids(golden: Golden, case: str) -> None:
    t = golden.tensors
    prompt = _prompt(golden, case)
    assert torch.equal(prompt.input_ids, t[f"{case}.input_ids"])
    assert torch.equal(prompt.text_ids_mask, t[f"{case}.text_ids_mask"])
    assert torch.equal(prompt.text_ids_len, t[f"{case}.text_ids_len"])
    if f"{case}.neg_input_ids" in t:
        assert prompt.negative is not None
        assert torch.equal(prompt.negative.input_ids, t[f"{case}.neg_input_ids"])
        assert torch.equal(prompt.negative.text_ids_mask, t[f"{case}.neg_text_ids_mask"])
        assert torch.equal(prompt.negative.text_ids_len, t[f"{case}.neg_text_ids_len"])


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_prefill(golden: Golden, case: str) -> None:
    t, model = golden.tensors, golden.model
    embeds, h_last = _prefill(model, _prompt(golden, case))
    assert _max_err(embeds, t[f"{case}.prefill_inputs_embeds"]) <= 1e-5
    assert _max_err(h_last, t[f"{case}.prefill_last_hidden"]) <= 1e-5
    logits = model.first_code_logits(h_last[None])[0]
    assert logits.dtype == torch.float32
    assert _max_err(logits, t[f"{case}.prefill_logits"]) <= 1e-4


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_frame0_depth_logits(golden: Golden, case: str) -> None:
    t, model = golden.tensors, golden.model
    _, h_last = _prefill(model, _prompt(golden, case))
    codes = t[f"{case}.rp1.codes"][0]  # teacher forcing with the golden frame 0
    depth = model.depth_decoder
    cache = depth.new_cache(1)
    depth.step(h_last[None], 0, cache)
    rows = []
    for j in range(1, 16):
        hidden = depth.step(depth.embed_code(codes[j - 1 : j], j - 1), j, cache)
        rows.append(depth.logits(hidden, j)[0])
    assert _max_err(torch.stack(rows), t[f"{case}.frame0_depth_logits_cond"]) <= 1e-4


@pytest.mark.parametrize("penalty", ["1", "1.1"])
@pytest.mark.parametrize("case", CASES)
def test_greedy_frames(golden: Golden, case: str, penalty: str) -> None:
    expected = golden.tensors[f"{case}.rp{penalty}.codes"]
    params = SamplingParams.greedy(repetition_penalty=float(penalty))
    frames = generate_frames(
        golden.model,
        _prompt(golden, case),
        params,
        0,
        max_frames=expected.shape[0],
        cfg_scale=golden.cases[case]["cfg_scale"],
    )
    assert torch.equal(torch.stack(list(frames)), expected)
