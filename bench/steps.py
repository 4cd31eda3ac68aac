"""Per-step cost of durable steps on FileStorage, against a raw JSON-lines append loop.

Usage: python bench/steps.py [--steps N] [--repeat R] [--profile fresh|replay]

Measures, each R times (median reported), on a temporary directory:
  raw       json.dumps of an `ok`-like record + f.write + f.flush per step (append-mode file)
  fresh     a fresh run of an N-step sequential workflow of async no-op steps
  replay    the same run resumed after it stopped right after its last step: all N steps answered from the log
  sync      a fresh run whose steps are plain (sync) functions, each run on the engine's thread pool
  fsync     a fresh run with checkpoint_every=1 (one fsync per step)
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from durably_py import Engine, FileStorage, workflow


class Stop(Exception):
    """Raised by the workflow after its last step while `STOP` is set, so the run ends before completing."""


STOP = False


async def noop(i: int) -> dict[str, int]:
    """An async step that does nothing but return a small dict."""
    return {"i": i}


def noop_sync(i: int) -> dict[str, int]:
    """The same step as a plain function (runs on the engine's executor)."""
    return {"i": i}


@workflow
async def many(ctx: Any, spec: dict[str, Any]) -> int:
    """N sequential steps; raises `Stop` after the last one while `STOP` is set."""
    fn = noop_sync if spec["sync"] else noop
    total = 0
    for i in range(spec["n"]):
        total += (await ctx.step(fn, i))["i"]
    if STOP:
        raise Stop()
    return total


def raw(n: int) -> float:
    """Seconds to encode and append-and-flush `n` step-like records to a plain file."""
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "raw.jsonl", "a") as f:
        started = time.perf_counter()
        for i in range(n):
            rec = {"t": "ok", "p": str(i), "l": "noop", "v": {"i": i}, "a": 1, "ms": 0.004, "ts": time.time()}
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            f.flush()
        return time.perf_counter() - started


def engine_run(directory: str, spec: dict[str, Any], checkpoint_every: int | None = None) -> Any:
    """One `Engine.run` of `many` on FileStorage at `directory`."""
    engine = Engine(FileStorage(directory), checkpoint_every=checkpoint_every)
    try:
        return asyncio.run(engine.run(many, spec, advisories="silent"))
    finally:
        engine.executor.shutdown()


def fresh(n: int, sync: bool = False, checkpoint_every: int | None = None) -> float:
    """Seconds for a fresh run of `n` steps."""
    spec = {"n": n, "sync": sync}
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        result = engine_run(tmp, spec, checkpoint_every)
        elapsed = time.perf_counter() - started
    assert result == n * (n - 1) // 2
    return elapsed


def replay(n: int, profile: cProfile.Profile | None = None) -> float:
    """Seconds for the resumed run that replays all `n` recorded steps and completes."""
    global STOP
    spec = {"n": n, "sync": False}
    with tempfile.TemporaryDirectory() as tmp:
        STOP = True
        try:
            engine_run(tmp, spec)
        except Stop:
            pass
        finally:
            STOP = False
        if profile is not None:
            profile.enable()
        started = time.perf_counter()
        result = engine_run(tmp, spec)
        elapsed = time.perf_counter() - started
        if profile is not None:
            profile.disable()
    assert result == n * (n - 1) // 2
    return elapsed


def median(fn: Callable[[], float], repeat: int) -> float:
    """Median seconds of `repeat` calls."""
    return statistics.median(fn() for _ in range(repeat))


def profile(which: str, n: int) -> None:
    """Print the top functions (by own time) of one fresh or replaying run."""
    prof = cProfile.Profile()
    if which == "fresh":
        prof.enable()
        fresh(n)
        prof.disable()
    else:
        replay(n, prof)
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile", choices=("fresh", "replay"))
    args = parser.parse_args()
    n, repeat = args.steps, args.repeat
    if args.profile:
        profile(args.profile, n)
        return
    fresh(200)
    replay(200)
    rows = [
        ("raw append+flush", median(lambda: raw(n), repeat)),
        ("fresh run (async steps)", median(lambda: fresh(n), repeat)),
        ("replay (all steps recorded)", median(lambda: replay(n), repeat)),
        ("fresh run (sync steps)", median(lambda: fresh(n, sync=True), repeat)),
        ("fresh run, checkpoint_every=1", median(lambda: fresh(n, checkpoint_every=1), repeat)),
    ]
    base = rows[0][1]
    print(f"{n:,} sequential steps, median of {repeat}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print(f"{'measurement':<32}{'seconds':>9}{'steps/s':>11}{'us/step':>9}{'x raw':>7}")
    for name, secs in rows:
        print(f"{name:<32}{secs:>9.3f}{n / secs:>11,.0f}{secs / n * 1e6:>9.1f}{secs / base:>7.2f}")
    fresh_s, replay_s = rows[1][1], rows[2][1]
    print(f"ours/raw per step: {fresh_s / base:.2f}x (target <= 3x)")
    print(f"replay/fresh time: {replay_s / fresh_s:.1%} (target <= 10%)")


if __name__ == "__main__":
    main()
