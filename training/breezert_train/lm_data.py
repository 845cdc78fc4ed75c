"""LM training data: teacher audio encoded to codec frames (cached per shard), and seeded batches.

Owns: encoding the teacher shards' audio with a trained codec's encoder + quantizer into 16 codes
per 80 ms frame, cached as ``codes-<shard>.npz`` (11-bit packed, written atomically, keyed by
the codec file's hash so a new codec re-encodes) with the teacher's phonemes beside them (each
frame's phoneme from the durations, ``frame_phonemes``, and each utterance's phoneme sequence:
training-only targets); the in-memory utterance set (prompt ids exactly
as serving builds them with the built-in byte tokenizer, frames, a fixed held-out split); and
length-bucketed batches whose order is a pure function of (seed, epoch), so a resumed run draws
the same batches. Must not: train, build models or be imported by serving code.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from breezert.constants import NUM_CODEBOOKS, SAMPLES_PER_FRAME
from breezert.models.codec_encoder import CodecEncoder
from breezert.models.prompt import Prompt
from breezert.prompting import make_prompt
from breezert.tokenizer import BreezeTokenizer, build_byte_tokenizer
from breezert_train import shards

CODES_GLOB = "codes-*.npz"
CODE_BITS = 11  # codes are 0..2047
PHONEME_CLASSES = 178
"""hibari 0.2.1's phoneme ids are 0..177; 0 is its pad (silence at both ends; CTC's blank)."""
SAMPLES_PER_DURATION = 600
"""One teacher duration unit (40 Hz at 24 kHz, ``teacher.SAMPLES_PER_DURATION``)."""


# ------------------------------------------------------------------------------- packing
def pack_codes(codes: np.ndarray) -> np.ndarray:
    """``[..]`` ints in 0..2047 -> uint8 bytes, 11 bits each (LSB first)."""
    flat = np.asarray(codes, dtype=np.uint16).reshape(-1)
    if flat.size and int(flat.max()) >= 1 << CODE_BITS:
        raise ValueError("codes must be < 2048 to pack in 11 bits")
    bits = ((flat[:, None] >> np.arange(CODE_BITS, dtype=np.uint16)) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1), bitorder="little")


def unpack_codes(packed: np.ndarray, count: int) -> np.ndarray:
    """Inverse of ``pack_codes``: the first ``count`` codes as int64."""
    bits = np.unpackbits(packed, count=count * CODE_BITS, bitorder="little")
    weights = (1 << np.arange(CODE_BITS, dtype=np.int64))
    return (bits.reshape(count, CODE_BITS).astype(np.int64) * weights).sum(axis=1)


def frame_phonemes(phoneme_ids: np.ndarray, durations: np.ndarray, num_frames: int
                   ) -> np.ndarray:
    """The teacher's phoneme id at the centre of each 80 ms frame (``num_frames`` of them),
    from its per-phoneme durations (40 Hz units); past the last phoneme: 0 (pad)."""
    ends = np.cumsum(np.asarray(durations, np.int64)) * SAMPLES_PER_DURATION  # [num_ids]
    centres = np.arange(num_frames) * SAMPLES_PER_FRAME + SAMPLES_PER_FRAME // 2
    index = np.searchsorted(ends, centres, side="right")
    ids = np.append(np.asarray(phoneme_ids, np.int64), 0)
    return ids[np.minimum(index, len(ids) - 1)].astype(np.int16)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ------------------------------------------------------------------------------- encoding
@torch.no_grad()
def encode_batch(encoder: CodecEncoder, clips: list[np.ndarray], device: torch.device
                 ) -> list[np.ndarray]:
    """int16 clips -> ``[ceil(n / 1920), 16]`` codes each. Every clip is zero-padded to whole
    frames (the last, partial frame is encoded as padded with silence), and clips share one
    batch: the encoder is causal, so padding after a clip leaves its frames as alone."""
    num_frames = [max(1, -(-len(c) // SAMPLES_PER_FRAME)) for c in clips]
    wav = torch.zeros(len(clips), max(num_frames) * SAMPLES_PER_FRAME)
    for row, clip in enumerate(clips):
        wav[row, : len(clip)] = torch.from_numpy(clip.astype(np.float32) / 32768.0)
    codes = encoder.encode(wav.to(device)).cpu().numpy()  # [B, K, 16]
    return [codes[row, :n] for row, n in enumerate(num_frames)]


def encode_shards(teacher_dir: str | Path, codec_dir: str | Path, cache_dir: str | Path,
                  device: str | torch.device = "cpu", batch_samples: int = 24000 * 240
                  ) -> list[Path]:
    """Encodes every complete teacher shard not yet cached under ``cache_dir`` for this codec.

    Returns the cache files. ``batch_samples`` bounds one encoder call (clips sorted by length).
    """
    from breezert.loader import load_checkpoint

    teacher_dir, cache_dir = Path(teacher_dir), Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    codec_file = Path(codec_dir) / "audio_tokenizer" / "model.safetensors"
    codec_sha = file_sha256(codec_file)
    encoder = None
    outs = []
    for shard in sorted(teacher_dir.glob(shards.SHARD_GLOB)):
        out = cache_dir / f"codes-{shard.stem.removeprefix('shard-')}.npz"
        outs.append(out)
        if out.is_file() and _cached_codec(out) == codec_sha:
            continue
        if encoder is None:
            encoder = load_checkpoint(codec_dir).codec_encoder
            if encoder is None:
                raise ValueError(f"{codec_dir}: the codec export has no encoder tensors")
            encoder = encoder.to(device).eval()
        _encode_one(shard, out, encoder, torch.device(device), codec_sha, batch_samples)
    return outs


def _cached_codec(path: Path) -> str:
    with np.load(path, allow_pickle=False) as data:
        return bytes(data["codec_sha256"]).decode()


def _encode_one(shard: Path, out: Path, encoder: CodecEncoder, device: torch.device,
                codec_sha: str, batch_samples: int) -> None:
    arrays = shards.read_shard(shard)
    offsets, meta = arrays["audio_offsets"], json.loads(bytes(arrays["meta"]).decode())
    clips = [arrays["audio"][offsets[i] : offsets[i + 1]] for i in range(len(meta))]
    codes: list[np.ndarray | None] = [None] * len(clips)
    order = sorted(range(len(clips)), key=lambda i: len(clips[i]))
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end - start + 1) * len(clips[order[end]]) <= batch_samples:
            end += 1
        rows = order[start:end]
        for i, c in zip(rows, encode_batch(encoder, [clips[i] for i in rows], device)):
            codes[i] = c
        start = end
    frames = np.cumsum([0] + [len(c) for c in codes], dtype=np.int64)  # type: ignore[arg-type]
    flat = np.concatenate(codes)  # [total frames, 16]
    texts = [{"utterance_id": m["utterance_id"], "text": m["text"]} for m in meta]
    ph_off = arrays["phoneme_offsets"]
    per_frame = [frame_phonemes(arrays["phoneme_ids"][ph_off[i]:ph_off[i + 1]],
                                arrays["durations"][ph_off[i]:ph_off[i + 1]], len(c))
                 for i, c in enumerate(codes)]  # type: ignore[arg-type]
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, packed=pack_codes(flat), num_frames=np.int64(len(flat)), frame_offsets=frames,
                 meta=np.frombuffer(json.dumps(texts).encode(), np.uint8),
                 codec_sha256=np.frombuffer(codec_sha.encode(), np.uint8),
                 frame_phonemes=np.concatenate(per_frame),
                 phoneme_ids=arrays["phoneme_ids"].astype(np.int16), phoneme_offsets=ph_off)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)


# ------------------------------------------------------------------------------- utterances
@dataclass(frozen=True)
class Utterance:
    utterance_id: int
    text: str
    prompt: Prompt
    codes: torch.Tensor  # [T, 16] long
    frame_phonemes: torch.Tensor | None = None  # [T] long: the teacher's phoneme per frame
    phonemes: torch.Tensor | None = None  # [P] long: its phoneme sequence, pads dropped

    @property
    def num_tokens(self) -> int:
        """Backbone positions: the prompt, the frames, and none for EOS (predicted at the end)."""
        return self.prompt.num_tokens + int(self.codes.shape[0])


def byte_tokenizer() -> BreezeTokenizer:
    return BreezeTokenizer(build_byte_tokenizer())


def make_utterance(tokenizer: BreezeTokenizer, utterance_id: int, text: str,
                   codes: np.ndarray | torch.Tensor, frame_phonemes: np.ndarray | None = None,
                   phonemes: np.ndarray | None = None) -> Utterance:
    """The prompt as serving builds it (``prompting.make_prompt``, speaker [S0], plain)."""
    codes = torch.as_tensor(np.asarray(codes), dtype=torch.long).reshape(-1, NUM_CODEBOOKS)

    def ids(a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else torch.as_tensor(np.asarray(a, np.int64))

    seq = None if phonemes is None else np.asarray(phonemes)[np.asarray(phonemes) != 0]
    return Utterance(utterance_id, text, make_prompt(tokenizer, text), codes,
                     ids(frame_phonemes), ids(seq))


def load_utterances(cache_dir: str | Path, max_frames: int = 250, max_text_tokens: int = 400
                    ) -> list[Utterance]:
    """Every cached utterance with 1..``max_frames`` frames, in file order."""
    tokenizer = byte_tokenizer()
    items = []
    for path in sorted(Path(cache_dir).glob(CODES_GLOB)):
        with np.load(path, allow_pickle=False) as data:
            flat = unpack_codes(data["packed"], int(data["num_frames"]) * NUM_CODEBOOKS)
            offsets = data["frame_offsets"]
            meta = json.loads(bytes(data["meta"]).decode())
            # caches written before the phonemes were kept have none
            ph = {k: data[k] for k in ("frame_phonemes", "phoneme_ids", "phoneme_offsets")
                  if k in data.files}
        flat = flat.reshape(-1, NUM_CODEBOOKS)
        for row, m in enumerate(meta):
            start, end = offsets[row], offsets[row + 1]
            codes = flat[start:end]
            if not 1 <= len(codes) <= max_frames or not m["text"].strip():
                continue
            extra = (ph["frame_phonemes"][start:end], ph["phoneme_ids"][
                ph["phoneme_offsets"][row]:ph["phoneme_offsets"][row + 1]]) if ph else ()
            utt = make_utterance(tokenizer, int(m["utterance_id"]), m["text"], codes, *extra)
            if utt.prompt.num_tokens <= max_text_tokens:
                items.append(utt)
    return items


def split_heldout(items: list[Utterance], every: int = 100) -> tuple[list[Utterance],
                                                                     list[Utterance]]:
    """(train, held out): utterance ids divisible by ``every`` are held out."""
    return ([u for u in items if u.utterance_id % every],
            [u for u in items if not u.utterance_id % every])


# ------------------------------------------------------------------------------- batches
def epoch_batches(items: list[Utterance], max_tokens: int, seed: int, epoch: int,
                  pool: int = 64) -> list[list[int]]:
    """Length-bucketed batches of one epoch: shuffle, sort pools of ``pool`` x the typical batch
    by length, cut batches of at most ``max_tokens`` padded positions, shuffle the batches."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(items), generator=gen).tolist()
    lengths = [items[i].num_tokens + 1 for i in order]
    per_batch = max(1, max_tokens // max(1, int(np.median(lengths))))
    span = pool * per_batch
    batches: list[list[int]] = []
    for start in range(0, len(order), span):
        chunk = sorted(order[start : start + span], key=lambda i: items[i].num_tokens)
        batch: list[int] = []
        for i in chunk:
            longest = items[i].num_tokens + 1  # the pool is sorted: the newest is the longest
            if batch and longest * (len(batch) + 1) > max_tokens:
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch:
            batches.append(batch)
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in perm]


