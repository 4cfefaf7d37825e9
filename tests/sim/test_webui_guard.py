from __future__ import annotations

from fleet_sim.webui.guard import Allowed, refusal

ALLOWED = Allowed.for_port(8081, "127.0.0.1")
JSON = {"Content-Type": "application/json; charset=utf-8"}


def req(method: str = "GET", host: str = "127.0.0.1:8081", **headers: str) -> str | None:
    return refusal(method, {"Host": host, **headers}, ALLOWED)


def test_only_its_own_loopback_names_and_port() -> None:
    for host in ("127.0.0.1:8081", "localhost:8081", "[::1]:8081", "LOCALHOST:8081"):
        assert req(host=host) is None
    for host in ("evil.example:8081", "127.0.0.1:8080", "127.0.0.1", ""):
        assert req(host=host) is not None
    assert "[::1]:9" in Allowed.for_port(9, "::1").hosts
    assert "[::1]:9" in Allowed.for_port(9, "[::1]").hosts


def test_other_sites_are_refused() -> None:
    assert req(**{"Sec-Fetch-Site": "cross-site"}) is not None
    assert req(**{"Sec-Fetch-Site": "same-site"}) is not None
    assert req(**{"Sec-Fetch-Site": "same-origin"}) is None
    assert req(**{"Sec-Fetch-Site": "none"}) is None


def test_changes_need_json_from_this_origin() -> None:
    assert req("POST", **JSON) is None
    assert req("POST", **JSON, Origin="http://localhost:8081") is None
    assert req("POST", **JSON, Origin="http://evil.example") is not None
    assert req("POST", **JSON, Origin="null") is not None
    assert req("POST", **{"Content-Type": "text/plain"}) is not None
    assert req("POST", **{"Content-Type": "application/x-www-form-urlencoded"}) is not None
    assert req("POST") is not None
    assert req("DELETE") is None
    assert req("DELETE", Origin="http://evil.example") is not None
