"""Storage adapters behind one protocol (`Storage`, the union of the roles `RunLogs`, `Identities`, `Catalog`,
`Inbox`, `DueQueue`, `Fleet` and `Limits`): files (the default), memory (tests), SQLite and PostgreSQL."""

from typing import TYPE_CHECKING, Any

from .base import LOG_VERSION, Lease, Log, QueueStats, RunInfo, validate_key, validate_run_id
from .file import FileStorage
from .roles import (
    AppTransaction,
    Catalog,
    DueQueue,
    Fleet,
    Identities,
    Inbox,
    Limits,
    LimitUpdate,
    RunLogs,
    Storage,
    Transactions,
)

if TYPE_CHECKING:
    from .memory import MemoryStorage
    from .postgres import PostgresStorage
    from .sqlite import SqliteStorage

__all__ = [
    "LOG_VERSION",
    "AppTransaction",
    "Catalog",
    "DueQueue",
    "FileStorage",
    "Fleet",
    "Identities",
    "Inbox",
    "Lease",
    "LimitUpdate",
    "Limits",
    "Log",
    "MemoryStorage",
    "PostgresStorage",
    "QueueStats",
    "RunInfo",
    "RunLogs",
    "SqliteStorage",
    "Storage",
    "Transactions",
    "validate_key",
    "validate_run_id",
]


def __getattr__(name: str) -> Any:
    """Import an adapter other than files only when asked for: a run on files imports neither the SQLite
    adapter nor psycopg (so durably runs without psycopg installed)."""
    if name == "MemoryStorage":
        from .memory import MemoryStorage

        return MemoryStorage
    if name == "SqliteStorage":
        from .sqlite import SqliteStorage

        return SqliteStorage
    if name == "PostgresStorage":
        from .postgres import PostgresStorage

        return PostgresStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
