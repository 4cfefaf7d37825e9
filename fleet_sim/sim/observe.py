"""Observing the fleet's processes from outside: Prometheus scrapes of the edge and the replicas,
and a scan of a process's writable memory (Linux /proc) for notify-token-shaped strings.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Final

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fleet_sim.sim.scenario import Context

TOKEN_BYTES: Final = re.compile(rb"bjn_v1\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{16,}")


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def scrape(url: str | None) -> str:
    if url is None:
        return ""
    try:
        return httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return ""


def replica_metric(
    ctx: Context, name: str, *, slice_name: str | None = None, **labels: str
) -> float:
    return sum(
        metric(scrape(r.metrics_url), name, **labels)
        for s, r in ctx.fleet.replicas.values()
        if slice_name is None or s == slice_name
    )


def tokens_in_memory(pid: int, limit_bytes: int = 2 << 30) -> tuple[set[bytes], str]:
    """Every notify-token-shaped string in a process's writable memory (Linux /proc)."""
    found: set[bytes] = set()
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    except OSError as exc:
        return found, f"cannot read the process's memory: {exc.strerror}"
    scanned = 0
    step, overlap = 8 << 20, 4096
    try:
        for line in maps:
            fields = line.split()
            span, perms = fields[0], fields[1]
            if "r" not in perms or "w" not in perms:
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            offset = start
            while offset < end and scanned < limit_bytes:
                size = min(step, end - offset)
                try:
                    data = os.pread(fd, size + min(overlap, end - offset - size), offset)
                except OSError:
                    break
                found.update(TOKEN_BYTES.findall(data))
                scanned += size
                offset += size
    finally:
        os.close(fd)
    return found, ""


__all__ = ["TOKEN_BYTES", "metric", "replica_metric", "scrape", "tokens_in_memory"]
