"""Races and clean-up with real processes: a `durably worker` that parks a race, SIGKILLs while a race is
decided and during clean-up, and the recorded winner on every resume."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import durably

RACE = '''
import asyncio, os, sys
from durably_py import RunCancelledError, workflow

LEDGER = os.environ["LEDGER"]


def note(what):
    with open(LEDGER, "a") as f:
        f.write(what + "\\n")
        f.flush()
        os.fsync(f.fileno())
    return what


async def long_step(seconds):
    note("long-start")
    await asyncio.sleep(seconds)
    return note("long-end")


@workflow
async def race(ctx, timer):
    sleep = asyncio.ensure_future(ctx.sleep(timer))
    sig = asyncio.ensure_future(ctx.wait_for("complete", timeout=7200))
    done, _ = await asyncio.wait([sleep, sig], return_when=asyncio.FIRST_COMPLETED)
    winner = "signal" if sig in done else "slept"
    await ctx.step(note, "winner " + winner)
    return winner


@workflow
async def booking(ctx):
    await ctx.step(note, "book")
    try:
        return await ctx.step(long_step, 3600)
    except RunCancelledError:
        await ctx.step(long_step, float(os.environ.get("CLEANUP", "0")), name="release")
        await ctx.step(note, "released")
        raise


def unbook(_):
    return note("unbook")


@workflow
async def compensated_booking(ctx):
    await ctx.step(note, "book", compensate=unbook)
    return await ctx.step(long_step, 3600)


@workflow
async def hello_cancellation(ctx):
    try:
        return await ctx.step(long_step, 3600)
    finally:
        await ctx.step(note, "cleanup")


if __name__ == "__main__":
    from durably_py import run
    print(run(globals()[sys.argv[1]], *([float(sys.argv[2])] if len(sys.argv) > 2 else [])))
'''


def setup(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The flows script, and the environment its processes get (on top of this one's)."""
    script = tmp_path / "flows.py"
    script.write_text(textwrap.dedent(RACE))
    return script, {"LEDGER": str(tmp_path / "ledger.txt"), "PYTHONUNBUFFERED": "1"}


