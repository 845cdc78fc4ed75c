"""Request text → backbone prompts: tokenize each piece and apply the template (SPEC §2.1).

Owns: turning a segment's text, the speaker, instructions and reference of a request into a
``Prompt`` (with its CFG negative) and checking it fits the context. Must not: embed or run
anything; the templates themselves live in ``models/prompt.py``.
"""

from __future__ import annotations

import torch

from breezert.errors import InvalidRequest
from breezert.models.prompt import Prompt, build_prompt, speaker_token_id
from breezert.request import Reference
from breezert.tokenizer import BreezeTokenizer


def make_prompt(
    tokenizer: BreezeTokenizer,
    text: str,
    *,
    speaker: str = "[S0]",
    instructions: str | None = None,
    reference: Reference | None = None,
    max_seq_len: int = 2048,
) -> Prompt:
    """Builds one segment's prompt; raises ``InvalidRequest`` naming the field at fault."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequest("text: must be a non-empty, non-whitespace string")
    try:
        speaker_token_id(speaker)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    ref_text_ids = ref_codes = None
    if reference is not None:
        ref_text_ids = tokenizer.encode(reference.ref_text)
        ref_codes = torch.tensor(reference.ref_codes)  # [K, 16] int64 (a copy of a few KB)
    prompt = build_prompt(
        tokenizer.encode(text),
        speaker=speaker,
        instruction_ids=tokenizer.encode(instructions) if instructions else None,
        ref_text_ids=ref_text_ids,
        ref_codes=ref_codes,
    )
    check_fits(prompt, max_seq_len)
    return prompt


def check_fits(prompt: Prompt, max_seq_len: int) -> None:
    """Raises ``InvalidRequest`` when ``prompt`` (or its CFG negative) leaves no room for a
    frame in a context of ``max_seq_len`` tokens."""
    longest = max(prompt.num_tokens, prompt.negative.num_tokens if prompt.negative else 0)
    # At least one frame must fit: generation stops at prefill_len + t >= max_seq_len - 1.
    if longest >= max_seq_len - 1:
        raise InvalidRequest(
            f"text: the prompt is {longest} tokens, over the context limit of "
            f"{max_seq_len - 2} tokens (max_seq_len={max_seq_len}); split the text into segments"
        )
