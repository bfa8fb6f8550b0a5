"""The former name of `sparkpoint.checkpoint` (the protocol's public classes), kept so that
`from sparkpoint.core import CheckpointStorage` goes on working. New code imports from
`sparkpoint.checkpoint` (and the RocksDB backend from `sparkpoint.state`)."""

from sparkpoint.checkpoint import *  # noqa: F403
from sparkpoint.checkpoint import __all__ as __all__
