"""The plugin's one interface to a BreezeRT runtime: ``RuntimeClient`` opens ``Turn``s.

Owns: the interfaces, ``TurnOptions`` (a turn's ``SynthesisOptions`` and streaming settings) and
``RuntimeUnavailable``. Must not: import LiveKit, torch, the engine or a transport.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from breezert.errors import BreezeRTError
from breezert.options import SynthesisOptions

from ..log import logger
from ..models import SAMPLE_RATE


class RuntimeUnavailable(BreezeRTError):
    """The runtime cannot be reached: connecting failed, or the socket closed mid-turn."""


def log_queued(request_id: str, num_waiting: int | None, max_running: int | None) -> None:
    """The one line that says why a turn's audio is late: it waits for a running slot."""
    logger.info(
        "breezert turn %s is queued: the engine's %s running-request slots are all taken "
        "(max_running_requests; an open turn holds its slot until its input closes); "
        "%s waiting", request_id, max_running if max_running is not None else "",
        num_waiting if num_waiting is not None else "some",
        extra={"request_id": request_id, "queued": True})


@dataclass(frozen=True)
class TurnOptions:
    """Settings of one turn (one engine request): the runtime's own ``SynthesisOptions`` for
    the voice and sampling, plus how the engine streams it."""

    voice: SynthesisOptions = field(default_factory=SynthesisOptions)
    """Speaker, instructions, CFG, seed and sampling overrides (validated on construction)."""
    chunk_schedule: tuple[int, ...] | None = None
    """Frames per chunk, last entry repeating; ``None`` = the engine's default."""
    max_frames: int | None = None
    """Frame limit per segment (80 ms each); ``None`` = the engine's default."""
    priority: int = 0


@dataclass(frozen=True)
class SegmentStart:
    """Where text segment ``index`` of a turn (0 = the first text sent) starts in the turn's
    audio: ``start_s`` seconds in, exact to one 80 ms codec frame. ``Turn.audio`` yields it
    before that segment's first audio."""

    index: int
    start_s: float


class Turn(ABC):
    """One running turn: append segments while it plays, then close or abort it."""

    request_id: str
    connection_reused: bool = False
    """Remote: the turn runs on a pooled socket; in-process: the shared engine was loaded."""
    acquire_time: float = 0.0
    """Seconds spent getting the connection (remote) or loading the engine (in-process)."""
    base_url: str | None = None
    """Remote: the ``breezert serve`` replica the turn runs on; in-process: ``None``."""

    @abstractmethod
    async def append(self, text: str) -> None:
        """Adds one text segment (a sentence) to the running request."""

    @abstractmethod
    async def close_input(self) -> None:
        """No more segments: the turn ends after the last one."""

    @abstractmethod
    async def abort(self) -> None:
        """Stops the request now and frees its engine resources (idempotent)."""

    @abstractmethod
    def report_playback(self, buffered_s: float, measured_at: float, source: str) -> None:
        """Tells the engine how much of this turn's audio is queued ahead of the playhead.

        ``measured_at`` is ``time.monotonic()`` on this machine. Never raises.
        """

    @abstractmethod
    def audio(self) -> AsyncIterator[bytes | SegmentStart]:
        """The turn's audio as PCM16 little-endian mono bytes at ``SAMPLE_RATE``, with a
        ``SegmentStart`` before each segment's first audio where the runtime tells (an old
        server does not); iterate once.

        Raises the runtime's errors (``RequestFailed``, ``EngineOverloaded``, ...).
        """


class RuntimeClient(ABC):
    """Opens turns on a BreezeRT runtime; ``sample_rate`` is the rate of every turn's audio."""

    sample_rate: int = SAMPLE_RATE
    num_queued_turns: int = 0
    """Turns the runtime said had to wait for a running slot (``log_queued`` logged each)."""

    @abstractmethod
    async def open_turn(
        self,
        texts: Sequence[str],
        options: TurnOptions,
        *,
        request_id: str,
        input_closed: bool,
        timeout: float | None = None,
    ) -> Turn:
        """Submits one request with its first segments.

        Args:
            texts: The segments known now (may be empty only when ``input_closed`` is False).
            options: Voice and generation settings.
            request_id: Unique id for the request (the plugin's LiveKit request id).
            input_closed: False: more segments follow via ``Turn.append``.
            timeout: Seconds allowed to reach the runtime (remote only).
        """

    def prewarm(self) -> None:
        """Starts loading or connecting in the background; never blocks."""

    async def aclose(self) -> None:
        """Releases what this client holds (never the process-wide shared engine)."""
