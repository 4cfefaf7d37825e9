"""Headless Chromium for tests, driven over the DevTools protocol on a loopback port.

Debian's ``chromium`` is started with a fresh profile and ``--remote-debugging-port=0``; the port
it picked is read from the profile's ``DevToolsActivePort`` file, and one page target is driven
over a WebSocket (``websockets``). Console errors and uncaught exceptions of the page are
collected so a test can assert there were none.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from tests.harness import eventually, eventually_async

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
    "--window-size=1280,860",
)
START_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 30.0


def chromium_or_skip() -> str:
    """The browser's path. CI installs it, so there its absence fails rather than skips."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (scripts/bootstrap installs it)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return path


@contextlib.contextmanager
def chromium(profile: Path) -> Iterator[int]:
    """Run the browser; yield its DevTools port; kill it (and its children) afterwards."""
    profile.mkdir(parents=True, exist_ok=True)
    log = open(profile.parent / "chromium.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [chromium_or_skip(), *FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=log,
        start_new_session=True,
    )
    try:
        active = profile / "DevToolsActivePort"
        failed = f"chromium did not start: {(profile.parent / 'chromium.log')}"

        def started() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(failed)
            return active.exists() and bool(active.read_text().strip())

        eventually(started, timeout=START_TIMEOUT_S, interval=0.05, message=failed)
        yield int(active.read_text().split()[0])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(10)
        log.close()


class Page:
    """One page target: commands, evaluation in the page, screenshots."""

    def __init__(self, ws: websockets.ClientConnection) -> None:
        self._ws = ws
        self._next = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.console_errors: list[str] = []
        self.exceptions: list[str] = []
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def open(cls, port: int) -> Page:
        async with httpx.AsyncClient(timeout=10) as http:
            targets = (await http.get(f"http://127.0.0.1:{port}/json/list")).json()
        url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        page = cls(await websockets.connect(url, max_size=None, ping_interval=None))
        await page.call("Runtime.enable")
        await page.call("Page.enable")
        return page

    async def _read(self) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for raw in self._ws:
                message = json.loads(raw)
                if "id" in message:
                    future = self._pending.pop(message["id"], None)
                    if future is not None and not future.done():
                        future.set_result(message)
                elif message.get("method") == "Runtime.consoleAPICalled":
                    params = message["params"]
                    if params["type"] == "error":
                        self.console_errors.append(
                            " ".join(
                                str(a.get("value", a.get("description"))) for a in params["args"]
                            )
                        )
                elif message.get("method") == "Runtime.exceptionThrown":
                    details = message["params"]["exceptionDetails"]
                    self.exceptions.append(
                        str(details.get("exception", {}).get("description", details["text"]))
                    )

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next += 1
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[self._next] = future
        await self._ws.send(json.dumps({"id": self._next, "method": method, "params": params}))
        async with asyncio.timeout(CALL_TIMEOUT_S):
            answer = await future
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        result: dict[str, Any] = answer["result"]
        return result

    async def evaluate(self, expression: str) -> Any:
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, within_s: float = 20.0) -> Any:
        """Poll until ``expression`` is truthy in the page; return its value."""
        return await eventually_async(
            lambda: self.evaluate(expression),
            timeout=within_s,
            interval=0.1,
            message=f"{expression!r} stayed false for {within_s}s",
        )

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'")

    async def screenshot(self) -> bytes:
        """The page as it is drawn now, as PNG."""
        await self.evaluate("new Promise(done => requestAnimationFrame(() => done(true)))")
        shot = await self.call("Page.captureScreenshot", format="png")
        return base64.b64decode(shot["data"])

    async def close(self) -> None:
        await self._ws.close()
        await self._reader
