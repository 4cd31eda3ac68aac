"""Listing runs at scale: a runs page over 100,000 runs on files and on SQLite.

    python bench/runs.py                   # ~2-4 min: 100,000 runs on files, then on SQLite
    python bench/runs.py --runs 20000 --only sqlite

Each store holds one real 3-step run copied under new ids, keys, workflows and times (every tenth copy
failed instead of completed), written behind the storage's back as an old store would be: the first
listing builds the run catalog from the logs (files: `catalog.db`; SQLite: the catalog columns), which is
timed on its own. Then each query is timed (median of --repeat) next to a floor measured in the same run:
reading the first and last line of every log (files) or selecting every run's header and last line
(SQLite), which is what a listing cost before the catalog. Nothing here passes or fails: it prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from durably_py import Engine, FileStorage, workflow  # noqa: E402
from durably_py.storage import SqliteStorage  # noqa: E402


async def noop(i: int) -> int:
    return i


@workflow
async def small(ctx: Any, n: int) -> int:
    """n sequential async steps."""
    for i in range(n):
        await ctx.step(noop, i, name="step")
    return n


def median_ms(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def template(tmp: Path) -> tuple[str, str]:
    """One real completed run's log and its id."""
    state = tmp / "template"
    engine = Engine(FileStorage(state))
    asyncio.run(engine.run(small, 3, key="template"))
    (log,) = (state / "runs").glob("*.jsonl")
    return log.read_text(), log.stem


def copies(text: str, old_id: str, runs: int) -> Any:
    """(run id, log text, time) of each copy: workflows job0-job6, keys batch-N, every tenth failed."""
    base = time.time() - runs
    for i in range(runs):
        run_id = f"job{i % 7}-20260501-{i:08x}"
        body = text.replace(old_id, run_id).replace('"key":"template"', f'"key":"batch-{i}"') \
                   .replace('"workflow":"small"', f'"workflow":"job{i % 7}"')
        if i % 10 == 9:
            body = body.replace('"status":"completed"', '"status":"failed"')
        yield run_id, body, base + i


def make_files(state: Path, text: str, old_id: str, runs: int) -> None:
    runs_dir = state / "runs"
    runs_dir.mkdir(parents=True)
    for run_id, body, at in copies(text, old_id, runs):
        path = runs_dir / f"{run_id}.jsonl"
        path.write_text(body)
        os.utime(path, (at, at))


SCHEMA_3 = (
    "CREATE TABLE runs (run_id TEXT PRIMARY KEY, header BLOB NOT NULL, created REAL NOT NULL, updated REAL NOT NULL,"
    " epoch INTEGER NOT NULL DEFAULT 0, owner TEXT, lease_expires REAL, last BLOB NOT NULL, size INTEGER NOT NULL,"
    " syncs INTEGER NOT NULL DEFAULT 0)",
    "CREATE TABLE records (seq INTEGER PRIMARY KEY, run_id TEXT NOT NULL, data BLOB NOT NULL)",
    "CREATE INDEX records_by_run ON records (run_id, seq)",
)
"""The runs and records tables of the SQLite adapter's schema 3 (it adds the others when it opens the file)."""


def make_sqlite(path: Path, text: str, old_id: str, runs: int) -> None:
    """A database as the SQLite adapter wrote it before the run catalog (its schema version 3 tables)."""
    path.parent.mkdir(parents=True)
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("BEGIN")
    for statement in SCHEMA_3:
        db.execute(statement)
    db.execute("PRAGMA user_version=3")
    have = {row[1] for row in db.execute("PRAGMA table_info(runs)")}
    assert "state" not in have, "the bench writes the pre-catalog layout"
    for run_id, body, at in copies(text, old_id, runs):
        data = body.encode()
        header = data[: data.index(b"\n") + 1]
        last = data[data.rstrip(b"\n").rfind(b"\n") + 1:]
        db.execute("INSERT INTO runs (run_id, header, created, updated, epoch, last, size) VALUES (?, ?, ?, ?, 1, ?, ?)",
                   (run_id, header, at, at, last, len(data)))
        db.execute("INSERT INTO records (run_id, data) VALUES (?, ?)", (run_id, data))
    db.execute("COMMIT")
    db.close()


