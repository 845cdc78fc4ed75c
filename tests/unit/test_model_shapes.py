"""Model structure: released parameter count and names, packed text encoding, KV-cache contract,
depth step shapes, prompt validation and random init."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from breezert.layers.attention import DenseKVCache, sdpa_gqa
from breezert.layers.norms import GemmaRMSNorm, RMSNorm
from breezert.layers.rope import apply_rope, apply_rope_signed, fold_rotation_sign
from breezert.models.backbone import Qwen3Backbone
from breezert.models.breeze import BreezeModel
from breezert.models.config import BackboneConfig, BreezeConfig
from breezert.models.prompt import build_prompt, speaker_token_id
from breezert.models.text_encoder import T5Gemma2TextEncoder, sliding_block_mask

pytestmark = pytest.mark.unit


LIVE_PREFIXES = (
    "text_encoder.",
    "text_encoder_proj.",
    "backbone_model.",
    "lm_head.",
    "depth_decoder.",
)


def test_full_config_parameter_count_on_meta() -> None:
    with torch.device("meta"):
        model = BreezeModel(BreezeConfig.full())
    assert model.count_parameters() == 2_850_155_520
    names = model.state_dict().keys()
    assert len(names) == 764  # 1115 released tensors - 350 codec_model.* - embed_text_tokens
    assert all(name.startswith(LIVE_PREFIXES) for name in names)
    assert "depth_decoder.model.embed_tokens.weight" in names
    assert not any("embed_audio_tokens" in name for name in names)  # tied, registered once
    assert model.depth_decoder.codebooks_head.weight.shape == (15, 1024, 2051)


@pytest.fixture(scope="module")
def tiny() -> BreezeModel:
    return BreezeModel(BreezeConfig.tiny()).init_random_(torch.Generator().manual_seed(1)).eval()


def test_init_random_norm_conventions(tiny: BreezeModel) -> None:
    for module in tiny.modules():
        if isinstance(module, GemmaRMSNorm):
            assert (module.weight == 0).all()
        elif isinstance(module, RMSNorm):
            assert (module.weight == 1).all()
    assert all(torch.isfinite(p).all() for p in tiny.parameters())
    assert tiny.text_encoder.embed_tokens.eoi_embedding.abs().sum() > 0


@torch.no_grad()
def test_meta_build_then_assign_load_runs(tiny: BreezeModel) -> None:
    """The loader's path: build on meta, ``load_state_dict(strict=True, assign=True)``."""
    with torch.device("meta"):
        model = BreezeModel(BreezeConfig.tiny())
    model.load_state_dict(tiny.state_dict(), strict=True, assign=True)
    codes = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    h_last = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    for m in (model, tiny):
        cache = m.depth_decoder.new_cache(2)
        m.depth_decoder.step(h_last, 0, cache)
        hidden = m.depth_decoder.step(m.depth_decoder.embed_code(codes[:, 0], 0), 1, cache)
        ids = torch.tensor([2, 262146, 5, 256000, 7])
        out = (m.encode_text_segments(ids, [5]), m.audio_frame_embeds(codes), hidden)
        if m is model:
            first = out
    for a, b in zip(first, out, strict=True):
        assert torch.equal(a, b)


@torch.no_grad()
def test_text_encoder_packed_equals_separate(tiny: BreezeModel) -> None:
    encoder: T5Gemma2TextEncoder = tiny.text_encoder
    lens = [5, 9, 1, 3]
    ids = torch.randint(0, 262158, (sum(lens),), generator=torch.Generator().manual_seed(0))
    ids[2] = 256000  # eoi substitution inside a packed batch
    packed = encoder(ids, lens)
    separate = torch.cat([encoder(seg, [len(seg)]) for seg in ids.split(lens)])
    torch.testing.assert_close(packed, separate, atol=1e-5, rtol=1e-5)
    cu_seqlens = torch.tensor([0, 5, 14, 15, 18])
    torch.testing.assert_close(encoder(ids, cu_seqlens), packed, atol=0, rtol=0)
    with pytest.raises(ValueError, match="seg_lens"):
        encoder(ids, [5, 9])


def test_sliding_window_is_symmetric() -> None:
    positions = torch.arange(12)
    seg = torch.zeros(12, dtype=torch.long)
    mask = sliding_block_mask(seg, positions, 4)
    dist = positions[:, None] - positions[None, :]
    assert torch.equal(mask, (dist >= -2) & (dist <= 1))
    big = torch.arange(600)
    mask = sliding_block_mask(torch.zeros(600, dtype=torch.long), big, 512)
    assert mask[300, 300 + 256] and not mask[300, 300 + 257]  # q - k = -256 in, -257 out
    assert mask[300, 300 - 255] and not mask[300, 300 - 256]  # q - k = 255 in, 256 out


