"""Shared fixtures: a per-test state dir, a reader for a run's JSONL records, and a throwaway PostgreSQL server; the
package compiled to bytecode once before the tests start."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import PgServer, log_files

# -- pytest-xdist: a worker sees the environment a plain `pytest` run has ----------------------------------------------
# A worker process has COLUMNS=80 and LINES=24 in its environment where the run that started it had none; the CLI
# then wraps its output at 80 columns as it does for a terminal of that size, where a plain run (output not a
# terminal, no COLUMNS) does not wrap. The controller hands its own values down and each worker restores them.

TERMINAL_SIZE = ("COLUMNS", "LINES")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    node.workerinput["terminal_size"] = {name: os.environ.get(name) for name in TERMINAL_SIZE}


def pytest_configure(config: pytest.Config) -> None:
    for name, value in getattr(config, "workerinput", {}).get("terminal_size", {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if not hasattr(config, "workerinput"):
        compile_the_package()


# -- Bytecode: the package is compiled once, before the tests start -------------------------------------------------
# Most tests start `durably` (or a script that imports durably_py) in a subprocess, well over a thousand in all. Where
# PYTHONDONTWRITEBYTECODE is set (as in many container images and CI runners) no subprocess writes the bytecode it
# compiles, so each compiled the whole package from source again: about 0.1 s of every subprocess. Compiling it once
# here (what an install without that setting does on the first import) lets each one load the cached bytecode,
# which Python checks against the source's time and size as usual, so an edited module is compiled afresh.

def compile_the_package() -> None:
    import compileall

    import durably_py

    compileall.compile_dir(Path(durably_py.__file__).parent, quiet=2)
    compileall.compile_dir(Path(__file__).parent, maxlevels=0, quiet=2, rx=re.compile(r"[/\\]test_[^/\\]*$"))


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

@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    """A libpq connection string for a PostgreSQL superuser on a private server, started once per session."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("PostgreSQL tests need psycopg 3 (pip install -e '.[test]')")
    if os.environ.get("DURABLY_TEST_POSTGRES_DSN"):
        yield os.environ["DURABLY_TEST_POSTGRES_DSN"]
        return
    server = PgServer("-c fsync=off -c full_page_writes=off")
    server.start()
    try:
        yield server.dsn
    finally:
        server.remove()


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

