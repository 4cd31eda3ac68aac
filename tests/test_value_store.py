"""Values stored once: large and repeated values of a run's records kept once per run, content-addressed, and
resolved by every reader (replay, `read`, `info`, export, inspect, logs, forks, the console), on every adapter."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import msgspec
import pytest
import value_flows as flows
from helpers import durably, storage_of, storage_url, wait_until

from durably_py import CorruptLogError, Engine, FileStorage, SqliteStorage
from durably_py.storage import valuestore
from durably_py.storage.url import open_storage

FLOWS = Path(flows.__file__)
TEXT_DIGEST = hashlib.sha256(msgspec.json.encode(flows.BIG["text"])).hexdigest()
USER = {"$blob": TEXT_DIGEST}  # user data spelled like a reference to a value the run really stores


def expected(n: int) -> dict[str, Any]:
    items = flows.big_list(n)
    return {"items": items, "wrapped": {"items": items, "note": "n" * 500}, "stashed": "stashed",
            "unsafe": items[:6], "loop": {"log": [flows.message(100 + i) for i in range(6)]}, "user": USER}


def stored_bytes(storage: Any, run_id: str) -> tuple[int, int]:
    """(log bytes, stored-value bytes) of a run on files or SQLite."""
    if isinstance(storage, FileStorage):
        values = storage.runs_dir / f"{run_id}.blobs"
        return storage.size(run_id), values.stat().st_size if values.exists() else 0
    db = sqlite3.connect(storage.path)
    try:
        row = db.execute("SELECT coalesce(sum(length(data)) + 64 * count(*), 0) FROM run_blobs WHERE run_id = ?",
                         (run_id,)).fetchone()
    finally:
        db.close()
    return storage.size(run_id), int(row[0])


@pytest.mark.parametrize("kind", ["memory", "file", "sqlite", "postgres"])
def test_large_and_repeated_values_round_trip(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    storage = storage_of(kind, tmp_path, request)
    engine = Engine(storage)
    want = expected(40)
    assert asyncio.run(engine.run(flows.everywhere, {"n": 40, "user": USER}, key="v", advisories="silent")) == want
    run_id = Engine(storage).resolve("v")
    plain = len(msgspec.json.encode(want))
    assert storage.size(run_id) < plain  # the log holds references, not the values (their result alone is larger)
    log = storage.read(run_id)
    assert log is not None and log.torn is None
    text = msgspec.json.encode([msgspec.to_builtins(r) for r in log.records])
    assert b'{"$blob":"' not in text.replace(b'{"$esc":{"$blob":"', b"")  # every reference resolved
    by_kind = {(r.t if hasattr(r, "t") else None) for r in log.records}
    assert by_kind  # typed records: the fast path
    info = storage.info(run_id)
    assert info is not None and info.last["result"]["items"] == [msgspec.to_builtins(x) for x in want["items"]]
    assert info.last["result"]["user"] == {"$esc": USER}
    # replay: a second engine on the same store answers the keyed run from the log, values and all
    again = Engine(storage if kind == "memory" else storage_of(kind, tmp_path, request))
    assert asyncio.run(again.run(flows.everywhere, {"n": 40, "user": USER}, key="v", advisories="silent")) == want
    exported = asyncio.run(again.export(run_id))
    assert TEXT_DIGEST.encode() in exported and exported.count(b"lorem ipsum") >= 40
    assert b'{"$blob":"' not in exported.replace(b'{"$esc":{"$blob":"', b"")


def test_a_resumed_run_replays_resolved_values(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "state")
    engine = Engine(storage)
    assert asyncio.run(engine.run(flows.agent, 20, key="a", advisories="silent")) == flows.conversation(20)
    run_id = Engine(storage).resolve("a")
    assert run_id is not None
    data = (storage.runs_dir / f"{run_id}.jsonl").read_bytes()
    cut = data[: data.rindex(b'{"t":"ok"')]  # as if the process died before its last step was recorded
    (storage.runs_dir / f"{run_id}.jsonl").write_bytes(cut)
    calls = tmp_path / "calls"
    flows.CALLS = str(calls)
    try:
        result = asyncio.run(Engine(FileStorage(tmp_path / "state")).run(flows.agent, 20, key="a",
                                                                          advisories="silent"))
    finally:
        flows.CALLS = None
    assert result == flows.conversation(20)
    assert calls.read_text().split() == ["19"]  # only the step that was not recorded ran again


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_a_hundred_turn_agent_loop_grows_linearly(kind: str, tmp_path: Path) -> None:
    distinct = sum(len(msgspec.json.encode(flows.message(turn))) for turn in range(100))
    sizes = {}
    for on in (True, False):
        root = tmp_path / f"{kind}-{on}"
        storage = (FileStorage(root, values_once=on) if kind == "file"
                   else SqliteStorage(root / "runs.db", values_once=on))
        result = asyncio.run(Engine(storage).run(flows.agent, 100, advisories="silent"))
        assert result == flows.conversation(100)
        run_id = storage.list_runs()[0].run_id
        sizes[on] = stored_bytes(storage, run_id)
        storage.close()
    log, values = sizes[True]
    off = sum(sizes[False])
    print(f"\n{kind}: 100 turns, distinct messages {distinct:,} B; values once: log {log:,} B + values {values:,} B "
          f"= {(log + values) / distinct:.2f}x; off: {off:,} B = {off / distinct:.1f}x")
    assert log + values <= 2 * distinct
    assert sizes[False][1] == 0 and off > 20 * distinct


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_an_agent_loop_killed_mid_loop_resumes(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    url = storage_url(kind, tmp_path, request)
    calls = tmp_path / "calls"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "VALUE_FLOWS_CALLS": str(calls)}
    proc = subprocess.Popen([sys.executable, str(FLOWS), url, "60"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        wait_until(lambda: calls.exists() and len(calls.read_text().split()) >= 30, seconds=60)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    before = calls.read_text().split()
    assert len(before) < 60, "the loop ended before it was killed"
    done = subprocess.run([sys.executable, str(FLOWS), url, "60"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"messages": 60, "equal": True}
    turns = [int(t) for t in calls.read_text().split()]
    again = turns[len(before):]
    print(f"\n{kind}: killed after {len(before)} model calls; the resumed process made {len(again)} "
          f"(from turn {again[0]})")
    assert sorted(set(turns)) == list(range(60))
    assert again[0] >= len(before) - 1  # at most the step in flight ran again
    storage = open_storage(url)
    info = storage.info(Engine(storage).resolve("agent"))
    assert info is not None and info.last["result"] == flows.conversation(60)


def test_a_worker_process_stores_values_once(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    url = storage_url("sqlite", tmp_path, request)
    engine = Engine(open_storage(url))
    handle = asyncio.run(engine.enqueue(flows.agent, 40, key="queued"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    worker = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "worker", "--storage", url, "--poll", "0.05",
                               "-q", "--import", str(FLOWS)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: engine.storage.info(handle.run_id).ended, seconds=60)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=30)
    run_id = handle.run_id
    assert asyncio.run(engine.inspect(run_id)).result == flows.conversation(40)
    log, values = stored_bytes(engine.storage, run_id)
    assert values > 0 and log + values < 2 * sum(len(msgspec.json.encode(flows.message(t))) for t in range(40)) + 20_000


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_export_inspect_logs_fork_and_console_show_the_values(tmp_path: Path) -> None:
    state = tmp_path / "state"
    storage = FileStorage(state)
    engine = Engine(storage)
    asyncio.run(engine.run(flows.agent, 12, key="talk", advisories="silent"))
    run_id = Engine(storage).resolve("talk")
    assert run_id is not None
    raw = (state / "runs" / f"{run_id}.jsonl").read_bytes()
    last = flows.message(11)["content"]
    assert last.encode() not in raw and b'{"$blob":"' in raw  # the log itself holds references
    exported = durably("export", run_id, "--dir", str(state), check=True).stdout
    assert exported.count(flows.message(0)["content"]) == 13 and '{"$blob"' not in exported
    inspected = json.loads(durably("inspect", run_id, "--json", "--dir", str(state), check=True).stdout)
    assert last in json.dumps(inspected) and "$blob" not in json.dumps(inspected)
    logs = durably("logs", run_id, "--dir", str(state), columns=400, check=True).stdout
    assert "turn 0:" in logs and "$blob" not in logs  # values shown truncated, from their start
    followed = durably("logs", run_id, "--follow", "--dir", str(state), columns=400, check=True).stdout
    assert followed == logs
    # a fork copies resolved values into a log (and stored values) of its own: deleting the original keeps it whole
    edited = {"messages": [flows.message(50)]}
    forked = asyncio.run(engine.fork(run_id, from_step=(3,), set_output=edited))
    assert forked == {"messages": [flows.message(50), *(flows.message(t) for t in range(4, 12))]}
    fork_id = next(r.run_id for r in storage.list_runs() if r.run_id != run_id)
    copied = (state / "runs" / f"{fork_id}.jsonl").read_bytes()
    assert flows.message(1)["content"].encode() not in copied  # the copied history refers to values too
    assert storage.delete(run_id)
    assert not (state / "runs" / f"{run_id}.blobs").exists()
    records = asyncio.run(engine.records(fork_id))
    assert records[-1]["result"] == forked and "$blob" not in json.dumps(records)
    pytest.importorskip("starlette")
    with warnings.catch_warnings():  # Starlette's test client over httpx warns of its own deprecation
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient

        from durably_py.ui import create_app
    client = TestClient(create_app(Engine(FileStorage(state))))
    shown = client.get(f"/api/runs/{fork_id}").text
    assert "turn 50:" in shown and "$blob" not in shown
    lines = client.get(f"/api/runs/{fork_id}/log").text
    assert "turn 50:" in lines and "$blob" not in lines


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_deleting_or_pruning_a_run_removes_its_stored_values(kind: str, tmp_path: Path) -> None:
    storage = storage_of(kind, tmp_path)
    engine = Engine(storage)
    asyncio.run(engine.run(flows.agent, 10, key="gone", advisories="silent"))
    run_id = engine.resolve("gone")
    assert stored_bytes(storage, run_id)[1] > 0
    if kind == "file":
        report = asyncio.run(engine.prune(older_than=0))
        assert run_id in json.dumps(msgspec.to_builtins(report), default=str)
    else:
        freed = storage.delete(run_id)
        assert freed and freed > 10_000
    assert storage.info(run_id) is None
    if kind == "file":
        assert not (storage.runs_dir / f"{run_id}.blobs").exists()
    else:
        db = sqlite3.connect(storage.path)
        assert db.execute("SELECT count(*) FROM run_blobs").fetchone()[0] == 0
        db.close()


def test_a_compacted_loop_keeps_its_values(tmp_path: Path) -> None:
    """A loop whose steps and snapshots carry its whole, growing state: the log is compacted (rewritten without
    the steps the snapshots cover) as it goes, and the rewrite keeps its values stored once."""
    storage = FileStorage(tmp_path / "state")

    async def main() -> Any:
        from durably_py import workflow

        @workflow(name="snapshots")
        async def snapshots(ctx: Any, turns: int) -> Any:
            async def turn(state: dict[str, Any], it: Any) -> Any:
                if it.number == turns:
                    return it.done(state)
                return await it.step(flows.model, state, it.number, name="model")
            return await ctx.loop({"messages": []}, turn, snapshot_every=1)

        return await Engine(storage).run(snapshots, 120, key="snap", advisories="silent")

    assert asyncio.run(main()) == flows.conversation(120)
    run_id = Engine(storage).resolve("snap")
    assert (storage.runs_dir / f"{run_id}.jsonl").read_bytes().count(b'"t":"ok"') < 60  # it was compacted
    log, values = stored_bytes(storage, run_id)
    distinct = sum(len(msgspec.json.encode(flows.message(t))) for t in range(120))
    assert log + values <= 2 * distinct
    assert storage.info(run_id).last["result"] == flows.conversation(120)


def test_a_user_dict_spelled_like_a_reference_is_user_data(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "state")
    engine = Engine(storage)
    digest = hashlib.sha256(msgspec.json.encode(flows.message(0)["content"])).hexdigest()  # a value it stores
    values = [{"$blob": digest}, {"$blob": "0" * 64}, {"$blob": digest, "x": 1}, [{"$blob": digest}] * 20,
              {"$esc": {"$blob": digest}}, {"s": '{"$blob":"' + digest + '"}' * 20}]

    async def main() -> Any:
        from durably_py import workflow

        @workflow(name="lookalikes")
        async def lookalikes(ctx: Any, _: Any) -> Any:
            await ctx.step(flows.echo, flows.conversation(3))
            return [await ctx.step(flows.echo, v) for v in values]

        first = await engine.run(lookalikes, None, key="look", advisories="silent")
        replayed = await Engine(FileStorage(tmp_path / "state")).run(lookalikes, None, key="look",
                                                                     advisories="silent")
        return first, replayed

    assert asyncio.run(main()) == (values, values)
    run_id = Engine(storage).resolve("look")
    kept = (storage.runs_dir / f"{run_id}.blobs").read_bytes().splitlines()
    assert sum(line.startswith(digest.encode()) for line in kept) == 1  # the real value, stored once
    raw = (storage.runs_dir / f"{run_id}.jsonl").read_bytes()
    assert b'{"$esc":{"$blob":"' + digest.encode() in raw or b'{"$blob":"' in raw


def test_a_reference_to_a_value_never_stored(tmp_path: Path) -> None:
    """The last line's value lost (a machine crash before the values were synced): that line is dropped as torn;
    an earlier line's: `CorruptLogError` naming the line."""
    storage = FileStorage(tmp_path / "state")
    asyncio.run(Engine(storage).run(flows.agent, 6, key="lost", advisories="silent"))
    run_id = Engine(storage).resolve("lost")
    path = storage.runs_dir / f"{run_id}.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    token = b'{"$blob":"' + b"e" * 64 + b'"}'
    cut = b"".join(lines[:-1]) + b'{"t":"ok","p":"9","l":"x","v":' + token + b',"a":1}\n'
    path.write_bytes(cut)
    log = storage.read(run_id)
    assert log is not None and log.torn and "never made durable" in log.torn
    assert len(log.records) == len(lines) - 1
    path.write_bytes(b"".join(lines[:2]) + b'{"t":"ok","p":"9","l":"x","v":' + token + b',"a":1}\n'
                     + b"".join(lines[2:]))
    with pytest.raises(CorruptLogError) as caught:
        storage.read(run_id)
    assert caught.value.line == 3 and caught.value.hint


