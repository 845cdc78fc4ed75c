"""LM training at the tiny size on CPU: serving equivalence, learning, resume, EOS, export, CLI.

Owns CPU-only checks of ``breezert_train.lm_data``, ``lm_forward`` and ``lm_train`` on synthetic
codes (a deterministic function of the text, so held-out utterances are predictable) and, for the
command line, synthetic teacher shards encoded by a tiny random codec. Must not: need a GPU, the
teacher or downloaded data.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
from breezert.constants import FRAME_EOS_ID, NUM_CODEBOOKS
from breezert.layers.attention import DenseKVCache
from breezert.loader import load_checkpoint
from breezert.models.generate import generate_frames
from breezert.options import SamplingParams
from breezert_train import lm_train
from breezert_train.checkpoint import LOG_FILE, STATE_FILE
from breezert_train.lm_data import (
    BatchStream,
    byte_tokenizer,
    encode_batch,
    make_utterance,
    pack_codes,
    unpack_codes,
)
from breezert_train.lm_forward import Layout, _prior, teacher_forced
from breezert_train.lm_train import (
    FP8,
    FP8_TENSORS,
    SNAPSHOT_FILE,
    LMTrainConfig,
    LMTrainer,
    export_checkpoint,
    plain_state,
    save_snapshot,
    train,
)

if TYPE_CHECKING:
    from breezert_train.pipeline import Plan

pytestmark = pytest.mark.unit

TOK = byte_tokenizer()
WORDS = ("the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "and", "so", "it", "go")
GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.0, depth_temperature=0.0)
CFG = LMTrainConfig(warmup_steps=5, schedule_steps=200, max_tokens=512)


def _codes(text: str) -> torch.Tensor:
    """One frame per character: code k of a character is a fixed function of it."""
    return torch.tensor([[(ord(c) * 37 + 131 * k) % 2048 for k in range(NUM_CODEBOOKS)]
                         for c in text])


def _utterances(n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 5))))
        out.append(make_utterance(TOK, seed * 1000 + i, text, _codes(text)))
    return out


def test_codes_pack_in_11_bits_and_round_trip() -> None:
    codes = np.random.default_rng(0).integers(0, 2048, size=(37, 16))
    packed = pack_codes(codes)
    assert packed.nbytes == -(-37 * 16 * 11 // 8)
    assert (unpack_codes(packed, codes.size).reshape(codes.shape) == codes).all()
    with pytest.raises(ValueError, match="2048"):
        pack_codes(np.array([2048]))


def test_teacher_forced_logits_equal_the_serving_path() -> None:
    """Two utterances of different lengths in one padded batch give, row for row, the logits
    that serving's step-by-step backbone (DenseKVCache) and depth loop give."""
    model = LMTrainer(CFG).model.eval()
    batch = [make_utterance(TOK, 1, "on a mat", _codes("on a mat")),
             make_utterance(TOK, 2, "go", _codes("go"))]
    with torch.no_grad():
        out = teacher_forced(model, batch, (), 0.2)
    row = 0
    for utt in batch:
        bb = model.cfg.backbone
        kv = DenseKVCache(bb.num_layers, bb.num_kv_heads, bb.head_dim)
        seq = kv.add_sequence()
        with torch.no_grad():
            embeds = model.prompt_embeds(utt.prompt)
            h = model.backbone_model(embeds, kv.begin_step([seq], [len(embeds)]), kv)[-1:]
            for t, frame in enumerate(utt.codes):
                ref = model.first_code_logits(h)[0]
                torch.testing.assert_close(out.code0_logits[row + t], ref, atol=1e-4, rtol=1e-4)
                depth = model.depth_decoder
                cache = depth.new_cache(1)
                depth.step(h, 0, cache)
                for j in range(1, NUM_CODEBOOKS):
                    x = depth.embed_code(frame[j - 1 : j], j - 1)
                    ref_j = depth.logits(depth.step(x, j, cache), j)[0]
                    frame_row = int((~out.is_eos_row[:row + t]).sum())
                    torch.testing.assert_close(out.depth_logits[frame_row, j - 1], ref_j,
                                               atol=1e-4, rtol=1e-4)
                h = model.backbone_model(model.audio_frame_embeds(frame[None]),
                                         kv.begin_step([seq], [1]), kv)
            eos_row = row + len(utt.codes)
            torch.testing.assert_close(out.code0_logits[eos_row], model.first_code_logits(h)[0],
                                       atol=1e-4, rtol=1e-4)
        assert int(out.code0_targets[eos_row]) == FRAME_EOS_ID and bool(out.is_eos_row[eos_row])
        row = eos_row + 1
    assert row == out.code0_logits.shape[0]


