"""The file adapter's stored values (`valuestore`): ``runs/<run_id>.blobs`` beside the log, append-only lines
``<sha256 hex> <bytes>``, written before the log line that refers to them and fsynced before the log is.

A line cut short by a crash is ignored when read (its bytes are not its digest's) and never joined to the
next: a write after a tail without its newline starts a new line first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .base import storage_full
from .filelocks import write_all
from .valuestore import blob_lines, parse_blob_lines

__all__ = ["read_values", "sync_values", "values_path", "write_values"]


def values_path(runs_dir: str, run_id: str) -> str:
    """Where the stored values of run `run_id` are kept."""
    return os.path.join(runs_dir, f"{run_id}.blobs")


def read_values(path: str) -> Mapping[str, bytes]:
    """The stored values kept at `path`, by digest (none when the file is missing)."""
    try:
        with open(path, "rb") as f:
            return parse_blob_lines(f.read())
    except FileNotFoundError:
        return {}


def write_values(path: str, blobs: Mapping[str, bytes]) -> bool:
    """Append `blobs` to the values at `path` with one write (not fsynced: `sync_values` does, before the log's
    own fsync); a write cut short is undone. True when the file was new (its directory needs an fsync too)."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        data = blob_lines(blobs)
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data  # a tail a crash cut short stays a line of its own
        try:
            write_all(fd, data)
        except OSError as exc:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass
            raise storage_full(exc, "append to", path) from exc
    finally:
        os.close(fd)
    return size == 0


def sync_values(path: str) -> None:
    """fsync the values at `path` (they precede the log lines that refer to them onto the disk)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
