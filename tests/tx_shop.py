"""The shop of tests/test_transactions.py: orders placed by transactional steps, run as a script (or by a
`durably worker --import`) that the test SIGKILLs at seeded points and runs again.

``python tx_shop.py KEY STEPS`` runs workflow `orders` (STEPS transactional steps, each taking one widget from
`inventory` and adding an `orders` row keyed by its operation id, even steps `def`, odd ones `async def`) on
$DURABLY_STORAGE and prints its result as one JSON line. $TX_DB names the application's tables: ``sqlite:PATH``
(the storage's own file) or ``postgresql:SCHEMA:DSN`` (a schema of the storage's database). Kill points, each
announced on stderr for the test to SIGKILL the process there: $TX_SLEEP_AT=i makes step i sleep inside its
transaction after its writes ("inside i"); $TX_PAUSE_AFTER=i makes the workflow sleep right after step i
committed ("committed i").
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

from durably_py import attempt, run, workflow

DB = os.environ.get("TX_DB", "")
SLEEP_AT = int(os.environ.get("TX_SLEEP_AT", "-1"))
PAUSE_AFTER = int(os.environ.get("TX_PAUSE_AFTER", "-1"))
STOCK = 100_000


def tables() -> tuple[str, str, str]:
    """The inventory and orders tables as the steps name them, and the parameter mark."""
    if DB.startswith("postgresql:"):
        schema = DB.split(":", 2)[1]
        return f"{schema}.inventory", f"{schema}.orders", "%s"
    return "inventory", "orders", "?"


def connect() -> Any:
    """A connection of the application's own (setup and checks), autocommitting."""
    if DB.startswith("postgresql:"):
        import psycopg

        return psycopg.connect(DB.split(":", 2)[2], autocommit=True)
    import sqlite3

    return sqlite3.connect(DB.split(":", 1)[1], timeout=30, isolation_level=None)


def setup() -> None:
    """Create the application's tables (once)."""
    inventory, orders, _ = tables()
    conn = connect()
    try:
        if DB.startswith("postgresql:"):
            conn.execute(f"CREATE SCHEMA IF NOT EXISTS {inventory.split('.')[0]}")
            conn.execute(f"CREATE TABLE IF NOT EXISTS {orders} (id BIGSERIAL PRIMARY KEY, op TEXT NOT NULL, "
                         "step INT NOT NULL)")
        else:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"CREATE TABLE IF NOT EXISTS {orders} (id INTEGER PRIMARY KEY AUTOINCREMENT, "
                         "op TEXT NOT NULL, step INT NOT NULL)")
        conn.execute(f"CREATE TABLE IF NOT EXISTS {inventory} (sku TEXT PRIMARY KEY, n INT NOT NULL)")
        if conn.execute(f"SELECT count(*) FROM {inventory}").fetchone()[0] == 0:
            conn.execute(f"INSERT INTO {inventory} (sku, n) VALUES ('widget', {STOCK})")
    finally:
        conn.close()


def state() -> tuple[int, list[str]]:
    """What the application holds: widgets left, and the operation id of every order row (repeats included)."""
    inventory, orders, _ = tables()
    conn = connect()
    try:
        left = conn.execute(f"SELECT n FROM {inventory} WHERE sku = 'widget'").fetchone()[0]
        ops = [row[0] for row in conn.execute(f"SELECT op FROM {orders} ORDER BY id").fetchall()]
    finally:
        conn.close()
    return left, ops


def take(conn: Any, step: int) -> int:
    inventory, orders, mark = tables()
    conn.execute(f"UPDATE {inventory} SET n = n - 1 WHERE sku = 'widget'")
    conn.execute(f"INSERT INTO {orders} (op, step) VALUES ({mark}, {mark})", (attempt().operation_id, step))
    time.sleep(0.01)  # a step takes a moment: a kill at a random moment may land inside one
    if step == SLEEP_AT:
        print(f"inside {step}", file=sys.stderr, flush=True)
        time.sleep(60)
    return int(conn.execute(f"SELECT n FROM {inventory} WHERE sku = 'widget'").fetchone()[0])


async def take_async(conn: Any, step: int) -> int:
    await asyncio.sleep(0)
    return take(conn, step)


@workflow
async def orders(ctx: Any, steps: int) -> list[int]:
    left = []
    for step in range(steps):
        left.append(await ctx.transaction(take_async if step % 2 else take, step, name="take"))
        if step == PAUSE_AFTER:
            print(f"committed {step}", file=sys.stderr, flush=True)
            time.sleep(60)
    return left


if __name__ == "__main__":
    print(json.dumps(run(orders, int(sys.argv[2]), key=sys.argv[1])), flush=True)
