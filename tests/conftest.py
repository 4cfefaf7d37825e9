"""Shared pytest configuration and fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import Fleet, fleet_at


@pytest.fixture
def anyio_backend() -> str:
    # The services run on asyncio (uvloop in production); trio is never a target.
    return "asyncio"


@pytest.fixture(scope="module")
def fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    """Real replica processes (``fleet_sim.local``), one fleet per test module, in a temporary
    directory named by the module's ``FLEET_DIR`` (``fleet`` when it has none)."""
    name: str = getattr(request.module, "FLEET_DIR", "fleet")
    with fleet_at(tmp_path_factory.mktemp(name)) as fleet:
        yield fleet