def test_guided_prior_is_zero_on_the_diagonal_and_near_one_far_from_it() -> None:
    lay = Layout(torch.tensor([11]), torch.tensor([20]), 31)
    weight, key_ok, row_ok = _prior(lay, 11, 0.2, torch.device("cpu"))
    # row 10 + t predicts frame t (t = 20 is EOS): t = 10 is halfway, key 5 is halfway.
    assert float(weight[0, 0, 20, 5]) == pytest.approx(0.0, abs=1e-6)
    assert float(weight[0, 0, 10, 10]) > 0.99  # frame 0 reading the last prompt position
    assert row_ok[0, 0, :10].sum() == 0 and row_ok[0, 0, 10:].sum() == 21
    assert bool(key_ok.all())


def test_a_few_steps_lower_the_held_out_loss() -> None:
    train_items, heldout = _utterances(48, seed=1), _utterances(8, seed=2)
    trainer = LMTrainer(CFG)
    before = trainer.evaluate(heldout)
    stream = BatchStream(train_items, CFG.max_tokens, CFG.seed)
    for _ in range(40):
        trainer.train_step(stream.next())
    after = trainer.evaluate(heldout)
    # Random weights score about ln(2052) = 7.6 nats; 40 steps must take 2 nats off code 0
    # (end of speech included) and off the depth codes of unseen texts.
    assert before["eval_code0"] > 7.0 and before["eval_depth"] > 7.0
    assert after["eval_code0"] < before["eval_code0"] - 2.0, (before, after)
    assert after["eval_depth"] < before["eval_depth"] - 2.0, (before, after)


def _log_steps(path: Path) -> list[dict]:
    """The step records (each run's closing held-out score is left out) without times."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "time_s"} for r in rows if "run_end" not in r]


def test_resume_after_a_kill_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    items, heldout = _utterances(24, seed=3), _utterances(3, seed=4)
    cfg = LMTrainConfig(warmup_steps=2, schedule_steps=8, max_tokens=256, fp8_tables=True)
    kw = dict(save_every=3, eval_every=4)
    whole = train(items, heldout, tmp_path / "a", cfg, minutes=5, max_steps=8, **kw)
    b = tmp_path / "b"
    train(items, heldout, b, cfg, minutes=5, max_steps=3, **kw)
    saved = (b / STATE_FILE).read_bytes()
    train(items, heldout, b, cfg, minutes=5, max_steps=5, **kw)  # steps 4-5 logged, then "killed"
    (b / STATE_FILE).write_bytes(saved)  # ... before their save: the step-3 save is the last
    resumed = train(items, heldout, b, cfg, minutes=5, max_steps=8, **kw)
    assert resumed.step == whole.step == 8
    for (name, x), (_, y) in zip(plain_state(whole.model).items(),
                                 plain_state(resumed.model).items(), strict=True):
        assert torch.equal(x, y), name
    steps = _log_steps(tmp_path / "a" / LOG_FILE)
    assert [r["step"] for r in steps] == list(range(1, 9)) and "eval_code0" in steps[3]
    assert _log_steps(b / LOG_FILE) == steps


def test_a_carry_snapshot_resumes_with_bf16_weights_and_a_fresh_optimizer(tmp_path: Path) -> None:
    items = _utterances(12, seed=5)
    trainer = train(items, [], tmp_path / "run", CFG, minutes=5, max_steps=3)
    stream = BatchStream(items, CFG.max_tokens, CFG.seed)
    stream.load_state_dict(torch.load(tmp_path / "run" / STATE_FILE)["data"])
    carry = tmp_path / "carry"
    carry.mkdir()
    save_snapshot(trainer, stream, carry / SNAPSHOT_FILE)
    state_bytes = (tmp_path / "run" / STATE_FILE).stat().st_size
    assert (carry / SNAPSHOT_FILE).stat().st_size < state_bytes / 10  # no moments, sparse text
    resumed = LMTrainer(CFG)
    assert lm_train.resume(resumed, BatchStream(items, CFG.max_tokens, CFG.seed), carry)
    assert resumed.step == resumed.reset_step == 3 and not resumed.opt.state
    # the audio table comes back as the rows the codes read, the others zero
    used = lm_train.audio_rows_used(items, NUM_CODEBOOKS, trainer.model.cfg.depth.vocab_size)
    for (name, x), (_, y) in zip(plain_state(trainer.model).items(),
                                 plain_state(resumed.model).items(), strict=True):
        if name == lm_train.AUDIO_TABLE:
            x = torch.zeros_like(x).index_copy_(0, used, x[used])
        torch.testing.assert_close(y, x.bfloat16().float(), atol=0, rtol=0, msg=name)
    assert resumed.lr() < trainer.lr() / 10  # re-warmup after the optimiser restart
    again = train(items, [], carry, CFG, minutes=5, max_steps=5)
    assert again.step == 5


def test_a_carry_snapshot_resumes_on_a_card_of_another_batch_size() -> None:
    """The next call's card may fit another batch (``fit_batch_to_card``: 32,768 positions on
    an H100, 65,536 on an H200): a carry snapshot loads across ``max_tokens``, not across the
    run's other settings."""
    trainer = LMTrainer(CFG)
    snap = trainer.snapshot()
    LMTrainer(replace(CFG, max_tokens=CFG.max_tokens * 2)).load_snapshot(snap)
    with pytest.raises(ValueError, match="learning_rate"):
        LMTrainer(replace(CFG, learning_rate=CFG.learning_rate / 2)).load_snapshot(snap)


