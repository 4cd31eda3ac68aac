"""A full disk (ENOSPC, EFBIG) is a `StorageFullError` with a hint, leaves no partial line, and the run resumes
once there is space; oversized or over-deep input is a clear error (exit 2 from the CLI)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
from helpers import durably

from durably_py import FileStorage, SerializationError, create_engine, workflow
from durably_py.errors import DurablyError, StorageFullError
from durably_py.storage import file as file_storage

DONE: list[int] = []


def record(i: int) -> int:
    DONE.append(i)
    return i


@workflow
async def three(ctx: Any, n: int) -> list[int]:
    return [await ctx.step(record, i) for i in range(3)]


class Disk:
    """Make the file adapter's writes of `kind` records fail with `code` from the `after`-th on, after writing
    `partial` bytes of the line (a write cut short)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, code: int, after: int, kind: str = "ok",
                 partial: int = 5) -> None:
        self.calls = 0
        real = file_storage._write_all

        def write_all(fd: int, data: bytes) -> None:
            if data.startswith(b'{"t":"%s"' % kind.encode()):
                self.calls += 1
            if self.calls >= after:
                os.write(fd, data[:partial])
                raise OSError(code, os.strerror(code))
            real(fd, data)

        monkeypatch.setattr(file_storage, "_write_all", write_all)


def log_bytes(root: Path) -> bytes:
    (log,) = (root / "runs").glob("*.jsonl")
    return log.read_bytes()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG])
def test_a_full_disk_on_append_is_a_storage_full_error_and_the_run_resumes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    DONE.clear()
    engine = create_engine(FileStorage(tmp_path))
    with monkeypatch.context() as patch:
        Disk(patch, code, after=2)
        with pytest.raises(StorageFullError) as raised:
            asyncio.run(engine.run(three, 1))
    error = raised.value
    assert isinstance(error, DurablyError) and error.hint and "Free disk space" in error.hint
    assert error.errno == code
    data = log_bytes(tmp_path)
    assert data.endswith(b"\n")
    kinds = [json.loads(line)["t"] for line in data.splitlines()]
    assert kinds == ["run", "claim", "ok"]  # the cut second record was undone, nothing marked failed
    assert asyncio.run(engine.run(three, 1)) == [0, 1, 2]
    assert DONE == [0, 1, 1, 2]


def test_a_full_disk_on_claim_leaves_no_partial_claim_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    DONE.clear()
    engine = create_engine(FileStorage(tmp_path))
    with monkeypatch.context() as patch:
        Disk(patch, errno.ENOSPC, after=1, kind="claim")
        with pytest.raises(StorageFullError, match="could not claim"):
            asyncio.run(engine.run(three, 1))
    assert [json.loads(line)["t"] for line in log_bytes(tmp_path).splitlines()] == ["run"]
    assert DONE == []
    assert asyncio.run(engine.run(three, 1)) == [0, 1, 2]


def test_a_full_disk_on_create_is_a_storage_full_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    DONE.clear()
    engine = create_engine(FileStorage(tmp_path))
    with monkeypatch.context() as patch:
        Disk(patch, errno.ENOSPC, after=1, kind="run")
        with pytest.raises(StorageFullError, match="No space left"):
            asyncio.run(engine.run(three, 2))
    assert not list((tmp_path / "runs").glob("*.jsonl"))
    assert asyncio.run(engine.run(three, 2)) == [0, 1, 2]


def test_huge_and_deep_values_are_serialization_errors(tmp_path: Path) -> None:
    engine = create_engine(FileStorage(tmp_path))
    with pytest.raises(SerializationError, match="digits"):
        asyncio.run(engine.run(three, 10**5000))
    with pytest.raises(SerializationError, match=r"input\.n\[1\]"):
        asyncio.run(engine.run(three, {"n": [1, -10**4500]}))
    deep: list[Any] = []
    inner = deep
    for _ in range(100_000):
        inner.append([])
        inner = inner[0]
    with pytest.raises(SerializationError, match="nested too deeply"):
        asyncio.run(engine.run(three, deep))
    assert not list((tmp_path / "runs").glob("*.jsonl")) if (tmp_path / "runs").exists() else True




@pytest.mark.parametrize("payload", ["9" * 5000, "[" * 100_000 + "]" * 100_000])
def test_cli_rejects_huge_or_deep_json_with_exit_2(tmp_path: Path, payload: str) -> None:
    script = tmp_path / "wf.py"
    script.write_text("from durably_py import workflow\n\n@workflow\nasync def wf(ctx, x):\n    return 1\n")
    (tmp_path / "input.json").write_text(payload)
    ran = durably("run", str(script), "--workflow", "wf", "--input", "@input.json", "--dir", str(tmp_path / "s"),
              cwd=tmp_path)
    assert ran.returncode == 2, ran.stderr
    assert "Traceback" not in ran.stderr and "hint:" in ran.stderr
    signalled = durably("signal", "nope", "go", "@input.json", "--dir", str(tmp_path / "s"), cwd=tmp_path)
    assert signalled.returncode == 2, signalled.stderr
    assert "Traceback" not in signalled.stderr and "hint:" in signalled.stderr


BIG: list[int] = []


def big(i: int) -> str:
    BIG.append(i)
    return f"{i} " + "x" * 20_000  # distinct: a value repeated would be stored once


@workflow
async def bulky(ctx: Any, n: int) -> int:
    for i in range(n):
        await ctx.step(big, i)
    return n


def test_a_full_sqlite_database_is_a_storage_full_error_and_the_run_resumes(tmp_path: Path) -> None:
    from durably_py import SqliteStorage

    store = SqliteStorage(tmp_path / "runs.db")
    engine = create_engine(store, lease=2)  # the full database kept the release: the resume waits the lease out
    assert asyncio.run(engine.run(three, 5)) == [0, 1, 2]
    with store._lock:
        db = store._db()
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        db.execute(f"PRAGMA max_page_count = {pages + 20}")
    BIG.clear()
    with pytest.raises(StorageFullError, match="SQLite") as raised:
        asyncio.run(engine.run(bulky, 40))
    assert raised.value.hint and raised.value.errno == errno.ENOSPC
    done_before = len(BIG)
    assert 0 < done_before < 40
    with store._lock:
        store._db().execute("PRAGMA max_page_count = 1073741823")
    assert asyncio.run(engine.run(bulky, 40)) == 40
    assert len(BIG) == 40 + 1  # only the step whose record did not fit ran again
