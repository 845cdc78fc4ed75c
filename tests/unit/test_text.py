"""``breezert.text.split_text``: sentences, then cuts until each piece fits."""

from __future__ import annotations

import pytest
from breezert.text import split_text

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