def test_end_of_speech_comes_on_time_after_overfitting_two_utterances() -> None:
    batch = [make_utterance(TOK, 1, "the cat sat", _codes("the cat sat")[:6]),
             make_utterance(TOK, 2, "a dog ran far", _codes("a dog ran far")[:10])]
    cfg = LMTrainConfig(warmup_steps=10, schedule_steps=150, learning_rate=3e-3)
    trainer = LMTrainer(cfg)
    for _ in range(150):
        record = trainer.train_step(batch)
    assert record["eos"] < 0.1, record
    model = trainer.model.eval()
    for utt in batch:
        frames = list(generate_frames(model, utt.prompt, GREEDY, max_frames=40))
        assert abs(len(frames) - len(utt.codes)) <= 1, (utt.text, len(frames))
        got = torch.stack(frames[: len(utt.codes)])
        assert (got == utt.codes[: len(got)]).float().mean() > 0.9


# ------------------------------------------------------------------------------- with a codec
@pytest.fixture(scope="module")
def codec_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from breezert_train.codec_train import CodecTrainConfig, CodecTrainer
    from breezert_train.codec_train import export_checkpoint as export_codec

    root = tmp_path_factory.mktemp("codec")
    return export_codec(CodecTrainer(CodecTrainConfig()), root / "ckpt")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from breezert_train.shards import ShardWriter

    root = tmp_path_factory.mktemp("teacher")
    rng = np.random.default_rng(0)
    writer = ShardWriter(root, max_bytes=80_000)
    for i in range(12):
        text = " ".join(rng.choice(WORDS, size=3))
        audio = (3000 * rng.standard_normal(int(rng.integers(4000, 12000)))).astype(np.int16)
        writer.add(i, "test", text, "", audio, np.zeros(1, np.int16), np.ones(1, np.int16))
    writer.flush()
    assert len(list(root.glob("shard-*.npz"))) >= 2
    return root


