"""Values stored once: the store size of an agent loop, and the per-step cost on small values, on and off.

Usage: python bench/agents.py [--turns 100] [--steps 2000] [--repeat 3]

Store size: a `turns`-turn agent loop whose one step per turn takes the whole conversation and returns it with
one more message (about 1 KiB of distinct text each), so every step's output repeats the conversation so far.
Measured on files (the log plus its runs/<id>.blobs) and on SQLite (the bytes of the run's records and
run_blobs rows), with values stored once (the default) and with it off (`values_once=False`), against the
bytes of the distinct messages (each message's JSON once).

Per-step cost: a fresh run of `--steps` no-op steps returning a small dict on files, on and off, interleaved
`--repeat` times; the min and median microseconds per step.
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
    log = db.execute("SELECT coalesce(sum(length(data)), 0) FROM records WHERE run_id = ?", (run_id,)).fetchone()[0]
    values = db.execute("SELECT coalesce(sum(length(data)) + 64 * count(*), 0) FROM run_blobs WHERE run_id = ?",
                        (run_id,)).fetchone()[0]
    db.close()
    return int(log), int(values)


def storage(kind: str, root: Path, values_once: bool) -> Any:
    """A fresh store of `kind`."""
    if kind == "file":
        return FileStorage(root, values_once=values_once)
    return SqliteStorage(root / "runs.db", values_once=values_once)


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
        store = FileStorage(tmp, values_once=values_once)
        engine = Engine(store)
        started = time.perf_counter()
        asyncio.run(engine.run(small, steps, advisories="silent"))
        elapsed = time.perf_counter() - started
        store.close()
        return elapsed / steps * 1e6


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
    print(f"\nsmall steps on files, {args.steps} steps, {args.repeat} interleaved rounds (us per step):\n")
    rounds: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeat):
        for on in (True, False):
            rounds[on].append(step_cost(args.steps, on))
    print("| values once | min | median |")
    print("| --- | ---: | ---: |")
    for on in (True, False):
        print(f"| {'on' if on else 'off'} | {min(rounds[on]):.2f} | {statistics.median(rounds[on]):.2f} |")


if __name__ == "__main__":
    sys.exit(main())
