"""`make soak`'s closing table: one line per `build/soak/*.json`, its scalar figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def summary(directory: Path) -> list[str]:
    lines = []
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            lines.append(f"{path.stem:<24} unreadable: {e}")
            continue
        scalars = {k: v for k, v in data.items() if isinstance(v, int | float | str) and k != "name"}
        lines.append(f"{path.stem:<24} " + " ".join(f"{k}={v}" for k, v in scalars.items()))
    return lines or [f"no soak results in {directory}"]


if __name__ == "__main__":
    print("\n".join(summary(Path(sys.argv[1] if len(sys.argv) > 1 else "build/soak"))))