@torch.no_grad()
def test_dense_kv_decode_equals_prefill_and_sequences_independent() -> None:
    cfg = BackboneConfig(
        hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
    )
    torch.manual_seed(0)
    backbone = Qwen3Backbone(cfg).eval()
    x, y = torch.randn(7, 32), torch.randn(3, 32)

    def cache() -> DenseKVCache:
        return DenseKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, initial_capacity=2)

    full_kv = cache()
    sid = full_kv.add_sequence()
    full = backbone(x, full_kv.begin_step([sid], [7]), full_kv)  # [7, D]
    kv = cache()
    a, b = kv.add_sequence(), kv.add_sequence()
    both = backbone(torch.cat([x[:4], y]), kv.begin_step([a, b], [4, 3]), kv)
    steps = [backbone(x[i : i + 1], kv.begin_step([a], [1]), kv) for i in range(4, 7)]
    torch.testing.assert_close(torch.cat([both[:4], *steps]), full, atol=1e-5, rtol=1e-5)
    alone_kv = cache()
    c = alone_kv.add_sequence()
    alone = backbone(y, alone_kv.begin_step([c], [3]), alone_kv)
    torch.testing.assert_close(both[4:], alone, atol=1e-5, rtol=1e-5)
    assert kv.seq_len(a) == 7 and kv.seq_len(b) == 3


@torch.no_grad()
def test_depth_step_and_logit_shapes(tiny: BreezeModel) -> None:
    depth = tiny.depth_decoder
    cache = depth.new_cache(3)
    assert cache.shape == (2, 2, 3, 2, 16, 8)  # [L, 2, R, KVH, 16, D]
    hidden = depth.step(torch.randn(3, 64), 0, cache)
    assert hidden.shape == (3, 32)
    hidden = depth.step(depth.embed_code(torch.tensor([0, 5, 2047]), 0), 1, cache)
    logits = depth.logits(hidden, 1)
    assert logits.shape == (3, 2051) and logits.dtype == torch.float32
    frames = torch.randint(0, 2048, (2, 16))
    assert tiny.audio_frame_embeds(frames).shape == (2, 64)
    assert tiny.first_code_logits(torch.randn(2, 64)).shape == (2, 2052)


