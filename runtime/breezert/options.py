"""How a turn is spoken: the one options type that the plugin, the wire protocol and the runtime share.

Owns: ``SamplingParams`` (the sampling defaults, their one home), ``SynthesisOptions`` (voice,
instructions, CFG, seed and sampling overrides), each validated once on construction, and the
field checks the request types reuse. Must not: import torch or any BreezeRT module but
``errors`` and ``constants``, so a remote client can use it without the engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from breezert.constants import SPEAKER_NAMES
from breezert.errors import InvalidRequest

DEFAULT_SPEAKER = "[S0]"
"""The checkpoint's first built-in speaker."""


def speaker_name(speaker: str) -> str:
    """``"S3"`` or ``" [S3] "`` -> ``"[S3]"`` (the token's name)."""
    name = speaker.strip()
    return name if name.startswith("[") and name.endswith("]") else f"[{name}]"


def check(ok: bool, name: str, message: str, value: object) -> None:
    """Raises ``InvalidRequest`` naming ``name`` and its value unless ``ok``."""
    if not ok:
        raise InvalidRequest(f"{name}={value!r}: {message}")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_text(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


@dataclass(frozen=True)
class SamplingParams:
    """Backbone (first code) and depth-decoder sampling parameters of one request.

    These defaults are the released ``generation_config.json`` plus the recipe's repetition
    penalty 1.1; a checkpoint's own ``generation_config.json`` overrides them at load. A
    temperature of 0 means greedy (argmax); ``top_k`` 0 turns top-k off.
    """

    temperature: float = 0.9
    """Backbone softmax temperature (>= 0; 0 = argmax)."""
    top_k: int = 50
    """Backbone top-k (>= 0; 0 = off; ties with the k-th value are kept)."""
    top_p: float = 1.0
    """Backbone nucleus mass in (0, 1]; 1 = off."""
    repetition_penalty: float = 1.1
    """HF repetition penalty over previously generated first codes (> 0; 1 = off)."""
    depth_temperature: float = 0.9
    """Depth-decoder temperature (>= 0; 0 = argmax)."""
    depth_top_k: int = 50
    """Depth-decoder top-k (>= 0; 0 = off)."""
    depth_top_p: float = 1.0
    """Depth-decoder nucleus mass in (0, 1]."""

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_sampling_value(f.name, getattr(self, f.name))

    @staticmethod
    def greedy(repetition_penalty: float = 1.0) -> SamplingParams:
        """Argmax for both the backbone and the depth decoder."""
        return SamplingParams(
            temperature=0.0, repetition_penalty=repetition_penalty, depth_temperature=0.0
        )


def _check_sampling_value(name: str, value: object) -> None:
    if not is_number(value):
        raise InvalidRequest(f"{name}={value!r} must be a number")
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number):
        raise InvalidRequest(f"{name}={value!r} must be finite")
    if name.endswith("temperature") and number < 0:
        raise InvalidRequest(f"{name}={value!r} must be >= 0")
    if name.endswith("top_k") and (not is_int(value) or number < 0):
        raise InvalidRequest(f"{name}={value!r} must be an integer >= 0 (0 = off)")
    if name.endswith("top_p") and not 0 < number <= 1:
        raise InvalidRequest(f"{name}={value!r} must be in (0, 1]")
    if name == "repetition_penalty" and number <= 0:
        raise InvalidRequest(f"{name}={value!r} must be > 0")


SAMPLING_OVERRIDES = ("temperature", "top_k", "top_p", "repetition_penalty")
"""Backbone sampling fields a caller may set one by one (``SynthesisOptions``)."""


@dataclass(frozen=True)
class SynthesisOptions:
    """The voice and sampling of one turn, as a caller sets them; valid once constructed.

    Sampling left ``None`` comes from the checkpoint's defaults when the engine admits the turn
    (``resolve_sampling``): ``sampling`` replaces them all, and each of ``temperature``,
    ``top_k``, ``top_p``, ``repetition_penalty`` replaces one on top.

    Raises:
        InvalidRequest: naming the field.
    """

    speaker: str = DEFAULT_SPEAKER
    """A built-in speaker, ``[S0]`` (``S0`` is accepted too; the prompt checks it exists)."""
    instructions: str | None = None
    """Voice design / direction instruction; ``None`` = none."""
    cfg_scale: float = 1.0
    """Classifier-free guidance scale (>= 0); 1 = off, 0 = negative prompt only."""
    seed: int | None = None
    """Seed of the request's own RNG stream; ``None`` = the engine picks one."""
    sampling: SamplingParams | None = None
    """Every sampling parameter at once; ``None`` = the checkpoint's defaults."""
    temperature: float | None = None
    """Backbone temperature (>= 0; 0 = argmax); ``None`` = keep."""
    top_k: int | None = None
    """Backbone top-k (>= 0; 0 = off); ``None`` = keep."""
    top_p: float | None = None
    """Backbone nucleus mass in (0, 1]; ``None`` = keep."""
    repetition_penalty: float | None = None
    """Repetition penalty over generated first codes (> 0; 1 = off); ``None`` = keep."""

    def __post_init__(self) -> None:
        check(is_text(self.speaker), "speaker", "must be non-empty text", self.speaker)
        if speaker_name(self.speaker) not in SPEAKER_NAMES:
            raise InvalidRequest(f"speaker={self.speaker!r} is unknown; expected one of "
                                 f"{SPEAKER_NAMES[0]}..{SPEAKER_NAMES[-1]}")
        check(self.instructions is None or is_text(self.instructions), "instructions",
              "must be None or non-empty text", self.instructions)
        cfg = self.cfg_scale
        check(is_number(cfg), "cfg_scale", "must be a number", cfg)
        check(math.isfinite(cfg) and cfg >= 0, "cfg_scale", "must be finite and >= 0", cfg)
        check(self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**64), "seed",
              "must be None or an int in 0..2**64-1", self.seed)
        check(self.sampling is None or isinstance(self.sampling, SamplingParams), "sampling",
              "must be SamplingParams or None", type(self.sampling).__name__)
        for name in SAMPLING_OVERRIDES:
            value = getattr(self, name)
            if value is not None:
                _check_sampling_value(name, value)

    def resolve_sampling(self, defaults: SamplingParams) -> SamplingParams:
        """The sampling this turn runs with, over the checkpoint's ``defaults``."""
        base = self.sampling or defaults
        overrides = {n: getattr(self, n) for n in SAMPLING_OVERRIDES
                     if getattr(self, n) is not None}
        return replace(base, **overrides) if overrides else base

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> SynthesisOptions:
        """Options from wire fields (``speaker``, ``instructions``, ``cfg_scale``, ``seed`` and
        the sampling overrides); absent or ``None`` fields keep their defaults, others ignored.
        """
        given = {n: data[n] for n in WIRE_FIELDS if data.get(n) is not None}
        return cls(**given)

    def to_mapping(self) -> dict[str, Any]:
        """The wire fields that differ from the defaults (``from_mapping`` reads them back).

        Raises:
            InvalidRequest: ``sampling`` is set (it has no wire form; use the overrides).
        """
        check(self.sampling is None, "sampling", "has no wire form: set temperature, top_k, "
              "top_p or repetition_penalty", self.sampling)
        default = SynthesisOptions()
        return {n: getattr(self, n) for n in WIRE_FIELDS if getattr(self, n) != getattr(default, n)}


WIRE_FIELDS = ("speaker", "instructions", "cfg_scale", "seed", *SAMPLING_OVERRIDES)
"""``SynthesisOptions`` fields that travel in a JSON request (``sampling`` does not)."""
