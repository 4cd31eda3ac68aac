"""The JSONL run log as `run()` writes it: append-only lines, checkpoint fsyncs, torn and damaged lines, compaction."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import Stop, log_files

from durably_py import (
    CorruptLogError,
    FakeClock,
    FileStorage,
    Retry,
    attempt,
    create_engine,
    engine_for,
    run,
    workflow,
)
from durably_py.testing import TestEngine

Records = Callable[..., list[dict[str, Any]]]


class Flaky(Exception):
    """A failing attempt."""


class Steps:
    """A workflow of `n` numbered steps that counts executions and can stop after step `stop_after`."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.stop_after: int | None = None
        self.counts = [0] * n

        def numbered(i: int) -> dict[str, int]:
            self.counts[i] += 1
            return {"i": i, "square": i * i}

        @workflow(name="steps")
        async def steps(ctx: Any, tag: str) -> list[int]:
            out = []
            for i in range(self.n):
                out.append((await ctx.step(numbered, i, name=f"step {i}"))["square"])
                if self.stop_after == i:
                    raise Stop()
            return out

        self.wf = steps

    def interrupt(self, after: int, state_dir: Path, tag: str = "t") -> None:
        self.stop_after = after
        with pytest.raises(Stop):
            run(self.wf, tag, dir=state_dir)
        self.stop_after = None


def the_log(state_dir: Path) -> Path:
    logs = log_files(state_dir)
    assert len(logs) == 1
    return logs[0]


# ---- record format --------------------------------------------------------------------------------


def test_each_completed_step_is_one_appended_ok_line(state_dir: Path, records: Records) -> None:
    flow = Steps(5)
    flow.interrupt(2, state_dir)
    log = the_log(state_dir)
    before = log.read_bytes()
    assert [r["t"] for r in records()] == ["run", "claim", "ok", "ok", "ok"]

    assert run(flow.wf, "t", dir=state_dir) == [0, 1, 4, 9, 16]
    after = log.read_bytes()
    assert after.startswith(before)
    assert after.endswith(b"\n") and len(after.splitlines()) == 9
    recs = records()
    assert [r["t"] for r in recs] == ["run", "claim", "ok", "ok", "ok", "claim", "ok", "ok", "end"]
    oks = [r for r in recs if r["t"] == "ok"]
    assert [(r["p"], r["l"], r["v"], r["a"]) for r in oks] == [
        (str(i), f"step {i}", {"i": i, "square": i * i}, 1) for i in range(5)
    ]
    for r in oks:
        assert set(r) == {"t", "p", "l", "v", "a", "ms", "ts"}
    assert [r["epoch"] for r in recs if r["t"] == "claim"] == [1, 2]
    assert recs[-1]["status"] == "completed" and recs[-1]["result"] == [0, 1, 4, 9, 16]
    assert flow.counts == [1] * 5


def test_header_is_the_first_line_with_version_one(state_dir: Path, records: Records) -> None:
    flow = Steps(1)
    run(flow.wf, "hello", dir=state_dir, key="greeting")
    header = records()[0]
    assert header["t"] == "run" and header["v"] == 1
    assert header["workflow"] == "steps" and header["input"] == "hello" and header["key"] == "greeting"
    assert the_log(state_dir).name == f"{header['run_id']}.jsonl"


# ---- checkpoints ------------------------------------------------------------------------------------


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every fsync from now on, as the path of the synced descriptor."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to name synced descriptors")
    targets: list[str] = []
    real = os.fsync

    def counting(fd: int) -> None:
        targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    return targets


@pytest.mark.parametrize("every, log_syncs", [(1, 10 + 1), (5, 2 + 1), (3, 3 + 1), (10, 1 + 1), (11, 1), (None, 1)])
def test_fsyncs_follow_checkpoint_every(state_dir: Path, fsynced: list[str], every: int | None,
                                        log_syncs: int) -> None:
    flow = Steps(10)
    run(flow.wf, "t", dir=state_dir, checkpoint_every=every)
    log = str(the_log(state_dir))
    assert fsynced.count(log) == log_syncs
    assert fsynced.count(str(state_dir / "runs")) == 1


def test_engine_checkpoint_every_is_the_default_for_its_runs(state_dir: Path, fsynced: list[str]) -> None:
    flow = Steps(10)

    async def main() -> None:
        engine = create_engine(FileStorage(state_dir), checkpoint_every=2)
        await engine.run(flow.wf, "a")
        await engine.run(flow.wf, "b", checkpoint_every=5)

    asyncio.run(main())
    logs = {str(p): p for p in log_files(state_dir)}
    by_input = {}
    for path in logs:
        tag = "a" if '"input":"a"' in Path(path).read_text().splitlines()[0] else "b"
        by_input[tag] = fsynced.count(path)
    assert by_input == {"a": 5 + 1, "b": 2 + 1}


# ---- damaged logs ---------------------------------------------------------------------------------


