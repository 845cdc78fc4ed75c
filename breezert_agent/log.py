"""The plugin's one named logger. Never log synthesized text through it (ids and sizes only)."""

from __future__ import annotations

import logging

logger = logging.getLogger("breezert_agent")
