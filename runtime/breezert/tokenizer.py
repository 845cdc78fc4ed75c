"""Text tokenizer: the checkpoint's ``tokenizer.json`` through the ``tokenizers`` library.

Owns: loading and checking the Breeze special ids, encoding text pieces, and building a small
byte-level stand-in tokenizer (same special ids) for random checkpoints. Must not: build prompt
templates (``models/prompt.py``) or touch tensors.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from breezert.constants import (
    AUDIO_EOS_TOKEN_ID,
    AUDIO_TOKEN_ID,
    EOI_TOKEN_ID,
    INS_BOS_TOKEN_ID,
    INS_EOS_TOKEN_ID,
    SPEAKER_TOKEN_IDS,
    TEXT_BOS_ID,
    TEXT_EOS_ID,
    TEXT_PAD_ID,
)

# The Breeze special tokens at their real ids (SPEC §1.5).
SPECIAL_TOKENS: dict[str, int] = {
    "<pad>": TEXT_PAD_ID,
    "<eos>": TEXT_EOS_ID,
    "<bos>": TEXT_BOS_ID,
    "<unk>": 3,
    "<end_of_image>": EOI_TOKEN_ID,
    "<|AUDIO|>": AUDIO_TOKEN_ID,
    "<|audio_eos|>": AUDIO_EOS_TOKEN_ID,
    **{f"[S{i}]": tid for i, tid in enumerate(SPEAKER_TOKEN_IDS)},
    "<ins_bos>": INS_BOS_TOKEN_ID,
    "<ins_eos>": INS_EOS_TOKEN_ID,
}


class TokenizerError(ValueError):
    """The tokenizer file is missing or does not carry Breeze's special tokens."""


class BreezeTokenizer:
    """Encodes text pieces to ids; every encoded piece starts with ``<bos>`` (id 2)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        for token, expected in SPECIAL_TOKENS.items():
            if token == "<unk>":
                continue
            got = tokenizer.token_to_id(token)
            if got != expected:
                raise TokenizerError(
                    f"tokenizer.json: special token {token!r} has id {got}, expected {expected}"
                )

    @staticmethod
    def from_file(path: str | Path) -> BreezeTokenizer:
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"missing tokenizer file: {path}")
        return BreezeTokenizer(Tokenizer.from_file(str(path)))

    def encode(self, text: str) -> list[int]:
        """``text`` → ids with a leading ``<bos>``; special tokens such as ``[S0]`` are kept."""
        ids = self._tok.encode(text, add_special_tokens=True).ids
        if not ids or ids[0] != TEXT_BOS_ID:
            ids = [TEXT_BOS_ID, *ids]
        return ids

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()


def build_byte_tokenizer() -> Tokenizer:
    """A tiny Gemma-shaped tokenizer: characters and byte fallback, real special ids.

    Used for random checkpoints so a fresh machine needs no external tokenizer. Ordinary
    characters map to small ids; every Breeze special token keeps its released id.
    """
    vocab: dict[str, int] = dict(SPECIAL_TOKENS)
    next_id = 4
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = next_id
        next_id += 1
    for ch in ["▁"] + [chr(c) for c in range(33, 127)]:
        if ch not in vocab:
            vocab[ch] = next_id
            next_id += 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", TEXT_BOS_ID)]
    )
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    return tok
