"""Storage adapters behind one protocol: files (the default), memory (tests), SQLite and PostgreSQL."""

from typing import Any

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
    "PostgresStorage",
    "RunInfo",
    "SqliteStorage",
    "Storage",
    "validate_key",
    "validate_run_id",
]


def __getattr__(name: str) -> Any:
    """Import `PostgresStorage` only when asked for, so durably runs without psycopg installed."""
    if name == "PostgresStorage":
        from .postgres import PostgresStorage

        return PostgresStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
