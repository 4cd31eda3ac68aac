"""Limits that hold across a fleet: a rate limit and a per-tenant concurrency key enforced by the store that
real `durably worker` processes share (files, SQLite, PostgreSQL), with workers SIGKILLed while they hold a
permit; a run waiting for a permit is parked with its reason and holds no worker slot.

Starts are counted from a ledger each execution writes the moment its step begins (every execution, killed
ones included) and checked against the run logs' step records."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import storage_url, wait_until

from durably_py import create_engine
from durably_py._authoring.workflow import load_script
from durably_py.storage.url import open_storage

JOBS = '''
import os, time
from durably_py import RateLimit, resource, workflow

# declared once, where the workflows are: every worker that imports this module enforces it
rated_api = resource("fleet-api", rate_limit=RateLimit(2, per=float(os.environ.get("FLEET_PER", "2"))))


def mark(what):
    with open(os.environ["FLEET_LEDGER"], "a") as f:
        f.write(f"{what} {os.getpid()} {time.time():.4f}\\n")


def call(i, seconds):
    mark(f"start rated-{i}")
    time.sleep(seconds)
    mark(f"end rated-{i}")
    return i


def hold(tenant, i, seconds):
    mark(f"start {tenant}-{i}")
    time.sleep(seconds)
    mark(f"end {tenant}-{i}")
    return i


@workflow
async def fleet_rated(ctx, job):
    return await ctx.step(call, job["i"], job["seconds"], uses="fleet-api")


@workflow
async def fleet_tenant(ctx, job):
    return await ctx.step(hold, job["tenant"], job["i"], job["seconds"],
                          concurrency_key=f"tenant:{job['tenant']}", concurrency_limit=job.get("limit", 2))
'''


class Fleet:
    """A project with the jobs module, a store of one kind, and the `durably worker` processes serving it."""

    def __init__(self, tmp_path: Path, url: str, per: float = 2.0, jobs: str = JOBS) -> None:
        self.root = tmp_path / "project"
        self.root.mkdir()
        self.jobs = self.root / "fleet_jobs.py"
        self.jobs.write_text(jobs)
        self.ledger = tmp_path / "ledger.txt"
        self.url = url
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}
        self.env.update(FLEET_LEDGER=str(self.ledger), FLEET_PER=str(per),
                        XDG_CONFIG_HOME=str(tmp_path / "user-config"))
        os.environ.update(FLEET_LEDGER=str(self.ledger), FLEET_PER=str(per))
        module = load_script(self.jobs)
        self.workflows = {name: wf for name, wf in vars(module).items() if hasattr(wf, "fingerprint")}
        self.storage = open_storage(url)
        self.engine = create_engine(self.storage)
        self.procs: list[subprocess.Popen[str]] = []
        self.logs: list[list[str]] = []

    def worker(self, *args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "durably_py.cli", "worker", "--storage", self.url, "--import", str(self.jobs),
             "--lease", "3", "--poll", "0.1", *args],
            cwd=self.root, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        lines: list[str] = []

        def read() -> None:
            assert proc.stderr is not None
            lines.extend(line.rstrip("\n") for line in proc.stderr)

        threading.Thread(target=read, daemon=True).start()
        self.procs.append(proc)
        self.logs.append(lines)
        wait_until(lambda: any("serving" in line for line in lines) or proc.poll() is not None, 30)
        assert proc.poll() is None, "\n".join(lines)
        return proc

    def enqueue(self, workflow: str, job: dict[str, Any]) -> str:
        import asyncio

        return asyncio.run(self.engine.enqueue(self.workflows[workflow], job)).run_id

    def inspect(self, run_id: str) -> Any:
        import asyncio

        return asyncio.run(self.engine.inspect(run_id))

    def marks(self) -> list[tuple[str, str, int, float]]:
        if not self.ledger.exists():
            return []
        out = []
        for line in self.ledger.read_text().splitlines():
            what, key, pid, at = line.split()
            out.append((what, key, int(pid), float(at)))
        return out

    def status(self, run_id: str) -> str:
        info = self.storage.info(run_id)
        return info.end_status or "open" if info is not None else "unknown"

    def wait_done(self, runs: list[str], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not all(self.status(r) == "completed" for r in runs):
            assert time.monotonic() < deadline, (
                f"not every run completed: {[self.status(r) for r in runs]}\n" + "\n".join(
                    "\n".join(lines[-15:]) for lines in self.logs))
            time.sleep(0.05)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.storage.close()


def _in_flight(marks: list[tuple[str, str, int, float]]) -> int | None:
    """The pid of a worker in the middle of a call (started, not ended), if any."""
    ended = {(key, pid) for what, key, pid, _ in marks if what == "end"}
    return next((pid for what, key, pid, _ in marks if what == "start" and (key, pid) not in ended), None)


def _kill_one_in_flight(fleet: Fleet, workers: list[subprocess.Popen[str]]) -> float:
    """SIGKILL the worker that is in the middle of a call (it holds that call's permit); when it was killed."""
    found: list[int] = []
    wait_until(lambda: found.append(_in_flight(fleet.marks()) or 0) or found[-1] != 0, 60)
    victim = next(w for w in workers if w.pid == found[-1])
    killed = time.time()
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    return killed


def _most_in_any_window(times: list[float], per: float) -> int:
    """The most of `times` that fall in any half-open window of `per` seconds."""
    times = sorted(times)
    return max((sum(1 for t in times[i:] if t < start + per) for i, start in enumerate(times)), default=0)


def _rate_limit_holds(kind: str, tmp_path: Path, request: pytest.FixtureRequest, runs: int, per: float) -> None:
    fleet = Fleet(tmp_path, storage_url(kind, tmp_path, request), per=per)
    try:
        workers = [fleet.worker("-c", "4") for _ in range(3)]
        ids = [fleet.enqueue("fleet_rated", {"i": i, "seconds": 0.4}) for i in range(runs)]
        # SIGKILL a worker in the middle of a rated call: its start stays in the window, its run runs again
        _kill_one_in_flight(fleet, workers)
        fleet.worker("-c", "4")  # its replacement
        fleet.wait_done(ids, runs * per / 2 + 30)
        starts = [m[3] for m in fleet.marks() if m[0] == "start"]
        most = _most_in_any_window(starts, per - 0.2)  # a mark trails its grant, by up to 0.2 s on a loaded machine
        ends = [m for m in fleet.marks() if m[0] == "end"]
        recorded = [fleet.inspect(r).steps[0] for r in ids]
        print(f"\n{kind}: {len(ids)} runs, {len(starts)} starts ({len(starts) - len(ends)} cut by the SIGKILL), "
              f"most starts in any {per - 0.2:g}s window of the ledger: {most} (limit 2 per {per:g}s), span "
              f"{max(starts) - min(starts):.1f}s")
        assert most <= 2, sorted(starts)
        assert all(s.status == "ok" for s in recorded)
        assert len(ends) == runs and len(starts) > runs  # each call completed once; the SIGKILL cut one
        assert max(starts) - min(starts) >= (runs / 2 - 1) * per - 0.5  # the fleet was held to the limit
    finally:
        fleet.stop()


@pytest.mark.parametrize("kind", ["file", "sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def test_three_workers_never_start_more_than_the_rate_limit_allows_even_across_a_sigkill(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    _rate_limit_holds(kind, tmp_path, request, runs=6, per=1.2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "sqlite", "postgres"])
def test_a_sixty_second_rate_limited_fleet_never_exceeds_two_starts_in_four_seconds(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    _rate_limit_holds(kind, tmp_path, request, runs=30, per=4.0)


@pytest.mark.parametrize("kind", ["file", "sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def test_a_tenants_concurrency_holds_across_workers_and_a_killed_holders_permit_comes_back(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    fleet = Fleet(tmp_path, storage_url(kind, tmp_path, request))
    try:
        # each call takes long enough (1.2 s) for a parked run to stay parked while a `durably inspect` starts
        ids = [fleet.enqueue("fleet_tenant", {"tenant": "alice", "i": i, "seconds": 1.2}) for i in range(6)]
        workers = [fleet.worker("-c", "4"), fleet.worker("-c", "4")]
        # the runs beyond the limit park, holding no slot, and say what they wait for
        wait_until(lambda: any(fleet.inspect(r).status == "waiting" for r in ids), 30)
        waiting = next(fleet.inspect(r) for r in ids if fleet.inspect(r).status == "waiting")
        assert waiting.steps[-1].output["limit"] == "tenant:alice concurrency 2/2"
        shown: list[str] = []

        def cli_says_so() -> bool:  # a parked run is woken as permits come back: look until one is seen parked
            parked = [r for r in ids if fleet.inspect(r).status == "waiting"]
            if not parked:
                assert not all(fleet.status(r) != "open" for r in ids), "every run ended before one was seen parked"
                return False
            listed = subprocess.run([sys.executable, "-m", "durably_py.cli", "inspect", parked[0], "--storage",
                                     fleet.url], cwd=fleet.root, env=fleet.env, capture_output=True, text=True)
            shown.append(listed.stdout + listed.stderr)
            return "waiting for tenant:alice concurrency 2/2" in listed.stdout

        wait_until(cli_says_so, 30, every=0.05)
        assert "waiting for tenant:alice concurrency 2/2" in shown[-1], shown[-1]
        # SIGKILL a worker in the middle of a call: it holds a permit
        killed = _kill_one_in_flight(fleet, workers)
        fleet.wait_done(ids, 60)
        marks = fleet.marks()
        intervals: dict[str, list[float]] = {}
        for _what, key, pid, at in marks:
            intervals.setdefault(f"{key}:{pid}", []).append(at)
        spans = [(v[0], v[1] if len(v) > 1 else killed) for v in intervals.values()]
        peak = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
        cut = [k.split(":")[0] for k, v in intervals.items() if len(v) == 1]
        assert 1 <= len(cut) <= 2  # the victim held one permit or both
        again = max(min(v[0] for k, v in intervals.items() if k.split(":")[0] == job and len(v) == 2)
                    for job in cut)
        print(f"\n{kind}: 6 runs, {len(spans)} executions ({len(cut)} cut by the SIGKILL), most at once {peak} "
              f"(limit 2); the killed runs ran again by {again - killed:.2f}s after the kill (lease 3s)")
        assert peak <= 2
        assert sum(1 for m in marks if m[0] == "end") == 6
        assert again - killed < 3 + 5.0 + 3.0  # the lease, one recheck, and a loaded machine at the most
    finally:
        fleet.stop()


def test_a_run_waiting_for_a_permit_holds_no_worker_slot(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    fleet = Fleet(tmp_path, storage_url("sqlite", tmp_path, request))
    try:
        first = fleet.enqueue("fleet_tenant", {"tenant": "solo", "i": 0, "seconds": 2.0, "limit": 1})
        fleet.worker("-c", "2")
        wait_until(lambda: any(m[1] == "solo-0" for m in fleet.marks()), 30)
        ids = [first] + [fleet.enqueue("fleet_tenant", {"tenant": t, "i": i, "seconds": 0.1, "limit": 1})
                         for t, i in (("solo", 1), ("solo", 2), ("other", 0))]
        # the two solo runs take the second slot in turn and park, so the other tenant's run gets it
        fleet.wait_done(ids, 30)
        at = {m[1]: m[3] for m in fleet.marks() if m[0] == "start"}
        end = {m[1]: m[3] for m in fleet.marks() if m[0] == "end"}
        print(f"\nthe other tenant started {at['other-0'] - at['solo-0']:.2f}s after solo-0, which ran 2.0s")
        assert at["other-0"] < end["solo-0"]
        assert at["solo-1"] >= end["solo-0"] - 0.05 and at["solo-2"] >= end["solo-0"] - 0.05
    finally:
        fleet.stop()
