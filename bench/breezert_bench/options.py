"""What ``breezert-bench`` was asked to do: options, load points, defaults and metadata.

Owns: turning parsed CLI arguments into ``BenchOptions`` (naming the flag in every error), the
default config/texts/output paths, and a result's metadata (its options beside the machine,
software and commit from ``provenance``). Must not: run engines (``runner``) or format output
(``report``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from breezert.profiles import EMBEDDED_PROFILE, profile_path
from breezert_bench.provenance import provenance, repo_root
from breezert_bench.variants import BUILTIN_VARIANTS, Variant, resolve_variants
from breezert_bench.workload import BUILTIN_TEXTS, default_texts_path, load_texts

DEFAULT_CONCURRENCY = (1, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class LoadPoint:
    """Closed loop at ``value`` requests in flight, open loop at ``value`` requests/s, or the
    naive baseline's one-at-a-time sequence."""

    mode: str  # "closed" | "open" | "sequential"
    value: float

    @property
    def label(self) -> str:
        if self.mode == "closed":
            return f"c={int(self.value)}"
        if self.mode == "open":
            return f"r={self.value:g}/s"
        return "seq"

    def as_dict(self) -> dict[str, Any]:
        key = "rate_rps" if self.mode == "open" else "concurrency"
        value = self.value if self.mode == "open" else int(self.value)
        return {"mode": self.mode, key: value, "label": self.label}


@dataclass
class BenchOptions:
    """Everything ``breezert-bench`` was asked to do."""

    config_path: Path
    texts_path: Path | None = None
    concurrency: tuple[int, ...] = ()
    rates: tuple[float, ...] = ()
    num_requests: int = 300
    warmup: int = 2
    variants: list[Variant] = field(default_factory=lambda: [BUILTIN_VARIANTS["config"]])
    seed: int = 0
    feedback: bool = True
    feedback_period_s: float = 0.1
    request_timeout_s: float = 300.0
    run_budget_s: float | None = None
    """Stop starting new requests this long into a run (the run is marked truncated)."""
    naive_requests: int = 20
    """Requests of the naive baseline (sequential, so one load point only)."""
    model_path: str | None = None
    tokenizer_path: str | None = None
    """tokenizer.json for random weights; default: ``../shared/breeze/tokenizer/tokenizer.json``
    when present, so prompts have real Gemma token counts."""
    device: str | None = None
    torch_threads: int | None = None
    git_commit: str | None = None
    """Recorded instead of ``git rev-parse`` (for a copied tree without ``.git``)."""
    shard: tuple[int, int] | None = None
    """``(i, n)``: run only the i-th of n contiguous slices of each load point's requests (one GPU
    each; ``python -m breezert_bench.report --merge-shards`` joins the n result files). The naive
    baseline runs in shard 1 only. An open-loop shard offers its rate to its own GPU."""
    command_line: str = ""
    server_url: str | None = None
    """Drive the running ``breezert serve`` at this base URL over its WebSocket instead of
    building engines (``--server``); variants do not apply."""
    server_token: str | None = None
    """Its ``serving.auth_token`` (``BREEZERT_AUTH_TOKEN``), if it has one."""

    def load_points(self) -> list[LoadPoint]:
        concurrency = self.concurrency or (() if self.rates else DEFAULT_CONCURRENCY)
        return ([LoadPoint("closed", c) for c in concurrency]
                + [LoadPoint("open", r) for r in self.rates])


def default_config_path(cuda: bool) -> Path:
    if cuda:
        return repo_root() / "configs" / "h200-latency.toml"
    return profile_path(EMBEDDED_PROFILE)


def read_texts(path: Path | None) -> tuple[list[str], str]:
    """The texts and where they came from (a path, or ``builtin``)."""
    path = path or default_texts_path(repo_root())
    if path is None:
        return list(BUILTIN_TEXTS), "builtin"
    return load_texts(path), str(path)


# ------------------------------------------------------------------------------------ metadata


def collect_metadata(options: BenchOptions, base: Any, texts_source: str,
                     num_texts: int) -> dict[str, Any]:
    """Machine, software, commit, date and options of this benchmark."""
    import torch

    from breezert.runtime_setup import resolve_device

    device = str(resolve_device(base.model.device))
    return {
        "device": device,
        **provenance(device=device, git_commit_override=options.git_commit),
        "torch_threads": torch.get_num_threads(),
        "command_line": options.command_line,
        "config_path": str(options.config_path),
        "texts": texts_source,
        "num_texts": num_texts,
        "options": {
            "num_requests": options.num_requests, "warmup": options.warmup,
            "naive_requests": options.naive_requests, "seed": options.seed,
            "feedback": options.feedback, "feedback_period_s": options.feedback_period_s,
            "request_timeout_s": options.request_timeout_s,
            "run_budget_s": options.run_budget_s,
            "load_points": [p.as_dict() for p in options.load_points()],
            "variants": [v.name for v in options.variants],
            "shard": list(options.shard) if options.shard else None,
        },
    }


