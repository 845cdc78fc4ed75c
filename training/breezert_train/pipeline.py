"""The default voice in one GPU call: teacher data -> codec -> codes -> LM -> export -> carry out.

Owns: the order of the stages and their time budget inside one call of at most 10 minutes, the
work folder's layout, and what leaves the call: the resumable state as ``state.NNN`` parts of at
most 16 MiB (``state_shards``) plus the logs. The next call takes the parts back
(``--carry-in``) and goes on where this one stopped. Must not: hold any stage's logic (each
stage is its own module) or be imported by serving code.

While the codec trains (``Plan.codec_minutes`` in all, over as many calls as it takes), a call
makes the teacher data again (about 0.7 minutes for 10 h on 16 cores), trains the codec from the
carried snapshot (bf16 weights of encoder, decoder and discriminator, about 23 MB, no optimiser
moments: they restart with a short re-warmup) and carries the snapshot on. The call that finishes
the codec exports it and goes on to the codes and the LM. With ``Plan.lm_fresh_hours`` an LM
call first synthesises that much more teacher speech, the corpus's next hours after the last
call's, encodes it and trains on it (beside the carried codes while the state holds them; its
pack then drops them for the marker ``FRESH_FILE``), so that the LM does not see 10 h forty
times. What the LM calls carry (about 37 MB
for ``small`` plus the codes; the device call's carry limit is 64 MiB with the working tree, and
what comes back is at most 8 files of 16 MiB, 64 MiB in all): the codec export (bf16, 22 MB,
without the random placeholder LM its export holds: rebuilt after the carry-in), the codes cache
(11-bit packed, about 1.2 MB per hour of speech) and the LM's carry snapshot (bf16 weights, no
optimiser moments: AdamW restarts with a short re-warmup; its audio table cut to the rows the
codes read, 8.8 MB, 6.4 gzip'd, for ``small``). Not carried: the teacher audio (173
MB per hour), so LM calls without fresh hours train on the codes already made (they need
neither the teacher's wheel nor its corpus). The GPU image's own onnxruntime runs the teacher.

In-run WER (``run_wer``): from the call's teacher data on, ``wer_workers`` CPU processes score
the codec (its resynthesis of the teacher's dev audio) every ``wer_every_min`` training minutes
and at the stage's end, and the voice likewise in the LM stage; each score is a line of
``wer_curve.jsonl`` (carried; also in ``$OUT``). The rule (``run_wer.WerRule``) acts at once:
``stop`` finishes the stage (the codec is exported and the LM starts; the LM is done), ``change``
ends the call with the state packed (``summary.json``'s ``wer`` says why), and a later call of
the same ``wer_label`` whose curve already says ``change`` trains nothing: change the recipe or
flags and give a new ``--wer-label`` (a new curve segment).

    python -m breezert_train.pipeline --work /tmp/voice --minutes-total 9.3 --out $OUT \\
        [--carry-in DIR] [--hours 10] [--workers 16] [--codec-minutes 40] [--codec-recipe 2]
        [--codec-batch-size 16] [--codec-latent-mel-weight 1.0] [--codec-autocast-bf16]
        [--wer-workers 12] [--wer-every-min 2] [--wer-label r2]
    python -m breezert_train.pipeline --carry-in PARTS --export-codec DIR   # score it here
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from breezert.constants import FRAME_S
from breezert_train import run_wer, state_shards
from breezert_train.checkpoint import (
    LOG_FILE,
    add_default_flag,
    load_state,
    save_atomic,
    stop_on_signals,
)

PARTS_PREFIX = "state"


@dataclass(frozen=True)
class Plan:
    """What one call does; every stage is skipped once its output exists in the carried state."""

    hours: float = 10.0
    """Teacher speech to generate (first call only)."""
    workers: int = 16
    """Teacher synthesis processes."""
    codec_minutes: float = 40.0
    """Codec training in all, over as many calls as it takes: a call that cannot finish it
    trains the codec only and carries its snapshot; the call that finishes it exports the
    codec and goes on to the codes and the LM."""
    codec_preset: str = "small"
    codec_recipe: int = 2
    """``codec_train.CODEC_RECIPES``: 2 aims at intelligibility (issue 35)."""
    codec_batch_size: int = 16
    codec_crop_frames: int = 24
    codec_latent_mel_weight: float = 1.0
    """``CodecTrainConfig.latent_mel_weight`` (0: the run of 2 Dec without the probe)."""
    codec_autocast_bf16: bool = False
    """``CodecTrainConfig.autocast_bf16`` (not yet measured on the GPU)."""
    lm_recipe: str = "small-gpu"
    """``lm_train`` recipe of the LM run."""
    lm_fresh_hours: float = 0.0
    """Teacher speech each LM call synthesises afresh and trains on, the corpus's next hours
    after the last call's (``FRESH_FILE`` carries where they ended; their audio and codes are
    not carried, and the carried codes leave the state once it is there). 0: the carried
    codes only. It needs the teacher's wheel on the machine (``.whl-train``), for which the
    cut LM snapshot and the xz'd parts make room in the carry."""
    reserve_minutes: float = 0.7
    """Kept at the end for the export, the sample and packing."""
    sample_max_frames: int = 150
    """Frame limit of the sample sentence (12 s)."""
    wer_workers: int = 12
    """Scoring processes of the in-run WER (0: none, no score)."""
    wer_every_min: float = 2.0
    """Training minutes between two scores of a stage (each stage's end is scored too)."""
    wer_label: str = ""
    """The curve segment the rule reads ("": ``r<codec_recipe>``); a new one starts afresh."""
    wer_goal: float = run_wer.WerRule.goal
    wer_min_gain: float = run_wer.WerRule.min_gain
    wer_window_min: float = run_wer.WerRule.window_min
    wer_drain_s: float = 40.0
    """How long a stage's end waits for its last score (kept out of its training minutes)."""
    codec_max_steps: int | None = None
    lm_max_steps: int | None = None
    """Step caps (tests)."""

    @property
    def label(self) -> str:
        return self.wer_label or f"r{self.codec_recipe}"

    @property
    def rule(self) -> run_wer.WerRule:
        return run_wer.WerRule(goal=self.wer_goal, min_gain=self.wer_min_gain,
                               window_min=self.wer_window_min)
    device: str = "cuda" if torch.cuda.is_available() else "cpu"


