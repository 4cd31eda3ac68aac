"""Test scaffolding shared by the suites: cutting a run off, crashing one, running a coroutine, checking an error,
waiting for a condition, finding run logs, a storage adapter of each kind, the CLI in this process and in a
subprocess."""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

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

