"""Every engine setting a `durably worker` is given takes effect, whichever source gives it (a flag, the
environment, `.durably/config.toml`): the lease the store holds and how often it is renewed, the runs and
child runs at once, how often an idle worker looks at the queue, and how long ended runs are kept. A
renewal that cannot come in time is reported before the lease lapses; a lease below the minimum is refused.

Each test starts real worker processes on a SQLite store and watches the store from this process."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until

from durably_py import Engine, SqliteStorage, ValidationError, create_engine
from durably_py._authoring.workflow import REGISTRY, load_script

JOBS = '''
import os, re, time
from durably_py import workflow


def mark(what):
    with open(os.environ["JOBS_LEDGER"], "a") as f:
        f.write(f"{what} {os.getpid()} {time.time():.3f}\\n")


def hold(key, seconds):
    mark(f"start {key}")
    time.sleep(seconds)
    mark(f"end {key}")
    return key


def hog(n):
    mark("hog")
    re.match(r"(a+)+$", "a" * n + "b")  # one C call that holds the GIL throughout
    return n


@workflow
async def settings_hold(ctx, job):
    return await ctx.step(hold, job["key"], job["seconds"])


@workflow
async def settings_parent(ctx, n):
    kids = await ctx.join_all(await ctx.spawn_all([(settings_hold, {"key": f"kid{i}", "seconds": 0.6})
                                                   for i in range(n)]))
    return [k.value for k in kids]


@workflow
async def settings_hog(ctx, n):
    return await ctx.step(hog, n)
'''


class Setup:
    """A project folder with the jobs script, a SQLite store, and an environment without durably settings."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "project"
        (self.root / ".durably").mkdir(parents=True)
        self.jobs = self.root / "jobs.py"
        self.jobs.write_text(JOBS)
        self.db = self.root / ".durably" / "runs.db"
        self.ledger = tmp_path / "ledger.txt"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}
        self.env.update(JOBS_LEDGER=str(self.ledger), XDG_CONFIG_HOME=str(tmp_path / "user-config"))
        self.engine = create_engine(SqliteStorage(self.db))
        self.procs: list[subprocess.Popen[str]] = []
        self.errs: list[list[tuple[float, str]]] = []
        os.environ["JOBS_LEDGER"] = str(self.ledger)
        for name in ("settings_hold", "settings_parent", "settings_hog"):
            REGISTRY.pop(name, None)
        load_script(self.jobs)

    def config(self, text: str) -> None:
        (self.root / ".durably" / "config.toml").write_text(text)

    def worker(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """A worker on the store, started in the project folder; its stderr lines are kept with their times."""
        proc = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "worker", "--storage", f"sqlite:{self.db}",
                                 "--import", str(self.jobs), *args], cwd=self.root, env={**self.env, **(env or {})},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        lines: list[tuple[float, str]] = []

        def read() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                lines.append((time.time(), line.rstrip("\n")))

        threading.Thread(target=read, daemon=True).start()
        self.procs.append(proc)
        self.errs.append(lines)
        wait_until(lambda: any("serving" in line for _, line in lines) or proc.poll() is not None, 30)
        assert proc.poll() is None, "\n".join(line for _, line in lines)
        return proc

    def enqueue(self, workflow: str, value: Any, **options: Any) -> str:
        return asyncio.run(self.engine.enqueue(REGISTRY[workflow], value, **options)).run_id

    def marks(self) -> list[list[str]]:
        return [line.split() for line in self.ledger.read_text().splitlines()] if self.ledger.exists() else []

    def lease_row(self, run_id: str) -> tuple[Any, ...]:
        with sqlite3.connect(self.db) as db:
            return db.execute("SELECT owner, lease_expires, epoch FROM runs WHERE run_id = ?", (run_id,)).fetchone()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def setup(tmp_path: Path) -> Any:
    made = Setup(tmp_path)
    yield made
    made.stop()


