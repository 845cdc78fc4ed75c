"""Issue 19's teacher data pipeline: text splitting, corpus, shards, resume, manifest, teacher.

A fake teacher (deterministic noise, length from the word count) keeps the pipeline tests fast;
one test runs the real hibari-tts teacher on two short sentences.
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import numpy as np
import pytest

from breezert_train import shards
from breezert_train import teacher_data as data
from breezert_train.text import (
    SplitConfig,
    build_corpus,
    dedup_key,
    normalise,
    parse_fortunes,
    parse_wordnet_line,
    read_excluded,
    split_utterances,
)
from tests.components import needs

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
CONFIG = SplitConfig(min_words=3, max_words=12, heldout_percent=10.0)


class FakeOutput:
    def __init__(self, text: str, seed: int) -> None:
        num_words = len(text.split())
        rng = np.random.default_rng(seed)
        self.audio = rng.integers(-3000, 3000, 2400 * num_words, dtype=np.int16)
        self.phoneme_ids = np.arange(len(text) + 2, dtype=np.int16)
        self.durations = np.full(len(text) + 2, 4, np.int16)
        self.phonemes = text.lower()


class FakeTeacher:
    model_sha256 = "fake"

    def synthesize(self, text: str, seed: int) -> FakeOutput:
        return FakeOutput(text, seed)


class BrokenTeacher(FakeTeacher):
    """Loads in the main process, fails in every worker."""

    def __init__(self) -> None:
        if multiprocessing.parent_process() is not None:
            raise RuntimeError("no teacher in this worker")


def fake_passages() -> dict[str, list[str]]:
    bible = [f"And the man number {i} went up to the city of Zion to pray." for i in range(40)]
    fortunes = [f"A friend of mine has {i} cats at home. They sleep all day long."
                for i in range(40)]
    wordnet = [f"A small tool used for cutting wood, type {i}" for i in range(40)]
    return {"bible-kjv": bible, "fortunes": fortunes, "wordnet": wordnet}


def run(out: Path, **kwargs: object) -> dict:
    args = {"hours": 1.0, "workers": 1, "shard_mb": 0.25, "seed": 3, "config": CONFIG,
            "exclude": None, "teacher_factory": FakeTeacher, "passages": fake_passages,
            "log": lambda line: None}
    args.update(kwargs)
    return data.generate(out, **args)  # type: ignore[arg-type]


def shard_contents(out: Path) -> tuple[list[int], bytes]:
    ids: list[int] = []
    audio = b""
    for path in sorted(out.glob(shards.SHARD_GLOB)):
        arrays = shards.read_shard(path)
        ids += arrays["utterance_ids"].tolist()
        audio += arrays["audio"].tobytes()
    return ids, audio


# -- text --------------------------------------------------------------------------------------
def test_normalise_and_split_bound_the_length() -> None:
    assert normalise("\u201cHi,\u201d  she\tsaid\u2026") == '"Hi," she said...'
    text = ("In the beginning God created the heaven and the earth. And God said, Let there be "
            "light: and there was light; and God saw the light, that it was good, and God "
            "divided the light from the darkness and the day from the night. Yes.")
    out = split_utterances(text, SplitConfig(min_words=3, max_words=12))
    assert out[0] == "In the beginning God created the heaven and the earth."
    assert "And there was light." in out  # a long sentence cut at its clause punctuation
    assert all(3 <= len(s.split()) <= 12 for s in out)
    assert "Yes." not in out  # too short


def test_split_rejects_junk() -> None:
    config = SplitConfig()
    url = "See http://example.com/index.html for the full list of it."
    assert split_utterances(url, config) == []
    assert split_utterances("|__|  /\\  |__|  ||  ==== ascii art here", config) == []
    assert split_utterances("THIS IS ALL SHOUTING AND NOT SPEECH.", config) == []
    assert split_utterances('He said "it is open and then left.', config) == []  # unbalanced


def test_fortune_and_wordnet_parsing() -> None:
    fortune = ("A black cat crossing your path\nsignifies something.\n\t\t-- Groucho Marx\n"
               "%\nNext one.\n")
    assert list(parse_fortunes(fortune)) == ["A black cat crossing your path signifies something.",
                                            "Next one."]
    line = ('00002684 03 n 02 object 0 | a tangible and visible entity; "it was full of rackets, '
            'balls and other objects"  \n')
    assert list(parse_wordnet_line(line)) == ["a tangible and visible entity",
                                              "it was full of rackets, balls and other objects"]
    assert list(parse_wordnet_line("  1 This software and database is provided")) == []


def test_corpus_dedups_excludes_and_holds_out(tmp_path: Path) -> None:
    eval_set = tmp_path / "eval.tsv"
    eval_set.write_text("id\ttext\nx1\tThe cat sat on the warm mat.\n")
    passages = {"bible-kjv": ["The cat sat on the warm mat. The dog ran far away."],
                "fortunes": ["the DOG ran far, away!", "A bird sang in the tall tree."],
                "wordnet": [f"a word of kind {i} used in speech" for i in range(200)]}
    train, heldout = build_corpus(passages, CONFIG, seed=1, excluded=read_excluded(eval_set))
    keys = [dedup_key(u.text) for u in train + heldout]
    assert len(keys) == len(set(keys)) == 202  # the dog once, the eval cat never
    assert dedup_key("The cat sat on the warm mat.") not in keys
    assert [u.source for u in train + heldout if "dog" in u.text] == ["bible-kjv"]
    assert 0 < len(heldout) < 60
    assert [u.utterance_id for u in train] == list(range(len(train)))
    excluded = read_excluded(eval_set)
    assert build_corpus(passages, CONFIG, seed=1, excluded=excluded) == (train, heldout)
    other, heldout_other = build_corpus(passages, CONFIG, seed=2, excluded=excluded)
    assert [u.text for u in other] != [u.text for u in train]
    assert sorted(u.text for u in other) == sorted(u.text for u in train)
    assert heldout_other == heldout  # the held-out split does not move with the seed


def test_the_eval_set_default_is_the_bench_file() -> None:
    assert data.EVAL_SET == REPO.parent / "shared" / "bench" / "texts_en.tsv"


# -- shards ------------------------------------------------------------------------------------
def test_shard_writer_respects_the_size_limit(tmp_path: Path) -> None:
    writer = shards.ShardWriter(tmp_path, max_bytes=64 * 1024)
    written = []
    for i in range(40):
        audio = np.full(4000 + 100 * i, i, np.int16)
        shard = writer.add(i, "wordnet", f"text {i}", f"ph {i}", audio,
                           np.arange(5, dtype=np.int16), np.full(5, 2, np.int16))
        written += [shard] if shard else []
    written.append(writer.flush())
    assert writer.flush() is None
    assert len(written) > 2
    for shard in written:
        assert shard is not None
        assert (tmp_path / shard.name).stat().st_size == shard.num_bytes <= 64 * 1024
    arrays = shards.read_shard(tmp_path / written[1].name)
    first = int(arrays["utterance_ids"][0])
    start, end = arrays["audio_offsets"][:2]
    assert np.all(arrays["audio"][start:end] == first) and end - start == 4000 + 100 * first
    assert json.loads(bytes(arrays["meta"]))[0]["text"] == f"text {first}"
    with pytest.raises(ValueError, match="exceeds the shard limit"):
        writer.add(99, "wordnet", "t", "p", np.zeros(40000, np.int16), np.zeros(1, np.int16),
                   np.zeros(1, np.int16))


def test_a_kill_during_a_write_leaves_no_shard(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def killed(src: object, dst: object) -> None:
        raise KeyboardInterrupt("killed between write and rename")

    writer = shards.ShardWriter(tmp_path, max_bytes=1 << 20)
    writer.add(0, "wordnet", "t", "p", np.ones(100, np.int16), np.zeros(3, np.int16),
               np.ones(3, np.int16))
    monkeypatch.setattr(shards.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        writer.flush()
    assert shards.scan(tmp_path) == []
    assert shards.remove_partial(tmp_path) == ["shard-00000000.npz.tmp"]
    assert list(tmp_path.iterdir()) == []


def test_resume_after_a_kill_gives_the_one_shot_set(tmp_path: Path) -> None:
    one_shot = run(tmp_path / "a", hours=0.01)
    assert one_shot["seconds"] >= 0.01 * 3600 and one_shot["num_shards"] >= 3
    assert run(tmp_path / "b", hours=0.01, stop_after=25) == {"stopped_after": 25}
    (tmp_path / "b" / "shard-99999999.npz.tmp").write_bytes(b"half a shard")
    first = json.loads((tmp_path / "b" / data.MANIFEST_NAME).read_text())
    assert 0 < first["num_utterances"] < 25  # the unflushed tail is lost, the shards kept
    resumed = run(tmp_path / "b", hours=0.01)
    assert shard_contents(tmp_path / "a") == shard_contents(tmp_path / "b")
    assert len(resumed["runs"]) == 2 and resumed["num_utterances"] == one_shot["num_utterances"]
    assert not list((tmp_path / "b").glob("*.tmp"))
    def no_teacher() -> FakeTeacher:
        raise AssertionError("a finished set needs no teacher")

    done = run(tmp_path / "b", hours=0.01, teacher_factory=no_teacher)
    assert done["num_utterances"] == one_shot["num_utterances"] and len(done["runs"]) == 2
    assert done["teacher"] == resumed["teacher"]


def test_manifest_matches_the_shards(tmp_path: Path) -> None:
    manifest = run(tmp_path, hours=0.01)
    ids, audio = shard_contents(tmp_path)
    assert manifest["num_utterances"] == len(ids) == len(set(ids))
    assert manifest["seconds"] == pytest.approx(len(audio) / 2 / 24000)
    assert manifest["seconds"] >= 0.01 * 3600
    names = sorted(p.name for p in tmp_path.glob("shard-*"))
    assert [s["name"] for s in manifest["shards"]] == names
    assert sum(s["num_bytes"] for s in manifest["shards"]) == manifest["num_bytes"]
    assert all(s["num_bytes"] <= 0.25 * 2**20 for s in manifest["shards"])
    assert sum(v["num_utterances"] for v in manifest["sources"].values()) == len(ids)
    assert set(manifest["sources"]) == {"bible-kjv", "fortunes", "wordnet"}
    assert manifest["teacher"]["package"] == "hibari-tts"
    assert manifest["teacher"]["version"] == "0.2.1"
    assert manifest["corpus"]["settings"]["seed"] == 3 and manifest["corpus"]["num_heldout"] > 0
    train, heldout, _ = data.load_corpus(tmp_path / data.CORPUS_NAME)
    assert ids == list(range(len(ids)))  # corpus order
    clips = list(shards.iter_audio(tmp_path))
    assert [i for i, _ in clips] == ids and b"".join(c.tobytes() for _, c in clips) == audio
    assert not {u.text for u in heldout} & {u.text for u in train}
    run_record = manifest["runs"][-1]
    assert run_record["num_utterances"] == len(ids) and run_record["x_realtime_per_core"] > 0


def test_the_hours_after_an_id_continue_the_corpus_where_another_folder_ended(
        tmp_path: Path) -> None:
    """``after_id``: a second folder holds the utterances that come after the first folder's,
    in corpus order, none of them twice (an LM call's fresh hours past the carried codes')."""
    run(tmp_path / "first", hours=0.005)
    first, _ = shard_contents(tmp_path / "first")
    run(tmp_path / "next", hours=0.005, after_id=max(first))
    following, _ = shard_contents(tmp_path / "next")
    assert following and following == list(range(max(first) + 1, max(first) + 1 + len(following)))
    run(tmp_path / "both", hours=0.005 + 0.005 * 1.5)  # one folder, in one go: the same texts
    both, _ = shard_contents(tmp_path / "both")
    assert both[: len(first) + len(following)] == first + following


def test_workers_give_the_same_shards(tmp_path: Path) -> None:
    run(tmp_path / "one", hours=0.005)
    run(tmp_path / "two", hours=0.005, workers=2)
    assert shard_contents(tmp_path / "one") == shard_contents(tmp_path / "two")


def test_a_worker_that_dies_fails_the_run_instead_of_hanging(tmp_path: Path) -> None:
    from concurrent.futures.process import BrokenProcessPool

    with pytest.raises(BrokenProcessPool):
        run(tmp_path, hours=0.005, workers=2, teacher_factory=BrokenTeacher)
    assert not list(tmp_path.glob(shards.SHARD_GLOB))


def test_a_short_corpus_ends_the_run_and_says_so(tmp_path: Path) -> None:
    lines: list[str] = []
    manifest = run(tmp_path, hours=1.0, log=lines.append)
    assert manifest["seconds"] < 3600 and manifest["runs"][-1]["is_corpus_exhausted"]
    assert any("corpus exhausted" in line for line in lines)


def test_other_corpus_settings_are_refused(tmp_path: Path) -> None:
    run(tmp_path, hours=0.001)
    with pytest.raises(ValueError, match="was built with"):
        run(tmp_path, hours=0.001, seed=4)


# -- the real teacher --------------------------------------------------------------------------
@needs("hibari")  # hibari-tts, in breezert-train (training/)
def test_the_teacher_speaks_two_sentences() -> None:
    from breezert_train.teacher import SAMPLES_PER_DURATION, Teacher

    teacher = Teacher()
    assert teacher.sample_rate == 24000
    for text in ("Hello there.", "The quick brown fox jumps over the lazy dog."):
        out = teacher.synthesize(text, seed=7)
        seconds = len(out.audio) / 24000
        assert out.audio.dtype == np.int16
        assert 0.15 * len(text.split()) < seconds < 1.0 * len(text.split()) + 0.5
        assert np.sqrt(np.mean(out.audio.astype(np.float64) ** 2)) > 300  # speech, not silence
        assert SAMPLES_PER_DURATION * int(out.durations.sum()) == len(out.audio)
        assert out.durations.shape == out.phoneme_ids.shape and out.phoneme_ids[0] == 0
        assert np.array_equal(teacher.synthesize(text, seed=7).audio, out.audio)
