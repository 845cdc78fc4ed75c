// Listener-side playout reporter for BreezeRT agents on LiveKit (livekit-client v2, browser).
//
// Every 100 ms it reads getStats() of the agent's audio track(s) this browser plays and
// publishes the receiver's cumulative jitter-buffer counters on the data topic
// "breezert.playout". The agent (breezert_agent.TTS.listen_room) turns the deltas into the
// listener's real playback buffer and reports it to the engine for the turn that is playing.
//
// What it sees: the browser's jitter buffer (40-300+ ms, growing after any stall) and
// concealment (underruns). What it cannot see: the agent's own send queue (the plugin adds that
// itself) and audio in flight on the network.
//
// Usage:
//   import { Room } from "livekit-client";
//   import { startPlayoutReporter } from "./playout_reporter.js";
//   const room = new Room();
//   await room.connect(url, token);
//   const stop = startPlayoutReporter(room);            // every agent audio track
//   // startPlayoutReporter(room, { agentIdentity: "agent-AJ_xyz" }) to pick one agent
//   ...
//   stop();
//
// Message (JSON, UTF-8), one per subscribed agent audio track per interval; the counters are
// the RTCInboundRtpStreamStats names, cumulative since the track started:
//   {"type": "playout", "v": 1, "trackSid": "TR_...", "jitterBufferDelay": 12.3,
//    "jitterBufferEmittedCount": 480000, "jitterBufferTargetDelay": 11.0,
//    "jitterBufferMinimumDelay": 9.5, "concealedSamples": 960, "concealmentEvents": 2,
//    "totalSamplesReceived": 481000, "timestampMs": 1712345678901.2}

// No imports: livekit-client's Track.Kind.Audio is the string "audio", and staying free of
// imports lets tests/unit/test_agent_reporter_js.py run this file under Node with a fake room.
export const PLAYOUT_TOPIC = "breezert.playout";

const COUNTERS = [
  "jitterBufferDelay",
  "jitterBufferEmittedCount",
  "jitterBufferTargetDelay",
  "jitterBufferMinimumDelay",
  "concealedSamples",
  "concealmentEvents",
  "totalSamplesReceived",
];

/** The inbound-rtp audio entry of a stats report, or undefined. */
function inboundAudio(report) {
  let found;
  report?.forEach((stat) => {
    if (stat.type === "inbound-rtp" && stat.kind === "audio") found = stat;
  });
  return found;
}

/** Remote audio publications this browser is subscribed to (optionally of one participant). */
function agentAudioPublications(room, agentIdentity) {
  const publications = [];
  for (const participant of room.remoteParticipants.values()) {
    if (agentIdentity && participant.identity !== agentIdentity) continue;
    for (const publication of participant.trackPublications.values()) {
      if (publication.kind === "audio" && publication.track && publication.isSubscribed) {
        publications.push({ participant, publication });
      }
    }
  }
  return publications;
}

/**
 * Starts publishing playout stats; returns a function that stops it.
 *
 * @param {import("livekit-client").Room} room A connected room.
 * @param {{intervalMs?: number, topic?: string, agentIdentity?: string}} [options]
 */
export function startPlayoutReporter(room, options = {}) {
  const intervalMs = options.intervalMs ?? 100;
  const topic = options.topic ?? PLAYOUT_TOPIC;
  const encoder = new TextEncoder();
  let busy = false;

  async function reportOnce() {
    if (busy || room.state !== "connected") return; // never pile up slow getStats() calls
    busy = true;
    try {
      for (const { participant, publication } of agentAudioPublications(room, options.agentIdentity)) {
        const stat = inboundAudio(await publication.track.getRTCStatsReport());
        if (!stat || stat.jitterBufferEmittedCount === undefined) continue;
        const message = { type: "playout", v: 1, trackSid: publication.trackSid, timestampMs: stat.timestamp };
        for (const name of COUNTERS) {
          if (typeof stat[name] === "number") message[name] = stat[name];
        }
        // Lossy: each sample carries cumulative counters, so a lost one costs nothing.
        await room.localParticipant.publishData(encoder.encode(JSON.stringify(message)), {
          reliable: false,
          topic,
          destinationIdentities: [participant.identity],
        });
      }
    } catch (err) {
      console.debug("breezert playout reporter:", err);
    } finally {
      busy = false;
    }
  }

  const timer = setInterval(reportOnce, intervalMs);
  return () => clearInterval(timer);
}
