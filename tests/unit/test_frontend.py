"""``breezert.frontend.TextFrontEnd`` on the byte-level tokenizer: the three ``Split`` modes,
each piece's prompt built once (fit check and segment share it), the prompt-token count, the
token limit's error, and CFG branches for a turn with no text yet.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

from breezert import frontend as frontend_module
from breezert.errors import InvalidRequest
from breezert.frontend import TextFrontEnd
from breezert.models.prompt import Prompt
from breezert.options import SynthesisOptions
from breezert.request import Reference, SynthesisRequest
from breezert.text import Split
from breezert.tokenizer import BreezeTokenizer, build_byte_tokenizer

pytestmark = pytest.mark.unit

MAX_SEQ_LEN = 66
"""64 prompt tokens a segment: a few dozen bytes of text."""


@pytest.fixture(scope="module")
def frontend() -> TextFrontEnd:
    return TextFrontEnd(BreezeTokenizer(build_byte_tokenizer()), MAX_SEQ_LEN, None)


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How many times each text's prompt was built."""
    counts: Counter[str] = Counter()
    real = frontend_module.make_prompt

    def spy(tokenizer: Any, text: str, **kwargs: Any) -> Prompt:
        counts[text] += 1
        return real(tokenizer, text, **kwargs)

    monkeypatch.setattr(frontend_module, "make_prompt", spy)
    return counts


def test_none_keeps_each_text_whole(frontend: TextFrontEnd, built: Counter[str]) -> None:
    prepared = frontend.prepare_text(["One. Two.", "Three."], SynthesisOptions(), None)
    assert prepared.owners == (0, 1) and built == {"One. Two.": 1, "Three.": 1}
    lens = [s.prompt_lens for s in prepared.segments]
    assert prepared.num_prompt_tokens == sum(max(n) for n in lens)
    assert all(s.prompt is not None and s.num_text_tokens for s in prepared.segments)


def test_sentences_cut_every_text_and_fit_only_what_does_not_fit(
    frontend: TextFrontEnd, built: Counter[str]
) -> None:
    texts = ["One. Two.", "Three."]
    assert frontend.prepare_text(texts, SynthesisOptions(), None, Split.SENTENCES).owners == \
        (0, 0, 1)
    assert built == {"One.": 1, "Two.": 1, "Three.": 1}
    built.clear()
    assert frontend.prepare_text(texts, SynthesisOptions(), None, Split.FIT).owners == (0, 1)
    assert built == {"One. Two.": 1, "Three.": 1}
    built.clear()
    long = "lorem ipsum dolor sit amet " * 6  # 162 bytes: over 64 tokens
    prepared = frontend.prepare_text(["Hi.", long], SynthesisOptions(), None, Split.FIT)
    assert prepared.owners[0] == 0 and prepared.owners.count(1) >= 3
    assert all(max(s.prompt_lens) <= frontend.max_prompt_tokens for s in prepared.segments)
    assert max(built.values()) == 1, built  # every piece measured and kept: built once


def test_a_prompt_over_the_limit_is_refused_in_tokens(frontend: TextFrontEnd) -> None:
    long = "lorem ipsum dolor sit amet " * 6
    with pytest.raises(InvalidRequest, match=f"context limit of {MAX_SEQ_LEN - 2} tokens"):
        frontend.prepare_text([long], SynthesisOptions(), None)
    crowded = SynthesisOptions(instructions="Speak slowly. " * 5)  # no room for any text
    with pytest.raises(InvalidRequest, match="over the context limit"):
        frontend.prepare_text(["Hi."], crowded, None, Split.SENTENCES)


def test_cfg_branches_of_a_turn_with_and_without_text(frontend: TextFrontEnd) -> None:
    directed = SynthesisOptions(instructions="Calm.", cfg_scale=2.0)
    with_text = frontend.prepare(SynthesisRequest(text="Hi.", options=directed))
    empty = frontend.prepare(SynthesisRequest(text=[], options=directed, input_closed=False))
    assert with_text.num_branches == empty.num_branches == 2  # the template has a negative
    assert frontend.prepare(SynthesisRequest(text="Hi.")).num_branches == 1
    assert empty.text.segments == () and empty.text.num_prompt_tokens == 0


def test_reference_counts_toward_the_limit_and_needs_an_encoder(
    frontend: TextFrontEnd,
) -> None:
    reference = Reference("Me.", np.zeros((40, 16), np.int64))  # 40 audio rows
    plain = frontend.prepare_text(["Hi."], SynthesisOptions(), None).num_prompt_tokens
    cloned = frontend.prepare_text(["Hi."], SynthesisOptions(), reference).num_prompt_tokens
    assert cloned >= plain + 40
    with pytest.raises(InvalidRequest, match="reference_audio"):
        frontend.encode_reference(np.zeros(24000, np.float32), 24000, "Me.")
    with pytest.raises(InvalidRequest, match="reference_text"):
        frontend.encode_reference(np.zeros(24000, np.float32), 24000, " ")
