"""Runtime configuration: one frozen pydantic model per concern, combined in ``EngineConfig``.

Owns the defaults, units and validation of every runtime knob, and the two entry points
``EngineConfig.from_file`` (TOML) and ``apply_env_overrides`` (the ONLY environment read). Must not
touch torch, devices or files beyond that one TOML read. Values measured at startup (KV blocks that
fit in memory, captured buckets) belong in the worker's resolved layout, never back in here.
"""

from __future__ import annotations

import ipaddress
import math
import os
import sys
from collections.abc import Mapping
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    model_validator,
)

from breezert.errors import InvalidConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10
    import tomli as tomllib

NO_CUDA_GRAPH_ENV = "BREEZERT_NO_CUDA_GRAPH"
AUTH_TOKEN_ENV = "BREEZERT_AUTH_TOKEN"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


def _check_buckets(name: str, buckets: tuple[int, ...]) -> None:
    if not buckets:
        raise ValueError(f"{name} must not be empty")
    if any(b <= 0 for b in buckets) or any(a >= b for a, b in pairwise(buckets)):
        raise ValueError(f"{name}={buckets} must be positive and strictly increasing")


class ModelConfig(_Frozen):
    """Which weights to load and where to run them."""

    path: str | None = None
    """Checkpoint directory (released HF layout). ``None``: random weights of ``preset``."""
    preset: Literal["tiny", "full"] = "tiny"
    """Model dimensions for random weights when ``path`` is ``None``."""
    dtype: Literal["bfloat16", "float16", "float32"] = "float32"
    """Weight and activation dtype (logits are computed in float32 regardless)."""
    device: Literal["cpu", "cuda", "auto"] = "auto"
    """``auto``: cuda when available, else cpu."""
    seed: int = Field(default=0, ge=0)
    """Seed of the random weight init (only used when ``path`` is ``None``)."""
    codec_precision: Literal["fp32", "tf32", "bf16", "fp16"] = "tf32"
    """Serving codec math on CUDA: ``tf32`` (fp32 storage, TF32 tensor cores for its convolutions
    and matmuls), ``fp32`` (TF32 off), ``bf16`` (a bf16 copy of the codec: faster, less exact),
    ``fp16`` (a float16 copy: bf16's tensor-core rate, 10 mantissa bits, range to 65504; each
    one's SNR is in bench/README.md). The golden and reference paths stay fp32; on CPU every
    choice but ``bf16`` and ``fp16`` is plain fp32."""
    tokenizer: str | None = None
    """``tokenizer.json`` for random weights (``path`` unset); ``None``: the built-in byte-level
    tokenizer, which spends one token per character (prompts about 4x longer than Gemma's)."""


class CacheConfig(_Frozen):
    """Backbone paged KV cache."""

    block_size: int = Field(default=16, gt=0, le=1024)
    """Tokens per KV block."""
    num_blocks: int | None = Field(default=None, gt=0)
    """KV blocks in the pool. ``None``: derive at startup: on CUDA as many as fit in
    ``gpu_memory_fraction`` of the device after the weights, capped at
    ``EngineConfig.worst_case_num_blocks``; elsewhere the worst case. Requests that find no free
    blocks wait (or are refused as overloaded), so a pool smaller than the worst case only
    lowers how many long requests run at once."""
    gpu_memory_fraction: float = Field(default=0.9, gt=0.0, le=1.0)
    """Share of the GPU's total memory this process may use when ``num_blocks`` is derived
    (as vLLM's ``gpu_memory_utilization``): the weights and anything already on the device
    count against it, KV blocks take the rest of it, and the remaining ``1 -
    gpu_memory_fraction`` is left for activations, the codec state, the slot table and
    CUDA graphs."""


