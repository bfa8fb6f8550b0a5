"""The order `make test` hands the test files to its workers: the longest first.

xdist's `--dist loadfile` gives each worker one file, then another whenever it has two tests or
fewer left, in the order the files were collected. Its default order (the files with the most tests
first) left the longest files, which have few tests (a `dagster dev` or `airflow standalone` end to
end, the warm Spark's JVM starts), for last: the suite ended on one worker running them while the
others had nothing left. Longest first, the others fill in around them (measured by
`make test-profile`; a file not listed here keeps its place after these, in collection order).
"""

from __future__ import annotations

from collections.abc import Sequence

# (tests/test_interrupt.py stays in collection order: its Ctrl-C of the demo, timed to a line of
# output, failed three times in three suites when it ran among the longest at the start.)
# Longest wall time first, as `make test-profile` measured it on two cores (the CPU by file it
# prints, weighed up for files that mostly wait on a server: sensors, schedulers, idle timeouts).
LONGEST_FIRST = (
    "tests/test_dagster_e2e.py",
    "tests/test_warm_spark.py",
    "tests/test_airflow_standalone.py",
    "tests/test_interleavings.py",
    "tests/test_classcache.py",
    "tests/test_bench_vs_spark.py",
    "tests/test_cluster.py",
    "tests/test_follow.py",
    "tests/test_airflow.py",
    "tests/test_bench_routing.py",
    "tests/test_crash.py",
    "tests/test_connect.py",
    "tests/test_erase_tables.py",
    "tests/test_erase.py",
    "tests/test_erase_output.py",
    "tests/test_erase_spark.py",
    "tests/test_erase_race_spark.py",
    "tests/test_factory.py",
    "tests/test_example_sessions.py",
    "tests/test_iceberg_sink_e2e.py",
    "tests/test_materialize_in_steps.py",
    "tests/test_interrupt_start.py",
    "tests/test_event_time.py",
    "tests/test_s3_e2e.py",
    "tests/test_docs.py",
    "tests/test_bench_scale.py",
)


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def longest_first(nodeids: Sequence[str]) -> list[int]:
    """The positions of `nodeids` in the order to run them: the files of `LONGEST_FIRST` in its order,
    then the rest as collected; a file's own tests keep their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    first_seen: dict[str, int] = {}
    for i, nodeid in enumerate(nodeids):
        first_seen.setdefault(file_of(nodeid), i)

    def key(i: int) -> tuple[int, int, int]:
        name = file_of(nodeids[i])
        return rank.get(name, len(rank)), first_seen[name], i

    return sorted(range(len(nodeids)), key=key)
