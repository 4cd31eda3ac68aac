"""What the PostgreSQL adapter's modules share of the driver: psycopg, imported only when a store is used (it
is an optional dependency), the longest lease the database stores, and where a locked row's error points."""

from __future__ import annotations

from typing import Any

from ..errors import ValidationError

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
