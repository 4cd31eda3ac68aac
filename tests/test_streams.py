"""Streamed steps through the public API: generator steps and `attempt().emit` in every mode, readers following
a stream live from any offset, a killed writer's next attempt continuing from its partials, `durably logs
--follow` showing chunks as they come."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import read_until, storage_of
from modes import Effects, cli_process, effects_fixture, environ, flows_fixture, in_worker, wait_until

from durably_py import Engine, FileStorage, SqliteStorage, attempt, run, workflow
from durably_py._replay.streams import FLUSH_CHUNKS
from durably_py.errors import RunParkedError, SerializationError, ValidationError
from durably_py.testing import TestEngine

FLOWS = '''
import asyncio, os, time
from pathlib import Path
from durably_py import Retry, attempt, workflow


async def tokens(n):
    mark("tokens")
    for i in range(n):
        yield f"t{i} "


def rows(n):
    mark("rows")
    for i in range(n):
        yield {"i": i}


async def emitter(n):
    mark("emitter")
    for i in range(n):
        attempt().emit(i)
        await asyncio.sleep(0)
    return sum(range(n))


def sync_emitter(n):
    mark("sync_emitter")
    for i in range(n):
        attempt().emit(f"s{i}")
    return "synced"


@workflow
async def streams_all(ctx, n):
    a = await ctx.step(tokens, n)
    b = await ctx.step(rows, n)
    c = await ctx.step(emitter, n)
    d = await ctx.step(sync_emitter, n)
    e = await ctx.step(tokens, 2, keep_partials=True)
    return [a, b, c, d, e]


@workflow
async def streams_nap(ctx, n):
    a = await ctx.step(tokens, n)
    await ctx.sleep(0.3)
    return [a, await ctx.step(tokens, 1)]


FLAKY = {"left": 1}


async def flaky_tokens(n):
    mark("flaky", len(attempt().partials))
    start = len(attempt().partials)
    for i in range(start, n):
        yield f"f{i} "
        if i == 2 and FLAKY["left"]:
            FLAKY["left"] -= 1
            raise ConnectionError("stream dropped")


@workflow
async def streams_retry(ctx, n):
    return await ctx.step(flaky_tokens, n, retry=Retry(3, base=0.01))


@workflow
async def streams_bad(ctx):
    async def gen():
        yield b"raw bytes"
    return await ctx.step(gen)
'''

flows = flows_fixture("streams_flows", FLOWS)
effects = effects_fixture()
EXPECTED = ["t0 t1 t2 ", [{"i": 0}, {"i": 1}, {"i": 2}], 3, "synced", "t0 t1 "]


def test_generator_and_emit_steps_in_run(flows: Any, effects: Effects, tmp_path: Path) -> None:
    _, mod = flows
    state = tmp_path / "state"
    assert run(mod.streams_all, 3, dir=state, key="all") == EXPECTED
    storage = FileStorage(state)
    run_id = storage.lookup("key:all")
    assert run_id is not None
    # every completed step's partials were folded into its record and dropped, except the kept one
    assert storage.partial_paths(run_id) == {"4": 2}
    assert storage.read_partials(run_id, "4", 1) == [b'"t1 "']
    ok = [r for r in storage.read(run_id).records if r["t"] == "ok"]
    assert [r.value for r in ok] == EXPECTED  # the log holds the joined results
    # a finished stream reads from its record; a kept one from its partials
    engine = Engine(storage)

    async def read(path: Any, offset: int = 0) -> list[Any]:
        return [c async for c in engine.stream("all", path, offset=offset)]

    assert asyncio.run(read(0)) == ["t0 t1 t2 "]
    assert asyncio.run(read((1,), 1)) == [{"i": 1}, {"i": 2}]
    assert asyncio.run(read("4")) == ["t0 ", "t1 "]
    assert asyncio.run(read(2)) == [3]  # an emit step's partials are dropped: its result is its record
    counts = {label: effects.count(label) for label in ("tokens", "rows", "emitter", "sync_emitter")}
    assert counts == {"tokens": 2, "rows": 1, "emitter": 1, "sync_emitter": 1}
    # a step run again streams anew: its kept partials are not taken for a cut-off attempt's
    assert asyncio.run(engine.retry("all", from_step=(4,))) == EXPECTED
    assert storage.partial_paths(run_id) == {"4": 2} and effects.count("tokens") == 3


def test_replay_answers_from_the_log(flows: Any, effects: Effects) -> None:
    _, mod = flows
    te = TestEngine()
    first = asyncio.run(te.run(mod.streams_all, 3, crash_after=(2,)))
    assert first.status == "crashed", first
    ran = effects.count("tokens")
    again = asyncio.run(te.resume(first.run_id))
    assert again.result == EXPECTED, again
    assert effects.count("tokens") == ran + 1  # only the step after the crash: no generator re-ran
    assert te.storage.partial_paths(first.run_id) == {"4": 2}


def test_retried_attempt_continues_from_its_partials(flows: Any, effects: Effects) -> None:
    _, mod = flows
    mod.FLAKY["left"] = 1
    te = TestEngine()
    result = asyncio.run(te.run(mod.streams_retry, 6))
    assert result.result == "f0 f1 f2 f3 f4 f5 ", result
    assert [line[2] for line in effects.lines() if line[0] == "flaky"] == ["0", "3"]
    assert te.storage.partial_paths(result.run_id) == {}


def test_run_wait_false_parks_and_resumes(flows: Any, effects: Effects, tmp_path: Path) -> None:
    _, mod = flows
    state = tmp_path / "state"
    with pytest.raises(RunParkedError):
        run(mod.streams_nap, 4, dir=state, key="nap", wait=False)
    time.sleep(0.35)
    assert run(mod.streams_nap, 4, dir=state, key="nap", wait=False) == ["t0 t1 t2 t3 ", "t0 "]
    assert effects.count("tokens") == 2


def test_in_a_worker_process(flows: Any, effects: Effects, tmp_path: Path) -> None:
    script, _ = flows
    state = tmp_path / "state"
    done = in_worker(state, script, "streams_all", 3, key="w")
    assert done.status == "completed" and done.result == EXPECTED
    assert effects.count("rows") == 1


def test_bad_chunks_and_options(flows: Any, tmp_path: Path) -> None:
    _, mod = flows
    with pytest.raises(SerializationError, match="chunk"):
        run(mod.streams_bad, dir=tmp_path / "state")

    @workflow
    async def bad_option(ctx: Any) -> Any:
        return await ctx.step(mod.tokens, 1, keep_partials="yes")

    with pytest.raises(ValidationError, match="keep_partials"):
        run(bad_option, dir=tmp_path / "state")
    with pytest.raises(ValidationError, match="outside a running step"):
        attempt().emit("x")


# -- readers following a live stream ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["file", "sqlite", "memory", pytest.param("postgres", marks=pytest.mark.slow)])
def test_followers_see_each_chunk_once_in_order_live(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    storage = storage_of(kind, tmp_path, request)
    engine = Engine(storage)
    seen: dict[int, list[Any]] = {0: [], 3: []}
    total = 12

    async def main() -> Any:
        async def talk(n: int) -> str:
            for i in range(n):
                attempt().emit(f"w{i} ")
                # the next chunk is emitted only once a follower saw this one: proof that it is read live
                deadline = time.monotonic() + 20
                while len(seen[0]) <= i:
                    assert time.monotonic() < deadline, "the follower never saw the chunk"
                    await asyncio.sleep(0.01)
            return "".join(f"w{i} " for i in range(n))

        @workflow(name="talker")
        async def talker(ctx: Any, n: int) -> Any:
            return await ctx.step(talk, n)

        async def follow(offset: int) -> None:
            while storage.lookup("key:talk") is None:
                await asyncio.sleep(0.01)
            async for chunk in engine.stream("talk", 0, offset=offset, follow=True):
                seen[offset].append(chunk)

        readers = [asyncio.ensure_future(follow(0)), asyncio.ensure_future(follow(3))]
        value = await engine.run(talker, total, key="talk")
        await asyncio.wait_for(asyncio.gather(*readers), 20)
        return value

    value = asyncio.run(main())
    assert seen[0] == [f"w{i} " for i in range(total)]
    tail = seen[3]
    # the late reader: every chunk from offset 3 once, in order; the ones written as the step completed may come
    # joined, from the step's record
    assert "".join(tail) == value[len("w0 w1 w2 "):]
    assert tail[:-1] == [f"w{i} " for i in range(3, 3 + len(tail) - 1)]
    assert storage.partial_paths(storage.lookup("key:talk")) == {}


# -- a killed writer ------------------------------------------------------------------------------------------

KILLED = '''
import asyncio, json, os, sys, time
from durably_py import FileStorage, SqliteStorage, attempt, create_engine, workflow

N = int(sys.argv[2])


def slow_tokens(n):
    start = len(attempt().partials)
    with open(os.environ["STREAM_REPORT"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "partials": attempt().partials}) + "\\n")
    for i in range(start, n):
        time.sleep(float(os.environ.get("STREAM_PAUSE", "0.05")))
        yield f"k{i} "
        with open(os.environ["STREAM_EMITTED"], "a") as f:  # what this process emitted, written as it goes
            f.write(f"{i}\\n")


@workflow
async def killed_stream(ctx, n):
    text = await ctx.step(slow_tokens, n)
    return text.upper()


if __name__ == "__main__":
    url = sys.argv[1]  # a state dir, or sqlite:PATH
    storage = SqliteStorage(url[7:]) if url.startswith("sqlite:") else FileStorage(url)
    engine = create_engine(storage, lease=2)  # a killed owner's lease lapses soon (files: at once)
    print(json.dumps(asyncio.run(engine.run(killed_stream, N, key="killed"))))
'''


def _kill_and_resume(tmp_path: Path, url: str, storage: Any, visible: list[int], total: int) -> dict[str, Any]:
    """Run the script, SIGKILL it once `visible[i]` chunks are in the store, for each i; then run it to its end."""
    script = tmp_path / "killed_stream.py"
    script.write_text(KILLED)
    report, emitted = tmp_path / "report.jsonl", tmp_path / "emitted.txt"
    env = environ() | {"STREAM_REPORT": str(report), "STREAM_EMITTED": str(emitted)}

    def flushed() -> int:
        run_id = storage.lookup("key:killed")
        return len(storage.read_partials(run_id, "0")) if run_id else 0

    kills = []
    for threshold in visible:
        emitted.write_text("")
        proc = subprocess.Popen([sys.executable, str(script), url, str(total)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: flushed() >= threshold or proc.poll() is not None, 60, 0.01)  # noqa: B023
            assert proc.poll() is None, proc.communicate()
            at_kill = flushed()
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.communicate(timeout=30)
        lines = emitted.read_text().split("\n")[:-1]
        kills.append({"at_kill": at_kill, "after_kill": flushed(), "emitted_to": int(lines[-1]) + 1 if lines else 0})
    done = subprocess.run([sys.executable, str(script), url, str(total)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    return {"kills": kills, "lines": lines, "result": json.loads(done.stdout)}


def _check_kills(kind: str, out: dict[str, Any], total: int) -> None:
    reports = out["lines"]
    assert reports[0]["partials"] == [] and len({r["pid"] for r in reports}) == len(reports)
    for kill, report in zip(out["kills"], reports[1:], strict=True):
        got = report["partials"]
        lost = kill["emitted_to"] - len(got)
        print(f"\n{kind}: {kill['at_kill']} chunks in the store when killed, {kill['emitted_to']} emitted; the next "
              f"attempt got {len(got)} as attempt().partials ({lost} lost: at most 64, or 0.1 s of chunks)")
        assert len(got) >= kill["after_kill"] >= kill["at_kill"]  # every chunk that was in the store
        assert got == [f"k{i} " for i in range(len(got))]
        assert 0 <= lost <= FLUSH_CHUNKS
    assert out["result"] == "".join(f"k{i} " for i in range(total)).upper()


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_a_killed_stream_continues_from_its_partials(kind: str, tmp_path: Path) -> None:
    total = 40
    state = tmp_path / "state"
    storage = FileStorage(state) if kind == "file" else SqliteStorage(state / "runs.db")
    url = str(state) if kind == "file" else f"sqlite:{state / 'runs.db'}"
    out = _kill_and_resume(tmp_path, url, storage, [6], total)
    _check_kills(kind, out, total)
    assert storage.partial_paths(storage.lookup("key:killed")) == {}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_a_stream_killed_again_and_again_loses_at_most_a_batch_each_time(kind: str, tmp_path: Path) -> None:
    total = 120
    state = tmp_path / "state"
    storage = FileStorage(state) if kind == "file" else SqliteStorage(state / "runs.db")
    url = str(state) if kind == "file" else f"sqlite:{state / 'runs.db'}"
    os.environ["STREAM_PAUSE"] = "0.01"
    try:
        out = _kill_and_resume(tmp_path, url, storage, [5, 20, 41, 60, 83, 100], total)
    finally:
        del os.environ["STREAM_PAUSE"]
    _check_kills(kind, out, total)


# -- durably logs --follow ------------------------------------------------------------------------------------

FOLLOWED = '''
import os, time
from pathlib import Path
from durably_py import attempt, workflow


def chatty(n):
    for i in range(n):
        attempt().emit(f"live-{i};")
    gate = Path(os.environ["STREAM_GATE"])
    while not gate.exists():  # the chunks are out; the step goes on until the test saw them
        time.sleep(0.02)
    return "said"


@workflow
async def followed(ctx, n):
    return await ctx.step(chatty, n)
'''


def test_logs_follow_shows_chunks_live(tmp_path: Path) -> None:
    script = tmp_path / "followed.py"
    script.write_text(FOLLOWED)
    state = tmp_path / "state"
    gate = tmp_path / "gate"
    os.environ["STREAM_GATE"] = str(gate)
    try:
        runner = cli_process("run", str(script), "--workflow", "followed", "--input", "3", "--key", "fol",
                             "--dir", str(state))
        storage = FileStorage(state)
        wait_until(lambda: storage.lookup("key:fol") is not None, 60, 0.02)
        follower = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "logs", "fol", "--follow",
                                     "--dir", str(state)], env=environ() | {"COLUMNS": "200"},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert follower.stdout is not None
            seen = read_until(follower.stdout.fileno(), b"live-2;", 60)
            assert b"live-0;live-1;" in seen or seen.index(b"live-0;") < seen.index(b"live-2;")
            assert not gate.exists() and runner.poll() is None  # seen while the step still ran
            gate.touch()
            rest, err = follower.communicate(timeout=60)
            assert follower.returncode == 0, err
        finally:
            if follower.poll() is None:
                follower.kill()
                follower.communicate()
        _, err = runner.communicate(timeout=60)
        assert runner.returncode == 0, err
    finally:
        del os.environ["STREAM_GATE"]


def test_a_torn_partial_line_is_skipped_then_cut(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "state")
    storage.create("r1", b'{"t":"run","v":1,"run_id":"r1","workflow":"wf","key":null,"created_at":"2024"}\n')
    storage.append_partials("r1", "0", 1, [b'"a"'])
    file = tmp_path / "state" / "runs" / "r1.partials" / "0.jsonl"
    with open(file, "ab") as f:
        f.write(b'{"attempt":1,"chunk":"b')  # a writer killed mid-line
    assert storage.read_partials("r1", "0") == [b'"a"']
    storage.append_partials("r1", "0", 2, [b'"c"'])
    assert storage.read_partials("r1", "0") == [b'"a"', b'"c"']
    assert file.read_bytes().count(b"\n") == 2


def test_the_console_streams_a_step_as_server_sent_events(tmp_path: Path) -> None:
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from durably_py.ui import create_app

    script = tmp_path / "followed.py"
    script.write_text(FOLLOWED)
    state = tmp_path / "state"
    gate = tmp_path / "gate"
    os.environ["STREAM_GATE"] = str(gate)
    try:
        runner = cli_process("run", str(script), "--workflow", "followed", "--input", "4", "--key", "sse",
                             "--dir", str(state))
        storage = FileStorage(state)
        wait_until(lambda: (rid := storage.lookup("key:sse")) is not None
                   and len(storage.read_partials(rid, "0")) == 4, 60, 0.02)
        client = TestClient(create_app(Engine(storage)))
        with client.stream("GET", "/api/runs/sse/stream/0", headers={"Last-Event-ID": "1"}) as stream:
            lines = stream.iter_lines()
            got = [next(lines) for _ in range(8)]
            assert runner.poll() is None  # live: the step is still running
            gate.touch()
            rest = list(lines)
        assert got == ["id: 2", "event: chunk", 'data: "live-2;"', "", "id: 3", "event: chunk", 'data: "live-3;"', ""]
        assert rest[:2] == ["event: end", "data: {}"]
        assert client.get("/api/runs/sse/stream/x.y").status_code == 400
        runner.communicate(timeout=60)
    finally:
        del os.environ["STREAM_GATE"]