class SchedulerConfig(_Frozen):
    """Admission, per-stage batch limits and the chunk schedule."""

    max_running_requests: int = Field(default=16, gt=0, le=4096)
    """Requests holding a slot at once (slots 0..max_running_requests-1)."""
    max_queued_requests: int = Field(default=64, ge=0)
    """Requests waiting for a slot; one more raises ``EngineOverloaded``."""
    max_queue_wait_s: float | None = Field(default=10.0, gt=0)
    """Longest a request may wait for a slot: one whose predicted wait (when the running
    requests ahead of it end, from their remaining audio and time per frame:
    ``sched/slot_wait.py``) is longer is refused at once with ``EngineOverloaded`` (HTTP 503 +
    ``Retry-After`` of that wait), and one still waiting after this long (its wait was unknown)
    is refused then. ``None``: wait as long as it takes."""
    admission_capacity: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Admission by real-time capacity (``sched/admission.py``): the seconds of audio per
    second the engine makes at full load, as measured for the profile; it then re-learns the
    figure from its own steps (``admission_learn_window_s``). A request is admitted only while
    the running streams' demand (1 s/s each while it generates, less the further its listener
    is ahead) plus its own 1 s/s stay within ``admission_headroom`` of it; otherwise it queues
    if its predicted wait for that room is within ``max_queue_wait_s``, else it is refused at
    once with that wait (``EngineOverloaded``, HTTP 503 + ``Retry-After``). ``None``: admission
    by slots and KV blocks only."""
    admission_headroom: float = Field(default=0.9, gt=0, le=1)
    """Share of ``admission_capacity`` the admitted streams' demand may fill (the rest is
    margin for start-ups, text encode and prefill, and step-time noise)."""
    admission_max_cycle_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Admission by frame cycle (``sched/admission.py``, ``FrameCycle``): a request is admitted
    only while the streams owed audio, itself included, stay within what the engine's measured
    frame cycle (busy time from one DEPTH step to the next) extrapolates to at this many
    seconds a cycle (``cycle_stream_limit``); otherwise it waits for running streams to end, or
    is refused at once when that predicted wait passes ``max_queue_wait_s``, as with
    ``admission_capacity``. About 0.04 keeps a newcomer's 1- and 2-frame chunks ahead of its
    listener (two cycles while 80 ms play). ``None``: no bound on the cycle."""
    admission_max_starting: int | None = Field(default=None, gt=0)
    """At most this many running streams in their start (owed audio, fewer than three chunks
    out) at once; a later arrival queues if a start is predicted to end within
    ``max_queue_wait_s`` and is otherwise refused at once with that wait (``EngineOverloaded``
    reason ``starting``). ``None``: no such bound."""
    admission_learn_window_s: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    """Busy seconds (steps and the host work between them) per sample of the learned capacity;
    0: keep ``admission_capacity`` fixed."""
    max_model_len: int = Field(default=2048, gt=2)
    """Backbone context per branch in tokens (prompt + frames); a segment stops at
    ``prompt_len + frames == max_model_len - 1`` (SPEC §2.5)."""
    max_lookahead_segments: int = Field(default=1, ge=0)
    """Segments after the active one that may text-encode and prefill ahead (each holds KV)."""
    max_text_encode_requests: int = Field(default=8, gt=0)
    """Requests per TEXT_ENCODE step."""
    max_text_encode_tokens: int = Field(default=2048, gt=0)
    """Text tokens per TEXT_ENCODE step (a longer single segment still runs alone)."""
    max_prefill_requests: int = Field(default=8, gt=0)
    """Requests per PREFILL step."""
    max_prefill_tokens: int = Field(default=512, gt=0)
    """Prompt tokens per PREFILL step (chunked-prefill budget; long prompts span steps)."""
    max_decode_requests: int = Field(default=16, gt=0)
    """Requests per DECODE step."""
    max_decode_rows: int = Field(default=32, ge=2)
    """Rows per DECODE step; a CFG request takes 2."""
    max_depth_requests: int = Field(default=16, gt=0)
    """Requests per DEPTH step."""
    max_depth_rows: int = Field(default=32, ge=2)
    """Rows per DEPTH step; a CFG request takes 2."""
    max_codec_requests: int = Field(default=16, gt=0)
    """Streams per CODEC step."""
    max_codec_frames: int = Field(default=64, gt=0, le=64)
    """Frames per CODEC item, i.e. the largest chunk (80 ms per frame)."""
    max_codec_step_frames: int = Field(default=256, gt=0)
    """Frames per CODEC step over all its items: bounds the step's duration so one batch of
    large chunks cannot hold a newcomer's first chunk back (the first item always fits)."""
    max_startup_codec_step_frames: int = Field(default=16, gt=0)
    """Frames per CODEC step led by a first chunk (``max_codec_step_frames`` still bounds it): a
    first packet does not wait for other streams' long chunks to be decoded with it."""
    default_chunk_schedule: tuple[int, ...] = (1, 2, 4, 8, 16)
    """Frames per chunk, in order; the last entry repeats."""
    default_max_frames: int = Field(default=750, gt=0)
    """Frame limit per segment when a request gives none (750 = 60 s of audio)."""
    starvation_limit_s: float = Field(default=0.5, gt=0)
    """A streaming request without a new chunk for this long gets served first. With
    ``use_predictor``: a request still without its first chunk this long past its first-chunk
    deadline (``predictor_ttfb_target_s`` after enqueue) is urgent, ranked with the urgent
    streams by slack, so that past capacity every admitted request starts within a bounded
    wait (urgent streams otherwise go before startup work for good)."""
    use_predictor: bool = False
    """Deadline-aware scheduling (``sched/policy.py``): serve by playback slack from the
    listener's reported buffer, wait to batch CODEC, emit partial chunks before an underrun.
    ``starvation_limit_s`` then bounds only the wait for a first chunk."""
    predictor_ttfb_target_s: float = Field(default=0.2, gt=0)
    """Deadline of a request's first chunk after enqueue, seconds."""
    predictor_overdue_startup_urgent: bool = False
    """A request still waiting for its first chunk whose slack falls below
    ``predictor_min_slack_s`` competes with urgent streams on slack (earliest deadline first
    across both) instead of waiting behind every urgent stream: a tighter bound on TTFB past
    capacity than ``starvation_limit_s`` alone, at the cost of stream gaps."""
    predictor_first_chunk_cover: bool = False
    """The first chunk carries enough audio to cover making the next one: as many frames of the
    schedule's first entry or more (up to its largest) as one more frame, a CODEC step and
    ``predictor_min_slack_s`` take by the stage-time model. Where a frame and a CODEC step take
    under 30 ms it stays the schedule's first entry; past that it costs first-packet time to
    spare the listener a hole right after the first chunk on an engine near real time."""
    predictor_min_slack_s: float = Field(default=0.05, ge=0)
    """A stream whose slack (deadline - now - predicted work) falls below this, seconds, is
    urgent: served before startup work; CODEC waits never take a stream below it."""
    predictor_max_lead_s: float = Field(default=2.0, gt=0)
    """A stream with more audio buffered than this, seconds, ranks last and yields DECODE/DEPTH
    batches that carry startup work."""
    predictor_feedback_stale_s: float = Field(default=0.5, gt=0)
    """A playback report older than this, seconds, is ignored (the buffer is estimated from the
    audio emitted since the first chunk instead)."""
    predictor_time_margin: float = Field(default=1.2, ge=1.0)
    """Factor on every predicted step time (safety margin)."""
    predictor_ewma_alpha: float = Field(default=0.2, gt=0, le=1)
    """Weight of a new step duration in the per-(stage, batch bucket) moving average."""
    predictor_prior_step_s: float = Field(default=0.02, gt=0)
    """Predicted step time of a stage before any step of it was observed, seconds."""

    @model_validator(mode="after")
    def _check(self) -> SchedulerConfig:
        schedule = self.default_chunk_schedule
        if not schedule or any(n <= 0 or n > self.max_codec_frames for n in schedule):
            raise ValueError(
                f"default_chunk_schedule={schedule} needs entries in 1..max_codec_frames"
                f"={self.max_codec_frames}"
            )
        if self.default_max_frames >= self.max_model_len - 1:
            raise ValueError(
                f"default_max_frames={self.default_max_frames} must be < max_model_len - 1"
                f"={self.max_model_len - 1}"
            )
        if not math.isfinite(self.starvation_limit_s):
            raise ValueError(f"starvation_limit_s={self.starvation_limit_s} must be finite")
        return self


