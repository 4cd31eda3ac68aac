"""Lease epochs: an owner whose lease lapsed and was taken over can no longer write to the run."""

import asyncio

import pytest

from durably_py import LeaseLostError, SqliteStorage, create_engine, workflow


def test_a_lapsed_owner_is_fenced_off_and_the_new_owner_finishes(tmp_path) -> None:
    db = tmp_path / "runs.db"
    executed: list[tuple[str, str]] = []
    undone: list[str] = []

    async def slow(who: str) -> str:
        executed.append(("slow", who))
        await asyncio.sleep(2.6 if who == "A" else 0)
        return who

    def quick(x: str) -> str:
        executed.append(("quick", x))
        return x

    def make(who: str):
        @workflow(name="fenced")
        async def fenced(ctx):
            first = await ctx.step(quick, "q", compensate=undone.append)
            second = await ctx.step(slow, who, name="slow")
            return f"{first}-{second}"

        return fenced

    # A's renewals of its 2 s lease never reach the store (as a laptop asleep would not); B takes the run over.
    a = create_engine(SqliteStorage(db), lease=2)
    a.storage.heartbeat = lambda lease, ttl: True  # type: ignore[method-assign]
    b = create_engine(SqliteStorage(db), lease=30)

    async def main():
        first = asyncio.ensure_future(a.run(make("A"), key="job"))
        await asyncio.sleep(0.1)
        second = await b.run(make("B"), key="job")
        with pytest.raises(LeaseLostError) as info:
            await first
        return second, info.value

    result, lost = asyncio.run(main())
    assert result == "q-B"
    assert lost.hint
    assert executed.count(("quick", "q")) == 1
    assert undone == []
    state = asyncio.run(b.inspect("job"))
    assert state.status == "completed" and state.attempt == 2
    assert [s.output for s in state.steps] == ["q", "B"]
