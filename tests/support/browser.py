"""Headless Chromium (Debian `chromium`) for the tests that look at the Dagster UI: a page's
rendered DOM and screenshot, and just enough of the DevTools protocol to click and capture."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from tests.support.waiting import wait_for

BUILD = Path(__file__).resolve().parent.parent.parent / "build"
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--window-size=1600,1000"]


def chromium() -> str:
    path = shutil.which("chromium") or (CHROMIUM if Path(CHROMIUM).exists() else None)
    if path is None:
        pytest.fail("headless Chromium is missing: run .ci/run (it installs it) or "
                    "`apt-get update && apt-get install -y chromium`", pytrace=False)
    return path


def render(url: str, profile: Path, *, screenshot: Path | None = None) -> str:
    """The rendered DOM of `url` (the UI is a JS app: give it virtual time), optionally a screenshot
    taken by the same Chromium (one page load, not two)."""
    args = [chromium(), *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=15000", "--dump-dom"]
    if screenshot is not None:
        args.append(f"--screenshot={screenshot}")
    done = subprocess.run([*args, url], check=True, timeout=120, capture_output=True)
    if screenshot is not None:
        assert screenshot.stat().st_size > 10_000, f"{screenshot} looks empty"
    return done.stdout.decode(errors="replace")


def text_of(dom: str) -> str:
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


class DevTools:
    """Just enough of the Chrome DevTools protocol to click a button and take a screenshot."""

    def __init__(self, profile: Path) -> None:
        self.proc = subprocess.Popen([chromium(), *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
                                      "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.stack = ExitStack()
        self.stack.callback(self._stop_chromium)
        try:
            self._connect(profile)
        except BaseException:
            self.stack.close()
            raise

    def _connect(self, profile: Path) -> None:
        active = profile / "DevToolsActivePort"
        wait_for(lambda: active.exists() and active.read_text().strip(), 30, 0.2, "chromium to start its DevTools",
                 stop=lambda: None if self.proc.poll() is None else "chromium exited")
        port = active.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        from websockets.sync.client import connect

        self.ws = self.stack.enter_context(connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10))
        self.next_id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return dict(message.get("result", {}))

    def evaluate(self, expression: str) -> Any:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def wait(self, expression: str, what: str, timeout: float = 45) -> None:
        wait_for(lambda: self.evaluate(expression), timeout, 0.5, what,
                 last=lambda: str(self.evaluate("document.body ? document.body.innerText : ''"))[:1500])

    def _stop_chromium(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        self.stack.close()  # the websocket, then chromium
