"""One script's workflows run in each mode a semantic test covers: in this process (`run()`,
`run(wait=False)`, `TestEngine`), by a real `durably worker` process, and by `durably run` subprocesses a
test can SIGKILL.

A test writes its workflows as a script (`write_script`), so worker and CLI processes import the same code
this process loads (`load`). Steps count their executions in an effects file (`Effects`) the script finds
through $MODES_EFFECTS, one line per execution, so a count holds across processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from durably_py import RunState, engine_for
from durably_py._authoring.workflow import load_script

ENDED = ("completed", "failed", "cancelled")
PARKED = ("waiting", "sleeping", "paused")
_loaded: dict[Path, ModuleType] = {}

EFFECTS_HEADER = '''
import os


def mark(label, *fields):
    """Count one execution of `label` (with `fields`) in the effects file."""
    with open(os.environ["MODES_EFFECTS"], "a") as f:
        f.write(" ".join([label, str(os.getpid()), *map(str, fields)]) + "\\n")
'''


class Effects:
    """The effects file of one test: where the script's `mark` calls go, and how often each label ran."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.touch()
        os.environ["MODES_EFFECTS"] = str(path)

    def lines(self) -> list[list[str]]:
        """Every complete line, split: label, pid, fields."""
        text = self.path.read_text()
        return [line.split(" ") for line in text.split("\n")[:-1] if line]

    def count(self, label: str) -> int:
        """How often `label` ran, in every process."""
        return sum(1 for line in self.lines() if line[0] == label)

    def labels(self) -> list[str]:
        """The labels in execution order."""
        return [line[0] for line in self.lines()]

    def clear(self) -> None:
        """Forget what ran so far."""
        self.path.write_text("")


def write_script(folder: Path, name: str, body: str) -> Path:
    """A script `name`.py in `folder`: the effects helper (`mark`) and `body`."""
    path = folder / f"{name}.py"
    path.write_text(EFFECTS_HEADER + textwrap.dedent(body))
    return path


def load(script: Path) -> ModuleType:
    """The script imported into this process (once per path), its workflows registered."""
    module = _loaded.get(script)
    if module is None:
        module = _loaded[script] = load_script(script)
    return module


def flows_fixture(name: str, body: str) -> Any:
    """A module-scoped fixture giving (the script `name`.py written from `body`, the module it is here)."""

    @pytest.fixture(scope="module")
    def flows(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModuleType]:
        script = write_script(tmp_path_factory.mktemp(name), name, body)
        return script, load(script)

    return flows


def effects_fixture() -> Any:
    """A fixture named `effects`: the test's effects file."""

    @pytest.fixture(name="effects")
    def make(tmp_path: Path) -> Effects:
        return Effects(tmp_path / "effects.txt")

    return make


def environ() -> dict[str, str]:
    """The environment of a child process: this one's, importing this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`durably ARGS` in a subprocess, run to its end."""
    return subprocess.run([sys.executable, "-m", "durably_py.cli", *args], env=environ(), capture_output=True,
                          text=True, timeout=timeout)


def cli_process(*args: str) -> subprocess.Popen[str]:
    """`durably ARGS` started in a subprocess (a test may SIGKILL it)."""
    return subprocess.Popen([sys.executable, "-m", "durably_py.cli", *args], env=environ(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill(proc: subprocess.Popen[str]) -> None:
    """SIGKILL `proc` and reap it."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)


def state_of(state_dir: Path, run: str) -> RunState:
    """The run as `durably inspect` sees it."""
    return asyncio.run(engine_for(state_dir).inspect(run))


def wait_until(check: Any, seconds: float = 30.0, every: float = 0.005) -> None:
    """Poll `check()` until it is true; fail after `seconds`."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)


def records(state_dir: Path, run: str) -> list[dict[str, Any]]:
    """The run's records as plain JSON objects."""
    return asyncio.run(engine_for(state_dir).records(run))


def in_worker(state_dir: Path, script: Path, workflow: str, input: Any = None, *, key: str,
              until: tuple[str, ...] = ENDED, timeout: float = 60.0) -> RunState:
    """Enqueue `workflow(input)` under `key` with `durably enqueue`, let one `durably worker` process serve it
    until its status is one of `until`, stop the worker (SIGTERM) and return the run's state."""
    args = ["--dir", str(state_dir)]
    enqueued = cli("enqueue", str(script), "--workflow", workflow, "--input", json.dumps(input), "--key", key,
                   *args)
    assert enqueued.returncode == 0, enqueued.stderr
    return serve(state_dir, script, key, until=until, timeout=timeout)


def serve(state_dir: Path, script: Path, run: str, *, until: tuple[str, ...] = ENDED,
          timeout: float = 60.0) -> RunState:
    """One `durably worker` process serving `script` until `run`'s status is one of `until`; its state then."""
    worker = cli_process("worker", "--import", str(script), "--dir", str(state_dir), "--poll", "0.02", "-q")
    try:
        wait_until(lambda: state_of(state_dir, run).status in until or worker.poll() is not None, timeout, 0.02)
        assert worker.poll() is None, worker.communicate()[1]
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=30)
    state = state_of(state_dir, run)
    assert state.status in until, (state.status, err)
    return state
