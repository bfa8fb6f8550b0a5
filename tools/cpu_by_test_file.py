"""Where the test suite's CPU goes, by test file: `make test-profile` runs this beside `make test`.

`time make test` counts only the processes the suite waited for; the JVMs, Spark Connect servers
and Dagster daemons that tests start in sessions of their own are not among them. This samples
every process once a second and gives each one's CPU since the last sample to the test file its
nearest pytest-xdist worker ancestor is running (a process whose worker is gone keeps the file it
was born under). Processes that live less than a second are missed. It also counts the JVMs each
file starts (a Spark start costs about 12 CPU seconds), where sharing one would save most.

    python tools/cpu_by_test_file.py --out build/cpu-by-file.json &   # then make test; then:
    python tools/cpu_by_test_file.py --report build/cpu-by-file.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

RUNNING = re.compile(r"\[pytest-xdist running\] (\S+?)::")
HZ = os.sysconf("SC_CLK_TCK")


def processes() -> dict[int, tuple[int, int, float, str]]:
    """pid -> (parent pid, start tick, CPU seconds, command line), for every readable process."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
        found[int(entry)] = (int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / HZ, command)
    return found


def test_file_of(pid: int, table: dict[int, tuple[int, int, float, str]]) -> str | None:
    """The file the nearest pytest-xdist worker at or above `pid` runs now."""
    for _ in range(40):
        if pid not in table:
            return None
        if m := RUNNING.search(table[pid][3]):
            return m.group(1)
        pid = table[pid][0]
    return None


def sample(out: Path, interval: float = 1.0) -> None:
    last: dict[tuple[int, int], float] = {}
    born: dict[tuple[int, int], str] = {}
    cpu: Counter[str] = Counter()
    jvms: Counter[str] = Counter()
    first = True
    while True:
        table = processes()
        for pid, (_, start, seconds, _) in table.items():
            key = (pid, start)
            now = test_file_of(pid, table)
            if now and key not in born:
                born[key] = now
                if not first and _is_jvm(table[pid][3]):
                    jvms[now] += 1
            previous = last.get(key, seconds if first else 0.0)
            last[key] = seconds
            if seconds > previous:
                cpu[now or born.get(key, "-")] += seconds - previous
        first = False
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".tmp").write_text(json.dumps({"cpu": dict(cpu), "jvms": dict(jvms)}))
        os.replace(out.with_suffix(".tmp"), out)
        time.sleep(interval)


def _is_jvm(command: str) -> bool:
    return command.split(" ", 1)[0].endswith("/java") or command.startswith("java ")


def report(path: Path, top: int = 40) -> None:
    raw = json.loads(path.read_text())
    cpu, jvms = raw.get("cpu", raw), raw.get("jvms", {})
    total = sum(v for k, v in cpu.items() if k != "-")
    print(f"CPU seconds by test file (total {total:,.0f}; '-' is every other process: {cpu.get('-', 0):,.0f}; "
          f"{sum(jvms.values())} JVMs started)")
    print(f"{'CPU s':>8}  {'share':>5}  {'JVMs':>4}  file")
    for name, seconds in sorted(cpu.items(), key=lambda kv: -kv[1])[:top]:
        if name != "-":
            print(f"{seconds:8.0f}  {100 * seconds / total:4.1f}%  {jvms.get(name, 0):4d}  {name}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="sample until killed, writing the totals here")
    parser.add_argument("--report", type=Path, help="print the totals a sampling wrote")
    args = parser.parse_args(argv)
    if args.out:
        sample(args.out)
    if args.report:
        report(args.report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
