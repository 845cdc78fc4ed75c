"""The audio the ASR quality gate scores, by the path it takes to a listener.

Owns: the teacher's one-shot synthesis; the teacher's audio through a checkpoint's codec (encode
then decode: the codec's own share of the error); a Breeze checkpoint's one-shot synthesis
(``offline.synthesize_whole``), its streams through the ``Engine`` at fixed chunk sizes, and its
stream at the server's progressive schedule; and the WebRTC Opus round trip (the server's own
``EngineAudioTrack`` at 48 kHz in 20 ms frames, decoded by aiortc's Opus decoder). Must not:
transcribe or score (``asr``, ``wer``), or be imported by serving code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from breezert.audio import OPUS_SAMPLE_RATE
from breezert.config import EngineConfig
from breezert.constants import SAMPLE_RATE
from breezert.engine import Engine, RequestOutcome
from breezert.offline import synthesize_whole
from breezert.options import SynthesisOptions
from breezert.profiles import EMBEDDED_PROFILE, profile_path
from breezert.request import RequestStatus, SynthesisRequest
from breezert_bench.workload import frames_for_text
from breezert_train.teacher import TEACHER_PACKAGE, TEACHER_VERSION, TEACHER_VOICE, Teacher

OFFLINE = "offline"
OPUS = "opus"
RESYNTHESIS = "resynthesis"
FIXED_CHUNKS = (1, 2, 4, 8, 16)
"""Frames per chunk of the streamed paths, one fixed size per path (``chunks_<n>``)."""
PROGRESSIVE = (1, 2, 4, 8, 16)
"""The server's default schedule (last entry repeating): the stream the Opus path carries."""
FRAME_SAMPLES = 1920
"""One codec frame (80 ms) at 24 kHz: the teacher's audio reaches the track in pieces this size."""
OPUS_FRAME_MS = 20
OPUS_TAIL_FRAMES = 3
"""Silent frames sent after a turn drains, so the codec's look-ahead (6.5 ms) returns its end."""


def chunk_path(num_frames: int) -> str:
    return f"chunks_{num_frames}"


@dataclass(frozen=True)
class PathAudio:
    """One path's audio of one sentence: mono float32 at ``sample_rate``."""

    pcm: np.ndarray
    sample_rate: int


class Subject(Protocol):
    """What the gate scores: a name, the paths it has, and each path's audio of a sentence."""

    name: str
    paths: tuple[str, ...]

    def render(self, text: str, seed: int) -> dict[str, PathAudio]: ...


# ------------------------------------------------------------------------------- Opus
async def _send(chunks: Iterable[np.ndarray], sample_rate: int) -> list[Any]:
    from breezert.server.webrtc_track import EngineAudioTrack

    now = 0.0

    async def sleep(seconds: float) -> None:  # a virtual clock: pacing costs no wall time
        nonlocal now
        now += seconds

    track = EngineAudioTrack(frame_ms=OPUS_FRAME_MS, clock=lambda: now, sleep=sleep)
    track.use_codec("audio/opus")
    turn = track.begin_turn("gate", sample_rate)
    for pcm in chunks:
        track.push("gate", pcm)
    track.end_turn("gate")
    packets = []
    while not turn.drained.is_set():
        packets.append(await track.recv())
    packets += [await track.recv() for _ in range(OPUS_TAIL_FRAMES)]
    track.stop()
    return packets


def opus_round_trip(chunks: Iterable[np.ndarray], sample_rate: int = SAMPLE_RATE) -> PathAudio:
    """The chunks (float32 at ``sample_rate``) as a WebRTC peer hears them: resampled to 48 kHz
    and framed by ``EngineAudioTrack``, Opus-encoded by its ``FrameEncoder`` (64 kb/s, voip,
    20 ms), decoded by aiortc's ``OpusDecoder`` (stereo s16, averaged to mono)."""
    from aiortc.codecs import get_decoder
    from aiortc.jitterbuffer import JitterFrame
    from aiortc.rtcrtpparameters import RTCRtpCodecParameters

    packets = asyncio.run(_send(chunks, sample_rate))
    decoder = get_decoder(RTCRtpCodecParameters(mimeType="audio/opus", clockRate=OPUS_SAMPLE_RATE,
                                                channels=2, payloadType=111))
    pieces = []
    for packet in packets:
        for frame in decoder.decode(JitterFrame(bytes(packet), int(packet.pts))):
            stereo = frame.to_ndarray().reshape(-1, 2)  # packed s16: [samples, 2]
            pieces.append(stereo.mean(axis=1, dtype=np.float32) / 32768.0)
    pcm = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    return PathAudio(pcm.astype(np.float32), OPUS_SAMPLE_RATE)


def frame_pieces(pcm: np.ndarray) -> list[np.ndarray]:
    """``pcm`` cut into 80 ms pieces (the last may be shorter), as an engine stream arrives."""
    return [pcm[i:i + FRAME_SAMPLES] for i in range(0, len(pcm), FRAME_SAMPLES)]


