"""SynthesisRequest validation and the Request/Segment bookkeeping helpers."""

from __future__ import annotations

import math

import pytest
from breezert.errors import InvalidRequest
import numpy as np
from breezert.options import WIRE_FIELDS, SamplingParams, SynthesisOptions
from breezert.request import (
    Reference,
    Request,
    RequestStatus,
    Segment,
    SegmentPhase,
    SynthesisRequest,
    num_cfg_branches,
)

pytestmark = pytest.mark.unit


def test_defaults_and_auto_id() -> None:
    a, b = SynthesisRequest("Hello."), SynthesisRequest("Hello.")
    assert a.request_id and b.request_id and a.request_id != b.request_id
    assert a.segments == ("Hello.",) and a.input_closed and a.options == SynthesisOptions()
    assert SynthesisRequest(["One.", "Two."]).segments == ("One.", "Two.")
    assert SynthesisRequest(["One."], chunk_schedule=[2, 4]).chunk_schedule == (2, 4)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"text": ""}, "text"),
        ({"text": "   "}, "text"),
        ({"text": ["ok", " "]}, "text"),
        ({"text": []}, "text"),
        ({"text": 5}, "text"),
        ({"speaker": ""}, "speaker"),
        ({"instructions": "  "}, "instructions"),
        ({"max_frames": 0}, "max_frames"),
        ({"max_frames": -3}, "max_frames"),
        ({"max_frames": 2.5}, "max_frames"),
        ({"chunk_schedule": ()}, "chunk_schedule"),
        ({"chunk_schedule": (1, 0)}, "chunk_schedule"),
        ({"chunk_schedule": (1, 65)}, "chunk_schedule"),
        ({"chunk_schedule": (1.0, 2)}, "chunk_schedule"),
        ({"cfg_scale": math.nan}, "cfg_scale"),
        ({"cfg_scale": -0.5}, "cfg_scale"),
        ({"cfg_scale": math.inf}, "cfg_scale"),
        ({"cfg_scale": True}, "cfg_scale"),
        ({"priority": 1.5}, "priority"),
        ({"priority": True}, "priority"),
        ({"seed": -1}, "seed"),
        ({"request_id": ""}, "request_id"),
        ({"reference": "voice.wav"}, "reference"),
    ],
)
def test_invalid_fields_are_named(kwargs: dict[str, object], field: str) -> None:
    values: dict[str, object] = {"text": "Hello."}
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in WIRE_FIELDS}
    values.update(kwargs)
    with pytest.raises(InvalidRequest, match=f"^{field}") as excinfo:
        SynthesisRequest(**values, options=SynthesisOptions(**options))  # type: ignore[arg-type]
    assert isinstance(excinfo.value, ValueError)


def test_text_is_never_echoed_in_errors() -> None:
    with pytest.raises(InvalidRequest) as excinfo:
        SynthesisRequest(["secret words", " "])
    assert "secret" not in str(excinfo.value)


def test_open_input_may_start_without_text() -> None:
    assert SynthesisRequest([], input_closed=False).segments == ()


def test_reference_validation() -> None:
    frame = list(range(16))
    ref = Reference("Reference words.", [frame, frame])
    assert ref.ref_codes.dtype == np.int64 and ref.ref_codes.tolist() == [frame, frame]
    assert not ref.ref_codes.flags.writeable and ref.num_frames == 2
    with pytest.raises(InvalidRequest, match="ref_text"):
        Reference(" ", [frame])
    with pytest.raises(InvalidRequest, match="ref_codes"):
        Reference("x", [])
    with pytest.raises(InvalidRequest, match="ref_codes"):
        Reference("x", [frame[:15]])
    with pytest.raises(InvalidRequest, match="ref_codes"):
        Reference("x", [[2048] * 16])
    with pytest.raises(InvalidRequest, match="ref_codes"):
        Reference("x", [[0.5] * 16])


def test_cfg_branches() -> None:
    assert [num_cfg_branches(s) for s in (1.0, 0.0, 1.5, 3.0)] == [1, 1, 2, 2]


def test_from_synthesis_copies_fields_and_checks_segments() -> None:
    options = SynthesisOptions(cfg_scale=2.0, seed=7, speaker="[S2]")
    synth = SynthesisRequest(["A.", "B."], priority=3, max_frames=40, request_id="r1",
                             input_closed=False, options=options)
    segments = [Segment((5, 3), prompt="p0"), Segment((6, 4), prompt="p1")]
    sampling = SamplingParams.greedy()
    request = Request.from_synthesis(synth, segments, sampling=sampling)
    assert (request.request_id, request.num_branches, request.seed, request.priority) == (
        "r1", 2, 7, 3)
    assert request.max_frames == 40 and request.chunk_schedule is None  # resolved at add
    assert [s.index for s in request.segments] == [0, 1]
    assert request.options is options and request.cfg_scale == 2.0
    assert request.sampling is sampling and not request.input_closed
    with pytest.raises(InvalidRequest, match="segments"):
        Request.from_synthesis(synth, segments[:1])
    with pytest.raises(InvalidRequest, match="prompt_lens"):
        Request.from_synthesis(synth, [Segment((5,)), Segment((6,))])


def test_segment_validation_and_blocks() -> None:
    seg = Segment((10, 7))
    assert seg.num_text_tokens == 17 and seg.prefill_cursors == [0, 0]
    assert seg.phase is SegmentPhase.QUEUED and not seg.is_generating
    seg.max_frames = 30
    assert seg.blocks_per_branch(16) == [3, 3]  # ceil(40 / 16), ceil(37 / 16)
    for bad in ((), (0,), (1, 2, 3), (4.0,)):
        with pytest.raises(InvalidRequest, match="prompt_lens"):
            Segment(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="num_text_tokens"):
        Segment((4,), num_text_tokens=-1)


def test_request_chunk_and_segment_helpers() -> None:
    request = Request("r", segments=[Segment((4,)), Segment((4,))], chunk_schedule=(1, 2, 4))
    assert request.status is RequestStatus.WAITING and not request.is_finished
    assert request.current_chunk_target == 1 and request.num_pending_frames == 0
    request.num_frames, request.num_decoded_frames = 10, 7
    request.chunk_emit_times = [0.1, 0.2, 0.3, 0.4]
    assert request.num_pending_frames == 3 and request.num_chunks == 4
    assert request.current_chunk_target == 4  # the last entry repeats
    assert request.first_chunk_time == 0.1 and request.last_chunk_time == 0.4
    assert request.active_segment is request.segments[0] and request.is_at_gap
    request.segments[0].phase = SegmentPhase.DECODE
    assert not request.is_at_gap and not request.is_generation_done
    for seg in request.segments:
        seg.phase = SegmentPhase.ENDED
    assert request.active_segment is None and request.is_generation_done
    request.input_closed = False
    assert not request.is_generation_done and request.is_at_gap
    with pytest.raises(InvalidRequest, match="prompt_lens"):
        request.add_segment(Segment((4, 4)))
    with pytest.raises(InvalidRequest, match="segment"):
        request.add_segment(request.segments[0])


def test_terminal_statuses() -> None:
    assert [s.is_finished for s in RequestStatus] == [False, False, True, True, True]
