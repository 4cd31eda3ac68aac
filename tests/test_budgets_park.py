"""Budgets that meter and park: a step whose result carries a model's usage (OpenAI- or Anthropic-style, dicts or
small objects) is charged by itself; a run out of budget parks `over_budget` (not failed) with what it spent and
on what, until `durably budget RUN --raise` / `Engine.raise_budget` / the console lets it go on; reservations
hold budget while a call runs; children spend their parent's budget; the spend is counted once across replays,
parks and SIGKILLed workers. Through `run()`, `run(wait=False)`, a `durably worker` process and `TestEngine`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import durably, wait_until

from durably_py import (
    BudgetExceededError,
    Engine,
    FileStorage,
    MemoryStorage,
    RunParkedError,
    ValidationError,
    create_engine,
    run,
    set_prices,
    usage_extractor,
    workflow,
)
from durably_py._authoring import usage as usage_module
from durably_py.records import kind_of
from durably_py.testing import TestEngine

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CALLS: list[str] = []


def openai_chat(i: int) -> dict[str, Any]:
    CALLS.append(f"chat{i}")
    return {"model": "gpt-4o-2024-08-06", "choices": [{"message": {"content": f"c{i}"}}],
            "usage": {"prompt_tokens": 1000, "completion_tokens": 500, "total_tokens": 1500}}


@dataclass
class Usage:
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0


@dataclass
class Message:  # an Anthropic-style response object (or the Responses API's, which has the same usage names)
    model: str
    content: str
    usage: Usage


def anthropic(i: int) -> Message:
    CALLS.append(f"claude{i}")
    return Message("claude-x", f"m{i}", Usage(800, 200, cache_read_input_tokens=1000))


@workflow
async def metered(ctx: Any) -> list[Any]:
    a = await ctx.step(openai_chat, 1, name="chat")
    b = await ctx.step(anthropic, 2, name="claude", schema=Message)
    c = await ctx.step(lambda: {"usage": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15}}, name="resp")
    d = await ctx.step(lambda: {"billed": 7}, name="custom", charge=lambda r: {"units": r["billed"]})
    e = await ctx.step(openai_chat, 3, name="free", charge=False)
    return [a["choices"][0]["message"]["content"], b.content, c["usage"]["total_tokens"], d, e["model"]]


@pytest.fixture(autouse=True)
def prices() -> Any:
    set_prices({"gpt-4o": (2.5, 10.0), "claude-x": (3.0, 15.0)})
    yield
    usage_module._PRICES.clear()
    usage_module.EXTRACTORS.clear()
    CALLS.clear()


def test_openai_and_anthropic_responses_are_charged_by_themselves(tmp_path: Path) -> None:
    engine = create_engine(FileStorage(tmp_path / ".durably"))
    out = asyncio.run(engine.run(metered, budget={"usd": 10}))
    assert out == ["c1", "m2", 15, {"billed": 7}, "gpt-4o-2024-08-06"]
    state = asyncio.run(engine.inspect(list_one(engine)))
    chat = (1000 * 2.5 + 500 * 10.0) / 1e6
    claude = ((800 + 1000) * 3.0 + 200 * 15.0) / 1e6
    assert state.spent_by["chat"] == pytest.approx({"tokens": 1500, "usd": chat})
    assert state.spent_by["claude"] == pytest.approx({"tokens": 2000, "usd": claude})  # cache tokens count
    assert state.spent_by["resp"] == {"tokens": 15}  # no model: no price, tokens only
    assert state.spent_by["custom"] == {"units": 7} and "free" not in state.spent_by
    assert state.spent["usd"] == pytest.approx(chat + claude) and state.spent["tokens"] == 3515
    before = asyncio.run(engine.records(state.run_id))
    again = asyncio.run(engine.run(metered, budget={"usd": 10}))  # completed: found, nothing recounted
    assert again == out and asyncio.run(engine.records(state.run_id)) == before
    print(f"charged: {state.spent}")


def test_a_registered_extractor_comes_first_and_a_broken_one_is_named(tmp_path: Path) -> None:
    @usage_extractor
    def billing(result: Any) -> dict[str, float] | None:
        return {"units": result["cost_units"]} if isinstance(result, dict) and "cost_units" in result else None

    @workflow
    async def custom(ctx: Any) -> Any:
        return await ctx.step(lambda: {"cost_units": 3, "usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    engine = create_engine(MemoryStorage())
    asyncio.run(engine.run(custom))
    assert asyncio.run(engine.inspect(list_one(engine))).spent["units"] == 3

    @workflow
    async def bad(ctx: Any) -> Any:
        return await ctx.step(lambda: 1, charge="yes")

    with pytest.raises(ValidationError, match="charge= of step"):
        asyncio.run(engine.run(bad))

    @workflow
    async def broken(ctx: Any) -> Any:
        return await ctx.step(lambda: 1, charge=lambda r: r["nope"])

    with pytest.raises(ValidationError, match="reading the usage of step"):
        asyncio.run(engine.run(broken))


def list_one(engine: Engine) -> str:
    runs = asyncio.run(engine.list())
    return runs[0].run_id


# ---- parking, in every mode ----------------------------------------------------------------------------

STEPS = 5


def model(i: int) -> dict[str, Any]:
    CALLS.append(f"model{i}")
    return {"usage": {"input_tokens": 800, "output_tokens": 200}, "text": f"t{i}"}


@workflow
async def agent(ctx: Any, n: int) -> list[str]:
    return [(await ctx.step(model, i, name="model"))["text"] for i in range(n)]


def test_testengine_parks_over_budget_and_a_raise_finishes_it() -> None:
    te = TestEngine()
    res = te.sync.run(agent, STEPS, budget={"tokens": 2500})
    assert res.status == "over_budget" and res.error is None and CALLS == ["model0", "model1", "model2"]
    state = te.sync.inspect(res.run_id)
    assert state.status == "over_budget" and state.over_budget is not None
    assert state.over_budget["spent"]["tokens"] == 3000 and state.over_budget["by"] == {"model": {"tokens": 3000}}
    done = te.sync.raise_budget(res.run_id, tokens=10_000)
    assert done.status == "completed" and done.result == [f"t{i}" for i in range(STEPS)]
    final = te.sync.inspect(res.run_id)
    assert final.spent["tokens"] == 5000 and final.budget == {"tokens": 12_500} and len(CALLS) == STEPS


def test_on_exhausted_raise_keeps_budget_exceeded_error() -> None:
    engine = create_engine(MemoryStorage(), on_exhausted="raise")
    with pytest.raises(BudgetExceededError) as caught:
        asyncio.run(engine.run(agent, STEPS, budget={"tokens": 2500}))
    assert "durably budget" in caught.value.hint
    with pytest.raises(ValidationError, match="on_exhausted="):
        create_engine(MemoryStorage(), on_exhausted="stop")
    parking = create_engine(MemoryStorage())

    async def twice() -> None:  # per call: the second run, in the same task, parks again
        with pytest.raises(BudgetExceededError):
            await parking.run(agent, STEPS, budget={"tokens": 2500}, on_exhausted="raise")
        with pytest.raises(RunParkedError):
            await parking.run(agent, STEPS, budget={"tokens": 2500}, key="second", wait=False)

    asyncio.run(twice())


def test_run_wait_false_parks_with_a_hint_and_resumes_once_raised(tmp_path: Path) -> None:
    state_dir = tmp_path / ".durably"
    with pytest.raises(RunParkedError) as parked:
        run(agent, STEPS, budget={"tokens": 2500}, dir=state_dir, wait=False)
    assert parked.value.status == "over_budget" and "durably budget" in parked.value.hint
    run_id = parked.value.run_id
    listed = json.loads(durably("list", "--status", "over_budget", "--json", "--dir", str(state_dir)).stdout)
    assert [r["run_id"] for r in listed] == [run_id]
    assert listed[0]["over_budget"]["by"] == {"model": {"tokens": 3000.0}} and listed[0]["over_budget"]["kind"] == "tokens"
    shown = json.loads(durably("budget", run_id, "--json", "--dir", str(state_dir), check=True).stdout)
    assert shown["status"] == "over_budget" and shown["spent_by"] == {"model": {"tokens": 3000.0}}
    before = durably("logs", run_id, "-o", "jsonl", "--dir", str(state_dir), check=True).stdout.splitlines()
    assert len(before) > 5
    for bad in (["--raise", "euro=5"], ["--raise", "usd"], ["--raise", "usd=5", "--set", "usd=5"],
                ["--raise", "usd=5", "--cancel"], ["--raise", "usd=-1"]):
        done = durably("budget", run_id, *bad, "--dir", str(state_dir))
        assert done.returncode == 2 and "hint:" in done.stderr, (bad, done.stderr)
    assert durably("logs", run_id, "-o", "jsonl", "--dir", str(state_dir)).stdout.splitlines() == before
    raised = asyncio.run(create_engine(FileStorage(state_dir)).raise_budget(run_id, tokens=5000))
    assert raised.status == "interrupted" and raised.budget == {"tokens": 7500}
    assert run(agent, STEPS, budget={"tokens": 2500}, dir=state_dir, wait=False) == [f"t{i}" for i in range(STEPS)]
    final = asyncio.run(create_engine(FileStorage(state_dir)).inspect(run_id))
    assert final.spent["tokens"] == 5000 and final.budget == {"tokens": 7500} and len(CALLS) == STEPS


def test_run_waits_over_budget_until_the_cli_raises_it(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    state_dir = tmp_path / ".durably"
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(run(agent, STEPS, budget={"tokens": 2500}, dir=state_dir)))
    thread.start()
    engine = create_engine(FileStorage(state_dir))

    def status() -> str | None:
        runs = asyncio.run(engine.list())
        return runs[0].status if runs else None

    try:
        wait_until(lambda: status() == "over_budget", seconds=30)
        run_id = asyncio.run(engine.list())[0].run_id
        assert engine.storage.held(run_id)  # waiting in its own process, as run() waits for a signal
        time.sleep(0.5)
        assert CALLS == ["model0", "model1", "model2"]
        said = capfd.readouterr().err
        assert f"run {run_id} is over budget before step 'model'" in said and f"durably budget {run_id} --raise" in said
        done = durably("budget", run_id, "--raise", "tokens=5000", "--json", "--dir", str(state_dir), check=True)
        assert json.loads(done.stdout)["action"] == "raised"
    finally:
        thread.join(timeout=60)
    assert out == [[f"t{i}" for i in range(STEPS)]]
    final = asyncio.run(engine.inspect(run_id))
    assert final.status == "completed" and final.spent["tokens"] == 5000 and final.budget == {"tokens": 7500}


# ---- reservations ---------------------------------------------------------------------------------------

RUNNING = {"now": 0, "most": 0}


async def call(i: int) -> dict[str, Any]:
    RUNNING["now"] += 1
    RUNNING["most"] = max(RUNNING["most"], RUNNING["now"])
    await asyncio.sleep(0.1)
    RUNNING["now"] -= 1
    CALLS.append(f"call{i}")
    return {"usage": {"prompt_tokens": 50, "completion_tokens": 50, "total_tokens": 100}}


@workflow
async def reserved(ctx: Any) -> int:
    results = await ctx.parallel([ctx.step(call, i, name="call", reserve={"tokens": 600}) for i in range(3)])
    return len(results)


def test_a_reservation_that_does_not_fit_waits_and_the_actual_charge_replaces_it() -> None:
    engine = create_engine(MemoryStorage())
    RUNNING.update(now=0, most=0)
    assert asyncio.run(engine.run(reserved, budget={"tokens": 1000})) == 3
    assert RUNNING["most"] == 1  # 600 + 600 > 1000: one call at a time; each charged 100, not 600
    state = asyncio.run(engine.inspect(list_one(engine)))
    assert state.spent["tokens"] == 300 and len(CALLS) == 3
    RUNNING.update(now=0, most=0)  # a run that may park (wait=False) waits for a reservation, it does not park
    assert asyncio.run(engine.run(reserved, budget={"tokens": 1000}, key="parkable", wait=False)) == 3
    assert RUNNING["most"] == 1 and len(CALLS) == 6

    @workflow
    async def big(ctx: Any) -> Any:
        return await ctx.step(call, 9, name="big", reserve={"tokens": 5000})

    with pytest.raises(RunParkedError) as parked:
        asyncio.run(engine.run(big, budget={"tokens": 1000}, wait=False))
    assert parked.value.status == "over_budget" and "call9" not in CALLS  # the call did not start
    asyncio.run(engine.raise_budget(parked.value.run_id, tokens=5000))
    asyncio.run(engine.run(big, budget={"tokens": 1000}))
    assert asyncio.run(engine.inspect(parked.value.run_id)).spent["tokens"] == 100


# ---- a parent's budget, shared with its children -------------------------------------------------------

@workflow(name="budget_kid")  # a name of its own: other test modules register "kid" in the same process
async def kid(ctx: Any, name: str) -> int:
    for i in range(4):
        await ctx.step(model, i, name=f"{name} model")
    return 4


@workflow(name="budget_mom")
async def mom(ctx: Any) -> list[int]:
    kids = [await ctx.spawn(kid, "a"), await ctx.spawn(kid, "b")]
    return [r.value for r in await ctx.join_all(kids)]


def test_two_children_spend_their_parents_budget(tmp_path: Path) -> None:
    state_dir = tmp_path / ".durably"
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(run(mom, budget={"tokens": 3500}, dir=state_dir)))
    thread.start()
    engine = create_engine(FileStorage(state_dir))
    try:
        def settled() -> bool:  # every child parked over budget or done (which first depends on the scheduling)
            kids = [r for r in asyncio.run(engine.list()) if r.parent is not None]
            return len(kids) == 2 and all(r.status in ("over_budget", "completed") for r in kids) \
                and any(r.status == "over_budget" for r in kids)

        wait_until(settled, seconds=60)
        spent = sum(s.spent["tokens"] for s in asyncio.run(engine.list()))
        assert 4000 <= spent <= 5000, spent  # checked before each call: at most one call past it per child
        parent = next(s for s in asyncio.run(engine.list()) if s.parent is None)
        child = asyncio.run(engine.list(status="over_budget"))[0]
        assert child.over_budget is not None and child.over_budget["owner"] == parent.run_id
        raised = durably("budget", child.run_id, "--raise", "tokens=10000", "--json", "--dir", str(state_dir),
                         check=True)  # a child raises the budget it spends: its parent's
        assert json.loads(raised.stdout)["budget"] is None
    finally:
        thread.join(timeout=60)
    assert out == [[4, 4]]
    states = [asyncio.run(engine.inspect(s.run_id)) for s in asyncio.run(engine.list())]
    assert sum(s.spent["tokens"] for s in states) == 8000 and len(CALLS) == 8  # each call counted once
    assert next(s for s in states if s.parent is None).budget == {"tokens": 13_500}


def test_queued_children_park_holding_no_worker_and_go_on_once_their_parent_is_raised(tmp_path: Path) -> None:
    async def main() -> tuple[list[str], Any, int]:
        engine = create_engine(FileStorage(tmp_path / ".durably"))
        handle = await engine.enqueue(mom, budget={"tokens": 3500})
        await engine.start(poll=0.05)
        try:
            for _ in range(600):
                kids = [r for r in await engine.list() if r.parent is not None]
                if len(kids) == 2 and all(r.status in ("over_budget", "completed") for r in kids) \
                        and any(r.status == "over_budget" for r in kids):
                    break
                await asyncio.sleep(0.05)
            parked = sorted(r.status for r in await engine.list())
            assert not any(engine.storage.held(r.run_id) for r in await engine.list())  # no slot held
            await engine.raise_budget(handle.run_id, tokens=10_000)
            result = await asyncio.wait_for(engine.join(handle), 60)
            spent = 0.0
            for state in await engine.list():
                spent += (await engine.inspect(state.run_id)).spent["tokens"]
            return parked, result, int(spent)
        finally:
            await engine.stop()

    parked, result, spent = asyncio.run(main())
    assert "over_budget" in parked and "waiting" in parked  # the parent waits in its join, the child over budget
    assert result == [4, 4] and spent == 8000 and len(CALLS) == 8


# ---- a durably worker process, SIGKILLed, parked, raised from the CLI -------------------------------------

FLOW = textwrap.dedent('''
    import os, pathlib, time
    from durably_py import workflow

    HERE = pathlib.Path(os.environ["BUDGETS"])

    def model(i):
        with open(HERE / "calls.log", "a") as out:
            out.write(f"{i}\\n")
        time.sleep(0.3)
        return {"usage": {"input_tokens": 800, "output_tokens": 200}, "text": f"t{i}"}

    @workflow
    async def agent(ctx, n):
        return [(await ctx.step(model, i, name="model"))["text"] for i in range(n)]
''')


def test_a_worker_parks_it_holding_no_slot_survives_a_sigkill_and_finishes_once_raised(tmp_path: Path) -> None:
    (tmp_path / "budget_flow.py").write_text(FLOW)
    state_dir = tmp_path / ".durably"
    sys.path.insert(0, str(tmp_path))
    os.environ["BUDGETS"] = str(tmp_path)
    try:
        import budget_flow as flow  # type: ignore[import-not-found]
        storage = FileStorage(state_dir)
        handle = asyncio.run(Engine(storage).enqueue(flow.agent, 6, budget={"tokens": 3500}))
    finally:
        sys.path.remove(str(tmp_path))
    run_id = handle.run_id
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "BUDGETS": str(tmp_path)}

    def worker() -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "durably_py.cli", "worker", "--import", "budget_flow.py", "--lease",
                                 "2", "--poll", "0.05", "-c", "1", "--dir", str(state_dir)], cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def oks() -> int:
        log = storage.read(run_id)
        return sum(1 for r in (log.records if log else []) if kind_of(r) == "ok")

    first = worker()
    try:
        wait_until(lambda: oks() >= 2, seconds=60)
    finally:
        first.kill()  # SIGKILL mid-run, inside a call
        first.communicate(timeout=30)
    killed_at = oks()
    assert 2 <= killed_at < 6
    second = worker()
    try:
        wait_until(lambda: asyncio.run(Engine(storage).inspect(run_id)).status == "over_budget", seconds=60)
        time.sleep(1.0)
        state = asyncio.run(Engine(storage).inspect(run_id))
        assert state.status == "over_budget" and state.spent["tokens"] == 4000
        assert not storage.held(run_id)  # parked: no worker slot, no lease
        entry = storage.entry(run_id)
        assert entry is not None and entry.at is None
        other = asyncio.run(Engine(storage).enqueue(flow.agent, 1, key="other")).run_id
        wait_until(lambda: asyncio.run(Engine(storage).inspect(other)).status == "completed", seconds=60)
        assert asyncio.run(Engine(storage).inspect(run_id)).status == "over_budget"  # the one slot was free for it
        done = durably("budget", run_id, "--raise", "tokens=5000", "--dir", str(state_dir))
        assert done.returncode == 0, done.stderr
        wait_until(lambda: asyncio.run(Engine(storage).inspect(run_id)).status == "completed", seconds=60)
    finally:
        second.send_signal(signal.SIGTERM)
        second.communicate(timeout=30)
    final = asyncio.run(Engine(storage).inspect(run_id))
    calls = (tmp_path / "calls.log").read_text().split()
    assert final.result == [f"t{i}" for i in range(6)]
    assert final.spent["tokens"] == 6000, final.spent  # six recorded steps, each charged once
    assert final.spent_by == {"model": {"tokens": 6000.0}} and final.attempt >= 3  # two workers, one after a raise
    assert len(calls) >= 6
    print(f"killed after {killed_at} steps; {len(calls)} calls made; spent {final.spent['tokens']:g} tokens")


# ---- the console -----------------------------------------------------------------------------------------

def test_the_console_raises_an_over_budget_run_and_it_finishes(tmp_path: Path) -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from starlette.testclient import TestClient

    from durably_py.ui import create_app

    state_dir = tmp_path / ".durably"
    with pytest.raises(RunParkedError) as parked:
        run(agent, STEPS, budget={"tokens": 2500}, dir=state_dir, wait=False)
    run_id = parked.value.run_id
    engine = Engine(FileStorage(state_dir))
    with TestClient(create_app(engine)) as client:
        page = client.get(f"/api/runs/{run_id}").json()
        assert page["status"] == "over_budget" and page["over_budget"]["by"] == {"model": {"tokens": 3000.0}}
        bad = client.post(f"/api/runs/{run_id}/budget", json={"raise": {"euro": 5}})
        assert bad.status_code == 400 and "hint" in bad.json()
        answer = client.post(f"/api/runs/{run_id}/budget", json={"raise": {"tokens": 5000}})
        assert answer.status_code == 200, answer.text
        wait_until(lambda: client.get(f"/api/runs/{run_id}").json()["status"] == "completed", seconds=30)
    final = asyncio.run(engine.inspect(run_id))
    assert final.spent["tokens"] == 5000 and final.budget == {"tokens": 7500}


# ---- a kill loop: SIGKILLed at random points, parked and raised, the spend counted once ----------------------

SCRIPT = textwrap.dedent('''
    import sys, time
    from durably_py import RunParkedError, run, workflow

    def model(i):
        time.sleep(0.15)
        return {"usage": {"input_tokens": 800, "output_tokens": 200}, "text": f"t{i}"}

    @workflow
    async def agent(ctx, n):
        return [(await ctx.step(model, i, name="model"))["text"] for i in range(n)]

    if __name__ == "__main__":
        try:
            print(len(run(agent, 30, budget={"tokens": 15500}, dir=sys.argv[1], wait=False)))
        except RunParkedError as parked:
            print("parked", parked.run_id)
''')


@pytest.mark.slow
def test_a_run_killed_again_and_again_and_raised_counts_each_recorded_call_once(tmp_path: Path) -> None:
    import random

    (tmp_path / "agent.py").write_text(SCRIPT)
    state = tmp_path / ".durably"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    rng = random.Random(23)
    kills = parks = 0
    for _ in range(60):
        proc = subprocess.Popen([sys.executable, str(tmp_path / "agent.py"), str(state)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=env, cwd=tmp_path)
        try:
            out, _ = proc.communicate(timeout=rng.uniform(0.4, 1.0))
        except subprocess.TimeoutExpired:
            proc.kill()  # SIGKILL at a random point
            proc.communicate()
            kills += 1
            continue
        if out.startswith("parked"):
            parks += 1
            done = durably("budget", out.split()[1], "--raise", "tokens=10000", "--dir", str(state))
            assert done.returncode == 0, done.stderr
            continue
        assert out.strip() == "30"
        break
    else:
        pytest.fail("the run never finished")
    engine = create_engine(FileStorage(state))
    final = asyncio.run(engine.inspect(asyncio.run(engine.list())[0].run_id))
    assert final.status == "completed" and parks >= 1 and kills >= 3
    assert final.spent["tokens"] == 30_000, final.spent  # 30 recorded calls, each charged once
    print(f"{kills} SIGKILLs, {parks} parks raised, spent {final.spent['tokens']:g} tokens for 30 calls")