CUDA_ONLY_SWITCHES = ("enable_cuda_graphs", "compile_depth", "fused_depth", "fused_depth_draw",
                      "fused_decode", "fused_prefill", "fused_text_encoder", "pdl")
"""``GraphConfig`` switches that need CUDA: refused on ``model.device='cpu'`` and all turned off
by ``BREEZERT_NO_CUDA_GRAPH=1``."""


class GraphConfig(_Frozen):
    """CUDA graphs, torch.compile and the fused kernels; all off runs the same code eagerly (CPU
    included). ``docs/configuration.md`` has one table of every switch (what the H200 profile
    sets, and why); ``bench/README.md`` the measurements behind them."""

    enable_cuda_graphs: bool = False
    """Capture and replay CUDA graphs per (stage, bucket); eager fallback past the last bucket."""
    compile_depth: bool = False
    """``torch.compile`` the whole depth frame (15-step loop with sampling) as one unit."""
    fused_depth: bool = False
    """Hand-fused Triton kernels for the depth decoder's layers (5 launches per layer, launch
    shapes per row bucket: ``kernels/fused_depth.py``); with it ``compile_depth`` compiles only
    the sampler."""
    fused_depth_draw: bool = False
    """Each depth code drawn by one Triton launch (``kernels/depth_draw.py``: guidance, reserved
    ids, temperature, top-k, top-p and the Gumbel draw) instead of about ten (the compiled
    sampler's ``topk`` among them); the first code keeps the sampler. Same codes but where
    top-p's boundary falls within the last bit of its mass."""
    pdl: bool = False
    """Programmatic dependent launch (Hopper) between the fused kernels of the depth layers and
    of the text encoder (those switched on): each kernel is placed while the one before it
    finishes and waits for it inside (``kernels/gemm.pdl_launch``), instead of starting after
    it; same bits. The DECODE and PREFILL kernels never use it (slower there on the H200)."""
    fused_decode: bool = False
    """Hand-fused Triton kernels for the backbone's DECODE step (6 launches per layer, attention
    reading the paged cache in place, ``kernels/fused_decode.py``)."""
    fused_prefill: bool = False
    """PREFILL steps of up to ``fused_prefill_max_tokens`` packed tokens through the fused
    Triton kernels (``kernels/fused_prefill.py``: 6 launches a layer instead of ~50); longer
    steps run the eager backbone."""
    fused_prefill_max_tokens: int = Field(default=256, ge=1, le=4096)
    """The longest PREFILL step the fused kernels take (tokens, padding included)."""
    fused_text_encoder: bool = False
    """Hand-fused Triton kernels for the text encoder's layers (7 launches per layer instead of
    ~70, ``kernels/fused_text_encoder.py``) for packed batches of up to
    ``fused_text_encoder_max_tokens``; longer ones run the eager encoder."""
    fused_text_encoder_max_tokens: int = Field(default=128, ge=1, le=4096)
    """With ``fused_text_encoder``: the longest packed batch the fused layers take (their GEMMs
    read each weight once per row block: of 64 rows, and past 128 tokens of 128 rows in 128 x 64
    tiles, ``kernels/fused_text_encoder.WIDE_ROWS``, the same bits on the H200)."""
    decode_batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """DECODE batch sizes in rows (CFG branches count)."""
    decode_context_buckets: tuple[int, ...] = (256, 512, 1024, 2048)
    """Attention context lengths in tokens (DECODE and PREFILL keys are padded up to one)."""
    depth_batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """DEPTH batch sizes in requests (a CFG graph runs two rows per request)."""
    prefill_token_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    """PREFILL tokens per step."""
    text_encode_buckets: tuple[int, ...] = (32, 64, 128)
    """Padded tokens per text piece (longer pieces run uncaptured)."""
    codec_buckets: tuple[int, ...] = (1, 2, 4, 8, 16)
    """CODEC batch sizes in streams."""
    fused_codec: bool = False
    """The codec's serving path (``StreamingCodec(fast=True)``): SnakeBeta fused with each
    conv's carried history (one Triton launch instead of six, CUDA only), one gather per
    codebook group, the upsamplers as GEMMs, the decoder's activations channels-last and its
    convs as 2-D channels-last convolutions, so no conv transposes its input and output and the
    residual units' conv biases ride passes made anyway (18-22 % off a CODEC step at every shape
    from 1 x 1 to 32 x 16 against channels-first, H100,
    ``bench/results/h100-codec-layout-ab-20261207-15.json``). Same arithmetic up to rounding
    order."""
    codec_replay_cost_frames: float = Field(default=24.0, ge=0)
    """Fixed cost of one CODEC replay in frame-equivalents: chunks of different sizes share a
    replay (each row decodes its own frames), grouped to minimise padded frames plus this per
    replay (a small replay is launch-bound)."""

    @model_validator(mode="after")
    def _check(self) -> GraphConfig:
        for name in (
            "decode_batch_buckets",
            "decode_context_buckets",
            "depth_batch_buckets",
            "prefill_token_buckets",
            "text_encode_buckets",
            "codec_buckets",
        ):
            _check_buckets(name, getattr(self, name))
        return self


