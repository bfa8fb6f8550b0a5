"""A real Prometheus scraping a real Pushgateway (Debian's `prometheus` and
`prometheus-pushgateway`), both on 127.0.0.1 at free ports, with a temporary configuration and
storage; stopped, by their process ids, on exit."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, process: subprocess.Popen[bytes], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {seconds} s")


@dataclass
class Monitoring:
    pushgateway: str  # http://127.0.0.1:P
    prometheus: str

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Prometheus' instant query: its `data.result`."""
        url = f"{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def wait_for(self, promql: str, seconds: float = 60) -> list[dict[str, Any]]:
        """The query's result once it is not empty (Prometheus scrapes the gateway every second)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            found = self.query(promql)
            if found:
                return found
            time.sleep(0.5)
        raise TimeoutError(f"Prometheus returned nothing for {promql} in {seconds} s")


@contextmanager
def prometheus_and_pushgateway(where: Path) -> Iterator[Monitoring]:
    if not (shutil.which("prometheus") and shutil.which("prometheus-pushgateway")):
        pytest.fail("the metrics test needs Debian's prometheus and prometheus-pushgateway: run make test (its "
                    "tools/ensure-test-tools installs them) or "
                    "'sudo apt-get install prometheus prometheus-pushgateway'")
    gateway_port, prometheus_port = _free_port(), _free_port()
    where.mkdir(parents=True, exist_ok=True)
    config = where / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: pushgateway\n    honor_labels: true\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{gateway_port}']\n")
    processes = []
    try:
        gateway = subprocess.Popen(["prometheus-pushgateway", f"--web.listen-address=127.0.0.1:{gateway_port}"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        processes.append(gateway)
        prometheus = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={where / 'data'}",
             f"--web.listen-address=127.0.0.1:{prometheus_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        processes.append(prometheus)
        monitoring = Monitoring(f"http://127.0.0.1:{gateway_port}", f"http://127.0.0.1:{prometheus_port}")
        _wait_ready(f"{monitoring.pushgateway}/-/ready", gateway)
        _wait_ready(f"{monitoring.prometheus}/-/ready", prometheus)
        yield monitoring
    finally:
        for p in processes:
            p.terminate()
        for p in processes:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
