"""LM training: text encoder + Qwen3 backbone + depth decoder on codec frames of teacher speech,
resumable, exported with the trained codec as the complete checkpoint in the released layout.

Owns: the train-size LM presets, the optimiser and its schedule, fp8 storage of the three large
tables (trained with a straight-through fp8 round trip so the export is what was trained), the
loop that stops after a number of minutes with atomic saves, the compact carry snapshot (weights
in bf16, no optimiser moments) for the next GPU call, the export, and the command line
``python -m breezert_train.lm_train --data DIR --codec DIR --out DIR --minutes M``. Must not:
define module types of its own (it trains the ones ``breezert.loader`` builds) or be imported by
serving code.

Choices made for learning alignment fast on little data and GPU time:
* small widths (the whole checkpoint must fit 40 MB) and short utterances (3-20 words);
* length-bucketed batches with a padded-token budget (little padding, large batches);
* a guided-attention diagonal prior on chosen backbone layers (audio rows over the prompt keys),
  since the backbone reads the text only through self-attention;
* training-only phoneme supervision from the teacher (``lm_forward.PhonemeHeads``, issue 35):
  the phoneme of each frame (from the durations) read from the state that predicts its code 0,
  and CTC of the phoneme sequence from the text encoder's prompt rows; the model still reads
  bytes, and the heads are never exported;
* AdamW, linear warmup then cosine decay, bf16 autocast on CUDA (fp32 master weights).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.nn.utils import parametrize

from breezert.loader import GenerationDefaults, load_checkpoint, save_checkpoint
from breezert.models.breeze import BreezeModel
from breezert.models.config import BackboneConfig, BreezeConfig, DepthConfig, TextEncoderConfig
from breezert.tokenizer import build_byte_tokenizer
from breezert_train.checkpoint import (
    LOG_FILE,
    STATE_FILE,
    StepLog,
    StopFlag,
    load_state,
    save_atomic,
    stop_on_signals,
    timed_loop,
)
from breezert_train.lm_data import (
    BatchStream,
    Utterance,
    encode_shards,
    iter_fixed_batches,
    load_utterances,
    split_heldout,
)
from breezert_train.lm_forward import PhonemeHeads, losses, teacher_forced

LM_PRESETS = ("tiny", "small")
SNAPSHOT_FILE = "snapshot.pt"
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_TENSORS = ("text_encoder.embed_tokens.weight", "depth_decoder.model.embed_tokens.weight",
               "depth_decoder.codebooks_head.weight")
"""Stored in fp8 (e4m3) when ``fp8_tables``: 262158 x 32 text rows (all but the byte
tokenizer's ~370 stay zero), the 16 x 2051-row audio table and the 15 depth heads. The loader
reads any stored dtype and casts it to the config's."""
TEXT_TABLE = FP8_TENSORS[0]
AUDIO_TABLE = FP8_TENSORS[1]


def audio_rows_used(items: list[Utterance], num_codebooks: int, vocab: int) -> torch.Tensor:
    """Rows of the tied audio table that ``items``' codes read (``code + vocab * codebook``),
    sorted: with recipe 2's codec, nearly all of the first 4 codebooks' rows and one row of each
    of the other 12 (their code is constant): 8,203 of 32,816 on the carried 10.1 h."""
    used = torch.zeros(num_codebooks * vocab, dtype=torch.bool)
    offsets = torch.arange(num_codebooks) * vocab
    for item in items:
        used[(item.codes + offsets).flatten()] = True
    return torch.nonzero(used).flatten()


def lm_preset(name: str) -> BreezeConfig:
    """The LM dimensions of a train size (the codec part is a placeholder the export replaces).

    ``small``: 15.8 M parameters, 12.7 M of them the fp8 tables (8.4 M mostly-zero text rows):
    17.1 MB on disk, beside the ``small`` codec's 22.1 MB in bf16.
    """
    base = BreezeConfig.tiny()
    if name == "tiny":
        te = TextEncoderConfig(hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                               num_kv_heads=1, head_dim=8, query_pre_attn_scalar=8.0,
                               sliding_window=16,
                               layer_types=("sliding_attention", "full_attention"))
        bb = BackboneConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=16)
        dd = DepthConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, backbone_hidden_size=64, audio_embed_size=64)
    elif name == "small":
        te = TextEncoderConfig(hidden_size=32, intermediate_size=128, num_layers=4, num_heads=2,
                               num_kv_heads=1, head_dim=16, query_pre_attn_scalar=16.0,
                               sliding_window=64, layer_types=(
                                   "sliding_attention", "full_attention") * 2)
        bb = BackboneConfig(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                            num_kv_heads=2, head_dim=32)
        dd = DepthConfig(hidden_size=64, intermediate_size=192, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=16, backbone_hidden_size=128,
                         audio_embed_size=128)
    else:
        raise ValueError(f"unknown LM preset {name!r}; choose one of {LM_PRESETS}")
    return replace(base, text_encoder=te, backbone=bb, depth=dd, hidden_size=bb.hidden_size,
                   audio_embed_size=bb.hidden_size)


