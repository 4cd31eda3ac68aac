"""The widget store of tests/test_idempotency.py, run as a script that the test SIGKILLs and runs again.

``python idem_shop.py STATE_DIR DB MODE [KILL_AT] [FLAG]`` runs one order on FileStorage under STATE_DIR and prints
the workflow's result as one JSON line. DB is a SQLite file path, or ``postgresql:SCHEMA:DSN``. MODE is ``once``
(the step guards its write with `durably_py.once`), ``once-async`` (the same from an `async def` step) or ``plain``
(no guard). With KILL_AT (``before-commit`` or ``after-commit``) the step writes FLAG when it gets there and sleeps
for the test to SIGKILL it: inside the transaction before it commits, or after the commit and before the step
returns (so its outcome is not in the run's log yet).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import durably_py
from durably_py import run, workflow

STATE, DB, MODE = sys.argv[1], sys.argv[2], sys.argv[3]
KILL_AT = sys.argv[4] if len(sys.argv) > 4 else ""
FLAG = sys.argv[5] if len(sys.argv) > 5 else ""


def connect() -> Any:
    if DB.startswith("postgresql:"):
        import psycopg

        _, schema, dsn = DB.split(":", 2)
        return psycopg.connect(dsn, options=f"-c search_path={schema}")
    import sqlite3

    return sqlite3.connect(DB, timeout=30)


def stop_here(point: str) -> None:
    """Where the test kills this process: tell it, then wait for the signal."""
    if KILL_AT == point:
        Path(FLAG).write_text(point)
        time.sleep(120)
        raise SystemExit("not killed")


def mark(conn: Any) -> str:
    return "?" if type(conn).__module__.startswith("sqlite3") else "%s"


def ship(order: dict[str, Any]) -> dict[str, Any]:
    conn = connect()
    try:
        if MODE == "plain":
            with conn:  # sqlite3 and psycopg alike: one transaction, committed at the end of the block
                conn.execute(f"UPDATE inventory SET n = n - 1 WHERE sku = {mark(conn)}", (order["sku"],))
                stop_here("before-commit")
            result = {"shipped": order["id"], "by": os.getpid()}
        else:
            with durably_py.once(conn) as op:
                if op.done:
                    return dict(op.result)
                conn.execute(f"UPDATE inventory SET n = n - 1 WHERE sku = {mark(conn)}", (order["sku"],))
                result = op.record({"shipped": order["id"], "by": os.getpid()})
                stop_here("before-commit")
        stop_here("after-commit")
        return result
    finally:
        conn.close()


async def ship_async(order: dict[str, Any]) -> dict[str, Any]:
    return ship(order)


@workflow
async def place_order(ctx: Any, order: dict[str, Any]) -> dict[str, Any]:
    shipped = await ctx.step(ship_async if MODE == "once-async" else ship, order, name="ship")
    await ctx.step(lambda: None, name="receipt")
    return shipped


if __name__ == "__main__":
    order = {"id": Path(STATE).name, "sku": Path(STATE).name}
    print(json.dumps(run(place_order, order, dir=STATE)), flush=True)
