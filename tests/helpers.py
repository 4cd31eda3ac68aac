"""Test scaffolding shared by the suites: cutting a run off, running a coroutine, checking an error, the CLI."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from durably_py import DurablyError


class Stop(BaseException):  # noqa: N818 - stands in for a killed process, not an error
    """Raised by a test workflow to cut its run off mid-way: escapes run() like a killed process."""


def go(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run the coroutine `main()` makes on a fresh event loop."""
    return asyncio.run(main())


def check_error(exc: BaseException) -> None:
    """`exc` is a durably error a user can act on: it has a hint and a docs link."""
    assert isinstance(exc, DurablyError)
    assert exc.hint and exc.docs


def durably(*args: str, cwd: Path, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    """`python -m durably_py.cli ARGS` in a real subprocess that imports this checkout."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **env}
    return subprocess.run([sys.executable, "-m", "durably_py.cli", *args], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=timeout)
