"""The Dagster UI rendered by headless Chromium (Debian `chromium`): the asset graph shows the SSTable
assets feeding the checkpoint asset, the checkpoint asset's page shows `checkpoint_id` and the size
metadata, and its Plots view plots them. Screenshots go to `build/`."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from tests.dagster_server import DagsterServer

pytestmark = pytest.mark.e2e

BUILD = Path(__file__).resolve().parent.parent / "build"
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--window-size=1600,1000"]
GRAPH = "/assets/sparkpoint/checkpoint?view=lineage&lineageScope=upstream"
LINEAGE = "/asset-groups"
CHECKPOINT = "/assets/sparkpoint/checkpoint"


def chromium() -> str:
    path = shutil.which("chromium") or (CHROMIUM if Path(CHROMIUM).exists() else None)
    if path is None:
        pytest.fail("headless Chromium is missing: run .ci/run (it installs it) or "
                    "`apt-get update && apt-get install -y chromium`", pytrace=False)
    return path


def render(url: str, profile: Path, *, screenshot: Path | None = None) -> str:
    """The rendered DOM of `url` (the UI is a JS app: give it virtual time), optionally a screenshot."""
    args = [chromium(), *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=15000"]
    if screenshot is not None:
        subprocess.run([*args, f"--screenshot={screenshot}", url], check=True, timeout=120,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert screenshot.stat().st_size > 10_000, f"{screenshot} looks empty"
    done = subprocess.run([*args, "--dump-dom", url], check=True, timeout=120, capture_output=True)
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
        deadline = time.monotonic() + 30
        while not (active.exists() and active.read_text().strip()):
            assert time.monotonic() < deadline and self.proc.poll() is None, "chromium did not start its DevTools"
            time.sleep(0.2)
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
        deadline = time.monotonic() + timeout
        while not self.evaluate(expression):
            if time.monotonic() > deadline:
                text = self.evaluate("document.body ? document.body.innerText : ''")
                raise AssertionError(f"timed out waiting for {what}; page text: {str(text)[:1500]}")
            time.sleep(0.5)

    def _stop_chromium(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        self.stack.close()  # the websocket, then chromium


def test_asset_graph_and_checkpoint_page_render_in_headless_chromium(dagster_server: DagsterServer,
                                                                      tmp_path: Path) -> None:
    chromium()  # fails with what to install when it is missing
    server = dagster_server
    server.ensure_checkpoint()
    server.gql("mutation { setNuxSeen }")  # the first-visit "Join the Dagster community" modal
    BUILD.mkdir(exist_ok=True)

    graph = text_of(render(server.url + GRAPH, tmp_path / "p1", screenshot=BUILD / "dagster-asset-graph.png"))
    for name in ("user_totals", "item_reach", "checkpoint"):  # the checkpoint's upstream lineage
        assert name in graph, f"{name} not on the asset graph: {graph[:1500]}"
    lineage = text_of(render(server.url + LINEAGE, tmp_path / "p2", screenshot=BUILD / "dagster-lineage.png"))
    assert "Global asset lineage" in lineage, lineage[:1500]
    assert "sparkpoint" in lineage and "clicks" in lineage, f"both pipelines' groups: {lineage[:1500]}"

    page = text_of(render(server.url + CHECKPOINT, tmp_path / "p3", screenshot=BUILD / "dagster-checkpoint.png"))
    latest = max(server.checkpoint_ids())
    assert re.search(rf"checkpoint_id\s+.*?{latest}\b", page), page[:2000]
    for key in ("summary", "state_size_bytes", "checkpointed_size_bytes", "incremental_ratio", "registry_files"):
        assert key in page, f"{key} not on the checkpoint page: {page[:2000]}"

    # The metadata's Plots view is a button (no URL): click it through the DevTools protocol.
    browser = DevTools(tmp_path / "p4")
    try:
        browser.call("Page.enable")
        browser.call("Page.navigate", url=server.url + CHECKPOINT)
        browser.wait("document.body && document.body.innerText.includes('checkpoint_id')", "the metadata table")
        clicked = browser.evaluate(
            "(() => { const b = [...document.querySelectorAll('button')].find(b => b.innerText.trim() === 'Plots');"
            " if (b) { b.click(); return true; } return false; })()"
        )
        assert clicked, "no Plots button on the checkpoint page"
        # One plot per numeric key, each with its title and a drawn chart.
        keys = json.dumps(["checkpoint_id", "state_size_bytes", "checkpointed_size_bytes"])
        browser.wait(f"document.querySelectorAll('canvas, svg.recharts-surface').length >= 4 && "
                     f"{keys}.every(k => document.body.innerText.includes(k))", "the metadata plots")
        time.sleep(1)
        shot = browser.call("Page.captureScreenshot", format="png")
        (BUILD / "dagster-checkpoint-plots.png").write_bytes(base64.b64decode(shot["data"]))
    finally:
        browser.close()
