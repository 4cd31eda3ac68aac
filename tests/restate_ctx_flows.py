"""A workflow reporting what it sees of `ctx` and `attempt()`: the same answers on Restate and on FileStorage."""

from __future__ import annotations

from durably_py import AttemptContext, DurablyError, WorkflowContext, attempt, workflow


def whose_attempt() -> list:
    att = attempt()
    return [type(att).__name__, isinstance(att, AttemptContext), att.number, att.operation_id.rpartition("/")[2],
            att.stashed, att.cancelled]


async def count(it_state: int, it) -> object:
    await it.step(whose_attempt)
    return it.done(it_state) if it_state >= 2 else it_state + 1


def add(a: int, b: int) -> int:
    return a + b


@workflow
async def one_context(ctx) -> dict:
    """`ctx` is the one `WorkflowContext` in every mode; its checks and paths are the same in each."""
    seen: dict = {"ctx": [type(ctx).__mro__[-2].__name__, isinstance(ctx, WorkflowContext)],  # below object
                  "attempt": ctx.attempt, "scheduled_at": ctx.scheduled_at}
    seen["in_step"] = await ctx.step(whose_attempt)
    seen["loop"] = await ctx.loop(0, count)
    seen["parallel"] = [r.value for r in await ctx.parallel([ctx.step(add, 1, i) for i in range(3)])]
    for name, call in {"unknown keyword": lambda: ctx.step(add, 1, 2, retries=3),
                       "bad retry": lambda: ctx.step(add, 1, 2, retry=3),
                       "bad signal name": lambda: ctx.wait_for("$x"),
                       "bad sleep": lambda: ctx.sleep(-1),
                       "bad handle": lambda: ctx.join("run-1")}.items():
        try:
            call()
            seen[name] = None
        except DurablyError as exc:
            seen[name] = f"{type(exc).__name__}: {exc.message}"
    seen["after"] = await ctx.step(whose_attempt)  # the checks above allocated no path
    return seen
