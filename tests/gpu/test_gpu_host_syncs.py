"""GPU: host code that must not wait for the GPU in the middle of its work. A TEXT_ENCODE step's
prompt assembly (audio rows placed by host positions), and a step of the voice's codec training
(``breezert_train.codec_train``) and LM training (``breezert_train.lm_train``), which wait once,
for their figures, not once per codebook, per copy or per boolean mask.

Run on a CUDA machine: ``python -m pytest tests/gpu -q`` (skipped without CUDA).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from breezert_train.codec_train import CodecTrainConfig, CodecTrainer, recipe_config
from breezert_train.lm_data import byte_tokenizer, make_utterance
from breezert_train.lm_train import SMALL_GPU, LMTrainer

pytestmark = pytest.mark.gpu


def _syncs(step) -> tuple[list[str], dict]:  # type: ignore[no-untyped-def]
    """``step()``'s host syncs (file:line of each) under CUDA's sync debug mode, and its result.
    A lower bound: the mode reports synchronizing copies and stream syncs, not allocations."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)], result


def test_the_sync_counter_sees_a_read_back() -> None:
    """The control: without it, a counter that saw nothing would pass every test below."""
    syncs, _ = _syncs(lambda: torch.ones(1, device="cuda").item())
    assert len(syncs) == 1 and syncs[0].startswith(__file__), syncs


def test_prompt_assembly_waits_for_nothing() -> None:
    """``BreezeModel.assemble_prompt_embeds`` for 16 requests with CFG branches and a cloned
    voice (reference frames and audio end-of-speech rows): no host sync (it was three per
    branch: an upload and two ``nonzero``)."""
    import numpy as np

    from breezert.prompting import make_prompt
    from breezert.random_init import build_random
    from breezert.request import Reference

    _, model, _ = build_random("tiny", seed=0, device="cuda")
    tok = byte_tokenizer()
    rng = np.random.default_rng(0)
    prompts = [make_prompt(tok, f"Request {i} says a sentence.", instructions="A calm voice.",
                           reference=Reference("The reference.", rng.integers(0, 2048, (5, 16))))
               for i in range(16)]
    branches = [b for p in prompts for b in (p, p.negative) if b is not None]
    assert len(branches) == 32 and all(p.ref_codes is not None for p in prompts)
    pieces = [seg for b in branches for seg in b.text_segments()]
    encoded = torch.randn(sum(int(p.shape[0]) for p in pieces), model.cfg.hidden_size,
                          device="cuda", dtype=model.text_encoder_proj.weight.dtype)
    with torch.inference_mode():
        syncs, rows = _syncs(lambda: model.assemble_prompt_embeds(branches, encoded))
    assert syncs == [], syncs
    assert len(rows) == 32


RECIPES = {
    1: (CodecTrainConfig(preset="small", batch_size=16, crop_frames=24, disc_start_step=0,
                         latent_mel_weight=1.0),
        {"stft_sc", "stft_mag", "disc_hinge", "latent_mel", "codes_restarted"}),
    2: (recipe_config(2, preset="small", batch_size=16, crop_frames=24, latent_mel_weight=1.0),
        {"stft_sc", "mel", "latent_mel", "codes_restarted", "disc_on"}),
}
"""Codec recipe -> (the pipeline's config of it, figures a step reports)."""


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_codec_training_step_syncs_once_for_its_figures(recipe: int) -> None:
    """The pipeline's recipes (small codec, batch 16, latent probe; 1: discriminator on; 2:
    multi-scale mel, 4 active codebooks, discriminator waiting for the plateau): after the first
    step (the codebooks' first vectors are read back once), a step's host syncs are the one copy
    of its losses; each sync before stalled the step's launch queue (16 codebook flags, 16
    restart counts, a pageable copy per draw, a float per loss)."""
    cfg, expected = RECIPES[recipe]
    trainer = CodecTrainer(cfg, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch = (torch.randn(cfg.batch_size, cfg.crop_samples, device="cuda", generator=gen) * 0.1)
    trainer.train_step(batch)
    syncs, figures = _syncs(lambda: trainer.train_step(batch))
    assert len(syncs) == 1 and "codec_train.py" in syncs[0], syncs  # the figures' one copy
    assert set(figures) >= expected


def test_an_lm_training_step_syncs_once_for_its_figures() -> None:
    """The ``small-gpu`` recipe on 24 utterances of 20-60 frames with the teacher's phonemes:
    the host indexes (frame rows, end-of-speech rows, the prior's lengths, the phoneme targets
    and CTC lengths) are uploaded before the forward, the audio rows of each prompt placed by
    host positions, the figures copied back once."""
    trainer = LMTrainer(SMALL_GPU, "cuda")
    gen = torch.Generator().manual_seed(0)
    tok = byte_tokenizer()
    batch = [make_utterance(tok, i, f"Sentence number {i} of the batch, spoken.",
                            torch.randint(0, 2048, (20 + 2 * i, 16), generator=gen),
                            torch.randint(0, 178, (20 + 2 * i,), generator=gen).numpy(),
                            torch.randint(1, 178, (30,), generator=gen).numpy())
             for i in range(24)]
    trainer.train_step(batch)
    syncs, figures = _syncs(lambda: trainer.train_step(batch))
    assert len(syncs) == 1 and "lm_train.py" in syncs[0], syncs  # the figures' one copy
    assert set(figures) >= {"code0", "eos", "depth", "guided", "loss", "grad_norm",
                            "phoneme_frame", "phoneme_ctc"}
