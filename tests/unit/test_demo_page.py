"""The demo page (``server/static/index.html``): self-contained (no CDN, nothing fetched from
elsewhere), live canvas plots of the playout buffer and of first audio per turn, log lines that
wrap. The browser test (``tests/integration/test_server_chromium.py``) checks the plots draw."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
PAGE = Path(__file__).resolve().parents[2] / "runtime" / "breezert" / "server" / "static" / \
    "index.html"


def test_page_is_self_contained() -> None:
    html = PAGE.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert not re.search(r"""import\s*\(|fetch\(\s*["']https?:""", html)


def test_page_plots_buffer_and_first_audio_and_wraps_the_log() -> None:
    html = PAGE.read_text()
    assert '<canvas id="bufferPlot">' in html and '<canvas id="firstPlot">' in html
    assert "bufferSeries" in html and "turns" in html and "drawPlots" in html
    log_css = re.search(r"#log \{([^}]*)\}", html)
    assert log_css and "overflow-wrap: anywhere" in log_css.group(1)