def _generate_teacher(out: Path, plan: Plan) -> None:
    from breezert_train.teacher_data import generate

    generate(out, plan.hours, plan.workers)


def _generate_fresh(out: Path, plan: Plan, after_id: int) -> int:
    """``plan.lm_fresh_hours`` of teacher speech in ``out``, the corpus's utterances after
    ``after_id`` (the corpus copied from the call's teacher folder, where the session put it);
    returns the last utterance id synthesised."""
    from breezert_train import shards
    from breezert_train.teacher_data import CORPUS_NAME, generate

    out.mkdir(parents=True, exist_ok=True)
    corpus = out.parent / "teacher" / CORPUS_NAME
    if corpus.is_file() and not (out / CORPUS_NAME).is_file():
        shutil.copy(corpus, out / CORPUS_NAME)
    generate(out, plan.lm_fresh_hours, plan.workers, after_id=after_id)
    return max((i for shard in shards.scan(out) for i in shard.utterance_ids), default=after_id)


FRESH_FILE = "fresh.json"
"""In the carry's ``lm/``: ``{"after_id": N}``, the last utterance id an LM call synthesised
afresh (``Plan.lm_fresh_hours``): the next call's fresh hours start after it."""


CODEC_SNAPSHOT = "codec_snapshot.pt"
"""The unfinished codec's carry (``CodecTrainer.snapshot`` plus its crop state)."""
CODEC_LOG = "codec_log.jsonl"
CODEC_DONE = "codec_done.json"
WER_DIR = "wer"
"""In the work folder: the scorer's language model and the snapshots handed to it."""
"""Written beside the export by the call that finishes the codec (step, seconds trained)."""


def _last_logged(log: Path) -> tuple[int, float]:
    """(step, time_s) of a training log's last step record; (0, 0.0) without one."""
    last = (0, 0.0)
    if log.is_file():
        for line in log.read_text().splitlines():
            record = json.loads(line)
            if "step" in record and "time_s" in record:
                last = (int(record["step"]), float(record["time_s"]))
    return last


