"""Fleets of real `durably worker` processes on one store (files, SQLite, PostgreSQL), with short leases,
SIGKILLed every 1.5-3.5 s and replaced, while operators retry and prune and the file catalog is damaged.

Every step writes `start KEY PID TIME` and `end KEY PID TIME` to a ledger. From it and the logs the tests
count what must never happen and print it: a run that did not complete exactly once, a step started by a
second owner while the first was alive (not yet killed, not yet ended), a completed step started again,
a claim record after an end record. Takeover after a SIGKILL is measured on purpose (a run held in a long
step, its worker killed, the time until another worker starts the step), against the lease plus one poll.
The soaks are in the slow suite; a short drain that counts claims after ends runs by default."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import pytest
from helpers import storage_url, wait_until

from durably_py import create_engine
from durably_py._authoring.workflow import REGISTRY, load_script

JOBS = '''
import os, time
from durably_py import Retry, attempt, workflow

LEDGER = os.environ["SOAK_LEDGER"]
LENGTHS = (0.05, 0.4, 1.2, 3.6)  # the last runs past a 3 s lease: only renewals keep it


def mark(kind, key):
    fd = os.open(LEDGER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{kind} {key} {os.getpid()} {time.time():.4f}\\n".encode())
    finally:
        os.close(fd)


def work(key, seconds):
    mark("start", key)
    time.sleep(seconds)
    mark("end", key)
    return key


def flaky(key):
    work(key, 0.05)
    if attempt().number == 1:
        raise ConnectionError("the first attempt fails")
    return key


def until_flag(key):
    mark("start", key)
    while not os.path.exists(os.environ["SOAK_LEDGER"] + "." + key):
        time.sleep(0.02)
    mark("end", key)
    return key


@workflow
async def fleet_chain(ctx, n):
    return [await ctx.step(work, f"chain{n}.{i}", LENGTHS[(n + i) % 4]) for i in range(3)]


@workflow
async def fleet_napper(ctx, n):
    first = await ctx.step(work, f"napper{n}.0", 0.2)
    await ctx.sleep(0.5)
    return [first, await ctx.step(work, f"napper{n}.1", LENGTHS[n % 4])]


@workflow
async def fleet_kid(ctx, key):
    return await ctx.step(work, key, 0.3)


@workflow
async def fleet_parent(ctx, n):
    kids = await ctx.join_all(await ctx.spawn_all([(fleet_kid, f"parent{n}.kid{i}") for i in range(2)]))
    return [await ctx.step(work, f"parent{n}.0", 0.1)] + [k.value for k in kids]


@workflow
async def fleet_flaky(ctx, n):
    return [await ctx.step(flaky, f"flaky{n}.0", retry=Retry(2, backoff="linear", base=0.5))]


@workflow
async def fleet_asker(ctx, n):
    first = await ctx.step(work, f"asker{n}.0", 0.1)
    answer = await ctx.wait_for("go", timeout=600)
    return [first, await ctx.step(work, f"asker{n}.1", 0.1), answer]


@workflow
async def fleet_failing(ctx, n):
    value = await ctx.step(work, f"failing{n}.0", 0.2)
    if not os.path.exists(os.environ["SOAK_LEDGER"] + ".heal"):
        raise RuntimeError("fails until healed")
    return [value]


@workflow
async def fleet_junk(ctx, n):
    return [await ctx.step(work, f"junk{n}.0", 0.05)]


@workflow
async def fleet_probe(ctx, key):
    return [await ctx.step(until_flag, key)]
'''

KINDS = ("chain", "napper", "parent", "flaky", "asker")


class Soak:
    """One store, the jobs script, the ledger, and a fleet of worker processes on them."""

    def __init__(self, tmp_path: Path, kind: str, storage: str, lease: float, poll: float = 0.1) -> None:
        self.tmp, self.kind, self.storage, self.lease, self.poll = tmp_path, kind, storage, lease, poll
        self.jobs = tmp_path / "fleet_jobs.py"
        self.jobs.write_text(JOBS)
        self.ledger = tmp_path / "ledger.txt"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}
        self.env["SOAK_LEDGER"] = str(self.ledger)
        os.environ["SOAK_LEDGER"] = str(self.ledger)
        for name in [n for n in REGISTRY if n.startswith("fleet_")]:
            REGISTRY.pop(name)
        load_script(self.jobs)
        self.engine = create_engine(storage)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.killed: dict[int, float] = {}  # pid -> when it was SIGKILLed
        self.ids: dict[str, tuple[str, int]] = {}  # run id -> (kind, n)

    # ---- the fleet ----------------------------------------------------------------------------------
    def start(self, count: int = 1) -> None:
        for _ in range(count):
            with open(self.tmp / f"worker-{len(self.procs)}.log", "wb") as log:  # the child keeps its own copy
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "durably_py.cli", "worker", "--storage", self.storage, "--import",
                     str(self.jobs), "-c", "4", "--poll", str(self.poll), "--lease", str(self.lease), "-q"],
                    env=self.env, stdout=subprocess.DEVNULL, stderr=log))

    def logs(self) -> str:
        """The last lines each worker wrote to stderr, for a failure's message."""
        return "\n".join(f"worker {i} (pid {p.pid}, exit {p.poll()}): "
                         + " | ".join((self.tmp / f"worker-{i}.log").read_text(errors="replace").splitlines()[-3:])
                         for i, p in enumerate(self.procs))

    def live(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.procs if p.poll() is None]

    def kill(self, proc: subprocess.Popen[bytes] | None = None) -> int:
        victim = proc or random.choice(self.live())
        # the time just before the signal: the victim may be dead (its locks free) as soon as the signal is sent,
        # and this process may be scheduled out before it reads the clock again
        self.killed[victim.pid] = time.time()
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        return victim.pid

    def stop(self) -> None:
        for proc in self.live():
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # ---- runs ---------------------------------------------------------------------------------------
    def enqueue(self, kind: str, n: int) -> str:
        run_id = asyncio.run(self.engine.enqueue(REGISTRY[f"fleet_{kind}"], n, priority=n % 2)).run_id
        self.ids[run_id] = (kind, n)
        return run_id

    def statuses(self) -> dict[str, str]:
        return {s.run_id: s.status for s in asyncio.run(self.engine.list())}

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "durably_py.cli", *args, "--storage", self.storage],
                              env=self.env, capture_output=True, text=True, timeout=120)

    def marks(self) -> list[tuple[str, str, int, float]]:
        if not self.ledger.exists():
            return []
        out = []
        for row in self.ledger.read_text().splitlines():
            kind, key, pid, at = row.split()
            out.append((kind, key, int(pid), float(at)))
        return out

    # ---- what must never happen ---------------------------------------------------------------------
    def double_owners(self) -> list[str]:
        """Steps started by a second process while the first that started it was alive and had not ended it."""
        found = []
        by_key: defaultdict[str, list[tuple[str, int, float]]] = defaultdict(list)
        for kind, key, pid, at in self.marks():
            by_key[key].append((kind, pid, at))
        for key, events in by_key.items():
            events.sort(key=lambda e: e[2])
            running: dict[int, float] = {}
            for kind, pid, at in events:
                if kind == "end":
                    running.pop(pid, None)
                    continue
                for other, since in running.items():
                    if other != pid and self.killed.get(other, float("inf")) > at:
                        found.append(f"{key}: started by {pid} at {at:.3f} while {other} (since {since:.3f}) "
                                     "was alive")
                running[pid] = at
        return found

    def records(self, run_id: str) -> list[dict[str, Any]]:
        log = self.engine.storage.read(run_id)
        assert log is not None, run_id
        return [r if isinstance(r, dict) else msgspec.to_builtins(r) for r in log.records]

    def reran_completed(self) -> list[str]:
        """Steps started again after their completion was recorded."""
        starts: defaultdict[str, list[float]] = defaultdict(list)
        for kind, key, _, at in self.marks():
            if kind == "start":
                starts[key].append(at)
        found = []
        for run_id in self.ids:
            for record in self.records(run_id):
                if record.get("t") == "ok" and isinstance(record.get("ts"), float) and isinstance(record.get("v"), str) \
                        and record["v"] in starts:
                    later = [at for at in starts[record["v"]] if at > record["ts"]]
                    if later:
                        found.append(f"{record['v']} started {len(later)} time(s) after it was recorded")
        return found

    def claims_after_end(self, run_ids: Any) -> int:
        """Runs with a claim record after their last end record (a retry's claim after a failed end is followed
        by the end of the run it reopened)."""
        count = 0
        for run_id in run_ids:
            kinds = [r.get("t") for r in self.records(run_id)]
            if "end" in kinds and "claim" in kinds[len(kinds) - kinds[::-1].index("end"):]:
                count += 1
        return count

    def takeovers(self, probes: int) -> list[float]:
        """Seconds from the SIGKILL of a worker inside a long step to another worker starting that step."""
        times = []
        for i in range(probes):
            key = f"probe{self.lease:g}-{i}"
            run_id = asyncio.run(self.engine.enqueue(REGISTRY["fleet_probe"], key)).run_id
            wait_until(lambda key=key: any(m[0] == "start" and m[1] == key for m in self.marks()), 60)
            holder = next(m[2] for m in self.marks() if m[0] == "start" and m[1] == key)
            time.sleep(random.uniform(0, self.lease / 3))  # anywhere between two renewals
            self.kill(next(p for p in self.procs if p.pid == holder))
            killed = self.killed[holder]
            self.start()
            deadline = time.monotonic() + self.lease + 60
            while not any(m[0] == "start" and m[1] == key and m[2] != holder for m in self.marks()):
                assert time.monotonic() < deadline, f"no worker took {key} over:\n{self.logs()}"
                time.sleep(0.01)
            taken = next(m[3] for m in self.marks() if m[0] == "start" and m[1] == key and m[2] != holder)
            times.append(taken - killed)
            Path(f"{self.ledger}.{key}").touch()
            wait_until(lambda run_id=run_id: self.statuses().get(run_id) == "completed", 60)
        return times


