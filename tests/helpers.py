"""Test scaffolding shared by the suites: cutting a run off, crashing one, running a coroutine, checking an error,
waiting for a condition, finding run logs, a storage adapter of each kind, the CLI in this process and in a
subprocess."""

from __future__ import annotations

import asyncio
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner

from durably_py import DurablyError, Engine, FileStorage, MemoryStorage, SqliteStorage
from durably_py.cli import app
from durably_py.testing import inject_crash

runner = CliRunner()


class Stop(BaseException):  # noqa: N818 - stands in for a killed process, not an error
    """Raised by a test workflow to cut its run off mid-way: escapes run() like a killed process."""


def go(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run the coroutine `main()` makes on a fresh event loop."""
    return asyncio.run(main())


def check_error(exc: BaseException) -> None:
    """`exc` is a durably error a user can act on: it has a hint and a docs link."""
    assert isinstance(exc, DurablyError)
    assert exc.hint and exc.docs


def interrupt(engine: Engine, wf: Any, input: Any, after: tuple[int, ...]) -> str:
    """Run `wf` until the process 'dies' right after step `after`; return the run id."""
    started: list[str] = []
    try:
        with inject_crash(after=after):
            asyncio.run(engine.run(wf, input, on_run=started.append))
    except Exception:
        raise
    except BaseException:  # noqa: BLE001 - the simulated process death
        pass
    else:
        raise AssertionError("the run did not crash")
    return started[0]


def log_files(state_dir: Path) -> list[Path]:
    """Every run log under `state_dir`, sorted by name."""
    return sorted((state_dir / "runs").glob("*.jsonl"))


def storage_of(kind: str, tmp_path: Path, request: pytest.FixtureRequest | None = None) -> Any:
    """A fresh adapter of `kind` rooted in `tmp_path` (postgres: on the test's schema of the session's server)."""
    if kind == "file":
        return FileStorage(tmp_path / "state")
    if kind == "memory":
        return MemoryStorage()
    if kind == "postgres":
        assert request is not None
        return request.getfixturevalue("postgres_storage")()
    return SqliteStorage(tmp_path / "state" / "durably.db")


def wait_until(check: Callable[[], bool], seconds: float = 20.0, every: float = 0.02) -> None:
    """Poll `check` every `every` seconds until it is true; fail the test after `seconds`."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)


def drain_while_killing(start: Callable[[], subprocess.Popen[bytes]], done: Callable[[], bool], *, kills: int,
                        pause: tuple[float, float], rng: Any, seconds: float, processes: int = 3) -> int:
    """Run `processes` workers made by `start` until `done()` or `seconds` pass: after a pause drawn from `pause`,
    SIGKILL one at random and start another in its place, `kills` times, then only wait; terminate them all at the
    end. Returns how many were killed."""
    procs = [start() for _ in range(processes)]
    killed = 0
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not done():
            if killed < kills:
                time.sleep(rng.uniform(*pause))
                victim = rng.randrange(len(procs))
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait()
                procs[victim] = start()
                killed += 1
            else:
                time.sleep(0.2)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    return killed


def records_of(storage: Any, run_id: str) -> list[dict[str, Any]]:
    """A run's records as plain dicts."""
    return [r if isinstance(r, dict) else msgspec.to_builtins(r) for r in storage.read(run_id).records]


def invoke(*args: str) -> Any:
    """`durably ARGS` in this process (typer's runner): exit code and output, no subprocess."""
    return runner.invoke(app, list(args))


def durably(*args: str, cwd: Path | None = None, timeout: float = 60, columns: int | None = None,
            unset: tuple[str, ...] = (), pythonpath: bool = True, module: str = "durably_py.cli", check: bool = False,
            **env: str) -> subprocess.CompletedProcess[str]:
    """`python -m MODULE ARGS` (the CLI by default) in a real subprocess, run to its end.

    `cwd` None keeps this process's directory. The child's environment is this process's, then: `unset` names
    removed (a name ending in `*` removes every name with that prefix), `COLUMNS` set when `columns` is given,
    `PYTHONPATH` set to this process's `sys.path` when `pythonpath` (so it imports this checkout), `env` added
    last (it overrides all of those). `check` fails the test, showing stderr, on a non-zero exit code."""
    prefixes = tuple(name[:-1] for name in unset if name.endswith("*"))
    environ = {k: v for k, v in os.environ.items() if k not in unset and not (prefixes and k.startswith(prefixes))}
    if columns is not None:
        environ["COLUMNS"] = str(columns)
    if pythonpath:
        environ["PYTHONPATH"] = os.pathsep.join(sys.path)
    environ.update(env)
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=environ, capture_output=True, text=True,
                          timeout=timeout)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def read_until(fd: int, needle: bytes, seconds: float) -> bytes:
    """What a terminal (a pty's controller `fd`) shows until `needle` appears, the output ends or `seconds` pass."""
    seen = b""
    deadline = time.monotonic() + seconds
    while needle not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                seen += os.read(fd, 65536)
            except OSError:
                break
    return seen