class _Scoring:
    """A stage's hand-offs to the in-run scorer: every ``plan.wer_every_min`` training minutes
    once the last score is done (and at the end, ``final``) ``save`` writes the subject and it
    is queued; the rule's verdict sets ``stop`` (the loop then ends after its step)."""

    def __init__(self, wer: run_wer.InRunWer | None, kind: str, plan: Plan, folder: Path,
                 save: Callable[[Any, Path], None]) -> None:
        self.wer, self.kind, self.plan, self.folder, self.save = wer, kind, plan, folder, save
        self.last_s: float | None = None
        self.last_step = -1
        self.stop: Any = None

    def __call__(self, trainer: Any, record: dict[str, float]) -> None:
        if self.wer is None:
            return
        if self.last_s is None:
            self.last_s = trainer.train_time_s
        # at most one score in flight: a scorer slower than wer_every_min sets the pace
        if trainer.train_time_s - self.last_s >= self.plan.wer_every_min * 60 \
                and not self.wer.pending:
            self.hand_in(trainer)
        if self.stop is not None and self.verdict()["verdict"] != "continue":
            self.stop.is_set = True

    def hand_in(self, trainer: Any) -> None:
        if self.wer is None or trainer.step == self.last_step:
            return
        self.last_s, self.last_step = trainer.train_time_s, trainer.step
        path = self.folder / f"{self.kind}-{trainer.step}"
        self.save(trainer, path)
        self.wer.submit(self.kind, path, trainer.train_time_s / 60, trainer.step)

    def final(self, trainer: Any, drain_s: float) -> None:
        """Scores the stage's last step (when this call trained it) and waits up to
        ``drain_s`` for every queued score."""
        if self.wer is not None:
            if self.last_s is not None:  # at least one step ran here
                self.hand_in(trainer)
            self.wer.drain(drain_s)

    def verdict(self) -> dict[str, Any]:
        if self.wer is None:
            return {"verdict": "continue", "reason": "no in-run WER"}
        return self.wer.verdict(self.kind)


def codec_config(plan: Plan, overrides: dict | None = None) -> Any:
    """The ``CodecTrainConfig`` a call trains the codec with."""
    from breezert_train.codec_train import recipe_config

    return recipe_config(plan.codec_recipe, preset=plan.codec_preset,
                         batch_size=plan.codec_batch_size, crop_frames=plan.codec_crop_frames,
                         latent_mel_weight=plan.codec_latent_mel_weight,
                         autocast_bf16=plan.codec_autocast_bf16, **(overrides or {}))


def restate(parts: str | Path, scratch: str | Path, plan: Plan = Plan(),
            codec_overrides: dict | None = None) -> list[Path]:
    """Packs the state that ``parts`` hold again, in place, as a call of ``plan`` would leave
    it (one snapshot, stale parts stripped, a finished codec's log dropped): an unfinished
    codec's snapshot is loaded into ``plan``'s recipe and snapshotted again (no discriminator
    before it starts, no decoder codebook copies, no inactive codebooks:
    ``CodecTrainer.snapshot``; its preset and discriminator width kept), the LM snapshot cut
    and, with fresh hours, the codes dropped for ``FRESH_FILE`` (``_restate_lm``), the parts
    compressed. Trains nothing; returns the files written."""
    from breezert_train.codec_train import CodecTrainer, config_from_json

    carry = Path(scratch) / "carry"
    state_shards.join_dir(parts, carry, PARTS_PREFIX)
    if (carry / CODEC_SNAPSHOT).is_file():
        old = load_state(carry / CODEC_SNAPSHOT)
        shape = config_from_json(old["config"])  # the sizes stay the snapshot's
        cfg = codec_config(replace(plan, codec_preset=shape.preset),
                           {**(codec_overrides or {}), "disc_channels": shape.disc_channels})
        trainer = CodecTrainer(cfg, "cpu")
        trainer.load_snapshot(old)
        snap = trainer.snapshot()
        if "data" in old:
            snap["data"] = old["data"]
        save_atomic(snap, carry / CODEC_SNAPSHOT)
    _restate_lm(carry, plan)
    _drop_placeholder_lm(carry / "codec")
    _drop_finished_codec_log(carry)
    _drop_codes_for_fresh(carry, plan.lm_fresh_hours)
    return state_shards.split_dir(carry, parts, PARTS_PREFIX)


def _restate_lm(carry: Path, plan: Plan) -> None:
    """The carried LM snapshot as a call leaves it now (its audio table cut to the rows the
    carried codes read: ``lm_train.save_snapshot``), and, with fresh hours
    (``Plan.lm_fresh_hours``), ``FRESH_FILE`` pointing past the carried codes' last id."""
    from breezert_train.lm_data import BatchStream, load_utterances
    from breezert_train.lm_train import SNAPSHOT_FILE, LMTrainConfig, LMTrainer, save_snapshot

    path = carry / "lm" / SNAPSHOT_FILE
    if not path.is_file():
        return
    old = load_state(path)
    cfg = LMTrainConfig.from_json(old["config"])
    items = load_utterances(carry / "codes", cfg.max_frames)
    if items:
        trainer = LMTrainer(cfg, "cpu")
        trainer.load_snapshot(old)
        data = BatchStream(items, cfg.max_tokens, cfg.seed)
        data.load_state_dict(old["data"])
        save_snapshot(trainer, data, path)
        marker = carry / "lm" / FRESH_FILE
        if plan.lm_fresh_hours > 0 and not marker.is_file():
            marker.write_text(json.dumps({"after_id": max(u.utterance_id for u in items)}))


