"""The session page in a real browser, following a session through the edge with EventSource.

A local fleet (``fleet_sim.up.start``) with its page server; headless Chromium opens the page,
mints a session through it, sends prompts and watches the stream. Mid-turn the edge is killed and
started again on the same port: the page server ends the broken stream, the browser's own
EventSource reconnects carrying ``Last-Event-ID``, the catch-up it gets holds only what came
after that id plus the turn in flight replayed, and the page ends with every reply exactly once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleet_sim.ports import free_port
from fleet_sim.up import LocalFleet
from tests.cdp import Page, chromium, chromium_or_skip
from tests.system.support import local_fleet

pytestmark = pytest.mark.slow

# Slow enough per word that a long reply is still streaming while the edge restarts.
MODEL = "stub:ttft=100ms,per_token=60ms,tokens=12"
LONG_WORDS = 150
SNAPSHOT = "window.fleetPage.snapshot()"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    chromium_or_skip()
    root = tmp_path_factory.mktemp("browser-fleet")
    with local_fleet(root, MODEL, web_listen="127.0.0.1:0") as local:
        yield local


def restart_edge(local: LocalFleet) -> None:
    """Kill the edge outright (every stream through it breaks) and start it on the same port."""
    address = local.edge.url.removeprefix("http://")
    local.edge.proc.signal(signal.SIGKILL)
    local.edge.proc.wait(10)
    local.edge = local.fleet.edge(
        local.config.state_dir / "edge.toml", listen=address, metrics=f"127.0.0.1:{free_port()}"
    )


def transcript(local: LocalFleet, session_id: str, grant: str) -> list[dict[str, Any]]:
    answer = httpx.post(
        f"{local.edge.url}/_beyond/agent",
        params={"session_id": session_id},
        headers={"x-beyond-grant": grant},
        json={"type": "get_messages"},
        timeout=10,
    )
    messages: list[dict[str, Any]] = answer.json()["data"]["messages"]
    return messages


async def prompt(page: Page, text: str) -> None:
    await page.evaluate(
        f"document.getElementById('prompt').value = {json.dumps(text)};"
        "document.getElementById('send').click()"
    )


def turn_done(count: int) -> str:
    """The page shows ``count`` finished turns and nothing in flight."""
    finished = f"{SNAPSHOT}.messages.filter(m => m.stop).length === {count}"
    return f"!{SNAPSHOT}.live && {finished}"


async def scenario(local: LocalFleet, port: int, shot: Path) -> dict[str, Any]:
    page = await Page.open(port)
    try:
        await page.call(
            "Emulation.setDeviceMetricsOverride",
            width=1280,
            height=860,
            deviceScaleFactor=1,
            mobile=False,
        )
        await page.goto(local.web.url if local.web else "")
        await page.wait_for("!document.getElementById('mint').disabled")
        await page.evaluate("document.getElementById('mint').click()")
        await page.wait_for(f"{SNAPSHOT}.catchups.length === 1 && {SNAPSHOT}.opens === 1")

        await prompt(page, "hello from the browser\nrun: echo browser-ok")
        await page.wait_for(turn_done(1), within_s=30)

        await prompt(page, f"a long one\nwords: {LONG_WORDS}")
        await page.wait_for(
            f"(() => {{ const l = {SNAPSHOT}.live; return l && l.text.split(' ').length > 5; }})()"
        )
        held = await page.evaluate(f"{SNAPSHOT}.lastEventId")
        await asyncio.to_thread(restart_edge, local)
        await page.wait_for(f"{SNAPSHOT}.catchups.length === 2", within_s=30)
        await page.wait_for(turn_done(2), within_s=60)

        await asyncio.to_thread(shot.write_bytes, await page.screenshot())
        snapshot: dict[str, Any] = await page.evaluate(SNAPSHOT)
        snapshot["held_before_drop"] = held
        snapshot["text"] = await page.evaluate("document.getElementById('transcript').innerText")
        snapshot["console_errors"] = page.console_errors
        snapshot["exceptions"] = page.exceptions
        return snapshot
    finally:
        await page.close()


def test_browser_follows_a_session_and_resumes_with_last_event_id(
    fleet: LocalFleet, tmp_path: Path
) -> None:
    shot = Path(os.environ.get("WEBUI_SCREENSHOT", tmp_path / "webui.png"))
    with chromium(tmp_path / "profile") as port:
        seen = asyncio.run(scenario(fleet, port, shot))

    assert seen["console_errors"] == [] and seen["exceptions"] == []
    session_id = seen["current"]
    truth = transcript(fleet, session_id, grant_for(fleet, session_id))
    ids = [m["id"] for m in truth]
    user_two = next(m for m in truth if m["role"] == "user" and "words:" in m["content"])

    # One EventSource object reconnected by itself, carrying the id of the last committed frame
    # it had received, which is the second prompt's (the reply was still streaming).
    assert seen["opens"] == 2 and seen["reconnects"] == 1 and seen["readyState"] == 1
    assert seen["held_before_drop"] == user_two["id"]
    first, resumed = seen["catchups"]
    assert first["after"] == "" and first["messageIds"] == []
    assert resumed["after"] == user_two["id"] and resumed["opens"] == 2
    # The catch-up after the resume held only what came after that id (nothing was committed
    # in between), and the turn in flight replayed from its start.
    assert resumed["messageIds"] == []
    assert resumed["turnFrames"] > 5
    log = (fleet.config.state_dir / "page.log").read_text()
    assert f"stream opened: Last-Event-ID {user_two['id']}," in log
    assert "stream from the edge broke off" in log

    # The page ends with the whole transcript, each message once, in order.
    assert [m["id"] for m in seen["messages"]] == ids
    replies = [m["content"] for m in truth if m["role"] == "assistant" and m.get("stop")]
    assert len(replies) == 2 and len(replies[1].split()) == LONG_WORDS
    for reply in replies:
        assert seen["text"].count(reply) == 1
    assert "browser-ok" in seen["text"]
    assert "stream resumed after" in seen["text"]
    assert shot.stat().st_size > 10_000


def grant_for(local: LocalFleet, session_id: str) -> str:
    """A grant of the test's own for the session the page minted (the page never shows one)."""
    answer = httpx.post(
        f"{local.control_plane.url}/v1/grants",
        json={"tenant": "demo", "session_id": session_id},
        timeout=10,
    )
    answer.raise_for_status()
    grant: str = answer.json()["grant"]
    return grant
