"""Codec training: CodecEncoder -> split RVQ -> CodecDecoder, resumable, exported in the released
layout.

Owns: the train-size codec presets, the recipes (``CODEC_RECIPES``), one training step (MR-STFT,
multi-scale log-mel and commitment, then the MS-STFT discriminator's hinge and feature-matching
terms from ``disc_start_step`` or, with ``disc_on_plateau``, from the step the main loss
plateaus), the codebooks a run leaves inactive (``active_codebooks``), the loop that stops
after a number of minutes with atomic saves, the carry snapshot (weights without optimiser
moments, small enough to move to the next GPU machine) and the warm starts from it or from an
export, the export, and the command line
``python -m breezert_train.codec_train --data DIR --out DIR --minutes M``. Must not: define its
own module types (it trains the ones ``breezert.loader`` builds) or be imported by serving code.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from breezert.loader import load_checkpoint, save_checkpoint
from breezert.models.codec import CodecDecoder, init_codec_random_
from breezert.models.codec_encoder import CodecEncoder, init_codec_encoder_random_
from breezert.models.config import BreezeConfig, CodecConfig
from breezert.random_init import build_random
from breezert.tokenizer import build_byte_tokenizer
from breezert_train.checkpoint import (
    LOG_FILE,
    STATE_FILE,
    StepLog,
    StopFlag,
    add_default_flag,
    load_state,
    save_atomic,
    stop_on_signals,
    timed_loop,
)
from breezert_train.data import AudioFolderCrops, CropSource
from breezert_train.losses import (
    LatentMelHead,
    MultiScaleMelLoss,
    MultiScaleStftDiscriminator,
    PlateauDetector,
    discriminator_hinge_loss,
    feature_matching_loss,
    generator_hinge_loss,
    mr_stft_loss,
)
from breezert_train.quantizer import (
    QuantizerOutput,
    VQTrainConfig,
    mark_codebooks_fresh_,
    quantize,
    sync_decoder_quantizer_,
    zero_inactive_codebooks_,
)

CODEC_PRESETS = ("tiny", "small")


def codec_preset(name: str) -> tuple[CodecConfig, dict[str, Any]]:
    """``(decoder config, encoder_config JSON)`` of a train-size codec.

    The encoder's width equals the decoder's ``codebook_dim`` and its code vectors are half of
    it, as in the released tokenizer (512 / 256), so both quantizers hold the same tensors.
    ``tiny`` is the test size; ``small`` is the size meant for the default voice.
    """
    if name == "tiny":
        base = BreezeConfig.tiny()
        codec, enc = base.codec, copy.deepcopy(base.codec_encoder_json)
    elif name == "small":
        # 5.5 M decoder + 1.3 M encoder parameters and 2 x 2.1 M codebook values: about 22 MB
        # in bf16, to leave room for the LM in the 40 MB.
        codec = CodecConfig(
            codebook_dim=128, latent_dim=192, decoder_dim=384, hidden_size=192,
            intermediate_size=384, num_layers=4, num_heads=3, num_kv_heads=3, head_dim=64,
            vq_hidden_dim=64,
        )
        enc = copy.deepcopy(BreezeConfig.full().codec_encoder_json)
        enc.update(num_filters=16, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=64)
    else:
        raise ValueError(f"unknown codec preset {name!r}; choose one of {CODEC_PRESETS}")
    half = codec.codebook_dim // 2
    enc.update(hidden_size=codec.codebook_dim, codebook_dim=half,
               vector_quantization_hidden_dimension=half, upsample_groups=codec.codebook_dim)
    return codec, enc


@dataclass(frozen=True)
class CodecTrainConfig:
    """One codec training run; a resumed run must use the same values."""

    preset: str = "tiny"
    """Codec size, one of ``CODEC_PRESETS``."""
    batch_size: int = 4
    """Crops per step."""
    crop_frames: int = 8
    """Crop length in codec frames (1920 samples each)."""
    learning_rate: float = 3e-4
    """AdamW learning rate of the encoder and decoder."""
    disc_learning_rate: float = 3e-4
    """AdamW learning rate of the discriminator."""
    betas: tuple[float, float] = (0.8, 0.99)
    """AdamW betas of both optimisers (HiFi-GAN's)."""
    grad_clip: float = 10.0
    """Max global gradient norm of each optimiser."""
    commitment_weight: float = 1.0
    """Weight of the commitment loss."""
    stft_weight: float = 1.0
    """Weight of spectral convergence + log magnitude."""
    adv_weight: float = 1.0
    """Weight of the generator hinge loss."""
    feature_weight: float = 2.0
    """Weight of the feature-matching loss."""
    disc_start_step: int = 2000
    """Step from which the discriminator trains and the adversarial terms count (with
    ``disc_on_plateau``: the earliest such step)."""
    disc_on_plateau: bool = False
    """Start the discriminator at the first step (>= ``disc_start_step``) where the main
    reconstruction loss (``mel`` when ``mel_weight`` > 0, else ``stft_mag``) has plateaued:
    ``PlateauDetector(plateau_window, plateau_min_improvement)``, fed only outside a re-warmup."""
    plateau_window: int = 500
    """Steps per window of the plateau detector (two windows are compared)."""
    plateau_min_improvement: float = 0.01
    """A plateau: the last window's mean fell by less than this fraction of the one before."""
    mel_weight: float = 0.0
    """Weight of the multi-scale log-mel L1 (``MultiScaleMelLoss``); 0: not computed."""
    active_codebooks: int = 16
    """Codebooks that code (the first ones: 1 semantic, then acoustic); the others hold only
    zero vectors, so their code is always 0 (``zero_inactive_codebooks_``)."""
    disc_channels: int = 32
    """Channels of each discriminator scale."""
    rewarmup_steps: int = 200
    """Linear warmup of both rates after a warm start (fresh optimiser moments)."""
    latent_mel_weight: float = 0.0
    """Weight of the latent's log-mel probe (``LatentMelHead``, L1); 0: no probe."""
    probe_lr_scale: float = 10.0
    """The probe's learning rate over the generator's (a linear read-out can move faster)."""
    autocast_bf16: bool = False
    """Encoder, decoder and discriminator layers under bf16 autocast (fp32 master weights; the
    quantizer, the STFTs and every loss stay fp32)."""
    seed: int = 0
    """Seeds the weights, the codebook restarts and the data crops."""
    vq: VQTrainConfig = field(default_factory=VQTrainConfig)
    """Codebook EMA and restarts."""

    def __post_init__(self) -> None:
        if self.preset not in CODEC_PRESETS:
            raise ValueError(f"preset={self.preset!r}: choose one of {CODEC_PRESETS}")
        if self.batch_size < 1 or self.crop_frames < 1:
            raise ValueError(f"batch_size={self.batch_size} and crop_frames={self.crop_frames} "
                             "must be >= 1")
        total = codec_preset(self.preset)[0].num_quantizers
        if not 1 <= self.active_codebooks <= total:
            raise ValueError(f"active_codebooks={self.active_codebooks}: choose 1..{total}")
        PlateauDetector(self.plateau_window, self.plateau_min_improvement)  # validates both

    @property
    def crop_samples(self) -> int:
        return self.crop_frames * codec_preset(self.preset)[0].samples_per_frame

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


CODEC_RECIPES: dict[int, dict[str, Any]] = {
    1: {},
    2: {"mel_weight": 1.0, "stft_weight": 0.2, "disc_on_plateau": True, "plateau_window": 500,
        "plateau_min_improvement": 0.01, "active_codebooks": 4},
}
"""``CodecTrainConfig`` fields each recipe sets. 1: the run of 2-4 Dec (MR-STFT, discriminator
from step 2000, 16 codebooks). 2 (issue 35, aimed at intelligibility): the multi-scale log-mel
L1 as the main term (MR-STFT at a fifth of it), the discriminator off until that loss gains
less than 1 % per 500 steps, and the codes in the first 4 codebooks."""


def recipe_config(recipe: int, **fields_: Any) -> CodecTrainConfig:
    """``CodecTrainConfig`` of ``recipe`` with ``fields_`` over it."""
    if recipe not in CODEC_RECIPES:
        raise ValueError(f"codec recipe {recipe}: choose one of {sorted(CODEC_RECIPES)}")
    return CodecTrainConfig(**{**CODEC_RECIPES[recipe], **fields_})


def config_from_json(d: dict[str, Any]) -> CodecTrainConfig:
    """The ``CodecTrainConfig`` that ``as_json`` wrote (a state file's or a snapshot's); fields
    added since it was written take their defaults."""
    d = dict(d)
    d["betas"] = tuple(d["betas"])
    d["vq"] = VQTrainConfig(**d["vq"])
    return CodecTrainConfig(**d)


# ------------------------------------------------------------------------------- the trainer
class CodecTrainer:
    """Encoder, decoder, discriminator, their optimisers and every random state of a run."""

    def __init__(self, cfg: CodecTrainConfig, device: str | torch.device = "cpu") -> None:
        self.cfg, self.device = cfg, torch.device(device)
        codec_cfg, self.encoder_json = codec_preset(cfg.preset)
        gen = torch.Generator().manual_seed(cfg.seed)
        self.decoder = init_codec_random_(CodecDecoder(codec_cfg), gen).to(self.device).train()
        self.encoder = init_codec_encoder_random_(CodecEncoder(self.encoder_json), gen)
        self.encoder.to(self.device).train()
        mark_codebooks_fresh_(self.encoder)
        zero_inactive_codebooks_(self.encoder, self.decoder, cfg.active_codebooks)
        self.mel_loss = MultiScaleMelLoss().to(self.device) if cfg.mel_weight > 0 else None
        self.plateau = PlateauDetector(cfg.plateau_window, cfg.plateau_min_improvement)
        self.disc_started_at: int | None = None
        """Step at which ``disc_on_plateau`` started the discriminator (None: not yet)."""
        with torch.random.fork_rng(devices=[]):  # default nn init, seeded, global RNG untouched
            torch.manual_seed(cfg.seed)
            self.disc = MultiScaleStftDiscriminator(cfg.disc_channels).to(self.device)
            self.mel_head = (LatentMelHead(codec_cfg.codebook_dim, codec_cfg.samples_per_frame)
                             .to(self.device) if cfg.latent_mel_weight > 0 else None)
        adamw = dict(betas=cfg.betas, weight_decay=0.0)
        groups = [{"params": self._generator_parameters(), "base_lr": cfg.learning_rate}]
        if self.mel_head is not None:
            groups.append({"params": list(self.mel_head.parameters()),
                           "base_lr": cfg.learning_rate * cfg.probe_lr_scale})
        self.opt_g = torch.optim.AdamW(groups, lr=cfg.learning_rate, **adamw)
        self.opt_d = torch.optim.AdamW(
            [{"params": list(self.disc.parameters()), "base_lr": cfg.disc_learning_rate}],
            lr=cfg.disc_learning_rate, **adamw)
        self.vq_gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.step = 0
        self.train_time_s = 0.0
        self.reset_step = 0
        """Step of the last warm start (0: none); the rates re-warm from it."""

    def _generator_parameters(self) -> list[torch.nn.Parameter]:
        # The encoder-side output_proj and the decoder-side input_proj are copies the other
        # module learns (sync_decoder_quantizer_ writes them at export): they get no gradient.
        enc = [p for n, p in self.encoder.named_parameters() if ".output_proj." not in n]
        dec = [p for n, p in self.decoder.named_parameters() if ".input_proj." not in n]
        return enc + dec

    def reconstruct(self, wav: Tensor, training: bool) -> tuple[Tensor, QuantizerOutput]:
        """``wav [B, T]`` (T a multiple of 1920) -> ``(decoded [B, T], quantizer output)``;
        ``training`` lets the codebooks learn."""
        with self._autocast():
            x = self.encoder.embed(wav)  # [B, hidden, K]
        q = quantize(self.encoder, self.decoder, x.float(), self.cfg.vq,
                     self.vq_gen if training else None, self.cfg.active_codebooks)
        with self._autocast():
            y, _ = self.decoder.decode_latent(q.latent, self.decoder.new_state(wav.shape[0]))
        return y.float(), q

    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.cfg.autocast_bf16)

    def _disc(self, wav: Tensor) -> list[tuple[Tensor, list[Tensor]]]:
        with self._autocast():
            out = self.disc(wav)
        return [(logits.float(), [f.float() for f in features]) for logits, features in out]

    @property
    def disc_active(self) -> bool:
        """Whether the discriminator trains at this step."""
        if self.cfg.disc_on_plateau:
            return self.disc_started_at is not None
        return self.step >= self.cfg.disc_start_step

    def train_step(self, wav: Tensor) -> dict[str, float]:
        """One optimisation step on ``wav [B, T]``; returns every loss as a float."""
        cfg = self.cfg
        self._set_rates()
        y, q = self.reconstruct(wav, training=True)
        sc, mag = mr_stft_loss(y, wav)
        losses = {"stft_sc": sc, "stft_mag": mag, "commitment": q.commitment}
        g_loss = cfg.stft_weight * (sc + mag) + cfg.commitment_weight * q.commitment
        if self.mel_loss is not None:
            losses["mel"] = self.mel_loss(y, wav)
            g_loss = g_loss + cfg.mel_weight * losses["mel"]
        if self.mel_head is not None:
            losses["latent_mel"] = self.mel_head.loss(q.latent, wav)
            g_loss = g_loss + cfg.latent_mel_weight * losses["latent_mel"]
        if self.disc_active:
            real = self._disc(wav)
            d_loss = discriminator_hinge_loss([r[0] for r in real],
                                              [f[0] for f in self._disc(y.detach())])
            self._update(self.opt_d, d_loss, self.disc.parameters())
            fake = self._disc(y)
            adv = generator_hinge_loss([f[0] for f in fake])
            fm = feature_matching_loss([r[1] for r in real], [f[1] for f in fake])
            g_loss = g_loss + cfg.adv_weight * adv + cfg.feature_weight * fm
            losses.update(disc_hinge=d_loss, gen_hinge=adv, feature_match=fm)
        self._update(self.opt_g, g_loss, [p for g in self.opt_g.param_groups for p in g["params"]])
        self.step += 1
        # one device -> host copy for the step's figures (a float() each was a sync each)
        values = torch.stack([v.detach().float() for v in losses.values()]
                             + [q.num_restarted.float()]).tolist()
        record = dict(zip([*losses, "codes_restarted"], values))
        if self.cfg.disc_on_plateau:
            record["disc_on"] = float(self.disc_active)  # during this step
        self._watch_plateau(record["mel" if self.mel_loss is not None else "stft_mag"])
        return record

    def _watch_plateau(self, main_loss: float) -> None:
        """Feeds the plateau detector (outside a re-warmup, from ``disc_start_step``) and starts
        the discriminator at the plateau."""
        cfg = self.cfg
        if not cfg.disc_on_plateau or self.disc_started_at is not None:
            return
        rewarming = self.reset_step and self.step - self.reset_step < cfg.rewarmup_steps
        if self.step >= cfg.disc_start_step and not rewarming and self.plateau.add(main_loss):
            self.disc_started_at = self.step

    def _set_rates(self) -> None:
        scale = 1.0
        if self.reset_step:
            scale = min(1.0, (self.step - self.reset_step + 1) / max(1, self.cfg.rewarmup_steps))
        for opt in (self.opt_g, self.opt_d):
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * scale

    def _update(self, opt: torch.optim.Optimizer, loss: Tensor, params: Any) -> None:
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params), self.cfg.grad_clip)
        opt.step()

    @torch.no_grad()
    def evaluate(self, wav: Tensor) -> dict[str, float]:
        """MR-STFT of ``wav [B, T]`` through the codec, codebooks frozen."""
        y, _ = self.reconstruct(wav.to(self.device), training=False)
        sc, mag = mr_stft_loss(y, wav.to(self.device))
        return {"stft_sc": float(sc), "stft_mag": float(mag)}

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "config": self.cfg.as_json(), "step": self.step, "train_time_s": self.train_time_s,
            "encoder": self.encoder.state_dict(), "decoder": self.decoder.state_dict(),
            "disc": self.disc.state_dict(), "opt_g": self.opt_g.state_dict(),
            "opt_d": self.opt_d.state_dict(), "vq_gen": self.vq_gen.get_state(),
            **({"mel_head": self.mel_head.state_dict()} if self.mel_head is not None else {}),
            **self._plateau_state(),
        }

    def _plateau_state(self) -> dict[str, Any]:
        return {"disc_started_at": self.disc_started_at, "plateau": list(self.plateau.history)}

    def _load_plateau_state(self, state: dict[str, Any]) -> None:
        self.disc_started_at = state.get("disc_started_at")
        self.plateau.history = list(state.get("plateau", []))[-2 * self.cfg.plateau_window:]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = config_from_json(state["config"])
        if saved != self.cfg:
            diff = [f"{f.name}: saved {getattr(saved, f.name)!r}, now {getattr(self.cfg, f.name)!r}"
                    for f in fields(saved) if getattr(saved, f.name) != getattr(self.cfg, f.name)]
            raise ValueError("the saved run used another config: " + "; ".join(diff))
        self.encoder.load_state_dict(state["encoder"])
        self.decoder.load_state_dict(state["decoder"])
        self.disc.load_state_dict(state["disc"])
        if self.mel_head is not None:
            self.mel_head.load_state_dict(state["mel_head"])
        self.opt_g.load_state_dict(state["opt_g"])
        self.opt_d.load_state_dict(state["opt_d"])
        self.vq_gen.set_state(state["vq_gen"])
        self.step, self.train_time_s = int(state["step"]), float(state["train_time_s"])
        self.reset_step = int(state.get("reset_step", 0))
        self._load_plateau_state(state)

    # ---------------------------------------------------------------- carry between machines
    def snapshot(self) -> dict[str, Any]:
        """The run without its optimiser moments, to go on on another machine: encoder and
        decoder in bf16 (codebook usage counts in fp32), the discriminator only once it trains,
        step, time, the codebook RNG and the plateau detector. Left out as stale: the decoder's
        copies of the codebooks (written from the encoder's only at export) and the inactive
        codebooks (zero by construction); ``small`` with 4 active codebooks: about 13 MB."""
        inactive = self._inactive_codebook_keys()

        def half(module: torch.nn.Module, drop: tuple[str, ...] = ()) -> dict[str, Tensor]:
            return {k: (v.detach().cpu().to(torch.bfloat16)
                        if v.is_floating_point() and "cluster_usage" not in k
                        and "initialized" not in k else v.detach().cpu().clone())
                    for k, v in module.state_dict().items()
                    if not any(part in k for part in drop) and k not in inactive}

        snap = {"config": self.cfg.as_json(), "step": self.step,
                "train_time_s": self.train_time_s, "encoder": half(self.encoder),
                "decoder": half(self.decoder, drop=("._codebook.",)),
                "vq_gen": self.vq_gen.get_state(), **self._plateau_state()}
        if self.disc_active:
            snap["disc"] = half(self.disc)
        if self.mel_head is not None:
            snap["mel_head"] = half(self.mel_head)
        return snap

    def _inactive_codebook_keys(self) -> set[str]:
        """Encoder state keys of the codebooks past ``active_codebooks``."""
        from breezert_train.quantizer import group_active, group_pairs

        keys, names = set(), {id(m): n for n, m in self.encoder.named_modules()}
        for (enc_group, _, num), act in zip(group_pairs(self.encoder, self.decoder),
                                            group_active(self.decoder, self.cfg.active_codebooks),
                                            strict=True):
            for vq in enc_group.layers[act:num]:
                prefix = names[id(vq.codebook)]
                keys |= {f"{prefix}.{b}" for b in ("embed_sum", "cluster_usage", "initialized")}
        return keys

    def _check_shape_config(self, saved: CodecTrainConfig, source: str) -> None:
        if (saved.preset, saved.disc_channels) != (self.cfg.preset, self.cfg.disc_channels):
            raise ValueError(f"{source} holds preset={saved.preset!r}, disc_channels="
                             f"{saved.disc_channels}; this run has preset={self.cfg.preset!r}, "
                             f"disc_channels={self.cfg.disc_channels}")

    def load_snapshot(self, snap: dict[str, Any]) -> None:
        """Goes on from ``snapshot()``: same weights (rounded to bf16), fresh optimiser moments,
        rates re-warmed over ``rewarmup_steps``. The other settings may change (batch size,
        rates, the recipe: a 16-codebook snapshot goes on with fewer active codebooks, the
        others zeroed): only the preset and the discriminator's width must match. A snapshot
        without a discriminator (not started yet) leaves this run's fresh one."""
        self._check_shape_config(config_from_json(snap["config"]), "the snapshot")
        names = ["encoder", "decoder"] + (["disc"] if "disc" in snap else [])
        if self.mel_head is not None and "mel_head" in snap:  # else the probe starts fresh
            names.append("mel_head")
        for name in names:
            module = getattr(self, name)
            dtypes = {k: v.dtype for k, v in module.state_dict().items()}
            result = module.load_state_dict({k: v.to(dtypes[k]) for k, v in snap[name].items()
                                             if k in dtypes}, strict=False)
            # only what snapshot() leaves out may be missing: the decoder's codebook copies,
            # the encoder's inactive codebooks (a snapshot with fewer active ones: they start
            # fresh, from data, here)
            left_out = {"decoder": "._codebook.", "encoder": ".codebook."}.get(name)
            odd = [k for k in result.missing_keys if left_out is None or left_out not in k]
            if odd or result.unexpected_keys:
                raise ValueError(f"the snapshot's {name} does not match: missing {odd[:3]}, "
                                 f"unexpected {result.unexpected_keys[:3]}")
        zero_inactive_codebooks_(self.encoder, self.decoder, self.cfg.active_codebooks)
        self.vq_gen.set_state(snap["vq_gen"])
        self.step, self.train_time_s = int(snap["step"]), float(snap["train_time_s"])
        self.reset_step = self.step
        self._load_plateau_state(snap)

    def load_export(self, folder: str | Path, step: int, train_time_s: float) -> None:
        """Goes on from a codec export (``export_checkpoint``): its encoder and decoder, a fresh
        discriminator, fresh optimiser moments and re-warmed rates; ``step`` and
        ``train_time_s`` are the run's so far (the export does not record them)."""
        ckpt = load_checkpoint(folder)
        if ckpt.codec_encoder is None:
            raise ValueError(f"{folder}: the export has no codec encoder")
        if ckpt.codec.cfg != self.decoder.cfg:
            raise ValueError(f"{folder}: its codec is not the {self.cfg.preset!r} preset")
        # the export holds no "initialized" flags (training-only buffers); nothing else may lack
        result = self.encoder.load_state_dict(ckpt.codec_encoder.float().state_dict(),
                                              strict=False)
        odd = [k for k in result.missing_keys if not k.endswith("initialized")]
        if odd or result.unexpected_keys:
            raise ValueError(f"{folder}: the export's encoder does not match: missing {odd[:3]}, "
                             f"unexpected {result.unexpected_keys[:3]}")
        self.decoder.load_state_dict(ckpt.codec.float().state_dict())
        mark_codebooks_fresh_(self.encoder, fresh=False)  # the export's are trained
        zero_inactive_codebooks_(self.encoder, self.decoder, self.cfg.active_codebooks)
        self.step, self.train_time_s = int(step), float(train_time_s)
        self.reset_step = self.step