def test_batched_encoding_equals_one_clip_at_a_time(codec_dir: Path) -> None:
    encoder = load_checkpoint(codec_dir).codec_encoder
    rng = np.random.default_rng(1)
    clips = [(3000 * rng.standard_normal(n)).astype(np.int16) for n in (1920 * 3, 5000, 100)]
    batched = encode_batch(encoder, clips, torch.device("cpu"))
    for clip, codes in zip(clips, batched, strict=True):
        assert codes.shape == (-(-len(clip) // 1920), NUM_CODEBOOKS)
        assert (encode_batch(encoder, [clip], torch.device("cpu"))[0] == codes).all()


def test_export_loads_stores_fp8_tables_and_serves(tmp_path: Path, codec_dir: Path) -> None:
    from safetensors import safe_open

    cfg = LMTrainConfig(fp8_tables=True, warmup_steps=1)
    trainer = LMTrainer(cfg)
    trainer.train_step(_utterances(4, seed=6))
    root = export_checkpoint(trainer, codec_dir, tmp_path / "voice")
    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    for name in FP8_TENSORS:
        with safe_open(str(root / index[name]), "pt") as f:
            stored = f.get_tensor(name)
        assert stored.dtype == FP8
        master = plain_state(trainer.model)[name].detach()
        assert torch.equal(stored.float(), master.clamp(-448, 448).to(FP8).float())
    ckpt = load_checkpoint(root)
    assert ckpt.config.backbone.hidden_size == 64 and ckpt.codec_encoder is not None
    codec_file = codec_dir / "audio_tokenizer" / "model.safetensors"
    assert (root / "audio_tokenizer" / "model.safetensors").read_bytes() == codec_file.read_bytes()
    from breezert.cli import main as cli_main

    wav = tmp_path / "out.wav"
    assert cli_main(["synth", "--model", str(root), "--text", "the cat", "--out", str(wav),
                     "--max-frames", "4", "--ignore-eos"]) == 0
    import wave

    with wave.open(str(wav)) as f:
        assert f.getnframes() == 4 * 1920


def test_command_line_encodes_once_trains_resumes_and_exports(
    tmp_path: Path, codec_dir: Path, teacher_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, voice = tmp_path / "lm", tmp_path / "voice"
    def argv(max_steps: int) -> list[str]:
        return ["--data", str(teacher_dir), "--codec", str(codec_dir), "--out", str(out),
                "--minutes", "5", "--max-steps", str(max_steps), "--max-tokens", "256",
                "--device", "cpu"]

    lm_train.main(argv(2))
    cached = sorted((out / "codes").glob("codes-*.npz"))
    assert len(cached) == len(list(teacher_dir.glob("shard-*.npz")))
    mtimes = [p.stat().st_mtime_ns for p in cached]
    lm_train.main(argv(4) + ["--export", str(voice)])
    assert [p.stat().st_mtime_ns for p in cached] == mtimes  # not encoded again
    assert [r["step"] for r in _log_steps(out / LOG_FILE)] == [1, 2, 3, 4]
    printed = capsys.readouterr().out
    assert "parameters" in printed and "MB on disk" in printed
    assert load_checkpoint(voice).config.codec == load_checkpoint(codec_dir).config.codec
    shutil.rmtree(out / "codes")


def _tone_teacher(out: Path, ids: range = range(1, 7)) -> None:
    """Stands in for the teacher: tone clips with texts (six, ids 1..6), as one shard in
    ``out``."""
    from breezert_train.shards import ShardWriter

    out.mkdir(parents=True)
    writer = ShardWriter(out, max_bytes=1 << 20)
    for i, utt in zip(ids, _utterances(len(ids), seed=6 + ids.start), strict=True):
        audio = (3000 * np.sin(np.arange(1920 * len(utt.codes)) * 0.05 * i))
        writer.add(i, "test", utt.text, "", audio.astype(np.int16),
                   np.zeros(1, np.int16), np.ones(1, np.int16))
    writer.flush()


def _tiny_plan(**changes: Any) -> Plan:
    """The pipeline tests' plan: tiny codec and LM on the CPU, no reserve, a 6-frame sample."""
    from breezert_train.pipeline import Plan

    return replace(Plan(codec_preset="tiny", codec_batch_size=2, codec_crop_frames=4,
                        lm_recipe="tiny", device="cpu", reserve_minutes=0.0,
                        sample_max_frames=6), **changes)


TINY_OVERRIDES = dict(codec_overrides={"disc_channels": 4}, lm_overrides={"max_tokens": 256})
"""``run_pipeline`` keywords of the pipeline tests: a narrow discriminator, short LM batches."""


@pytest.mark.parametrize("fp8_tables", [False, True])
def test_the_carry_snapshot_keeps_only_the_audio_rows_the_codes_read(
        tmp_path: Path, fp8_tables: bool) -> None:
    """With codebooks 4..15 held at one code (recipe 2's codec), the carried snapshot keeps all
    rows of codebooks 0..3 and one row of each other codebook; resumed, the LM scores every
    utterance exactly as one resumed from the whole table (no lookup reads a dropped row), and
    the dropped rows load as zeros."""
    def constant_tail(items: list) -> list:
        out = []
        for u in items:
            codes = u.codes.clone()
            codes[:, 4:] = 7
            out.append(make_utterance(TOK, u.utterance_id, u.text, codes))
        return out

    items = constant_tail(_utterances(24, seed=11))
    cfg = replace(CFG, fp8_tables=fp8_tables)
    trainer = train(items, [], tmp_path / "run", cfg, minutes=5, max_steps=3)
    stream = BatchStream(items, cfg.max_tokens, cfg.seed)
    vocab = trainer.model.cfg.depth.vocab_size
    rows = lm_train.audio_rows_used(items, NUM_CODEBOOKS, vocab)
    seen0 = {int(c) for u in items for c in u.codes[:, 0]}
    assert len(rows) == sum(len({int(c) for u in items for c in u.codes[:, k]})
                            for k in range(4)) + 12
    assert len(seen0) <= len(rows) < 4 * vocab
    save_snapshot(trainer, stream, tmp_path / "slim.pt")
    torch.save({**trainer.snapshot(), "data": stream.state_dict()}, tmp_path / "whole.pt")
    slim = torch.load(tmp_path / "slim.pt", weights_only=False)
    assert lm_train.AUDIO_TABLE not in slim["weights"] and len(slim["audio_rows"]) == len(rows)
    assert (tmp_path / "slim.pt").stat().st_size < (tmp_path / "whole.pt").stat().st_size
    scores = []
    for name in ("slim.pt", "whole.pt"):
        resumed = LMTrainer(cfg)
        resumed.load_snapshot(torch.load(tmp_path / name, weights_only=False))
        scores.append(resumed.evaluate(items))
        table = plain_state(resumed.model)[lm_train.AUDIO_TABLE]
        dropped = torch.ones(table.shape[0], dtype=torch.bool)
        dropped[rows] = False
        assert bool(table[dropped].any()) == (name == "whole.pt")
    assert scores[0] == scores[1]


def test_the_pipeline_carries_its_state_to_a_second_call(tmp_path: Path) -> None:
    """Call 1 makes data, trains codec and LM, packs; call 2, on a fresh work folder with only
    the parts, makes no data, keeps the codec and goes on with the LM from its snapshot."""
    from breezert_train.pipeline import run_pipeline

    def make_teacher(out: Path, plan: Plan) -> None:
        _tone_teacher(out)

    def no_teacher(out: Path, plan: Plan) -> None:
        raise AssertionError("the second call must not need the teacher")

    plan = _tiny_plan(codec_max_steps=2, lm_max_steps=3)
    first = run_pipeline(tmp_path / "w1", 5, tmp_path / "out1", plan=plan,
                         make_teacher=make_teacher, **TINY_OVERRIDES)
    assert all((tmp_path / "out1" / n).stat().st_size <= 16 * 1024 * 1024 for n in first["parts"])
    assert len(list((tmp_path / "out1").iterdir())) <= 8  # what one device call returns
    from breezert_train.state_shards import join_dir

    carried = {p.name for p in join_dir(tmp_path / "out1", tmp_path / "joined").rglob("*")}
    assert {"snapshot.pt", "config.json"} <= carried
    # the finished codec's log comes back beside the parts, not in them (the 64 MiB carry)
    assert "codec_log.jsonl" not in carried and (tmp_path / "out1" / "codec_log.jsonl").is_file()
    assert "state.pt" not in carried  # the full optimiser state stays on the machine
    # the codec export's random placeholder LM is rebuilt after the carry-in, not carried
    assert not any(name.startswith("model") for name in carried - {"model.safetensors"})
    second = run_pipeline(tmp_path / "w2", 5, tmp_path / "out2", carry_in=tmp_path / "out1",
                          plan=replace(plan, lm_max_steps=5), make_teacher=no_teacher,
                          **TINY_OVERRIDES)
    assert second["sample"]["frames"] >= 1
    steps = [r["step"] for r in _log_steps(tmp_path / "out2" / "lm_log.jsonl")]
    assert steps == [1, 2, 3, 4, 5]
    codec = "carry/codec/audio_tokenizer/model.safetensors"
    assert (tmp_path / "w1" / codec).read_bytes() == (tmp_path / "w2" / codec).read_bytes()
    assert load_checkpoint(tmp_path / "w2" / "voice").config.backbone.hidden_size == 64
    # the voice the parts carry, exported here (where a session installs the default voice)
    from breezert_train.pipeline import main as pipeline_main

    pipeline_main(["--carry-in", str(tmp_path / "out2"), "--export-voice",
                   str(tmp_path / "default")])
    for name in ("model-00001-of-00001.safetensors", "audio_tokenizer/model.safetensors"):
        assert ((tmp_path / "default" / name).read_bytes()
                == (tmp_path / "w2" / "voice" / name).read_bytes())


def test_an_lm_call_trains_on_fresh_teacher_hours_after_the_last_calls(tmp_path: Path) -> None:
    """``Plan.lm_fresh_hours``: each LM call synthesises the corpus's next utterances (after the
    carried codes' last id, then after the last call's), encodes and trains on them beside the
    carried codes; the state then carries where they ended instead of the codes. ``restate``
    packs an older state so: the LM snapshot's audio table cut, the marker, no codes."""
    from breezert_train.pipeline import FRESH_FILE, restate, run_pipeline
    from breezert_train.state_shards import join_dir

    asked: list[int] = []

    def make_fresh(out: Path, plan: Plan, after_id: int) -> int:
        asked.append(after_id)
        _tone_teacher(out, range(after_id + 1, after_id + 4))
        return after_id + 3

    plan = _tiny_plan(codec_max_steps=2, lm_max_steps=2)
    first = run_pipeline(tmp_path / "w1", 5, tmp_path / "out1", plan=plan,
                         make_teacher=lambda out, plan: _tone_teacher(out),
                         make_fresh=make_fresh, **TINY_OVERRIDES)
    assert asked == [] and not any("fresh_last_id" in s for s in first["stages"])  # 0 h: none
    fresh_plan = replace(plan, lm_fresh_hours=0.01, lm_max_steps=4)
    for call, after in ((2, 6), (3, 9)):  # the carried codes end at id 6
        summary = run_pipeline(tmp_path / f"w{call}", 5, tmp_path / f"out{call}",
                               carry_in=tmp_path / f"out{call - 1}", plan=fresh_plan,
                               make_fresh=make_fresh, **TINY_OVERRIDES)
        stage = next(s for s in summary["stages"] if "fresh_last_id" in s)
        assert (stage["fresh_after_id"], stage["fresh_last_id"], stage["fresh_utterances"]) == (
            after, after + 3, 3)
        carried = join_dir(tmp_path / f"out{call}", tmp_path / f"joined{call}")
        assert json.loads((carried / "lm" / FRESH_FILE).read_text()) == {"after_id": after + 3}
        assert not (carried / "codes").exists() and not (carried / "fresh_codes").exists()
    assert asked == [6, 9]
    with pytest.raises(ValueError, match="--lm-fresh-hours"):  # no codes and none made
        run_pipeline(tmp_path / "w4", 5, tmp_path / "out4", carry_in=tmp_path / "out3",
                     plan=plan, make_fresh=make_fresh, **TINY_OVERRIDES)
    # the first call's state, restated for fresh hours: what call 2 would have carried in
    shutil.copytree(tmp_path / "out1", tmp_path / "restated")
    restate(tmp_path / "restated", tmp_path / "scratch", fresh_plan)
    again = join_dir(tmp_path / "restated", tmp_path / "joined-restated")
    assert json.loads((again / "lm" / FRESH_FILE).read_text()) == {"after_id": 6}
    assert not (again / "codes").exists()
    snap = torch.load(again / "lm" / SNAPSHOT_FILE, weights_only=False)
    assert lm_train.AUDIO_TABLE not in snap["weights"] and len(snap["audio_rows"]) > 0


def test_the_codec_trains_over_several_calls_before_the_lm(tmp_path: Path) -> None:
    """A call that cannot finish the codec's minutes trains the codec only and carries its
    snapshot (no export, no LM); the next call makes the teacher data again, goes on from the
    snapshot's step, finishes the codec and trains the LM."""
    from breezert_train.pipeline import CODEC_DONE, CODEC_SNAPSHOT, run_pipeline
    from breezert_train.state_shards import join_dir

    teacher_calls = []

    def make_teacher(out: Path, plan: Plan) -> None:
        teacher_calls.append(out)
        _tone_teacher(out)

    plan = _tiny_plan(codec_minutes=0.04, lm_max_steps=3)
    first = run_pipeline(tmp_path / "w1", 0.01, tmp_path / "out1", plan=plan,
                         make_teacher=make_teacher, **TINY_OVERRIDES)
    assert first["stages"][-1]["codec_finished"] is False and "sample" not in first
    carried = {p.relative_to(tmp_path / "j1").parts[0]
               for p in join_dir(tmp_path / "out1", tmp_path / "j1").rglob("*")}
    assert CODEC_SNAPSHOT in carried and not carried & {"codec", "lm", "codes", CODEC_DONE}
    steps1 = [r["step"] for r in _log_steps(tmp_path / "out1" / "codec_log.jsonl")]
    assert steps1 and steps1 == list(range(1, len(steps1) + 1))
    second = run_pipeline(tmp_path / "w2", 5, tmp_path / "out2", carry_in=tmp_path / "out1",
                          plan=plan, make_teacher=make_teacher, **TINY_OVERRIDES)
    assert len(teacher_calls) == 2
    assert second["stages"][1]["codec_finished"] is True
    assert second["stages"][1]["codec_trained_s"] >= 0.04 * 60 - 1.0
    steps2 = [r["step"] for r in _log_steps(tmp_path / "out2" / "codec_log.jsonl")]
    assert steps2[: len(steps1)] == steps1 and steps2 == list(range(1, len(steps2) + 1))
    assert len(steps2) > len(steps1)
    assert second["sample"]["frames"] >= 1
    assert (tmp_path / "w2" / "carry" / CODEC_DONE).is_file()
    # either call's codec, exported from its parts alone, loads; the finished one is the export
    # the LM trained on, byte for byte
    from breezert_train.pipeline import main as pipeline_main

    pipeline_main(["--carry-in", str(tmp_path / "out1"), "--export-codec",
                   str(tmp_path / "codec1")])
    unfinished = load_checkpoint(tmp_path / "codec1")
    codes = torch.randint(0, 2048, (1, 3, unfinished.codec.cfg.num_quantizers))
    wav, _ = unfinished.codec.step(codes, unfinished.codec.new_state(1))
    assert wav.shape[-1] == 3 * unfinished.codec.cfg.samples_per_frame and wav.abs().sum() > 0
    pipeline_main(["--carry-in", str(tmp_path / "out2"), "--export-codec",
                   str(tmp_path / "codec2")])
    codec = "audio_tokenizer/model.safetensors"
    assert ((tmp_path / "codec2" / codec).read_bytes()
            == (tmp_path / "w2" / "carry" / "codec" / codec).read_bytes())
    assert load_checkpoint(tmp_path / "codec2").codec_encoder is not None
    with pytest.raises(SystemExit):
        pipeline_main(["--export-codec", str(tmp_path / "codec3")])  # no parts named
    with pytest.raises(FileExistsError):  # never over an earlier export
        pipeline_main(["--carry-in", str(tmp_path / "out2"), "--export-codec",
                       str(tmp_path / "codec2")])
    assert not (tmp_path / "placeholder-lm").exists()


def test_the_pipeline_command_line_sets_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every plan flag reaches the plan; a bool is a --flag / --no-flag pair, not bool("False")."""
    import breezert_train.pipeline as pipeline

    plans = []
    monkeypatch.setattr(pipeline, "run_pipeline", lambda *a: plans.append(a[-1]) or {})
    base = ["--work", "w", "--minutes-total", "1", "--out", "o"]
    pipeline.main(base + ["--codec-autocast-bf16", "--codec-batch-size", "32",
                          "--codec-latent-mel-weight", "0"])
    pipeline.main(base + ["--no-codec-autocast-bf16"])
    assert (plans[0].codec_autocast_bf16, plans[0].codec_batch_size,
            plans[0].codec_latent_mel_weight) == (True, 32, 0.0)
    assert plans[1].codec_autocast_bf16 is False and plans[1].codec_batch_size == 16


def test_restate_packs_a_recipe_1_snapshot_slim_for_recipe_2(tmp_path: Path) -> None:
    """``--restate`` (what 4 Dec's committed snapshot went through): a recipe-1 codec snapshot
    with its discriminator becomes recipe 2's (no discriminator yet, no decoder codebook copies,
    4 codebooks), same weights otherwise, fewer bytes; a recipe-2 trainer goes on from its
    step."""
    from breezert_train.checkpoint import load_state
    from breezert_train.pipeline import CODEC_SNAPSHOT, main, run_pipeline
    from breezert_train.state_shards import join_dir

    recipe1 = _tiny_plan(codec_recipe=1, codec_minutes=5)  # a call of 0.01 min: unfinished
    overrides = {**TINY_OVERRIDES, "codec_overrides": {"disc_channels": 4, "disc_start_step": 1}}
    run_pipeline(tmp_path / "w1", 0.01, tmp_path / "parts", plan=recipe1,
                 make_teacher=lambda out, plan: _tone_teacher(out), **overrides)
    before = load_state(join_dir(tmp_path / "parts", tmp_path / "j1") / CODEC_SNAPSHOT)
    size = sum(p.stat().st_size for p in (tmp_path / "parts").glob("state.0*"))
    assert "disc" in before and before["config"]["active_codebooks"] == 16
    main(["--carry-in", str(tmp_path / "parts"), "--restate"])  # the snapshot's sizes kept
    after = load_state(join_dir(tmp_path / "parts", tmp_path / "j2") / CODEC_SNAPSHOT)
    assert "disc" not in after and after["config"]["active_codebooks"] == 4
    assert after["step"] == before["step"] >= 1
    assert torch.equal(after["data"]["generator"], before["data"]["generator"])
    assert all(torch.equal(before["decoder"][k], v) for k, v in after["decoder"].items())
    assert sum(p.stat().st_size for p in (tmp_path / "parts").glob("state.0*")) < size
    from breezert_train.codec_train import CodecTrainer, recipe_config

    trainer = CodecTrainer(recipe_config(2, preset="tiny", disc_channels=4))
    trainer.load_snapshot(after)  # what the next call's warm start does
    assert trainer.step == before["step"] and not trainer.disc_active


def test_the_shipped_voice_of_recipe_2_fits_40_mb(tmp_path: Path) -> None:
    """Issue 35's budget: the complete checkpoint the pipeline exports (the ``small`` LM with
    its fp8 tables, the ``small`` codec of recipe 2 in bf16 with its reference encoder; random
    weights, the same bytes as trained ones) is at most 40 MB."""
    from breezert_train.codec_train import CodecTrainer, recipe_config
    from breezert_train.codec_train import export_checkpoint as export_codec
    from breezert_train.lm_train import SMALL_GPU, folder_bytes

    codec = export_codec(CodecTrainer(recipe_config(2, preset="small")), tmp_path / "codec",
                         dtype=torch.bfloat16)
    voice = export_checkpoint(LMTrainer(SMALL_GPU), codec, tmp_path / "voice")
    assert folder_bytes(voice) <= 40_000_000, folder_bytes(voice)
    assert load_checkpoint(voice).config.codec.num_quantizers == NUM_CODEBOOKS


def test_frame_phonemes_follow_the_teacher_durations() -> None:
    from breezert_train.lm_data import frame_phonemes

    # ends at 1200, 3000 and 6000 samples; frame centres at 960, 2880, 4800 and 6720
    got = frame_phonemes(np.array([0, 7, 9]), np.array([2, 3, 5]), num_frames=4)
    assert got.tolist() == [0, 7, 9, 0]


def test_phoneme_heads_learn_travel_in_the_snapshot_and_stay_out_of_the_export(
        tmp_path: Path, codec_dir: Path, teacher_dir: Path) -> None:
    """The training-only heads: a few steps lower the frame phoneme loss and the CTC loss; the
    carry snapshot holds them; the export is the same model without them. The codes cache keeps
    each frame's phoneme from the shards (one per frame)."""
    from breezert_train.lm_data import encode_shards, load_utterances

    encode_shards(teacher_dir, codec_dir, tmp_path / "codes")
    cached = load_utterances(tmp_path / "codes")
    assert all(u.frame_phonemes is not None and len(u.frame_phonemes) == len(u.codes)
               for u in cached)

    def voiced(u):  # noqa: ANN001, ANN202 - phonemes a fixed function of the text
        chars = torch.tensor([ord(c) % 40 + 1 for c in u.text])
        return replace(u, frame_phonemes=chars, phonemes=chars[::2])

    items = [voiced(u) for u in _utterances(24, seed=5)]
    cfg = replace(CFG, phoneme_weight=1.0, phoneme_ctc_weight=1.0, learning_rate=5e-3)
    trainer = LMTrainer(cfg)
    stream = BatchStream(items, cfg.max_tokens, cfg.seed)
    first = trainer.train_step(stream.next())
    for _ in range(25):
        last = trainer.train_step(stream.next())
    assert last["phoneme_frame"] < first["phoneme_frame"] - 1.0, (first, last)
    assert last["phoneme_ctc"] < first["phoneme_ctc"], (first, last)
    snap = trainer.snapshot()
    again = LMTrainer(cfg)
    again.load_snapshot(snap)
    assert torch.equal(again.heads.frame.weight, trainer.heads.frame.weight.bfloat16().float())
    ckpt = load_checkpoint(export_checkpoint(trainer, codec_dir, tmp_path / "voice"))
    assert not any("phoneme" in k or "heads" in k for k in ckpt.model.state_dict())


def test_a_step_with_phonemes_gives_finite_figures() -> None:
    """The prompt rows' CTC (``breezert_train.ctc``) in a training step, one prompt shorter than
    its phonemes among the batch (it adds 0, and no NaN through the step's gradients)."""
    cfg = replace(CFG, phoneme_weight=1.0, phoneme_ctc_weight=1.0)
    trainer = LMTrainer(cfg)
    gen = torch.Generator().manual_seed(0)
    batch = [make_utterance(TOK, i, text, torch.randint(0, 2048, (6 + 2 * i, NUM_CODEBOOKS),
                                                        generator=gen),
                            torch.randint(0, 40, (6 + 2 * i,), generator=gen).numpy(),
                            torch.randint(1, 40, (num,), generator=gen).numpy())
             for i, (text, num) in enumerate((("the cat sat", 4), ("a dog ran far", 9),
                                              ("so", 200)))]
    with torch.no_grad():
        prompt_rows = [len(t) for t in trainer.model.prompt_embeds_many([u.prompt for u in batch])]
    assert prompt_rows[2] < 200 and all(n >= 9 for n in prompt_rows[:2]), prompt_rows
    for _ in range(2):
        figures = trainer.train_step(batch)
        assert all(np.isfinite(v) for v in figures.values()), figures
    assert figures["phoneme_ctc"] > 0


def test_the_gpu_batch_fits_the_card_it_runs_on() -> None:
    """SMALL_GPU's 65,536 padded positions were sized on an H200 (139 GiB); an H100 (79 GiB)
    ran out of memory at them, so it trains on the largest power of two below its share."""
    from breezert_train.lm_train import SMALL_GPU, fit_batch_to_card

    gib = 2**30
    assert fit_batch_to_card(SMALL_GPU, 139 * gib) == SMALL_GPU
    assert fit_batch_to_card(SMALL_GPU, 141 * gib) == SMALL_GPU  # never more than the recipe
    h100 = fit_batch_to_card(SMALL_GPU, 79 * gib)
    assert h100.max_tokens == 32768
    assert h100 == replace(SMALL_GPU, max_tokens=32768)  # nothing else changes
    assert fit_batch_to_card(SMALL_GPU, 1 * gib).max_tokens == 1024  # the floor
