"""Benchmark variants: named engine-config overrides run side by side in one process.

Owns: the ablation variants of issue 4 (fixed vs progressive chunks, compiled depth, CUDA graphs,
the naive offline baseline), ``--variant`` specs and applying overrides to a base profile. Must
not: implement anything the flags name; the engine does.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10
    import tomli as tomllib

PROGRESSIVE = [1, 2, 4, 8, 16]


@dataclass(frozen=True)
class Variant:
    """A named set of config overrides run side by side with the others in one process."""

    name: str
    overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """``{section: {key: value}}`` merged over the base profile."""
    description: str = ""
    is_naive: bool = False
    """Run the offline baseline (``synthesize_whole``, one request at a time) instead."""
    profile: str | None = None
    """A TOML profile whose sections replace the base profile's for this variant
    (``NAME=@PATH``), all but ``[model]`` (the run's weights, tokenizer and device stay): two
    profiles side by side in one run; ``overrides`` then apply over it."""


def _eager(schedule: list[int], *, fast_depth: bool = False, graphs: bool = False) -> dict:
    """``fast_depth``: the fused Triton depth layers and the compiled sampler. The ablation runs
    without the predictor (issue 5 compares it separately), whatever the profile says."""
    return {
        "scheduler": {"default_chunk_schedule": schedule, "use_predictor": False},
        "graph": {"enable_cuda_graphs": graphs, "compile_depth": fast_depth,
                  "fused_depth": fast_depth},
    }


BUILTIN_VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("config", {}, "the profile as given"),
    Variant("fixed16-eager", _eager([16]), "16-frame chunks from the first, no compile/graphs"),
    Variant("progressive-eager", _eager(PROGRESSIVE), "chunks 1,2,4,8,16, no compile/graphs"),
    Variant("progressive-compiled", _eager(PROGRESSIVE, fast_depth=True),
            "progressive + fused Triton depth layers and compiled sampler, no graphs"),
    Variant("progressive-graphs", _eager(PROGRESSIVE, fast_depth=True, graphs=True),
            "progressive + fused depth + CUDA graphs at every stage"),
    Variant("progressive-graphs-inductor",
            {"scheduler": {"default_chunk_schedule": PROGRESSIVE, "use_predictor": False},
             "graph": {"enable_cuda_graphs": True, "compile_depth": True, "fused_depth": False}},
            "progressive + torch.compile'd depth step (Inductor) + CUDA graphs"),
    Variant("naive", {"graph": {"enable_cuda_graphs": False, "compile_depth": False,
                                "fused_depth": False}},
            "offline baseline: one request at a time, eager, whole utterance then decode",
            is_naive=True),
)}


def _toml_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare word: a string


def parse_variant_spec(spec: str) -> Variant:
    """``NAME=[BASE;]section.key=value[;section.key=value...]`` (values in TOML syntax), e.g.
    ``predictor-on=progressive-graphs;scheduler.use_predictor=true``; ``BASE`` may be ``@PATH``,
    another profile file in place of ``--config`` (``latency-64=@configs/h200-latency.toml``).

    Raises:
        ValueError: the spec is malformed or names an unknown base variant.
    """
    name, sep, body = spec.partition("=")
    name = name.strip()
    if not sep or not name or "," in name:
        raise ValueError(f"--variant {spec!r}: expected NAME=[BASE;]section.key=value;...")
    overrides: dict[str, dict[str, Any]] = {}
    is_naive, parts = False, [p.strip() for p in body.split(";") if p.strip()]
    profile = None
    if parts and parts[0].startswith("@"):
        profile, parts = parts[0][1:].strip(), parts[1:]
        if not profile:
            raise ValueError(f"--variant {spec!r}: '@' needs a profile path")
    elif parts and "=" not in parts[0]:
        base = BUILTIN_VARIANTS.get(parts[0])
        if base is None:
            raise ValueError(f"--variant {spec!r}: unknown base variant {parts[0]!r} "
                             f"(choose from {', '.join(BUILTIN_VARIANTS)})")
        overrides = {s: dict(kv) for s, kv in base.overrides.items()}
        is_naive, parts = base.is_naive, parts[1:]
    for part in parts:
        key, _, raw = part.partition("=")
        section, dot, leaf = key.strip().partition(".")
        if not dot or not leaf or not raw.strip():
            raise ValueError(f"--variant {spec!r}: {part!r} is not section.key=value")
        overrides.setdefault(section, {})[leaf] = _toml_value(raw.strip())
    return Variant(name, overrides, f"custom: {body}", is_naive=is_naive, profile=profile)


def resolve_variants(names: Sequence[str], specs: Sequence[str] = ()) -> list[Variant]:
    """Variants by name: builtins plus those defined by ``--variant`` specs. With no names, the
    custom ones (if any), else ``config``."""
    custom = {v.name: v for v in (parse_variant_spec(s) for s in specs)}
    if not names:
        return list(custom.values()) or [BUILTIN_VARIANTS["config"]]
    known = {**BUILTIN_VARIANTS, **custom}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--variants: unknown {', '.join(unknown)} "
                         f"(choose from {', '.join(known)}, or define one with --variant)")
    return [known[n] for n in names]


def variant_config(base: Any, variant: Variant) -> Any:
    """``base`` (an ``EngineConfig``; the variant's ``profile`` with ``base``'s ``[model]`` when
    it names one) with the variant's overrides and the env switches applied.

    Raises:
        ValueError: an override is invalid, or the profile does not load (``InvalidConfig``).
    """
    from breezert.config import EngineConfig, apply_env_overrides

    data = base.model_dump()
    if variant.profile is not None:
        data = {**EngineConfig.from_file(variant.profile).model_dump(), "model": data["model"]}
    for section, values in variant.overrides.items():
        data.setdefault(section, {}).update(values)
    return apply_env_overrides(EngineConfig.from_dict(data, source=f"variant {variant.name}"))


def config_with_overrides(path: str, sets: Sequence[str], tokenizer: str | None = None,
                          name: str = "run") -> Any:
    """The profile at ``path`` (an ``EngineConfig``) with ``--set section.key=value`` overrides
    and, given one, the tokenizer file, applied as the variant ``name``; the profile as loaded
    when there are none.

    Raises:
        ValueError: an override is malformed or invalid.
    """
    from breezert.config import EngineConfig

    base = EngineConfig.from_file(path)
    parts = [*sets, *([f"model.tokenizer='{tokenizer}'"] if tokenizer else [])]
    return variant_config(base, parse_variant_spec(f"{name}={';'.join(parts)}")) if parts else base
