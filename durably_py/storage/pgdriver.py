"""What the PostgreSQL adapter's modules share of the driver: psycopg, imported only when a store is used (it
is an optional dependency), the longest lease the database stores, where a locked row's error points, and the
connection methods `PostgresStorage` provides to the parts kept in modules of their own (`PostgresPart`)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from ..errors import RunNotFoundError, ValidationError

if TYPE_CHECKING:
    import psycopg

BUSY_DOCS = "docs/storage.md#waiting-for-a-locked-run"  # a row or key locked longer than `lock_wait`
MAX_TTL = 1e9  # seconds (about 31 years): longer leases are stored as this, since intervals cannot be infinite


def psycopg_module() -> Any:
    """The psycopg module, or a `ValidationError` saying how to install it (it is an optional dependency)."""
    try:
        import psycopg
    except ImportError:
        raise ValidationError(
            "PostgresStorage needs psycopg 3, which is not installed",
            hint="pip install 'durably-py[postgres]' (or pip install 'psycopg[binary]>=3.1').",
            docs="docs/storage.md#postgresql",
        ) from None
    return psycopg


class PostgresPart:
    """A part of `PostgresStorage` kept in a module of its own (its due queue, inbox, limits): what the adapter
    provides it, declared once."""

    if TYPE_CHECKING:
        def _cursor(self, transaction: bool = False, *,
                    flush: bool = True) -> AbstractContextManager[psycopg.Cursor[Any]]: ...
        def _write(self, query: str, params: tuple[Any, ...]) -> int: ...
        def _fetch(self, query: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]: ...
        def _missing(self, run_id: str) -> RunNotFoundError: ...