class ServingConfig(_Frozen):
    """The HTTP/WebRTC server in front of the engine."""

    host: str = "127.0.0.1"
    """Bind address."""
    port: int = Field(default=8080, ge=0, le=65535)
    """Bind port (0 = any free port)."""
    max_peers: int = Field(default=16, gt=0)
    """Concurrent WebRTC peers."""
    max_text_chars: int = Field(default=4096, gt=0)
    """Characters of text per request (all segments). What binds per segment is the prompt's
    token limit (``scheduler.max_model_len`` - 2 tokens with the template, voice, instructions
    and reference); the server splits longer text into segments at sentence, then word
    boundaries (``breezert.text.split_text``), so any text up to this many characters fits."""
    turn_idle_timeout_s: float = Field(default=10.0, gt=0)
    """An open WebSocket/WebRTC turn (``more: true``) that gets no ``append`` or ``end`` for
    this long has its input closed: the text it has is spoken, then ``turn_done`` comes with
    ``reason: "idle_timeout"``. Frees the running slot an idle open turn would hold forever."""
    auth_token: SecretStr | None = None
    """Bearer token required from clients under ``/v1/``; ``None`` = no auth (local use only).
    Must not be empty or blank."""
    allow_unauthenticated: bool = False
    """Let ``breezert serve`` bind beyond loopback with no ``auth_token`` (anyone who can reach
    the port can synthesise); otherwise such a bind refuses to start."""
    allowed_origins: tuple[str, ...] = ()
    """Browser origins (``scheme://host[:port]``, e.g. ``https://app.example.com``) allowed to
    call the API, besides the server's own origin and loopback origins (``http://localhost``,
    ``127.0.0.0/8``, ``[::1]``, any port), which are always allowed; ``"*"`` allows every
    origin. A request carrying any other ``Origin`` header gets 403; one with none (not a
    browser) is not checked."""
    webrtc_connect_timeout_s: float = Field(default=10.0, gt=0, le=300)
    """Seconds a WebRTC peer has, from its offer, to reach ICE/DTLS ``connected``; a peer that
    has not is closed and its place under ``max_peers`` (and any request) freed."""
    webrtc_liveness_timeout_s: float = Field(default=10.0, gt=0, le=300)
    """Seconds a connected WebRTC peer may go without answering the server's ICE consent
    checks (STUN binding requests, one a second) before it is closed and its turn, engine
    request and place under ``max_peers`` freed: bounds how long a peer that vanished (network
    gone, no close) holds them, instead of ICE's own 30 s consent expiry (RFC 7675). A peer
    that is merely silent still answers consent checks and stays."""

    shutdown_grace_s: float = Field(default=10.0, ge=0, le=600)
    """SIGTERM/SIGINT drain: new work and ``/readyz`` get 503 at once, idle WebSockets and
    WebRTC peers are closed at once, turns and HTTP streams already running get up to this
    many seconds to finish; then everything left is closed and the process exits."""
    retry_after_s: int = Field(default=2, ge=0, le=3600)
    """``Retry-After`` seconds sent with every 503 (at capacity, not ready, draining)."""

    @model_validator(mode="after")
    def _check_auth_and_origins(self) -> ServingConfig:
        if self.auth_token is not None and not self.auth_token.get_secret_value().strip():
            raise ValueError("auth_token must not be empty: set a token, or leave auth_token "
                             "out for no auth (loopback only)")
        for origin in self.allowed_origins:
            if origin != "*" and (origin != origin.strip().rstrip("/") or "://" not in origin):
                raise ValueError(f"allowed_origins: {origin!r} must be '*' or "
                                 "scheme://host[:port] with no trailing slash")
        return self

    @property
    def is_loopback(self) -> bool:
        """The bind address is loopback only (127.0.0.0/8, ::1, localhost)."""
        return is_loopback_host(self.host)

    def binding_problem(self) -> str | None:
        """Why this config must not be served as is (a bind beyond loopback with no token and
        no ``allow_unauthenticated``), or ``None``."""
        if self.is_loopback or self.auth_token is not None or self.allow_unauthenticated:
            return None
        return (f"serving.host={self.host!r} is reachable beyond this machine and no "
                "serving.auth_token is set: set a token, bind 127.0.0.1, or pass "
                "--allow-unauthenticated (serving.allow_unauthenticated) to serve anyone who "
                "can reach the port")


