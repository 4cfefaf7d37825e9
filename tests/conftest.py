"""Shared pytest configuration."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    # The services run on asyncio (uvloop in production); trio is never a target.
    return "asyncio"