class BatchStream:
    """Endless batches over epochs; its state is ``(epoch, index)``."""

    def __init__(self, items: list[Utterance], max_tokens: int, seed: int) -> None:
        if not items:
            raise ValueError("no training utterances")
        self.items, self.max_tokens, self.seed = items, max_tokens, seed
        self.epoch, self.index = 0, 0
        self._batches = epoch_batches(items, max_tokens, seed, 0)

    def next(self) -> list[Utterance]:
        if self.index >= len(self._batches):
            self.epoch, self.index = self.epoch + 1, 0
            self._batches = epoch_batches(self.items, self.max_tokens, self.seed, self.epoch)
        batch = self._batches[self.index]
        self.index += 1
        return [self.items[i] for i in batch]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._batches = epoch_batches(self.items, self.max_tokens, self.seed, self.epoch)


def iter_fixed_batches(items: list[Utterance], max_tokens: int) -> Iterator[list[Utterance]]:
    """Held-out batches in a fixed order (sorted by length)."""
    batch: list[Utterance] = []
    for utt in sorted(items, key=lambda u: (u.num_tokens, u.utterance_id)):
        if batch and (utt.num_tokens + 1) * (len(batch) + 1) > max_tokens:
            yield batch
            batch = []
        batch.append(utt)
    if batch:
        yield batch
