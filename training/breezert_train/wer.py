"""Word error rate for the ASR quality gate (issue 19): text normalisation and edit distance.

Owns: turning a reference sentence and an ASR transcript into comparable word lists (the rules are
in ``normalise``) and counting substitutions, deletions and insertions by Levenshtein alignment.
Must not: run an ASR, touch audio, or import anything beyond the standard library.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
         "fifteen sixteen seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = ((10**9, "billion"), (10**6, "million"), (1000, "thousand"), (100, "hundred"))
_ORDINAL_WORDS = {"one": "first", "two": "second", "three": "third", "five": "fifth",
                  "eight": "eighth", "nine": "ninth", "twelve": "twelfth"}
_SYMBOLS = {"&": " and ", "%": " percent ", "+": " plus ", "@": " at "}
_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u02bc": "'", "`": "'",
                         "\u201c": '"', "\u201d": '"'})
_NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?(?:st|nd|rd|th)?")
_WORD = re.compile(r"[a-z0-9]+(?:'[a-z0-9]+)*")
"""Letters and digits, with apostrophes kept only between them (``don't``, ``o'clock``)."""


def number_words(value: int) -> str:
    """``1850`` -> ``"one thousand eight hundred fifty"`` (cardinal, no "and", 0 .. 10**12-1)."""
    if not 0 <= value < 10**12:
        raise ValueError(f"value={value} must be in 0..10**12-1")
    if value < 20:
        return _ONES[value]
    if value < 100:
        tens, ones = divmod(value, 10)
        return _TENS[tens] + (f" {_ONES[ones]}" if ones else "")
    for scale, name in _SCALES:
        if value >= scale:
            head, rest = divmod(value, scale)
            return f"{number_words(head)} {name}" + (f" {number_words(rest)}" if rest else "")
    raise AssertionError(value)  # unreachable: every value >= 100 has a scale


def _ordinal(words: str) -> str:
    *head, last = words.split()
    if last in _ORDINAL_WORDS:
        last = _ORDINAL_WORDS[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return " ".join([*head, last])


def _spell_number(match: re.Match[str]) -> str:
    token = match.group(0)
    suffix = token[-2:] if token[-2:].isalpha() else ""
    digits = token[: len(token) - len(suffix)].replace(",", "")
    whole, _, fraction = digits.partition(".")
    words = number_words(int(whole)) if len(whole) <= 12 else " ".join(_ONES[int(d)] for d in whole)
    if suffix:
        words = _ordinal(words)
    if fraction:
        words += " point " + " ".join(_ONES[int(d)] for d in fraction)
    return f" {words} "


def normalise(text: str) -> list[str]:
    """The words of ``text`` as WER compares them.

    Rules, in order: Unicode NFKC and accents dropped (``café`` -> ``cafe``); lower case; curly
    quotes to ASCII; numbers spelled out as cardinals (``1,850`` -> ``one thousand eight hundred
    fifty``; ``2.5`` -> ``two point five``; ``21st`` -> ``twenty first``; years are not read as
    ``eighteen fifty``); ``&``, ``%``, ``+``, ``@`` as words; hyphens, dashes and every other
    punctuation mark split words; an apostrophe stays only between letters (``don't``, ``i'll``
    as pocketsphinx's dictionary spells them), so quoting apostrophes go.
    """
    text = unicodedata.normalize("NFKD", unicodedata.normalize("NFKC", text).translate(_QUOTES))
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    text = _NUMBER.sub(_spell_number, text)
    for symbol, word in _SYMBOLS.items():
        text = text.replace(symbol, word)
    return _WORD.findall(text)


@dataclass(frozen=True)
class WordErrors:
    """The alignment of a transcript against its reference, in words."""

    num_ref_words: int
    substitutions: int
    deletions: int
    insertions: int

    @property
    def num_errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions

    @property
    def wer(self) -> float:
        """Errors over reference words; above 1 when the transcript inserts many words."""
        return self.num_errors / self.num_ref_words


def align(ref: Sequence[str], hyp: Sequence[str]) -> WordErrors:
    """Minimum-edit alignment of ``hyp`` to ``ref`` (each edit costs 1); among alignments of equal
    cost, the one with the most substitutions (then deletions) is counted, as sclite does.

    Raises:
        ValueError: ``ref`` is empty (a WER needs reference words).
    """
    if not ref:
        raise ValueError("the reference has no words: WER is undefined")
    # row[j] = (cost, substitutions, deletions, insertions) of ref[:i] against hyp[:j]
    row = [(j, 0, 0, j) for j in range(len(hyp) + 1)]
    for i, ref_word in enumerate(ref, start=1):
        new = [(i, 0, i, 0)]
        for j, hyp_word in enumerate(hyp, start=1):
            c, s, d, n = row[j - 1]
            same = ref_word == hyp_word
            diagonal = (c + (not same), s + (not same), d, n)
            c, s, d, n = row[j]
            deletion = (c + 1, s, d + 1, n)
            c, s, d, n = new[j - 1]
            insertion = (c + 1, s, d, n + 1)
            new.append(min(diagonal, deletion, insertion, key=lambda e: (e[0], -e[1], -e[2])))
        row = new
    _, substitutions, deletions, insertions = row[-1]
    return WordErrors(len(ref), substitutions, deletions, insertions)


def word_errors(reference: str, transcript: str) -> WordErrors:
    """``align`` of the two texts after ``normalise``."""
    return align(normalise(reference), normalise(transcript))
