from __future__ import annotations

from pathlib import Path

import pytest

from fleet_sim.cli import main
from fleet_sim.webui.errors import ConfigError
from fleet_sim.webui.process import web_listen


def test_the_page_sits_next_to_the_edge_unless_told() -> None:
    assert web_listen(None, "127.0.0.1:8080") == "127.0.0.1:8081"
    assert web_listen(None, "127.0.0.1:0") == "127.0.0.1:0"
    assert web_listen("localhost:9000", "127.0.0.1:8080") == "localhost:9000"
    assert web_listen("off", "127.0.0.1:8080") is None


@pytest.mark.parametrize("value", ["0.0.0.0:8081", "10.1.2.3:80", "example.com:80", "8081", "x:y"])
def test_only_loopback_addresses(value: str) -> None:
    with pytest.raises(ConfigError):
        web_listen(value, "127.0.0.1:8080")


def test_up_refuses_a_routable_page_address_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["up", "--dir", str(tmp_path / "d"), "--web-listen", "0.0.0.0:8081"]) == 2
    assert "--web-listen" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
