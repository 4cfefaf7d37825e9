"""The page server as one more process of a local fleet (what ``fleet-sim up`` starts)."""

from __future__ import annotations

import sys
from pathlib import Path

from fleet_sim.local import Fleet, Service, listening
from fleet_sim.webui.errors import ConfigError
from fleet_sim.webui.server import check_loopback


def web_listen(value: str | None, edge_listen: str) -> str | None:
    """Where ``fleet-sim up`` serves the page: ``value`` as given (``off``: nowhere), else next
    to the edge, on its host and the port after its own (an edge on port 0 gives port 0)."""
    if value == "off":
        return None
    if value is None:
        host, _, port = edge_listen.rpartition(":")
        number = int(port) if port.isdigit() else 0
        value = f"{host}:{number + 1 if number else 0}"
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"expected HOST:PORT, not {value!r}")
    check_loopback(host)
    return value


def spawn(
    fleet: Fleet,
    listen: str,
    edge_url: str,
    control_plane_url: str | None,
    *,
    state_file: Path | None = None,
) -> Service:
    argv = [sys.executable, "-m", "fleet_sim.webui", "--listen", listen, "--edge", edge_url]
    if control_plane_url is not None:
        argv += ["--control-plane", control_plane_url]
    if state_file is not None:
        argv += ["--state", str(state_file)]
    proc = fleet._spawn("page", argv)
    return Service("page", listening(proc.readline())["url"], None, proc)
