"""Named queues served by real `durably worker` processes sharing one store (files, SQLite, PostgreSQL): a
queue's concurrency holds across workers and a SIGKILL, a full partition never holds up another tenant's first
run, `per_worker` and `--queue` take effect, and `durably queues` (text and JSON) and the console's queue API
show each queue's runs and limits."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import storage_url, wait_until
from test_flow_fleet import Fleet

QUEUE_JOBS = '''
import os, time
from durably_py import queue, workflow

batch = queue("batch", concurrency=3)
tenants = queue("tenants", partition_concurrency=2)
solo = queue("solo", per_worker=1)


def mark(what):
    with open(os.environ["FLEET_LEDGER"], "a") as f:
        f.write(f"{what} {os.getpid()} {time.time():.4f}\\n")


def work(name, seconds):
    mark(f"start {name}")
    time.sleep(seconds)
    mark(f"end {name}")
    return name


@workflow(queue="batch")
async def batch_job(ctx, job):
    return await ctx.step(work, job["name"], job["seconds"])


@workflow(queue="tenants")
async def tenant_job(ctx, job):
    return await ctx.step(work, job["name"], job["seconds"])


@workflow(queue="solo")
async def solo_job(ctx, job):
    return await ctx.step(work, job["name"], job["seconds"])


@workflow
async def plain_job(ctx, job):
    return await ctx.step(work, job["name"], job["seconds"])
'''


class QueueFleet(Fleet):
    """A fleet whose jobs module declares named queues."""

    def __init__(self, tmp_path: Path, url: str) -> None:
        super().__init__(tmp_path, url, jobs=QUEUE_JOBS)

    def spans(self) -> dict[str, tuple[float, float | None]]:
        """Each execution (name:pid) with its start and end (None: cut off)."""
        out: dict[str, list[float]] = {}
        for _what, name, pid, at in self.marks():
            out.setdefault(f"{name}:{pid}", []).append(at)
        return {k: (v[0], v[1] if len(v) > 1 else None) for k, v in out.items()}


def _peak(spans: list[tuple[float, float]]) -> int:
    return max((sum(1 for a, b in spans if a <= t < b) for t, _ in spans), default=0)


@pytest.mark.parametrize("kind", ["file", "sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def test_a_queues_concurrency_holds_across_workers_and_a_sigkill(kind: str, tmp_path: Path,
                                                                 request: pytest.FixtureRequest) -> None:
    fleet = QueueFleet(tmp_path, storage_url(kind, tmp_path, request))
    try:
        workers = [fleet.worker("-c", "4") for _ in range(3)]
        ids = [fleet.enqueue("batch_job", {"name": f"b{i}", "seconds": 0.6}) for i in range(10)]
        wait_until(lambda: any(end is None for _, end in fleet.spans().values()), 30)
        holder = next(int(k.split(":")[1]) for k, (_, end) in fleet.spans().items() if end is None)
        victim = next(w for w in workers if w.pid == holder)
        killed = time.time()
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        fleet.wait_done(ids, 90)
        spans = [(a, b if b is not None else killed) for a, b in fleet.spans().values()]
        ends = sum(1 for m in fleet.marks() if m[0] == "end")
        print(f"\n{kind}: 10 runs of a queue with concurrency 3 on 3 workers, one SIGKILLed: {len(spans)} "
              f"executions, most at once {_peak(spans)}, {ends} completed")
        assert _peak(spans) <= 3
        assert ends == 10
    finally:
        fleet.stop()


@pytest.mark.parametrize("kind", ["file", "sqlite", "postgres"])
def test_another_tenants_first_run_starts_within_a_poll_behind_a_hundred_of_one_tenant(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    fleet = QueueFleet(tmp_path, storage_url(kind, tmp_path, request))
    try:
        wf = fleet.workflows["tenant_job"]
        asyncio.run(fleet.engine.enqueue_many([(wf, {"name": f"a{i}", "seconds": 0.5}) for i in range(100)],
                                              partition="a"))
        fleet.worker("-c", "4")
        fleet.worker("-c", "4")
        wait_until(lambda: sum(1 for m in fleet.marks() if m[0] == "start") >= 2, 30)
        asked = time.time()
        b = asyncio.run(fleet.engine.enqueue(wf, {"name": "b0", "seconds": 0.1}, partition="b")).run_id
        wait_until(lambda: any(m[1] == "b0" for m in fleet.marks()), 30)
        started = next(m[3] for m in fleet.marks() if m[1] == "b0")
        fleet.wait_done([b], 30)
        a_spans = [(s, e if e is not None else time.time()) for k, (s, e) in fleet.spans().items()
                   if k.startswith("a")]
        print(f"\n{kind}: tenant b's first run started {started - asked:.3f}s after its enqueue, behind "
              f"{100 - sum(1 for s, e in a_spans if e < asked)} runs of tenant a (poll 0.1s); tenant a's most at once "
              f"{_peak(a_spans)} (limit 2)")
        assert started - asked < 1.0
        assert _peak(a_spans) <= 2
    finally:
        fleet.stop()


def test_per_worker_and_queue_flags_take_effect_and_durably_queues_shows_it(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    fleet = QueueFleet(tmp_path, storage_url("sqlite", tmp_path, request))
    try:
        solo = [fleet.enqueue("solo_job", {"name": f"s{i}", "seconds": 0.4}) for i in range(4)]
        plain = fleet.enqueue("plain_job", {"name": "p0", "seconds": 0.1})
        fleet.worker("-c", "4", "--queue", "solo")  # serves the solo queue only
        fleet.wait_done(solo, 30)
        spans = [(a, b) for k, (a, b) in fleet.spans().items() if k.startswith("s")]
        assert _peak(spans) == 1  # per_worker=1 on a worker of concurrency 4
        assert fleet.status(plain) == "open"  # the default queue is not served by that worker
        shown = subprocess.run([sys.executable, "-m", "durably_py.cli", "queues", "--storage", fleet.url,
                                "--import", str(fleet.jobs), "--json"], cwd=fleet.root, env=fleet.env,
                               capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        queues = {q["name"]: q for q in json.loads(shown.stdout)}
        assert queues["default"]["due"] == 1 and queues["solo"]["due"] == 0
        assert queues["solo"]["limits"] == {"per_worker": 1}
        assert queues["batch"]["limits"] == {"concurrency": 3}
        text = subprocess.run([sys.executable, "-m", "durably_py.cli", "queues", "--storage", fleet.url,
                               "--import", str(fleet.jobs)], cwd=fleet.root, env={**fleet.env, "COLUMNS": "200"},
                              capture_output=True, text=True, timeout=60)
        assert "concurrency 0/3" in text.stdout and "1 per worker" in text.stdout, text.stdout
        fleet_view = subprocess.run([sys.executable, "-m", "durably_py.cli", "queues", "--storage", fleet.url,
                                     "--json"], cwd=fleet.root, env=fleet.env, capture_output=True, text=True,
                                    timeout=60)
        seen = {q["name"]: q["limits"] for q in json.loads(fleet_view.stdout)}
        assert seen["solo"] == {"per_worker": 1}  # no --import: the limits the live worker advertises
        assert "batch" not in seen  # that worker does not serve it
        fleet.worker("-c", "2")  # every queue
        fleet.wait_done([plain], 30)
    finally:
        fleet.stop()


@pytest.mark.parametrize("kind", ["file", "sqlite", "postgres"])
def test_a_burst_of_fifty_debounced_enqueues_runs_once_on_a_worker_with_the_last_input(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    fleet = QueueFleet(tmp_path, storage_url(kind, tmp_path, request))
    try:
        fleet.worker("-c", "4")
        wf = fleet.workflows["plain_job"]

        async def burst() -> list[str]:
            return [(await fleet.engine.enqueue(wf, {"name": f"rev{i}", "seconds": 0.0}, key="doc-1",
                                                debounce=0.5)).run_id for i in range(50)]

        ids = asyncio.run(burst())
        fleet.wait_done(ids[-1:], 30)
        time.sleep(0.3)  # a worker that wrongly started a superseded run would have marked it by now
        ran = [m[1] for m in fleet.marks() if m[0] == "start"]
        superseded = [fleet.inspect(r) for r in ids[:-1]]
        print(f"\n{kind}: 50 debounced enqueues of one key -> {len(ran)} execution ({ran}), "
              f"{sum(s.status == 'cancelled' for s in superseded)} superseded")
        assert ran == ["rev49"]
        assert all(s.status == "cancelled" and later in s.error["message"]
                   for s, later in zip(superseded, ids[1:], strict=True))
    finally:
        fleet.stop()


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_a_killed_worker_holding_every_place_of_a_full_queue_is_taken_over(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    fleet = QueueFleet(tmp_path, storage_url(kind, tmp_path, request))
    try:
        ids = [fleet.enqueue("batch_job", {"name": f"b{i}", "seconds": 0.8}) for i in range(5)]
        victim = fleet.worker("-c", "4")
        # the victim holds all three places of the queue (concurrency 3) when it dies
        wait_until(lambda: sum(1 for _, end in fleet.spans().values() if end is None) == 3, 30)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        killed = time.time()
        fleet.worker("-c", "4")
        fleet.wait_done(ids, 60)
        spans = [(a, b if b is not None else killed) for a, b in fleet.spans().values()]
        print(f"\n{kind}: a worker holding the 3 places of a full queue SIGKILLed: all 5 runs completed "
              f"{time.time() - killed:.2f}s later (lease 3s), most at once {_peak(spans)}")
        assert _peak(spans) <= 3
        assert sum(1 for m in fleet.marks() if m[0] == "end") == 5
    finally:
        fleet.stop()
