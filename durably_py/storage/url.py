"""Storage URLs: one string that names where runs live, for `--storage`, `DURABLY_STORAGE` and `create_engine`.

Accepted forms:

- a directory path, or ``file:PATH``: a `FileStorage` rooted there (``file://`` plus an absolute path works too);
- ``sqlite:PATH``: a `SqliteStorage` database file, PATH relative to the current directory or absolute
  (``sqlite:///abs/path.db`` and ``sqlite://rel/path.db`` are read the same way);
- ``postgresql://...`` (or ``postgres://...``): a `PostgresStorage` on that server (needs the ``postgres``
  extra); a ``schema`` query parameter picks the schema (default ``durably``), ``lock_wait`` how many seconds a
  claim waits for a run another connection holds locked (default 10).
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..errors import ValidationError

FORMS = "a directory, file:PATH, sqlite:PATH (relative or absolute) or postgresql://USER@HOST/DB"
DOCS = "docs/storage.md#storage-urls"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


def _bad(url: object, why: str) -> ValidationError:
    return ValidationError(f"invalid storage URL {url!r}: {why}; a storage URL is {FORMS}",
                           hint="For example --storage .durably, --storage sqlite:state/runs.db, or "
                                "--storage postgresql://app@db.internal/durably.",
                           docs=DOCS)


def parse_storage_url(url: object) -> tuple[str, str]:
    """Split a storage URL into (kind, target): ("file", dir), ("sqlite", path) or ("postgres", dsn).

    Pure: nothing is opened or created. A URL of no accepted form raises `ValidationError`."""
    if not isinstance(url, str) or not url.strip():
        raise _bad(url, "it is empty" if isinstance(url, str) else f"it is a {type(url).__name__}, not a string")
    if "\x00" in url:
        raise _bad(url, "it contains a NUL character")
    match = _SCHEME.match(url)
    scheme = match.group(1).lower() if match else None
    if scheme is None or (len(scheme) == 1 and os.name == "nt"):  # C:\dir on Windows is a path
        return "file", url
    rest = url[match.end():] if match else url
    if scheme == "file":
        path = rest[2:] if rest.startswith("//") else rest
        if not path:
            raise _bad(url, "file: needs a directory path")
        return "file", path
    if scheme == "sqlite":
        path = rest
        if path.startswith("//"):
            path = path[2:]  # sqlite:///abs/path.db -> /abs/path.db; sqlite://rel/path.db -> rel/path.db
        if not path or path.endswith(("/", os.sep)):
            raise _bad(url, "sqlite: needs a database file path")
        return "sqlite", path
    if scheme in ("postgresql", "postgres"):
        parts = urlsplit(url)
        if not rest.startswith("//") or not (parts.hostname or parts.path.strip("/")):
            raise _bad(url, "a PostgreSQL URL is postgresql://[USER[:PASSWORD]@]HOST[:PORT]/DATABASE")
        return "postgres", url
    raise _bad(url, f"unknown scheme {scheme!r}")


def open_storage(url: str, **options: Any) -> Any:
    """The storage a URL names (see `parse_storage_url`); extra `options` go to the adapter's constructor.

    ``postgresql://...?schema=NAME`` picks the schema; other query parameters stay in the DSN for libpq."""
    kind, target = parse_storage_url(url)
    if kind == "file":
        from .file import FileStorage

        return FileStorage(target, **options)
    if kind == "sqlite":
        from .sqlite import SqliteStorage

        return SqliteStorage(target, **options)
    from .postgres import PostgresStorage

    parts = urlsplit(target)
    query = parse_qsl(parts.query, keep_blank_values=True)
    schema = [v for k, v in query if k == "schema"]
    waits = [v for k, v in query if k == "lock_wait"]
    if waits:
        try:
            options.setdefault("lock_wait", float(waits[-1]))
        except ValueError:
            raise _bad(url, f"lock_wait={waits[-1]!r} is not a number of seconds") from None
    if schema or waits:
        if schema:
            options.setdefault("schema", schema[-1])
        target = urlunsplit(parts._replace(scheme="postgresql", query=urlencode(
            [(k, v) for k, v in query if k not in ("schema", "lock_wait")])))
    elif parts.scheme == "postgres":
        target = urlunsplit(parts._replace(scheme="postgresql"))
    return PostgresStorage(target, **options)