FAN_OUT = """
def mark(n):
    with open(effects, "a") as f:
        f.write(f"{n}\\n")
    return n


@workflow
async def kid(ctx, n):
    return await ctx.step(mark, n)


@workflow
async def mom(ctx, count):
    handles = await ctx.spawn_all([(kid, n) for n in range(count)])
    return sum(r.value * (i + 1) for i, r in enumerate(await ctx.join_all(handles)))
"""
"""Script text for fan-out kill tests (the script defines `effects`, a path): `mom(count)` spawns `kid(n)` for
each n < count, each appending n to `effects` in its one step, and returns sum(n * (n + 1)), which only
results joined in order give."""


def fan_out_sum(count: int) -> str:
    """What `FAN_OUT`'s `mom(count)` prints."""
    return str(sum(n * (n + 1) for n in range(count)))


PG_BIN_GLOBS = ("/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin", "/opt/homebrew/opt/postgresql*/bin",
                "/usr/local/opt/postgresql*/bin", "/usr/local/pgsql/bin")


def pg_bindir() -> Path | None:
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


class PgServer:
    """A throwaway PostgreSQL server in a temp dir, listening only on a unix socket there (run as the
    'postgres' user when this process is root); `start` skips the test with the reason when it cannot."""

    def __init__(self, options: str = "") -> None:
        import shutil

        self.bindir = pg_bindir()
        if self.bindir is None:
            pytest.skip("PostgreSQL tests need the server binaries (initdb, pg_ctl): none on PATH or in "
                        + ", ".join(PG_BIN_GLOBS) + " (apt-get install postgresql)")
        self.prefix: list[str] = []
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
            self.prefix, owner = [runuser, "-u", "postgres", "--"], (entry.pw_uid, entry.pw_gid)
        import tempfile

        self.root = Path(tempfile.mkdtemp(prefix="durably-pg-"))
        if owner is not None:
            os.chown(self.root, *owner)
        self.data, self.log = self.root / "data", self.root / "server.log"
        self.options = f"-k {self.root} -c listen_addresses='' {options}"
        self.dsn = f"host={self.root} user=postgres dbname=postgres"

    def call(self, *args: str) -> Any:
        import subprocess

        return subprocess.run([*self.prefix, *args], cwd=self.root, capture_output=True, text=True, timeout=60)

    def start(self) -> None:
        """initdb (the first time) and start the server."""
        done = None
        if not self.data.exists():
            done = self.call(str(self.bindir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                             "-E", "UTF8", "--no-sync")
        if done is None or done.returncode == 0:
            done = self.call(str(self.bindir / "pg_ctl"), "start", "-w", "-t", "30", "-D", str(self.data),
                             "-l", str(self.log), "-o", self.options)
        if done.returncode != 0:
            server_log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            self.remove()
            pytest.skip(f"could not start a PostgreSQL server from {self.bindir}: {done.stderr.strip()[-1000:]} "
                        f"{server_log}")

    def crash(self) -> None:
        """Stop the server the way a crash does: at once, no shutdown checkpoint, what it held in memory lost."""
        self.call(str(self.bindir / "pg_ctl"), "stop", "-D", str(self.data), "-m", "immediate", "-w")

    def remove(self) -> None:
        """Stop the server and delete its files."""
        import shutil

        if self.data.exists():
            self.crash()
        shutil.rmtree(self.root, ignore_errors=True)


def storage_url(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A fresh store of `kind` ("file", "sqlite" or "postgres") for real worker processes to share: a state dir,
    a SQLite file, or a schema of the test session's PostgreSQL server (`postgres_dsn`), dropped afterwards."""
    if kind == "file":
        return str(tmp_path / "state")
    if kind == "sqlite":
        (tmp_path / "state").mkdir(parents=True, exist_ok=True)
        return f"sqlite:{tmp_path / 'state' / 'runs.db'}"
    import uuid

    import psycopg

    dsn = request.getfixturevalue("postgres_dsn")
    parts = dict(p.split("=", 1) for p in dsn.split())
    schema = f"test_{uuid.uuid4().hex[:16]}"

    def drop() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

    request.addfinalizer(drop)
    return f"postgresql://{parts['user']}@/{parts['dbname']}?host={parts['host']}&schema={schema}"
