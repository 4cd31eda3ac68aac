"""Throughput of streamed steps: chunks per second a step streams, as a ratio to a raw append loop of the same
chunks, on files and on SQLite.

Usage: python bench/streams.py [--chunks N] [--repeat R]

Every measurement runs R times, interleaved (one of each per round); the table gives the best and the median
chunks/s of the rounds, and each streamed row's ratio to its store's floor (median over median). It prints
figures, it decides nothing.

Floors (the same N chunks, each JSON-encoded, no durability logic):
  raw file append   one line per chunk written to an append-mode file, flushed every 64 chunks
  raw sqlite insert one INSERT per chunk, committed every 64 chunks (synchronous=NORMAL, WAL)
Rows (one run of one step streaming N chunks, the run's own start and end included):
  emit              an `async def` step calling attempt().emit(chunk) N times
  async generator   an async generator step yielding N chunks (its result is their text, joined)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from durably_py import Engine, FileStorage, SqliteStorage, attempt, workflow

BATCH = 64


def chunk(i: int) -> str:
    return f" tok{i % 1000}"


async def emitting(n: int) -> int:
    att = attempt()
    for i in range(n):
        att.emit(chunk(i))
    return n


async def generating(n: int) -> Any:
    for i in range(n):
        yield chunk(i)


@workflow(name="bench_emit")
async def emit_run(ctx: Any, n: int) -> Any:
    return await ctx.step(emitting, n)


@workflow(name="bench_generator")
async def generator_run(ctx: Any, n: int) -> Any:
    text = await ctx.step(generating, n)
    return len(text)


def raw_file(n: int) -> float:
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "raw.jsonl", "a") as f:
        started = time.perf_counter()
        for i in range(n):
            f.write('{"attempt":1,"chunk":' + json.dumps(chunk(i)) + "}\n")
            if i % BATCH == BATCH - 1:
                f.flush()
        f.flush()
        return time.perf_counter() - started


def raw_sqlite(n: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        db = sqlite3.connect(Path(tmp) / "raw.db", isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("CREATE TABLE partials (seq INTEGER PRIMARY KEY, run_id TEXT, path TEXT, attempt INTEGER, data BLOB)")
        started = time.perf_counter()
        db.execute("BEGIN")
        for i in range(n):
            db.execute("INSERT INTO partials (run_id, path, attempt, data) VALUES (?, ?, ?, ?)",
                       ("r", "0", 1, json.dumps(chunk(i)).encode()))
            if i % BATCH == BATCH - 1:
                db.execute("COMMIT")
                db.execute("BEGIN")
        db.execute("COMMIT")
        took = time.perf_counter() - started
        db.close()
        return took


def streamed(kind: str, wf: Any, n: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        storage = FileStorage(Path(tmp) / "state") if kind == "files" else SqliteStorage(Path(tmp) / "runs.db")
        engine = Engine(storage)
        started = time.perf_counter()
        asyncio.run(engine.run(wf, n))
        took = time.perf_counter() - started
        storage.close()
        return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    n = args.chunks
    rows: list[tuple[str, str, Callable[[], float]]] = [
        ("files", "raw file append", lambda: raw_file(n)),
        ("files", "emit", lambda: streamed("files", emit_run, n)),
        ("files", "async generator", lambda: streamed("files", generator_run, n)),
        ("sqlite", "raw sqlite insert", lambda: raw_sqlite(n)),
        ("sqlite", "emit", lambda: streamed("sqlite", emit_run, n)),
        ("sqlite", "async generator", lambda: streamed("sqlite", generator_run, n)),
    ]
    times: dict[tuple[str, str], list[float]] = {(store, name): [] for store, name, _ in rows}
    for _ in range(args.repeat):
        for store, name, measure in rows:
            times[(store, name)].append(measure())
    print(f"{n:,} chunks per run, {args.repeat} interleaved rounds; chunks/s (higher is better)")
    print(f"{'store':8}{'row':20}{'best/s':>12}{'median/s':>12}{'x floor':>10}")
    for store in ("files", "sqlite"):
        floor = statistics.median(times[(store, "raw file append" if store == "files" else "raw sqlite insert")])
        for (where, name), found in times.items():
            if where != store:
                continue
            median = statistics.median(found)
            ratio = "" if name.startswith("raw") else f"{median / floor:.2f}"
            print(f"{store:8}{name:20}{n / min(found):12,.0f}{n / median:12,.0f}{ratio:>10}")


if __name__ == "__main__":
    main()
