"""Storage adapters behind one protocol: files (the default), memory (tests) and SQLite."""

from .base import LOG_VERSION, Lease, Log, RunInfo, Storage, validate_key, validate_run_id
from .file import FileStorage
from .memory import MemoryStorage
from .sqlite import SqliteStorage

__all__ = [
    "LOG_VERSION",
    "FileStorage",
    "Lease",
    "Log",
    "MemoryStorage",
    "RunInfo",
    "SqliteStorage",
    "Storage",
    "validate_key",
    "validate_run_id",
]
