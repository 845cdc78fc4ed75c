"""The typed errors BreezeRT raises to its callers.

Owns the exception hierarchy only (all derive from ``BreezeRTError``). Must not import torch or
any other BreezeRT module, so every layer, the plugin included, can catch these cheaply.
"""

from __future__ import annotations


class BreezeRTError(Exception):
    """Base class of every error BreezeRT raises on purpose."""


class EngineOverloaded(BreezeRTError):
    """The engine cannot start the request soon enough: the waiting queue is full
    (``max_queued_requests``), its predicted wait for a slot, for real-time capacity, for room
    in the frame cycle or for a stream to get through its start passed ``max_queue_wait_s``,
    or it waited that long; retry later or elsewhere.

    Attributes:
        retry_after_s: When a retry may find room (the predicted wait), if known.
        reason: Why: ``queue_full``, ``slot_wait`` (no slot soon enough), ``capacity`` (the
            running streams leave no real-time capacity soon enough: ``sched/admission.py``),
            ``cycle`` (the frame cycle leaves no room for one more stream soon enough:
            ``admission_max_cycle_s``), ``starting`` (too many streams are in their start:
            ``admission_max_starting``) or ``waited`` (it waited past ``max_queue_wait_s``);
            ``None`` when not said.
    """

    def __init__(self, message: str, retry_after_s: float | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason


class RequestFailed(BreezeRTError):
    """A request ended with an error; other requests are unaffected.

    Attributes:
        request_id: The failed request.
        reason: A short description of the cause (never the synthesized text).
    """

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id} failed: {reason}")
        self.request_id = request_id
        self.reason = reason


class RequestAborted(BreezeRTError):
    """A request was aborted (by the caller or by cancelling its consumer)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id} was aborted")
        self.request_id = request_id


class InvalidRequest(BreezeRTError, ValueError):
    """A request's own fields are invalid; the message names the field."""


class InvalidConfig(BreezeRTError, ValueError):
    """A config file or value is invalid; the message names the field path."""
