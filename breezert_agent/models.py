"""Literal aliases and defaults shared by the plugin's modules; no behaviour lives here."""

from __future__ import annotations

from typing import Literal

TTSModels = Literal["breeze-tts-2"]
"""The model family the runtime serves (one checkpoint per runtime)."""

TTSSpeakers = Literal[
    "[S0]", "[S1]", "[S2]", "[S3]", "[S4]", "[S5]", "[S6]", "[S7]", "[S8]", "[S9]"
]
"""Speaker tokens Breeze-TTS-2 knows (``"S3"`` is accepted too)."""

FrameSizeMs = Literal[10, 20]
"""Duration of each ``rtc.AudioFrame`` the plugin emits."""

PlaybackSource = Literal["livekit-source", "livekit-client"]
"""``source`` tag of playback feedback: our ``rtc.AudioSource`` queue (sender side only), or
that plus the listener's jitter buffer reported by ``examples/playout_reporter.js``."""

DEFAULT_MODEL: TTSModels = "breeze-tts-2"
DEFAULT_SPEAKER = "[S0]"
SAMPLE_RATE = 24000
"""The codec's output rate; audio leaves the plugin at this rate, mono."""
NUM_CHANNELS = 1
DEFAULT_FRAME_SIZE_MS: FrameSizeMs = 20
PLAYOUT_TOPIC = "breezert.playout"
"""Data topic on which the listener-side reporter publishes its ``getStats()`` samples."""
DEFAULT_FEEDBACK_INTERVAL_S = 0.05
"""How often a running turn reports its playback buffer to the engine."""
LISTENER_STATS_MAX_AGE_S = 0.5
"""Listener stats older than this are ignored (the reporter sends one every 100 ms)."""
LISTENER_SETTLE_S = 0.3
"""How long after its first subscriber RoomIO's output starts a turn's audio
(``PlayoutFeedback.wait_for_listener``). RoomIO releases a held turn the moment the server
reports the subscription, while the subscriber is still setting up its receive path: a
``livekit.rtc`` listener then concealed 1560-1980 samples of speech in the first 100-200 ms in 3
of 6 such turns, though every packet reached it on time (4 Dec, a capture on loopback). Held 100
or 300 ms after the subscription, none of 13 turns concealed anything at its start; but held
100 ms, a fresh clone's turn on a quiet box (0.06 cores of foreign load, no machine stop)
concealed 1671 samples again, its first audio 165 ms after the subscription (4 Dec, later): the
receive path can take longer than 100 ms, so the hold covers the whole 100-200 ms window seen,
with margin. A turn that begins a TTFB or more after the subscription, the usual case, does
not wait; nor does one for SIP callers only (``PlayoutFeedback._settle_s``: LiveKit SIP took
the greeting whole without it, and held it cost a phone greeting ~250 ms)."""
SPEECH_STREAM_PATH = "/v1/audio/speech/stream"
"""WebSocket route of ``breezert serve`` for streamed turns."""
DEFAULT_MAX_SESSION_S = 300.0
"""A pooled WebSocket older than this is replaced before its next turn (``max_session_duration``)."""
DEFAULT_HEARTBEAT_S = 10.0
"""Ping period of pooled WebSockets; a pong missing for half of it closes the socket."""
DEFAULT_READINESS_INTERVAL_S = 0.5
"""With several replicas: how often each one's ``/readyz`` is read while the client is in use."""
RECEIVE_POLL_S = 0.05
"""How often a remote turn re-checks its receive deadline while it waits."""
CLOSE_TIMEOUT_S = 1.0
"""How long closing a WebSocket waits for the server's close frame."""
