"""A store holding a record of every kind `records.py` defines, made the way users make them: real `durably`
commands in subprocesses (runs, retries, a pause, a signal, a code change, a retry from a step, a stale run
adopted, a run killed inside an unsafe step and resolved, an awakeable resolved, a cancel, a worker that parks a parent in its join). Shared by the `logs`/`inspect` tests and the console's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from helpers import durably

SCRIPT = textwrap.dedent('''
    import os, pathlib, time
    from durably_py import Retry, Task, attempt, workflow

    V = os.environ.get("FLOW_VERSION", "1")

    def stashy():
        current = attempt()
        if current.number == 1:
            current.stash({"done": 1})
            raise ConnectionError("first try fails")
        return current.stashed

    def once():
        return "charged"

    def double(x):
        return x * 2

    def nap(seconds):
        time.sleep(seconds)
        return seconds

    def book(x):
        return f"booked {x}"

    def unbook(booking):
        return None

    def explode(x):
        raise RuntimeError("no seats")

    @workflow
    async def leaf(ctx, n):
        return await ctx.step(double, n)

    async def count_to_two(state, it):
        if state >= 2:
            return it.done(state)
        await it.step(double, state, name="loop-step")
        await it.step(double, state, name="loop-check")
        return state + 1

    async def everything_body(ctx, n):
        await ctx.step(stashy, retry=Retry(2, base=0.01))
        await ctx.step(once, replay="unsafe")
        ctx.charge(usd=0.25, tokens=10)
        ctx.annotate(stage="charged")
        await ctx.graph({"a": Task(leaf, 1), "b": Task(leaf, 2, depends_on=["a"])})
        await ctx.loop(0, count_to_two)
        await ctx.sleep(0.01)
        ctx.patched("v2")
        return await ctx.wait_for("go")

    if V == "1":
        @workflow(name="everything")
        async def everything(ctx, n):
            return await everything_body(ctx, n)
    else:
        @workflow(name="everything")
        async def everything(ctx, n):
            got = await everything_body(ctx, n)
            return got

    @workflow
    async def saga(ctx, n):
        await ctx.step(book, n, compensate=unbook)
        await ctx.step(explode, n)

    if V == "1":
        @workflow(name="renamed")
        async def renamed(ctx, n):
            first = await ctx.step(double, n, name="first")
            await ctx.wait_for("later", timeout=600)
            return first
    else:
        @workflow(name="renamed")
        async def renamed(ctx, n):
            first = await ctx.step(double, n, name="second")
            await ctx.wait_for("later", timeout=600)
            return first

    def charge(n):
        pathlib.Path("charging").write_text("")
        time.sleep(600)
        return n

    @workflow
    async def effect(ctx, n):
        return await ctx.step(charge, n, replay="unsafe")

    @workflow
    async def stopped(ctx, n):
        return await ctx.wait_for("never", timeout=600)

    @workflow
    async def callback(ctx, n):
        approval = await ctx.awakeable(timeout=600, name="approval")
        return await approval

    @workflow
    async def napkid(ctx, seconds):
        return await ctx.step(nap, seconds)

    @workflow
    async def parent(ctx, n):
        child = await ctx.spawn(napkid, 0.3)
        return await ctx.join(child)
''')

BUDGET = "from durably_py import run\nimport kinds\nprint(run(kinds.everything, 1, budget={'usd': 10}))\n"


def cli(project: Path, *args: str, code: int | None = 0, version: str = "1") -> subprocess.CompletedProcess[str]:
    """`durably ARGS` in `project`; its exit code must be `code` (None: any)."""
    done = durably(*args, cwd=project, FLOW_VERSION=version)
    assert code is None or done.returncode == code, (args, done.returncode, done.stdout, done.stderr)
    return done


def run_id_of(project: Path, workflow: str) -> str:
    return cli(project, "list", "-q", "--workflow", workflow).stdout.split()[0]


def make_every_kind(project: Path) -> dict[str, str]:
    """Fill `project/.durably` with runs that together hold every record kind; their ids by workflow."""
    (project / "kinds.py").write_text(SCRIPT)
    cli(project, "run", "kinds.py", "-w", "everything", "-i", "1", "--no-wait", code=3)  # parks on its sleep
    everything = run_id_of(project, "everything")
    cli(project, "retry", everything, "--no-wait", code=3)  # its wake time passed: on to the wait
    cli(project, "pause", everything)
    cli(project, "resume", everything)
    cli(project, "signal", everything, "go", "5")
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(project), *sys.path]), "FLOW_VERSION": "2"}
    done = subprocess.run([sys.executable, "-c", BUDGET], cwd=project, env=environ, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "5", done.stderr
    cli(project, "retry", everything, "--from-step", "ctx.sleep", "--no-wait", code=3, version="2")

    cli(project, "run", "kinds.py", "-w", "saga", "-i", "1", code=1)
    saga = run_id_of(project, "saga")
    cli(project, "retry", saga, code=1)

    cli(project, "run", "kinds.py", "-w", "renamed", "-i", "1", "--no-wait", code=3)
    renamed = run_id_of(project, "renamed")
    cli(project, "retry", renamed, code=1, version="2")  # stale: 'first' is now called 'second'
    cli(project, "adopt", renamed, "--yes", "--no-wait", code=3, version="2")

    runner = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "run", "kinds.py", "-w", "effect", "-i", "1"],
                              cwd=project, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (project / "charging").exists():  # inside its unsafe step: killed there
            assert time.monotonic() < deadline and runner.poll() is None
            time.sleep(0.05)
    finally:
        runner.kill()
        runner.wait(timeout=30)
    effect = run_id_of(project, "effect")
    cli(project, "resolve", effect, "--path", "0", "--value", '"charged by hand"', "--yes")  # a resolve record

    cli(project, "run", "kinds.py", "-w", "stopped", "-i", "1", "--no-wait", code=3)
    stopped = run_id_of(project, "stopped")
    cli(project, "cancel", stopped)

    cli(project, "run", "kinds.py", "-w", "callback", "-i", "1", "--no-wait", code=3)
    callback = run_id_of(project, "callback")
    cli(project, "resolve-awakeable", f"{callback}:0", '"approved"')
    cli(project, "retry", callback)

    parent = cli(project, "enqueue", "kinds.py", "-w", "parent", "-i", "1").stdout.strip()
    worker = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "worker", "--import", "kinds.py"],
                              cwd=project, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while json.loads(cli(project, "inspect", parent, "--json").stdout)["status"] != "completed":
            assert time.monotonic() < deadline and worker.poll() is None, worker.stderr
            time.sleep(0.1)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=30)
    return {"everything": everything, "saga": saga, "renamed": renamed, "parent": parent,
            "stopped": stopped, "effect": effect, "callback": callback}
