"""The in-run WER: the rule, the dev set, the scorer's language model in pocketsphinx, and the
pipeline acting on the verdicts (a codec whose WER meets its goal is finished early; a stalled
recipe ends the call and the next call of the same label trains nothing).

Owns CPU-only checks of ``breezert_train.run_wer`` and its use in ``pipeline``; the pipeline
runs use a scorer thread, a tone teacher and a transcriber that knows the teacher's clips, so
they need neither hibari nor a trained voice. Must not: need a GPU.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from breezert_train import run_wer
from breezert_train.run_wer import CODEC, TEACHER, VOICE, WerRule, decide

from tests.unit.test_lm_train import TINY_OVERRIDES, _tiny_plan, _tone_teacher

pytestmark = pytest.mark.unit


def _point(subject: str, minutes: float, wer: float, recipe: str = "r2") -> dict:
    return {"subject": subject, "minutes": minutes, "mean_wer": wer, "recipe": recipe}


def test_the_rule_continues_stops_and_changes() -> None:
    rule = WerRule(goal=0.05, min_gain=0.03, window_min=6.0, min_scores=3)
    teacher = _point(TEACHER, 0, 0.20, None)
    assert decide([], CODEC, rule)["verdict"] == "continue"
    assert decide([teacher, _point(CODEC, 2, 0.24)], CODEC, rule)["verdict"] == "stop"
    falling = [teacher] + [_point(CODEC, m, w) for m, w in ((2, .8), (4, .7), (6, .6), (8, .5))]
    assert decide(falling[:3], CODEC, rule)["verdict"] == "continue"  # 2 of 3 scores
    assert decide(falling, CODEC, rule)["verdict"] == "continue"  # 0.5 vs 0.8 before
    flat = falling + [_point(CODEC, m, w) for m, w in ((10, .49), (12, .48), (14, .5), (16, .49))]
    verdict = decide(flat, CODEC, rule)  # minutes 10-16: best 0.48; before: 0.5 -> gain 0.02
    assert verdict["verdict"] == "change" and "0.480" in verdict["reason"]
    assert decide(flat, CODEC, rule, recipe="r3")["verdict"] == "continue"  # a new segment
    assert decide(flat, VOICE, rule)["verdict"] == "continue"  # another stage


def test_the_dev_set_is_fixed_held_out_and_bounded() -> None:
    heldout = [(i, " ".join(["word"] * n)) for i, n in enumerate([3, 8, 30, 6, 16, 17] * 10)]
    dev = run_wer.dev_sentences(heldout, num=20)
    assert len(dev) == 20 and dev == run_wer.dev_sentences(heldout, num=20)
    assert all(6 <= len(d.text.split()) <= 16 for d in dev)
    assert [d.sentence_id for d in dev[:3]] == ["heldout-1", "heldout-3", "heldout-4"]
    with pytest.raises(ValueError, match="fewer than 40"):
        run_wer.dev_sentences(heldout, num=40)
    mixed = [(0, "a b c d e yak"), (1, "a b c d e f"), (2, "a b c d zebra yak"),
             (3, "f e d c b a")]
    assert [d.sentence_id for d in run_wer.dev_sentences(mixed, 3, set("abcdef"))] == [
        "heldout-1", "heldout-3", "heldout-0"]  # no word outside the vocabulary first
    assert {"cat", "the"} <= run_wer.lm_vocabulary(["The cat, qzxv."]) <= {"cat", "the", "qzxv"}


def test_the_language_model_is_built_from_normalised_texts(tmp_path: Path) -> None:
    """(tests/integration/test_asr_gate.py decodes the teacher's speech with such a model.)"""
    texts = ["The cat sat on the mat.", "A dog ran far, and so it goes.", "The 3rd cat ran."]
    body = run_wer.build_lm(texts, tmp_path / "dev.arpa").read_text()
    assert "\\3-grams:" in body and " the cat sat" in body and "third" in body
    assert "The" not in body and "3rd" not in body
    with pytest.raises(ValueError, match="no words"):
        run_wer.build_lm(["...", ""], tmp_path / "none.arpa")


# ------------------------------------------------------------------------------- the pipeline
DEV = [run_wer.DevSentence("heldout-1", "the cat sat"), run_wer.DevSentence("heldout-2", "a dog ran")]
"""Short: the random tiny voice synthesises up to twice the length rule."""


class _ToneTeacher:
    def synthesize(self, text: str, seed: int):  # noqa: ANN201
        n = 1920 * 3 + 16 * seed  # each sentence its own length: the transcriber's key
        audio = (4000 * np.sin(np.arange(n) * 0.03 * (seed + 1))).astype(np.int16)
        return type("Out", (), {"audio": audio})()


class _Ears:
    """Hears the teacher's clips perfectly, anything else perfectly (``other_is_right``) or as
    nothing. With the scorer's one thread, a score's sentences come in dev-set order."""

    def __init__(self, other_is_right: bool) -> None:
        self.other_is_right, self.calls = other_is_right, 0

    def __call__(self, lm: str | None) -> _Ears:
        return self

    def transcribe(self, pcm: np.ndarray, rate: int) -> str:
        index, self.calls = self.calls % len(DEV), self.calls + 1
        teacher = _ToneTeacher().synthesize("", index).audio.astype(np.float32) / 32768.0
        if self.other_is_right or np.array_equal(pcm, teacher):
            return DEV[index].text
        return ""


def _make_wer(other_is_right: bool):  # noqa: ANN202
    def make(work: Path, plan, teacher: bool) -> run_wer.InRunWer:  # noqa: ANN001
        return run_wer.InRunWer(work / "wer", work / "carry" / run_wer.CURVE_FILE, DEV,
                                None, workers=0, rule=plan.rule, recipe=plan.label,
                                teacher_factory=_ToneTeacher,
                                transcriber_factory=_Ears(other_is_right), teacher=teacher)
    return make


def _teacher(out: Path, plan) -> None:  # noqa: ANN001
    _tone_teacher(out)


def test_a_codec_at_its_goal_is_finished_early_and_the_voice_is_scored(tmp_path: Path) -> None:
    from breezert_train.pipeline import run_pipeline

    plan = _tiny_plan(codec_minutes=30, codec_max_steps=60, lm_max_steps=4, wer_every_min=0.0,
                      wer_drain_s=30)
    summary = run_pipeline(tmp_path / "w", 5, tmp_path / "out", plan=plan, make_teacher=_teacher,
                           make_wer=_make_wer(other_is_right=True), **TINY_OVERRIDES)
    assert summary["wer"]["codec"]["verdict"] == "stop"
    assert summary["stages"][1]["codec_finished"] is True
    steps = [json.loads(x)["step"] for x in
             (tmp_path / "out" / "codec_log.jsonl").read_text().splitlines()]
    assert len(steps) < 60  # the rule, not the step cap, ended the codec
    curve = run_wer.read_curve(tmp_path / "out" / run_wer.CURVE_FILE)
    assert curve[0]["subject"] == TEACHER and curve[0]["mean_wer"] == 0.0
    assert {r["subject"] for r in curve} == {TEACHER, CODEC, VOICE}
    assert all(r["recipe"] == "r2" for r in curve)
    assert summary["wer"]["voice"]["verdict"] == "stop" and summary["sample"]["frames"] >= 1
    # an LM-only call has no teacher: it scores the voice, the rule reads the carried teacher
    # score
    again = run_pipeline(tmp_path / "w2", 5, tmp_path / "out2", carry_in=tmp_path / "out",
                         plan=replace(plan, lm_max_steps=6), make_teacher=_teacher,
                         make_wer=_make_wer(other_is_right=True), **TINY_OVERRIDES)
    later = run_wer.read_curve(tmp_path / "out2" / run_wer.CURVE_FILE)
    new = [r["subject"] for r in later[len(curve):]]
    assert later[: len(curve)] == curve and new and set(new) == {VOICE}
    assert again["wer"]["voice"]["verdict"] == "stop"


def test_a_slim_wheel_drops_a_member_and_its_record_line(tmp_path: Path) -> None:
    import zipfile

    from breezert_train.slim_wheel import slim_wheel

    src = tmp_path / "pkg-1.0-py3-none-any.whl"
    record = "pkg/__init__.py,sha256=a,1\npkg/big.bin,sha256=b,9\npkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(src, "w") as z:
        z.writestr("pkg/__init__.py", "x = 1\n")
        z.writestr("pkg/big.bin", b"\0" * 9)
        z.writestr("pkg-1.0.dist-info/RECORD", record)
    out = slim_wheel(src, tmp_path / "slim", ["pkg/big.bin"])
    assert out.name == src.name
    with zipfile.ZipFile(out) as z:
        assert z.namelist() == ["pkg/__init__.py", "pkg-1.0.dist-info/RECORD"]
        assert "big.bin" not in z.read("pkg-1.0.dist-info/RECORD").decode()
    with pytest.raises(ValueError, match="no"):
        slim_wheel(src, tmp_path / "slim2", ["pkg/absent"])


def test_a_stalled_recipe_ends_the_call_and_the_next_one_trains_nothing(tmp_path: Path) -> None:
    """The codec's WER stays at 1.0: after 3 scores over more than the window the rule says
    ``change``; the state is packed; a second call of the same label stops before the teacher;
    a new label trains again."""
    from breezert_train.pipeline import run_pipeline

    plan = _tiny_plan(codec_minutes=30, codec_max_steps=80, wer_every_min=0.0,
                      wer_window_min=0.0001, wer_drain_s=30)
    first = run_pipeline(tmp_path / "w1", 5, tmp_path / "out1", plan=plan, make_teacher=_teacher,
                         make_wer=_make_wer(other_is_right=False), **TINY_OVERRIDES)
    assert first["wer"]["codec"]["verdict"] == "change"
    assert first["stages"][-1]["codec_finished"] is False and "sample" not in first
    curve = run_wer.read_curve(tmp_path / "out1" / run_wer.CURVE_FILE)
    codec = [r for r in curve if r["subject"] == CODEC]
    assert len(codec) >= 3 and all(r["mean_wer"] == 1.0 for r in codec)
    assert codec[-1]["decision"]["verdict"] == "change"

    def no_teacher(out: Path, plan) -> None:  # noqa: ANN001
        raise AssertionError("a stalled recipe's call must not make teacher data")

    second = run_pipeline(tmp_path / "w2", 5, tmp_path / "out2", carry_in=tmp_path / "out1",
                          plan=plan, make_teacher=no_teacher,
                          make_wer=_make_wer(other_is_right=False), **TINY_OVERRIDES)
    assert second["wer"]["codec_at_start"]["verdict"] == "change" and not second["stages"]
    third = run_pipeline(tmp_path / "w3", 5, tmp_path / "out3", carry_in=tmp_path / "out2",
                         plan=replace(plan, wer_label="r2-b", lm_max_steps=2,
                                      codec_max_steps=codec[-1]["step"] + 2),
                         make_teacher=_teacher,
                         make_wer=_make_wer(other_is_right=False), **TINY_OVERRIDES)
    assert third["wer"]["codec_at_start"]["verdict"] == "continue" and third["stages"]
    # or the codec stops where it stalled: a new label whose codec minutes are fewer than those
    # already trained exports the snapshot as it is (no further step) and trains the LM (the
    # call queued on 6 Dec: --codec-minutes 24 after 24.9 minutes)
    trained_s = first["stages"][-1]["codec_trained_s"]
    fourth = run_pipeline(tmp_path / "w4", 5, tmp_path / "out4", carry_in=tmp_path / "out2",
                          plan=replace(plan, wer_label="r2-lm", lm_max_steps=2,
                                       codec_minutes=trained_s / 120),
                          make_teacher=_teacher,
                          make_wer=_make_wer(other_is_right=False), **TINY_OVERRIDES)
    assert fourth["wer"]["codec_at_start"]["verdict"] == "continue"
    assert fourth["stages"][1]["codec_finished"] is True
    log = "codec_log.jsonl"
    assert ((tmp_path / "out4" / log).read_text().splitlines()
            == (tmp_path / "out1" / log).read_text().splitlines())  # not a step more
    assert "lm_done_min" in fourth["stages"][-1] and fourth["sample"]["frames"] >= 1