def _save_codec_snapshot(trainer: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_atomic(trainer.snapshot(), path)


def _codec_stage(work: Path, plan: Plan, budget_minutes: float, codec_cfg_overrides: dict,
                 wer: run_wer.InRunWer | None = None) -> tuple[bool, float, dict]:
    """Trains the codec from whatever is carried (nothing, a snapshot or an export) for what is
    left of ``plan.codec_minutes``, at most ``budget_minutes``, handing snapshots to ``wer``;
    returns (whether it finished, seconds trained in all, the WER verdict). Finished (the
    minutes spent or the rule's ``stop``): the bf16 export in ``carry/codec``; not yet:
    ``carry/codec_snapshot.pt``. Either way the other is removed, and so are codes and an LM
    made with an older codec."""
    from breezert_train.codec_train import CodecTrainer, export_checkpoint
    from breezert_train.codec_train import train as train_codec
    from breezert_train.data import AudioFolderCrops

    carry, run = work / "carry", work / "codec_run"
    cfg = codec_config(plan, codec_cfg_overrides)
    run.mkdir(parents=True, exist_ok=True)
    if (carry / CODEC_LOG).is_file() and not (run / LOG_FILE).is_file():
        shutil.copy(carry / CODEC_LOG, run / LOG_FILE)
    snapshot = load_state(carry / CODEC_SNAPSHOT) if (carry / CODEC_SNAPSHOT).is_file() else None
    step, seconds = _last_logged(carry / CODEC_LOG)  # an export carries no clock: its log does
    if snapshot is not None:
        seconds = float(snapshot["train_time_s"])
    elif not (carry / "codec").is_dir():
        seconds = 0.0
    minutes = min(max(0.0, plan.codec_minutes * 60 - seconds) / 60, budget_minutes)
    # crops: the snapshot's position, else (an export warm start) a seed of their own
    data = AudioFolderCrops(work / "teacher", cfg.crop_samples, seed=cfg.seed + step)
    if snapshot is not None and "data" in snapshot:
        data.load_state_dict(snapshot["data"])

    def warm_start(trainer: CodecTrainer) -> None:
        if snapshot is not None:
            trainer.load_snapshot(snapshot)
        elif (carry / "codec").is_dir():
            trainer.load_export(carry / "codec", step, seconds)

    scoring = _Scoring(wer, run_wer.CODEC, plan, work / WER_DIR, _save_codec_snapshot)
    with stop_on_signals() as stop:
        scoring.stop = stop
        trainer = train_codec(data, run, cfg, minutes, plan.codec_max_steps, save_every=500,
                              device=plan.device, stop=stop, warm_start=warm_start,
                              on_step=scoring)
    scoring.final(trainer, plan.wer_drain_s)
    shutil.copy(run / LOG_FILE, carry / CODEC_LOG)
    verdict = scoring.verdict()
    finished = trainer.train_time_s >= plan.codec_minutes * 60 - 1.0 or (
        plan.codec_max_steps is not None and trainer.step >= plan.codec_max_steps) or (
        verdict["verdict"] == "stop")
    for stale in ("codes", "lm", "codec"):
        shutil.rmtree(carry / stale, ignore_errors=True)
    (carry / CODEC_SNAPSHOT).unlink(missing_ok=True)
    if finished:
        export_checkpoint(trainer, carry / "codec", dtype=torch.bfloat16)
        (carry / CODEC_DONE).write_text(json.dumps(
            {"step": trainer.step, "train_time_s": round(trainer.train_time_s, 3)}))
    else:
        snap = trainer.snapshot()
        snap["data"] = data.state_dict()
        save_atomic(snap, carry / CODEC_SNAPSHOT)
    return finished, trainer.train_time_s, verdict


def _drop_placeholder_lm(codec: Path) -> None:
    """Removes the codec export's LM, ``codec_train.export_checkpoint``'s random ``tiny``
    placeholder (47 MB in fp32 at the released text vocabulary, never trained or used), so the
    carry holds only the codec; ``_restore_placeholder_lm`` rebuilds one after the carry-in."""
    from breezert.loader import INDEX_FILE

    for name in [INDEX_FILE, *(p.name for p in codec.glob("model-*.safetensors"))]:
        (codec / name).unlink(missing_ok=True)


def _restore_placeholder_lm(codec: Path) -> None:
    """Writes a random ``tiny`` LM beside a carried codec (its config.json names that size) so
    the loader reads the folder again; only its codec and encoder are ever used."""
    from breezert.loader import INDEX_FILE, save_checkpoint
    from breezert.random_init import build_random
    from breezert.tokenizer import build_byte_tokenizer

    if (codec / INDEX_FILE).is_file() or not codec.is_dir():
        return
    scratch = codec.parent / "placeholder-lm"
    config, model, decoder = build_random("tiny")
    save_checkpoint(scratch, config, model, decoder, build_byte_tokenizer().to_str())
    for name in [INDEX_FILE, *(p.name for p in scratch.glob("model-*.safetensors"))]:
        shutil.move(str(scratch / name), str(codec / name))
    shutil.rmtree(scratch)


def export_carried_codec(parts: str | Path, out: str | Path, scratch: str | Path) -> Path:
    """The codec that a call's ``parts`` carry, in the released layout at ``out`` with a random
    ``tiny`` placeholder LM, so that ``asr_gate --codec`` and the codebook ablation can score a
    voice's codec between calls, on any machine. A finished codec: its export as carried. An
    unfinished one: its snapshot exported as the call that finishes it would (bf16; the
    snapshot's weights are already bf16). Trains nothing; ``out`` must not exist or be empty;
    ``scratch`` receives the joined parts."""
    from breezert_train.codec_train import CodecTrainer, config_from_json, export_checkpoint

    carry, out = Path(scratch) / "carry", Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder")
    state_shards.join_dir(parts, carry, PARTS_PREFIX)
    if (carry / "codec").is_dir():
        _restore_placeholder_lm(carry / "codec")  # (its scratch folder beside it, in scratch)
        shutil.copytree(carry / "codec", out, dirs_exist_ok=True)
        return out
    if not (carry / CODEC_SNAPSHOT).is_file():
        raise FileNotFoundError(f"{parts} carries neither a codec export nor {CODEC_SNAPSHOT}")
    snapshot = load_state(carry / CODEC_SNAPSHOT)
    trainer = CodecTrainer(config_from_json(snapshot["config"]), "cpu")
    trainer.load_snapshot(snapshot)
    return export_checkpoint(trainer, out, dtype=torch.bfloat16)


def export_carried_voice(parts: str | Path, out: str | Path, scratch: str | Path) -> Path:
    """The complete voice that a call's ``parts`` carry (the LM's carry snapshot with the
    carried codec), exported in the released layout at ``out`` as the call exported it (fp8
    tables rounded from the snapshot's bf16 weights, not from fp32 masters): e.g.
    ``runtime/breezert/voices/default``, where ``model.path = "@default"`` finds it. Trains
    nothing; ``out`` must not exist or be empty."""
    from breezert_train.lm_train import SNAPSHOT_FILE, LMTrainConfig, LMTrainer, export_checkpoint

    carry, out = Path(scratch) / "carry", Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder")
    state_shards.join_dir(parts, carry, PARTS_PREFIX)
    if not (carry / "lm" / SNAPSHOT_FILE).is_file() or not (carry / "codec").is_dir():
        raise FileNotFoundError(f"{parts} carries no trained LM (lm/{SNAPSHOT_FILE}) and codec")
    _restore_placeholder_lm(carry / "codec")
    snap = load_state(carry / "lm" / SNAPSHOT_FILE)
    trainer = LMTrainer(LMTrainConfig.from_json(snap["config"]), "cpu")
    trainer.load_snapshot(snap)
    return export_checkpoint(trainer, carry / "codec", out)


def _fresh_items(work: Path, plan: Plan, carried: list, max_frames: int,
                 make_fresh: Callable[[Path, Plan, int], int], summary: dict) -> list:
    """The call's fresh utterances (``Plan.lm_fresh_hours``; none at 0): synthesised after the
    last call's (or the carried codes') last id, encoded with the carried codec; where they
    ended goes into the carry (``FRESH_FILE``)."""
    from breezert_train.lm_data import encode_shards, load_utterances

    if plan.lm_fresh_hours <= 0:
        return []
    start = time.monotonic()
    carry = work / "carry"
    marker = carry / "lm" / FRESH_FILE
    after = (json.loads(marker.read_text())["after_id"] if marker.is_file()
             else max((u.utterance_id for u in carried), default=-1))
    last = make_fresh(work / "fresh", plan, after)
    encode_shards(work / "fresh", carry / "codec", work / "fresh_codes", device=plan.device)
    items = load_utterances(work / "fresh_codes", max_frames)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"after_id": last}))
    summary["stages"].append({
        "fresh_after_id": after, "fresh_last_id": last, "fresh_utterances": len(items),
        "fresh_hours": round(sum(int(u.codes.shape[0]) for u in items) * FRAME_S / 3600, 3),
        "fresh_min": round((time.monotonic() - start) / 60, 2)})
    return items


