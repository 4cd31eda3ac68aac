"""Values stored once: the store size of an agent loop, and the per-step cost on small values, on and off.

Usage: python bench/agents.py [--turns 100] [--steps 2000] [--repeat 3]

Store size: a `turns`-turn agent loop whose one step per turn takes the whole conversation and returns it with
one more message (about 1 KiB of distinct text each), so every step's output repeats the conversation so far.
Measured on files (the log plus its runs/<id>.blobs) and on SQLite (the bytes of the run's records and
run_blobs rows), with values stored once (the default) and with it off (`values_once=False`), against the
bytes of the distinct messages (each message's JSON once).

Per-step cost: a fresh run of `--steps` no-op steps returning a small dict on files, on and off, interleaved
`--repeat` times; the min and median microseconds per step. Per-append cost: 20,000 appends of a small `ok`
line to one claimed run on files (`FileStorage.append`, the path every step's record takes), on and off. Run
the same script with PYTHONPATH pointing at an older tree of durably-py for a before/after comparison (its
per-append and per-step rows need no `values_once`: an older tree ignores the setting, which is then off).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from durably_py import Engine, FileStorage, SqliteStorage, workflow


def message(turn: int) -> dict[str, str]:
    """The assistant message of `turn`: about 1 KiB of text no other turn has."""
    words = []
    seed = hashlib.sha256(str(turn).encode()).hexdigest()
    while sum(len(w) + 1 for w in words) < 1000:
        seed = hashlib.sha256(seed.encode()).hexdigest()
        words.append(seed[: 4 + int(seed[0], 16) % 7])
    return {"role": "assistant", "content": f"turn {turn}: " + " ".join(words)}


def model(conversation: dict[str, Any], turn: int) -> dict[str, Any]:
    """A stand-in for a model call: the conversation with the next message appended."""
    return {"messages": [*conversation["messages"], message(turn)]}


@workflow
async def agent(ctx: Any, turns: int) -> int:
    """An agent loop: every turn's step takes and returns the whole conversation."""
    conversation: dict[str, Any] = {"messages": []}
    for turn in range(turns):
        conversation = await ctx.step(model, conversation, turn, name="model")
    return len(conversation["messages"])


async def noop(i: int) -> dict[str, int]:
    """A step with a small output."""
    return {"i": i}


@workflow
async def small(ctx: Any, steps: int) -> int:
    """A run of small steps (the plain step path)."""
    for i in range(steps):
        await ctx.step(noop, i)
    return steps


def store_bytes(kind: str, root: Path, run_id: str) -> tuple[int, int]:
    """(log bytes, stored-value bytes) of one run."""
    if kind == "file":
        blobs = root / "runs" / f"{run_id}.blobs"
        return (root / "runs" / f"{run_id}.jsonl").stat().st_size, blobs.stat().st_size if blobs.exists() else 0
    db = sqlite3.connect(root / "runs.db")
    try:  # SQLite schema 10: a run's records are the range of its number
        log = db.execute("SELECT coalesce(sum(length(r.data)), 0) FROM runs JOIN records r ON r.seq BETWEEN"
                         " runs.num * 4294967296 AND runs.num * 4294967296 + 4294967295 WHERE runs.run_id = ?",
                         (run_id,)).fetchone()[0]
    except sqlite3.OperationalError:  # an older tree: records carry their run's id
        log = db.execute("SELECT coalesce(sum(length(data)), 0) FROM records WHERE run_id = ?", (run_id,)).fetchone()[0]
    try:
        values = db.execute("SELECT coalesce(sum(length(data)) + 64 * count(*), 0) FROM run_blobs WHERE run_id = ?",
                            (run_id,)).fetchone()[0]
    except sqlite3.OperationalError:  # an older tree: no such table
        values = 0
    db.close()
    return int(log), int(values)


def storage(kind: str, root: Path, values_once: bool) -> Any:
    """A fresh store of `kind` (an older tree, without the setting, stores every value inline)."""
    try:
        if kind == "file":
            return FileStorage(root, values_once=values_once)
        return SqliteStorage(root / "runs.db", values_once=values_once)
    except TypeError:
        return FileStorage(root) if kind == "file" else SqliteStorage(root / "runs.db")


def loop_size(kind: str, turns: int, values_once: bool) -> tuple[int, int, float]:
    """(log bytes, stored-value bytes, seconds) of a `turns`-turn agent loop."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = storage(kind, root, values_once)
        engine = Engine(store)
        started = time.perf_counter()
        asyncio.run(engine.run(agent, turns, advisories="silent"))
        seconds = time.perf_counter() - started
        run_id = store.list_runs()[0].run_id
        store.close()
        log, values = store_bytes(kind, root, run_id)
        return log, values, seconds


def step_cost(steps: int, values_once: bool) -> float:
    """Microseconds per small step of a fresh run on files."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            store = FileStorage(tmp, values_once=values_once)
        except TypeError:  # an older tree, without the setting
            store = FileStorage(tmp)
        engine = Engine(store)
        started = time.perf_counter()
        asyncio.run(engine.run(small, steps, advisories="silent"))
        elapsed = time.perf_counter() - started
        store.close()
        return elapsed / steps * 1e6


def append_cost(values_once: bool, appends: int = 20_000) -> float:
    """Microseconds per append of a small `ok` line to one claimed run on files (best of 5 batches)."""
    line = b'{"t":"ok","p":"12","l":"noop","v":{"i":12},"a":1,"ms":0.01,"ts":1796432209.8569725}\n'
    best = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            store = FileStorage(tmp, values_once=values_once)
        except TypeError:  # an older tree, without the setting
            store = FileStorage(tmp)
        store.create("r1", b'{"t":"run","v":1,"run_id":"r1","workflow":"w"}\n')
        lease = store.claim("r1", "bench", 30)
        assert lease is not None
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(appends):
                store.append(lease, line)
            best.append((time.perf_counter() - started) / appends * 1e6)
        store.close()
    return min(best)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    distinct = sum(len(msgspec.json.encode(message(turn))) for turn in range(args.turns))
    print(f"{args.turns}-turn agent loop, one ~1 KiB message per turn; distinct messages: {distinct:,} bytes\n")
    print("| store | values once | log bytes | stored values | total | x distinct | seconds |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for kind in ("file", "sqlite"):
        for on in (True, False):
            log, values, seconds = loop_size(kind, args.turns, on)
            total = log + values
            print(f"| {kind} | {'on' if on else 'off'} | {log:,} | {values:,} | {total:,} | "
                  f"{total / distinct:.2f} | {seconds:.2f} |")
    print(f"\nsmall values on files, {args.repeat} interleaved rounds: us per step of a fresh {args.steps}-step run, "
          "us per append of a small line\n")
    steps: dict[bool, list[float]] = {True: [], False: []}
    appends: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeat):
        for on in (True, False):
            steps[on].append(step_cost(args.steps, on))
            appends[on].append(append_cost(on))
    print("| values once | step min | step median | append min | append median |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for on in (True, False):
        print(f"| {'on' if on else 'off'} | {min(steps[on]):.2f} | {statistics.median(steps[on]):.2f} | "
              f"{min(appends[on]):.3f} | {statistics.median(appends[on]):.3f} |")


if __name__ == "__main__":
    sys.exit(main())
