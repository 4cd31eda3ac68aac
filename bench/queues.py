"""The durable queue: enqueue->start latency, runs/s through N worker processes, and the due query with many
ended runs present, on files, SQLite and PostgreSQL. Figures and ratios only; nothing passes or fails.

Usage: python bench/queues.py [--runs M] [--workers N] [--ended E] [--width W] [--postgres DSN_URL]
                               [--only files,sqlite,...]

Rows:
  enqueue->start    median seconds from `enqueue` returning to the run's first step starting, with the
                    engine's own worker started (`engine.start(poll=0.2)`; an enqueue pokes it)
  runs/s N workers  N `durably worker -c 4` processes, started and warmed up; then M three-step runs
                    enqueued and runs/s counted from the first enqueue to the last completion, against the
                    floor: the same M runs through `engine.run` one after another in this process (no queue,
                    no claims, no other process), as a ratio
  due query         median time of `storage.due(10)` with 100 pending runs, before and after E ended runs
                    were added to the store (their ratio says whether ended runs slow the query); on
                    PostgreSQL the ended runs' rows are inserted by one statement. `end` is the median
                    cost of `unschedule` (a run leaving the queue as it ends, its parent's join updated)
  fan-out           a parent spawning W one-step children and `join_all`ing them, through the engine's own
                    worker at concurrency 1 (the parent parks in the join, holding no slot; the children
                    run one by one; the last one's end makes the parent due), against `engine.run` of the
                    same parent in one process (children in the parent's process, no parking)
PostgreSQL rows need --postgres postgresql://USER@HOST/DB (a schema is created and dropped).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from durably_py import create_engine, workflow
from durably_py.storage.url import open_storage

JOBS = '''
from durably_py import workflow


def work(i):
    return i + 1


@workflow
async def three(ctx, n):
    a = await ctx.step(work, n)
    b = await ctx.step(work, a)
    return await ctx.step(work, b)
'''

STARTED: dict[str, float] = {}


def mark(run: str) -> float:
    STARTED[run] = time.time()
    return STARTED[run]


@workflow
async def first_step(ctx: Any, n: int) -> float:
    return await ctx.step(mark, str(n))


def latency(url: str, samples: int) -> float:
    engine = create_engine(url)

    async def main() -> list[float]:
        await engine.start(poll=0.2)
        out = []
        for n in range(samples):
            key = f"lat-{uuid.uuid4().hex}"
            before = time.time()
            handle = await engine.enqueue(first_step, n, key=key)
            queued = time.time()
            await engine.join(handle)
            out.append(STARTED[str(n)] - queued)
            del before
        await engine.stop()
        return out

    return statistics.median(asyncio.run(main()))


def throughput(url: str, folder: Path, runs: int, workers: int) -> tuple[float, float]:
    jobs = folder / "jobs.py"
    jobs.write_text(JOBS)
    sys.path.insert(0, str(folder))
    from durably_py._workflow import REGISTRY, load_script

    REGISTRY.pop("three", None)
    load_script(jobs)
    three = REGISTRY["three"]
    engine = create_engine(url)
    floor_engine = create_engine(url)

    async def floor() -> float:
        start = time.perf_counter()
        for n in range(runs):
            await floor_engine.run(three, n, key=f"floor-{uuid.uuid4().hex}")
        return time.perf_counter() - start

    floor_s = asyncio.run(floor())

    async def fill(count: int, prefix: str) -> list[str]:
        return [(await engine.enqueue(three, n, key=f"{prefix}-{uuid.uuid4().hex}")).run_id for n in range(count)]

    def wait_all(ids: list[str]) -> None:
        pending = set(ids)
        while pending:
            time.sleep(0.02)
            pending = {r for r in pending if (info := engine.storage.info(r)) is None or info.last.get("t") != "end"}

    env = {**os.environ}
    args = [sys.executable, "-m", "durably_py.cli", "worker", "--storage", url, "--import", str(jobs), "-c", "4",
            "--poll", "0.05", "-q"]
    procs = [subprocess.Popen(args, env=env) for _ in range(workers)]
    try:
        wait_all(asyncio.run(fill(workers * 4, "warm")))  # every worker up and idle before the clock starts
        start = time.perf_counter()
        wait_all(asyncio.run(fill(runs, "tp")))
        took = time.perf_counter() - start
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    return runs / took, runs / floor_s


@workflow
async def fan_leaf(ctx: Any, n: int) -> int:
    return await ctx.step(int, n)


@workflow
async def fan_parent(ctx: Any, width: int) -> int:
    results = await ctx.join_all(await ctx.spawn_all([(fan_leaf, n) for n in range(width)]))
    return sum(r.value for r in results)


def fan_out(url: str, width: int) -> tuple[float, float, int]:
    """Seconds through the engine's worker at concurrency 1, seconds through `run()`, and the parent's claims."""
    engine = create_engine(url, concurrency=1)

    async def served() -> tuple[float, str]:
        await engine.start(poll=0.05)
        start = time.perf_counter()
        handle = await engine.enqueue(fan_parent, width, key=f"fan-{uuid.uuid4().hex}")
        assert await engine.join(handle) == width * (width - 1) // 2
        took = time.perf_counter() - start
        await engine.stop()
        return took, handle.run_id

    took, run_id = asyncio.run(served())
    claims = asyncio.run(engine.inspect(run_id)).attempt

    async def in_process() -> float:
        start = time.perf_counter()
        await create_engine(url, concurrency=1).run(fan_parent, width, key=f"fan-{uuid.uuid4().hex}")
        return time.perf_counter() - start

    return took, asyncio.run(in_process()), claims


def due_query(url: str, ended: int, rounds: int = 30) -> tuple[float, float]:
    storage = open_storage(url)
    header = b'{"t":"run","v":1,"run_id":"%s","workflow":"wf","key":null}\n'
    for n in range(100):
        run_id = f"pending-{n}-{uuid.uuid4().hex[:8]}"
        storage.create(run_id, header % run_id.encode())

    def timed() -> float:
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            storage.due(10)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    before = timed()
    if type(storage).__name__ == "PostgresStorage":
        # One statement instead of 200,000 durable round trips: the same rows `create` + `unschedule` leave.
        end = b'{"t":"end","status":"completed","result":1}\n'
        with storage._cursor(transaction=True) as cur:
            cur.execute(f"INSERT INTO {storage._runs} (run_id, header, last, size) SELECT 'ended-' || g,"
                        " convert_to('{\"t\":\"run\",\"v\":1,\"run_id\":\"ended-' || g || '\",\"workflow\":\"wf\"}'"
                        " || chr(10), 'UTF8'), %s, 100 FROM generate_series(1, %s) g", (end, ended))
    else:
        for n in range(ended):
            run_id = f"ended-{n}"
            storage.create(run_id, header % run_id.encode())
            storage.unschedule(run_id)
    after = timed()
    ends = []
    for n in range(200):
        run_id = f"ending-{n}"
        storage.create(run_id, header % run_id.encode())
        t = time.perf_counter()
        storage.unschedule(run_id)
        ends.append(time.perf_counter() - t)
    storage.close()
    UNSCHEDULE[url] = statistics.median(ends)
    return before, after


UNSCHEDULE: dict[str, float] = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--ended", type=int, default=100_000)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--width", type=int, default=200)
    parser.add_argument("--postgres", default=os.environ.get("DURABLY_BENCH_POSTGRES"))
    parser.add_argument("--only", default="files,sqlite,postgres")
    opts = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="durably-bench-queue-"))
    schemas: list[str] = []

    def url_for(kind: str, name: str) -> str | None:
        if kind == "files":
            return str(root / name / "state")
        if kind == "sqlite":
            (root / name).mkdir(parents=True, exist_ok=True)
            return f"sqlite:{root / name / 'runs.db'}"
        if not opts.postgres:
            return None
        schema = f"bench_{uuid.uuid4().hex[:12]}"
        schemas.append(schema)
        sep = "&" if "?" in opts.postgres else "?"
        return f"{opts.postgres}{sep}schema={schema}"

    print(f"durably bench/queues.py: {opts.runs} runs, {opts.workers} workers, {opts.ended} ended runs, "
          f"{os.cpu_count()} CPUs")
    try:
        for kind in opts.only.split(","):
            urls = {name: url_for(kind, name) for name in ("lat", "tp", "due", "fan")}
            if any(u is None for u in urls.values()):
                print(f"{kind:9} skipped (pass --postgres postgresql://USER@HOST/DB)")
                continue
            lat = latency(urls["lat"], opts.samples)  # type: ignore[arg-type]
            (root / f"{kind}-tp").mkdir(exist_ok=True)
            rate, floor = throughput(urls["tp"], root / f"{kind}-tp", opts.runs, opts.workers)  # type: ignore[arg-type]
            before, after = due_query(urls["due"], opts.ended)  # type: ignore[arg-type]
            print(f"{kind:9} enqueue->start {lat * 1000:7.1f} ms | {opts.workers} workers {rate:7.1f} runs/s "
                  f"(in-process floor {floor:7.1f} runs/s, ratio {rate / floor:4.2f}) | due(10) {before * 1000:6.2f} ms "
                  f"-> {after * 1000:6.2f} ms with {opts.ended} ended runs (x{after / before:4.2f}), "
                  f"end {UNSCHEDULE[urls['due']] * 1000:5.2f} ms")  # type: ignore[index]
            served, direct, claims = fan_out(urls["fan"], opts.width)  # type: ignore[arg-type]
            print(f"{kind:9} fan-out {opts.width} children: worker -c 1 {served:6.2f} s (parent claimed {claims}x) | "
                  f"run() in one process {direct:6.2f} s (ratio {served / direct:4.2f})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if schemas and opts.postgres:
            import psycopg

            base = opts.postgres.split("?")[0] + ("?" + "&".join(
                p for p in opts.postgres.split("?", 1)[1].split("&") if not p.startswith("schema="))
                if "?" in opts.postgres else "")
            with psycopg.connect(base, autocommit=True) as conn:
                for schema in schemas:
                    conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


if __name__ == "__main__":
    main()
