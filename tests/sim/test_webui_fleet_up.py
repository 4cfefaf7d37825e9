"""The session page's fleet view on a real ``fleet-sim up``, as a person runs it.

One ``fleet-sim up`` (a subprocess, stopped with Ctrl-C) serves every test here. Through the page
server's API: the view lists the six replicas with their slices and readiness, shows which one
holds an open session, refuses faults it must not send, and after a kill of the owner shows the
takeover (from, to, how long the session was unavailable) and the new owner at a higher epoch;
no answer carries a grant or the fleet's control token. In headless Chromium: a person starts a
long turn, presses the owner's Kill button, and watches the session move and go on.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cdp import Page, chromium, chromium_or_skip
from tests.harness import eventually

pytestmark = pytest.mark.slow

# A plain reply is 200 words at 30 ms each: a turn of about six seconds.
MODEL = "stub:ttft=100ms,per_token=30ms,tokens=200"
SNAPSHOT = "window.fleetPage.snapshot()"
FLEET = "window.fleetView.last()"


@dataclass
class Up:
    state_file: Path
    page: str
    token: str
    control_plane: str
    log: Path
    bodies: list[bytes] = field(default_factory=list)
    """Every answer the page server gave in these tests, to search for secrets."""

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = json.loads(self.state_file.read_text())
        return state

    def client(self) -> httpx.Client:
        def keep(response: httpx.Response) -> None:
            response.read()
            self.bodies.append(response.content)

        return httpx.Client(base_url=self.page, timeout=30, event_hooks={"response": [keep]})


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    root = tmp_path_factory.mktemp("fleet-view")
    state_file = root / "state.json"
    log = root / "up.out"
    out = open(log, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fleet_sim",
            "up",
            "--dir",
            str(root / "data"),
            "--listen",
            "127.0.0.1:0",
            "--web-listen",
            "127.0.0.1:0",
            "--state",
            str(state_file),
            "--model",
            MODEL,
            "--drain-grace",
            "2",
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        eventually(lambda: proc.poll() is not None or "export GRANT=" in log.read_text(), 120)
        assert proc.poll() is None, log.read_text()
        state = json.loads(state_file.read_text())
        yield Up(
            state_file,
            state["web_url"],
            state["supervisor_token"],
            state["control_plane_url"],
            log,
        )
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        out.close()


def fleet(client: httpx.Client, session_id: str | None = None) -> dict[str, Any]:
    params = {"session_id": session_id} if session_id else {}
    answer = client.get("/api/fleet", params=params)
    assert answer.status_code == 200, answer.text
    view: dict[str, Any] = answer.json()
    return view


def owners(up: Up, session_id: str) -> dict[str, int]:
    """Who lists the session, asked of each replica directly (the state names where)."""
    found = {}
    for replica in up.state()["replicas"]:
        url = replica["metrics_url"].removesuffix("/metrics") + "/sessions"
        try:
            listed = httpx.get(url, timeout=2).json()["sessions"]
        except httpx.HTTPError:
            continue
        for listed_session in listed:
            if listed_session["session_id"] == session_id:
                found[replica["name"]] = listed_session["epoch"]
    return found


def attach_session(up: Up, client: httpx.Client) -> tuple[str, str]:
    """A session the test minted itself, attached to the page: so the test knows the grant the
    page server holds for it, and can look for that grant in every answer."""
    made = httpx.post(f"{up.control_plane}/v1/sessions", json={"tenant": "demo"}, timeout=10)
    made.raise_for_status()
    session_id, grant = made.json()["session_id"], made.json()["grant"]
    answer = client.post("/api/sessions/attach", json={"session_id": session_id, "grant": grant})
    assert answer.status_code == 201, answer.text
    return session_id, grant


def command(client: httpx.Client, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = client.post("/api/agent", params={"session_id": session_id}, json=body)
    assert answer.status_code in (200, 202), answer.text
    data: dict[str, Any] = answer.json()
    return data


def all_ready(view: dict[str, Any]) -> dict[str, Any] | None:
    return view if all(r["ready"] for r in view["replicas"]) else None


def test_the_view_lists_every_replica_with_its_slice_and_readiness(up: Up) -> None:
    with up.client() as client:
        config = client.get("/api/config").json()
        assert config["fleet"] is True
        view = eventually(lambda: all_ready(fleet(client)), timeout=20)
    by_slice: dict[str, list[str]] = {}
    for replica in view["replicas"]:
        by_slice.setdefault(replica["slice"], []).append(replica["name"])
        assert replica["badge"] == "ready" and replica["state"] == "up"
        assert isinstance(replica["pid"], int) and replica["live"] is not None
    assert by_slice == {"a07": ["r1", "r2", "r3"], "a08": ["r4", "r5", "r6"]}
    assert {p["name"] for p in view["processes"]} >= {"edge", "control-plane", "sandbox", "page"}
    assert all(p["state"] == "up" for p in view["processes"])
    assert view["session"] is None
    assert view["verbs"] == ["kill", "freeze", "thaw", "drain", "restart"]  # local-dir


def test_faults_the_page_must_not_send_are_refused(up: Up) -> None:
    with up.client() as client:
        bad_verb = client.post("/api/fault", json={"verb": "explode", "target": "r1"})
        assert bad_verb.status_code == 400
        assert "unknown fault 'explode'" in bad_verb.json()["error"]
        # Partitions need a substrate that can cut a mount off; local-dir cannot.
        assert (
            client.post("/api/fault", json={"verb": "partition", "target": "r1"}).status_code == 400
        )
        unknown = client.post("/api/fault", json={"verb": "kill", "target": "r99"})
        assert unknown.status_code == 404 and "no process named 'r99'" in unknown.json()["error"]
        assert client.post("/api/fault", json=["kill", "r1"]).status_code == 400
        cross_site = [
            {"Origin": "http://evil.example"},
            {"Sec-Fetch-Site": "cross-site"},
            {"Content-Type": "text/plain"},
        ]
        for headers in cross_site:
            refused = client.post(
                "/api/fault",
                content=json.dumps({"verb": "kill", "target": "r1"}),
                headers={"Content-Type": "application/json", **headers},
            )
            assert refused.status_code == 403, headers
        # Nobody holds the session a stranger names: the view says nothing of it.
        assert (
            client.get("/api/fleet", params={"session_id": "a07-s1.nosuchsession"}).status_code
            == 401
        )
        view = fleet(client)
    assert all(r["state"] == "up" for r in view["replicas"])  # nothing was faulted


def frozen_r5(view: dict[str, Any]) -> dict[str, Any] | None:
    r5: dict[str, Any] = next(r for r in view["replicas"] if r["name"] == "r5")
    return r5 if r5["badge"] == "frozen" and r5["reach"] == "not answering" else None


def test_a_frozen_replica_shows_frozen_without_stalling_the_view_and_thaws(up: Up) -> None:
    with up.client() as client:
        frozen = client.post("/api/fault", json={"verb": "freeze", "target": "r5"})
        assert frozen.status_code == 200 and frozen.json()["message"].startswith("froze r5")
        try:
            again = client.post("/api/fault", json={"verb": "freeze", "target": "r5"})
            assert again.status_code == 409 and "already frozen" in again.json()["error"]
            r5 = eventually(lambda: frozen_r5(fleet(client)), timeout=10)
            assert (r5["state"], r5["reach"], r5["live"]) == ("frozen", "not answering", None)
            for _ in range(5):  # each sample waits for r5 only so long
                started = time.monotonic()
                assert frozen_r5(fleet(client))
                assert time.monotonic() - started < 2.0
        finally:
            thawed = client.post("/api/fault", json={"verb": "thaw", "target": "r5"})
        assert thawed.status_code == 200, thawed.text
        eventually(lambda: all_ready(fleet(client)), timeout=20)


def test_killing_the_owner_shows_the_takeover_and_the_new_owner(up: Up) -> None:
    with up.client() as client:
        session_id, grant = attach_session(up, client)
        assert fleet(client, session_id)["session"]["status"] == "closed"
        command(client, session_id, {"type": "prompt", "message": "hello\nwords: 5"})
        held = eventually(
            lambda: (s := fleet(client, session_id)["session"])["status"] == "held" and s,
            timeout=20,
        )
        first_owner, first_epoch = held["owner"], held["epoch"]
        assert owners(up, session_id) == {first_owner: first_epoch}
        row = next(r for r in fleet(client, session_id)["replicas"] if r["name"] == first_owner)
        assert row["owns_open"] and any(s["open"] for s in row["owned"])

        killed = client.post("/api/fault", json={"verb": "kill", "target": first_owner})
        assert killed.status_code == 200, killed.text
        assert killed.json()["message"].startswith(f"killed {first_owner} (pid ")
        # Nothing follows this session now: its next command opens it again, elsewhere or on
        # the owner started again. The edge holds the command until some replica takes it.
        state = command(client, session_id, {"type": "get_state"})
        assert state["success"], state
        session = eventually(
            lambda: (s := fleet(client, session_id)["session"])["takeovers"] and s, timeout=30
        )
        (takeover,) = session["takeovers"]
        # The killed replica is started again by the fleet, and the view shows it back.
        eventually(
            lambda: any(
                r["name"] == first_owner and r["restarts"] >= 1 and r["badge"] == "ready"
                for r in fleet(client)["replicas"]
            ),
            timeout=60,
        )

    assert takeover["from"] == first_owner and takeover["from_epoch"] == first_epoch
    assert takeover["to"] == session["owner"] and takeover["to_epoch"] == session["epoch"]
    assert session["epoch"] > first_epoch and session["epoch"] == state["data"]["epoch"]
    assert owners(up, session_id) == {session["owner"]: session["epoch"]}
    assert takeover["cause"] == "killed from this page"
    assert 0 < takeover["unavailable_s"] < 30
    print(f"takeover {takeover['from']} -> {takeover['to']}: {takeover['unavailable_s']} s")
    for body in up.bodies:
        assert grant.encode() not in body and grant.split(".")[-1].encode() not in body
        assert up.token.encode() not in body


def test_no_answer_carries_the_control_token(up: Up) -> None:
    with up.client() as client:
        for path in ("/", "/app.js", "/fleet.js", "/api/config", "/api/fleet", "/api/sessions"):
            client.get(path)
    assert up.bodies and not any(up.token.encode() in body for body in up.bodies)


# -- in a browser ------------------------------------------------------------------------------


async def prompt(page: Page, text: str) -> None:
    await page.evaluate(
        f"document.getElementById('prompt').value = {json.dumps(text)};"
        "document.getElementById('send').click()"
    )


def finished(count: int) -> str:
    return f"!{SNAPSHOT}.live && {SNAPSHOT}.messages.filter(m => m.stop).length === {count}"


def live_words() -> str:
    return f"(() => {{ const l = {SNAPSHOT}.live; return l ? l.text.split(' ').length : 0; }})()"


async def kill_the_owner_from_the_page(up: Up, port: int, shot: Path) -> dict[str, Any]:
    page = await Page.open(port)
    try:
        await page.call(
            "Emulation.setDeviceMetricsOverride",
            width=1280,
            height=900,
            deviceScaleFactor=1,
            mobile=False,
        )
        await page.goto(up.page)
        await page.wait_for(
            "document.querySelectorAll('#fleet .replica .state.ready').length === 6"
        )
        await page.evaluate("window.notReloaded = true")
        await page.wait_for("!document.getElementById('mint').disabled")
        await page.evaluate("document.getElementById('mint').click()")
        await page.wait_for(f"{SNAPSHOT}.catchups.length === 1 && {SNAPSHOT}.opens === 1")

        await prompt(page, "hello from the fleet view\nwords: 40")
        await page.wait_for(finished(1), within_s=30)
        await prompt(page, "a long one, please")
        await page.wait_for(f"{live_words()} > 20", within_s=30)
        owner = await page.wait_for("document.querySelector('#fleet .replica.owner')?.dataset.name")
        first = await page.evaluate(f"{FLEET}.session")
        words_at_kill = await page.evaluate(live_words())
        await page.evaluate(
            "document.querySelector('#fleet .replica.owner button[data-verb=kill]').click()"
        )
        status = await page.wait_for("window.fleetView.status()")

        # The session moves: the stream resumes on the replica that took the session over, and
        # the view shows it holding the session at a higher epoch, with the takeover logged.
        await page.wait_for(f"{SNAPSHOT}.opens === 2 && {SNAPSHOT}.readyState === 1", within_s=60)
        moved = await page.wait_for(
            f"(() => {{ const s = {FLEET}.session;"
            f" return s && s.status === 'held' && s.takeovers.length === 1 && s; }})()",
            within_s=60,
        )
        await page.wait_for(
            f"document.querySelector('#fleet .replica.owner')?.dataset.name === '{moved['owner']}'"
        )
        # It goes on: a new prompt streams to completion in the same page, without a reload.
        await prompt(page, "still there?\nwords: 60")
        await page.wait_for(f"{live_words()} > 10", within_s=30)
        await page.wait_for(finished(2), within_s=60)
        await page.wait_for(f"{FLEET}.session.running === false")  # the view has caught up

        await asyncio.to_thread(shot.write_bytes, await page.screenshot())
        seen: dict[str, Any] = await page.evaluate(SNAPSHOT)
        seen.update(
            owner=owner,
            first=first,
            moved=moved,
            status=status,
            words_at_kill=words_at_kill,
            not_reloaded=await page.evaluate("window.notReloaded === true"),
            card=await page.evaluate(
                "[...document.querySelectorAll('#fleet-owner > span')].map(e => e.textContent)"
            ),
            log=await page.evaluate("document.getElementById('fleet-takeovers').innerText"),
            transcript=await page.evaluate("document.getElementById('transcript').innerText"),
            console_errors=page.console_errors,
            exceptions=page.exceptions,
        )
        return seen
    finally:
        await page.close()


def test_a_person_kills_the_owner_from_the_page_and_the_session_goes_on(
    up: Up, tmp_path: Path
) -> None:
    chromium_or_skip()
    artifacts = Path(os.environ.get("TEST_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "fleet-view-takeover.png"
    with chromium(tmp_path / "profile") as port:
        seen = asyncio.run(kill_the_owner_from_the_page(up, port, shot))
    print(f"screenshot: {shot}")

    assert seen["console_errors"] == [] and seen["exceptions"] == []
    session_id, owner, moved = seen["current"], seen["owner"], seen["moved"]
    assert seen["first"]["owner"] == owner and seen["first"]["running"]
    assert seen["status"]["ok"] and seen["status"]["text"].startswith(f"killed {owner} (pid ")
    (takeover,) = moved["takeovers"]
    assert takeover["from"] == owner and takeover["to"] == moved["owner"]
    assert moved["epoch"] > seen["first"]["epoch"] == takeover["from_epoch"]
    assert takeover["cause"] == "killed from this page"
    assert owners(up, session_id) == {moved["owner"]: moved["epoch"]}
    unavailable = takeover["unavailable_s"]
    print(f"takeover shown: {owner} -> {moved['owner']} after {unavailable} s unavailable")

    # What the person sees: the new owner and its epoch, and the takeover in the log.
    assert seen["card"] == [moved["owner"], f"epoch {moved['epoch']}"]
    assert f"{owner} → {moved['owner']}" in seen["log"]
    assert f"{unavailable:.1f} s unavailable" in seen["log"]
    assert (
        f"⇄ {owner} → {moved['owner']} after {unavailable:.1f} s unavailable" in seen["transcript"]
    )

    # The same page and the same EventSource went on: it reconnected once, by itself. The reply
    # in flight died with its replica (the product keeps the prompt, not the run): the page kept
    # what had streamed of it, marked lost, and the next prompt streamed to completion.
    assert seen["not_reloaded"] and seen["opens"] == 2 and seen["reconnects"] == 1
    (lost,) = seen["lost"]
    assert len(lost.split()) >= seen["words_at_kill"]
    assert any("the reply was lost" in m for m in seen["marks"])
    replies = [m for m in seen["messages"] if m["role"] == "assistant" and m.get("stop")]
    assert len(replies) == 2 and len(replies[1]["content"].split()) == 60
    prompts = [m["content"] for m in seen["messages"] if m["role"] == "user"]
    assert prompts[1] == "a long one, please"  # committed before the kill, kept after it
    assert shot.stat().st_size > 20_000
