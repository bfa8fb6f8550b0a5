"""What importing the code location costs a process: the CPU (user + system) of a new
interpreter that imports the module and exits, as every Dagster run worker, sensor tick's code
server and Airflow DAG parse does before its first step, beside the orchestrator's own import
(`dagster`, `airflow`) and the heavy libraries the location loaded.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_imports [--repeat 5] [--tree DIR --label before]

`--tree` measures another copy of the package (`git archive <commit> sparkpoint | tar -x -C DIR`),
so a before and an after are measured in one run, interleaved; it prints a table and writes
benchmarks/results/imports.json (the runs of each label, medians).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
HEAVY = ("pyspark", "rocksdict", "pandas", "pyarrow", "numpy", "deltalake", "pyiceberg")
# What each process imports: the floor first, then the code location as each front end loads it.
CASES = {
    "dagster (floor)": "import dagster",
    "sparkpoint.definitions": "import sparkpoint.definitions",
    "sparkpoint.factory": "import sparkpoint.factory",
    "sparkpoint.component": "import sparkpoint.component",
    "airflow (floor)": "import airflow",
    "Airflow DAG parse": "import sparkpoint.airflow.dags, sparkpoint.sample",
}


def cpu_of(code: str, tree: Path) -> tuple[float, list[str]]:
    """CPU seconds of a new interpreter that runs `code`, and the heavy libraries it loaded."""
    probe = f"{code}\nimport sys\nprint(','.join(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-c", probe], cwd=tree, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(tree)})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{code!r} failed in {tree}:\n{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    loaded = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    return cpu, [m for m in loaded.split(",") if m]


def measure(trees: dict[str, Path], repeat: int) -> dict[str, Any]:
    """Each case under each tree, `repeat` times, the trees interleaved (the machine is shared)."""
    runs: dict[str, dict[str, list[float]]] = {label: {case: [] for case in CASES} for label in trees}
    loaded: dict[str, dict[str, list[str]]] = {label: {} for label in trees}
    for _ in range(repeat):
        for case, code in CASES.items():
            for label, tree in trees.items():
                cpu, heavy = cpu_of(code, tree)
                runs[label][case].append(round(cpu, 3))
                loaded[label][case] = heavy
    return {label: {case: {"median_cpu_s": round(statistics.median(v), 3), "runs": v, "heavy": loaded[label][case]}
                    for case, v in cases.items()} for label, cases in runs.items()}


def table(results: dict[str, Any]) -> str:
    labels = list(results)
    head = "".join(f"{label + ' CPU s':>16}" for label in labels)
    lines = [f"{'process imports':<26}{head}  heavy libraries loaded"]
    for case in CASES:
        cells = "".join(f"{results[label][case]['median_cpu_s']:>16.2f}" for label in labels)
        heavy = " | ".join(",".join(results[label][case]["heavy"]) or "-" for label in labels)
        lines.append(f"{case:<26}{cells}  {heavy}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tree", type=Path, help="another copy of the package to measure beside this one")
    parser.add_argument("--label", default="before", help="what to call --tree's figures")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    trees = ({args.label: args.tree.resolve()} if args.tree else {}) | {"after" if args.tree else "now": REPO}
    results = measure(trees, args.repeat)
    print(table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"when": datetime.now().isoformat(timespec="seconds"), "machine": platform.node(),
              "cpus": os.cpu_count(), "repeat": args.repeat, "results": results}
    (args.out / "imports.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
