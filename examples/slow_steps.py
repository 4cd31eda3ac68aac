"""Slow steps: interrupt a run half way and watch it resume without redoing finished steps.

    python examples/slow_steps.py             # 10 steps of 0.5 s each
    python examples/slow_steps.py 20 0.25     # 20 steps of 0.25 s each
    durably run examples/slow_steps.py        # the same, with a live progress view

Press Ctrl-C (or `kill -9` the process) after a few steps, then run the same command
again: the steps that finished are answered from `.durably/` and are not run again;
only the interrupted step and the ones after it run.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from durably_py import run, workflow


def work(index: int, seconds: float) -> dict[str, Any]:
    """One slow unit of work."""
    time.sleep(seconds)
    return {"step": index, "done_at": time.time()}


@workflow
async def slow_steps(ctx: Any, input: dict[str, Any]) -> dict[str, Any]:
    """Run `steps` slow steps one after the other."""
    total = input["steps"]
    results = []
    for i in range(total):
        ctx.log(f"step {i + 1}/{total}: working ({ctx.run_id}, workflow attempt {ctx.attempt})")
        results.append(await ctx.step(work, i, input["seconds"], name=f"work-{i + 1}"))
    ctx.log("all steps done")
    return {"steps": len(results), "first_done_at": results[0]["done_at"] if results else None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run `argv[0]` steps (default 10) of `argv[1]` seconds (default 0.5) and print the result."""
    args = sys.argv[1:] if argv is None else argv
    steps = int(args[0]) if args else 10
    seconds = float(args[1]) if len(args) > 1 else 0.5
    result = run(slow_steps, {"steps": steps, "seconds": seconds})
    print(result)
    return result


if __name__ == "__main__":
    main()
