"""The durable queue on files, SQLite and PostgreSQL: how fast `durably worker` processes drain a backlog of
short runs, side by side with each adapter's raw floor and with DBOS's queue; how fast a batch is enqueued; how
soon an idle worker starts new, sleeping and signalled runs; and what finding due work costs as the backlog grows.
Figures and ratios only; nothing passes or fails.

Usage: python bench/queues.py [--runs M] [--workers 1,2,4] [--concurrency C] [--only files,sqlite,postgres]
                              [--postgres URL] [--dbos-python PATH] [--dbos-runs M] [--batch B] [--samples S]
                              [--skip drain,enqueue,latency,step,backlog]

Rows:
  drain        M runs of a three-step workflow (`async def` steps) enqueued, then N `durably worker -c C`
               processes started on them. runs/s is counted in the window where every worker is running: from
               the latest first claim among the workers to the earliest last end, the runs that ended in it
               (worker start-up and the tail are left out). `floor` is the adapter's own durable writes for one
               run done raw, one run after another in this process: files append the claim, step and end lines
               to the run's log in one write, fsync it and delete its queue entry; SQLite inserts the lines and
               deletes the queue row in one transaction committed with synchronous=FULL; PostgreSQL the same in
               one committed transaction. `dbos` is DBOS's queue (system database on SQLite or PostgreSQL) under
               the same load, run with `--dbos-python` (an interpreter with `pip install dbos`), the same
               window (`bench/dbos_queue.py`)
  enqueue      B runs recorded pending by `engine.enqueue_many` (runs/s), against one `engine.enqueue` per run
               and against the raw floor of B headers written in one durable write
  latency      one idle `durably worker` (default poll 0.2 s); S samples each, min / median / p99 ms:
               enqueue->start (from `enqueue` returning to the run's first step starting in the worker),
               sleep->wake (from the wake time a `ctx.sleep(0.3)` recorded to the next step starting),
               signal->step (from `engine.signal` being called on the parked run to its next step starting)
  step         SQLite only: median us per fresh `async def` step of a 2,000-step run (`engine.run`), against
               the floor of the same record line inserted and committed raw (WAL, synchronous=NORMAL), 5 rounds
  backlog      `storage.due(8)` median ms with 10 and with 5,000 runs pending (the ratio says whether finding due
               work grows with the backlog)
PostgreSQL rows use --postgres URL (a schema per row, dropped afterwards) or, without it, a throwaway server
started here (`bench/pgserver.py`, fsync on). DBOS rows need PostgreSQL databases of their own: they run only
on the throwaway server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pgserver  # bench/pgserver.py

from durably_py import create_engine
from durably_py.storage.url import open_storage

JOBS = '''
import time

from durably_py import workflow


def work(i):
    return i + 1


async def awork(i):
    return i + 1


def now():
    return time.time()


@workflow
async def three(ctx, n):
    a = await ctx.step(awork, n)
    b = await ctx.step(awork, a)
    return await ctx.step(awork, b)


@workflow
async def first(ctx, n):
    return await ctx.step(now)


@workflow
async def sleepy(ctx, n):
    await ctx.sleep(0.3)
    return await ctx.step(now)


@workflow
async def waiter(ctx, n):
    await ctx.wait_for("go")
    return await ctx.step(now)
'''

BENCH = Path(__file__).resolve().parent


class Stores:
    """Fresh storage URLs per row: a directory or SQLite file under one temporary folder, a PostgreSQL schema."""

    def __init__(self, root: Path, postgres: str | None) -> None:
        self.root = root
        self.postgres = postgres
        self.schemas: list[str] = []

    def url(self, kind: str) -> str | None:
        name = uuid.uuid4().hex[:10]
        if kind == "files":
            return str(self.root / name / ".durably")
        if kind == "sqlite":
            (self.root / name).mkdir(parents=True)
            return f"sqlite:{self.root / name / 'runs.db'}"
        if self.postgres is None:
            return None
        schema = f"bench_{name}"
        self.schemas.append(schema)
        return f"{self.postgres}{'&' if '?' in self.postgres else '?'}schema={schema}"

    def drop(self) -> None:
        if not self.schemas or self.postgres is None:
            return
        import psycopg

        with psycopg.connect(base_dsn(self.postgres), autocommit=True) as conn:
            for schema in self.schemas:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def base_dsn(url: str) -> str:
    """A PostgreSQL URL without its `schema=` parameter (what libpq accepts)."""
    if "?" not in url:
        return url
    head, query = url.split("?", 1)
    rest = [p for p in query.split("&") if not p.startswith("schema=")]
    return head + ("?" + "&".join(rest) if rest else "")


def jobs_file(root: Path) -> Path:
    path = root / "jobs.py"
    if not path.exists():
        path.write_text(JOBS)
    return path


def load_jobs(root: Path) -> dict[str, Any]:
    from durably_py._authoring.workflow import REGISTRY, load_script

    for name in ("three", "first", "sleepy", "waiter"):
        REGISTRY.pop(name, None)
    load_script(jobs_file(root))
    return {name: REGISTRY[name] for name in ("three", "first", "sleepy", "waiter")}


def start_workers(url: str, root: Path, count: int, concurrency: int) -> list[subprocess.Popen[bytes]]:
    args = [sys.executable, "-m", "durably_py.cli", "worker", "--storage", url, "--import", str(jobs_file(root)),
            "-c", str(concurrency), "-q"]
    return [subprocess.Popen(args, stderr=subprocess.DEVNULL) for _ in range(count)]


def stop_workers(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


async def enqueue_all(engine: Any, wf: Any, inputs: list[Any], prefix: str) -> list[str]:
    """Enqueue one run per input: `enqueue_many` where the engine has it, else one `enqueue` each."""
    keys = [f"{prefix}-{uuid.uuid4().hex}" for _ in inputs]
    if hasattr(engine, "enqueue_many"):
        handles = await engine.enqueue_many([(wf, value, key) for value, key in zip(inputs, keys, strict=True)])
        return [h.run_id for h in handles]
    return [(await engine.enqueue(wf, value, key=key)).run_id for value, key in zip(inputs, keys, strict=True)]


def ended(storage: Any, run_ids: list[str]) -> int:
    return sum(1 for r in run_ids if (info := storage.info(r)) is not None and info.last.get("t") == "end")


def wait_ended(storage: Any, run_ids: list[str], timeout: float) -> None:
    """Wait until every run has ended, looking four times a second (as `bench/dbos_queue.py` does) and each time
    only from the first run not yet seen ended up to the next one still open, so the waiting takes next to no
    CPU from the workers it measures (runs drain about in the order they were enqueued)."""
    deadline = time.monotonic() + timeout
    pending = list(run_ids)
    while pending and time.monotonic() < deadline:
        while pending and (info := storage.info(pending[0])) is not None and info.last.get("t") == "end":
            pending.pop(0)
        if pending:
            time.sleep(0.25)
    pending = [r for r in run_ids if (info := storage.info(r)) is None or info.last.get("t") != "end"]
    if pending:
        raise RuntimeError(f"{len(pending)} of {len(run_ids)} runs did not end within {timeout:g} s")


def window_rate(spans: dict[str, list[tuple[float, float]]]) -> float:
    """Runs ended per second while every worker ran: from the latest first start among the workers to the
    earliest last end, the runs that ended in it (as `dbos_queue.window_rate`)."""
    if not spans:
        return 0.0
    begin = max(min(s for s, _ in runs) for runs in spans.values())
    end = min(max(e for _, e in runs) for runs in spans.values())
    count = sum(1 for runs in spans.values() for _, e in runs if begin < e <= end)
    return count / (end - begin) if end > begin else 0.0


def spans_of(storage: Any, run_ids: list[str]) -> dict[str, list[tuple[float, float]]]:
    """Per worker (the owner of each run's last claim): (claimed at, ended at) of each run it ended."""
    from datetime import datetime

    spans: dict[str, list[tuple[float, float]]] = {}
    for run_id in run_ids:
        log = storage.read(run_id)
        claims = [r for r in log.records if type(r).__name__ == "Claim" or getattr(r, "get", lambda k: None)("t") == "claim"]
        end = log.records[-1]
        claim = claims[-1]
        at = claim.at if hasattr(claim, "at") else claim["at"]
        ts = end.ts if hasattr(end, "ts") else end["ts"]
        owner = claim.owner if hasattr(claim, "owner") else claim["owner"]
        spans.setdefault(owner, []).append((datetime.fromisoformat(at).timestamp(), ts))
    return spans


def drain(url: str, root: Path, runs: int, workers: int, concurrency: int) -> float:
    jobs = load_jobs(root)
    engine = create_engine(url)
    run_ids = asyncio.run(enqueue_all(engine, jobs["three"], list(range(runs)), "drain"))
    procs = start_workers(url, root, workers, concurrency)
    try:
        wait_ended(engine.storage, run_ids, 600)
    finally:
        stop_workers(procs)
    rate = window_rate(spans_of(engine.storage, run_ids))
    engine.storage.close()
    return rate


# ---- the raw floors: what a run's durable writes cost with no engine ------------------------------------------
LINES = (b'{"t":"claim","epoch":1,"owner":"host:1:abc","at":"2025-01-01T00:00:00.000000+00:00"}\n'
         + b''.join(b'{"t":"ok","p":"%d","l":"awork","v":%d,"a":1,"ms":0.01,"ts":1735689600.0}\n' % (i, i + 1)
                    for i in range(3))
         + b'{"t":"end","status":"completed","result":3,"error":null,"ts":1735689600.0}\n')
HEADER = b'{"t":"run","v":1,"run_id":"%s","workflow":"three","input":1}\n'


def floor_drain(kind: str, url: str, runs: int) -> float:
    """Runs/s of the drain's durable writes done raw, one run after another."""
    ids = [f"floor-{n}" for n in range(runs)]
    if kind == "files":
        folder = Path(url)
        (folder / "runs").mkdir(parents=True)
        (folder / "queue").mkdir()
        for run_id in ids:
            (folder / "runs" / f"{run_id}.jsonl").write_bytes(HEADER % run_id.encode())
            (folder / "queue" / f"{run_id}.json").write_bytes(b'{"at":0}')
        os.sync()
        start = time.perf_counter()
        for run_id in ids:
            fd = os.open(folder / "runs" / f"{run_id}.jsonl", os.O_WRONLY | os.O_APPEND)
            os.write(fd, LINES)
            os.fsync(fd)
            os.close(fd)
            os.unlink(folder / "queue" / f"{run_id}.json")
        return runs / (time.perf_counter() - start)
    if kind == "sqlite":
        db = sqlite3.connect(url.removeprefix("sqlite:"), isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("CREATE TABLE records (seq INTEGER PRIMARY KEY, run_id TEXT NOT NULL, data BLOB NOT NULL)")
        db.execute("CREATE TABLE queue (run_id TEXT PRIMARY KEY, due REAL)")
        db.executemany("INSERT INTO queue VALUES (?, 0)", [(r,) for r in ids])
        start = time.perf_counter()
        for run_id in ids:
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT INTO records (run_id, data) VALUES (?, ?)", (run_id, LINES))
            db.execute("DELETE FROM queue WHERE run_id = ?", (run_id,))
            db.execute("COMMIT")
        took = time.perf_counter() - start
        db.close()
        return runs / took
    import psycopg

    schema = url.rsplit("schema=", 1)[1]
    with psycopg.connect(base_dsn(url)) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
        conn.execute(f'CREATE TABLE "{schema}".records (seq BIGSERIAL PRIMARY KEY, run_id TEXT, data BYTEA)')
        conn.execute(f'CREATE TABLE "{schema}".queue (run_id TEXT PRIMARY KEY, due DOUBLE PRECISION)')
        with conn.cursor() as cur:
            cur.executemany(f'INSERT INTO "{schema}".queue VALUES (%s, 0)', [(r,) for r in ids])
        conn.commit()
        start = time.perf_counter()
        for run_id in ids:
            conn.execute(f'INSERT INTO "{schema}".records (run_id, data) VALUES (%s, %s)', (run_id, LINES))
            conn.execute(f'DELETE FROM "{schema}".queue WHERE run_id = %s', (run_id,))
            conn.commit()
        return runs / (time.perf_counter() - start)


def floor_enqueue(kind: str, url: str, batch: int) -> float:
    """Runs/s of writing `batch` headers and queue entries in one durable write, raw."""
    ids = [f"floor-{n}" for n in range(batch)]
    if kind == "files":
        folder = Path(url)
        (folder / "runs").mkdir(parents=True)
        (folder / "queue").mkdir()
        os.sync()
        start = time.perf_counter()
        for run_id in ids:
            (folder / "runs" / f"{run_id}.jsonl").write_bytes(HEADER % run_id.encode())
            (folder / "queue" / f"{run_id}.json").write_bytes(b'{"at":0}')
        os.sync()
        return batch / (time.perf_counter() - start)
    rows = [(r, HEADER % r.encode()) for r in ids]
    if kind == "sqlite":
        db = sqlite3.connect(url.removeprefix("sqlite:"), isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("CREATE TABLE runs (run_id TEXT PRIMARY KEY, header BLOB)")
        db.execute("CREATE TABLE queue (run_id TEXT PRIMARY KEY, due REAL)")
        start = time.perf_counter()
        db.execute("BEGIN IMMEDIATE")
        db.executemany("INSERT INTO runs VALUES (?, ?)", rows)
        db.executemany("INSERT INTO queue VALUES (?, 0)", [(r,) for r in ids])
        db.execute("COMMIT")
        took = time.perf_counter() - start
        db.close()
        return batch / took
    import psycopg

    schema = url.rsplit("schema=", 1)[1]
    with psycopg.connect(base_dsn(url)) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
        conn.execute(f'CREATE TABLE "{schema}".runs (run_id TEXT PRIMARY KEY, header BYTEA)')
        conn.execute(f'CREATE TABLE "{schema}".queue (run_id TEXT PRIMARY KEY, due DOUBLE PRECISION)')
        conn.commit()
        start = time.perf_counter()
        with conn.cursor() as cur:
            cur.executemany(f'INSERT INTO "{schema}".runs VALUES (%s, %s)', rows)
            cur.executemany(f'INSERT INTO "{schema}".queue VALUES (%s, 0)', [(r,) for r in ids])
        conn.commit()
        return batch / (time.perf_counter() - start)


def enqueue_rates(url: str, loop_url: str, root: Path, batch: int) -> tuple[float | None, float]:
    """(enqueue_many runs/s or None without it, one enqueue per run runs/s)."""
    jobs = load_jobs(root)
    many = None
    engine = create_engine(url)
    if hasattr(engine, "enqueue_many"):
        start = time.perf_counter()
        asyncio.run(enqueue_all(engine, jobs["three"], list(range(batch)), "batch"))
        many = batch / (time.perf_counter() - start)
    engine.storage.close()
    engine = create_engine(loop_url)
    single = min(batch, 300)

    async def loop() -> None:
        for n in range(single):
            await engine.enqueue(jobs["three"], n, key=f"one-{uuid.uuid4().hex}")

    start = time.perf_counter()
    asyncio.run(loop())
    rate = single / (time.perf_counter() - start)
    engine.storage.close()
    return many, rate


# ---- latency -------------------------------------------------------------------------------------------------
def latencies(url: str, root: Path, samples: int) -> dict[str, list[float]]:
    jobs = load_jobs(root)
    engine = create_engine(url)
    storage = engine.storage
    procs = start_workers(url, root, 1, 4)
    out: dict[str, list[float]] = {"enqueue->start": [], "sleep->wake": [], "signal->step": []}

    def result(run_id: str) -> Any:
        wait_ended(storage, [run_id], 30)
        info = storage.info(run_id)
        return info.last.get("result")

    async def main() -> None:
        warm = await engine.enqueue(jobs["first"], -1, key=f"warm-{uuid.uuid4().hex}")
        result(warm.run_id)
        for n in range(samples):
            await asyncio.sleep(0.05)
            handle = await engine.enqueue(jobs["first"], n, key=f"lat-{uuid.uuid4().hex}")
            queued = time.time()
            out["enqueue->start"].append(result(handle.run_id) - queued)
        for n in range(samples):
            handle = await engine.enqueue(jobs["sleepy"], n, key=f"sleep-{uuid.uuid4().hex}")
            started = result(handle.run_id)
            wake = [r for r in await engine.records(handle.run_id) if r.get("t") == "wake"]
            from datetime import datetime

            out["sleep->wake"].append(started - datetime.fromisoformat(wake[0]["at"]).timestamp())
        for n in range(samples):
            handle = await engine.enqueue(jobs["waiter"], n, key=f"wait-{uuid.uuid4().hex}")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # parked: its entry waits for the signal, no process holds it
                entry = storage.entry(handle.run_id)
                if entry is not None and entry.at is None and not storage.held(handle.run_id):
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            sent = time.time()
            await engine.signal(handle.run_id, "go")
            out["signal->step"].append(result(handle.run_id) - sent)

    try:
        asyncio.run(main())
    finally:
        stop_workers(procs)
        storage.close()
    return out


def backlog(url: str) -> tuple[float, float]:
    """Median ms of `due(8)` with 10, then 5,000 runs pending."""
    storage = open_storage(url)

    def fill(count: int) -> None:
        for _ in range(count):
            run_id = f"pending-{uuid.uuid4().hex[:12]}"
            storage.create(run_id, HEADER % run_id.encode())

    def timed() -> float:
        times = []
        for _ in range(20):
            t = time.perf_counter()
            storage.due(8)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1000

    fill(10)
    small = timed()
    fill(4990)
    large = timed()
    storage.close()
    return small, large


def sqlite_step(root: Path, steps: int = 2000, rounds: int = 5) -> tuple[float, float]:
    """Median us per fresh `async def` step of one run on SQLite, and per raw INSERT + COMMIT of the same
    record line (the floor: WAL, synchronous=NORMAL, one committed transaction per step), interleaved. Each side
    makes its database (schema, pragmas) before its clock starts; the run's own costs (create, claim, end) count."""

    async def noop(i: int) -> int:
        return i

    from durably_py import workflow

    @workflow(name="bench_steps")
    async def many(ctx: Any, n: int) -> int:
        for i in range(n):
            await ctx.step(noop, i)
        return n

    ours, floor = [], []
    line = b'{"t":"ok","p":"17","l":"noop","v":17,"a":1,"ms":0.004,"ts":1735689600.0}\n'
    for r in range(rounds):
        engine = create_engine(f"sqlite:{root / f'steps-{r}.db'}")
        engine.storage.list_runs(limit=1)  # the database made, as the floor's is below
        start = time.perf_counter()
        asyncio.run(engine.run(many, steps, key=f"steps-{r}", advisories="silent"))
        ours.append((time.perf_counter() - start) / steps * 1e6)
        engine.storage.close()
        db = sqlite3.connect(root / f"floor-{r}.db", isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("CREATE TABLE records (seq INTEGER PRIMARY KEY, run_id TEXT NOT NULL, data BLOB NOT NULL)")
        start = time.perf_counter()
        for _ in range(steps):
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT INTO records (run_id, data) VALUES (?, ?)", ("r", line))
            db.execute("COMMIT")
        floor.append((time.perf_counter() - start) / steps * 1e6)
        db.close()
    return statistics.median(ours), statistics.median(floor)


def spread(values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return f"{ms[0]:6.1f} / {statistics.median(ms):6.1f} / {p99:6.1f} ms"


def dbos_drain(python: str, url: str, runs: int, workers: int, concurrency: int, cwd: Path) -> float | None:
    done = subprocess.run([python, str(BENCH / "dbos_queue.py"), "drain", url, "--runs", str(runs), "--workers",
                           str(workers), "--concurrency", str(concurrency)], cwd=cwd, capture_output=True, text=True,
                          timeout=1200)
    if done.returncode != 0:
        print(f"  dbos failed: {done.stderr.strip()[-400:]}")
        return None
    return float(json.loads(done.stdout.strip().splitlines()[-1])["rate"])


def dbos_python(given: str | None) -> str | None:
    for python in ([given] if given else []) + [os.environ.get("DURABLY_BENCH_DBOS_PYTHON") or "", sys.executable]:
        if python and subprocess.run([python, "-c", "import dbos"], capture_output=True).returncode == 0:
            return python
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--dbos-runs", type=int, default=400)
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--postgres", default=os.environ.get("DURABLY_BENCH_POSTGRES"))
    parser.add_argument("--dbos-python", default=None)
    parser.add_argument("--only", default="files,sqlite,postgres")
    parser.add_argument("--skip", default="")
    opts = parser.parse_args()
    skip = set(opts.skip.split(",")) - {""}
    kinds = opts.only.split(",")
    counts = [int(w) for w in opts.workers.split(",")]
    root = Path(tempfile.mkdtemp(prefix="durably-bench-queues-"))
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, root, True)
        socket_dir = None
        if "postgres" in kinds and opts.postgres is None:
            try:
                socket_dir, opts.postgres = stack.enter_context(pgserver.throwaway())
            except RuntimeError as exc:
                print(f"postgres skipped: {exc}")
        stores = Stores(root, opts.postgres)
        stack.callback(stores.drop)
        python = dbos_python(opts.dbos_python)
        print(f"durably bench/queues.py: {opts.runs} runs per drain, -c {opts.concurrency}, {os.cpu_count()} CPUs, "
              f"load {os.getloadavg()[0]:.1f}; DBOS: {python or 'not installed (pass --dbos-python)'}")
        for kind in kinds:
            if stores.url(kind) is None:
                print(f"{kind:9} skipped (no PostgreSQL)")
                continue
            if "drain" not in skip:
                floor = floor_drain(kind, stores.url(kind), min(opts.runs, 1000))  # type: ignore[arg-type]
                for workers in counts:
                    rate = drain(stores.url(kind), root, opts.runs, workers, opts.concurrency)  # type: ignore[arg-type]
                    theirs = None
                    if python and kind != "files":
                        theirs = dbos_drain(python, dbos_url(kind, root, socket_dir), opts.dbos_runs, workers,
                                            opts.concurrency, root)
                    vs = f" | dbos {theirs:7.1f} runs/s, x{rate / theirs:5.1f}" if theirs else ""
                    print(f"{kind:9} drain {workers} worker{'s' if workers > 1 else ' '} {rate:8.1f} runs/s | "
                          f"floor {floor:7.1f} runs/s, x{rate / floor:5.2f}{vs}", flush=True)
            if "enqueue" not in skip:
                many, single = enqueue_rates(stores.url(kind), stores.url(kind), root, opts.batch)  # type: ignore[arg-type]
                raw = floor_enqueue(kind, stores.url(kind), opts.batch)  # type: ignore[arg-type]
                shown = f"{many:9.0f} runs/s, x{many / raw:5.2f} floor" if many else "      (no enqueue_many)"
                print(f"{kind:9} enqueue {opts.batch} as a batch {shown} | one at a time {single:7.0f} runs/s | "
                      f"floor {raw:9.0f} runs/s", flush=True)
            if "latency" not in skip:
                found = latencies(stores.url(kind), root, opts.samples)  # type: ignore[arg-type]
                print(f"{kind:9} latency min / median / p99: "
                      + " | ".join(f"{name} {spread(values)}" for name, values in found.items()), flush=True)
            if kind == "sqlite" and "step" not in skip:
                ours, raw = sqlite_step(root)
                print(f"{kind:9} step (async def, fresh) {ours:6.1f} us | INSERT+COMMIT floor {raw:6.1f} us, "
                      f"x{ours / raw:4.2f}", flush=True)
            if "backlog" not in skip:
                small, large = backlog(stores.url(kind))  # type: ignore[arg-type]
                print(f"{kind:9} due(8): {small:6.2f} ms at 10 pending, {large:6.2f} ms at 5,000 (x{large / small:5.1f})",
                      flush=True)


def dbos_url(kind: str, root: Path, socket_dir: str | None) -> str:
    name = f"dbos_{uuid.uuid4().hex[:10]}"
    if kind == "sqlite":
        return f"sqlite:///{root / (name + '.db')}"
    assert socket_dir is not None, "DBOS on PostgreSQL needs the throwaway server (run without --postgres)"
    import psycopg

    with psycopg.connect(f"host={socket_dir} user=postgres dbname=postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"postgresql+psycopg://postgres@localhost/{name}?host={socket_dir}"


if __name__ == "__main__":
    main()
