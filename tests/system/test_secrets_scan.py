"""After a full run of a local fleet (turns, tool calls, a background job whose end is called
back through the edge, a drain), no log line, metric, state file or shard file holds a grant,
a notify token, a tenant key, an exec header, or (on the shard) any message plaintext."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
from pathlib import Path

import httpx
import pytest

from fleet_sim.keys import derive_tenant_dek
from fleet_sim.sandbox import sandbox_token
from fleet_sim.sim.journal import Journal
from fleet_sim.sim.workload import Session, prompt_ws
from fleet_sim.up import UpConfig, start
from replica.keyfiles import b64url_encode, read_key_file
from replica.notify import NotifyKey
from tests.harness import eventually

pytestmark = pytest.mark.slow


def test_no_secret_or_plaintext_is_written_anywhere(tmp_path: Path) -> None:
    fleet = start(
        UpConfig(state_dir=tmp_path / "fleet", listen="127.0.0.1:0", model="mock", drain_grace_s=5)
    )
    journal = Journal(tmp_path / "journal.jsonl")
    canary = "CANARY-" + secrets.token_hex(8)
    try:
        made = fleet.new_session("acme")
        session = Session(made["session_id"], "acme", made["grant"])
        grants = [made["grant"]]
        for text in (
            f"{canary} hello",
            f"{canary}\nrun: echo {canary}-tool",
            f"{canary}\nbg: sleep 0.3; echo {canary}-job",
        ):
            asyncio.run(prompt_ws(fleet.edge_url, session, journal, text=text))

        def told() -> bool:
            response = httpx.post(
                f"{fleet.edge_url}/_beyond/agent",
                params={"session_id": session.session_id},
                content=b'{"type":"get_messages"}',
                headers={"x-beyond-grant": session.grant},
                timeout=30,
            )
            return any(m["role"] == "event" for m in response.json()["data"]["messages"])

        eventually(told, timeout=20)  # the job's end came back through edge and replica
        # A token of our own, sent through the edge like a sandbox would.
        key = NotifyKey(read_key_file(fleet.fleet.keys_dir / "notify.key", what="notify key"))
        token = key.mint("acme", session.session_id)
        httpx.post(
            f"{fleet.edge_url}/_beyond/agent",
            params={"session_id": session.session_id, "tenant": "acme"},
            content=json.dumps({"type": "job_ended", "job_id": "j-none"}).encode(),
            headers={"authorization": f"Bearer {token}"},
            timeout=30,
        )
        for _, (_, replica) in fleet.replicas.items():
            assert replica.metrics_url is not None
            (tmp_path / f"scrape-{replica.name}.txt").write_text(
                httpx.get(replica.metrics_url, timeout=5).text
            )
        assert fleet.edge.metrics_url is not None
        (tmp_path / "scrape-edge.txt").write_text(httpx.get(fleet.edge.metrics_url, timeout=5).text)
        sandbox_secret = read_key_file(
            tmp_path / "fleet" / "sandboxes" / "@sandbox.key", what="sandbox secret"
        )
        exec_header = sandbox_token(sandbox_secret, session.session_id)
        dek = derive_tenant_dek(fleet.fleet.keys, "acme")
    finally:
        journal.close()
        fleet.stop(drain_timeout_s=20)
    # Nothing writes once every process of the fleet has exited.
    eventually(
        lambda: all(proc.proc.poll() is not None for _, proc in fleet.processes().values()),
        timeout=10,
        message="a process of the fleet outlived its stop",
    )

    secrets_anywhere = {
        "grant": grants[0].encode(),
        "grant signature": grants[0].rsplit(".", 1)[1].encode(),
        "notify token": token.encode(),
        "notify token mac": token.rsplit(".", 1)[1].encode(),
        "exec header": exec_header.encode(),
        "tenant key (raw)": dek,
        "tenant key (base64url)": b64url_encode(dek).encode(),
        "tenant key (base64)": base64.b64encode(dek),
    }
    keys_dir = tmp_path / "fleet" / "keys"
    scanned = 0
    for path in tmp_path.rglob("*"):
        if not path.is_file() or keys_dir in path.parents or path.name == "@sandbox.key":
            continue
        if path.name == "journal.jsonl":
            continue  # the test's own record of what it sent
        data = path.read_bytes()
        scanned += 1
        for what, needle in secrets_anywhere.items():
            assert needle not in data, f"{what} found in {path.relative_to(tmp_path)}"
        if "shards" in path.parts:
            assert canary.encode() not in data, f"plaintext on the shard: {path.name}"
    assert scanned > 20
    logs = [p for p in (tmp_path / "fleet").glob("*.log")]
    assert {"edge.log", "r1.log", "sandbox.log", "control-plane.log"} <= {p.name for p in logs}
