"""How the file adapter makes a new run's log: an unnamed file (``O_TMPFILE``) written and linked to its name where
the OS has them, a hidden temp file hard-linked otherwise; either way whole or not at all, nothing left behind,
and a name that exists already is an error that leaves no queue entry."""

import errno
import os

import pytest

from durably_py import FileStorage, ValidationError
from durably_py.records import LOG_VERSION, Header, encode
from durably_py.storage.base import NewRun


def header(run_id: str) -> bytes:
    return encode(Header(v=LOG_VERSION, run_id=run_id, workflow="w", fingerprint="x", input=1, input_digest="x",
                         identity=f"id:{run_id}", created_at="2026-01-01T00:00:00+00:00", ts=0.0))


def only_logs(storage: FileStorage) -> list[str]:
    """Every name in runs/ (no temp file may be left)."""
    return sorted(os.listdir(storage.runs_dir))


@pytest.mark.parametrize("unnamed", [True, False])
def test_batch_and_single_logs_hold_their_header_and_leave_no_temp_file(tmp_path, unnamed) -> None:
    storage = FileStorage(tmp_path)
    storage._unnamed_logs = unnamed and hasattr(os, "O_TMPFILE")
    storage.create("w-aaaaaaaaaaaaaaaa", header("w-aaaaaaaaaaaaaaaa"))
    ids = [f"w-{c * 16}" for c in "bcd"]
    assert storage.create_bound([NewRun(run_id, header(run_id), f"id:{run_id}") for run_id in ids]) is None
    for run_id in ["w-aaaaaaaaaaaaaaaa", *ids]:
        log = storage.read(run_id)
        assert log is not None and log.records[0]["run_id"] == run_id
        assert storage.lookup(f"id:{run_id}") == run_id or run_id == "w-aaaaaaaaaaaaaaaa"
    assert only_logs(storage) == sorted(f"{run_id}.jsonl" for run_id in ["w-aaaaaaaaaaaaaaaa", *ids])
    with pytest.raises(ValidationError, match="already exists"):
        storage.create("w-bbbbbbbbbbbbbbbb", header("w-bbbbbbbbbbbbbbbb"))
    assert storage.entry("w-bbbbbbbbbbbbbbbb") is not None  # the run's own entry, not replaced or dropped
    assert only_logs(storage) == sorted(f"{run_id}.jsonl" for run_id in ["w-aaaaaaaaaaaaaaaa", *ids])


@pytest.mark.skipif(not hasattr(os, "O_TMPFILE"), reason="unnamed files are Linux's")
def test_without_a_way_to_link_an_unnamed_file_logs_are_made_the_temp_file_way(tmp_path, monkeypatch) -> None:
    """/proc missing (the link fails): that log and every later one is made through a temp file instead."""
    storage = FileStorage(tmp_path)
    link = os.link
    tried: list[str] = []

    def no_proc(src, dst, **kwargs):
        if str(src).startswith("/proc/"):
            tried.append(str(dst))
            raise OSError(errno.ENOENT, "No such file or directory", src)
        return link(src, dst, **kwargs)

    monkeypatch.setattr(os, "link", no_proc)
    storage.create("w-eeeeeeeeeeeeeeee", header("w-eeeeeeeeeeeeeeee"))
    storage.create("w-ffffffffffffffff", header("w-ffffffffffffffff"))
    assert len(tried) == 1 and not storage._unnamed_logs
    assert only_logs(storage) == ["w-eeeeeeeeeeeeeeee.jsonl", "w-ffffffffffffffff.jsonl"]
    assert storage.read("w-ffffffffffffffff").records[0]["run_id"] == "w-ffffffffffffffff"


def test_a_full_disk_while_the_header_is_written_leaves_no_log_and_no_entry(tmp_path, monkeypatch) -> None:
    from durably_py.errors import StorageFullError
    from durably_py.storage import file as file_module

    storage = FileStorage(tmp_path)

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(file_module, "_write_all", full)
    with pytest.raises(StorageFullError):
        storage.create("w-gggggggggggggggg", header("w-gggggggggggggggg"))
    assert storage.info("w-gggggggggggggggg") is None and storage.entry("w-gggggggggggggggg") is None
    assert only_logs(storage) == []
