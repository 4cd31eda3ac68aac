"""Make tests/data/sqlite_schema9.sql: a SQLite database of schema 9 with runs in every state, dumped as SQL, and
tests/data/sqlite_schema9.json: what its readers answered then. Run with a checkout of durably-py whose SQLite
adapter writes schema 9 (0.1.0 before schema 10) on the path, from that checkout's folder (its `durably list`
subprocess imports from there): ``cd <that checkout> && PYTHONPATH=. python <this checkout>/tests/data/sqlite_schema9_make.py``. `tests/test_sqlite_upgrade.py` opens the dump with the current adapter."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from durably_py import RunParkedError, SqliteStorage, create_engine, records, workflow
from durably_py.storage import sqlite as adapter

HERE = Path(__file__).parent
FAR = 50 * 365 * 86400  # the delayed run and the sleeping one stay so for the life of the fixture


def add(a: int, b: int) -> int:
    return a + b


def boom(n: int) -> int:
    raise ValueError(f"boom {n}")


@workflow(name="u9_three")
async def three(ctx: Any, n: int) -> int:
    a = await ctx.step(add, n, 1)
    b = await ctx.step(add, a, 2)
    return await ctx.step(add, b, 3)


@workflow(name="u9_fails")
async def fails(ctx: Any, n: int) -> int:
    await ctx.step(add, n, 1)
    return await ctx.step(boom, n, retry=None)


@workflow(name="u9_big")
async def big(ctx: Any, n: int) -> str:
    text = await ctx.step(lambda: "x" * 5000, name="text")  # a stored value (`valuestore`)
    return await ctx.step(lambda t: t[:10] + str(len(t)), text, name="cut")


@workflow(name="u9_waits")
async def waits(ctx: Any, n: int) -> Any:
    await ctx.step(add, n, 1)
    return await ctx.wait_for("go")


@workflow(name="u9_sleeps")
async def sleeps(ctx: Any, n: int) -> int:
    await ctx.step(add, n, 1)
    await ctx.sleep(FAR)
    return n


def readers(store: SqliteStorage) -> dict[str, Any]:
    """Every storage reader's answer for every run."""
    out: dict[str, Any] = {}
    for info in store.list_runs():
        run_id = info.run_id
        log = store.read(run_id)
        entry = store.entry(run_id)
        out[run_id] = {
            "info": [info.header, info.last, info.held, info.updated_at, info.epoch, info.state],
            "records": [r if isinstance(r, dict) else json.loads(records.encode(r)) for r in log.records]
            if log else None,
            "size": store.size(run_id),
            "inbox": store.inbox(run_id),
            "entry": None if entry is None else [entry.at, entry.priority, list(entry.wait), entry.created,
                                                 entry.queue, entry.partition],
        }
    return out


async def engine_readers(path: Path) -> dict[str, Any]:
    """`Engine.list` and `Engine.inspect` of every run: status, attempt, steps, result, error type, queue place."""
    engine = create_engine(f"sqlite:{path}")
    listed = {state.run_id: state.status for state in await engine.list()}
    out = {}
    for run_id, status in listed.items():
        state = await engine.inspect(run_id)
        out[run_id] = {"list": status, "inspect": [state.status, state.workflow, state.key, state.attempt,
                                                   [step.status for step in state.steps], state.result,
                                                   (state.error or {}).get("type"), state.queued]}
    return out


def cli_list(path: Path) -> dict[str, Any]:
    """`durably list --json` (a real process): each run's id, status, workflow and key."""
    done = subprocess.run([sys.executable, "-m", "durably_py.cli", "list", "--storage", f"sqlite:{path}", "--json"],
                          capture_output=True, text=True, check=True, env=os.environ.copy())
    return {row["run_id"]: [row.get("status"), row.get("workflow"), row.get("key")] for row in json.loads(done.stdout)}


async def fill(path: Path) -> str:
    engine = create_engine(f"sqlite:{path}")
    await engine.run(three, 1, key="done-1")
    await engine.run(three, 2, key="done-2")
    try:
        await engine.run(fails, 3, key="failed-3")
    except Exception:  # noqa: BLE001 - the run's own failure, recorded
        pass
    await engine.run(big, 4, key="big-4")
    await engine.enqueue(three, 5, key="pending-5")
    await engine.enqueue(three, 6, key="pending-6", priority=3, queue="q", partition="p1")
    await engine.enqueue(three, 7, key="later-7", delay=FAR)
    held = await engine.enqueue(three, 11, key="held-11")
    doomed = await engine.enqueue(three, 12, key="cancelled-12")
    await engine.cancel(doomed.run_id)
    for wf, n, key in ((waits, 8, "waits-8"), (sleeps, 9, "sleeps-9")):
        try:
            await engine.run(wf, n, key=key, wait=False, advisories="silent")
        except RunParkedError:
            pass
    await engine.signal((await engine.list(workflow="u9_waits"))[0].run_id, "unrelated", {"x": 1})
    return held.run_id


def main() -> None:
    assert adapter.SCHEMA_VERSION == 9, "run with a checkout whose SQLite adapter writes schema 9"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "old.db"
        held = asyncio.run(fill(path))
        store = SqliteStorage(path)
        lease = store.claim(held, "a-worker-gone", ttl=10 * 365 * 86400)  # running: its owner's lease is live
        assert lease is not None
        store.append(lease, b'{"t":"ok","p":"0","l":"add","v":12,"a":1,"ms":0.01,"ts":1735689601.0}\n')
        answers = {"storage": readers(store), "engine": asyncio.run(engine_readers(path)), "cli": cli_list(path)}
        store.close()
        db = sqlite3.connect(path)
        assert db.execute("PRAGMA user_version").fetchone()[0] == 9
        dump = "\n".join(db.iterdump())
        db.close()
    (HERE / "sqlite_schema9.sql").write_text("PRAGMA user_version=9;\n" + dump + "\n")
    (HERE / "sqlite_schema9.json").write_text(json.dumps(answers, indent=1, sort_keys=True, default=str) + "\n")
    print(f"{len(answers['storage'])} runs", file=sys.stderr)


if __name__ == "__main__":
    main()
