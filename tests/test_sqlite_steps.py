"""SQLite's step path and its fleet: a step is the fenced insert of its records alone, so the readers of an open
run (info, list, inspect, `durably list`, size) take its last record and size from the records; a process
SIGKILLed between steps leaves a log they read right and a run that resumes; due runs are found by walking the
queue's index (no sort of the backlog, nor of every run of a workflow, under the write lock); and processes
sharing the file wait for each other at the write gate, never longer than the storage's timeout, a gate no other
process takes going off again."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from durably_py import SqliteStorage, StorageBusyError, create_engine, workflow
from durably_py.storage.sqlite import SPAN
from durably_py.storage.sqlitegate import QUIET, WAITED, WriteGate
from tests.helpers import wait_until

OF_RUN = f"records.seq BETWEEN runs.num * {SPAN} AND runs.num * {SPAN} + {SPAN - 1}"  # a run's records (schema 10)

CHILD = '''
import asyncio, sys
from durably_py import create_engine, workflow


def add(i):
    return i


@workflow(name="counter")
async def counter(ctx, n):
    total = 0
    for i in range(n):
        total += await ctx.step(add, i, name=f"s{i}")
    return total


engine = create_engine(f"sqlite:{sys.argv[1]}", lease=2.0)
print(asyncio.run(engine.run(counter, int(sys.argv[2]), key="k")), flush=True)
'''


def add(i: int) -> int:
    return i


@workflow(name="counter")
async def counter(ctx: Any, n: int) -> int:
    total = 0
    for i in range(n):
        total += await ctx.step(add, i, name=f"s{i}")
    return total


def _log_bytes(store: SqliteStorage, run_id: str) -> bytes:
    rows = store._db().execute(f"SELECT records.data FROM runs JOIN records ON {OF_RUN} WHERE runs.run_id = ?"
                               " ORDER BY records.seq", (run_id,)).fetchall()
    return b"".join(bytes(row[0]) for row in rows)


def _steps(store: SqliteStorage, run_id: str) -> int:
    return int(store._db().execute(f"SELECT count(*) FROM runs JOIN records ON {OF_RUN} WHERE runs.run_id = ?",
                                   (run_id,)).fetchone()[0])


def _check_readers(store: SqliteStorage, run_id: str) -> dict[str, Any]:
    """Every reader of the open run agrees with its log: the last record, the size, the listing."""
    log = store.read(run_id)
    assert log is not None and log.torn is None
    last = log.records[-1]
    info = store.info(run_id)
    assert info is not None and info.state == "open"
    assert info.last == json.loads(_log_bytes(store, run_id).splitlines()[-1])
    assert info.kind == (last.get("t") if isinstance(last, dict) else type(last).__struct_config__.tag)
    assert store.size(run_id) == len(_log_bytes(store, run_id))
    listed = {found.run_id: found for found in store.list_runs()}
    assert listed[run_id].last == info.last
    return info.last


def test_readers_of_an_open_run_follow_its_steps_and_its_end(tmp_path: Path) -> None:
    store = SqliteStorage(tmp_path / "runs.db")
    store.create("r", b'{"t":"run","v":1,"run_id":"r","workflow":"w","input":1}\n')
    lease = store.claim("r", "me", 30)
    assert lease is not None
    before = store.info("r")
    assert before is not None and before.kind == "claim"
    ts = round(time.time() + 5, 3)  # a step recorded later than the claim: the run's time follows it
    for i in range(3):
        store.append(lease, b'{"t":"ok","p":"%d","l":"add","v":%d,"a":1,"ms":0.01,"ts":%r}\n' % (i, i, ts))
        assert _check_readers(store, "r") == {"t": "ok", "p": str(i), "l": "add", "v": i, "a": 1, "ms": 0.01,
                                              "ts": ts}
    info = store.info("r")
    assert info is not None and info.updated_at == pytest.approx(ts)
    two = b'{"t":"ok","p":"3","l":"add","v":3,"a":1,"ms":0.01}\n{"t":"ok","p":"4","l":"add","v":4,"a":1,"ms":0.01}\n'
    store.append(lease, two)  # several lines in one append: the last of them
    assert _check_readers(store, "r")["p"] == "4"
    store.sync(lease)  # the change detector is the latest append, not the row's size
    fsyncs = store.fsyncs
    store.sync(lease)
    assert store.fsyncs == fsyncs
    store.append(lease, b'{"t":"ok","p":"5","l":"add","v":5,"a":1,"ms":0.01}\n')
    store.sync(lease)
    assert store.fsyncs == fsyncs + 1
    store.append(lease, b'{"t":"end","status":"completed","result":10,"error":null}\n')
    ended = store.info("r")
    assert ended is not None and ended.ended and ended.state == "completed"
    assert store.size("r") == len(_log_bytes(store, "r"))  # the row, written at the end, holds the whole size
    assert store._db().execute("SELECT size FROM runs WHERE run_id = 'r'").fetchone()[0] == store.size("r")
    assert store.list_runs(state="completed")[0].run_id == "r"


def test_a_sigkill_between_steps_leaves_a_log_every_reader_reads_right(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    engine = create_engine(f"sqlite:{db}", lease=2.0)
    store = engine.storage
    assert isinstance(store, SqliteStorage)
    counts = []
    for kill in range(3):
        proc = subprocess.Popen([sys.executable, str(script), str(db), "3000"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        try:
            seen = _steps(store, store.list_runs()[0].run_id) if store.list_runs() else 0
            wait_until(lambda seen=seen: bool(store.list_runs()) and _steps(store, store.list_runs()[0].run_id)
                       > seen + 20, seconds=60, every=0.005)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait()
        run_id = store.list_runs()[0].run_id
        last = _check_readers(store, run_id)
        counts.append(_steps(store, run_id))
        assert last["t"] in ("ok", "claim"), last
        state = asyncio.run(engine.inspect(run_id))
        assert state.status not in ("completed", "failed", "cancelled")
        shown = subprocess.run([sys.executable, "-m", "durably_py.cli", "list", "--storage", f"sqlite:{db}"],
                               capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0 and run_id[:8] in shown.stdout, shown.stdout + shown.stderr
        print(f"kill {kill}: SIGKILLed after {counts[-1]} appends; last record {last.get('t')} {last.get('p')}")
    assert counts == sorted(counts)
    wait_until(lambda: store.lease_of(run_id) is None, seconds=30)
    assert asyncio.run(engine.run(counter, 3000, key="k")) == sum(range(3000))
    log = store.read(run_id)
    assert log is not None
    done = [r for r in log.records if type(r).__name__ == "Ok"]
    assert len(done) == 3000  # each step recorded once: the one cut off by a kill was not recorded
    info = store.info(run_id)
    assert info is not None and info.ended and store.size(run_id) == len(_log_bytes(store, run_id))


def test_due_runs_of_a_batch_come_in_order_from_the_queue_index(tmp_path: Path) -> None:
    store = SqliteStorage(tmp_path / "runs.db")
    engine = create_engine(store)
    handles = asyncio.run(engine.enqueue_many([(counter, 1, f"k{i}") for i in range(300)]))
    ids = [h.run_id for h in handles]
    db = store._db()
    for names in (None, frozenset({"counter"})):
        from durably_py.storage.sqlite import _kept

        where, params = _kept(time.time(), (), names, None, frozenset())
        plan = " ".join(row[3] for row in db.execute(
            "EXPLAIN QUERY PLAN SELECT q.run_id FROM queue q JOIN runs r ON r.run_id = q.run_id WHERE "
            f"{where} ORDER BY q.priority DESC, q.due, q.created, q.run_id LIMIT 8", params))
        assert "queue_due" in plan and "TEMP B-TREE" not in plan, plan
    first = store.due(8, workflows={"counter"})
    assert first == sorted(ids)[:8]  # one batch: equal due and created times, then the run id
    leases = store.claim_due("me", 30, 5, workflows={"counter"})
    assert [lease.run_id for lease in leases] == sorted(ids)[:5]
    assert store.due(3, workflows={"counter"}) == sorted(ids)[5:8]


def test_a_held_write_gate_is_waited_for_no_longer_than_the_timeout(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    store = SqliteStorage(db, timeout=0.3)
    store.create("r", b'{"t":"run","v":1,"run_id":"r","workflow":"w"}\n')
    store._gate.on = True  # type: ignore[union-attr]  # as after a write that waited for another process
    fd = os.open(f"{db}.gate", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process stopped inside its write
        began = time.monotonic()
        with pytest.raises(StorageBusyError) as info:
            store.claim("r", "me", 30)
        assert 0.25 < time.monotonic() - began < 3 and info.value.hint
    finally:
        os.close(fd)
    lease = store.claim("r", "me", 30)
    assert lease is not None
    store.append(lease, b'{"t":"ok","p":"0","l":"add","v":0,"a":1,"ms":0.01}\n')
    assert store.info("r").kind == "ok"  # type: ignore[union-attr]


FLEET = '''
import sys
from durably_py import SqliteStorage

store = SqliteStorage(sys.argv[1])
name = sys.argv[2]
for n in range(int(sys.argv[3])):
    run_id = f"{name}-{n}"
    store.create(run_id, b'{"t":"run","v":1,"run_id":"%s","workflow":"w"}\\n' % run_id.encode())
    lease = store.claim(run_id, name, 30)
    for i in range(3):
        store.append(lease, b'{"t":"ok","p":"%d","l":"add","v":%d,"a":1,"ms":0.01}\\n' % (i, i))
    store.finish_all([lease])
print("gate on" if store._gate.on else "gate off", flush=True)
'''


def test_processes_writing_one_file_at_once_lose_nothing_and_take_the_gate(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    SqliteStorage(db).close()
    script = tmp_path / "fleet.py"
    script.write_text(FLEET)
    procs = [subprocess.Popen([sys.executable, str(script), str(db), f"p{i}", "300"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(3)]
    outs = [proc.communicate(timeout=180) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outs
    print("gates:", [out.strip() for out, _ in outs])
    store = SqliteStorage(db)
    runs = store.list_runs()
    assert len(runs) == 900
    for found in runs:
        assert found.last.get("p") == "2" and found.state == "open" and not found.held
        assert store.size(found.run_id) == len(_log_bytes(store, found.run_id))


def test_a_write_gate_no_other_process_takes_goes_off_again(tmp_path: Path) -> None:
    """A write that waited turns the gate on; entries that always find it free (no other process takes it, as after
    a write that was merely slow on a busy machine) turn it off again, so steps stop paying its two flocks; one
    entry that found it held starts the count again."""
    gate = WriteGate(str(tmp_path / "runs.db.gate"), timeout=5.0)
    gate.took(time.perf_counter() - 2 * WAITED)  # as after a write that waited 2 ms
    assert gate.on
    for _ in range(QUIET - 1):
        assert gate.enter()
        gate.leave()
    fd = os.open(gate.path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process inside its write, out again soon
        threading.Timer(0.02, fcntl.flock, (fd, fcntl.LOCK_UN)).start()
        assert gate.enter()  # waited for it
        gate.leave()
    finally:
        os.close(fd)
    for _ in range(QUIET - 1):
        assert gate.enter()
        gate.leave()
    assert gate.on  # the count began again at the entry that waited
    assert gate.enter()
    gate.leave()
    assert not gate.on and not gate.enter()  # off: no flock until a write waits again
    gate.took(time.perf_counter() - 2 * WAITED)
    assert gate.on and gate.enter()
    gate.leave()
    gate.close()


def test_the_write_gate_stays_on_while_another_connection_commits(tmp_path: Path) -> None:
    """Steps that always find the gate free turn it off only when no other connection committed meanwhile: a
    writer that never takes the gate (a `sqlite3` shell, an application's own connection) keeps it on."""
    db = tmp_path / "runs.db"
    store = SqliteStorage(db)
    store.create("r", b'{"t":"run","v":1,"run_id":"r","workflow":"w"}\n')
    lease = store.claim("r", "me", 30)
    assert lease is not None
    gate = store._gate  # type: ignore[union-attr]
    assert gate is not None and not gate.on
    gate.took(time.perf_counter() - 2 * WAITED)  # as after a write that waited 2 ms
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("CREATE TABLE app (n INTEGER)")
    for i in range(3 * QUIET):
        store.append(lease, b'{"t":"ok","p":"%d","l":"add","v":%d,"a":1,"ms":0.01}\n' % (i, i))
        if i % 100 == 0:
            other.execute("INSERT INTO app VALUES (?)", (i,))
    assert gate.on
    for i in range(3 * QUIET, 4 * QUIET + 1):
        store.append(lease, b'{"t":"ok","p":"%d","l":"add","v":%d,"a":1,"ms":0.01}\n' % (i, i))
    assert not gate.on  # alone again: steps no longer pay the gate
    other.close()
    assert len(store.read("r").records) == 2 + 4 * QUIET + 1  # type: ignore[union-attr]
    store.close()
