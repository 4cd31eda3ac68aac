"""Which run a `run()` call finds: identity by workflow and canonical input or by key, and the resume rules."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from helpers import Stop, check_error, go

from durably_py import (
    Engine,
    FakeClock,
    FileStorage,
    KeyConflictError,
    MemoryStorage,
    Retry,
    RunNotFoundError,
    ValidationError,
    attempt,
    create_engine,
    engine_for,
    run,
    run_async,
    workflow,
)
from durably_py import records as log_format


class Flaky(Exception):
    """A step failure the test can switch off."""


def run_ids(state_dir: Path) -> list[str]:
    return sorted(state.run_id for state in go(lambda: engine_for(state_dir).list()))


class Probe:
    """A two-step workflow that counts its step executions, can stop after the first step, and reports its run."""

    def __init__(self) -> None:
        self.stop = False
        self.fail_second = False
        self.counts = {"first": 0, "second": 0}
        self.attempts: list[int] = []
        self.seen: list[tuple[str, Any]] = []

        def first(value: Any) -> Any:
            self.counts["first"] += 1
            return value

        def second() -> str:
            self.counts["second"] += 1
            self.attempts.append(attempt().number)
            if self.fail_second:
                raise Flaky("second step fails")
            return "done"

        @workflow(name="probe")
        async def probe(ctx: Any, input: Any) -> list[Any]:
            self.seen.append((ctx.run_id, input))
            got = await ctx.step(first, input, name="first")
            if self.stop:
                raise Stop()
            return [got, await ctx.step(second, name="second", retry=Retry(2, backoff="none"))]

        self.wf = probe

    @property
    def run_id(self) -> str:
        return self.seen[-1][0]

    def interrupt(self, input: Any, state_dir: Path, **options: Any) -> str:
        """Run until after the first step, then stop as a killed process would."""
        self.stop = True
        with pytest.raises(Stop):
            run(self.wf, input, dir=state_dir, **options)
        self.stop = False
        return self.run_id


# ---- finding the run ----------------------------------------------------------------------------


def test_same_workflow_and_input_resumes_the_interrupted_run(state_dir: Path) -> None:
    probe = Probe()
    run_id = probe.interrupt([1, 2], state_dir)
    state = go(lambda: engine_for(state_dir).inspect(run_id))
    assert state.status == "interrupted" and state.attempt == 1
    assert run(probe.wf, [1, 2], dir=state_dir) == [[1, 2], "done"]
    assert probe.counts == {"first": 1, "second": 1}
    assert [rid for rid, _ in probe.seen] == [run_id, run_id]
    assert run_ids(state_dir) == [run_id]
    state = go(lambda: engine_for(state_dir).inspect(run_id))
    assert state.status == "completed" and state.attempt == 2 and state.result == [[1, 2], "done"]


def test_dict_key_order_does_not_matter(state_dir: Path) -> None:
    probe = Probe()
    run_id = probe.interrupt({"a": 1, "b": {"x": 1, "y": 2}}, state_dir)
    assert run(probe.wf, {"b": {"y": 2, "x": 1}, "a": 1}, dir=state_dir) == [{"a": 1, "b": {"x": 1, "y": 2}}, "done"]
    assert probe.run_id == run_id
    assert probe.counts == {"first": 1, "second": 1}


def test_none_valued_entries_do_not_change_identity(state_dir: Path) -> None:
    probe = Probe()
    run_id = probe.interrupt({"a": 1}, state_dir)
    assert run(probe.wf, {"a": 1, "b": None}, dir=state_dir) == [{"a": 1}, "done"]
    assert probe.run_id == run_id
    assert probe.seen[-1][1] == {"a": 1}
    assert probe.counts == {"first": 1, "second": 1}


def test_none_inside_a_list_is_part_of_identity(state_dir: Path) -> None:
    probe = Probe()
    run_id = probe.interrupt([1], state_dir)
    run(probe.wf, [1, None], dir=state_dir)
    assert probe.run_id != run_id
    assert len(run_ids(state_dir)) == 2


def test_other_input_is_another_run(state_dir: Path) -> None:
    probe = Probe()
    run_id = probe.interrupt({"a": 1}, state_dir)
    run(probe.wf, {"a": 2}, dir=state_dir)
    assert probe.run_id != run_id
    assert probe.counts == {"first": 2, "second": 1}


def test_completed_run_starts_a_fresh_run(state_dir: Path) -> None:
    probe = Probe()
    assert run(probe.wf, 7, dir=state_dir) == [7, "done"]
    first_id = probe.run_id
    assert run(probe.wf, 7, dir=state_dir) == [7, "done"]
    assert probe.run_id != first_id
    assert probe.counts == {"first": 2, "second": 2}
    assert run_ids(state_dir) == sorted([first_id, probe.run_id])


def test_failed_run_resumes_at_its_failed_step_with_fresh_attempts(state_dir: Path) -> None:
    probe = Probe()
    probe.fail_second = True
    with pytest.raises(Flaky, match="second step fails"):
        run(probe.wf, "x", dir=state_dir)
    run_id = probe.run_id
    assert probe.counts == {"first": 1, "second": 2}
    state = go(lambda: engine_for(state_dir).inspect(run_id))
    assert state.status == "failed"
    assert [(s.label, s.status, s.attempts) for s in state.steps] == [("first", "ok", 1), ("second", "failed", 2)]

    probe.fail_second = False
    assert run(probe.wf, "x", dir=state_dir) == ["x", "done"]
    assert probe.run_id == run_id
    assert probe.counts == {"first": 1, "second": 3}
    assert probe.attempts == [1, 2, 1]
    state = go(lambda: engine_for(state_dir).inspect(run_id))
    assert state.status == "completed"
    assert [(s.label, s.status, s.attempts) for s in state.steps] == [("first", "ok", 1), ("second", "ok", 1)]


def test_fresh_starts_over(state_dir: Path) -> None:
    probe = Probe()
    old_id = probe.interrupt("x", state_dir)
    assert run(probe.wf, "x", dir=state_dir, fresh=True) == ["x", "done"]
    assert probe.run_id != old_id
    assert probe.counts == {"first": 2, "second": 1}
    assert go(lambda: engine_for(state_dir).inspect(old_id)).status == "interrupted"
    run(probe.wf, "x", dir=state_dir)
    assert probe.counts == {"first": 3, "second": 2}


# ---- keys ---------------------------------------------------------------------------------------


def test_key_finds_the_run_whatever_the_input_order(state_dir: Path) -> None:
    probe = Probe()
    run_id = probe.interrupt({"a": 1, "b": 2}, state_dir, key="nightly")
    assert run(probe.wf, {"b": 2, "a": 1}, dir=state_dir, key="nightly") == [{"a": 1, "b": 2}, "done"]
    assert probe.run_id == run_id
    assert probe.counts == {"first": 1, "second": 1}
    states = go(lambda: engine_for(state_dir).list(key="nightly"))
    assert [(s.run_id, s.key, s.status) for s in states] == [(run_id, "nightly", "completed")]


def test_key_reused_with_another_input_is_a_conflict(state_dir: Path) -> None:
    probe = Probe()
    run_id = probe.interrupt({"day": 1}, state_dir, key="daily")
    with pytest.raises(KeyConflictError) as info:
        run(probe.wf, {"day": 2}, dir=state_dir, key="daily")
    err = info.value
    check_error(err)
    assert (err.run_id, err.key, err.bound_input, err.input) == (run_id, "daily", {"day": 1}, {"day": 2})
    assert run_id in str(err) and "{'day': 1}" in str(err) and "{'day': 2}" in str(err)
    assert "fresh=True" in err.hint
    assert probe.counts == {"first": 1, "second": 0}
    assert run_ids(state_dir) == [run_id]

    assert run(probe.wf, {"day": 2}, dir=state_dir, key="daily", fresh=True) == [{"day": 2}, "done"]
    new_id = probe.run_id
    assert new_id != run_id
    assert go(lambda: engine_for(state_dir).inspect("daily")).run_id == new_id


@pytest.mark.parametrize("key", ["", "a\x00b", "tab\there", "k" * 513, 42])
def test_invalid_keys_are_rejected_before_anything_runs(state_dir: Path, key: Any) -> None:
    probe = Probe()
    with pytest.raises(ValidationError) as info:
        run(probe.wf, 1, dir=state_dir, key=key)
    check_error(info.value)
    assert "invalid run key" in str(info.value)
    assert probe.counts == {"first": 0, "second": 0}
    assert not state_dir.exists()


def test_longest_key_is_accepted(state_dir: Path) -> None:
    probe = Probe()
    run(probe.wf, 1, dir=state_dir, key="k" * 512)
    assert go(lambda: engine_for(state_dir).inspect("k" * 512)).run_id == probe.run_id


# ---- run() and run_async() ------------------------------------------------------------------------


def test_run_inside_a_running_loop_names_run_async(state_dir: Path) -> None:
    probe = Probe()

    async def main() -> Any:
        with pytest.raises(ValidationError) as info:
            run(probe.wf, 1, dir=state_dir)
        check_error(info.value)
        assert "run_async" in info.value.hint
        return await run_async(probe.wf, 1, dir=state_dir)

    assert go(main) == [1, "done"]
    assert probe.counts == {"first": 1, "second": 1}


# ---- inspect and list -------------------------------------------------------------------------------


def test_inspect_and_list_by_id_and_by_key() -> None:
    probe = Probe()

    async def main() -> None:
        engine: Engine = create_engine(MemoryStorage(), clock=FakeClock())
        await engine.run(probe.wf, "a", key="alpha")
        alpha = probe.run_id
        probe.stop = True
        with pytest.raises(Stop):
            await engine.run(probe.wf, "b")
        beta = probe.run_id

        by_id = await engine.inspect(alpha)
        by_key = await engine.inspect("alpha")
        assert by_id == by_key
        assert (by_id.run_id, by_id.key, by_id.workflow, by_id.input, by_id.status) == (
            alpha, "alpha", "probe", "a", "completed")
        assert [(s.path, s.label, s.output) for s in by_id.steps] == [((0,), "first", "a"), ((1,), "second", "done")]
        other = await engine.inspect(beta)
        assert (other.status, other.key, [s.label for s in other.steps]) == ("interrupted", None, ["first"])

        assert {s.run_id for s in await engine.list()} == {alpha, beta}
        assert [s.run_id for s in await engine.list(key="alpha")] == [alpha]
        assert [s.run_id for s in await engine.list(status="completed")] == [alpha]
        assert [s.run_id for s in await engine.list(status="interrupted")] == [beta]
        assert len(await engine.list(workflow="probe")) == 2
        assert await engine.list(workflow="other") == []
        assert len(await engine.list(limit=1)) == 1

    go(main)


def test_unknown_run_is_run_not_found_with_hint(state_dir: Path) -> None:
    async def main() -> None:
        for engine in (create_engine(MemoryStorage()), engine_for(state_dir)):
            with pytest.raises(RunNotFoundError) as info:
                await engine.inspect("nope-20260101-00000000")
            check_error(info.value)
            assert "nope-20260101-00000000" in str(info.value)
            assert "durably list" in info.value.hint

    go(main)


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize("run_id", ["../x", "a/b", "..", "a\x00b", "x" * 1000, "/etc/passwd", "a/../../b", ".hidden"])
def test_run_id_escapes_are_rejected_before_touching_disk(tmp_path: Path, run_id: str) -> None:
    state_dir = tmp_path / "deep" / ".durably"
    probe = Probe()
    run(probe.wf, 1, dir=state_dir)
    before = tree(tmp_path)
    storage = FileStorage(state_dir)

    async def main() -> None:
        with pytest.raises(ValidationError) as info:
            await create_engine(storage).inspect(run_id)
        check_error(info.value)
        assert "invalid run id" in str(info.value)
        with pytest.raises(ValidationError):
            await create_engine(MemoryStorage()).inspect(run_id)

    go(main)
    for call in (storage.read, storage.held, storage.size, lambda r: storage.claim(r, "me", 1.0)):
        with pytest.raises(ValidationError):
            call(run_id)
    assert tree(tmp_path) == before
    assert not os.path.exists(tmp_path / "deep" / "x.jsonl") and not os.path.exists(state_dir / "x.jsonl")


class CompletesBeforeTheClaim(FileStorage):
    """A store where, just before the next claim, another process has retried the failed run to its end."""

    race = False

    def claim(self, run_id: str, owner: str, ttl: float, **options: Any) -> Any:
        if self.race:
            self.race = False
            end = log_format.encode(log_format.End(status="completed", result=["x", "by the other"], ts=0.0))
            assert self.amend(run_id, lambda records, where: end)
        return super().claim(run_id, owner, ttl, **options)


def failed_once(storage: FileStorage) -> tuple[Probe, Engine]:
    """A probe whose run of "x" on `storage` failed at its second step, and the engine that ran it."""
    probe = Probe()
    probe.fail_second = True
    engine = Engine(storage)
    with pytest.raises(Flaky):
        go(lambda: engine.run(probe.wf, "x"))
    probe.fail_second = False
    return probe, engine


def test_failed_run_that_completes_before_its_claim_is_not_reopened(tmp_path: Path) -> None:
    storage = CompletesBeforeTheClaim(tmp_path)
    probe, engine = failed_once(storage)
    storage.race = True
    assert go(lambda: engine.run(probe.wf, "x")) == ["x", "by the other"]
    assert probe.counts == {"first": 1, "second": 2}  # nothing ran again
    kinds = [rec["t"] for rec in go(lambda: engine.records(probe.run_id))]
    assert kinds[-1] == "end" and "reopen" not in kinds  # no claim written after its end, never reopened
    assert go(lambda: engine.run(probe.wf, "x")) == ["x", "done"]  # a completed run: the next call starts anew
    assert probe.counts == {"first": 2, "second": 3}


class Counting(FileStorage):
    """A store that counts the log reads and claims the engine asks of it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[str] = []

    def claim(self, run_id: str, owner: str, ttl: float, **options: Any) -> Any:
        self.asked.append("claim reopen" if options.get("reopen") else "claim")
        return super().claim(run_id, owner, ttl, **options)

    def read(self, run_id: str) -> Any:
        self.asked.append("read")
        return super().read(run_id)


def test_a_failed_run_is_claimed_reopened_with_one_read_of_its_log(tmp_path: Path) -> None:
    storage = Counting(tmp_path)
    probe, engine = failed_once(storage)
    storage.asked.clear()
    assert go(lambda: engine.run(probe.wf, "x")) == ["x", "done"]
    assert storage.asked == ["claim reopen"]  # not a refused claim, a read and a second claim
    probe.fail_second = True
    with pytest.raises(Flaky):
        go(lambda: engine.run(probe.wf, "y"))
    storage.asked.clear()
    probe.fail_second = False
    assert go(lambda: engine.retry(probe.run_id)) == ["y", "done"]
    assert [asked for asked in storage.asked if "claim" in asked] == ["claim reopen"]  # after the retry's own look
