"""The Dagster UI rendered by headless Chromium (Debian `chromium`): the asset graph shows the SSTable
assets feeding the checkpoint asset, the checkpoint asset's page shows `checkpoint_id` and the size
metadata (each byte count beside a readable size), and its Plots view plots them; input assets are
observed; a failure armed for the input sensor's next run fails that run, whose page links its
recovery run. Screenshots go to `build/`."""

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

from sparkpoint.assets.metadata import readable_size
from tests.support.dagster_server import INJECT_TAG, RECOVERS_TAG, DagsterServer, land_clicks
from tests.support.waiting import wait_for

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


def arm_failure(server: DagsterServer, sensor: str, point: str) -> None:
    """The documented one step: set the input sensor's cursor with `dagster sensor cursor`. A tick
    the daemon was running at that moment writes its own cursor over it (Dagster's cursor, whoever
    sets it): the next tick says whether the sensor is armed, and the step is taken again if not."""
    armed = f"(armed: the next run gets {INJECT_TAG}={point})"
    for _ in range(3):
        server.dagster("sensor", "cursor", sensor, "--set", json.dumps({"inject_failure": point}))
        set_at = time.time()
        tick = server.wait_for(
            f"a tick of {sensor} after its cursor was set",
            lambda since=set_at: next((t for t in server.ticks(sensor) if t["timestamp"] > since), None), timeout=60)
        if armed in (tick["skipReason"] or ""):
            return
    raise AssertionError(f"{sensor} never said {armed!r}; its ticks: {server.ticks(sensor)}")


def new_run(server: DagsterServer, known: set[str], job: str) -> dict[str, Any] | None:
    return next((r for r in server.runs() if r["jobName"] == job and r["runId"] not in known), None)


@pytest.mark.timeout(1200)  # three Spark runs and a recovery, one after another, on a loaded machine
def test_input_observed_sizes_readable_and_a_failed_run_one_click_from_its_recovery(dagster_server: DagsterServer,
                                                                                    tmp_path: Path) -> None:
    """Issue 34, items 6-9, on the example's `clicks` pipeline (its own operator and columns): a
    failure armed in one step for the input sensor's next run fails that run only; the failed run's
    page links its recovery run, one click away; the input assets are observed; the checkpoint's
    sizes read as sizes. Screenshots go to `build/`."""
    chromium()
    server = dagster_server
    server.gql("mutation { setNuxSeen }")
    server.ensure_checkpoint()  # the sample pipeline's, whose input sensor is stopped: its run observes the input
    BUILD.mkdir(exist_ok=True)
    into = server.root / ".sparkpoint" / "clicks" / "input"
    into.mkdir(parents=True, exist_ok=True)

    # 9. Arm a failure for the next run of the running input sensor, land a batch: that run fails.
    arm_failure(server, "clicks_input_sensor", "after-upload")
    known = {r["runId"] for r in server.runs()}
    land_clicks(into, 1)
    first = server.wait_for("the input sensor's run", lambda: new_run(server, known, "clicks_checkpoint"), timeout=120)
    failed = server.wait_run(first["runId"])
    assert failed["status"] == "FAILURE", f"{failed}\n{server.log_tail()}"
    assert {"key": INJECT_TAG, "value": "after-upload"} in failed["tags"]
    (recovery,) = server.wait_for(f"the recovery of {failed['runId']}",
                                  lambda: server.runs({RECOVERS_TAG: failed["runId"]}), timeout=120)
    assert server.wait_run(recovery["runId"])["status"] == "SUCCESS", server.log_tail()
    known = {r["runId"] for r in server.runs()}
    (landed,) = land_clicks(into, 1)
    after = server.wait_run(server.wait_for("the next run", lambda: new_run(server, known, "clicks_checkpoint"),
                                            timeout=120)["runId"])
    assert after["status"] == "SUCCESS" and {"key": "sparkpoint/landed", "value": landed.name} in after["tags"]
    assert INJECT_TAG not in {t["key"] for t in after["tags"]}, "the armed failure went to one run only"

    browser = DevTools(tmp_path / "p5")
    try:
        browser.call("Page.enable")
        # 8. The failed run's page links its recovery run; one click opens it.
        browser.call("Page.navigate", url=f"{server.url}/runs/{failed['runId']}")
        link = f"a[href='/runs/{recovery['runId']}']"
        browser.wait(f"document.querySelector(\"{link}\") !== null", "the link to the recovery run")
        assert "recovery_run" in browser.evaluate("document.body.innerText")
        time.sleep(1)
        shot = browser.call("Page.captureScreenshot", format="png")
        (BUILD / "dagster-failed-run-recovery-link.png").write_bytes(base64.b64decode(shot["data"]))
        browser.evaluate(f"document.querySelector(\"{link}\").click()")
        browser.wait(f"location.pathname === '/runs/{recovery['runId']}' && "
                     "document.body.innerText.includes('clicks_recover')", "the recovery run's page")

        # 7. The checkpoint's byte counts stay numbers; beside each, the size as a person reads it.
        (latest,) = [m for m in server.materializations("checkpoint", "clicks") if m["runId"] == after["runId"]]
        sizes = latest["metadata"]
        assert sizes["state_size"] == readable_size(sizes["state_size_bytes"]), sizes
        assert sizes["checkpointed_size"] == readable_size(sizes["checkpointed_size_bytes"]), sizes
        browser.call("Page.navigate", url=f"{server.url}/assets/clicks/checkpoint")
        browser.wait("document.body.innerText.includes('checkpointed_size_bytes')", "the metadata table")
        page = browser.evaluate("document.body.innerText")
        for key in ("state_size", "checkpointed_size"):
            shown = re.search(rf"^{key}\s+\S[^\n]*\s+(.+)$", page, flags=re.M)
            assert shown and shown.group(1).strip() == sizes[key], f"{key}: {page[:3000]}"
            assert re.search(rf"^{key}_bytes\s+\S[^\n]*\s+{sizes[key + '_bytes']}$", page, flags=re.M), page[:3000]
        browser.evaluate("[...document.querySelectorAll('td')].find(td => td.innerText.trim() === 'state_size_bytes')"
                         ".scrollIntoView({block: 'center'})")
        time.sleep(1)
        shot = browser.call("Page.captureScreenshot", format="png")
        (BUILD / "dagster-readable-sizes.png").write_bytes(base64.b64decode(shot["data"]))
    finally:
        browser.close()

    # 6. Neither pipeline's input asset is "Never observed": the sensor's ticks and the runs observe
    # them. Once the sensor saw the last batch consumed, the state read all there is: in sync.
    def seen_consumed() -> bool:  # the newest observation is the sensor's (no run), after the last run
        newest = server.observations("input", "clicks")[0]
        return newest["runId"] == "" and newest["metadata"]["files_pending"] == 0

    server.wait_for("the input sensor's observation after the last run", seen_consumed, timeout=60)
    for prefix in ("clicks", "sparkpoint"):
        graph = text_of(render(f"{server.url}/assets/{prefix}/checkpoint?view=lineage&lineageScope=upstream"
                               "&lineageDepth=2", tmp_path / f"p6{prefix}",
                               screenshot=BUILD / f"dagster-{prefix}-input-observed.png"))
        assert "input" in graph and "Observed" in graph, graph[:2000]
        assert "Never observed" not in graph, graph[:2000]
        if prefix == "clicks":
            assert "Unsynced" not in graph, f"the state read what the observation saw: {graph[:2000]}"