def _depth_step_by_modules(depth, x: torch.Tensor, position: int,
                           cache: torch.Tensor) -> torch.Tensor:
    """The depth step spelled out through the submodules' own calls (``RMSNorm``, the
    projections, ``apply_rope`` on q and k apart, the MLP module): what ``DepthLayer.forward``
    writes out on the weights for speed."""
    cos, sin = depth.rope.cos_sin(torch.tensor([position]), x.dtype)
    mask = (torch.arange(cache.shape[4]) <= position)[None, None, None, :]
    h = depth.model.inputs_embeds_projector(x)
    rows = x.shape[0]
    for i, layer in enumerate(depth.model.layers):
        attn = layer.self_attn
        q, k, v = attn.project(layer.input_layernorm(h))
        q = apply_rope(q.reshape(rows, attn.num_heads, attn.head_dim), cos.expand(rows, -1),
                       sin.expand(rows, -1))
        k = apply_rope(k.reshape(rows, attn.num_kv_heads, attn.head_dim), cos.expand(rows, -1),
                       sin.expand(rows, -1))
        cache[i, 0, :, :, position] = k
        cache[i, 1, :, :, position] = v.reshape(rows, attn.num_kv_heads, attn.head_dim)
        out = sdpa_gqa(q[:, :, None, :], cache[i, 0], cache[i, 1], mask)
        h = h + attn.o_proj(out.reshape(rows, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return depth.model.norm(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
@torch.no_grad()
def test_depth_step_is_the_module_composition_bit_for_bit(tiny: BreezeModel, packed: bool,
                                                          dtype: torch.dtype) -> None:
    """``DepthLayer.forward`` (weights read directly, q and k rotated together with the sign
    folded into the table, one norm call with its weight in fp32) gives the same bits as the
    modules' own composition, frame after frame (CPU; bf16 takes the norm's other branch)."""
    model = copy.deepcopy(tiny).to(dtype)
    if packed:
        model.fuse_projections_()
    depth = model.depth_decoder
    fast, slow = depth.new_cache(3), depth.new_cache(3)
    gen = torch.Generator().manual_seed(3)
    for position in range(depth.max_positions):
        x = (torch.randn(3, 64, generator=gen).to(dtype) if position == 0 else
             depth.embed_code(torch.randint(0, 2048, (3,), generator=gen), position - 1))
        assert torch.equal(depth.step(x, position, fast),
                           _depth_step_by_modules(depth, x, position, slow))
        assert torch.equal(fast, slow)


@torch.no_grad()
def test_depth_step_tables_are_run_layers_bit_for_bit(tiny: BreezeModel) -> None:
    """The eager step reads each position's RoPE tables and mask made once; ``run_layers`` (the
    compiled and fused units' contract) makes them from its tensor inputs: the same bits, and
    the same cache written, at every position."""
    depth = copy.deepcopy(tiny).depth_decoder
    tabled, built = depth.new_cache(3), depth.new_cache(3)
    positions, cos, sin = depth._frame_rope(torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(5)
    for position in range(depth.max_positions):
        x = (torch.randn(3, 64, generator=gen) if position == 0 else
             depth.embed_code(torch.randint(0, 2048, (3,), generator=gen), position - 1))
        assert torch.equal(
            depth.step(x, position, tabled),
            depth.run_layers(x, cos[position].expand(3, -1), sin[position].expand(3, -1), built,
                             positions[position]))
        assert torch.equal(tabled, built)


def test_depth_step_after_an_inference_mode_warm_up_runs_under_autograd(tiny: BreezeModel) -> None:
    """The frame's RoPE tables are kept from the first call; made under inference mode (the
    engine's warm-up) they must still serve a later call that autograd records (the GPU graph
    test runs the stages' eager functions so): the same values, no inference-tensor error."""
    depth = copy.deepcopy(tiny).depth_decoder
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        warm = depth.step(x, 0, depth.new_cache(2))
    recorded = depth.step(x, 0, depth.new_cache(2))
    assert recorded.requires_grad and torch.equal(recorded.detach(), warm)


def test_rms_norm_and_signed_rope_are_the_same_bits() -> None:
    gen = torch.Generator().manual_seed(0)
    for dim in (8, 32, 100, 1024):
        norm = RMSNorm(dim)
        norm.weight.data = torch.randn(dim, generator=gen)
        x = torch.randn(5, dim, generator=gen) * 3
        spelled = norm.weight * F.rms_norm(x, (dim,), eps=norm.eps)  # weight outside the call
        assert torch.equal(norm(x), spelled)
        q = torch.randn(5, 4, dim, generator=gen)
        cos, sin = torch.randn(5, dim, generator=gen), torch.randn(5, dim, generator=gen)
        assert torch.equal(apply_rope(q, cos, sin),
                           apply_rope_signed(q, cos[:, None], fold_rotation_sign(sin)[:, None]))


def test_prompt_validation_names_fields() -> None:
    assert speaker_token_id("S9") == speaker_token_id("[S9]") == 262155
    with pytest.raises(ValueError, match="speaker"):
        build_prompt([2, 5], speaker="[S10]")
    with pytest.raises(ValueError, match="ref_text_ids"):
        build_prompt([2, 5], ref_codes=torch.zeros(2, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="ref_codes"):
        build_prompt([2, 5], ref_text_ids=[2, 6], ref_codes=torch.full((2, 16), 2048))
    with pytest.raises(ValueError, match="text_ids"):
        build_prompt([2, 262144])
    plain = build_prompt([2, 5, 6], speaker="S2", instruction_ids=[2])  # empty instruction
    assert plain.input_ids.tolist() == [2, 262148, 5, 6] and plain.negative is None


def test_rows_placed_by_runs_of_positions_equal_an_indexed_assignment() -> None:
    from breezert.models.breeze import _place_rows

    gen = torch.Generator().manual_seed(0)
    positions = [1, 2, 3, 7, 9, 10]
    rows = torch.randn(len(positions), 4, generator=gen)
    want, got = torch.zeros(12, 4), torch.zeros(12, 4)
    want[torch.tensor(positions)] = rows
    _place_rows(got, positions, rows)
    assert torch.equal(got, want)
    one = torch.randn(1, 4, generator=gen)  # one row for every position (audio end of speech)
    want[torch.tensor(positions)] = one
    _place_rows(got, positions, one)
    assert torch.equal(got, want)
