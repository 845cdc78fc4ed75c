"""``SentenceTokenizer``: the runtime's sentence splitter behind LiveKit's tokenizer interface.

The plugin's default ``tokenizer`` (``TTS(tokenizer=...)`` takes any LiveKit
``tokenize.SentenceTokenizer``, e.g. ``tokenize.blingfire.SentenceTokenizer()``). Owns only the
adaptation: ``breezert.text.SentenceSplitter`` (which the server uses too) hands each sentence on
as soon as it is complete, with no minimum length and no look-ahead after ``!``/``?``, which is
what keeps it the default: LiveKit's buffered streams hold a sentence until the next one starts.
Must not: split text itself or import torch.
"""

from __future__ import annotations

from livekit.agents import tokenize, utils

from breezert.text import MAX_SENTENCE_CHARS, SentenceSplitter, split_sentences


class SentenceTokenizer(tokenize.SentenceTokenizer):
    """Sentences as ``breezert.text`` cuts them (``language`` is not used: the splitter reads
    Latin and CJK sentence ends alike)."""

    def __init__(self, *, max_chars: int = MAX_SENTENCE_CHARS) -> None:
        """Args:
            max_chars: A sentence longer than this is cut at its last space before it.
        """
        self._max_chars = max_chars

    def tokenize(self, text: str, *, language: str | None = None) -> list[str]:
        return split_sentences(text, max_chars=self._max_chars)

    def stream(self, *, language: str | None = None) -> tokenize.SentenceStream:
        return _SentenceStream(self._max_chars)


class _SentenceStream(tokenize.SentenceStream):
    """Each sentence goes out from inside the ``push_text`` call that completed it."""

    def __init__(self, max_chars: int) -> None:
        super().__init__()
        self._splitter = SentenceSplitter(max_chars=max_chars)
        self._segment_id = utils.shortuuid()

    def push_text(self, text: str) -> None:
        self._check_not_closed()
        self._send(self._splitter.push(text))

    def flush(self) -> None:
        """What is buffered goes out as a sentence; later ones belong to a new segment."""
        self._check_not_closed()
        self._send(self._splitter.flush())
        self._segment_id = utils.shortuuid()

    def end_input(self) -> None:
        self.flush()
        self._do_close()

    async def aclose(self) -> None:
        self._do_close()

    def _send(self, sentences: list[str]) -> None:
        for sentence in sentences:
            self._event_ch.send_nowait(
                tokenize.TokenData(segment_id=self._segment_id, token=sentence))