def _lm_stage(work: Path, plan: Plan, minutes: float, lm_overrides: dict,
              wer: run_wer.InRunWer | None = None,
              make_fresh: Callable[[Path, Plan, int], int] = _generate_fresh,
              summary: dict | None = None) -> tuple[Path, dict]:
    from breezert_train.lm_data import BatchStream, encode_shards, load_utterances, split_heldout
    from breezert_train.lm_train import (
        _RECIPES,
        SNAPSHOT_FILE,
        export_checkpoint,
        fit_batch_to_card,
        save_snapshot,
        train,
    )

    stage_start = time.monotonic()
    carry, run = work / "carry", work / "lm_run"
    run.mkdir(parents=True, exist_ok=True)
    if not (run / "state.pt").is_file():  # a fresh machine: go on from the carried snapshot
        for name in (SNAPSHOT_FILE, LOG_FILE):
            if (carry / "lm" / name).is_file():
                shutil.copy(carry / "lm" / name, run / name)
    if (work / "teacher").is_dir():
        encode_shards(work / "teacher", carry / "codec", carry / "codes", device=plan.device)
    cfg = replace(_RECIPES[plan.lm_recipe], **lm_overrides)
    if torch.device(plan.device).type == "cuda":
        cfg = fit_batch_to_card(cfg, torch.cuda.get_device_properties(plan.device).total_memory)
        print(f"LM batch: {cfg.max_tokens} padded positions on this card", flush=True)
    carried = load_utterances(carry / "codes", cfg.max_frames)  # none once fresh hours replace them
    fresh = _fresh_items(work, plan, carried, cfg.max_frames, make_fresh,
                         summary if summary is not None else {"stages": []})
    if not carried and not fresh:
        raise ValueError("no LM data: the state carries no codes (it was packed for fresh "
                         "hours) and this call makes none: give --lm-fresh-hours")
    items, heldout = split_heldout(carried or fresh)  # held out from the carried codes if any
    if carried:
        items += fresh
    # encoding and the fresh hours come out of the stage's minutes
    minutes = max(0.0, minutes - (time.monotonic() - stage_start) / 60)
    scoring = _Scoring(wer, run_wer.VOICE, plan, work / WER_DIR,
                       lambda t, path: export_checkpoint(t, carry / "codec", path))
    with stop_on_signals() as stop:
        scoring.stop = stop
        trainer = train(items, heldout, run, cfg, minutes, plan.lm_max_steps,
                        save_every=500, eval_every=500, device=plan.device, stop=stop,
                        on_step=scoring)
    scoring.final(trainer, plan.wer_drain_s)
    data = BatchStream(items, cfg.max_tokens, cfg.seed)
    data.load_state_dict(torch.load(run / "state.pt", weights_only=True)["data"])
    (carry / "lm").mkdir(exist_ok=True)
    save_snapshot(trainer, data, carry / "lm" / SNAPSHOT_FILE)
    shutil.copy(run / LOG_FILE, carry / "lm" / LOG_FILE)
    return export_checkpoint(trainer, carry / "codec", work / "voice"), scoring.verdict()


