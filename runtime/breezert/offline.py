"""One request at a time, no scheduler: the reference streaming path and the naive baseline.

Owns: ``stream_sequential`` (generate frame by frame with ``models.generate`` and decode each
chunk with the exact streaming codec) and ``synthesize_whole`` (generate everything, then decode
once: the naive PyTorch baseline of the benchmark). Must not: batch requests or schedule stages;
the ``Engine`` does that and is checked against this path.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from breezert.constants import SAMPLE_RATE
from breezert.loader import Checkpoint
from breezert.models.codec import StreamingCodec
from breezert.models.generate import generate_frames
from breezert.outputs import AudioChunk
from breezert.prompting import make_prompt
from breezert.request import SynthesisRequest

DEFAULT_CHUNK_SCHEDULE = (1, 2, 4, 8, 16)


def chunk_sizes(schedule: Sequence[int]) -> Iterator[int]:
    """1, 2, 4, 8, 16, 16, ...: the schedule, its last entry repeating."""
    yield from schedule[:-1]
    while True:
        yield schedule[-1]


def _request_frames(ckpt: Checkpoint, request: SynthesisRequest) -> Iterator[tuple[int, torch.Tensor]]:
    """(segment index, frame [16]) for every frame of every segment, one RNG stream."""
    options = request.options
    params = options.resolve_sampling(ckpt.generation.sampling)
    seed = options.seed if options.seed is not None else 0
    produced = 0
    segments = [request.text] if isinstance(request.text, str) else list(request.text)
    max_frames = request.max_frames or ckpt.generation.max_new_tokens
    for index, text in enumerate(segments):
        prompt = make_prompt(
            ckpt.tokenizer, text, speaker=options.speaker, instructions=options.instructions,
            reference=request.reference, max_seq_len=ckpt.config.max_seq_len,
        )
        for frame in generate_frames(
            ckpt.model, prompt, params, seed, max_frames=max_frames,
            cfg_scale=options.cfg_scale, ignore_eos=request.ignore_eos, frame_offset=produced,
        ):
            produced += 1
            yield index, frame


@torch.no_grad()
def stream_sequential(ckpt: Checkpoint, request: SynthesisRequest) -> Iterator[AudioChunk]:
    """Streams ``request`` as chunks following its schedule (default 1, 2, 4, 8, 16, 16...)."""
    codec = StreamingCodec(ckpt.codec, max_slots=1)
    slot = torch.zeros(1, dtype=torch.long)
    sizes = chunk_sizes(request.chunk_schedule or DEFAULT_CHUNK_SCHEDULE)
    target = next(sizes)
    pending: list[torch.Tensor] = []
    emitted = 0
    segment = 0

    def flush(is_final: bool) -> AudioChunk:
        nonlocal emitted
        codes = torch.stack(pending)[None].to(ckpt.codec_device)  # [1, F, 16]
        wav = codec.decode(slot, codes)[0].float().cpu().numpy()
        chunk = AudioChunk(
            request_id=str(request.request_id), pcm=wav.astype(np.float32),
            sample_rate=SAMPLE_RATE, frame_start=emitted, frame_end=emitted + len(pending),
            segment_index=segment, created_time=time.monotonic(), is_final=is_final,
        )
        emitted += len(pending)
        pending.clear()
        return chunk

    for segment, frame in _request_frames(ckpt, request):
        pending.append(frame)
        if len(pending) == target:
            yield flush(is_final=False)
            target = next(sizes)
    if pending:
        yield flush(is_final=True)


@torch.no_grad()
def synthesize_whole(ckpt: Checkpoint, request: SynthesisRequest) -> np.ndarray:
    """The naive baseline: generate every frame, then decode the utterance in one call."""
    frames = [frame for _, frame in _request_frames(ckpt, request)]
    if not frames:
        return np.zeros(0, dtype=np.float32)
    codes = torch.stack(frames)[None].to(ckpt.codec_device)  # [1, T, 16]
    return ckpt.codec.decode(codes)[0].float().cpu().numpy()
