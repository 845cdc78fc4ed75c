"""``breezert.text``: the sentence splitter (streamed and whole), then ``split_text``'s cuts until
each piece fits."""

from __future__ import annotations

import pytest
from breezert.text import SentenceSplitter, split_sentences, split_text

pytestmark = pytest.mark.unit


def test_sentences_first_then_cuts_at_spaces_until_each_fits() -> None:
    text = "Short one. Then" + " word" * 30 + " end."
    pieces = split_text(text, lambda p: len(p) <= 40)
    assert pieces[0] == "Short one." and all(len(p) <= 40 for p in pieces)
    assert " ".join(pieces).split() == text.split()  # nothing lost, words kept whole


def test_text_without_spaces_is_cut_at_commas_then_anywhere() -> None:
    text = "甲乙丙丁，戊己庚辛" + "子" * 20
    pieces = split_text(text, lambda p: len(p) <= 8)
    assert pieces[0] == "甲乙丙丁，" and "".join(pieces) == text
    assert all(len(p) <= 8 for p in pieces)


def test_no_check_gives_sentences() -> None:
    assert split_text("One. Two? Three") == ["One.", "Two?", "Three"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Hello there. How are you?", ["Hello there.", "How are you?"]),
        ("Mr. Smith paid 3.14 dollars. Then he left!", ["Mr. Smith paid 3.14 dollars.",
                                                        "Then he left!"]),
        ("e.g. this one. J. K. Rowling wrote it.", ["e.g. this one.",
                                                    "J. K. Rowling wrote it."]),
        ("Visit example.com today. It works.", ["Visit example.com today.", "It works."]),
        ("Wait... What? Yes!", ["Wait...", "What?", "Yes!"]),
        ("你好。我很好！谢谢", ["你好。", "我很好！", "谢谢"]),
        ("one\ntwo\n\n- three", ["one", "two", "- three"]),
        ('He said "Stop." Then silence.', ['He said "Stop."', "Then silence."]),
        ("...", ["..."]),
        ("   ", []),
    ],
)
def test_split_sentences(text: str, expected: list[str]) -> None:
    assert split_sentences(text) == expected


def test_splitter_streamed_char_by_char_equals_whole_text() -> None:
    text = "Dr. Who arrived at 10.30 a.m. sharp. It was 3.5 km away! Was it far? Not really."
    splitter = SentenceSplitter()
    streamed = [s for ch in text for s in splitter.push(ch)] + splitter.flush()
    assert streamed == split_sentences(text)


def test_splitter_emits_complete_sentence_without_minimum_length() -> None:
    splitter = SentenceSplitter()
    assert splitter.push("Hi!") == ["Hi!"]  # unambiguous: at once, however short
    assert splitter.push(" Ok.") == []  # "Ok." could still be "Ok.5": wait for the next word
    assert splitter.push(" Next") == ["Ok."]
    assert splitter.flush() == ["Next"]


def test_splitter_cuts_overlong_sentence_at_a_space() -> None:
    splitter = SentenceSplitter(max_chars=20)
    pieces = splitter.push("one two three four five six seven eight") + splitter.flush()
    assert all(len(p) <= 20 for p in pieces)
    assert " ".join(pieces) == "one two three four five six seven eight"
