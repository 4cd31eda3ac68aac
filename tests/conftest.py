"""Shared fixtures: a per-test state dir, a reader for a run's JSONL records, and a throwaway PostgreSQL server."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import log_files


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    """A fresh `.durably` state dir for the test (not created until a run needs it)."""
    return tmp_path / ".durably"


@pytest.fixture
def records(state_dir: Path) -> Callable[..., list[dict[str, Any]]]:
    """`records(run_id=None)`: the decoded lines of a run's log (the only run when no id is given)."""

    def read(run_id: str | None = None) -> list[dict[str, Any]]:
        if run_id is None:
            logs = log_files(state_dir)
            assert len(logs) == 1, f"expected exactly one run log, found {logs}"
            path = logs[0]
        else:
            path = state_dir / "runs" / f"{run_id}.jsonl"
        return [json.loads(line) for line in path.read_bytes().splitlines() if line.strip()]

    return read


# -- PostgreSQL: a throwaway server for the PostgresStorage tests -------------------------------------------------
# `postgres_dsn` starts one server per test session (initdb in a temp dir, listening only on a unix socket there)
# and skips with the reason when it cannot; DURABLY_TEST_POSTGRES_DSN points the tests at an existing server instead.
# `postgres_storage()` makes adapters on one fresh schema per test, dropped afterwards.

PG_BIN_GLOBS = ("/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin", "/opt/homebrew/opt/postgresql*/bin",
                "/usr/local/opt/postgresql*/bin", "/usr/local/pgsql/bin")


def _pg_bindir() -> Path | None:
    """The directory holding `initdb` and `pg_ctl`: on PATH, else the newest versioned install."""
    import glob
    import shutil

    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return Path(found).resolve().parent
    candidates = [Path(d) for pattern in PG_BIN_GLOBS for d in glob.glob(pattern)]
    candidates = [d for d in candidates if (d / "initdb").exists() and (d / "pg_ctl").exists()]
    candidates.sort(key=lambda d: [int(p) if p.isdigit() else 0 for p in re.split(r"\D+", str(d)) if p])
    return candidates[-1] if candidates else None


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    """A libpq connection string for a PostgreSQL superuser on a private server, started once per session."""
    import shutil
    import subprocess
    import tempfile

    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("PostgreSQL tests need psycopg 3 (pip install -e '.[test]')")
    if os.environ.get("DURABLY_TEST_POSTGRES_DSN"):
        yield os.environ["DURABLY_TEST_POSTGRES_DSN"]
        return
    bindir = _pg_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL tests need the server binaries (initdb, pg_ctl): none on PATH or in "
                    + ", ".join(PG_BIN_GLOBS) + " (apt-get install postgresql)")
    prefix: list[str] = []
    owner: tuple[int, int] | None = None
    if os.geteuid() == 0:
        import pwd

        try:
            entry = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("PostgreSQL refuses to run as root and there is no 'postgres' system user to run it as")
        runuser = shutil.which("runuser")
        if runuser is None:
            pytest.skip("PostgreSQL refuses to run as root and `runuser` is missing to run it as 'postgres'")
        prefix, owner = [runuser, "-u", "postgres", "--"], (entry.pw_uid, entry.pw_gid)
    root = Path(tempfile.mkdtemp(prefix="durably-pg-"))
    if owner is not None:
        os.chown(root, *owner)
    data, log = root / "data", root / "server.log"

    def call(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*prefix, *args], cwd=root, capture_output=True, text=True, timeout=60)

    done = call(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
    if done.returncode == 0:
        options = f"-k {root} -c listen_addresses='' -c fsync=off -c full_page_writes=off"
        done = call(str(bindir / "pg_ctl"), "start", "-w", "-t", "30", "-D", str(data), "-l", str(log), "-o", options)
    if done.returncode != 0:
        server_log = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"could not start a PostgreSQL server from {bindir}: {done.stderr.strip()[-1000:]} {server_log}")
    try:
        yield f"host={root} user=postgres dbname=postgres"
    finally:
        call(str(bindir / "pg_ctl"), "stop", "-D", str(data), "-m", "immediate", "-w")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_storage(postgres_dsn: str) -> Iterator[Callable[..., Any]]:
    """`postgres_storage(**options)`: a new `PostgresStorage` (another "machine") on this test's own fresh schema."""
    import uuid

    import psycopg

    from durably_py.storage import PostgresStorage

    schema = f"test_{uuid.uuid4().hex[:16]}"
    made: list[Any] = []

    def make(**options: Any) -> Any:
        made.append(PostgresStorage(postgres_dsn, schema=schema, **options))
        return made[-1]

    yield make
    for adapter in made:
        adapter.close()
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
