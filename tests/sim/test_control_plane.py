from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from fleet_sim.control_plane import ControlPlaneConfig, parse_slice_arg, start_control_plane
from fleet_sim.keys import generate_keyset
from replica.grants import GrantVerifier, verify_grant
from wire.names import parse_session_id

SECRET = bytes(range(32))


def config(tmp_path: Path) -> ControlPlaneConfig:
    generate_keyset(tmp_path / "keys")
    return ControlPlaneConfig(
        keys_dir=tmp_path / "keys",
        sandbox_url="http://127.0.0.1:7700",
        sandbox_secret=SECRET,
        slices=(parse_slice_arg("a07:s1,s2"), parse_slice_arg("a08:s1")),
        journal=tmp_path / "events.jsonl",
    )


def test_slice_args() -> None:
    assert parse_slice_arg("a07:s1,s2").shards == ("a07-s1", "a07-s2")
    for bad in ("a07", "a-7:s1", "a07:", ":s1", "a07:s/1"):
        with pytest.raises(ValueError):
            parse_slice_arg(bad)


@pytest.mark.anyio
async def test_sessions_grants_and_lifecycle(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    runner, url, plane = await start_control_plane(cfg)
    verifier = GrantVerifier(dict(plane.keys.grant_keys), plane.keys.seal_key)
    try:
        async with httpx.AsyncClient(base_url=url) as client:
            made = [
                (await client.post("/v1/sessions", json={"tenant": "acme"})).json()
                for _ in range(6)
            ]
            assert len({m["slice"] for m in made}) == 1  # a tenant stays on its slice
            for m in made:
                grant = verify_grant(verifier, m["grant"])
                assert str(grant.session) == m["session_id"] and grant.tenant == "acme"
                assert parse_session_id(m["session_id"]).slice == m["slice"]
                assert grant.exec_url.endswith("/s/" + m["session_id"])
            again = await client.post(
                "/v1/grants", json={"tenant": "acme", "session_id": made[0]["session_id"]}
            )
            assert verify_grant(verifier, again.json()["grant"]).tenant == "acme"
            other_slice = "a08-s1.x" if made[0]["slice"] == "a07" else "a07-s1.x"
            refused = await client.post(
                "/v1/grants", json={"tenant": "acme", "session_id": other_slice}
            )
            assert refused.status_code == 403
            assert (await client.post("/v1/sessions", json={"tenant": "../x"})).status_code == 400
            assert (await client.post("/v1/sessions", content=b"[")).status_code == 400
            event = {"type": "run", "phase": "started", "session_id": made[0]["session_id"]}
            assert (await client.post("/v1/lifecycle", json=event)).status_code == 202
            assert (await client.post("/v1/lifecycle", json={"x": 1})).status_code == 400
            listed = (await client.get("/v1/lifecycle", params={"type": "run"})).json()
            assert [e["phase"] for e in listed["events"]] == ["started"]
    finally:
        await runner.cleanup()
    assert '"phase": "started"' in (tmp_path / "events.jsonl").read_text()
