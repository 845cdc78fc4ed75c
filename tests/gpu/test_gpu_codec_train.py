"""GPU: a step of the voice's codec training (``breezert.train.codec_train``) waits for the GPU
once, for its figures, not once per codebook.

Run on a CUDA machine: ``python -m pytest tests/gpu -q`` (skipped without CUDA).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from breezert.train.codec_train import CodecTrainConfig, CodecTrainer

pytestmark = pytest.mark.gpu


def test_a_training_step_syncs_once_for_its_figures() -> None:
    """The pipeline's recipe (small codec, batch 16, discriminator on, latent probe): after the
    first step (the codebooks' first vectors are read back once), a step's host syncs are the
    one copy of its losses; each sync before stalled the step's launch queue (16 codebook flags,
    16 restart counts, a pageable copy per draw, a float per loss)."""
    cfg = CodecTrainConfig(preset="small", batch_size=16, crop_frames=24, disc_start_step=0)
    trainer = CodecTrainer(cfg, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch = (torch.randn(cfg.batch_size, cfg.crop_samples, device="cuda", generator=gen) * 0.1)
    trainer.train_step(batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            figures = trainer.train_step(batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 1, syncs
    assert set(figures) >= {"stft_sc", "stft_mag", "disc_hinge", "latent_mel", "codes_restarted"}