def test_values_once_can_be_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    off = FileStorage(tmp_path / "off", values_once=False)
    asyncio.run(Engine(off).run(flows.agent, 8, advisories="silent"))
    monkeypatch.setenv("DURABLY_VALUES_ONCE", "0")
    env_off = SqliteStorage(tmp_path / "env.db")
    asyncio.run(Engine(env_off).run(flows.agent, 8, advisories="silent"))
    for storage in (off, env_off):
        run_id = storage.list_runs()[0].run_id
        assert stored_bytes(storage, run_id)[1] == 0
        assert storage.info(run_id).last["result"] == flows.conversation(8)
    assert not list((tmp_path / "off" / "runs").glob("*.blobs"))


def test_externalise_and_resolve_are_inverse() -> None:
    """The walk on values of every shape: what `resolve` gives back decodes to what went in."""
    big = "x" * 500
    cases: list[Any] = [
        {"a": big, "b": [big] * 9, "c": {"d": big, "e": [1, 2, 3]}},
        {"list": [{"k": i, "v": big + str(i)} for i in range(70)]},
        {"esc": {"$esc": {"$esc": {"deep": [big] * 5}}}, "s": '{"$blob":"' + "a" * 64 + '"}' + big},
        {"$esc": big, "other": [big] * 5}, {"x": {"$esc": [big] * 9, "y": 1}, "z": {"$esc": {"$blob": "b" * 64}}},
        {"ints": list(range(3000)), "nested": [[[big]]], "unicode": "é😀" * 300},
    ]
    for case in cases:
        line = msgspec.json.encode({"t": "ok", "v": case}) + b"\n"
        kept: set[str] = set()
        out, blobs = valuestore.externalise(line, kept)
        assert out != line and blobs
        back, missing = valuestore.resolve(out, lambda blobs=blobs: blobs)
        assert not missing and msgspec.json.decode(back) == msgspec.json.decode(line)
        kept.update(blobs)
        again, more = valuestore.externalise(line, kept)
        assert again == out and more == {}  # the same line again: nothing new to keep
    short = b'{"t":"ok","v":"' + b"y" * 100 + b'"}\n'
    assert valuestore.externalise(short, set()) == (short, {})


