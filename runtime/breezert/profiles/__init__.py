"""Engine profiles shipped inside the package, and how a ``config`` argument becomes a config.

Owns: ``cpu-tiny.toml`` (the embedded default: the tiny random model on CPU), finding packaged
profiles by name through ``importlib.resources``, and ``resolve_config``. Must not: import
torch, build an engine, or keep a second copy of a profile anywhere.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from breezert.config import EngineConfig, apply_env_overrides

EMBEDDED_PROFILE = "cpu-tiny"
"""What ``resolve_config(None)`` loads: ``AsyncEngine.shared()`` and so the plugin's ``TTS()``."""


def profile_path(name: str) -> Path:
    """The file of the packaged profile ``name`` (e.g. ``cpu-tiny``).

    Raises:
        FileNotFoundError: no packaged profile has that name (the message lists those that do).
    """
    folder = resources.files(__name__)
    resource = folder / f"{name}.toml"
    if not isinstance(resource, Path) or not resource.is_file():
        known = sorted(p.name.removesuffix(".toml") for p in folder.iterdir()
                       if p.name.endswith(".toml"))
        raise FileNotFoundError(f"no config file or packaged profile named {name!r} "
                                f"(packaged profiles: {', '.join(known)})")
    return resource


def config_path(value: str | os.PathLike[str]) -> Path:
    """A ``--config`` value as a file: a TOML path as given, or a packaged profile's file when
    ``value`` is a bare name (no folder, no suffix) that names no existing file."""
    path = Path(value)
    if path.exists() or path.suffix or len(path.parts) != 1:
        return path
    return profile_path(str(value))


def resolve_config(config: str | os.PathLike[str] | EngineConfig | None) -> EngineConfig:
    """An ``EngineConfig``, a TOML path, a packaged profile name, or ``None`` (the embedded
    profile), with the environment switches applied (``apply_env_overrides``)."""
    if config is None:
        cfg = EngineConfig.from_file(profile_path(EMBEDDED_PROFILE))
    elif isinstance(config, EngineConfig):
        cfg = config
    else:
        cfg = EngineConfig.from_file(config_path(config))
    return apply_env_overrides(cfg)
