"""Test tools that ship with sparkpoint: an operator harness that runs a keyed operator on real
RocksDB without Spark, and fault injection for any fsspec filesystem."""

from sparkpoint.testing.faultyfs import FAULT_KINDS, FaultyFileSystem, faulty_storage
from sparkpoint.testing.harness import HarnessError, HarnessSnapshot, OperatorHarness

__all__ = ["FAULT_KINDS", "FaultyFileSystem", "HarnessError", "HarnessSnapshot", "OperatorHarness", "faulty_storage"]
