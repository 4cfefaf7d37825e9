"""Ports chosen ahead of their listener stay clear of the kernel's ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from fleet_sim import ports


def test_ports_sit_below_the_ephemeral_range_and_are_not_handed_out_twice() -> None:
    low, _high = ports.ephemeral_range()
    chosen = [ports.free_port() for _ in range(50)]
    assert len(set(chosen)) == 50
    assert all(ports.LOWEST <= port < low for port in chosen)
    for port in chosen[:5]:  # and each can really be listened on
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", port))
            listener.listen()


def test_a_port_in_use_is_never_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        # Offer the busy port first, then a free one: the busy one is skipped.
        offers = iter([busy, busy, ports.free_port() + 1])
        monkeypatch.setattr("random.randrange", lambda _a, _b: next(offers))
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (65_000, 65_535))
        assert ports.free_port() != busy


def test_the_range_file_is_read_and_a_bad_one_falls_back(tmp_path: Path) -> None:
    good = tmp_path / "range"
    good.write_text("40000\t50000\n")
    assert ports.ephemeral_range(good) == (40_000, 50_000)
    bad = tmp_path / "bad"
    bad.write_text("not numbers")
    assert ports.ephemeral_range(bad) == (32_768, 60_999)
    assert ports.ephemeral_range(tmp_path / "absent") == (32_768, 60_999)


def test_no_room_below_the_range_falls_back_to_a_kernel_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST + 10, 60_999))
    port = ports.free_port()
    assert port >= ports.LOWEST + 10


def test_a_confined_process_chooses_only_from_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_share", ports._share)  # restored after the test
    low, _high = ports.ephemeral_range()
    middle = ports.LOWEST + (low - ports.LOWEST) // 2
    ports.confine(0, 2)
    assert all(ports.LOWEST <= ports.free_port() < middle for _ in range(40))
    ports.confine(1, 2)
    assert all(middle <= ports.free_port() < low for _ in range(40))
    for bad in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="share"):
            ports.confine(*bad)
