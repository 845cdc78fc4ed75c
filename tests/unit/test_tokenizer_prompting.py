"""``breezert.tokenizer`` and ``breezert.prompting``: special ids, encoding, request-level checks.

The byte-level stand-in tokenizer is always tested; the real Breeze ``tokenizer.json`` is checked
only where ``../shared/breeze/tokenizer/`` holds it (it is not shipped with the project).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from breezert.errors import InvalidRequest
from breezert.prompting import make_prompt
from breezert.tokenizer import SPECIAL_TOKENS, BreezeTokenizer, build_byte_tokenizer

pytestmark = pytest.mark.unit

REAL_TOKENIZER = Path(
    os.environ.get("BREEZE_TOKENIZER")
    or Path(__file__).resolve().parents[2].parent / "shared/breeze/tokenizer/tokenizer.json"
)
TEMPLATE = "[S0]<ins_bos>A calm voice.<ins_eos>Hi"


@pytest.fixture(scope="module")
def byte_tok() -> BreezeTokenizer:
    return BreezeTokenizer(build_byte_tokenizer())


@pytest.fixture(scope="module")
def real_tok() -> BreezeTokenizer:
    if not REAL_TOKENIZER.is_file():
        pytest.skip(f"real Breeze tokenizer not found at {REAL_TOKENIZER} (not shipped)")
    return BreezeTokenizer.from_file(REAL_TOKENIZER)


# ----------------------------------------------------------------------------- byte tokenizer


def test_byte_tokenizer_keeps_every_special_id() -> None:
    tok = build_byte_tokenizer()
    for token, token_id in SPECIAL_TOKENS.items():
        assert tok.token_to_id(token) == token_id, token
        assert tok.id_to_token(token_id) == token, token


def test_byte_tokenizer_survives_serialization(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(build_byte_tokenizer().to_str())
    assert BreezeTokenizer.from_file(path).encode("[S3]hi") == (
        BreezeTokenizer(build_byte_tokenizer()).encode("[S3]hi")
    )


def test_encode_has_one_leading_bos(byte_tok: BreezeTokenizer) -> None:
    ids = byte_tok.encode("Hello world")
    assert ids[0] == 2 and 2 not in ids[1:]
    assert all(i < 512 for i in ids[1:])  # ordinary characters map to small ids


@pytest.mark.parametrize("text", ["Hello world", "Hi, how are you?", "ünïcödé 台灣 🎉", "a  b"])
def test_decode_round_trips_text(byte_tok: BreezeTokenizer, text: str) -> None:
    assert build_byte_tokenizer().decode(byte_tok.encode(text)) == text


def test_speaker_tags_map_to_their_ids(byte_tok: BreezeTokenizer) -> None:
    assert byte_tok.encode("[S3]") == [2, 262149]
    assert byte_tok.encode("[S0]<ins_bos>x<ins_eos>")[:3] == [2, 262146, 262156]
    assert byte_tok.encode("[S9]")[-1] == 262155


# ----------------------------------------------------------------------------- make_prompt


def test_plain_prompt_layout(byte_tok: BreezeTokenizer) -> None:
    prompt = make_prompt(byte_tok, "Hi", speaker="[S3]")
    assert prompt.input_ids.tolist() == byte_tok.encode("[S3]Hi")
    assert prompt.negative is None


def test_design_prompt_equals_encoded_template(byte_tok: BreezeTokenizer) -> None:
    prompt = make_prompt(byte_tok, "Hi", instructions="A calm voice.")
    assert prompt.input_ids.tolist() == byte_tok.encode(TEMPLATE)
    assert prompt.negative is not None
    assert prompt.negative.input_ids.tolist() == byte_tok.encode("[S0]Hi")


@pytest.mark.parametrize("text", ["", "   ", " \n\t "])
def test_empty_text_is_rejected(byte_tok: BreezeTokenizer, text: str) -> None:
    with pytest.raises(InvalidRequest, match=r"^text: "):
        make_prompt(byte_tok, text)


@pytest.mark.parametrize("speaker", ["[S12]", "[S10]", "S-1", "narrator"])
def test_unknown_speaker_is_rejected(byte_tok: BreezeTokenizer, speaker: str) -> None:
    with pytest.raises(InvalidRequest, match=r"^speaker="):
        make_prompt(byte_tok, "Hi", speaker=speaker)


def test_speaker_without_brackets_is_accepted(byte_tok: BreezeTokenizer) -> None:
    assert make_prompt(byte_tok, "Hi", speaker="S3").input_ids.tolist()[:2] == [2, 262149]


def test_text_over_the_context_limit(byte_tok: BreezeTokenizer) -> None:
    text = "hello world"
    num_tokens = make_prompt(byte_tok, text).num_tokens  # bos, speaker, 11 characters
    assert num_tokens == 13
    # One frame must still fit: the prompt needs num_tokens + 2 positions.
    make_prompt(byte_tok, text, max_seq_len=num_tokens + 2)
    with pytest.raises(InvalidRequest, match=r"^text: .*context limit"):
        make_prompt(byte_tok, text, max_seq_len=num_tokens + 1)
    with pytest.raises(InvalidRequest, match=r"^text: "):
        make_prompt(byte_tok, text * 10, max_seq_len=64)


def test_negative_prompt_counts_against_the_limit(byte_tok: BreezeTokenizer) -> None:
    prompt = make_prompt(byte_tok, "Hi", instructions="A long voice description.")
    with pytest.raises(InvalidRequest, match=r"^text: "):
        make_prompt(byte_tok, "Hi", instructions="A long voice description.",
                    max_seq_len=prompt.num_tokens + 1)


def test_invalid_request_is_a_value_error(byte_tok: BreezeTokenizer) -> None:
    with pytest.raises(ValueError):
        make_prompt(byte_tok, " ")


# ----------------------------------------------------------------------------- real tokenizer


def test_real_tokenizer_encodes_the_design_template(real_tok: BreezeTokenizer) -> None:
    ids = real_tok.encode(TEMPLATE)
    assert ids[:3] == [2, 262146, 262156]
    assert 262157 in ids


def test_real_tokenizer_prompt_equals_encoded_template(real_tok: BreezeTokenizer) -> None:
    prompt = make_prompt(real_tok, "Hi", instructions="A calm voice.")
    assert prompt.input_ids.tolist() == real_tok.encode(TEMPLATE)
    assert prompt.negative is not None
    assert prompt.negative.input_ids.tolist() == real_tok.encode("[S0]Hi")
