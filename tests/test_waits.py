"""Every wait says what it waits for and until when, through real subprocesses (a pseudo-terminal where a person
watches): a lease held by a dead process (SQLite, PostgreSQL), a second process joining a live run, a running
step's elapsed time and its slow-step advisory while it runs, a pending run and the worker it needs, a parked run
that got what it waited for, and `logs --follow` while a process waits in a park."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from helpers import durably, wait_until
from terminal import Terminal

JOB = textwrap.dedent('''
    import asyncio, dataclasses, os, sys, time
    from durably_py import create_engine, workflow

    if os.environ.get("SLOW_AFTER"):  # the slow-step advisory from this many seconds (the catalogue says 60)
        from durably_py._state import advisories as _advisories
        code = _advisories.CODES["SLOW_STEP_NO_TIMEOUT"]
        _advisories.CODES["SLOW_STEP_NO_TIMEOUT"] = dataclasses.replace(code, info_at=float(os.environ["SLOW_AFTER"]))

    def warm(seconds):
        time.sleep(seconds)
        return seconds

    def crunch(seconds):
        time.sleep(seconds + float(os.environ.get("LINGER", "0")))  # LINGER: a process to be killed in it
        return seconds

    @workflow
    async def job(ctx, seconds):
        first = await ctx.step(warm, 0.05, name="warm-up")
        return first + await ctx.step(crunch, seconds)

    @workflow
    async def gate(ctx, n):
        got = await ctx.wait_for("approval", timeout=600)
        return [n, got]

    if __name__ == "__main__":
        engine = create_engine(os.environ.get("DURABLY_STORAGE") or os.environ["DURABLY_DIR"],
                               lease=float(os.environ.get("LEASE", "15")), heartbeat=0.5)
        print(asyncio.run(engine.run(job, float(sys.argv[1]))))
''')


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "job.py").write_text(JOB)
    return tmp_path


def status_of(project: Path, run_id: str, **env: str) -> dict[str, Any]:
    done = durably("inspect", run_id, "--json", cwd=project, **env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def first_run(project: Path, **env: str) -> str:
    listed = durably("list", "-q", cwd=project, **env).stdout.split()
    return listed[0] if listed else ""


def kill_inside_the_slow_step(project: Path, seconds: str, **env: str) -> str:
    """`durably run job.py -- SECONDS` killed with SIGKILL inside its slow step; the run's id."""
    proc = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "run", "job.py", "--", seconds], cwd=project,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "LINGER": "60", **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: bool(first_run(project, **env))
                   and any(s["label"] == "warm-up" and s["status"] == "ok"
                           for s in status_of(project, first_run(project, **env), **env)["steps"]), 30)
    finally:
        proc.kill()
        proc.wait()
    return first_run(project, **env)


def check_dead_lease(project: Path, **env: str) -> None:
    """A process killed in its slow step holds a 5 s lease: while it lasts `list` and `inspect` (asked at once, side
    by side) show its owner unresponsive, and a rerun says whose lease it waits for and how long, then continues
    the run."""
    env = {"LEASE": "5", **env}
    run_id = kill_inside_the_slow_step(project, "0.5", **env)
    commands = [(("list",), {"COLUMNS": "200"}), (("inspect", run_id, "--json"), {}),
                (("inspect", run_id), {"COLUMNS": "250"})]
    with ThreadPoolExecutor(len(commands)) as pool:
        asked = [pool.submit(durably, *args, cwd=project, **env, **extra) for args, extra in commands]
        listed, state, shown = (future.result().stdout for future in asked)
    assert re.search(rf"{run_id}\s+job\s+running \(owner unresponsive since \d\d:\d\d:\d\d\)", listed), listed
    owner = json.loads(state)["owner"]
    assert owner["alive"] is False and owner["expires"] > time.time() and owner["since"]
    assert re.search(r"owner\s+pid \d+ on \S+  not responding since .*; its lease lapses in \d", shown), shown
    with Terminal("run", "job.py", "--", "0.5", cwd=project, columns=200, **env) as term:
        assert term.wait(60) == 0, term.raw[-2000:]
        text = term.text
    said = re.search(rf"{run_id} is held by pid \d+ on \S+, which is not running; its lease expires in "
                     r"([\d.]+)(ms|s), then this process continues the run", text)
    assert said, text[-2000:]
    assert "0.55" in text and f"✓ {run_id}  completed  2 steps: 1 ran · 1 replayed" in text


def test_a_rerun_waiting_for_a_dead_process_lease_says_so_on_sqlite(project: Path) -> None:
    check_dead_lease(project, DURABLY_STORAGE=f"sqlite:{project / 'runs.db'}")


@pytest.mark.slow  # the SQLite version runs by default
def test_a_rerun_waiting_for_a_dead_process_lease_says_so_on_postgres(project: Path, postgres_dsn: str) -> None:
    parts = dict(item.split("=", 1) for item in postgres_dsn.split())
    schema = f"test_{uuid.uuid4().hex[:12]}"
    url = f"postgresql://{parts['user']}@/{parts['dbname']}?host={quote(parts['host'])}&schema={schema}"
    check_dead_lease(project, DURABLY_STORAGE=url)