def _drive(soak: Soak, deadline: float, *, kill: bool = True, chores: Any = None) -> None:
    """Keep three workers up, SIGKILL one every 1.5-3.5 s, answer waiting askers, until every run ended."""
    soak.start(3)
    next_kill = time.monotonic() + random.uniform(1.5, 3.5)
    answered: set[str] = set()
    while time.monotonic() < deadline:
        states = soak.statuses()
        for run_id, (kind, n) in soak.ids.items():
            if kind == "asker" and run_id not in answered and states.get(run_id) == "waiting":
                asyncio.run(soak.engine.signal(run_id, "go", f"yes-{n}"))
                answered.add(run_id)
        if chores is not None:
            chores(states)
        if all(states.get(r) in ("completed", "failed") for r in soak.ids):
            return
        if kill and time.monotonic() >= next_kill:
            soak.kill()
            soak.start()
            next_kill = time.monotonic() + random.uniform(1.5, 3.5)
        time.sleep(0.1)
    left = {r: s for r, s in soak.statuses().items() if r in soak.ids and s not in ("completed", "failed")}
    raise AssertionError(f"{len(left)} runs did not end in time: {list(left.items())[:8]}")


def _check_exactly_once(soak: Soak) -> None:
    for run_id, (kind, n) in soak.ids.items():
        state = asyncio.run(soak.engine.inspect(run_id))
        assert state.status == "completed", (run_id, state.status)
        if kind == "asker":
            assert state.result[-1] == f"yes-{n}"


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_two_workers_draining_runs_claim_no_run_after_its_end(kind: str, tmp_path: Path,
                                                              request: pytest.FixtureRequest, capsys: Any) -> None:
    soak = Soak(tmp_path, kind, storage_url(kind, tmp_path, request), lease=3, poll=0.02)
    for n in range(200):
        soak.enqueue("junk", n)
    soak.start(2)
    try:
        wait_until(lambda: all(s == "completed" for s in soak.statuses().values()), 120, every=0.2)
    finally:
        soak.stop()
    after = soak.claims_after_end(soak.ids)
    with capsys.disabled():
        print(f"\n  {kind}: 200 runs drained by 2 workers, {after} with a claim after their end")
    assert after == 0
    assert all(len(soak.records(r)) and [t.get("t") for t in soak.records(r)].count("claim") == 1 for r in soak.ids)


