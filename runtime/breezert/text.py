"""Text into engine segments: the sentence splitter, and cutting a piece until its prompt fits.

Owns: ``SentenceSplitter`` (streamed text -> sentences, as soon as each is complete),
``split_sentences`` (a whole text), ``split_text`` (sentences, each cut further at spaces,
then punctuation, then anywhere until a caller's ``fits`` check passes: the prompt's token
limit) and ``Split`` / ``cut_text``, the way a caller asks the engine's text front end to cut
its text. Used by the text front end (``breezert.frontend``) and by the LiveKit plugin
(``breezert_agent``). Must not: import torch, the tokenizer or anything beyond the standard
library; the token check comes in as a callable.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

MAX_SENTENCE_CHARS = 300
"""A sentence longer than this is cut at its last space before it (about 20 s of speech, well
inside one segment's frame limit)."""


_CLOSERS = "\"')]}»”’」』"
_CJK_ENDS = "。！？"
# NOTE(breezert): only words that rarely end a sentence ("no." does, so "No. 5" splits).
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc e.g i.e inc ltd corp fig approx dept mt "
    "jan feb apr jun jul aug sep sept oct nov dec u.s u.k a.m p.m ph.d cf al".split()
)


class Split(str, enum.Enum):
    """How the text front end turns one text a caller sends into engine segments."""

    NONE = "none"
    """The text is one segment; a prompt over the token limit is an ``InvalidRequest``."""
    FIT = "fit"
    """The text is one segment when its prompt fits, else it is cut as ``SENTENCES`` cuts it
    (the server's turns: a client's segment stays whole when it can)."""
    SENTENCES = "sentences"
    """The text's sentences (``split_text``), each cut further until its prompt fits (the
    server's HTTP route: one input, spoken sentence by sentence)."""


def _has_word(text: str) -> bool:
    return any(ch.isalnum() for ch in text)


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _word_before(text: str, i: int) -> str:
    start = i
    while start > 0 and (text[start - 1].isalnum() or text[start - 1] == "."):
        start -= 1
    return text[start:i].lower()


class SentenceSplitter:
    """Cuts streamed text into sentences as soon as each one is known to be complete.

    A sentence ends at ``!``/``?``/``。！？`` (at once, even at the end of the text so far), at
    ``.``/``…`` followed by a space and a word that is not lower case (so ``3.14``, ``e.g. this``,
    ``Mr. Smith`` and ``J. K.`` do not split; this waits for the next word), or at a newline.
    There is no minimum length; pieces without a letter or digit join the next sentence, and a
    sentence over ``max_chars`` is cut at its last space.
    """

    def __init__(self, *, max_chars: int = MAX_SENTENCE_CHARS) -> None:
        self._buf = ""
        self._pos = 0  # scanning resumes here (the buffer before it holds no boundary)
        self._max_chars = max_chars

    def push(self, text: str) -> list[str]:
        """Adds text; returns the sentences it completed, in order."""
        self._buf += text
        sentences: list[str] = []
        while (cut := self._next_cut()) is not None:
            self._take(cut, sentences)
        while len(self._buf) > self._max_chars:
            space = self._buf.rfind(" ", 0, self._max_chars)
            self._take(space if space > 0 else self._max_chars, sentences)
        return sentences

    def flush(self) -> list[str]:
        """Everything still buffered, as one last piece (if it holds any text)."""
        sentences: list[str] = []
        self._take(len(self._buf), sentences)
        return sentences

    def _take(self, cut: int, out: list[str]) -> None:
        piece, self._buf, self._pos = self._buf[:cut].strip(), self._buf[cut:], 0
        if piece:
            out.append(piece)

    def _next_cut(self) -> int | None:
        buf, i = self._buf, self._pos
        while i < len(buf):
            cut, resume = self._boundary_at(buf, i)
            if cut is not None:
                if _has_word(buf[:cut]):
                    return cut
                i = cut  # only punctuation so far: it joins the next sentence
            elif resume is not None:
                i = resume
            else:  # undecided: wait for more text
                self._pos = i
                return None
        self._pos = len(buf)
        return None

    @staticmethod
    def _boundary_at(buf: str, i: int) -> tuple[int | None, int | None]:
        """(cut, None) = a sentence ends before ``cut``; (None, j) = no boundary here, go on at
        ``j``; (None, None) = cannot tell until more text arrives."""
        ch, n = buf[i], len(buf)
        if ch == "\n":
            return i + 1, None
        if ch in _CJK_ENDS:
            return _skip(buf, _skip(buf, i + 1, _CJK_ENDS), _CLOSERS), None
        if ch in "!?":
            j = _skip(buf, _skip(buf, i + 1, "!?.…"), _CLOSERS)
            return (j, None) if j == n or buf[j].isspace() else (None, j)
        if ch not in ".…":
            return None, i + 1
        j = _skip(buf, _skip(buf, i + 1, ".…!?"), _CLOSERS)
        if j == n:
            return None, None  # "3." may become "3.14"
        if not buf[j].isspace():
            return None, j  # decimals, URLs, "e.g"
        k = j
        while k < n and buf[k].isspace():
            k += 1
        if k == n:
            return None, None  # need the next word to tell "Mr. Smith" from "end. Next"
        word = _word_before(buf, i).lstrip(".")
        if buf[k].islower() or word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha()):
            return None, k
        return j, None


def split_sentences(text: str, *, max_chars: int = MAX_SENTENCE_CHARS) -> list[str]:
    """A whole text cut the way ``SentenceSplitter`` cuts a stream of it."""
    splitter = SentenceSplitter(max_chars=max_chars)
    return splitter.push(text) + splitter.flush()


_SOFT_BREAKS = ",;:，、；："


def split_text(text: str, fits: Callable[[str], bool] | None = None, *,
               max_chars: int = MAX_SENTENCE_CHARS) -> list[str]:
    """``text`` as segments: its sentences (``split_sentences``), each one that ``fits``
    rejects cut in two near its middle (at a space, else a comma-like mark, else anywhere) until
    every piece fits. A single character that still does not fit is returned as it is (the
    engine's own check then reports it, in tokens)."""
    pieces: list[str] = []
    for sentence in split_sentences(text, max_chars=max_chars):
        pieces.extend(_cut_until_fits(sentence, fits))
    return pieces


def cut_text(text: str, split: Split, fits: Callable[[str], bool]) -> list[str]:
    """``text`` cut as ``split`` says (``fits``: whether a piece's prompt fits one segment)."""
    if split is Split.NONE or (split is Split.FIT and fits(text)):
        return [text]
    return split_text(text, fits)


def _cut_until_fits(piece: str, fits: Callable[[str], bool] | None) -> list[str]:
    if fits is None or len(piece) <= 1 or fits(piece):
        return [piece]
    cut = _middle_break(piece)
    head, rest = piece[:cut].strip(), piece[cut:].strip()
    return [p for part in (head, rest) if part for p in _cut_until_fits(part, fits)]


def _middle_break(piece: str) -> int:
    """Where to cut ``piece`` in two: the break nearest its middle, preferring whitespace."""
    mid = len(piece) // 2
    for is_break in (str.isspace, lambda ch: ch in _SOFT_BREAKS):
        cuts = [i + 1 for i, ch in enumerate(piece[:-1]) if is_break(ch)]
        if cuts:
            return min(cuts, key=lambda i: abs(i - mid))
    return mid