def _sample(voice: Path, text: str, max_frames: int) -> dict:
    """One sentence with the checkpoint's own sampling: frames made, whether EOS ended it."""
    from breezert.loader import load_checkpoint
    from breezert.offline import synthesize_whole
    from breezert.request import SynthesisRequest

    ckpt = load_checkpoint(voice)
    audio = synthesize_whole(ckpt, SynthesisRequest(text=text, max_frames=max_frames))
    frames = len(audio) // 1920
    return {"text": text, "frames": frames, "ended_by_eos": frames < max_frames}


def default_wer(work: Path, plan: Plan, teacher: bool) -> run_wer.InRunWer | None:
    """The call's in-run scorer: the dev set and the language model's texts from the corpus
    beside the teacher data (``teacher_data.CORPUS_NAME``), the teacher's dev audio where the
    call has the teacher (``teacher``: a codec call); None when ``plan.wer_workers`` is 0 or
    there is no corpus (then nothing is scored, and the summary says so)."""
    from breezert_train.teacher_data import CORPUS_NAME, load_corpus

    corpus = work / "teacher" / CORPUS_NAME
    if plan.wer_workers <= 0 or not corpus.is_file():
        return None
    train, heldout, _ = load_corpus(corpus)
    lm_texts = [u.text for u in train[: run_wer.LM_SENTENCES]]
    try:
        dev = run_wer.dev_sentences([(u.utterance_id, u.text) for u in heldout],
                                    vocabulary=run_wer.lm_vocabulary(lm_texts))
    except ValueError as exc:  # a corpus too small to score: train on, unscored
        print(f"[wer] no in-run WER: {exc}", flush=True)
        return None
    return run_wer.InRunWer(work / WER_DIR, work / "carry" / run_wer.CURVE_FILE, dev, lm_texts,
                            plan.wer_workers, plan.rule, plan.label, teacher=teacher)


