"""Flow control on files, SQLite and PostgreSQL: what a permit costs against the same adapter's plain claim, and
how fast `durably worker` processes drain short runs with and without limits. Figures and ratios only; nothing
passes or fails.

Usage: python bench/flow.py [--runs M] [--workers 1,2,4] [--concurrency C] [--only files,sqlite,postgres]
                            [--postgres URL] [--samples S] [--skip permit,drain]

Rows:
  permit   median us of one permit taken and given back (`Storage.limit` twice: a step's concurrency key, under
           a held lease) against one plain claim and release of a run (`Storage.claim` + `release`), S samples
           each, interleaved
  drain    M runs of a three-step workflow (`async def` steps) enqueued, then N `durably worker -c C` processes
           started on them (runs/s in the window where every worker runs, as bench/queues.py counts it):
           `plain` on the default queue with no limit; `limited` on a queue declared with concurrency 2*C*N
           (room for every slot: the figure is the cost of the permits, not of waiting) whose every step also
           takes a permit of a resource with concurrency 64
PostgreSQL rows use --postgres URL (a schema per row) or a throwaway server started here (bench/pgserver.py).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import pgserver  # bench/pgserver.py
import queues  # bench/queues.py: stores, workers, the drain window

from durably_py import create_engine
from durably_py._authoring.resources import Limit
from durably_py._replay.limits import give_back, take
from durably_py.storage.url import open_storage

JOBS = '''
import os

from durably_py import queue, resource, workflow

room = int(os.environ.get("FLOW_ROOM", "64"))
limited_queue = queue("limited", concurrency=room)
api = resource("flow-api", concurrency=64)


async def awork(i):
    return i + 1


@workflow
async def plain(ctx, n):
    a = await ctx.step(awork, n)
    b = await ctx.step(awork, a)
    return await ctx.step(awork, b)


@workflow(queue="limited")
async def limited(ctx, n):
    a = await ctx.step(awork, n, uses="flow-api")
    b = await ctx.step(awork, a, uses="flow-api")
    return await ctx.step(awork, b, uses="flow-api")
'''


def permit_cost(url: str, samples: int) -> tuple[float, float]:
    """(us per permit taken and given back, us per plain claim and release), medians over interleaved samples."""
    storage = open_storage(url)
    engine = create_engine(storage)

    from durably_py._authoring.workflow import REGISTRY, load_script

    root = Path(tempfile.mkdtemp(prefix="durably-bench-flow-jobs-"))
    (root / "flow_jobs.py").write_text(JOBS)
    load_script(root / "flow_jobs.py")
    run_id = asyncio.run(engine.enqueue(REGISTRY["plain"], 1)).run_id
    limit = Limit("key:bench", "bench", 1_000_000)
    permits, claims = [], []
    for _ in range(samples):
        t0 = time.perf_counter()
        lease = storage.claim(run_id, "bench", 30.0)
        storage.release(lease)
        t1 = time.perf_counter()
        lease = storage.claim(run_id, "bench", 30.0)
        holder = [run_id, lease.epoch, "0"]
        t2 = time.perf_counter()
        storage.limit(limit.key, functools.partial(take, limit=limit, holder=holder))
        storage.limit(limit.key, functools.partial(give_back, limit=limit, holder=holder, ok=True))
        t3 = time.perf_counter()
        storage.release(lease)
        claims.append(t1 - t0)
        permits.append(t3 - t2)
    storage.close()
    shutil.rmtree(root, True)
    return statistics.median(permits) * 1e6, statistics.median(claims) * 1e6


def drain(url: str, root: Path, name: str, runs: int, workers: int, concurrency: int) -> float:
    """runs/s of `workers` workers draining `runs` runs of workflow `name` (bench/queues.py's window)."""
    from durably_py._authoring.workflow import REGISTRY, load_script

    os.environ["FLOW_ROOM"] = str(2 * concurrency * workers)
    load_script(root / "jobs.py")
    engine = create_engine(url)
    run_ids = asyncio.run(queues.enqueue_all(engine, REGISTRY[name], list(range(runs)), name))
    procs = queues.start_workers(url, root, workers, concurrency)
    try:
        queues.wait_ended(engine.storage, run_ids, 600)
    finally:
        queues.stop_workers(procs)
    rate = queues.window_rate(queues.spans_of(engine.storage, run_ids))
    engine.storage.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--postgres", default=os.environ.get("DURABLY_BENCH_POSTGRES"))
    parser.add_argument("--only", default="files,sqlite,postgres")
    parser.add_argument("--skip", default="")
    opts = parser.parse_args()
    skip = set(opts.skip.split(",")) - {""}
    kinds = opts.only.split(",")
    counts = [int(w) for w in opts.workers.split(",")]
    root = Path(tempfile.mkdtemp(prefix="durably-bench-flow-"))
    (root / "jobs.py").write_text(JOBS)  # the workers import it (queues.start_workers passes root/jobs.py)
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, root, True)
        if "postgres" in kinds and opts.postgres is None:
            try:
                _, opts.postgres = stack.enter_context(pgserver.throwaway())
            except RuntimeError as exc:
                print(f"postgres skipped: {exc}")
        stores = queues.Stores(root, opts.postgres)
        stack.callback(stores.drop)
        print(f"durably bench/flow.py: {opts.runs} runs per drain, -c {opts.concurrency}, {os.cpu_count()} CPUs, "
              f"load {os.getloadavg()[0]:.1f}")
        for kind in kinds:
            if stores.url(kind) is None:
                print(f"{kind:9} skipped (no PostgreSQL)")
                continue
            if "permit" not in skip:
                permit, claim = permit_cost(stores.url(kind), opts.samples)  # type: ignore[arg-type]
                print(f"{kind:9} permit taken and given back {permit:8.1f} us | plain claim and release "
                      f"{claim:8.1f} us, x{permit / claim:5.2f}", flush=True)
            if "drain" not in skip:
                for workers in counts:
                    plain = drain(stores.url(kind), root, "plain", opts.runs, workers, opts.concurrency)  # type: ignore[arg-type]
                    limited = drain(stores.url(kind), root, "limited", opts.runs, workers, opts.concurrency)  # type: ignore[arg-type]
                    print(f"{kind:9} drain {workers} worker{'s' if workers > 1 else ' '} plain {plain:8.1f} runs/s | "
                          f"limited {limited:8.1f} runs/s, x{limited / plain:5.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
