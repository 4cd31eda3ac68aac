"""Operations by filter: `retry_many` and `cancel_many` against the floor of the same operation run one run at a
time (`engine.retry` / `engine.cancel` in a loop), on files and SQLite.

    python bench/bulk.py                 # 1,000 runs per row
    python bench/bulk.py --runs 3000     # the downstream-outage day of issue 12

Each row seeds two equal batches of runs in one store (failed runs for retry, parked runs for cancel), acts on
one batch with the loop (the floor) and on the other with the bulk call, and prints milliseconds per run and
the ratio bulk / loop. `select` is the dry run the CLI counts with before it asks.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from durably_py import FileStorage, RunParkedError, SqliteStorage, create_engine, workflow

OUTAGE = {"on": True}


def call(n: int) -> int:
    if OUTAGE["on"]:
        raise ConnectionError("downstream is down")
    return n


@workflow
async def bench_bulk_fails(ctx: Any, n: int) -> int:
    return await ctx.step(call, n)


@workflow
async def bench_bulk_parks(ctx: Any, n: int) -> Any:
    await ctx.step(lambda: n, name="first")
    return await ctx.wait_for("go", timeout=86400)


async def seed(engine: Any, wf: Any, start: int, count: int) -> list[str]:
    ids = []
    for n in range(start, start + count):
        try:
            await engine.run(wf, n, wait=False)
        except (ConnectionError, RunParkedError):
            pass
        ids.append(engine_key(engine, wf, n))
    return ids


def engine_key(engine: Any, wf: Any, n: int) -> str:
    """The id of the run `wf(n)` names (its identity binding)."""
    from durably_py._codec import digest

    return engine.storage.lookup(f"wf:{wf.name}:{digest(n)}")


async def row(kind: str, runs: int, root: Path) -> list[tuple[str, float, float, float]]:
    storage = FileStorage(root / "state") if kind == "files" else SqliteStorage(root / "runs.db")
    engine = create_engine(storage)
    out = []

    OUTAGE["on"] = True
    loop_ids = await seed(engine, bench_bulk_fails, 0, runs)
    await seed(engine, bench_bulk_fails, runs, runs)
    OUTAGE["on"] = False
    started = time.perf_counter()
    for run_id in loop_ids:
        await engine.retry(run_id, wait=False)
    floor = time.perf_counter() - started
    started = time.perf_counter()
    preview = await engine.retry_many(status="failed", dry_run=True)
    select = time.perf_counter() - started
    assert len(preview.selected) == runs
    started = time.perf_counter()
    result = await engine.retry_many(status="failed")
    bulk = time.perf_counter() - started
    assert len(result.acted) == runs and not result.skipped
    out.append((f"{kind} retry", floor / runs * 1e3, bulk / runs * 1e3, select * 1e3))

    loop_ids = await seed(engine, bench_bulk_parks, 0, runs)
    await seed(engine, bench_bulk_parks, runs, runs)
    started = time.perf_counter()
    for run_id in loop_ids:
        await engine.cancel(run_id)
    floor = time.perf_counter() - started
    started = time.perf_counter()
    preview = await engine.cancel_many(status="waiting", dry_run=True)
    select = time.perf_counter() - started
    started = time.perf_counter()
    result = await engine.cancel_many(status="waiting")
    bulk = time.perf_counter() - started
    assert len(result.acted) == runs and not result.skipped
    out.append((f"{kind} cancel", floor / runs * 1e3, bulk / runs * 1e3, select * 1e3))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    args = parser.parse_args()
    print(f"{args.runs} runs per batch; ms per run; select = the dry run before the question (ms, whole batch)")
    print(f"{'row':<16}{'loop (floor)':>14}{'bulk':>10}{'x floor':>9}{'select':>10}")
    for kind in ("files", "sqlite"):
        with tempfile.TemporaryDirectory() as tmp:
            for name, floor, bulk, select in asyncio.run(row(kind, args.runs, Path(tmp))):
                print(f"{name:<16}{floor:>14.2f}{bulk:>10.2f}{bulk / floor:>9.2f}{select:>10.0f}", flush=True)


if __name__ == "__main__":
    main()
