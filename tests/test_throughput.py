"""A run's fixed cost: batched enqueue (`engine.enqueue_many`, `durably enqueue --from`), workers woken at once
instead of at their next poll, and group commits of the ends of the runs a worker holds, killed mid-commit."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import drain_while_killing, records_of, storage_of, wait_until

from durably_py import KeyConflictError, ValidationError, create_engine, workflow
from durably_py._authoring.workflow import REGISTRY, load_script

JOBS = '''
import os, time
from durably_py import workflow

LEDGER = os.environ.get("JOBS_LEDGER")


def mark(key):
    if LEDGER:
        fd = os.open(LEDGER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, f"{key}\\n".encode())
        os.close(fd)
    return time.time()


@workflow
async def tp_quick(ctx, n):
    a = await ctx.step(mark, f"{n}.0")
    return await ctx.step(mark, f"{n}.1")


@workflow
async def tp_sleeper(ctx, n):
    await ctx.sleep(0.5)
    return await ctx.step(mark, f"s{n}")


@workflow
async def tp_asker(ctx, n):
    await ctx.wait_for("go")
    return await ctx.step(mark, f"a{n}")
'''


@workflow
async def tally(ctx: Any, n: int) -> int:
    return await ctx.step(int, n)


@pytest.fixture(params=["file", "sqlite", "memory", "postgres"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    return create_engine(storage_of(request.param, tmp_path, request))


def test_enqueue_many_keeps_the_identity_rules_and_writes_a_batch_at_once(engine: Any) -> None:
    async def main() -> None:
        first = await engine.enqueue_many([(tally, n) for n in range(1100)] + [(tally, 1, "one")])
        assert len(first) == 1101 and len({h.run_id for h in first}) == 1101
        again = await engine.enqueue_many([(tally, 3), (tally, 3), (tally, 1, "one"), (tally, 9999)])
        assert again[0].run_id == again[1].run_id == first[3].run_id  # same workflow and input: same run
        assert again[2].run_id == first[1100].run_id and again[3].run_id not in {h.run_id for h in first}
        with pytest.raises(KeyConflictError):
            await engine.enqueue_many([(tally, 2, "one")])
        with pytest.raises(ValidationError):
            await engine.enqueue_many([(tally, 1), "not a pair"])  # checked before anything is written
        assert await engine.count() == 1102
        late = await engine.enqueue_many([(tally, -1), (tally, -2)], priority=7, delay=60)
        entries = [engine.storage.entry(h.run_id) for h in late]
        assert all(e.priority == 7 and e.at > time.time() + 50 for e in entries)
        assert len(engine.storage.due(5000)) == 1102
        assert await engine.run(tally, 0) == 0  # runs the pending run the identity names
        done = await engine.enqueue_many([(tally, 0)])  # completed: the identity starts a new run
        assert done[0].run_id != first[0].run_id

    asyncio.run(main())


def test_enqueue_many_is_one_durable_write_per_batch_on_sqlite(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:{tmp_path / 'runs.db'}")
    started = time.perf_counter()
    asyncio.run(engine.enqueue_many([(tally, n) for n in range(5000)]))
    took = time.perf_counter() - started
    print(f"enqueue_many: {5000 / took:,.0f} runs/s, {engine.storage.fsyncs} durable commits")
    assert engine.storage.fsyncs == 5  # ENQUEUE_BATCH (1,000) runs per commit


def _jobs(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    jobs = tmp_path / "jobs.py"
    jobs.write_text(JOBS)
    env = {**os.environ, "JOBS_LEDGER": str(tmp_path / "ledger.txt"), "PYTHONPATH": str(tmp_path)}
    return jobs, env


def _cli(*args: str, env: dict[str, str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "durably_py.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120, **kwargs)


def test_durably_enqueue_from_a_json_lines_file_and_stdin(tmp_path: Path) -> None:
    jobs, env = _jobs(tmp_path)
    state = tmp_path / "state"
    lines = tmp_path / "runs.jsonl"
    lines.write_text("".join(json.dumps({"input": n, "key": f"k{n}"}) + "\n" for n in range(50)) + "\n"
                     + json.dumps({"input": 7}) + "\n")
    done = _cli("enqueue", str(jobs), "-w", "tp_quick", "--from", str(lines), "--dir", str(state), "--priority", "3",
                env=env)
    assert done.returncode == 0, done.stderr
    ids = done.stdout.split()
    assert len(ids) == 51 and len(set(ids)) == 51
    done = _cli("enqueue", str(jobs), "-w", "tp_quick", "--from", "-", "--dir", str(state), "--json", env=env,
                input='{"input": 1, "key": "k1"}\n{"input": 99}\n')
    assert done.returncode == 0, done.stderr
    again = json.loads(done.stdout)["run_ids"]
    assert again[0] == ids[1] and again[1] not in ids  # the key names the run enqueued before
    engine = create_engine(str(state))
    assert engine.storage.entry(ids[0]).priority == 3
    assert asyncio.run(engine.count()) == 52
    bad = _cli("enqueue", str(jobs), "-w", "tp_quick", "--from", "-", "--dir", str(state), env=env,
               input='{"input": 5}\n{"inptu": 6}\n')
    assert bad.returncode != 0 and "line 2 of stdin" in bad.stderr and "nothing was enqueued" in bad.stderr
    assert asyncio.run(engine.count()) == 52


def _url(kind: str, store: Any) -> str:
    """The `--storage` URL of `store` for a worker process."""
    if kind == "file":
        return str(store.dir)
    if kind == "sqlite":
        return f"sqlite:{store.path}"
    dsn = dict(part.split("=", 1) for part in store.dsn.split())
    return f"postgresql://{dsn['user']}@localhost/{dsn['dbname']}?host={dsn['host']}&schema={store.schema}"


def _result(engine: Any, run_id: str) -> Any:
    wait_until(lambda: (info := engine.storage.info(run_id)) is not None and info.last.get("t") == "end", 30)
    return engine.storage.info(run_id).last["result"]


@pytest.mark.parametrize("kind", ["file", "sqlite", "postgres"])
def test_an_idle_worker_is_woken_at_once_not_at_its_next_poll(kind: str, tmp_path: Path,
                                                              request: pytest.FixtureRequest) -> None:
    """With a 5 s poll, a worker process starts a new run, ends a sleep and runs a signalled step within a
    fraction of that: the storage woke it (local wake-ups, LISTEN/NOTIFY) or it waited for the next due time."""
    jobs, env = _jobs(tmp_path)
    store = storage_of(kind, tmp_path, request)
    url = _url(kind, store)
    engine = create_engine(store)
    for name in ("tp_quick", "tp_sleeper", "tp_asker"):
        REGISTRY.pop(name, None)
    load_script(jobs)
    worker = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "worker", "--storage", url, "--import",
                               str(jobs), "--poll", "5", "-q"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        async def main() -> dict[str, float]:
            warm = await engine.enqueue(REGISTRY["tp_quick"], -1)
            _result(engine, warm.run_id)
            await asyncio.sleep(0.3)
            queued = await engine.enqueue(REGISTRY["tp_quick"], 1)
            enqueued_at = time.time()
            started = _result(engine, queued.run_id)
            sleeper = await engine.enqueue(REGISTRY["tp_sleeper"], 1)
            woke = _result(engine, sleeper.run_id)
            wake = [r for r in await engine.records(sleeper.run_id) if r.get("t") == "wake"][0]["at"]
            asker = await engine.enqueue(REGISTRY["tp_asker"], 1)
            wait_until(lambda: (e := engine.storage.entry(asker.run_id)) is not None and e.at is None
                       and not engine.storage.held(asker.run_id))
            await asyncio.sleep(0.2)
            sent = time.time()
            await engine.signal(asker.run_id, "go")
            answered = _result(engine, asker.run_id)
            from durably_py._codec import from_iso

            return {"enqueue->start": started - enqueued_at, "sleep->wake": woke - from_iso(wake).timestamp(),
                    "signal->step": answered - sent}

        found = asyncio.run(main())
    finally:
        worker.terminate()
        worker.wait(30)
    print(", ".join(f"{name} {seconds * 1000:.1f} ms" for name, seconds in found.items()))
    assert all(seconds < 2.5 for seconds in found.values()), found  # the poll alone would take up to 5 s




FLEET_KILLS = [pytest.param(1500, 6, 3, id="short"),  # runs, SIGKILLs at most, SIGKILLs at least
               pytest.param(3000, 12, 5, id="long", marks=pytest.mark.slow)]


@pytest.mark.parametrize(("runs", "most", "least"), FLEET_KILLS)
@pytest.mark.parametrize("kind", ["file", "sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def test_workers_killed_during_group_commits_lose_no_run_and_run_none_twice(kind: str, runs: int, most: int,
                                                                           least: int, tmp_path: Path,
                                                                           request: pytest.FixtureRequest) -> None:
    """Three `durably worker -c 8` processes drain `runs` two-step runs enqueued in batches while one is SIGKILLed
    every 0.1-0.3 s (mostly inside a group commit of ends: that is where a worker spends its time between
    runs) and replaced, up to `most` times. Every run reported enqueued completes; no step of a run runs again
    after the run's end was recorded, and no run is claimed after its end."""
    jobs, env = _jobs(tmp_path)
    store = storage_of(kind, tmp_path, request)
    url = _url(kind, store)
    engine = create_engine(store)
    for name in ("tp_quick", "tp_sleeper", "tp_asker"):
        REGISTRY.pop(name, None)
    load_script(jobs)
    args = [sys.executable, "-m", "durably_py.cli", "worker", "--storage", url, "--import", str(jobs), "-c", "8",
            "--lease", "2", "-q"]
    # enqueued before the workers start, so that the kills fall while they drain (a fleet keeps pace with
    # an enqueue going on)
    ids = [h.run_id for h in asyncio.run(engine.enqueue_many([(REGISTRY["tp_quick"], n) for n in range(runs)]))]

    def worker() -> subprocess.Popen[bytes]:
        # at a lower priority: the fleet drains flat out, and what it proves does not depend on its speed, while
        # tests timing a signal in other processes beside it do
        return subprocess.Popen(args, env=env, stderr=subprocess.DEVNULL, preexec_fn=lambda: os.nice(10))

    first_open = 0  # runs before it have ended: each look reads from there on, so looking stays quick

    def drained() -> bool:
        nonlocal first_open
        while first_open < len(ids) and (info := engine.storage.info(ids[first_open])) is not None \
                and info.last.get("t") == "end":
            first_open += 1
        # every run ended; the queue entry of one whose end a killed worker recorded but did not commit as a
        # group goes once its lease lapses and a worker claims it (and finds it ended)
        return first_open == len(ids) and not engine.storage.due(10)

    kills = drain_while_killing(worker, drained, kills=most, pause=(0.1, 0.3), rng=random.Random(7), seconds=120)

    executions = len((tmp_path / "ledger.txt").read_text().split())
    claims_after_end = twice = 0
    for run_id in ids:
        records = records_of(engine.storage, run_id)
        assert records[-1]["t"] == "end" and records[-1]["status"] == "completed", (run_id, records[-1])
        ends = [i for i, r in enumerate(records) if r["t"] == "end"]
        claims_after_end += sum(1 for r in records[ends[0]:] if r["t"] == "claim")
        paths = [r["p"] for r in records if r["t"] == "ok"]
        twice += (len(ends) - 1) + (len(paths) - len(set(paths)))
    print(f"{kind}: {len(ids)} runs, {kills} workers SIGKILLed, {executions} step executions for "
          f"{2 * len(ids)} steps, {twice} steps or ends recorded twice, {claims_after_end} claims after an end")
    assert kills >= least and twice == 0 and claims_after_end == 0
    assert engine.storage.due(10) == []
