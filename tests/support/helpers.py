"""Building state handles from real files, for core tests that do not need RocksDB; an empty
checkpoint of real RocksDB backends for tests that need one but no Spark; the `sparkpoint`
command run in a directory of a user's own modules."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterable
from pathlib import Path

from sparkpoint.checkpoint.metadata import FileHandle, SubtaskStateHandle
from sparkpoint.checkpoint.paths import private_dir, shared_dir
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.state.keygroups import key_group_range
from sparkpoint.state.operators import KeyedOperator
from tests.support.backends import make_backends

ROOT = Path(__file__).resolve().parents[2]


def cli(where: Path, *args: str, java: bool = False) -> subprocess.CompletedProcess[str]:
    """`sparkpoint ARGS` in `where` (its modules importable); without `java`, no JVM can start
    (JAVA_HOME points nowhere): a command that needs no Spark is shown to start none."""
    env = {**os.environ, "PYTHONPATH": f"{where}{os.pathsep}{ROOT}"}
    if not java:
        env["JAVA_HOME"] = str(where / "no-java")
    return subprocess.run([sys.executable, "-m", "sparkpoint.cli", *args], capture_output=True, text=True,
                          timeout=600, cwd=where, env=env)


class FakeSubtask:
    """Uploads named local 'SST' files like a state backend would, with Flink's reuse rule.

    Only files of the last *confirmed* checkpoint are re-referenced; anything else is uploaded
    again under a fresh unique name.
    """

    def __init__(
        self, storage: CheckpointStorage, workdir: Path, operator: str = "op", subtask: int = 0, parallelism: int = 1
    ):
        self.storage = storage
        self.parallelism = parallelism
        self.workdir = workdir
        self.operator = operator
        self.subtask = subtask
        self.confirmed: dict[str, FileHandle] = {}
        self.pending: dict[int, dict[str, FileHandle]] = {}
        workdir.mkdir(parents=True, exist_ok=True)

    def write(self, local_name: str, content: bytes | None = None) -> str:
        path = self.workdir / local_name
        path.write_bytes(content if content is not None else os.urandom(64) + local_name.encode())
        return str(path)

    def snapshot(self, checkpoint_id: int, local_names: list[str]) -> SubtaskStateHandle:
        shared: list[FileHandle] = []
        uploads: list[tuple[str, str]] = []
        for name in local_names:
            if name in self.confirmed:
                shared.append(self.confirmed[name])
            else:
                rel = f"{shared_dir(self.operator, self.subtask)}/{uuid.uuid4().hex}.sst"
                uploads.append((str(self.workdir / name), rel))
        shared += self.storage.upload(uploads, checkpoint_id)
        manifest = self.write("MANIFEST-000001")
        private = self.storage.upload(
            [(manifest, f"{private_dir(checkpoint_id, self.operator, self.subtask)}/{uuid.uuid4().hex[:8]}-MANIFEST")],
            checkpoint_id,
        )
        self.pending[checkpoint_id] = {f.local_name: f for f in shared}
        return SubtaskStateHandle(
            operator=self.operator,
            subtask=self.subtask,
            checkpoint_id=checkpoint_id,
            key_group_range=key_group_range(128, self.parallelism, self.subtask),
            max_parallelism=128,
            shared=tuple(shared),
            private=tuple(private),
        )

    def confirm(self, checkpoint_id: int) -> None:
        self.confirmed = self.pending.pop(checkpoint_id)
        self.pending = {k: v for k, v in self.pending.items() if k > checkpoint_id}

    def abort(self, checkpoint_id: int) -> None:
        self.pending.pop(checkpoint_id, None)


def empty_checkpoint(storage: CheckpointStorage, operators: Iterable[KeyedOperator], parallelism: int,
                     local_dir: Path) -> None:
    """A completed checkpoint of `operators` at `parallelism` with empty state and no input
    consumed, written by real RocksDB backends without Spark."""
    from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
    from sparkpoint.state.backend import take_checkpoint

    backends = [b for op in operators for b in make_backends(storage, local_dir, parallelism, operator=op.uid)]
    for b in backends:
        b.restore(None)
    take_checkpoint(CheckpointCoordinator(storage), backends,
                    source_offsets={"source": {"version": 1, "consumed": []}, "sink": []})
    for b in backends:
        b.close()
