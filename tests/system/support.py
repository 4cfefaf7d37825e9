"""A whole local fleet (``fleet-sim up``'s ``fleet_sim.up.start``) for the system tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fleet_sim.up import LocalFleet, UpConfig, start


@contextmanager
def local_fleet(
    state_dir: Path, model: str, *, web_listen: str | None = None, log_level: str = "info"
) -> Iterator[LocalFleet]:
    """One replica per slice, the edge on a loopback port, a 2 s drain grace; stopped with a 10 s
    drain. ``web_listen`` and ``log_level`` are ``UpConfig``'s, with its defaults."""
    local = start(
        UpConfig(
            state_dir=state_dir,
            listen="127.0.0.1:0",
            model=model,
            replicas_per_slice=1,
            drain_grace_s=2,
            web_listen=web_listen,
            log_level=log_level,
        )
    )
    try:
        yield local
    finally:
        local.stop(drain_timeout_s=10)
