"""SynthesisOptions and SamplingParams: validation once, sampling resolution, the wire form."""

from __future__ import annotations

import math
import sys
import subprocess

import pytest
from breezert.errors import InvalidRequest
from breezert.options import WIRE_FIELDS, SamplingParams, SynthesisOptions

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"speaker": ""}, "speaker"),
        ({"speaker": 3}, "speaker"),
        ({"instructions": " "}, "instructions"),
        ({"cfg_scale": math.nan}, "cfg_scale"),
        ({"cfg_scale": -1}, "cfg_scale"),
        ({"cfg_scale": "2"}, "cfg_scale"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": True}, "repetition_penalty"),
        ({"sampling": {"temperature": 1.0}}, "sampling"),
    ],
)
def test_invalid_options_are_named(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest, match=f"^{field}="):
        SynthesisOptions(**kwargs)  # type: ignore[arg-type]


def test_sampling_params_validate_every_field() -> None:
    for name, bad in (("depth_temperature", -1.0), ("depth_top_k", 2.5), ("depth_top_p", 0.0),
                      ("top_k", -3), ("temperature", math.nan)):
        with pytest.raises(InvalidRequest, match=f"^{name}="):
            SamplingParams(**{name: bad})  # type: ignore[arg-type]
    assert SamplingParams.greedy() == SamplingParams(temperature=0.0, repetition_penalty=1.0,
                                                     depth_temperature=0.0)


def test_resolve_sampling_layers_overrides_on_the_defaults() -> None:
    defaults = SamplingParams(temperature=0.7, top_k=30)
    assert SynthesisOptions().resolve_sampling(defaults) is defaults
    assert SynthesisOptions(temperature=0.2, top_p=0.9).resolve_sampling(defaults) == (
        SamplingParams(temperature=0.2, top_k=30, top_p=0.9))
    full = SamplingParams.greedy()
    assert SynthesisOptions(sampling=full).resolve_sampling(defaults) is full
    assert SynthesisOptions(sampling=full, top_k=5).resolve_sampling(defaults) == (
        SamplingParams(temperature=0.0, top_k=5, repetition_penalty=1.0, depth_temperature=0.0))


def test_wire_form_round_trips_and_sends_only_what_was_set() -> None:
    assert SynthesisOptions().to_mapping() == {}
    options = SynthesisOptions(speaker="[S3]", instructions="Calm.", cfg_scale=2.0, seed=9,
                               temperature=0.5, repetition_penalty=1.2)
    wire = options.to_mapping()
    assert set(wire) <= set(WIRE_FIELDS) and wire["speaker"] == "[S3]" and "top_k" not in wire
    assert SynthesisOptions.from_mapping(wire) == options
    assert SynthesisOptions.from_mapping({"seed": None, "format": "pcm"}) == SynthesisOptions()
    with pytest.raises(InvalidRequest, match="^temperature="):
        SynthesisOptions.from_mapping({"temperature": "hot"})
    with pytest.raises(InvalidRequest, match="^sampling="):
        SynthesisOptions(sampling=SamplingParams()).to_mapping()


def test_options_import_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None; "
            "from breezert.options import SynthesisOptions; "
            "print(SynthesisOptions(temperature=0.3).to_mapping())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "{'temperature': 0.3}"
