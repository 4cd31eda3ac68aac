"""Workflows whose values repeat and grow (values stored once): imported by tests/test_value_store.py and run as
a real process (`python value_flows.py STORAGE_URL CALLS_FILE TURNS`) by its kill tests."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
from typing import Any

from durably_py import Engine, attempt, workflow
from durably_py.storage.url import open_storage

BIG = {"text": "lorem ipsum dolor sit amet " * 24, "n": 0}  # about 700 bytes of JSON


def message(turn: int) -> dict[str, str]:
    """The assistant message of `turn`: about 1 KiB of text no other turn has."""
    words = []
    seed = hashlib.sha256(str(turn).encode()).hexdigest()
    while sum(len(w) + 1 for w in words) < 1000:
        seed = hashlib.sha256(seed.encode()).hexdigest()
        words.append(seed[: 4 + int(seed[0], 16) % 7])
    return {"role": "assistant", "content": f"turn {turn}: " + " ".join(words)}


def conversation(turns: int) -> dict[str, Any]:
    """The conversation after `turns` turns."""
    return {"messages": [message(turn) for turn in range(turns)]}


CALLS = os.environ.get("VALUE_FLOWS_CALLS")


def model(conv: dict[str, Any], turn: int) -> dict[str, Any]:
    """A stand-in for a model call: the whole conversation with the next message appended (each call noted in
    the file $VALUE_FLOWS_CALLS names, when set, and slowed down so a test can kill it part way)."""
    if CALLS:
        with open(CALLS, "a") as f:
            f.write(f"{turn}\n")
        time.sleep(0.01)
    return {"messages": [*conv["messages"], message(turn)]}


@workflow(name="agent_loop")
async def agent(ctx: Any, turns: int) -> dict[str, Any]:
    """An agent loop: every turn's step takes and returns the whole, growing conversation."""
    conv: dict[str, Any] = {"messages": []}
    for turn in range(turns):
        conv = await ctx.step(model, conv, turn, name="model")
    return conv


def big_list(n: int) -> list[dict[str, Any]]:
    """A long list of large values, three distinct ones repeated."""
    return [dict(BIG, n=i % 3) for i in range(n)]


def echo(value: Any) -> Any:
    return value


def stashing(value: Any) -> str:
    """A step that stashes a large value before it returns."""
    attempt().stash(value)
    return "stashed"


@workflow(name="values_everywhere")
async def everywhere(ctx: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Large and repeated values in a step's output, a stash, an unsafe step's start input, loop snapshots, a
    user dict that looks like a reference, and the run's result."""
    items = await ctx.step(big_list, spec["n"], name="list")
    wrapped = await ctx.step(echo, {"items": items, "note": "n" * 500}, name="echo")
    stashed = await ctx.step(stashing, items[:4], name="stash")
    unsafe = await ctx.step(echo, items[:6], name="unsafe", replay="unsafe")

    def grow(state: dict[str, Any], it: Any) -> Any:
        if it.number == 6:
            return it.done(state)
        return {"log": [*state["log"], message(100 + it.number)]}

    looped = await ctx.loop({"log": []}, grow, snapshot_every=1)
    user = await ctx.step(echo, spec["user"], name="user")
    return {"items": items, "wrapped": wrapped, "stashed": stashed, "unsafe": unsafe, "loop": looped, "user": user}


if __name__ == "__main__":
    url, turns = sys.argv[1], int(sys.argv[2])
    engine = Engine(open_storage(url), lease=2.0)  # a killed holder's time lease (SQL stores) lapses soon
    result = asyncio.run(engine.run(agent, turns, key="agent", advisories="silent"))
    print(json.dumps({"messages": len(result["messages"]), "equal": result == conversation(turns)}))
