"""Test tools that ship with sparkpoint: fault injection for any fsspec filesystem."""

from sparkpoint.testing.faultyfs import FAULT_KINDS, FaultyFileSystem, faulty_storage

__all__ = ["FAULT_KINDS", "FaultyFileSystem", "faulty_storage"]