def collect_remote_metadata(options: BenchOptions, texts_source: str,
                            num_texts: int) -> dict[str, Any]:
    """This client's machine, commit, date and options for a run against a server."""
    return {
        "device": "remote", "server_url": options.server_url,
        **provenance(device="remote", git_commit_override=options.git_commit),
        "command_line": options.command_line,
        "config_path": None, "texts": texts_source, "num_texts": num_texts,
        "options": {
            "num_requests": options.num_requests, "warmup": options.warmup,
            "seed": options.seed, "feedback": options.feedback,
            "feedback_period_s": options.feedback_period_s,
            "request_timeout_s": options.request_timeout_s,
            "run_budget_s": options.run_budget_s,
            "load_points": [p.as_dict() for p in options.load_points()],
        },
    }


# ------------------------------------------------------------------------------------ CLI glue


def _comma_list(raw: str | None, kind: type, flag: str) -> tuple[Any, ...]:
    if raw is None:
        return ()
    try:
        values = tuple(kind(v) for v in raw.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{flag}={raw!r}: expected a comma list of numbers") from None
    if not values or any(not v > 0 for v in values):
        raise ValueError(f"{flag}={raw!r}: needs positive values")
    return values


def options_from_args(args: Any) -> tuple[BenchOptions, Path]:
    """``BenchOptions`` and the output path from ``breezert-bench``'s parsed arguments.

    Raises:
        ValueError: a list, count or variant is invalid (the message names the flag).
        FileNotFoundError: ``--config`` or ``--texts`` does not exist.
    """
    import torch

    cuda = args.device != "cpu" and torch.cuda.is_available()
    config_path = args.config or default_config_path(cuda)
    for flag, path in (("--config", config_path), ("--texts", args.texts)):
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"{flag}={str(path)!r} does not exist")
    for flag, value, least in (("--num-requests", args.num_requests, 1),
                               ("--warmup", args.warmup, 0),
                               ("--naive-requests", args.naive_requests, 1)):
        if value < least:
            raise ValueError(f"{flag}={value} must be >= {least}")
    if not 0 < args.feedback_period <= 10:
        raise ValueError(f"--feedback-period={args.feedback_period} must be in (0, 10] seconds")
    names = [n.strip() for n in (args.variants or "").split(",") if n.strip()]
    options = BenchOptions(
        config_path=Path(config_path), texts_path=args.texts,
        concurrency=_comma_list(args.concurrency, int, "--concurrency"),
        rates=_comma_list(args.rate, float, "--rate"),
        num_requests=args.num_requests, warmup=args.warmup,
        variants=resolve_variants(names, args.variant), seed=args.seed, feedback=args.feedback,
        feedback_period_s=args.feedback_period,
        request_timeout_s=args.request_timeout, run_budget_s=args.run_budget,
        naive_requests=args.naive_requests, model_path=args.model, device=args.device,
        tokenizer_path=args.tokenizer or _default_tokenizer(),
        torch_threads=args.torch_threads, git_commit=args.git_commit,
        shard=parse_shard(args.shard), command_line=_command_line(args),
        server_url=_server_url(getattr(args, "server", None)),
        server_token=os.environ.get("BREEZERT_AUTH_TOKEN") or None,
    )
    if options.shard and options.shard[1] > options.num_requests:
        raise ValueError(f"--shard={args.shard!r}: more shards than --num-requests="
                         f"{options.num_requests}")
    out = args.out or default_out_path(config_path)
    if out.suffix != ".json":
        raise ValueError(f"--out={str(out)!r} must end in .json (the PNG is written beside it)")
    return options, out


def _server_url(raw: str | None) -> str | None:
    if raw is None:
        return None
    if not raw.startswith(("http://", "https://")):
        raise ValueError(f"--server={raw!r}: expected the server's http(s):// base URL")
    return raw.rstrip("/")


def parse_shard(raw: str | None) -> tuple[int, int] | None:
    """``--shard I/N`` as ``(I, N)``, 1 <= I <= N; ``None`` when not given."""
    if raw is None:
        return None
    try:
        i, n = (int(part) for part in raw.split("/"))
    except ValueError:
        raise ValueError(f"--shard={raw!r}: expected I/N, e.g. 1/2") from None
    if not 1 <= i <= n:
        raise ValueError(f"--shard={raw!r}: needs 1 <= I <= N")
    return i, n


def default_out_path(config_path: Path) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return Path("bench") / "results" / f"{Path(config_path).stem}-{stamp}.json"


def _default_tokenizer() -> str | None:
    path = repo_root().parent / "shared" / "breeze" / "tokenizer" / "tokenizer.json"
    return str(path) if path.is_file() else None


def _command_line(args: Any) -> str:
    """The invocation as ``breezert-bench ...`` with every option spelled out."""
    parts = ["breezert-bench"]
    for key, value in sorted(vars(args).items()):
        if key == "command" or value is None or value == [] or callable(value):
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else f"--no-{key}")
        elif isinstance(value, list):
            parts += [item for v in value for item in (flag, str(v))]
        else:
            parts += [flag, str(value)]
    return " ".join(parts)
