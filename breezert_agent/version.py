"""The plugin's version (kept in step with the ``breezert-agent`` distribution)."""

from __future__ import annotations

__version__ = "0.1.0"
