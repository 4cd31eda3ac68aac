"""Real `durably worker` processes: a schedule's tick starts once with 3 workers racing; children and nested
fan-out wider than the concurrency complete through the shared queue."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from helpers import durably, wait_until

from durably_py import FileStorage, create_engine, records

JOBS = '''
import os
import time
import durably_py
from durably_py import workflow


def mark(label):
    with open(os.environ["JOBS_MARKS"], "a") as f:
        f.write(f"{label} {os.getpid()}\\n")
    return label


@workflow
async def tick(ctx, who):
    return await ctx.step(mark, f"tick:{ctx.run_id}")


def leaf_work(label):
    time.sleep(float(os.environ.get("JOBS_LEAF_SECONDS", "0")))
    return mark(label)


@workflow
async def leaf(ctx, n):
    return await ctx.step(leaf_work, f"leaf:{n}")


@workflow
async def middle(ctx, n):
    results = await ctx.join_all(await ctx.spawn_all([(leaf, f"{n}.{i}") for i in range(3)]))
    return [r.value for r in results]


@workflow
async def top(ctx, width):
    results = await ctx.join_all(await ctx.spawn_all([(middle, i) for i in range(width)]))
    return [r.value for r in results]


durably_py.schedule(tick, "* * * * *", input="racers", name="every-minute")
'''


def workers(tmp_path: Path, n: int = 3, concurrency: int = 2, leaf_seconds: float = 0) -> list[subprocess.Popen[bytes]]:
    env = {**os.environ, "JOBS_MARKS": str(tmp_path / "marks.txt"), "JOBS_LEAF_SECONDS": str(leaf_seconds)}
    env.pop("DURABLY_DIR", None)
    env.pop("DURABLY_STORAGE", None)
    args = [sys.executable, "-m", "durably_py.cli", "worker", "--dir", str(tmp_path / "state"),
            "--import", str(tmp_path / "jobs.py"), "-c", str(concurrency), "--poll", "0.05"]
    logs = [tmp_path / f"worker-{os.urandom(4).hex()}.log" for _ in range(n)]
    procs = []
    for log in logs:
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=f))
    # a worker stops gracefully (exit 0) once it serves; a SIGTERM while it still imports exits 143
    wait_until(lambda: all("serving" in log.read_text() for log in logs), seconds=60)
    return procs


def stop(procs: list[subprocess.Popen[bytes]]) -> list[int]:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    return [proc.wait(timeout=30) for proc in procs]


def marks(tmp_path: Path) -> list[tuple[str, str]]:
    path = tmp_path / "marks.txt"
    return [tuple(line.split()) for line in path.read_text().splitlines()] if path.exists() else []  # type: ignore[misc]


def test_a_schedule_fires_once_per_tick_with_three_workers_racing(tmp_path: Path) -> None:
    (tmp_path / "jobs.py").write_text(JOBS)
    storage = FileStorage(tmp_path / "state")
    # the schedule was first declared an hour ago, so the current minute's tick is due as the workers start
    assert storage.bind("schedule:every-minute:* * * * *", f"since-{int(time.time()) - 3600}")
    procs = workers(tmp_path)
    engine = create_engine(FileStorage(tmp_path / "state"))
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        runs = asyncio.run(engine.list())
        if runs and all(r.status == "completed" for r in runs):
            break
        time.sleep(0.1)
    time.sleep(1.5)  # every worker has polled its schedules again meanwhile
    assert stop(procs) == [0, 0, 0]
    runs = asyncio.run(engine.list())
    keys = [r.key for r in runs]
    assert keys and len(keys) == len(set(keys)), keys
    minute = datetime.now(UTC).replace(second=0, microsecond=0)
    assert all(k.startswith("every-minute@") and datetime.fromisoformat(k.partition("@")[2]) <= minute for k in keys)
    assert all(r.status == "completed" for r in runs)
    ticks = [label for label, _ in marks(tmp_path) if label.startswith("tick:")]
    assert sorted(ticks) == sorted(f"tick:{r.run_id}" for r in runs)  # each tick's step ran exactly once


def test_nested_fan_out_wider_than_the_concurrency_completes_on_workers(tmp_path: Path) -> None:
    (tmp_path / "jobs.py").write_text(JOBS)
    procs = workers(tmp_path, concurrency=2)
    out = durably("enqueue", str(tmp_path / "jobs.py"), "--workflow", "top", "--input", "5", "--dir",
                  str(tmp_path / "state"), "--json", pythonpath=False, JOBS_MARKS=str(tmp_path / "marks.txt"))
    assert out.returncode == 0, out.stderr
    engine = create_engine(FileStorage(tmp_path / "state"))
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        tops = [r for r in asyncio.run(engine.list()) if r.workflow == "top"]
        if tops and tops[0].status in ("completed", "failed"):
            break
        time.sleep(0.2)
    assert stop(procs) == [0, 0, 0]
    [run] = [r for r in asyncio.run(engine.list()) if r.workflow == "top"]
    assert asyncio.run(engine.inspect(run.run_id)).result == [[f"leaf:{n}.{i}" for i in range(3)] for n in range(5)]
    leaves = [(label, pid) for label, pid in marks(tmp_path) if label.startswith("leaf:")]
    assert sorted(label for label, _ in leaves) == sorted(f"leaf:{n}.{i}" for n in range(5) for i in range(3))
    assert len({pid for _, pid in leaves}) > 1, "children ran on one worker only"


def test_one_worker_of_concurrency_one_completes_nested_fan_out_with_parents_parked_and_killed(tmp_path: Path) -> None:
    """Depth 3, width 3 on one `durably worker -c 1`: every parent leaves its only slot while it waits in
    `join_all` (seen parked, held by no process), and a SIGKILL while it is parked loses nothing."""
    (tmp_path / "jobs.py").write_text(JOBS)
    out = durably("enqueue", str(tmp_path / "jobs.py"), "--workflow", "top", "--input", "3", "--dir",
                  str(tmp_path / "state"), "--json", pythonpath=False, JOBS_MARKS=str(tmp_path / "marks.txt"))
    assert out.returncode == 0, out.stderr
    run_id = json.loads(out.stdout)["run_id"]
    engine = create_engine(FileStorage(tmp_path / "state"))
    [proc] = workers(tmp_path, n=1, concurrency=1, leaf_seconds=0.3)  # parents stay parked long enough to be seen
    killed = 0
    parked_seen: set[str] = set()
    deadline = time.monotonic() + 90
    state = None
    while time.monotonic() < deadline:
        runs = asyncio.run(engine.list())
        for r in runs:
            if r.workflow in ("top", "middle") and r.status == "waiting" and not engine.storage.held(r.run_id):
                parked_seen.add(r.workflow)
        if killed < 2 and "top" in parked_seen and any(r.workflow == "leaf" and r.status != "completed" for r in runs):
            proc.send_signal(signal.SIGKILL)  # the top run is parked: the kill hits the children's worker
            proc.wait()
            killed += 1
            [proc] = workers(tmp_path, n=1, concurrency=1, leaf_seconds=0.3)
        state = asyncio.run(engine.inspect(run_id))
        if state.status in ("completed", "failed"):
            break
        time.sleep(0.05)
    assert stop([proc]) == [0]
    assert state is not None and state.status == "completed", state
    assert state.result == [[f"leaf:{n}.{i}" for i in range(3)] for n in range(3)]
    assert parked_seen == {"top", "middle"} and killed >= 1
    top_parks = [r for r in records.load(engine.storage.read(run_id).records, run_id) if isinstance(r, records.Park)]
    assert top_parks, "the top run never parked in its join"
    leaves = sorted({label for label, _ in marks(tmp_path) if label.startswith("leaf:")})
    assert leaves == sorted(f"leaf:{n}.{i}" for n in range(3) for i in range(3))
    assert engine.storage.due(10) == []
