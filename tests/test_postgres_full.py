"""A PostgreSQL server out of disk space: the server's own `disk_full` error (SQLSTATE 53100) is a
`StorageFullError` with a hint, nothing partial is kept, and the run resumes once there is space.

The disk is made full without root or a small filesystem: the server runs under a file size limit
(RLIMIT_FSIZE, which PostgreSQL meets with a short write it reports as `disk_full`), with 1 MiB WAL segments
so its own files fit under the limit. Restarting it without the limit is "freeing space"."""

from __future__ import annotations

import asyncio
import os
import resource
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import pg_bindir

from durably_py import create_engine, workflow
from durably_py.errors import DurablyError, StorageFullError
from durably_py.storage.postgres import FULL_SQLSTATES, storage_full

LIMIT = 4 * 1024 * 1024 + 100  # bytes per file: not a whole 8 KiB block, so the table's last extension is short
WROTE: list[int] = []


def chunk(i: int) -> str:
    WROTE.append(i)
    return secrets.token_hex(48 * 1024)  # 96 KB that do not compress


@workflow
async def pg_filler(ctx: Any, n: int) -> int:
    return len([await ctx.step(chunk, i) for i in range(n)])


class Server:
    """A private PostgreSQL server whose files may not grow past `LIMIT` bytes until `unlimit()`."""

    def __init__(self) -> None:
        bindir = pg_bindir()
        if bindir is None:
            pytest.skip("needs the PostgreSQL server binaries (initdb, pg_ctl)")
        pytest.importorskip("psycopg")
        self.prefix: list[str] = []
        self.root = Path(tempfile.mkdtemp(prefix="durably-pgfull-"))
        if os.geteuid() == 0:
            import pwd

            runuser = shutil.which("runuser")
            try:
                entry = pwd.getpwnam("postgres")
            except KeyError:
                pytest.skip("PostgreSQL refuses to run as root and there is no 'postgres' user")
            if runuser is None:
                pytest.skip("PostgreSQL refuses to run as root and `runuser` is missing")
            self.prefix = [runuser, "-u", "postgres", "--"]
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self.bindir, self.data = bindir, self.root / "data"
        done = self.call("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync",
                         "--wal-segsize=1")
        assert done.returncode == 0, done.stderr
        self.start(limited=True)
        self.dsn = f"host={self.root} user=postgres dbname=postgres"

    def call(self, tool: str, *args: str, limited: bool = False) -> subprocess.CompletedProcess[str]:
        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))

        return subprocess.run([*self.prefix, str(self.bindir / tool), *args], cwd=self.root, capture_output=True,
                              text=True, timeout=60, preexec_fn=limit if limited else None)

    def start(self, *, limited: bool) -> None:
        options = f"-k {self.root} -c listen_addresses='' -c fsync=off"
        done = self.call("pg_ctl", "start", "-w", "-t", "30", "-D", str(self.data), "-l", str(self.root / "log"),
                         "-o", options, limited=limited)
        assert done.returncode == 0, done.stderr + (self.root / "log").read_text(errors="replace")[-2000:]

    def unlimit(self) -> None:
        """Free space: the same server, restarted without the file size limit."""
        assert self.call("pg_ctl", "stop", "-w", "-D", str(self.data), "-m", "fast").returncode == 0
        self.start(limited=False)

    def stop(self) -> None:
        self.call("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w")
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def server() -> Iterator[Server]:
    made = Server()
    try:
        yield made
    finally:
        made.stop()


def test_a_full_postgres_disk_is_a_storage_full_error_and_the_run_resumes(server: Server) -> None:
    from durably_py import PostgresStorage

    WROTE.clear()
    store = PostgresStorage(server.dsn)
    engine = create_engine(store)
    with pytest.raises(StorageFullError) as raised:
        asyncio.run(engine.run(pg_filler, 200, key="filler"))
    error = raised.value
    assert isinstance(error, DurablyError) and isinstance(error, OSError)
    assert "SQLSTATE 53100" in error.message and "could not extend file" in error.message
    assert error.hint == FULL_SQLSTATES["53100"] and error.docs
    assert isinstance(error.__cause__, Exception) and error.__cause__.sqlstate == "53100"  # the server's own error
    done_before = len(WROTE)
    assert 10 < done_before < 200
    run_id = engine.resolve("filler")
    log = store.read(run_id)
    assert log is not None and log.torn is None  # nothing partial was kept
    kinds = [type(r).__name__ for r in log.records]
    assert kinds[:2] == ["Header", "Claim"] and set(kinds[2:]) == {"Ok"}  # no end: not failed, not compensated
    assert asyncio.run(engine.inspect(run_id)).status == "interrupted"
    store.close()

    server.unlimit()
    WROTE.clear()
    again = create_engine(PostgresStorage(server.dsn))
    assert asyncio.run(again.run(pg_filler, 200, key="filler")) == 200
    assert len(WROTE) == 200 - done_before + 1  # only the step whose record did not fit ran again
    again.storage.close()


def test_only_out_of_space_sqlstates_are_mapped() -> None:
    class Fake(Exception):
        def __init__(self, sqlstate: str) -> None:
            super().__init__("boom")
            self.sqlstate = sqlstate

    for sqlstate in FULL_SQLSTATES:
        mapped = storage_full(Fake(sqlstate), "durably")
        assert isinstance(mapped, StorageFullError) and f"SQLSTATE {sqlstate}" in mapped.message and mapped.hint
    for other in ("40001", "23505", "53200", "53300", "08006", None):
        assert storage_full(Fake(other), "durably") is None  # type: ignore[arg-type]
