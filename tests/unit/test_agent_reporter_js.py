"""``examples/playout_reporter.js`` under Node with a fake livekit-client room, its messages fed
to the plugin's ``breezert.playout`` handler: the two ends of the protocol agree.

Owns: the reporter's message format and cadence as the plugin parses it. Must not: need a
browser, livekit-client or a server (skipped when ``node`` is not installed).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from livekit import rtc

from breezert_agent.client import TurnOptions
from breezert_agent.playout import PlayoutFeedback
from tests.components import needs
from tests.unit.test_agent_tts import FakeRuntimeClient, FakeTurn

pytestmark = pytest.mark.unit

REPORTER = Path(__file__).resolve().parents[2] / "examples" / "playout_reporter.js"

# A fake Room: one agent with one subscribed audio track whose jitter buffer holds 150 ms
# (each getStats() call: 2400 more samples emitted, each after 0.15 s in the buffer), one
# listener-side screen-share track that must be ignored, and a publishData that prints.
HARNESS = """
import { startPlayoutReporter } from %(reporter)s;
let calls = 0;
const stats = () => {
  calls += 1;
  const emitted = 2400 * calls;
  return new Map([["in", {type: "inbound-rtp", kind: "audio", timestamp: 1000 + calls * 100,
    jitterBufferDelay: 0.15 * emitted, jitterBufferEmittedCount: emitted,
    jitterBufferTargetDelay: 0.12 * emitted, concealedSamples: calls > 2 ? 480 : 0,
    concealmentEvents: calls > 2 ? 1 : 0, totalSamplesReceived: emitted + 960}]]);
};
const audio = {kind: "audio", trackSid: "TR_agent", isSubscribed: true,
               track: {getRTCStatsReport: async () => stats()}};
const video = {kind: "video", trackSid: "TR_cam", isSubscribed: true,
               track: {getRTCStatsReport: async () => new Map()}};
const room = {
  state: "connected",
  remoteParticipants: new Map([["agent-1", {identity: "agent-1",
                                trackPublications: new Map([["a", audio], ["v", video]])}]]),
  localParticipant: {publishData: async (data, opts) => {
    console.log(JSON.stringify({payload: new TextDecoder().decode(data), opts}));
  }},
};
const stop = startPlayoutReporter(room, {intervalMs: 20});
setTimeout(() => { stop(); }, 130);
"""


@needs(binary="node", make_target="livekit-web")  # its npm ci needs node too
def test_js_reporter_messages_drive_the_plugin_handler(tmp_path: Path) -> None:
    harness = tmp_path / "harness.mjs"
    harness.write_text(HARNESS % {"reporter": json.dumps(REPORTER.as_uri())})
    result = subprocess.run(["node", str(harness)], capture_output=True, text=True, timeout=20,
                            check=False)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) >= 3
    for line in lines:
        assert line["opts"] == {"reliable": False, "topic": "breezert.playout",
                                "destinationIdentities": ["agent-1"]}

    feedback = PlayoutFeedback()
    turn = FakeTurn(FakeRuntimeClient(), "req", TurnOptions(), ["Hi."], True)
    feedback.begin(turn)
    for line in lines:
        feedback.on_data_packet(rtc.DataPacket(
            data=line["payload"].encode(), kind=rtc.DataPacketKind.KIND_LOSSY,
            participant=SimpleNamespace(identity="listener-1"),  # type: ignore[arg-type]
            topic=line["opts"]["topic"]))
    assert feedback.num_bad_packets == 0
    stats = feedback.listeners["listener-1/TR_agent"]
    assert stats.delay_s == pytest.approx(0.15) and stats.target_delay_s == pytest.approx(0.12)
    assert len(turn.reports) == len(lines) - 1  # the first message is the baseline
    assert all(r[0] == pytest.approx(0.15) and r[2] == "livekit-client" for r in turn.reports)
    assert feedback.num_concealed_samples == 480