def spawn(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """`durably ARGS` as a process of its own, importing this checkout."""
    return subprocess.Popen([sys.executable, "-m", "durably_py.cli", *args], cwd=tmp_path, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def ledger(tmp_path: Path) -> list[str]:
    path = tmp_path / "ledger.txt"
    return path.read_text().split("\n")[:-1] if path.exists() else []


def status(tmp_path: Path, run_id: str, env: dict[str, str]) -> dict:
    shown = durably("inspect", run_id, "--json", cwd=tmp_path, **env)
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def wait_for(predicate, seconds: float = 30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out")


def only_run(tmp_path: Path, env: dict[str, str]) -> str:
    listed = json.loads(durably("list", "--json", cwd=tmp_path, **env).stdout)
    assert len(listed) == 1, listed
    return listed[0]["run_id"]


@pytest.mark.parametrize("winner", ["signal", "slept"])
def test_a_worker_parks_a_race_and_the_right_side_wins(tmp_path: Path, winner: str) -> None:
    script, env = setup(tmp_path)
    timer = "3600" if winner == "signal" else "1"
    assert durably("enqueue", str(script), "--workflow", "race", "--input", timer, cwd=tmp_path, **env).returncode == 0
    run_id = only_run(tmp_path, env)
    worker = spawn(tmp_path, env, "worker", "--import", str(script), "--poll", "0.1")
    try:
        if winner == "signal":
            wait_for(lambda: status(tmp_path, run_id, env)["status"] == "waiting")
            time.sleep(0.5)
            assert status(tmp_path, run_id, env)["status"] == "waiting"  # not completed: no signal was sent
            assert durably("signal", run_id, "complete", cwd=tmp_path, **env).returncode == 0
        wait_for(lambda: status(tmp_path, run_id, env)["status"] == "completed")
    finally:
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=30)
    assert status(tmp_path, run_id, env)["result"] == winner
    assert ledger(tmp_path) == [f"winner {winner}"]
    assert "never retrieved" not in err and "Traceback" not in err, err


def test_killed_while_both_sides_become_ready_the_earlier_wins_on_resume(tmp_path: Path) -> None:
    script, env = setup(tmp_path)
    proc = spawn(tmp_path, env, "run", str(script), "--", "race", "3")
    run_id = wait_for(lambda: (durably("list", "-q", cwd=tmp_path, **env).stdout.split() or [None])[0])
    wait_for(lambda: status(tmp_path, run_id, env)["status"] == "waiting")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert durably("signal", run_id, "complete", cwd=tmp_path, **env).returncode == 0  # at ~1 s: before the timer
    time.sleep(3.5)  # the timer is due too by now
    resumed = durably("run", str(script), "--", "race", "3", cwd=tmp_path, **env)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.strip().splitlines()[-1] == "signal"
    assert ledger(tmp_path) == ["winner signal"]


@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_random_kills_around_a_race_never_change_its_winner(tmp_path: Path, seed: int) -> None:
    """The winner recorded first is the winner for good, however often the process dies around it."""
    script, env = setup(tmp_path)
    rng = random.Random(seed)
    signalled = False
    results = []
    for _ in range(6):
        proc = spawn(tmp_path, env, "run", str(script), "--", "race", "2")
        time.sleep(rng.uniform(0.3, 1.5))
        runs = durably("list", "-q", cwd=tmp_path, **env).stdout.split()
        if runs and not signalled and rng.random() < 0.5:
            durably("signal", runs[0], "complete", cwd=tmp_path, **env)
            signalled = True
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        if proc.returncode == 0:
            results.append(out.strip().splitlines()[-1])
            break
    runs = durably("list", "-q", cwd=tmp_path, **env).stdout.split()
    # a run that completed in the loop (its process maybe killed before it exited) is not run again: the same
    # command would start a new run, whose race is another race
    if not results and (not runs or status(tmp_path, runs[0], env)["status"] != "completed"):
        final = durably("run", str(script), "--", "race", "2", cwd=tmp_path, **env)
        assert final.returncode == 0, final.stderr
    winners = [line for line in ledger(tmp_path) if line.startswith("winner")]
    assert len(set(winners)) == 1, winners  # one winner, however many times its step was cut short and rerun
    recorded = winners[0].split()[1]
    run_id = durably("list", "-q", cwd=tmp_path, **env).stdout.split()[0]
    assert status(tmp_path, run_id, env)["result"] == recorded


def test_a_cancelled_run_cleans_up_and_a_kill_during_clean_up_resumes_the_clean_up(tmp_path: Path) -> None:
    script, env = setup(tmp_path)
    env["CLEANUP"] = "2"
    proc = spawn(tmp_path, env, "run", str(script), "--", "booking")
    wait_for(lambda: "long-start" in ledger(tmp_path))
    run_id = durably("list", "-q", cwd=tmp_path, **env).stdout.split()[0]
    asked = durably("cancel", run_id, "--timeout", "0", cwd=tmp_path, **env)  # ask, and do not wait
    assert asked.returncode in (0, 1), asked.stderr
    wait_for(lambda: ledger(tmp_path).count("long-start") == 2)  # the clean-up step started
    proc.send_signal(signal.SIGKILL)  # during the clean-up
    proc.wait()
    resumed = durably("run", str(script), "--", "booking", cwd=tmp_path, **env)
    assert resumed.returncode != 0
    assert "cancelled" in resumed.stderr
    entries = ledger(tmp_path)
    assert entries.count("book") == 1
    assert entries.count("long-start") == 3  # the cancelled step once; the clean-up twice (cut by the kill)
    assert entries[-2:] == ["long-end", "released"]
    assert status(tmp_path, run_id, env)["status"] == "cancelled"


def test_temporal_hello_cancellation_ports_one_to_one(tmp_path: Path) -> None:
    script, env = setup(tmp_path)
    proc = spawn(tmp_path, env, "run", str(script), "--", "hello_cancellation")
    wait_for(lambda: "long-start" in ledger(tmp_path))
    run_id = durably("list", "-q", cwd=tmp_path, **env).stdout.split()[0]
    cancelled = durably("cancel", run_id, cwd=tmp_path, **env)
    assert cancelled.returncode == 0, cancelled.stderr
    proc.communicate(timeout=30)
    assert ledger(tmp_path) == ["long-start", "cleanup"]
    assert status(tmp_path, run_id, env)["status"] == "cancelled"


def test_cancelling_a_parked_run_runs_its_clean_up(tmp_path: Path) -> None:
    script, env = setup(tmp_path)
    env["CLEANUP"] = "0"
    proc = spawn(tmp_path, env, "run", str(script), "--", "booking")
    wait_for(lambda: "long-start" in ledger(tmp_path))
    proc.send_signal(signal.SIGKILL)  # no process holds the run now (it waits for a `retry`)
    proc.wait()
    run_id = durably("list", "-q", cwd=tmp_path, **env).stdout.split()[0]
    wait_for(lambda: status(tmp_path, run_id, env)["status"] != "running", 60)
    cancelled = durably("cancel", run_id, cwd=tmp_path, **env)
    assert cancelled.returncode == 0, cancelled.stderr
    entries = ledger(tmp_path)
    assert entries.count("book") == 1
    assert entries[-1] == "released"
    assert status(tmp_path, run_id, env)["status"] == "cancelled"


def test_cancel_cleanup_window_and_compensate_take_effect_through_the_cli(tmp_path: Path) -> None:
    script, env = setup(tmp_path)
    env["CLEANUP"] = "30"  # the clean-up step would take 30 s; --cleanup 1s stops it after one
    proc = spawn(tmp_path, env, "run", str(script), "--", "booking")
    wait_for(lambda: "long-start" in ledger(tmp_path))
    run_id = durably("list", "-q", cwd=tmp_path, **env).stdout.split()[0]
    began = time.monotonic()
    cancelled = durably("cancel", run_id, "--cleanup", "1s", cwd=tmp_path, **env)
    assert cancelled.returncode == 0, cancelled.stderr
    proc.communicate(timeout=30)
    assert time.monotonic() - began < 15
    assert ledger(tmp_path).count("long-start") == 2 and "released" not in ledger(tmp_path)
    assert status(tmp_path, run_id, env)["status"] == "cancelled"

    (tmp_path / "ledger.txt").unlink()
    proc = spawn(tmp_path, env, "run", str(script), "--", "compensated_booking")
    wait_for(lambda: "long-start" in ledger(tmp_path))
    run_id = next(r["run_id"] for r in json.loads(durably("list", "--json", cwd=tmp_path, **env).stdout)
                  if r["workflow"].endswith("compensated_booking"))
    assert durably("cancel", run_id, "--compensate", cwd=tmp_path, **env).returncode == 0
    proc.communicate(timeout=30)
    assert ledger(tmp_path) == ["book", "long-start", "unbook"]
    bad = durably("cancel", run_id, "--cleanup", "soon", cwd=tmp_path, **env)
    assert bad.returncode == 2