# ------------------------------------------------------------------------------- the loop
def _save(trainer: CodecTrainer, data: CropSource, out: Path) -> None:
    state = trainer.state_dict()
    state["data"] = data.state_dict()
    state["torch_rng"] = torch.get_rng_state()
    save_atomic(state, out / STATE_FILE)


def train(data: CropSource, out: str | Path, cfg: CodecTrainConfig, minutes: float,
          max_steps: int | None = None, save_every: int = 200,
          device: str | torch.device = "cpu", stop: StopFlag | None = None,
          warm_start: Callable[[CodecTrainer], None] | None = None,
          on_step: Callable[[CodecTrainer, dict[str, float]], None] | None = None
          ) -> CodecTrainer:
    """Trains until ``minutes`` pass (or ``max_steps`` total steps, or ``stop`` is set),
    resuming from ``out/state.pt`` if present, else from ``warm_start`` (e.g. a carried
    snapshot: ``lambda t: t.load_snapshot(...)``) if given; saves every ``save_every`` steps and
    at the end; ``on_step`` sees the trainer and each step's record (its time is not training
    time: e.g. handing a snapshot to the in-run scorer). An error (a non-finite loss included)
    leaves the last save as it was."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    trainer = CodecTrainer(cfg, device)
    state_path = out / STATE_FILE
    resumed = state_path.is_file()
    if resumed:
        state = load_state(state_path)
        trainer.load_state_dict(state)
        data.load_state_dict(state["data"])
        torch.set_rng_state(state["torch_rng"])
    elif warm_start is not None:
        warm_start(trainer)
        resumed = trainer.step > 0
    log = StepLog(out / LOG_FILE, trainer.step if resumed else None)
    timed_loop(trainer, lambda: trainer.train_step(data.sample(cfg.batch_size).to(trainer.device)),
               lambda: _save(trainer, data, out), log, minutes, max_steps, save_every, stop,
               after_step=(lambda record: on_step(trainer, record)) if on_step else None)
    return trainer


# ------------------------------------------------------------------------------- export
def export_checkpoint(trainer: CodecTrainer, out: str | Path, lm_from: str | Path | None = None,
                      dtype: torch.dtype = torch.float32) -> Path:
    """Writes the trained codec (decoder + reference encoder) in the released layout.

    The LM comes from the checkpoint at ``lm_from`` (its config, weights and tokenizer), else
    the seeded random ``tiny`` LM with the byte-level tokenizer; only the codec is trained here.
    ``dtype`` is the codec's storage in the file (bf16 halves it; the loader reads it as fp32).
    """
    encoder, decoder = copy.deepcopy(trainer.encoder).cpu(), copy.deepcopy(trainer.decoder).cpu()
    sync_decoder_quantizer_(encoder, decoder)
    encoder, decoder = encoder.to(dtype), decoder.to(dtype)
    if lm_from is not None:
        base = load_checkpoint(lm_from)
        config, model = base.config, base.model
        tokenizer_json = (Path(lm_from) / "tokenizer.json").read_text()
    else:
        config, model, _ = build_random("tiny", seed=trainer.cfg.seed)
        tokenizer_json = build_byte_tokenizer().to_str()
    config = replace(config, codec=decoder.cfg, codec_encoder_json=trainer.encoder_json)
    return save_checkpoint(out, config, model, decoder.eval(), tokenizer_json,
                           codec_encoder=encoder.eval())


_EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_GPU_RECIPE = """\
one GPU run of at most 10 minutes (re-run the same line to continue; keep --minutes under the
machine's limit so the exit save lands):
  python -m breezert_train.codec_train --data DATA --out runs/codec --minutes 9 \\
      --preset small --batch-size 16 --crop-frames 24 --save-every 500 \\
      --export runs/codec/ckpt --export-dtype bfloat16
"""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m breezert_train.codec_train", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_GPU_RECIPE)
    p.add_argument("--data", required=True, help="folder of 24 kHz .wav / .npy int16 audio")
    p.add_argument("--out", required=True, help="run folder: state.pt, log.jsonl")
    p.add_argument("--minutes", type=float, required=True, help="wall time of this run")
    p.add_argument("--max-steps", type=int, default=None, help="stop at this total step")
    p.add_argument("--save-every", type=int, default=200, help="steps between saves")
    p.add_argument("--export", default=None, help="write the released layout here at the end")
    p.add_argument("--lm-from", default=None, help="checkpoint whose LM the export carries")
    p.add_argument("--export-dtype", default="float32", choices=sorted(_EXPORT_DTYPES),
                   help="codec storage in the exported file")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    defaults = CodecTrainConfig()
    for f in fields(CodecTrainConfig):
        if f.name in ("vq", "betas"):
            continue
        add_default_flag(p, f.name, getattr(defaults, f.name))
    args = p.parse_args(argv)
    cfg = CodecTrainConfig(**{f.name: getattr(args, f.name) for f in fields(CodecTrainConfig)
                              if f.name not in ("vq", "betas")})
    if torch.device(args.device).type == "cuda":
        # NOTE(codec_train): TF32 matmuls and convs for training (the serving codec's own
        # precision choice is separate, ``CODEC_PRECISIONS``).
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    with stop_on_signals() as stop:
        data = AudioFolderCrops(args.data, cfg.crop_samples, seed=cfg.seed)
        trainer = train(data, args.out, cfg, args.minutes, args.max_steps, args.save_every,
                        args.device, stop)
    print(f"step {trainer.step}, {trainer.train_time_s:.1f} s trained, saved to {args.out}")
    if args.export:
        root = export_checkpoint(trainer, args.export, args.lm_from,
                                 _EXPORT_DTYPES[args.export_dtype])
        print(f"exported to {root}")


if __name__ == "__main__":
    main()
