"""The integration modules' shared engine: the tiny CPU profile behind an ``AsyncEngine``, one
per module, closed after it. A module that needs another engine defines its own ``engine``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from breezert.async_engine import AsyncEngine
from tests.integration._server import close_engine, make_engine


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    engine = make_engine()
    yield engine
    close_engine(engine)
