"""Run as a script: write two checkpoints of a backend, or restore them with the open-file limit
set just above what the process already uses (`test_local_errors` drives it)."""

from __future__ import annotations

import os
import resource
import shutil
import sys
from pathlib import Path

from sparkpoint.checkpoint.coordinator import CheckpointCoordinator
from sparkpoint.checkpoint.storage import CheckpointStorage
from sparkpoint.checkpoint.store import CompletedCheckpointStore
from sparkpoint.state.backend import restore_with_fallback, take_checkpoint
from sparkpoint.state.codecs import StructCodec
from tests.support.backends import make_backend

COUNTS = StructCodec[tuple[int]]("<q")


def main(root: Path, mode: str, spare_fds: int = 0) -> None:
    storage = CheckpointStorage(f"file://{root}/ckpt", "job")
    backend = make_backend(storage, root / "local", max_parallelism=32)
    if mode == "write":
        coord = CheckpointCoordinator(storage, num_retained=2)
        with backend as b:
            b.restore(None)
            for _ in (1, 2):
                for r in range(12):
                    b.value_state("count", COUNTS).put_many((f"k{r}-{i}", (i,)) for i in range(2000))
                    b.db.flush()  # one SST per round: many files to open on restore
                take_checkpoint(coord, [b])
        return
    shutil.rmtree(backend.db_path)  # the working database is lost: restore from the task-local copy
    checkpoints = CompletedCheckpointStore(storage).load_all().checkpoints
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + spare_fds, hard))
    try:
        results = restore_with_fallback([backend], checkpoints)
    except Exception as e:
        print(f"ERROR {type(e).__name__}: {e}")
        return
    print(f"RESTORED {results[0].checkpoint_id} fell back from {list(results[0].fell_back_from)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], *(int(a) for a in sys.argv[3:]))