@pytest.mark.slow
@pytest.mark.parametrize("lease", [3.0, 12.0])
@pytest.mark.parametrize("kind", ["file", "sqlite", "postgres"])
def test_a_killed_fleet_runs_every_run_once_with_no_step_on_two_live_workers(
        kind: str, lease: float, tmp_path: Path, request: pytest.FixtureRequest, capsys: Any) -> None:
    soak = Soak(tmp_path, kind, storage_url(kind, tmp_path, request), lease=lease)
    for n in range(150):
        soak.enqueue(KINDS[n % len(KINDS)], n)
    began = time.monotonic()
    try:
        _drive(soak, time.monotonic() + 400)
        took = time.monotonic() - began
        takeovers = soak.takeovers(3)
    finally:
        soak.stop()
    _check_exactly_once(soak)
    doubles, reran = soak.double_owners(), soak.reran_completed()
    after = soak.claims_after_end(soak.ids)
    steps = sum(1 for m in soak.marks() if m[0] == "start")
    with capsys.disabled():
        print(f"\n  {kind}, lease {lease:g}s, poll {soak.poll:g}s: {len(soak.ids)} runs completed exactly once in "
              f"{took:.0f}s through {len(soak.killed) - 3} random SIGKILLs; {steps} step starts, "
              f"{len(doubles)} double owners, {len(reran)} completed steps re-run, {after} claims after an end; "
              f"takeover after SIGKILL min/median/max {min(takeovers):.2f}/{statistics.median(takeovers):.2f}/"
              f"{max(takeovers):.2f}s (lease + poll {lease + soak.poll:.2f}s)")
    assert doubles == [], doubles[:5]
    assert reran == [], reran[:5]
    assert after == 0
    # the lease plus one poll (a file lease dies with its process: there it is one poll, as the figures show),
    # and a busy machine's scheduling slack
    assert max(takeovers) <= lease + soak.poll + 1.5


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "sqlite", "postgres"])
def test_retry_and_prune_race_a_live_fleet_without_losing_or_doubling_a_run(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest, capsys: Any) -> None:
    soak = Soak(tmp_path, kind, storage_url(kind, tmp_path, request), lease=3)
    for n in range(30):
        soak.enqueue(KINDS[n % len(KINDS)], n)
    failing = [soak.enqueue("failing", n) for n in range(6)]
    junk = [soak.enqueue("junk", n) for n in range(30)]
    pruned: set[str] = set()
    retries = {"ok": 0, "refused": 0}

    def chores(states: dict[str, str]) -> None:
        done = soak.cli("prune", "--older-than", "0s", "--workflow", "fleet_junk", "--json")
        assert done.returncode == 0, done.stderr
        pruned.update(json.loads(done.stdout)["runs"])
        failed = [r for r in failing if states.get(r) == "failed"]
        if failed and len(failed) + sum(retries.values()) >= 6:
            Path(f"{soak.ledger}.heal").touch()
        for run_id in failed[:2]:
            done = soak.cli("retry", run_id, "--json")  # races the fleet and the other retries for the run
            retries["ok" if done.returncode == 0 else "refused"] += 1
        for run_id in list(soak.ids):
            if run_id in pruned:
                del soak.ids[run_id]

    try:
        _drive(soak, time.monotonic() + 400, chores=chores)
        while any(soak.statuses().get(r) == "failed" for r in failing):
            chores(soak.statuses())
    finally:
        soak.stop()
    for run_id in junk:
        assert run_id in pruned or soak.statuses().get(run_id) == "completed"
    ends = {m[1] for m in soak.marks() if m[0] == "end"}
    assert all(f"junk{soak_n}.0" in ends for soak_n in range(30))  # every pruned run had run to its end first
    _check_exactly_once(soak)
    doubles, after = soak.double_owners(), soak.claims_after_end(soak.ids)
    with capsys.disabled():
        print(f"\n  {kind}: prune deleted {len(pruned)} ended runs under a live fleet, {retries['ok']} retries ran "
              f"and {retries['refused']} were refused (held elsewhere); {len(doubles)} double owners, "
              f"{after} claims after a run's end, every other run completed exactly once")
    assert doubles == [] and after == 0