@pytest.mark.parametrize("source", ["flag", "environment", "config"])
def test_the_lease_the_store_holds_and_its_renewals_are_the_workers_settings(setup: Setup, source: str) -> None:
    args: list[str] = []
    env: dict[str, str] = {}
    if source == "flag":
        args = ["--lease", "6", "--heartbeat", "0.8"]
    elif source == "environment":
        env = {"DURABLY_LEASE": "6", "DURABLY_HEARTBEAT": "0.8"}
    else:
        setup.config("lease = 6\nheartbeat = 0.8\n")
    run_id = setup.enqueue("settings_hold", {"key": "a", "seconds": 3.5})
    setup.worker("--poll", "0.05", *args, env=env)
    wait_until(lambda: setup.lease_row(run_id)[0] is not None)
    samples = []
    for _ in range(25):  # 2.5 s into the step: the lease is renewed every 0.8 s to 6 s from then
        owner, expires, _ = setup.lease_row(run_id)
        samples.append((time.time(), expires))
        time.sleep(0.1)
    ahead = [expires - now for now, expires in samples]
    renewals = sorted({expires for _, expires in samples})
    gaps = [b - a for a, b in zip(renewals, renewals[1:], strict=False)]
    print(f"\n  lease {source}: {min(ahead):.2f}-{max(ahead):.2f} s ahead, renewed every "
          f"{sum(gaps) / max(len(gaps), 1):.2f} s")
    assert 5.0 < max(ahead) <= 6.05 and min(ahead) > 4.4  # a 6 s lease, never let fall 0.8 s + slack behind
    assert len(renewals) >= 3 and all(0.5 < gap < 1.4 for gap in gaps)


def test_a_five_second_step_under_a_two_second_lease_runs_once_on_two_workers(setup: Setup) -> None:
    run_id = setup.enqueue("settings_hold", {"key": "long", "seconds": 5})  # two and a half leases
    for _ in range(2):
        setup.worker("--lease", "2", "--poll", "0.1", "-q")
    wait_until(lambda: asyncio.run(setup.engine.inspect(run_id)).status == "completed", 40)
    starts = [m for m in setup.marks() if m[:2] == ["start", "long"]]
    assert len(starts) == 1, starts
    assert asyncio.run(setup.engine.inspect(run_id)).attempt == 1


def test_concurrency_from_the_environment_bounds_runs_and_child_runs(setup: Setup) -> None:
    runs = [setup.enqueue("settings_hold", {"key": f"run{i}", "seconds": 0.6}) for i in range(4)]
    parent = setup.enqueue("settings_parent", 4)
    setup.worker("--poll", "0.05", "-q", env={"DURABLY_CONCURRENCY": "2"})
    wait_until(lambda: all(asyncio.run(setup.engine.inspect(r)).status == "completed" for r in [*runs, parent]), 60)
    live = peak = 0
    for kind, _key, _pid, _at in sorted(setup.marks(), key=lambda m: (float(m[3]), m[0] == "start")):
        live += 1 if kind == "start" else -1
        peak = max(peak, live)
    assert peak == 2  # four runs and four children, never more than two steps at once


def test_an_idle_worker_looks_at_the_queue_as_often_as_its_configured_poll(setup: Setup) -> None:
    setup.config("poll = 1.5\n")
    setup.worker("-q")
    wakeups = Path(f"{setup.db}.wake")  # the poll is the fallback: unregister the worker's local wake-up
    wait_until(lambda: wakeups.is_dir() and any(wakeups.iterdir()), 20)
    for registered in wakeups.iterdir():
        registered.unlink()
    waits = []
    for i in range(5):
        time.sleep(0.37 * i % 1.1)
        queued = time.time()
        setup.enqueue("settings_hold", {"key": f"p{i}", "seconds": 0})
        wait_until(lambda i=i: any(m[:2] == ["start", f"p{i}"] for m in setup.marks()), 10, every=0.01)
        waits.append(float(next(m for m in setup.marks() if m[:2] == ["start", f"p{i}"])[3]) - queued)
    print(f"\n  pick-up after enqueue with poll 1.5 s: {', '.join(f'{w:.2f}' for w in waits)} s")
    assert max(waits) <= 1.5 + 0.8 and max(waits) > 0.45  # with the default 0.2 s poll all would be under 0.45


