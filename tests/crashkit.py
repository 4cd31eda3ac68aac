"""Workflows run in child processes by the crash tests, and the helpers that spawn, watch and SIGKILL them.

As a script, ``python crashkit.py SCENARIO DIR EFFECTS [ARG_JSON]`` runs one workflow on FileStorage under
DIR and prints one JSON line: ``{"ok": true, "result": ...}`` (exit 0) or ``{"ok": false, "type": ...,
"message": ..., "details": ...}`` (exit 1). With $CRASHKIT_ANNOUNCE set it first logs a ``joining`` effect. Every step appends ``<label> <pid> [fields...]`` to the EFFECTS
file (append mode, flushed), so a test counts how often each step really ran and in which process.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
EFFECTS = ""


# ---- the child side ------------------------------------------------------------------------------
def effect(label: str, *fields: Any) -> None:
    """Record one execution of `label` by this process in the effects file."""
    with open(EFFECTS, "a") as f:
        f.write(" ".join([label, str(os.getpid()), *map(str, fields)]) + "\n")
        f.flush()


def bump(path: str) -> int:
    """Increment the integer in `path` (missing counts as 0) and return the new value."""
    try:
        n = int(Path(path).read_text() or 0)
    except FileNotFoundError:
        n = 0
    Path(path).write_text(str(n + 1))
    return n + 1


def _child_workflows() -> dict[str, Callable[[Any], tuple[Any, Any]]]:
    """Scenario name -> (workflow, input) factory; built lazily so the test process never imports them."""
    from durably_py import Retry, StepInterruptedError, attempt, workflow

    async def work(label: str, value: Any, pause: float) -> Any:
        effect(label)
        await asyncio.sleep(random.random() * pause)
        return value

    @workflow
    async def sequential(ctx: Any, spec: dict[str, Any]) -> int:
        total = 0
        for i in range(spec["n"]):
            total += await ctx.step(work, f"s{i}", i * i, spec["pause"], name=f"s{i}")
        return total

    @workflow
    async def fanout(ctx: Any, spec: dict[str, Any]) -> dict[str, Any]:
        head = [await ctx.step(work, f"h{i}", i, spec["pause"], name=f"h{i}") for i in range(spec["head"])]

        async def branch(b: int) -> int:
            acc = 0
            for j in range(spec["depth"]):
                acc += await ctx.step(work, f"b{b}.{j}", b * 100 + j, spec["pause"], name=f"b{b}.{j}")
            return acc

        results = await ctx.parallel([lambda b=b: branch(b) for b in range(spec["width"])])
        tail = [await ctx.step(work, f"t{i}", -i, spec["pause"], name=f"t{i}") for i in range(spec["tail"])]
        return {"head": head, "branches": [r.value for r in results], "tail": tail}

    async def flaky() -> int:
        n = bump(EFFECTS + ".count")
        effect("flaky", attempt().number, time.time())
        if n <= 2:
            raise RuntimeError(f"flaky failure {n}")
        return n

    @workflow
    async def retrying(ctx: Any, spec: dict[str, Any]) -> int:
        effect("body", time.time())
        return await ctx.step(flaky, name="flaky", retry=Retry(4, backoff="linear", base=1.0))

    async def crunch(n: int, pause: float) -> dict[str, Any]:
        att = attempt()
        state = att.stashed or {"i": -1, "sum": 0}
        effect("resume", json.dumps(att.stashed, separators=(",", ":")))
        total = state["sum"]
        for i in range(state["i"] + 1, n):
            effect(f"item{i}")
            total += i * i
            await asyncio.sleep(pause)
            att.stash({"i": i, "sum": total})
        return {"sum": total}

    @workflow
    async def stashing(ctx: Any, spec: dict[str, Any]) -> dict[str, Any]:
        return await ctx.step(crunch, spec["n"], spec["pause"], name="crunch")

    async def book(i: int) -> dict[str, int]:
        effect(f"book{i}")
        return {"i": i}

    async def undo(booking: dict[str, int]) -> None:
        await asyncio.sleep(0.2)
        effect(f"undo{booking['i']}")

    async def charge() -> None:
        effect("charge")
        raise ValueError("card declined")

    @workflow
    async def saga(ctx: Any, spec: dict[str, Any]) -> None:
        for i in range(spec["n"]):
            await ctx.step(book, i, name=f"book{i}", compensate=undo)
        await ctx.step(charge, name="charge")

    async def send() -> str:
        effect("send")
        await asyncio.sleep(60)
        return "sent"

    @workflow
    async def mailer(ctx: Any, spec: dict[str, Any]) -> dict[str, Any]:
        await ctx.step(work, "prepare", 1, 0.0, name="prepare")
        try:
            status: Any = await ctx.step(send, name="send", replay="unsafe", on_interrupt="raise")
        except StepInterruptedError as exc:
            status = {"reconciled": True, "path": exc.path, "label": exc.label, "operation_id": exc.operation_id,
                      "run_id": ctx.run_id}
        after = await ctx.step(work, "after", 2, 0.0, name="after")
        return {"status": status, "after": after}

    async def slow_step(label: str, value: int, pause: float) -> int:
        effect(label)
        await asyncio.sleep(pause)
        return value

    @workflow
    async def slow(ctx: Any, spec: dict[str, Any]) -> list[int]:
        return [await ctx.step(slow_step, f"w{i}", i * 10, spec["pause"], name=f"w{i}") for i in range(spec["n"])]

    flows = {"sequential": sequential, "fanout": fanout, "retrying": retrying, "stashing": stashing,
             "saga": saga, "mailer": mailer, "slow": slow}
    return {name: (lambda spec, wf=wf: (wf, spec)) for name, wf in flows.items()}


def child_main(argv: list[str]) -> int:
    """Run one scenario to its end and print its outcome as a JSON line."""
    global EFFECTS
    from durably_py import DurablyError, run

    scenario, directory, EFFECTS = argv[1], argv[2], argv[3]
    spec = json.loads(argv[4]) if len(argv) > 4 else {}
    if os.environ.get("CRASHKIT_ANNOUNCE"):
        effect("joining")
    wf, value = _child_workflows()[scenario](spec)
    try:
        result = run(wf, value, dir=directory, advisories="silent")
    except Exception as exc:  # noqa: BLE001 - the test reads the failure from stdout
        details = exc.details if isinstance(exc, DurablyError) else {}
        print(json.dumps({"ok": False, "type": type(exc).__name__, "message": str(exc), "details": details},
                         default=str), flush=True)
        return 1
    print(json.dumps({"ok": True, "result": result}), flush=True)
    return 0


# ---- the test side -------------------------------------------------------------------------------
class Effect:
    """One line of the effects file."""

    __slots__ = ("label", "pid", "fields")

    def __init__(self, line: str) -> None:
        parts = line.split(" ")
        self.label = parts[0]
        self.pid = int(parts[1])
        self.fields = parts[2:]

    def __repr__(self) -> str:
        return f"Effect({self.label!r}, pid={self.pid}, {self.fields})"


class Sandbox:
    """One state directory and effects file, plus every child spawned on them (killed on close)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dir = root / "state"
        self.effects_path = root / "effects.txt"
        root.mkdir(parents=True, exist_ok=True)
        self.effects_path.touch()
        self.procs: list[subprocess.Popen[str]] = []

    # -- processes
    def spawn(self, scenario: str, spec: dict[str, Any] | None = None, announce: bool = False
              ) -> subprocess.Popen[str]:
        """Start a child running `scenario` with input `spec`; `announce` logs a `joining` effect before run()."""
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("DURABLY_DIR", None)
        env.pop("CRASHKIT_ANNOUNCE", None)
        if announce:
            env["CRASHKIT_ANNOUNCE"] = "1"
        proc = subprocess.Popen(
            [sys.executable, str(HERE), scenario, str(self.dir), str(self.effects_path), json.dumps(spec or {})],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=self.root)
        self.procs.append(proc)
        return proc

    @staticmethod
    def kill(proc: subprocess.Popen[str]) -> None:
        """SIGKILL `proc` and reap it."""
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)

    @staticmethod
    def finish(proc: subprocess.Popen[str], timeout: float = 30.0) -> tuple[int, dict[str, Any], str]:
        """Wait for `proc` to end on its own: (exit code, its JSON outcome, its stderr)."""
        out, err = proc.communicate(timeout=timeout)
        lines = out.strip().splitlines()
        outcome = json.loads(lines[-1]) if lines else {}
        return proc.returncode, outcome, err

    def close(self) -> None:
        """Kill and reap every child still running."""
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            try:
                proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass

    # -- observation
    def effects(self) -> list[Effect]:
        """Every complete effect line so far."""
        text = self.effects_path.read_text()
        return [Effect(line) for line in text.split("\n")[:-1] if line]

    def counts(self, effects: list[Effect] | None = None) -> dict[str, int]:
        """How many times each label was executed."""
        out: dict[str, int] = {}
        for e in self.effects() if effects is None else effects:
            out[e.label] = out.get(e.label, 0) + 1
        return out

    def logs(self) -> list[Path]:
        """The run logs under the state directory."""
        return sorted((self.dir / "runs").glob("*.jsonl")) if (self.dir / "runs").exists() else []

    def log(self) -> Path:
        """The run log that has step records (an orphan header-only log may exist if a child died creating it)."""
        logs = self.logs()
        assert logs, "no run log was written"
        with_steps = [p for p in logs if any(r.get("t") != "run" for r in read_records(p))]
        assert len(with_steps) <= 1, f"more than one run has records: {with_steps}"
        return with_steps[0] if with_steps else logs[0]

    def records(self) -> list[dict[str, Any]]:
        """The complete records of the run log (a torn tail is left out)."""
        return read_records(self.log()) if self.logs() else []

    def done_labels(self) -> set[str]:
        """Labels of steps with an `ok` record in any run log."""
        return {r["l"] for p in self.logs() for r in read_records(p) if r.get("t") == "ok"}

    def wait_for(self, proc: subprocess.Popen[str], predicate: Callable[[], bool], timeout: float = 20.0) -> bool:
        """Poll `predicate` until it holds (True) or `proc` exits first (False); fail after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            if proc.poll() is not None:
                return predicate()
            time.sleep(0.001)
        raise AssertionError(f"timed out after {timeout}s waiting for the child {proc.args}")


def read_records(path: Path) -> list[dict[str, Any]]:
    """Complete lines of a log, each parsed on its own (the torn tail, if any, is left out)."""
    data = path.read_bytes()
    return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].split(b"\n")[:-1] if line.strip()]


@contextmanager
def sandbox(root: Path) -> Iterator[Sandbox]:
    """A `Sandbox` whose children are killed when the block ends, however it ends."""
    box = Sandbox(root)
    try:
        yield box
    finally:
        box.close()


class KillReport:
    """What one chaos run saw: per kill, how many effect lines existed and which steps the log had finished."""

    def __init__(self) -> None:
        self.kills: list[tuple[int, set[str]]] = []
        self.outcome: dict[str, Any] = {}
        self.stderr = ""


def chaos(box: Sandbox, scenario: str, spec: dict[str, Any], steps: int, seed: int, max_kills: int = 4,
          deadline: float = 60.0) -> KillReport:
    """Run `scenario`, SIGKILLing it at random moments and restarting it, until its run is completed.

    A run killed after its `end` record is complete (running the command again would start a fresh run).
    """
    rng = random.Random(seed)
    report = KillReport()
    end = time.monotonic() + deadline
    while True:
        assert time.monotonic() < end, f"seed {seed}: no completion within {deadline}s"
        proc = box.spawn(scenario, spec)
        if len(report.kills) < max_kills:
            if rng.random() < 0.25:
                reached = proc.poll() is None and not _sleep_unless_exit(proc, rng.uniform(0.02, 0.3))
            else:
                remaining = max(steps - len(box.done_labels()), 1)
                target = len(box.effects()) + rng.randint(1, remaining + 2)
                reached = box.wait_for(proc, lambda t=target: len(box.effects()) >= t)
                time.sleep(rng.random() * 0.004)
            if reached and proc.poll() is None:
                box.kill(proc)
                report.kills.append((len(box.effects()), box.done_labels()))
                last = box.records()[-1:]
                if last and last[0]["t"] == "end" and last[0]["status"] == "completed":
                    report.outcome = {"ok": True, "result": last[0]["result"]}
                    return report
                continue
        code, report.outcome, report.stderr = box.finish(proc)
        assert code == 0, f"seed {seed}: child failed: {report.outcome} {report.stderr}"
        return report


def _sleep_unless_exit(proc: subprocess.Popen[str], seconds: float) -> bool:
    """Sleep `seconds`; True if `proc` exited meanwhile."""
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


if __name__ == "__main__":
    sys.exit(child_main(sys.argv))