@pytest.mark.slow
def test_a_fleet_on_files_finishes_while_its_catalog_is_damaged_and_deleted(tmp_path: Path, capsys: Any) -> None:
    soak = Soak(tmp_path, "file", str(tmp_path / "state"), lease=3)
    for n in range(40):
        soak.enqueue(KINDS[n % len(KINDS)], n)
    catalog = tmp_path / "state" / "catalog.db"
    damage = {"n": 0, "at": 0.0}

    def chores(states: dict[str, str]) -> None:
        if time.monotonic() - damage["at"] < 1.5:
            return
        damage["at"] = time.monotonic()
        damage["n"] += 1
        if damage["n"] % 2:
            catalog.unlink(missing_ok=True)
        elif catalog.exists():
            with open(catalog, "r+b") as f:
                f.seek(100)
                f.write(os.urandom(4096))

    try:
        _drive(soak, time.monotonic() + 400, chores=chores)
    finally:
        soak.stop()
    _check_exactly_once(soak)
    listed = soak.cli("list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert len(json.loads(listed.stdout)) == len(soak.ids) + sum(1 for s in soak.statuses() if s not in soak.ids)
    doubles = soak.double_owners()
    with capsys.disabled():
        print(f"\n  file catalog damaged or deleted {damage['n']} times under a killed fleet: {len(soak.ids)} runs "
              f"completed exactly once, {len(doubles)} double owners, `durably list` lists every run")
    assert doubles == []
