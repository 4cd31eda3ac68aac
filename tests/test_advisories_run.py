"""Advisories raised by real runs: emitted at crossings, printed once, stored and shown by inspect."""

import asyncio

from helpers import Stop

from durably_py import MemoryStorage, Retry, create_engine, workflow


def engine():
    return create_engine(MemoryStorage())


def run(eng, wf, *args, **kwargs):
    return asyncio.run(eng.run(wf, *args, **kwargs))


@workflow
async def many_steps(ctx, n):
    total = 0
    for i in range(n):
        total += await ctx.step(lambda i=i: i, name="item")
    return total


def test_loop_suggested_is_printed_once_and_stored(capsys) -> None:
    eng = engine()
    seen = []
    assert run(eng, many_steps, 150, on_advisory=seen.append) == sum(range(150))
    err = capsys.readouterr().err
    assert err.count("LOOP_SUGGESTED") == 1
    assert [a.code for a in seen] == ["LOOP_SUGGESTED"]
    assert seen[0].level == "info" and seen[0].hint and seen[0].docs.endswith("#loop_suggested")
    (state,) = asyncio.run(eng.list())
    inspected = asyncio.run(eng.inspect(state.run_id))
    assert [a["code"] for a in inspected.advisories] == ["LOOP_SUGGESTED"]


def test_silent_advisories_still_reach_the_callback(capsys) -> None:
    seen = []
    run(engine(), many_steps, 120, advisories="silent", on_advisory=seen.append)
    assert "LOOP_SUGGESTED" not in capsys.readouterr().err
    assert [a.code for a in seen] == ["LOOP_SUGGESTED"]


def test_a_resumed_run_does_not_announce_again(capsys) -> None:
    state = {"stop": True}

    @workflow
    async def wf(ctx):
        for i in range(110):
            await ctx.step(lambda i=i: i, name="item")
        if state["stop"]:
            raise Stop()
        return "done"

    eng = engine()
    try:
        run(eng, wf)
    except Stop:
        pass
    assert capsys.readouterr().err.count("LOOP_SUGGESTED") == 1
    state["stop"] = False
    seen = []
    assert run(eng, wf, on_advisory=seen.append) == "done"
    assert seen == []
    assert "LOOP_SUGGESTED" not in capsys.readouterr().err


def test_budget_near_crosses_info_then_warn() -> None:
    @workflow
    async def spend(ctx):
        for usd in (0.5, 0.35, 0.12):
            ctx.charge(usd=usd)
            await ctx.step(lambda: None, name="work")
        return ctx.budget.spent("usd")

    seen = []
    assert run(engine(), spend, budget={"usd": 1.0}, advisories="silent", on_advisory=seen.append) == 0.97
    assert [(a.code, a.level) for a in seen] == [("BUDGET_NEAR", "info"), ("BUDGET_NEAR", "warn")]


def test_retry_storm_when_most_attempts_fail() -> None:
    def always_fails():
        raise ConnectionError("down")

    @workflow
    async def storm(ctx):
        results = await ctx.parallel(
            [ctx.step(always_fails, name=f"call {i}", retry=Retry(4, backoff="none")) for i in range(5)]
        )
        return sum(1 for r in results if not r.ok)

    seen = []
    assert run(engine(), storm, advisories="silent", on_advisory=seen.append) == 5
    assert [a.code for a in seen] == ["RETRY_STORM"]


def test_fanout_ceiling_names_the_width() -> None:
    @workflow
    async def wide(ctx):
        results = await ctx.parallel([ctx.step(lambda i=i: i, name="leaf") for i in range(1000)])
        return len(results)

    seen = []
    assert run(engine(), wide, advisories="silent", on_advisory=seen.append) == 1000
    assert [a.code for a in seen] == ["FANOUT_CEILING"]
    assert "1000" in seen[0].msg