def test_torn_last_line_is_dropped_and_the_run_resumes(state_dir: Path, records: Records,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    flow = Steps(4)
    flow.interrupt(1, state_dir)
    log = the_log(state_dir)
    good = log.read_bytes()
    torn = b'{"t":"ok","p":"2","l":"step 2","v":{"i":2,"squ'
    with open(log, "ab") as f:
        f.write(torn)
    capsys.readouterr()

    assert run(flow.wf, "t", dir=state_dir) == [0, 1, 4, 9]
    err = capsys.readouterr().err
    assert f"dropped a torn last line ({len(torn)} bytes) at line {len(good.splitlines()) + 1} of {log}" in err
    assert "the run resumes from the last complete record" in err
    assert flow.counts == [1, 1, 1, 1]
    data = log.read_bytes()
    assert data.startswith(good) and data[len(good):].startswith(b'{"t":"claim"')
    assert [r["t"] for r in records()] == ["run", "claim", "ok", "ok", "claim", "ok", "ok", "end"]


def test_damaged_middle_line_is_a_corrupt_log_error_and_nothing_is_written(state_dir: Path) -> None:
    flow = Steps(4)
    flow.interrupt(1, state_dir)
    log = the_log(state_dir)
    lines = log.read_bytes().splitlines(keepends=True)
    lines[2] = b'{"t":"ok","p":"0",garbage\n'
    damaged = b"".join(lines)
    log.write_bytes(damaged)
    run_id = log.name.removesuffix(".jsonl")

    with pytest.raises(CorruptLogError) as info:
        run(flow.wf, "t", dir=state_dir)
    err = info.value
    assert err.hint and err.docs
    assert (err.path, err.line) == (str(log), 3)
    assert f"line 3 of {log} is damaged" in str(err)
    assert log.read_bytes() == damaged
    assert flow.counts == [1, 1, 0, 0]

    with pytest.raises(CorruptLogError):
        asyncio.run(engine_for(state_dir).inspect(run_id))
    assert log.read_bytes() == damaged


# ---- compaction ---------------------------------------------------------------------------------


def test_compaction_shrinks_a_resumed_log_and_replays_identically(state_dir: Path, records: Records) -> None:
    stop = [True]
    calls = {"grind": 0, "tail": 0}

    def grind() -> dict[str, Any]:
        calls["grind"] += 1
        att = attempt()
        done = (att.stashed or {"done": 0})["done"] + 1
        att.stash({"done": done, "pad": "x" * 300})
        if att.number < 8:
            raise Flaky(f"attempt {att.number} of a long job")
        return {"done": done}

    def tail(i: int) -> int:
        calls["tail"] += 1
        return i

    @workflow(name="grinder")
    async def grinder(ctx: Any) -> list[Any]:
        job = await ctx.step(grind, retry=Retry(8, backoff="none"))
        first = await ctx.step(tail, 1)
        if stop[0]:
            raise Stop()
        return [job, first, await ctx.step(tail, 2)]

    storage = FileStorage(state_dir, compact_above_bytes=2000)

    async def main() -> None:
        engine = create_engine(storage, clock=FakeClock())
        with pytest.raises(Stop):
            await engine.run(grinder)
        log = the_log(state_dir)
        run_id = log.name.removesuffix(".jsonl")
        big = log.stat().st_size
        kinds = [r["t"] for r in records()]
        assert big > 2000 and kinds.count("fail") == 7 and kinds.count("stash") == 8

        stop[0] = False
        assert await engine.run(grinder) == [{"done": 8}, 1, 2]
        assert log.stat().st_size < big
        recs = records()
        assert [r["t"] for r in recs] == ["run", "claim", "ok", "ok", "ok", "end"]
        assert recs[1]["epoch"] == 2
        assert calls == {"grind": 8, "tail": 2}

        with TestEngine() as checker:
            replayed = await checker.replay(await engine.export(run_id), grinder)
        assert replayed.ok and replayed.frontier is None
        assert replayed.result == [{"done": 8}, 1, 2]
        state = await engine.inspect(run_id)
        assert [(s.label, s.status, s.attempts, s.output) for s in state.steps] == [
            ("grind", "ok", 8, {"done": 8}),
            ("tail", "ok", 1, 1),
            ("tail", "ok", 1, 2),
        ]

    asyncio.run(main())
    assert calls == {"grind": 8, "tail": 2}


def test_compaction_keeps_pending_retries_and_stash(state_dir: Path, records: Records) -> None:
    stop = [True]
    seen: list[tuple[int, Any]] = []

    def grind() -> int:
        att = attempt()
        seen.append((att.number, att.stashed))
        att.stash(att.number * 100)
        if att.number < 5:
            if att.number == 3 and stop[0]:
                raise Stop()
            raise Flaky("again")
        return att.number

    @workflow(name="pending")
    async def pending(ctx: Any) -> int:
        await ctx.step(tail_pad)
        return await ctx.step(grind, retry=Retry(5, backoff="none"))

    async def main() -> None:
        engine = create_engine(FileStorage(state_dir, compact_above_bytes=600), clock=FakeClock())
        with pytest.raises(Stop):
            await engine.run(pending)
        big = the_log(state_dir).stat().st_size
        assert big > 600
        stop[0] = False
        assert await engine.run(pending) == 5

    asyncio.run(main())
    assert seen == [(1, None), (2, 100), (3, 200), (3, 300), (4, 300), (5, 400)]
    assert [r["t"] for r in records()].count("ok") == 2


def tail_pad() -> str:
    return "p" * 700


def test_a_large_log_with_nothing_superseded_is_not_rewritten(state_dir: Path) -> None:
    steps = Steps(40)
    engine = create_engine(FileStorage(state_dir, compact_above_bytes=512))

    def interrupted() -> None:
        steps.stop_after = 30
        with pytest.raises(Stop):
            asyncio.run(engine.run(steps.wf, "big"))
        steps.stop_after = None

    interrupted()
    log = the_log(state_dir)
    before, inode = log.read_bytes(), log.stat().st_ino
    assert len(before) > 512
    assert asyncio.run(engine.run(steps.wf, "big")) == [i * i for i in range(40)]
    assert log.stat().st_ino == inode
    assert log.read_bytes().startswith(before)
    assert steps.counts == [1] * 40