def run_pipeline(work: str | Path, minutes_total: float, out: str | Path,
                 carry_in: str | Path | None = None, plan: Plan = Plan(),
                 make_teacher: Callable[[Path, Plan], None] = _generate_teacher,
                 codec_overrides: dict | None = None, lm_overrides: dict | None = None,
                 make_wer: Callable[[Path, Plan, bool], run_wer.InRunWer | None] = default_wer,
                 make_fresh: Callable[[Path, Plan, int], int] = _generate_fresh) -> dict:
    """One call: resume from ``carry_in`` parts, run what is left within ``minutes_total``,
    write the state parts, the logs, the WER curve and ``summary.json`` to ``out``; returns the
    summary."""
    start = time.monotonic()
    work, out = Path(work), Path(out)
    carry = work / "carry"
    if carry_in and (Path(carry_in) / f"{PARTS_PREFIX}.json").is_file():
        state_shards.join_dir(carry_in, carry, PARTS_PREFIX)
        _restore_placeholder_lm(carry / "codec")
    carry.mkdir(parents=True, exist_ok=True)
    summary: dict = {"plan": asdict(plan), "stages": [], "wer": {}}
    wer: run_wer.InRunWer | None = None

    def left() -> float:
        """Minutes a stage may train: the call's, less the reserve and the final score's
        wait."""
        drain = plan.wer_drain_s / 60 if wer is not None else 0.0
        return minutes_total - plan.reserve_minutes - drain - (time.monotonic() - start) / 60

    def stalled(stage: str) -> bool:
        """The carried curve already says ``change`` for this stage and label."""
        verdict = run_wer.decide(run_wer.read_curve(carry / run_wer.CURVE_FILE), stage,
                                 plan.rule, plan.label)
        summary["wer"][f"{stage}_at_start"] = verdict
        return verdict["verdict"] == "change"

    summary["wer"]["scored"] = False
    try:
        # an export without CODEC_DONE is an unfinished codec of an older pipeline: it goes on
        if not ((carry / "codec").is_dir() and (carry / CODEC_DONE).is_file()):
            if stalled(run_wer.CODEC):
                return _pack(carry, out, summary, start)
            make_teacher(work / "teacher", plan)  # each codec call makes it again (not carried)
            summary["stages"].append(
                {"teacher_done_min": round((time.monotonic() - start) / 60, 2)})
            wer = make_wer(work, plan, True)
            finished, trained_s, verdict = _codec_stage(work, plan, left(),
                                                        codec_overrides or {}, wer)
            summary["wer"]["codec"] = verdict
            summary["stages"].append({"codec_done_min": round((time.monotonic() - start) / 60, 2),
                                      "codec_trained_s": round(trained_s, 1),
                                      "codec_finished": finished})
            if not finished:
                return _pack(carry, out, summary, start)
        elif stalled(run_wer.VOICE):
            return _pack(carry, out, summary, start)
        if wer is None:
            wer = make_wer(work, plan, False)
        voice, verdict = _lm_stage(work, plan, max(0.0, left()), lm_overrides or {}, wer,
                                   make_fresh, summary)
        summary["wer"]["voice"] = verdict
        summary["stages"].append({"lm_done_min": round((time.monotonic() - start) / 60, 2)})
        from breezert_train.lm_train import folder_bytes

        summary["voice_bytes"] = folder_bytes(voice)
        summary["sample"] = _sample(voice, "The quick brown fox jumps over the lazy dog.",
                                    plan.sample_max_frames)
        return _pack(carry, out, summary, start)
    finally:
        if wer is not None:
            summary["wer"].update(scored=True, error=repr(wer.error) if wer.error else None)
            wer.close()


