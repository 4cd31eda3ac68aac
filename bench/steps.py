"""Per-step cost of durable steps on FileStorage, as ratios to floors measured in the same process.

Usage: python bench/steps.py [--steps N] [--repeat R] [--profile fresh|sync|replay]

Every measurement runs R times, interleaved (one of each per round, so a burst of load on a shared
machine hits every row alike); the table reports the min and the median of the rounds.

Floors:
  raw append    json.dumps of an `ok`-like record + f.write + f.flush per step (append-mode file)
  raw fsync     the same, plus os.fsync per step
  replay floor  msgspec-decode an N-record log + await one trivial coroutine per step
  loop floor    resuming a loop of 100 iterations (the tail after its latest snapshot)
Rows:
  fresh async / fresh def       a new N-step sequential run of `async def` / `def` no-op steps
  replay async / replay def     the same run resumed after it stopped right after its last step
  fsync async / fsync def       a fresh run with checkpoint_every=1 (an fsync per step), N/10 steps
  loop resume 1k / 10k          resuming a loop (one step per iteration, snapshot every 100) stopped
                                50 iterations after its latest snapshot, against the loop floor
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

import msgspec

from durably_py import Engine, FileStorage, workflow


class Stop(Exception):
    """Raised by the workflow after its last step while `STOP` is set, so the run ends before completing."""


STOP = False


async def noop(i: int) -> dict[str, int]:
    """An async step that does nothing but return a small dict."""
    return {"i": i}


def noop_sync(i: int) -> dict[str, int]:
    """The same step as a plain function."""
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


@workflow
async def looping(ctx: Any, n: int) -> int:
    """A loop of one step per iteration, snapshot every 100; stops after `n` iterations while `STOP` is set."""

    async def turn(total: int, it: Any) -> Any:
        if it.number == n:
            if STOP:
                raise Stop()
            return it.done(total)
        return total + (await it.step(noop, it.number))["i"]

    return await ctx.loop(0, turn, snapshot_every=100)


# ---- floors ------------------------------------------------------------------------------------
def record(i: int) -> dict[str, Any]:
    return {"t": "ok", "p": str(i), "l": "noop", "v": {"i": i}, "a": 1, "ms": 0.004, "ts": time.time()}


def raw(n: int, fsync: bool = False) -> float:
    """Seconds to encode and append-and-flush (and fsync) `n` step-like records to a plain file."""
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "raw.jsonl", "a") as f:
        started = time.perf_counter()
        for i in range(n):
            f.write(json.dumps(record(i), separators=(",", ":")) + "\n")
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        return time.perf_counter() - started


async def trivial(value: Any) -> Any:
    return value


def replay_floor(n: int) -> float:
    """Seconds to read and msgspec-decode an `n`-record log and await one trivial coroutine per record."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "log.jsonl"
        path.write_bytes(b"".join(msgspec.json.encode(record(i)) + b"\n" for i in range(n)))

        async def main() -> int:
            records = msgspec.json.decode(b"[" + path.read_bytes().rstrip(b"\n").replace(b"\n", b",") + b"]")
            total = 0
            for rec in records:
                total += (await trivial(rec["v"]))["i"]
            return total

        started = time.perf_counter()
        asyncio.run(main())
        return time.perf_counter() - started


# ---- durably -----------------------------------------------------------------------------------
def engine_run(directory: str, wf: Any, value: Any, checkpoint_every: int | None = None) -> Any:
    """One `Engine.run` of `wf` on FileStorage at `directory`."""
    engine = Engine(FileStorage(directory), checkpoint_every=checkpoint_every)
    try:
        return asyncio.run(engine.run(wf, value, advisories="silent"))
    finally:
        engine.executor.shutdown()


def fresh(n: int, sync: bool = False, checkpoint_every: int | None = None) -> float:
    """Seconds for a fresh run of `n` steps."""
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        result = engine_run(tmp, many, {"n": n, "sync": sync}, checkpoint_every)
        elapsed = time.perf_counter() - started
    assert result == n * (n - 1) // 2
    return elapsed