def test_a_second_process_says_whose_run_it_joined_and_shows_its_progress(project: Path) -> None:
    env = {"DURABLY_DIR": str(project / ".durably")}
    first = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "run", "job.py", "--", "2"], cwd=project,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "LINGER": "2", **env},
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        wait_until(lambda: bool(first_run(project)) and any(
            s["label"] == "warm-up" for s in status_of(project, first_run(project))["steps"]), 30)
        run_id = first_run(project)
        with Terminal("run", "job.py", "--", "2", cwd=project, columns=200, **env) as term:
            assert term.wait_for(f"joined {run_id} (running in pid {first.pid} on ", 20), term.text
            assert term.wait_for(f"{run_id}  joined (running in pid {first.pid} on ", 20), term.text
            assert term.wait_for(" · 1 done · 1 running  crunch ", 20), term.text  # its log tells the progress
            assert term.wait(60) == 0
            text = term.text
        assert "2.05" in text and f"{run_id}  completed" in text
    finally:
        first.kill()
        first.wait()
    piped = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "run", "job.py", "--", "1"], cwd=project,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "LINGER": "3", **env},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(durably("list", "-q", cwd=project).stdout.split()) == 2 and any(
            s["label"] == "warm-up" for s in status_of(project, first_run(project))["steps"]), 30)
        second = durably("run", "job.py", "--", "1", cwd=project, **env)  # no terminal: the same line, once
        assert second.returncode == 0, second.stderr
        assert second.stderr.count(f"joined {first_run(project)} (running in pid {piped.pid} on ") == 1
    finally:
        piped.kill()
        piped.wait()


def test_a_running_step_shows_its_time_and_a_slow_one_its_advisory_while_it_runs(project: Path) -> None:
    env = {"DURABLY_DIR": str(project / ".durably"), "SLOW_AFTER": "1"}  # 4 s to look while the step runs
    with Terminal("run", "job.py", "--", "5", cwd=project, columns=120, **env) as term:
        assert term.wait_for("crunch 1.", 20), term.text  # the step in flight, with how long it has run
        run_id = first_run(project)
        wait_until(lambda: any(a["code"] == "SLOW_STEP_NO_TIMEOUT" for a in status_of(project, run_id)["advisories"]),
                   20)
        state = status_of(project, run_id)
        running = next(s for s in state["steps"] if s["label"] == "crunch")
        assert running["status"] == "running" and running["started_at"]  # advised while it still runs
        shown = durably("inspect", run_id, cwd=project, COLUMNS="250").stdout
        assert re.search(r"\(1,\) crunch  running  running for \d", shown), shown
        assert re.search(r"SLOW_STEP_NO_TIMEOUT: step 'crunch' has run \ds with no timeout= and still runs", shown)
        assert term.wait_for("durably advisory [INFO] SLOW_STEP_NO_TIMEOUT: step 'crunch' has run", 20)
        assert term.wait(60) == 0
        text = term.text
    assert text.count("SLOW_STEP_NO_TIMEOUT") == 1  # said once, not again when the step ended


def test_a_pending_run_says_when_it_is_due_and_that_a_worker_runs_it(project: Path) -> None:
    with Terminal("enqueue", "job.py", "-w", "job", "-i", "0.1", "--priority", "5", "--delay", "1h",
                  cwd=project, columns=200) as term:
        assert term.wait(30) == 0
        text = term.text
    run_id = text.split()[0]
    assert text.count("nothing runs it until a worker does") == 1
    assert f"{run_id} is pending (due in 1h00m, priority 5): nothing runs it until a worker does: " \
           "`durably worker --import job.py`" in text
    piped = durably("enqueue", "job.py", "-w", "job", "-i", "0.2", cwd=project)
    assert piped.returncode == 0 and re.fullmatch(r"job-\w+\n", piped.stdout) and piped.stderr == ""
    state = status_of(project, run_id)
    assert state["status"] == "pending" and state["queued"]["priority"] == 5
    assert state["queued"]["due"] == pytest.approx(time.time() + 3600, abs=120)
    shown = durably("inspect", run_id, cwd=project, COLUMNS="250").stdout
    assert re.search(r"queued\s+due \d{4}-\d\d-\d\d \d\d:\d\d:\d\d · priority 5", shown), shown
    assert f"next      a worker: nothing runs it until `durably worker --import {project / 'job.py'}`" in shown


def test_a_parked_run_that_got_its_signal_says_it_is_ready(project: Path) -> None:
    parked = durably("run", "job.py", "-w", "gate", "-i", "1", "--no-wait", cwd=project)
    assert parked.returncode == 3
    run_id = first_run(project)
    assert f"durably signal {run_id} approval PAYLOAD" in parked.stderr
    with Terminal("signal", run_id, "approval", '"yes"', cwd=project, columns=200) as term:
        assert term.wait(30) == 0
        assert (f"signal received; due for the next worker or re-run (`durably retry {run_id}` continues it "
                "now)") in term.text
    shown = durably("inspect", run_id, cwd=project, COLUMNS="250").stdout
    assert f"parked    ready: signal 'approval' received; a worker or `durably retry {run_id}` continues it" in shown
    assert f"next      durably retry {run_id} continues it now, or the next worker does" in shown
    assert "durably signal" not in shown and "unread since" in shown  # not read yet: the run has not run since
    again = durably("run", "job.py", "-w", "gate", "-i", "1", "--no-wait", cwd=project)
    assert again.returncode == 0 and json.loads(again.stdout) == [1, "yes"]


def test_logs_follow_keeps_following_while_a_process_waits_in_a_park(project: Path) -> None:
    waiter = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "run", "job.py", "-w", "gate", "-i", "2"],
                              cwd=project, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        wait_until(lambda: bool(first_run(project)) and status_of(project, first_run(project))["status"] == "waiting")
        run_id = first_run(project)
        follow = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "logs", run_id, "--follow"], cwd=project,
                                  env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "COLUMNS": "200"},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1)
        assert follow.poll() is None  # the run waits, held by a process: the tail goes on
        assert durably("signal", run_id, "approval", "7", cwd=project).returncode == 0
        out, err = follow.communicate(timeout=30)
        assert follow.returncode == 0, err
        assert "waiting for signal 'approval'" in out and "run completed  → [2, 7]" in out
        assert waiter.wait(30) == 0
    finally:
        for proc in (waiter,):
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