# ------------------------------------------------------------------------------- subjects
class TeacherSubject:
    """hibari-tts, one-shot, and the same audio over Opus (it has no engine stream)."""

    paths = (OFFLINE, OPUS)

    def __init__(self) -> None:
        self._teacher = Teacher(threads=1)
        self.name = f"teacher {TEACHER_PACKAGE} {TEACHER_VERSION} ({TEACHER_VOICE})"

    def render(self, text: str, seed: int) -> dict[str, PathAudio]:
        pcm = self._teacher.synthesize(text, seed).audio.astype(np.float32) / 32768.0
        rate = self._teacher.sample_rate
        return {OFFLINE: PathAudio(pcm, rate), OPUS: opus_round_trip(frame_pieces(pcm), rate)}


class CodecSubject:
    """The teacher's audio (``offline``) and the same audio encoded and decoded by a Breeze
    checkpoint's codec (``resynthesis``): what the codec alone costs in WER, before any LM."""

    paths = (OFFLINE, RESYNTHESIS)

    def __init__(self, model: Path) -> None:
        from breezert.loader import load_checkpoint

        ckpt = load_checkpoint(model, device="cpu")
        if ckpt.codec_encoder is None:
            raise ValueError(f"{model}: the checkpoint has no codec encoder (audio_tokenizer)")
        self._encoder, self._decoder = ckpt.codec_encoder.float().eval(), ckpt.codec.float()
        self._teacher = Teacher(threads=1)
        self.name = f"codec of {model} on the teacher's audio"

    def render(self, text: str, seed: int) -> dict[str, PathAudio]:
        import torch

        from breezert_train.lm_data import encode_batch

        clip = self._teacher.synthesize(text, seed).audio  # int16
        rate = self._teacher.sample_rate
        if rate != SAMPLE_RATE:
            raise ValueError(f"teacher rate {rate} Hz, the codec takes {SAMPLE_RATE} Hz")
        # the LM's own codes of this clip (padded to whole frames), decoded
        codes = torch.from_numpy(encode_batch(self._encoder, [clip], torch.device("cpu"))[0])
        with torch.no_grad():
            out = self._decoder.decode(codes[None])[0, : len(clip)].float().numpy()
        pcm = clip.astype(np.float32) / 32768.0
        return {OFFLINE: PathAudio(pcm, rate), RESYNTHESIS: PathAudio(out, SAMPLE_RATE)}


class BreezeSubject:
    """A Breeze checkpoint folder (``None``: the tiny random weights) on the CPU engine.

    Every path of a sentence samples with the same seed, so they carry the same codes and differ
    only in how the codec decodes and delivers them. ``max_frames`` is ``max_frames_scale`` times
    the benchmark's length rule (15 characters a second), room for a voice that ends its turn.
    """

    def __init__(self, model: Path | None, *, max_frames_scale: float = 2.0,
                 chunk_sizes: Sequence[int] = FIXED_CHUNKS) -> None:
        base = EngineConfig.from_file(profile_path(EMBEDDED_PROFILE))
        model_cfg = {**base.model.model_dump(), "path": str(model) if model else None,
                     "device": "cpu"}
        self.engine = Engine(EngineConfig.from_dict({**base.model_dump(), "model": model_cfg},
                                                    source="asr gate"))
        self.name = f"model {model}" if model else "random tiny model"
        self.chunk_sizes = tuple(chunk_sizes)
        self.paths = (OFFLINE, *map(chunk_path, self.chunk_sizes), OPUS)
        self.max_frames_scale = max_frames_scale

    def render(self, text: str, seed: int) -> dict[str, PathAudio]:
        max_frames = max(1, round(self.max_frames_scale * frames_for_text(text)))
        schedules = {chunk_path(n): (n,) for n in self.chunk_sizes}
        streams = self._stream(text, seed, max_frames, {**schedules, OPUS: PROGRESSIVE})
        offline = synthesize_whole(self.engine.checkpoint, self._request(text, seed, max_frames))
        out = {OFFLINE: PathAudio(offline, SAMPLE_RATE)}
        out.update({path: PathAudio(np.concatenate(streams[path]) if streams[path]
                                    else np.zeros(0, np.float32), SAMPLE_RATE)
                    for path in schedules})
        out[OPUS] = opus_round_trip(streams[OPUS])
        return out

    def _request(self, text: str, seed: int, max_frames: int,
                 schedule: tuple[int, ...] | None = None,
                 request_id: str | None = None) -> SynthesisRequest:
        extra = {"request_id": request_id} if request_id else {}
        return SynthesisRequest(text=text, options=SynthesisOptions(seed=seed),
                                max_frames=max_frames, chunk_schedule=schedule, **extra)

    def _stream(self, text: str, seed: int, max_frames: int,
                schedules: dict[str, tuple[int, ...]]) -> dict[str, list[np.ndarray]]:
        """One request per schedule, run together; each path's chunks in order."""
        ids = {self.engine.add_request(self._request(text, seed, max_frames, schedule,
                                                     f"gate-{path}")): path
               for path, schedule in schedules.items()}
        chunks: dict[str, list[np.ndarray]] = {path: [] for path in schedules}
        while self.engine.has_work():
            for out in self.engine.step():
                if isinstance(out, RequestOutcome):
                    if out.status != RequestStatus.FINISHED:
                        raise RuntimeError(f"{ids[out.request_id]}: {out.status.value} "
                                           f"({out.error})")
                else:
                    chunks[ids[out.request_id]].append(out.pcm)
        return chunks
