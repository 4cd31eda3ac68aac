"""Cost of child runs: a parent that spawns N children (`ctx.spawn_all`) and joins them (`ctx.join_all`).

Usage: python bench/children.py [--only NAME ...] [--concurrency C] [--postgres URL]

Rows (each in a fresh subprocess, so peak RSS is that row's alone):
  file 1k, file 10k        FileStorage, 1,000 / 10,000 children
  sqlite 10k, sqlite 100k  SqliteStorage, 10,000 / 100,000 children
  sqlite 100k in 1k        SqliteStorage, 100,000 children spawned and joined 1,000 at a time by one parent
                           (what the workflow holds stays at 1,000 children: durably's memory must stay flat too)
  postgres 1k, postgres 10k  PostgresStorage, 1,000 / 10,000 children (only with --postgres
           postgresql://USER@HOST/DB; each row in a schema of its own, dropped afterwards)
Columns:
  wall     the whole run: spawn, every child's one async step, join, end
  spawn    until `spawn_all` returned (every child created and recorded)
  floor    creating the same number of bare runs straight through the storage (header only, no fsync
           policy), measured in the same process: the cost spawn cannot go below
  spawn/floor  the ratio
  peak RSS the process's maximum resident memory (ru_maxrss) after the run
  RSS/1k   peak RSS growth per 1,000 children over the process's RSS before the run
  data/1k  the workflow's own data per 1,000 children at its largest, measured in the same process
           (tracemalloc of the same objects: the (workflow, input) pairs, the handles with their run ids, the
           results): what any library returning handles and results holds, the floor RSS/1k cannot go below
  ours/1k  RSS/1k less data/1k: what durably keeps per child beyond the workflow's own data
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROWS = {"file 1k": ("file", 1_000, None), "file 10k": ("file", 10_000, None),
        "sqlite 10k": ("sqlite", 10_000, None), "sqlite 100k": ("sqlite", 100_000, None),
        "sqlite 100k in 1k": ("sqlite", 100_000, 1_000),
        "postgres 1k": ("postgres", 1_000, None), "postgres 10k": ("postgres", 10_000, None)}


def rss_mib() -> float:
    """The current resident set size (Linux /proc), in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def own_data(n: int) -> float:
    """Bytes the workflow itself holds for `n` children at its largest: the pairs it spawns, the handles
    `spawn_all` returns (each with a run id of the engine's form) and the results `join_all` returns."""
    import tracemalloc

    from durably_py import Ok, RunHandle, workflow
    from durably_py._ids import new_run_id

    @workflow(name="bench_child")
    async def child(ctx: Any, i: int) -> int:
        return i

    tracemalloc.start()
    try:
        pairs = [(child, i) for i in range(n)]
        handles = [RunHandle(new_run_id("bench_child"), child) for _ in pairs]
        results = [Ok(i) for i in range(n)]
        size, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del pairs, handles, results
    return size


def one(kind: str, n: int, rounds_of: int | None, concurrency: int, postgres: str | None,
        where: str | None = None) -> dict[str, Any]:
    """Run one row in this process and return its figures; its files go in a new folder in `where` (which whoever
    made it removes) or in a temporary folder removed at the end."""
    from durably_py import Engine, FileStorage, SqliteStorage, workflow
    from durably_py.storage.url import open_storage

    marks: dict[str, float] = {}

    async def tiny(i: int) -> int:
        return i

    @workflow(name="bench_child")
    async def child(ctx: Any, i: int) -> int:
        return await ctx.step(tiny, i)

    @workflow(name="bench_parent")
    async def parent(ctx: Any, count: int) -> int:
        total = 0
        step = rounds_of or count
        for first in range(0, count, step):
            handles = await ctx.spawn_all([(child, i) for i in range(first, min(first + step, count))])
            marks.setdefault("spawned", time.perf_counter())
            results = await ctx.join_all(handles)
            total += sum(r.value for r in results)
            del handles, results
        return total

    with contextlib.nullcontext(tempfile.mkdtemp(dir=where)) if where else tempfile.TemporaryDirectory() as tmp:
        schemas: list[str] = []

        def storage(sub: str) -> Any:
            if kind == "postgres":
                assert postgres is not None
                schemas.append(f"bench_children_{os.getpid()}_{sub}")
                return open_storage(f"{postgres}{'&' if '?' in postgres else '?'}schema={schemas[-1]}")
            return FileStorage(Path(tmp) / sub) if kind == "file" else SqliteStorage(Path(tmp) / f"{sub}.db")

        floor_store = storage("floor")
        from durably_py import records

        started = time.perf_counter()
        for i in range(n):
            header = records.Header(v=records.LOG_VERSION, run_id=f"floor-{i}", workflow="bench_child",
                                    fingerprint="x", input=i, input_digest="x", identity=f"floor:{i}",
                                    created_at="2026-01-01T00:00:00+00:00", ts=0.0)
            floor_store.create(f"floor-{i}", records.encode(header))
        floor = time.perf_counter() - started
        del floor_store

        engine = Engine(storage("state"), concurrency=concurrency)
        before = rss_mib()
        started = time.perf_counter()
        total = asyncio.run(engine.run(parent, n, advisories="silent"))
        wall = time.perf_counter() - started
        assert total == n * (n - 1) // 2, total
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if schemas:
            import psycopg

            assert postgres is not None
            with psycopg.connect(postgres, autocommit=True) as conn:
                for schema in schemas:
                    conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    spawn = marks["spawned"] - started
    data = own_data(rounds_of or n) / 2**20
    return {"wall": wall, "spawn": spawn, "floor": floor, "peak": peak, "growth": (peak - before) / n * 1000,
            "data": data / n * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=list(ROWS), help="run only these rows")
    parser.add_argument("--concurrency", type=int, default=4, help="the engine's concurrency (default 4)")
    parser.add_argument("--postgres", default=os.environ.get("DURABLY_BENCH_POSTGRES"),
                        help="postgresql://USER@HOST/DB: adds the PostgreSQL rows")
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--where", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        kind, n, rounds_of = ROWS[args.row]
        print(json.dumps(one(kind, n, rounds_of, args.concurrency, args.postgres, args.where)))
        return
    # Every row's files are removed after the last row: removing tens of thousands of files keeps a disk busy
    # for a while after (more so on a file system mounted with `discard`), and the next row would pay for it.
    with tempfile.TemporaryDirectory(prefix="durably-bench-children-") as where:
        table(args, where)


def table(args: argparse.Namespace, where: str) -> None:
    """Run each row in a fresh subprocess, its files in `where`, and print its line."""
    print(f"{'row':<18} {'wall s':>8} {'spawn s':>8} {'floor s':>8} {'spawn/floor':>11} {'peak RSS MiB':>13} "
          f"{'RSS/1k':>7} {'data/1k':>7} {'ours/1k':>7}")
    for name in args.only or [row for row in ROWS if args.postgres or ROWS[row][0] != "postgres"]:
        if ROWS[name][0] == "postgres" and not args.postgres:
            print(f"{name:<18} skipped (pass --postgres postgresql://USER@HOST/DB)")
            continue
        out = subprocess.run([sys.executable, __file__, "--row", name, "--concurrency", str(args.concurrency),
                              "--where", where, *(["--postgres", args.postgres] if args.postgres else [])],
                             capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(f"{name:<18} failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name:<18} {r['wall']:>8.2f} {r['spawn']:>8.2f} {r['floor']:>8.2f} {r['spawn'] / r['floor']:>11.1f} "
              f"{r['peak']:>13.0f} {r['growth']:>7.2f} {r['data']:>7.2f} {r['growth'] - r['data']:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