def resumed(wf: Any, value: Any, expected: Any, profile: cProfile.Profile | None = None) -> float:
    """Seconds for the run of `wf` that resumes after a first one stopped (raised `Stop`) and completes."""
    global STOP
    with tempfile.TemporaryDirectory() as tmp:
        STOP = True
        try:
            engine_run(tmp, wf, value)
        except Stop:
            pass
        finally:
            STOP = False
        if profile is not None:
            profile.enable()
        started = time.perf_counter()
        result = engine_run(tmp, wf, value)
        elapsed = time.perf_counter() - started
        if profile is not None:
            profile.disable()
    assert result == expected, result
    return elapsed


def replay(n: int, sync: bool = False, profile: cProfile.Profile | None = None) -> float:
    """Seconds for the resumed run that replays all `n` recorded steps and completes."""
    return resumed(many, {"n": n, "sync": sync}, n * (n - 1) // 2, profile)


def loop_resume(iterations: int) -> float:
    """Seconds to resume a loop stopped 50 iterations after its latest snapshot, `iterations` in."""
    n = iterations + 50
    return resumed(looping, n, n * (n - 1) // 2)


# ---- report ------------------------------------------------------------------------------------
def profile(which: str, n: int) -> None:
    """Print the top functions (by own time) of one fresh or replaying run."""
    prof = cProfile.Profile()
    if which in ("fresh", "sync"):
        prof.enable()
        fresh(n, sync=which == "sync")
        prof.disable()
    else:
        replay(n, profile=prof)
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile", choices=("fresh", "sync", "replay"))
    args = parser.parse_args()
    n, repeat = args.steps, args.repeat
    if args.profile:
        profile(args.profile, n)
        return
    few = max(n // 10, 1)
    # name -> (measure, steps it covers, floor name, target ratio or None)
    rows: dict[str, tuple[Callable[[], float], int, str | None, float | None]] = {
        "raw append": (lambda: raw(n), n, None, None),
        "raw fsync": (lambda: raw(few, fsync=True), few, None, None),
        "replay floor": (lambda: replay_floor(n), n, None, None),
        "loop floor (100 it.)": (lambda: loop_resume(100), 1, None, None),
        "fresh async": (lambda: fresh(n), n, "raw append", 2.0),
        "fresh def": (lambda: fresh(n, sync=True), n, "raw append", 2.0),
        "replay async": (lambda: replay(n), n, "replay floor", 1.5),
        "replay def": (lambda: replay(n, sync=True), n, "replay floor", 1.5),
        "fsync async": (lambda: fresh(few, checkpoint_every=1), few, "raw fsync", None),
        "fsync def": (lambda: fresh(few, sync=True, checkpoint_every=1), few, "raw fsync", None),
        "loop resume 1k": (lambda: loop_resume(1_000), 1, "loop floor (100 it.)", 1.5),
        "loop resume 10k": (lambda: loop_resume(10_000), 1, "loop floor (100 it.)", 1.5),
    }
    fresh(200)
    fresh(200, sync=True)
    replay(200)
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repeat):
        for name, (measure, _, _, _) in rows.items():
            times[name].append(measure())
    per: dict[str, tuple[float, float]] = {}
    for name, (_, steps, _, _) in rows.items():
        per[name] = (min(times[name]) / steps, statistics.median(times[name]) / steps)
    print(f"{n:,} steps ({few:,} with fsync), {repeat} interleaved rounds, Python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs; us per step (per resume for loops)")
    print(f"{'measurement':<22}{'min us':>10}{'median us':>11}  {'floor':<22}{'x floor':>8}{'(min)':>7}  target")
    for name, (_, _, floor, target) in rows.items():
        lo, mid = per[name]
        line = f"{name:<22}{lo * 1e6:>10.2f}{mid * 1e6:>11.2f}  "
        if floor is not None:
            ratio, ratio_min = mid / per[floor][1], lo / per[floor][0]
            verdict = "" if target is None else f"<= {target:g}x: {'met' if ratio <= target else 'not met'}"
            line += f"{floor:<22}{ratio:>8.2f}{ratio_min:>7.2f}  {verdict}"
        print(line)


if __name__ == "__main__":
    main()