def floor_files(runs_dir: Path) -> None:
    """What a listing read before the catalog: the first and last line of every run's log."""
    for name in os.listdir(runs_dir):
        if name.endswith(".jsonl"):
            with open(runs_dir / name, "rb") as f:
                json.loads(f.readline())
                size = os.fstat(f.fileno()).st_size
                f.seek(max(0, size - 512))
                json.loads(f.read().rstrip().rsplit(b"\n", 1)[-1])


def floor_sqlite(path: Path) -> None:
    """What a listing read before the catalog: every run's header and last line, decoded."""
    db = sqlite3.connect(path)
    for header, last in db.execute("SELECT header, last FROM runs ORDER BY updated DESC"):
        json.loads(header)
        json.loads(last)
    db.close()


def row(what: str, ms: float, floor: float | None = None) -> None:
    ratio = f"{ms / floor:.3f}x" if floor else ""
    print(f"| {what} | {ms:,.1f} | {ratio} |", flush=True)


def measure(engine: Engine, runs: int, repeat: int, floor: float) -> None:
    def page(**filters: Any) -> Any:
        return lambda: asyncio.run(engine.list(**filters))

    row("Engine.list(limit=51): first page", median_ms(page(limit=51), repeat), floor)
    row(f"Engine.list(limit=51, offset={runs // 2:,})", median_ms(page(limit=51, offset=runs // 2), repeat), floor)
    row("Engine.list(workflow='job3', status='completed', limit=51)",
        median_ms(page(workflow="job3", status="completed", limit=51), repeat), floor)
    row("Engine.list(status='failed', limit=51)", median_ms(page(status="failed", limit=51), repeat), floor)
    row("Engine.list(status='running', limit=51) (no open runs)",
        median_ms(page(status="running", limit=51), repeat), floor)
    row("Engine.list(search='batch-4242', limit=51)", median_ms(page(search="batch-4242", limit=51), repeat), floor)
    if hasattr(engine, "count"):
        row("Engine.count(status='completed')",
            median_ms(lambda: asyncio.run(engine.count(status="completed")), repeat), floor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", choices=["files", "sqlite"])
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="durably-bench-runs-"))
    try:
        text, old_id = template(tmp)
        if args.only in (None, "files"):
            state = tmp / "files" / ".durably"
            began = time.perf_counter()
            make_files(state, text, old_id, args.runs)
            print(f"\nFileStorage, {args.runs:,} runs (logs written in {time.perf_counter() - began:.0f} s)\n")
            print("| measurement | ms (median) | x floor |\n| --- | ---: | ---: |")
            floor = median_ms(lambda: floor_files(state / "runs"), args.repeat)
            row("floor: first and last line of every log", floor)
            engine = Engine(FileStorage(state))
            began = time.perf_counter()
            asyncio.run(engine.list(limit=1))
            row("first listing: builds catalog.db from the logs (once)", (time.perf_counter() - began) * 1000, floor)
            measure(engine, args.runs, args.repeat, floor)
        if args.only in (None, "sqlite"):
            path = tmp / "sqlite" / "durably.db"
            began = time.perf_counter()
            make_sqlite(path, text, old_id, args.runs)
            print(f"\nSqliteStorage, {args.runs:,} runs (written in {time.perf_counter() - began:.0f} s)\n")
            print("| measurement | ms (median) | x floor |\n| --- | ---: | ---: |")
            floor = median_ms(lambda: floor_sqlite(path), args.repeat)
            row("floor: every run's header and last line", floor)
            engine = Engine(SqliteStorage(path))
            began = time.perf_counter()
            asyncio.run(engine.list(limit=1))
            row("first listing: adds and fills the catalog columns (once)", (time.perf_counter() - began) * 1000,
                floor)
            measure(engine, args.runs, args.repeat, floor)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