@dataclass(frozen=True)
class LMTrainConfig:
    """One LM training run; a resumed run must use the same values."""

    preset: str = "tiny"
    """LM size, one of ``LM_PRESETS``."""
    max_tokens: int = 2048
    """Padded backbone positions per batch (batch size x longest utterance)."""
    learning_rate: float = 2e-3
    """Peak AdamW learning rate."""
    min_lr_ratio: float = 0.1
    """The cosine ends at this fraction of the peak."""
    warmup_steps: int = 100
    """Linear warmup from the first step."""
    rewarmup_steps: int = 100
    """Linear warmup again after a resume from a carry snapshot (fresh optimiser moments)."""
    schedule_steps: int = 1000
    """Cosine length in steps; the rate stays at the floor after it."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Max global gradient norm."""
    depth_weight: float = 1.0
    """Weight of the depth codes' mean cross-entropy."""
    guided_weight: float = 1.0
    """Weight of the guided-attention prior."""
    guided_sigma: float = 0.2
    """Width of the prior's diagonal band (fractions of the utterance)."""
    guided_layers: tuple[int, ...] = (1,)
    """Backbone layers whose heads the prior shapes."""
    fp8_tables: bool = False
    """Train and store ``FP8_TENSORS`` in fp8 e4m3."""
    max_frames: int = 250
    """Longest utterance kept, in frames (20 s)."""
    phoneme_weight: float = 0.0
    """Weight of the frames' phoneme cross-entropy (``PhonemeHeads.frame``); 0: no head."""
    phoneme_ctc_weight: float = 0.0
    """Weight of the prompt rows' phoneme CTC (``PhonemeHeads.ctc``); 0 with
    ``phoneme_weight`` 0: no heads."""
    seed: int = 0
    """Seeds the weights and the batch order."""

    def __post_init__(self) -> None:
        if self.preset not in LM_PRESETS:
            raise ValueError(f"preset={self.preset!r}: choose one of {LM_PRESETS}")
        num_layers = lm_preset(self.preset).backbone.num_layers
        if any(not 0 <= i < num_layers for i in self.guided_layers):
            raise ValueError(f"guided_layers={self.guided_layers}: the backbone has "
                             f"{num_layers} layers")

    @staticmethod
    def from_json(d: dict[str, Any]) -> LMTrainConfig:
        d = dict(d)
        d["betas"], d["guided_layers"] = tuple(d["betas"]), tuple(d["guided_layers"])
        return LMTrainConfig(**d)


SMALL_GPU = LMTrainConfig(preset="small", max_tokens=65536, learning_rate=2e-3,
                          warmup_steps=300, rewarmup_steps=200, schedule_steps=12000,
                          guided_layers=(1, 2), fp8_tables=True, phoneme_weight=0.5,
                          phoneme_ctc_weight=0.5)
"""The run meant for the default voice on one H200 (``--recipe small-gpu``)."""

SIZED_FOR_BYTES = 139 * 2**30
"""The card ``SMALL_GPU``'s batch was sized on (the H200's 139 GiB)."""


