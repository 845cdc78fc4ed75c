"""The teacher voice: hibari-tts 0.2.1, bundled voice "heart" only, with per-phoneme durations.

Owns loading hibari's ONNX graph with one extra graph output (``/Clip_output_0``, the clipped
durations, one per phoneme id in 40 Hz units) and turning text into int16 audio, phoneme ids and
durations. Must not download anything: only the voice inside the wheel is used.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TEACHER_PACKAGE = "hibari-tts"
TEACHER_VERSION = "0.2.1"
TEACHER_VOICE = "heart"
DURATION_TENSOR = "/Clip_output_0"
SAMPLES_PER_DURATION = 600
"""One duration unit: 40 Hz at 24 kHz (two of hibari's 300-sample spectral frames)."""


@dataclass(frozen=True)
class TeacherOutput:
    audio: np.ndarray
    """[num_samples] int16, 24 kHz mono."""
    phoneme_ids: np.ndarray
    """[num_ids] int16: hibari's vocabulary ids, the 0 pads at both ends included."""
    durations: np.ndarray
    """[num_ids] int16: frames of 40 Hz per id; ``600 * sum`` is ``len(audio)`` for one sentence."""
    phonemes: str


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def with_extra_output(model: bytes, tensor_name: str) -> bytes:
    """The ONNX ``ModelProto`` bytes with ``tensor_name`` appended to the graph's outputs.

    NOTE(i19): a raw protobuf edit (ModelProto.graph = field 7, GraphProto.output = field 12,
    ValueInfoProto.name = field 1) so that the ``onnx`` package (tens of MB) is not needed;
    onnxruntime infers the output's type and shape itself."""
    out = bytearray()
    pos = 0
    found = False
    while pos < len(model):
        start = pos
        key, pos = _read_varint(model, pos)
        key_end = pos
        wire_type = key & 7
        if wire_type == 0:
            _, pos = _read_varint(model, pos)
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        elif wire_type == 2:
            length, body = _read_varint(model, pos)
            pos = body + length
            if key >> 3 == 7:
                name = tensor_name.encode()
                value_info = b"\x0a" + _varint(len(name)) + name
                graph = model[body:pos] + b"\x62" + _varint(len(value_info)) + value_info
                out += model[start:key_end] + _varint(len(graph)) + graph
                found = True
                continue
        else:
            raise ValueError(f"unexpected protobuf wire type {wire_type} at byte {start}")
        out += model[start:pos]
    if not found:
        raise ValueError("no graph field in the ONNX model")
    return bytes(out)


class Teacher:
    """hibari's bundled voice on one onnxruntime thread, returning durations beside the audio."""

    def __init__(self, threads: int = 1) -> None:
        import hibari
        import onnxruntime as ort
        from hibari import dsp
        from hibari.voices import voice_path

        if hibari.__version__ != TEACHER_VERSION:
            raise RuntimeError(f"teacher must be hibari-tts {TEACHER_VERSION}, "
                               f"found {hibari.__version__}")
        self._dsp = dsp
        self._tts = hibari.Hibari(voice=TEACHER_VOICE, threads=threads)
        model = Path(voice_path(TEACHER_VOICE, download_missing=False)).read_bytes()
        self.model_sha256 = hashlib.sha256(model).hexdigest()
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = threads
        options.log_severity_level = 3
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "teacher.onnx"
            path.write_bytes(with_extra_output(model, DURATION_TENSOR))
            self._session = ort.InferenceSession(str(path), options,
                                                 providers=["CPUExecutionProvider"])

    @property
    def sample_rate(self) -> int:
        return int(self._tts.sample_rate)

    def synthesize(self, text: str, seed: int) -> TeacherOutput:
        """One utterance; sentences hibari splits it into are concatenated. ``seed`` fixes the
        teacher's noise component, so the same (text, seed) gives the same samples."""
        rng = np.random.default_rng(seed)
        audio_parts, id_parts, duration_parts, phoneme_parts = [], [], [], []
        for phonemes in self._tts.phonemize(text):
            ids = self._tts.ids(phonemes)
            if len(ids) < 3:
                continue
            outputs = self._session.run(None, {"ids": np.asarray([ids], np.int64),
                                               "speed": np.asarray([1.0], np.float32)})
            lh, theta, ln, lr, phi, f0 = (o[0] for o in outputs[:6])  # each [601, F], f0 [F]
            durations = np.rint(outputs[6]).astype(np.int16)  # [num_ids]
            if durations.shape != (len(ids),) or 2 * int(durations.sum()) != lh.shape[1]:
                raise RuntimeError(f"durations {durations.shape} sum {int(durations.sum())} do not "
                                   f"match {len(ids)} ids and {lh.shape[1]} frames")
            wav = self._dsp.synth(lh, theta, ln, lr, phi, f0, rng)
            audio_parts.append(wav)
            id_parts.append(np.asarray(ids, np.int16))
            duration_parts.append(durations)
            phoneme_parts.append(phonemes)
        if not audio_parts:
            raise ValueError(f"the teacher produced no phonemes for {text!r}")
        audio = np.concatenate(audio_parts)
        pcm = (np.clip(audio, -1.0, 1.0) * 32767.0).astype(np.int16)
        return TeacherOutput(pcm, np.concatenate(id_parts), np.concatenate(duration_parts),
                             " ".join(phoneme_parts))
