"""Checkpoint engines for real runs: synchronous, and lazy asynchronous multi-level (DataStates-LLM).

Engines know nothing about pipelines; the `checkpoint` and `async_checkpoint` recovery methods wrap
them. File format: see `format.py`; commit protocol: see `levels.py`.
"""

from .engine import (
    CheckpointEngine,
    CheckpointEngineFailed,
    CheckpointStats,
    SpanCallback,
    SynchronousCheckpointEngine,
)
from .format import DEFAULT_RUN_ID, CheckpointCorruptError
from .host_pool import HostPool
from .lazy_async import LOCAL_LEVEL, REMOTE_LEVEL, LazyAsyncCheckpointEngine
from .levels import CheckpointInfo

__all__ = [
    "DEFAULT_RUN_ID",
    "LOCAL_LEVEL",
    "REMOTE_LEVEL",
    "CheckpointCorruptError",
    "CheckpointEngine",
    "CheckpointEngineFailed",
    "CheckpointInfo",
    "CheckpointStats",
    "HostPool",
    "LazyAsyncCheckpointEngine",
    "SpanCallback",
    "SynchronousCheckpointEngine",
]