def _drop_finished_codec_log(carry: Path) -> None:
    """A finished codec's training log leaves the carried state (3.4 MB at 24.9 minutes, ~0.9
    MB packed): only an unfinished codec reads it (its clock and step), and a voice call's
    carry (the tree, the state, the wheels and the corpus) fits 64 MiB only without it. The
    call that finished the codec returns the log beside the parts."""
    if (carry / CODEC_DONE).is_file():
        (carry / CODEC_LOG).unlink(missing_ok=True)


def _drop_codes_for_fresh(carry: Path, fresh_hours: float) -> None:
    """With fresh hours (``Plan.lm_fresh_hours``) the carried codes leave the state once
    ``FRESH_FILE`` says where the fresh hours go on: the carry with the teacher's wheel fits
    64 MiB only without them (bench/README.md, queue item 3), and the fresh hours replace
    them."""
    if fresh_hours > 0 and (carry / "lm" / FRESH_FILE).is_file():
        shutil.rmtree(carry / "codes", ignore_errors=True)


def _pack(carry: Path, out: Path, summary: dict, start: float) -> dict:
    """The carried state as parts in ``out``, with the logs and ``summary.json``."""
    out.mkdir(parents=True, exist_ok=True)
    logs = (("lm/" + LOG_FILE, "lm_log.jsonl"), (CODEC_LOG, CODEC_LOG),
            (run_wer.CURVE_FILE, run_wer.CURVE_FILE))
    for name, target in logs:
        if (carry / name).is_file():
            shutil.copy(carry / name, out / target)
    _drop_placeholder_lm(carry / "codec")
    _drop_finished_codec_log(carry)
    _drop_codes_for_fresh(carry, summary["plan"]["lm_fresh_hours"])
    summary["parts"] = [p.name for p in state_shards.split_dir(carry, out, PARTS_PREFIX)]
    summary["minutes"] = round((time.monotonic() - start) / 60, 2)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m breezert_train.pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", help="scratch folder on the GPU machine")
    p.add_argument("--minutes-total", type=float, help="wall time of this call")
    p.add_argument("--out", help="where the state parts and logs go ($OUT)")
    p.add_argument("--carry-in", default=None, help="folder holding the last call's parts")
    p.add_argument("--export-codec", metavar="DIR", default=None,
                   help="instead of a call: write the codec that --carry-in's parts hold to DIR "
                        "in the released layout (export_carried_codec), then stop")
    p.add_argument("--export-voice", metavar="DIR", default=None,
                   help="instead of a call: write the voice that --carry-in's parts hold to DIR "
                        "(export_carried_voice; runtime/breezert/voices/default installs it as "
                        "the default voice), then stop")
    p.add_argument("--restate", action="store_true",
                   help="instead of a call: pack --carry-in's parts again, in place, in the "
                        "form this plan's calls leave (restate), then stop")
    defaults = Plan()
    names = ("hours", "workers", "codec_minutes", "codec_preset", "codec_recipe",
             "codec_batch_size", "codec_latent_mel_weight", "codec_autocast_bf16", "lm_recipe",
             "lm_fresh_hours",
             "reserve_minutes", "wer_workers", "wer_every_min", "wer_label", "wer_goal",
             "wer_min_gain", "wer_window_min", "wer_drain_s", "device")
    for name in names:
        add_default_flag(p, name, getattr(defaults, name))
    args = p.parse_args(argv)
    plan = replace(defaults, **{k: getattr(args, k) for k in names})
    # the verbs that read --carry-in's parts instead of making a call
    verbs = {"restate": lambda parts, scratch: "\n".join(
                 f"{path} ({path.stat().st_size} bytes)" for path in restate(parts, scratch, plan)),
             "export_voice": lambda parts, scratch: export_carried_voice(
                 parts, args.export_voice, scratch),
             "export_codec": lambda parts, scratch: export_carried_codec(
                 parts, args.export_codec, scratch)}
    for verb, run in verbs.items():
        if getattr(args, verb):
            if not args.carry_in:
                p.error(f"--{verb.replace('_', '-')} needs --carry-in (the parts to read)")
            with tempfile.TemporaryDirectory() as scratch:
                print(run(args.carry_in, scratch))
            return
    missing = [flag for flag, value in (("--work", args.work), ("--out", args.out),
                                        ("--minutes-total", args.minutes_total)) if value is None]
    if missing:
        p.error(f"a call needs {', '.join(missing)}")
    if plan.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    print(json.dumps(run_pipeline(args.work, args.minutes_total, args.out, args.carry_in, plan),
                     indent=1))


if __name__ == "__main__":
    main()