def test_a_worker_deletes_ended_runs_after_its_configured_retention(setup: Setup) -> None:
    run_id = setup.enqueue("settings_hold", {"key": "r", "seconds": 0})
    setup.worker("--poll", "0.05", "-q", env={"DURABLY_RETENTION": "2s"})
    wait_until(lambda: setup.engine.storage.info(run_id) is not None
               and setup.engine.storage.info(run_id).last.get("t") == "end", 20)
    ended = time.time()
    wait_until(lambda: setup.engine.storage.info(run_id) is None, 20)
    assert time.time() - ended >= 1.5  # kept for its retention, then pruned


def test_a_renewal_the_gil_holds_up_is_reported_before_the_lease_lapses(setup: Setup) -> None:
    run_id = setup.enqueue("settings_hog", 27)  # several seconds in one call that never lets go of the GIL
    setup.worker("--lease", "3", "--poll", "0.05", "-q")
    wait_until(lambda: any(m[0] == "hog" for m in setup.marks()), 20)
    _, expires, _ = setup.lease_row(run_id)  # the last renewal before the hog holds the lease until then
    lines = setup.errs[0]
    wait_until(lambda: any("could not renew it in time" in line for _, line in lines), 60)
    dumped = next(at for at, line in lines if line.startswith("Timeout ("))
    print(f"\n  stacks written {expires - dumped:.2f} s before the lease would lapse")
    assert dumped < expires
    assert any("in hog" in line for _, line in lines)  # the stack names the step that held the GIL


def test_a_lease_below_the_minimum_is_refused_with_a_hint(setup: Setup) -> None:
    done = subprocess.run([sys.executable, "-m", "durably_py.cli", "worker", "--storage", f"sqlite:{setup.db}",
                           "--import", str(setup.jobs), "--lease", "1"], cwd=setup.root, env=setup.env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "a lease is 2 to 1e9 seconds" in done.stderr and "hint" in done.stderr
    setup.config("heartbeat = 5\n")
    done = subprocess.run([sys.executable, "-m", "durably_py.cli", "worker", "--storage", f"sqlite:{setup.db}",
                           "--import", str(setup.jobs), "--lease", "6"], cwd=setup.root, env=setup.env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "at most half the lease" in done.stderr
    for bad in [{"lease": 0.5}, {"lease": 10, "heartbeat": 6}, {"heartbeat": 0}, {"concurrency": 0}]:
        with pytest.raises(ValidationError) as info:
            Engine(SqliteStorage(setup.db), **bad)
        assert info.value.hint and info.value.docs
    assert Engine(SqliteStorage(setup.db), lease=12).heartbeat_every == 4  # a third of the lease by default


def test_durably_run_claims_and_renews_with_the_lease_from_the_environment(setup: Setup) -> None:
    env = {**setup.env, "DURABLY_LEASE": "5"}
    proc = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "run", str(setup.jobs), "--workflow",
                             "settings_hold", "--input", '{"key": "cli", "seconds": 2.5}', "--storage",
                             f"sqlite:{setup.db}"], cwd=setup.root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: any(m[:2] == ["start", "cli"] for m in setup.marks()), 30)
        with sqlite3.connect(setup.db) as db:
            ahead = [db.execute("SELECT lease_expires FROM runs").fetchone()[0] - time.time()
                     for _ in range(15) if time.sleep(0.1) is None]
        assert 3.0 < max(ahead) <= 5.05  # a 5 s lease, renewed (30 s without the setting)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    setup.config("lease = 0.5\n")
    bad = subprocess.run([sys.executable, "-m", "durably_py.cli", "run", str(setup.jobs), "--workflow",
                          "settings_hold", "--input", '{"key": "x", "seconds": 0}'], cwd=setup.root, env=setup.env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "config.toml: a lease is 2 to 1e9 seconds" in bad.stderr