def test_a_test_engine_run_crashed_mid_loop_resumes_with_its_values() -> None:
    from durably_py.testing import TestEngine

    engine = TestEngine()
    crashed = asyncio.run(engine.run(flows.agent, 20, crash_after=(12,)))
    assert crashed.status == "crashed"
    done = asyncio.run(engine.resume(crashed.run_id))  # shadow replay checks the replayed history too
    assert done.status == "completed" and done.result == flows.conversation(20)
    assert [s.executions for s in done.steps] == [1] * 20  # across both processes: none ran twice
    assert done.step((19,)).output == flows.conversation(20)
    log = engine.storage.read(crashed.run_id)
    assert log is not None and engine.storage.size(crashed.run_id) < len(msgspec.json.encode(done.result)) * 2


def test_stored_values_are_fsynced_before_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = FileStorage(tmp_path / "state")
    storage.create("r1", b'{"t":"run","v":1,"run_id":"r1","workflow":"w"}\n')
    lease = storage.claim("r1", "me", 30)
    assert lease is not None
    storage.sync(lease)
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    line = msgspec.json.encode({"t": "ok", "p": "0", "l": "x", "v": flows.conversation(4), "a": 1}) + b"\n"
    storage.append(lease, line)
    storage.sync(lease)
    assert synced[0] == "r1.blobs" and synced.index("r1.blobs") < synced.index("r1.jsonl")
    synced.clear()
    storage.append(lease, line)  # nothing new to keep: only the log is written and synced
    storage.sync(lease)
    assert synced == ["r1.jsonl"]
    assert storage.read("r1").records[-1]["v"] == flows.conversation(4)


def test_a_values_line_cut_short_is_ignored_and_never_joined(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "state")
    storage.create("r1", b'{"t":"run","v":1,"run_id":"r1","workflow":"w"}\n')
    lease = storage.claim("r1", "me", 30)
    assert lease is not None

    def line(turns: int) -> bytes:
        return msgspec.json.encode({"t": "ok", "p": str(turns), "l": "x", "v": flows.conversation(turns), "a": 1}) + b"\n"

    storage.append(lease, line(3))
    values = storage.runs_dir / "r1.blobs"
    with open(values, "ab") as f:
        f.write(b"ab" * 32 + b' "cut sho')  # a write a crash cut short
    storage.append(lease, line(5))  # new values: written on a line of their own
    assert b'"cut sho\n' in values.read_bytes()
    assert [r["v"] for r in storage.read("r1").records[2:]] == [flows.conversation(3), flows.conversation(5)]
