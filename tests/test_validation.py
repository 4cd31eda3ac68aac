"""Bad arguments fail at the call with a hint, before anything runs; values that cannot be recorded name their path."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from helpers import check_error, go

from durably_py import (
    ArgumentError,
    Engine,
    FakeClock,
    MemoryStorage,
    Retry,
    SerializationError,
    ValidationError,
    attempt,
    create_engine,
    engine_for,
    run,
    workflow,
)


class Opaque:
    """A class instance that is not JSON."""


def new_engine() -> Engine:
    return create_engine(MemoryStorage(), clock=FakeClock())


def noop() -> str:
    return "ran"


# ---- Retry ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, words", [
    (lambda: Retry(attempts=0), "attempts must be an int >= 1"),
    (lambda: Retry(-1), "attempts must be an int >= 1"),
    (lambda: Retry(2.5), "attempts must be an int >= 1"),
    (lambda: Retry(True), "attempts must be an int >= 1"),
    (lambda: Retry(backoff="bogus"), "Retry(backoff='bogus') is not one of"),
    (lambda: Retry(base=-1), "Retry(base=) must be a number >= 0"),
    (lambda: Retry(base=float("nan")), "Retry(base=) must be a number >= 0"),
    (lambda: Retry(max=-0.5), "Retry(max=) must be a number >= 0"),
])
def test_bad_retry_is_rejected_at_construction(make: Callable[[], Retry], words: str) -> None:
    with pytest.raises(ValidationError) as info:
        make()
    check_error(info.value)
    assert words in str(info.value)


def test_good_retry_is_accepted() -> None:
    assert Retry(1).attempts == 1
    assert Retry(3, backoff="linear", base=0, max=0).delay(2) == 0


# ---- step options --------------------------------------------------------------------------------


class NoFields:
    """A class msgspec cannot build from JSON."""


BAD_STEP_OPTIONS: list[tuple[dict[str, Any], str]] = [
    ({"timeout": -1}, "timeout= of step 'noop' must be a number >= 0"),
    ({"timeout": 0}, "timeout= of step 'noop' must be > 0 seconds"),
    ({"timeout": float("nan")}, "timeout= of step 'noop' must be a number"),
    ({"timeout": "30s"}, "timeout= of step 'noop' must be a number"),
    ({"compensate": "undo"}, "compensate= of step 'noop' must be callable"),
    ({"replay": "maybe"}, "replay= of step 'noop' must be 'safe', 'idempotent', 'manual' or 'unsafe'"),
    ({"replay": "unsafe", "on_interrupt": "ignore"}, "on_interrupt= of step 'noop' must be 'attention' or 'raise'"),
    ({"on_interrupt": "raise"}, "on_interrupt= of step 'noop' applies to replay='manual'"),
    ({"retry": 3}, "retry= of step 'noop' must be a Retry(...)"),
    ({"concurrency_key": "api", "concurrency_limit": 0}, "concurrency_limit= of step 'noop' must be an int >= 1"),
    ({"concurrency_limit": 2}, "sets concurrency_limit= without concurrency_key="),
    ({"schema": 5}, "schema of step 'noop' must be a type"),
    ({"schema": NoFields}, "msgspec cannot build a NoFields"),
    ({"name": "labelled", "timeout": 0}, "timeout= of step 'labelled' must be > 0"),
]


@pytest.mark.parametrize("options, words", BAD_STEP_OPTIONS)
def test_bad_step_option_fails_at_the_call(options: dict[str, Any], words: str) -> None:
    calls = []
    caught: list[BaseException] = []

    def target() -> str:
        calls.append(1)
        return "ran"

    target.__qualname__ = "noop"

    @workflow
    async def wf(ctx: Any) -> str:
        try:
            ctx.step(target, **options)
        except ValidationError as exc:
            caught.append(exc)
        return await ctx.step(noop, name="after")

    async def main() -> None:
        engine = new_engine()
        assert await engine.run(wf) == "ran"
        steps = (await engine.inspect((await engine.list())[0].run_id)).steps
        assert [(s.path, s.label) for s in steps] == [((0,), "after")]

    go(main)
    assert calls == []
    assert len(caught) == 1
    check_error(caught[0])
    assert words in str(caught[0])


@pytest.mark.parametrize("keyword", ["x", "fn", "args", "self"])
def test_unknown_step_keyword_is_an_argument_error_whatever_its_name(keyword: str) -> None:
    caught: list[BaseException] = []

    @workflow
    async def wf(ctx: Any) -> str:
        try:
            ctx.step(noop, **{keyword: 1})
        except ArgumentError as exc:
            caught.append(exc)
        return await ctx.step(noop)

    assert go(lambda: new_engine().run(wf)) == "ran"
    assert len(caught) == 1
    check_error(caught[0])
    assert f"ctx.step() got unknown keyword argument(s) {keyword!r}" in str(caught[0])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_parallel_bad_concurrency_fails_at_the_call(bad: Any) -> None:
    calls = []

    @workflow
    async def wf(ctx: Any) -> None:
        ctx.parallel([lambda: ctx.step(calls.append, 1)], concurrency=bad)

    with pytest.raises(ValidationError) as info:
        go(lambda: new_engine().run(wf))
    check_error(info.value)
    assert "concurrency= must be an int >= 1" in str(info.value)
    assert calls == []


def test_parallel_item_that_is_neither_awaitable_nor_callable() -> None:
    @workflow
    async def wf(ctx: Any) -> None:
        await ctx.parallel([42])

    with pytest.raises(ValidationError) as info:
        go(lambda: new_engine().run(wf))
    check_error(info.value)
    assert "item 0 is 42" in str(info.value)


def test_negative_charge_fails_at_the_call() -> None:
    caught: list[BaseException] = []

    @workflow
    async def wf(ctx: Any) -> float:
        for bad in ({"usd": -1}, {"tokens": float("nan")}, {"units": "3"}):
            try:
                ctx.charge(**bad)
            except ValidationError as exc:
                caught.append(exc)
        ctx.charge(usd=0.5)
        return ctx.budget.spent("usd")

    assert go(lambda: new_engine().run(wf)) == 0.5
    assert len(caught) == 3
    for exc in caught:
        check_error(exc)
        assert "must be a non-negative number" in str(exc)


# ---- run() options -------------------------------------------------------------------------------


@pytest.mark.parametrize("options, words", [
    ({"budget": {"euro": 5}}, "unknown budget kind 'euro'"),
    ({"budget": {"usd": -1}}, "budget usd=-1 must be a finite number >= 0"),
    ({"budget": {"usd": float("inf")}}, "must be a finite number >= 0"),
    ({"budget": 5}, "budget= must be a dict"),
    ({"checkpoint_every": 0}, "checkpoint_every= must be an int >= 1"),
    ({"checkpoint_every": -3}, "checkpoint_every= must be an int >= 1"),
    ({"advisories": "loud"}, "advisories= must be None or 'silent'"),
])
def test_bad_run_option_fails_before_anything_runs(state_dir: Path, options: dict[str, Any], words: str) -> None:
    calls = []

    @workflow
    async def wf(ctx: Any) -> None:
        calls.append(1)

    with pytest.raises(ValidationError) as info:
        run(wf, 1, dir=state_dir, **options)
    check_error(info.value)
    assert words in str(info.value)
    assert calls == []
    assert go(lambda: engine_for(state_dir).list()) == []
    assert not (state_dir / "runs").exists()


@pytest.mark.parametrize("options", [{"checkpoint_every": 0}, {"budget": {"euro": 1}}])
def test_bad_engine_option_fails_at_create_engine(options: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as info:
        create_engine(MemoryStorage(), **options)
    check_error(info.value)


def test_not_a_workflow_is_rejected(state_dir: Path) -> None:
    with pytest.raises(ValidationError) as info:
        run(noop, dir=state_dir)
    check_error(info.value)
    assert "is not a workflow" in str(info.value)


# ---- @workflow -----------------------------------------------------------------------------------


def test_workflow_must_be_async() -> None:
    def plain(ctx: Any) -> None:
        return None

    with pytest.raises(ValidationError) as info:
        workflow(plain)
    check_error(info.value)
    assert "needs an `async def` function" in str(info.value)
    assert "async def" in info.value.hint


@pytest.mark.parametrize("params", [0, 3])
def test_workflow_takes_ctx_and_at_most_one_input(params: int) -> None:
    async def none() -> None:
        return None

    async def three(ctx: Any, a: Any, b: Any) -> None:
        return None

    fn = none if params == 0 else three
    with pytest.raises(ValidationError) as info:
        workflow(fn)
    check_error(info.value)
    assert f"takes {params} positional parameters" in str(info.value)
    assert "dict or dataclass" in info.value.hint


def test_workflow_bad_schema_fails_at_decoration() -> None:
    async def echo(ctx: Any, input: Any) -> Any:
        return input

    for option in ("input", "output"):
        with pytest.raises(ValidationError) as info:
            workflow(**{option: 5})(echo)
        check_error(info.value)
        assert f"{option} schema of workflow" in str(info.value)


# ---- serialization ----------------------------------------------------------------------------------


def cycle() -> dict[str, Any]:
    items: list[Any] = []
    items.append(items)
    return {"items": items}


UNRECORDABLE: list[tuple[Callable[[], Any], str, str]] = [
    (lambda: {"items": [1, {"when": datetime(2024, 1, 1)}]}, ".items[1].when", "naive datetime"),
    (lambda: {"tags": {"a", "b"}}, ".tags", "set"),
    (lambda: [1.0, float("nan")], "[1]", "non-finite float"),
    (lambda: {"blob": b"\x00"}, ".blob", "bytes"),
    (lambda: {"obj": Opaque()}, ".obj", "Opaque"),
    (cycle, ".items[0]", "contains itself"),
    (lambda: {"m": {1: "one"}}, ".m", "non-str key 1"),
    (lambda: {1, 2}, "", "set"),
]


@pytest.mark.parametrize("make, where, what", UNRECORDABLE)
def test_unrecordable_step_output_names_its_path(make: Callable[[], Any], where: str, what: str) -> None:
    calls = []

    def produce() -> Any:
        calls.append(1)
        return make()

    @workflow
    async def wf(ctx: Any) -> Any:
        return await ctx.step(produce, name="produce", retry=Retry(3, backoff="none"))

    with pytest.raises(SerializationError) as info:
        go(lambda: new_engine().run(wf))
    err = info.value
    check_error(err)
    assert err.path == f"output{where}"
    assert f"cannot record output{where}: it is" in str(err) and what in str(err)
    assert "returned by step 'produce' at path (0,)" in err.__notes__
    assert calls == [1]


@pytest.mark.parametrize("make, where, what", UNRECORDABLE)
def test_unrecordable_workflow_input_names_its_path(state_dir: Path, make: Callable[[], Any], where: str,
                                                     what: str) -> None:
    calls = []

    @workflow
    async def wf(ctx: Any, input: Any) -> None:
        calls.append(1)

    with pytest.raises(SerializationError) as info:
        run(wf, make(), dir=state_dir)
    check_error(info.value)
    assert info.value.path == f"input{where}"
    assert what in str(info.value)
    assert calls == []
    assert not (state_dir / "runs").exists()


def test_unrecordable_workflow_result_names_result() -> None:
    @workflow
    async def wf(ctx: Any) -> Any:
        return {"done": {1, 2}}

    with pytest.raises(SerializationError) as info:
        go(lambda: new_engine().run(wf))
    check_error(info.value)
    assert info.value.path == "result.done"


def test_unrecordable_output_is_a_failed_step_that_resumes_after_the_fix() -> None:
    fixed = [False]
    numbers: list[int] = []
    counts = {"before": 0}

    def before() -> str:
        counts["before"] += 1
        return "kept"

    def produce() -> Any:
        numbers.append(attempt().number)
        return sorted({3, 1, 2}) if fixed[0] else {3, 1, 2}

    @workflow
    async def wf(ctx: Any) -> list[Any]:
        return [await ctx.step(before), await ctx.step(produce, name="produce", retry=Retry(4, backoff="none"))]

    async def main() -> None:
        engine = new_engine()
        with pytest.raises(SerializationError):
            await engine.run(wf)
        run_id = (await engine.list())[0].run_id
        state = await engine.inspect(run_id)
        assert state.status == "failed"
        assert [(s.label, s.status, s.attempts) for s in state.steps][1] == ("produce", "failed", 1)
        assert state.steps[1].error is not None and "cannot record output" in state.steps[1].error["message"]
        fixed[0] = True
        assert await engine.run(wf) == ["kept", [1, 2, 3]]
        assert [s.run_id for s in await engine.list()] == [run_id]

    go(main)
    assert numbers == [1, 1]
    assert counts == {"before": 1}


def test_unrecordable_stash_names_stash() -> None:
    def produce() -> None:
        attempt().stash({"seen": {1}})

    @workflow
    async def wf(ctx: Any) -> Any:
        return await ctx.step(produce)

    with pytest.raises(SerializationError) as info:
        go(lambda: new_engine().run(wf))
    check_error(info.value)
    assert info.value.path == "stash.seen"


def test_bad_step_call_fails_the_run_and_the_fixed_call_resumes_it(state_dir: Path) -> None:
    bad = [True]
    counts = {"noop": 0}

    def counted() -> str:
        counts["noop"] += 1
        return "ran"

    @workflow
    async def wf(ctx: Any) -> list[str]:
        first = await ctx.step(counted, name="first")
        second = await ctx.step(counted, name="second", timeout=0 if bad[0] else 5)
        return [first, second]

    with pytest.raises(ValidationError):
        run(wf, dir=state_dir)
    bad[0] = False
    assert run(wf, dir=state_dir) == ["ran", "ran"]
    assert counts == {"noop": 2}
