"""``breezert_train.wer``: the quality gate's text normalisation and word alignment."""

from __future__ import annotations

import pytest

from breezert_train.wer import align, normalise, number_words, word_errors

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------------------ normalise
def test_case_and_punctuation_go_and_apostrophes_stay_inside_words() -> None:
    text = "\u201cDon\u2019t,\u201d she said; 'I'll go' -- the well-known caf\u00e9 (now)!"
    assert normalise(text) == ["don't", "she", "said", "i'll", "go", "the", "well", "known",
                               "cafe", "now"]


def test_numbers_are_spelled_out() -> None:
    assert normalise("1,850 men, 2.5 miles, the 21st and 3rd day, 100% & 7") == (
        "one thousand eight hundred fifty men two point five miles the twenty first and "
        "third day one hundred percent and seven").split()
    assert number_words(0) == "zero" and number_words(40) == "forty"
    assert number_words(2_000_013) == "two million thirteen"
    assert normalise("the 12th, 20th and 101st") == (
        "the twelfth twentieth and one hundred first".split())


def test_nothing_but_punctuation_has_no_words() -> None:
    assert normalise(" ... -- !? ") == []


# ------------------------------------------------------------------------------ alignment
def test_identical_texts_score_zero_whatever_the_punctuation() -> None:
    e = word_errors("He was in deep converse, with the clerk.",
                    "he was in deep converse with the clerk")
    assert (e.num_errors, e.wer, e.num_ref_words) == (0, 0.0, 8)


def test_substitution_deletion_insertion_are_counted_apart() -> None:
    e = align("a b c d".split(), "a x c d e".split())
    assert (e.substitutions, e.deletions, e.insertions) == (1, 0, 1)
    e = align("a b c d".split(), "a d".split())
    assert (e.substitutions, e.deletions, e.insertions, e.wer) == (0, 2, 0, 0.5)


def test_an_empty_transcript_is_all_deletions_and_insertions_pass_one() -> None:
    assert align("a b c".split(), []).wer == 1.0
    e = align(["a"], "x y z".split())
    assert (e.substitutions, e.insertions, e.wer) == (1, 2, 3.0)


def test_ties_prefer_substitutions_as_sclite_does() -> None:
    e = align("a b".split(), "x y".split())  # 2 substitutions, not 2 deletions + 2 insertions
    assert (e.substitutions, e.deletions, e.insertions) == (2, 0, 0)


def test_an_empty_reference_has_no_wer() -> None:
    with pytest.raises(ValueError, match="no words"):
        word_errors("?!", "hello")
