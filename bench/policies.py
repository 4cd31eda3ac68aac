"""Per-step overhead of step policies: `retry=Retry(3), timeout=30, schema=int` against a bare step.

Usage: python bench/policies.py [--steps N] [--rounds R]

One fresh run on FileStorage in a temporary directory alternates blocks of N bare steps and N steps with
all three policies (R blocks of each, so warm-up and drift hit both alike), timing each block from inside
the workflow body, and prints the median microseconds per step of each kind and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from typing import Any

from durably_py import Engine, FileStorage, Retry, workflow


async def noop(i: int) -> int:
    """An async step returning its argument."""
    return i


@workflow
async def mixed(ctx: Any, spec: dict[str, int]) -> dict[str, list[float]]:
    """Alternating timed blocks of bare and policy-laden steps (the timings are the result)."""
    n = spec["n"]
    times: dict[str, list[float]] = {"bare": [], "policies": []}
    for _ in range(spec["rounds"]):
        started = time.perf_counter()
        for i in range(n):
            await ctx.step(noop, i)
        times["bare"].append((time.perf_counter() - started) / n)
        started = time.perf_counter()
        for i in range(n):
            await ctx.step(noop, i, retry=Retry(3), timeout=30, schema=int)
        times["policies"].append((time.perf_counter() - started) / n)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(FileStorage(tmp))
        try:
            times = asyncio.run(engine.run(mixed, {"n": args.steps, "rounds": args.rounds}, advisories="silent"))
        finally:
            engine.executor.shutdown()
    bare = statistics.median(times["bare"]) * 1e6
    full = statistics.median(times["policies"]) * 1e6
    print(f"{args.rounds} blocks of {args.steps:,} steps each, median per step")
    print(f"{'step':<40}{'us/step':>9}")
    print(f"{'bare ctx.step(noop, i)':<40}{bare:>9.1f}")
    print(f"{'retry=Retry(3), timeout=30, schema=int':<40}{full:>9.1f}")
    print(f"policies/bare: {full / bare:.2f}x (target <= 1.5x)")


if __name__ == "__main__":
    main()