def fit_batch_to_card(cfg: LMTrainConfig, card_bytes: int) -> LMTrainConfig:
    """``cfg`` with ``max_tokens`` scaled to a card of ``card_bytes`` and rounded down to a
    power of two (never up): an H100's 79 GiB ran out of memory in the first backward pass at
    ``SMALL_GPU``'s 65,536 padded positions (7 Dec: 54.6 GiB allocated, 9 GiB asked, 18.8 GiB
    reserved between), so it trains on 32,768."""
    if card_bytes >= SIZED_FOR_BYTES:
        return cfg
    fits = max(1024, cfg.max_tokens * card_bytes // SIZED_FOR_BYTES)
    return replace(cfg, max_tokens=min(cfg.max_tokens, 1 << (fits.bit_length() - 1)))


class _Fp8RoundTrip(nn.Module):
    """Straight-through fp8 round trip: the forward sees the stored values, the fp32 master
    takes the gradient as is."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + (w.clamp(-FP8_MAX, FP8_MAX).to(FP8).to(w.dtype) - w).detach()


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, attr = name.rsplit(".", 1)
    return model.get_submodule(path), attr


def plain_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict`` under the released names (parametrized masters as their weights)."""
    key = ".parametrizations.weight.original"
    return {k.replace(key, ".weight"): v for k, v in model.state_dict().items()}


def text_rows_used() -> torch.Tensor:
    """Text ids the built-in byte tokenizer can emit (all other rows stay zero)."""
    return torch.tensor(sorted(build_byte_tokenizer().get_vocab().values()))


def init_lm(cfg: LMTrainConfig) -> BreezeModel:
    """Seeded random LM of ``cfg.preset``; text rows no tokenizer id reaches are zero."""
    model = BreezeModel(lm_preset(cfg.preset))
    model.init_random_(torch.Generator().manual_seed(cfg.seed))
    with torch.no_grad():
        table = model.text_encoder.embed_tokens.weight
        keep = torch.zeros(table.shape[0], dtype=torch.bool)
        keep[text_rows_used()] = True
        table[~keep] = 0.0
    if cfg.fp8_tables:
        for name in FP8_TENSORS:
            module, attr = _owner(model, name)
            parametrize.register_parametrization(module, attr, _Fp8RoundTrip())
    return model


# ------------------------------------------------------------------------------- the trainer
class LMTrainer:
    """The model, its optimiser and step counters."""

    def __init__(self, cfg: LMTrainConfig, device: str | torch.device = "cpu") -> None:
        self.cfg, self.device = cfg, torch.device(device)
        self.model = init_lm(cfg).to(self.device).train()
        self.heads: PhonemeHeads | None = None
        if cfg.phoneme_weight > 0 or cfg.phoneme_ctc_weight > 0:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.seed)
                self.heads = PhonemeHeads(self.model.cfg.hidden_size).to(self.device)
        self.opt = self._new_optimizer()
        self.step = 0
        self.reset_step = 0  # the step of the last optimiser reset (a carry-snapshot resume)
        self.train_time_s = 0.0

    def _parameters(self) -> list[nn.Parameter]:
        heads = list(self.heads.parameters()) if self.heads is not None else []
        return list(self.model.parameters()) + heads

    def _new_optimizer(self) -> torch.optim.Optimizer:
        decay = [p for p in self._parameters() if p.dim() >= 2]
        rest = [p for p in self._parameters() if p.dim() < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.cfg.weight_decay},
             {"params": rest, "weight_decay": 0.0}],
            lr=self.cfg.learning_rate, betas=self.cfg.betas, fused=True)

    def lr(self) -> float:
        c, s = self.cfg, self.step
        warm = min(1.0, (s + 1) / max(1, c.warmup_steps))
        rewarm = min(1.0, (s - self.reset_step + 1) / max(1, c.rewarmup_steps)) \
            if self.reset_step else 1.0
        progress = min(1.0, s / max(1, c.schedule_steps))
        cosine = c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return c.learning_rate * warm * rewarm * cosine

    def _losses(self, batch: list[Utterance]) -> dict[str, torch.Tensor]:
        use_bf16 = self.device.type == "cuda"
        with parametrize.cached(), torch.autocast(self.device.type, dtype=torch.bfloat16,
                                                  enabled=use_bf16):
            out = teacher_forced(self.model, batch, self.cfg.guided_layers,
                                 self.cfg.guided_sigma, self.heads)
            return losses(out)

    def train_step(self, batch: list[Utterance]) -> dict[str, float]:
        lr = self.lr()
        for group in self.opt.param_groups:
            group["lr"] = lr
        parts = self._losses(batch)
        cfg = self.cfg
        loss = parts["code0"] + cfg.depth_weight * parts["depth"] \
            + cfg.guided_weight * parts["guided"]
        if "phoneme_frame" in parts:
            loss = loss + cfg.phoneme_weight * parts["phoneme_frame"] \
                + cfg.phoneme_ctc_weight * parts["phoneme_ctc"]
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self._parameters(), cfg.grad_clip)
        self.opt.step()
        self.step += 1
        # the step's figures in one device -> host copy (a float() each was a sync each)
        names = [*parts, "loss", "grad_norm"]
        values = torch.stack([v.detach().float() for v in parts.values()]
                             + [loss.detach().float(), grad_norm.detach().float()]).tolist()
        out: dict[str, float] = dict(zip(names, values))
        out.update(lr=lr, utterances=len(batch),
                   frames=sum(int(u.codes.shape[0]) for u in batch))
        return out

    @torch.no_grad()
    def evaluate(self, items: list[Utterance]) -> dict[str, float]:
        """Token-weighted held-out cross-entropies (fixed batches, no update)."""
        self.model.eval()
        sums = {"code0": 0.0, "eos": 0.0, "depth": 0.0}
        counts = {"code0": 0, "eos": 0, "depth": 0}
        for batch in iter_fixed_batches(items, self.cfg.max_tokens):
            parts = self._losses(batch)
            frames = sum(int(u.codes.shape[0]) for u in batch)
            for key, n in (("code0", frames + len(batch)), ("eos", len(batch)),
                           ("depth", frames)):
                sums[key] += float(parts[key]) * n
                counts[key] += n
        self.model.train()
        return {f"eval_{k}": sums[k] / max(1, counts[k]) for k in sums}

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.cfg), "step": self.step, "reset_step": self.reset_step,
                "train_time_s": self.train_time_s, "model": self.model.state_dict(),
                "opt": self.opt.state_dict(), **self._heads_state(torch.float32)}

    def _heads_state(self, dtype: torch.dtype) -> dict[str, Any]:
        if self.heads is None:
            return {}
        return {"phoneme_heads": {k: v.detach().to("cpu", dtype)
                                  for k, v in self.heads.state_dict().items()}}

    def _load_heads(self, state: dict[str, Any]) -> None:
        if self.heads is not None and "phoneme_heads" in state:  # else they start fresh
            self.heads.load_state_dict({k: v.float() for k, v in state["phoneme_heads"].items()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_config(state["config"])
        self.model.load_state_dict(state["model"])
        self._load_heads(state)
        self.opt.load_state_dict(state["opt"])
        self.step, self.reset_step = int(state["step"]), int(state["reset_step"])
        self.train_time_s = float(state["train_time_s"])

    def _check_config(self, saved_json: dict[str, Any], free: tuple[str, ...] = ()) -> None:
        """The saved run's config must be this one, but for the ``free`` fields."""
        saved = LMTrainConfig.from_json(saved_json)
        diff = [f"{f.name}: saved {getattr(saved, f.name)!r}, now {getattr(self.cfg, f.name)!r}"
                for f in fields(saved)
                if f.name not in free and getattr(saved, f.name) != getattr(self.cfg, f.name)]
        if diff:
            raise ValueError("the saved run used another config: " + "; ".join(diff))

    def snapshot(self, audio_rows: torch.Tensor | None = None) -> dict[str, Any]:
        """The carry form: bf16 weights, the text table as its used rows, no optimiser moments
        (about 15 MB for ``small``); resuming from it restarts AdamW with a short re-warmup.
        ``audio_rows``: the audio table's rows the training codes read (``audio_rows_used``);
        only those are kept and the others load as zeros. No lookup of those codes reads them,
        and they are random: with recipe 2's codec 24,613 of 32,816 rows, which took the
        carried snapshot of 7 Dec (277 steps) from 11.4 to 6.4 MB gzip'd, room the carry needs
        for the teacher's wheel (bench/README.md, queue item 3)."""
        weights = plain_state(self.model)
        rows = text_rows_used()
        table = weights.pop(TEXT_TABLE)
        unused = torch.ones(table.shape[0], dtype=torch.bool)
        unused[rows] = False
        if bool(table[unused.to(table.device)].any()):
            raise AssertionError("text rows outside the tokenizer moved: a snapshot loses them")
        snap = {"config": asdict(self.cfg), "step": self.step, "train_time_s": self.train_time_s,
                "weights": {k: v.detach().to("cpu", torch.bfloat16) for k, v in weights.items()},
                "text_rows": rows,
                "text_table_rows": table[rows.to(table.device)].cpu().bfloat16(),
                "text_table_shape": list(table.shape), **self._heads_state(torch.bfloat16)}
        if audio_rows is not None:
            audio = snap["weights"].pop(AUDIO_TABLE)
            snap.update(audio_rows=audio_rows.cpu(), audio_table_rows=audio[audio_rows.cpu()],
                        audio_table_shape=list(audio.shape))
        return snap

    def load_snapshot(self, snap: dict[str, Any]) -> None:
        """A carry snapshot; its batch size may differ from this run's (``fit_batch_to_card``:
        the card of the next call may be another), since AdamW restarts anyway."""
        self._check_config(snap["config"], free=("max_tokens",))
        weights = {k: v.float() for k, v in snap["weights"].items()}
        for name, key in ((TEXT_TABLE, "text"), (AUDIO_TABLE, "audio")):
            if f"{key}_rows" in snap:  # kept as its used rows, the others zero
                table = torch.zeros(snap[f"{key}_table_shape"])
                table[snap[f"{key}_rows"]] = snap[f"{key}_table_rows"].float()
                weights[name] = table
        load_plain_(self.model, weights)
        self._load_heads(snap)
        self.opt = self._new_optimizer()
        self.step = self.reset_step = int(snap["step"])
        self.train_time_s = float(snap["train_time_s"])


def load_plain_(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Loads released-name weights into ``model`` (parametrized or not)."""
    key = ".parametrizations.weight.original"
    names = {k.replace(key, ".weight"): k for k in model.state_dict()}
    if set(names) != set(weights):
        raise ValueError(f"weights differ from the model: {sorted(set(names) ^ set(weights))[:8]}")
    model.load_state_dict({names[k]: v for k, v in weights.items()})


# ------------------------------------------------------------------------------- the loop
def _save(trainer: LMTrainer, data: BatchStream, out: Path) -> None:
    state = trainer.state_dict()
    state["data"] = data.state_dict()
    save_atomic(state, out / STATE_FILE)


def resume(trainer: LMTrainer, data: BatchStream, out: Path) -> bool:
    """From ``out/state.pt`` (exact), else ``out/snapshot.pt`` (a carried snapshot); False
    when neither exists."""
    if (out / STATE_FILE).is_file():
        state = load_state(out / STATE_FILE)
        trainer.load_state_dict(state)
        data.load_state_dict(state["data"])
        return True
    if (out / SNAPSHOT_FILE).is_file():
        snap = load_state(out / SNAPSHOT_FILE)
        trainer.load_snapshot(snap)
        data.load_state_dict(snap["data"])
        return True
    return False


def save_snapshot(trainer: LMTrainer, data: BatchStream, path: Path) -> None:
    """The carry snapshot, its audio table cut to the rows ``data``'s codes read."""
    cfg = trainer.model.cfg.depth
    snap = trainer.snapshot(audio_rows_used(data.items, cfg.num_codebooks, cfg.vocab_size))
    snap["data"] = data.state_dict()
    save_atomic(snap, path)


def train(train_items: list[Utterance], heldout: list[Utterance], out: str | Path,
          cfg: LMTrainConfig, minutes: float, max_steps: int | None = None,
          save_every: int = 200, eval_every: int = 500, device: str | torch.device = "cpu",
          stop: StopFlag | None = None,
          on_step: Callable[[LMTrainer, dict[str, float]], None] | None = None) -> LMTrainer:
    """Trains until ``minutes`` pass (or ``max_steps`` total steps, or ``stop``), resuming from
    ``out``; saves every ``save_every`` steps and at the end, evaluates every ``eval_every``
    steps and at the end; ``on_step`` sees the trainer and each step's record (not training
    time). A non-finite loss raises and leaves the last save as it was."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    trainer = LMTrainer(cfg, device)
    data = BatchStream(train_items, cfg.max_tokens, cfg.seed)
    resumed = resume(trainer, data, out)
    log = StepLog(out / LOG_FILE, trainer.step if resumed else None)

    def evaluate(record: dict[str, float]) -> None:
        if heldout and trainer.step % eval_every == 0:
            record.update(trainer.evaluate(heldout))
        if on_step is not None:
            on_step(trainer, record)

    def run_end() -> None:  # each run ends with a held-out score
        if heldout and trainer.step % eval_every:
            log.write({"step": trainer.step, "time_s": round(trainer.train_time_s, 3),
                       "run_end": True, **trainer.evaluate(heldout)})

    timed_loop(trainer, lambda: trainer.train_step(data.next()),
               lambda: _save(trainer, data, out), log, minutes, max_steps, save_every, stop,
               after_step=evaluate, at_end=run_end)
    return trainer


# ------------------------------------------------------------------------------- export
def export_checkpoint(trainer: LMTrainer, codec_dir: str | Path, out: str | Path,
                      dtype: torch.dtype = torch.bfloat16) -> Path:
    """The complete checkpoint: the trained LM (in ``dtype``, the fp8 tables as fp8 when the
    run trained them so) with the codec decoder and encoder of the codec export at
    ``codec_dir``, stored as they are there; the built-in byte tokenizer."""
    base = load_checkpoint(codec_dir)
    codec_file = Path(codec_dir) / "audio_tokenizer" / "model.safetensors"
    with safe_open(str(codec_file), "pt") as f:
        codec_dtype = f.get_tensor(next(iter(f.keys()))).dtype
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}
    config = replace(lm_preset(trainer.cfg.preset), codec=base.config.codec,
                     codec_encoder_json=base.config.codec_encoder_json, dtype=name[dtype])
    model = BreezeModel(config)
    load_plain_(model, {k: v.detach().cpu().float() for k, v in plain_state(trainer.model).items()})
    # fp8 straight from the fp32 masters, as training's round trip (no bf16 step between).
    fp8 = {n: model.get_parameter(n).detach().clamp(-FP8_MAX, FP8_MAX).to(FP8)
           for n in (FP8_TENSORS if trainer.cfg.fp8_tables else ())}
    model.to(dtype).eval()
    for tensor_name, value in fp8.items():
        module, attr = _owner(model, tensor_name)
        setattr(module, attr, nn.Parameter(value, requires_grad=False))
    encoder = base.codec_encoder.to(codec_dtype) if base.codec_encoder is not None else None
    return save_checkpoint(out, config, model, base.codec.to(codec_dtype),
                           build_byte_tokenizer().to_str(), generation=GenerationDefaults(),
                           codec_encoder=encoder)


def folder_bytes(root: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


# ------------------------------------------------------------------------------- CLI
_RECIPES = {"small-gpu": SMALL_GPU, "tiny": LMTrainConfig()}
_GPU_RECIPE = """\
one GPU run of at most 10 minutes (re-run the same line to continue):
  python -m breezert_train.lm_train --data data/teacher --codec runs/codec/ckpt --out runs/lm \\
      --minutes 8 --recipe small-gpu --export runs/voice
"""


def config_from_args(args: argparse.Namespace) -> LMTrainConfig:
    base = _RECIPES[args.recipe] if args.recipe else LMTrainConfig()
    overrides = {f.name: getattr(args, f.name) for f in fields(LMTrainConfig)
                 if getattr(args, f.name, None) is not None}
    if "guided_layers" in overrides:
        overrides["guided_layers"] = tuple(overrides["guided_layers"])
    return replace(base, **overrides)


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", choices=sorted(_RECIPES), default=None,
                   help="a preset run config; the flags below override it")
    for f in fields(LMTrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "betas":
            continue
        if f.name == "guided_layers":
            p.add_argument(flag, type=int, nargs="*", default=None)
        elif f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            kind = type(getattr(LMTrainConfig(), f.name))
            p.add_argument(flag, type=kind, default=None)


def run(args: argparse.Namespace, cfg: LMTrainConfig) -> LMTrainer:
    """Encode (cached), load, train and optionally export, as the command line does."""
    out = Path(args.out)
    cache = Path(args.codes) if args.codes else out / "codes"
    encode_shards(args.data, args.codec, cache, device=args.device)
    train_items, heldout = split_heldout(load_utterances(cache, cfg.max_frames))
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    n = sum(p.numel() for p in init_lm(cfg).parameters())
    print(f"{len(train_items)} training / {len(heldout)} held-out utterances; "
          f"LM {cfg.preset}: {n:,} parameters")
    with stop_on_signals() as stop:
        trainer = train(train_items, heldout, out, cfg, args.minutes, args.max_steps,
                        args.save_every, args.eval_every, args.device, stop)
    print(f"step {trainer.step}, {trainer.train_time_s:.1f} s trained, saved to {out}")
    if args.export:
        root = export_checkpoint(trainer, args.codec, args.export)
        print(f"exported to {root}: {folder_bytes(root) / 1e6:.2f} MB on disk")
    return trainer


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m breezert_train.lm_train", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_GPU_RECIPE)
    p.add_argument("--data", required=True, help="teacher shards folder (shard-*.npz)")
    p.add_argument("--codec", required=True, help="codec export (released layout) to encode with")
    p.add_argument("--out", required=True, help="run folder: state.pt, log.jsonl, codes/")
    p.add_argument("--codes", default=None, help="codes cache (default OUT/codes)")
    p.add_argument("--minutes", type=float, required=True, help="wall time of this run")
    p.add_argument("--max-steps", type=int, default=None, help="stop at this total step")
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--export", default=None, help="write the complete checkpoint here at the end")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_config_args(p)
    args = p.parse_args(argv)
    run(args, config_from_args(args))


if __name__ == "__main__":
    main()