def is_loopback_host(host: str) -> bool:
    """``host`` (an address or name, IPv6 with or without brackets) is loopback."""
    name = host.strip().strip("[]").lower().rstrip(".")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class EngineConfig(_Frozen):
    """The whole runtime configuration, loaded with ``EngineConfig.from_file``."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    graph: GraphConfig = GraphConfig()
    serving: ServingConfig = ServingConfig()

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.model.device == "cpu" and any(
                getattr(self.graph, name) for name in CUDA_ONLY_SWITCHES):
            names = ", ".join(f"graph.{name}" for name in CUDA_ONLY_SWITCHES)
            raise ValueError(f"model.device='cpu' needs {names} false")
        return self

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> EngineConfig:
        """Loads a TOML file with sections ``[model]``, ``[cache]``, ``[scheduler]``, ``[graph]``,
        ``[serving]`` (all optional; unknown keys are rejected).

        Raises:
            InvalidConfig: the file is not valid TOML, or a value is invalid; the message names
                the file and each field path (e.g. ``scheduler.max_running_requests``).
        """
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise InvalidConfig(f"{path}: invalid TOML: {exc}") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "<dict>") -> EngineConfig:
        """Validates a nested mapping shaped like the TOML file; errors as in ``from_file``."""
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            raise InvalidConfig(f"{source}: {_describe(exc)}") from None

    def worst_case_num_blocks(self) -> int:
        """KV blocks for every running request at full context with CFG and full lookahead:
        ``max_running_requests * 2 * (1 + max_lookahead_segments) * ceil(max_model_len /
        block_size)``. What ``cache.num_blocks=None`` derives before any memory cap."""
        s = self.scheduler
        per_request = (1 + s.max_lookahead_segments) * self.min_request_num_blocks()
        return s.max_running_requests * per_request

    def min_request_num_blocks(self) -> int:
        """KV blocks one segment may need at most (two CFG branches at full context): a pool
        smaller than this could refuse a valid request forever."""
        return 2 * -(-self.scheduler.max_model_len // self.cache.block_size)


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        message = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "value_error":  # our validators: the message starts with the field
            parts.append(f"{loc}.{message}" if loc else message)
            continue
        if "auth_token" not in loc:  # never echo a secret back
            message += f" (got {repr(err.get('input'))[:60]})"
        parts.append(f"{loc}: {message}")
    return "; ".join(parts)


def apply_env_overrides(
    cfg: EngineConfig, environ: Mapping[str, str] | None = None
) -> EngineConfig:
    """Applies the environment switches BreezeRT honours; the only place that reads them.

    ``BREEZERT_NO_CUDA_GRAPH=1`` turns off every switch of ``CUDA_ONLY_SWITCHES`` (graphs,
    compile and the fused kernels: plain eager PyTorch). Unset, empty or ``0`` changes nothing.
    ``BREEZERT_AUTH_TOKEN=<token>`` sets ``serving.auth_token`` (a Kubernetes Secret as an
    environment variable; the plugin's remote client reads the same name); unset or empty
    changes nothing.

    Args:
        cfg: The loaded config (not modified).
        environ: The environment to read; ``os.environ`` when ``None``.

    Raises:
        InvalidConfig: the variable holds something other than 0/1/true/false/yes/no.
    """
    env = os.environ if environ is None else environ
    token = env.get(AUTH_TOKEN_ENV, "").strip()
    if token:
        serving = cfg.serving.model_copy(update={"auth_token": SecretStr(token)})
        cfg = cfg.model_copy(update={"serving": serving})
    raw = env.get(NO_CUDA_GRAPH_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return cfg
    if raw not in ("1", "true", "yes"):
        raise InvalidConfig(f"{NO_CUDA_GRAPH_ENV}={raw!r}: expected 1 or 0")
    graph = cfg.graph.model_copy(update=dict.fromkeys(CUDA_ONLY_SWITCHES, False))
    return cfg.model_copy(update={"graph": graph})
