"""`durably_py.agents.pydantic_ai`: a Pydantic AI agent in a workflow, each model request and each tool call a step.

Offline: the agents run on Pydantic AI's `FunctionModel`, whose function counts every request it answers in the
effects file, so a repeated model request shows there as a repeated line, like a repeated tool call."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("pydantic_ai")

from helpers import check_error  # noqa: E402
from modes import (  # noqa: E402
    Effects,
    cli,
    cli_process,
    effects_fixture,
    flows_fixture,
    kill,
    state_of,
    wait_until,
)

from durably_py import NotSupportedError, RunParkedError, create_engine, workflow  # noqa: E402
from durably_py.agents.pydantic_ai import DurableAgent  # noqa: E402
from durably_py.errors import ArgumentError  # noqa: E402
from durably_py.testing import TestEngine  # noqa: E402

SCRIPT = '''
import os
import time

from pydantic_ai import Agent
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import FunctionModel

from durably_py import attempt, workflow
from durably_py.agents.pydantic_ai import DurableAgent, TokenPrice


def returns(messages):
    return [p for m in messages for p in m.parts if p.part_kind == "tool-return"]


def plan(messages, info):
    """Tool A, then tool B, then the answer: one step of the plan per request."""
    done = returns(messages)
    mark("request", len(done))
    time.sleep(float(os.environ.get("PAI_DELAY", "0")))
    if not done:
        return ModelResponse(parts=[ToolCallPart("tool_a", {"x": 2}, tool_call_id="call-a")])
    if len(done) == 1:
        return ModelResponse(parts=[ToolCallPart("tool_b", {"y": "two"}, tool_call_id="call-b")])
    return ModelResponse(parts=[TextPart("answer: " + " ".join(str(p.content) for p in done))])


planner = Agent(FunctionModel(plan), name="planner")


@planner.tool_plain
def tool_a(x: int) -> int:
    mark("tool_a", x, attempt().operation_id)
    time.sleep(float(os.environ.get("PAI_DELAY", "0")))
    return x * 10


@planner.tool_plain
def tool_b(y: str) -> dict:
    mark("tool_b_started")
    time.sleep(float(os.environ.get("PAI_DELAY", "0")))
    gate = os.environ.get("PAI_GATE")
    while gate and os.path.exists(gate):
        time.sleep(0.02)
    mark("tool_b", y)
    return {"y": y.upper()}


durable_planner = DurableAgent(planner, price=TokenPrice(input_per_million=1.0, output_per_million=4.0))


@workflow
async def plan_flow(ctx, question: str) -> str:
    result = await durable_planner.run(ctx, question)
    return result.output


def pay_plan(messages, info):
    done = returns(messages)
    mark("pay_request", len(done))
    if not done:
        return ModelResponse(parts=[ToolCallPart("pay", {"amount": 5}, tool_call_id="call-pay")])
    return ModelResponse(parts=[TextPart("paid: " + str(done[0].content))])


payer = Agent(FunctionModel(pay_plan), name="payer")


@payer.tool_plain(requires_approval=True)
def pay(amount: int) -> str:
    mark("pay", amount)
    return f"sent {amount}"


durable_payer = DurableAgent(payer)


@workflow
async def pay_flow(ctx, who: str) -> str:
    result = await durable_payer.run(ctx, who)
    return result.output
'''

flows = flows_fixture("pai_flows", SCRIPT)
effects = effects_fixture()
ANSWER = "answer: 20 {'y': 'TWO'}"


def labels(state: Any) -> list[str]:
    return [step.label for step in state.steps]


def test_each_model_request_and_tool_call_is_a_step(flows: tuple[Path, ModuleType], effects: Effects,
                                                      tmp_path: Path) -> None:
    _, mod = flows
    engine = create_engine(tmp_path / "state")
    assert asyncio.run(engine.run(mod.plan_flow, "q")) == ANSWER
    state = asyncio.run(engine.inspect(asyncio.run(engine.list())[0].run_id))
    assert labels(state) == ["planner: model request", "planner: tool tool_a", "planner: model request",
                             "planner: tool tool_b", "planner: model request"]
    assert [s.output for s in state.steps if s.label.startswith("planner: tool")] == [
        {"return": 20}, {"return": {"y": "TWO"}}]
    first = state.steps[0].output
    assert first["parts"][0]["tool_name"] == "tool_a" and first["kind"] == "response"
    # usage: every request's input + output tokens, and its cost at the given price
    usages = [s.output["usage"] for s in state.steps if s.label == "planner: model request"]
    tokens = sum(u["input_tokens"] + u["output_tokens"] for u in usages)
    usd = sum(u["input_tokens"] * 1.0 + u["output_tokens"] * 4.0 for u in usages) / 1e6
    assert tokens > 0
    assert state.spent["tokens"] == tokens
    assert state.spent["usd"] == pytest.approx(usd)
    print(f"spent: {state.spent}")
    # run again with the same input: a completed run starts fresh; a replay of it (TestEngine) runs nothing twice
    assert effects.labels().count("request") == 3 and effects.count("tool_a") == 1 and effects.count("tool_b") == 1
    # a tool runs inside its step: attempt() is the step's
    assert [line[3] for line in effects.lines() if line[0] == "tool_a"] == [f"{state.run_id}/2"]


def test_under_test_engine_with_shadow_replay_and_a_crash(flows: tuple[Path, ModuleType], effects: Effects) -> None:
    _, mod = flows
    with TestEngine() as engine:
        result = engine.sync.run(mod.plan_flow, "q")
        assert result.status == "completed" and result.result == ANSWER
        assert result.executions == {"planner: model request": 3, "planner: tool tool_a": 1,
                                     "planner: tool tool_b": 1}
        effects.clear()
        crashed = engine.sync.run(mod.plan_flow, "other", crash_after="planner: tool tool_a")
        assert crashed.status != "completed"
        assert engine.sync.resume(crashed.run_id).result == ANSWER
        assert effects.count("tool_a") == 1 and effects.count("tool_b") == 1
        assert [line[2] for line in effects.lines() if line[0] == "request"] == ["0", "1", "2"]


def test_killed_between_tool_calls_resumes_without_repeating(flows: tuple[Path, ModuleType], effects: Effects,
                                                             tmp_path: Path) -> None:
    script, _ = flows
    state_dir = tmp_path / "state"
    gate = tmp_path / "gate"
    gate.touch()
    os.environ["PAI_GATE"] = str(gate)
    try:
        args = ["run", str(script), "--workflow", "plan_flow", "--input", '"q"', "--dir", str(state_dir)]
        first = cli_process(*args)
        wait_until(lambda: effects.count("tool_b_started") == 1 or first.poll() is not None, 60, 0.02)
        kill(first)
        print(f"killed with ledger {effects.labels()}")
        assert effects.count("tool_a") == 1 and effects.count("tool_b") == 0
        gate.unlink()
        again = cli(*args)
        assert again.returncode == 0, again.stderr
        assert ANSWER in again.stdout
    finally:
        del os.environ["PAI_GATE"]
    print(f"after resume: {effects.labels()}")
    assert effects.count("tool_a") == 1
    assert effects.count("tool_b") == 1
    assert effects.count("tool_b_started") == 2  # the call cut off mid-way is the only one that ran again
    assert [line[2] for line in effects.lines() if line[0] == "request"] == ["0", "1", "2"]
    # each request charged once, the two replayed ones included
    runs = asyncio.run(create_engine(state_dir).list())
    state = state_of(state_dir, runs[0].run_id)
    usages = [s.output["usage"] for s in state.steps if s.label == "planner: model request"]
    assert len(usages) == 3
    assert state.spent["tokens"] == sum(u["input_tokens"] + u["output_tokens"] for u in usages)
    print(f"spent after the resume: {state.spent}")


@pytest.mark.slow
def test_killed_at_random_points_never_repeats_a_recorded_call(flows: tuple[Path, ModuleType], effects: Effects,
                                                               tmp_path: Path) -> None:
    """SIGKILLed at random moments until it completes: after each kill, no model request or tool call whose step
    was recorded ran again (each request is marked with how many tool returns it saw, so they are told apart)."""
    import random

    script, _ = flows
    state_dir = tmp_path / "state"
    args = ["run", str(script), "--workflow", "plan_flow", "--input", '"r"', "--dir", str(state_dir)]
    os.environ["PAI_DELAY"] = "0.15"
    rng = random.Random(23)
    kills: list[tuple[int, list[str]]] = []  # (ledger length, labels of the steps recorded) at each kill
    result = None
    try:
        for _ in range(12):
            seen = len(effects.lines())
            proc = cli_process(*args)
            # a kill lands while the agent works: after a random number of new ledger lines, at a random moment
            target = seen + rng.randint(1, 2)
            wait_until(lambda target=target, proc=proc: len(effects.lines()) >= target or proc.poll() is not None,
                       60, 0.01)
            time.sleep(rng.uniform(0, 0.2))
            if proc.poll() is None:
                kill(proc)
            else:
                assert proc.communicate()[0] and proc.returncode == 0
            runs = asyncio.run(create_engine(state_dir).list())
            state = state_of(state_dir, runs[0].run_id) if runs else None
            if state is not None and state.status == "completed":
                result = state.result
                break
            kills.append((len(effects.lines()), [s.label for s in state.steps if s.status == "ok"] if state else []))
        else:
            again = cli(*args)
            assert again.returncode == 0, again.stderr
            result = json.loads(again.stdout)
    finally:
        del os.environ["PAI_DELAY"]
    assert result == ANSWER
    lines = effects.lines()
    print(f"{len(kills)} kills; ledger {[line[0] + (line[2] if line[0] == 'request' else '') for line in lines]}")
    for at, recorded in kills:
        requests_done = recorded.count("planner: model request")
        later = lines[at:]
        assert not [line for line in later if line[0] == "request" and int(line[2]) < requests_done], (at, recorded)
        if "planner: tool tool_a" in recorded:
            assert not [line for line in later if line[0] == "tool_a"]
        if "planner: tool tool_b" in recorded:
            assert not [line for line in later if line[0] == "tool_b"]
    assert effects.count("tool_b") >= 1 and effects.count("tool_a") >= 1


def signal_cli(state_dir: Path, run: str, name: str, payload: str) -> None:
    done = cli("signal", run, name, payload, "--dir", str(state_dir))
    assert done.returncode == 0, done.stderr


def test_a_tool_that_needs_approval_parks_until_signalled(flows: tuple[Path, ModuleType], effects: Effects,
                                                          tmp_path: Path) -> None:
    _, mod = flows
    state_dir = tmp_path / "state"
    engine = create_engine(state_dir)
    with pytest.raises(RunParkedError, match="waiting"):
        asyncio.run(engine.run(mod.pay_flow, "ann", key="ann", wait=False))
    assert effects.count("pay") == 0
    parked = state_of(state_dir, "ann")
    assert parked.status == "waiting"
    # a payload of no known shape is consumed and ignored: the run waits again
    signal_cli(state_dir, "ann", "approve:call-pay", '"maybe"')
    with pytest.raises(RunParkedError):
        asyncio.run(engine.run(mod.pay_flow, "ann", key="ann", wait=False))
    assert effects.count("pay") == 0
    signal_cli(state_dir, "ann", "approve:call-pay", "true")
    assert asyncio.run(engine.run(mod.pay_flow, "ann", key="ann", wait=False)) == "paid: sent 5"
    assert effects.count("pay") == 1
    assert "payer: tool pay" in labels(state_of(state_dir, "ann"))

    with pytest.raises(RunParkedError):
        asyncio.run(engine.run(mod.pay_flow, "bob", key="bob", wait=False))
    signal_cli(state_dir, "bob", "approve:call-pay", '{"approved": false, "message": "over the limit"}')
    assert asyncio.run(engine.run(mod.pay_flow, "bob", key="bob", wait=False)) == "paid: over the limit"
    assert effects.count("pay") == 1  # denied: the tool never ran
    assert [line[2] for line in effects.lines() if line[0] == "pay_request"] == ["0", "1", "0", "1"]


def test_in_a_worker_process(flows: tuple[Path, ModuleType], effects: Effects, tmp_path: Path) -> None:
    script, _ = flows
    state_dir = tmp_path / "state"
    where = ["--dir", str(state_dir)]
    for workflow_name, value, key in (("pay_flow", "cy", "cy"), ("plan_flow", "q", "plan")):
        done = cli("enqueue", str(script), "--workflow", workflow_name, "--input", f'"{value}"', "--key", key, *where)
        assert done.returncode == 0, done.stderr
    worker = cli_process("worker", "--import", str(script), *where, "--poll", "0.02", "-q")
    try:
        wait_until(lambda: state_of(state_dir, "cy").status == "waiting"
                   and state_of(state_dir, "plan").status == "completed" or worker.poll() is not None, 60, 0.05)
        assert effects.count("pay") == 0
        signal_cli(state_dir, "cy", "approve:call-pay", "true")
        wait_until(lambda: state_of(state_dir, "cy").status == "completed" or worker.poll() is not None, 60, 0.05)
        assert worker.poll() is None
    finally:
        kill(worker)
    plan = state_of(state_dir, "plan")
    assert plan.result == ANSWER and plan.spent["tokens"] > 0
    assert state_of(state_dir, "cy").result == "paid: sent 5"
    assert effects.count("pay") == 1 and effects.count("tool_a") == 1


def test_bad_arguments_are_durably_errors(flows: tuple[Path, ModuleType]) -> None:
    _, mod = flows
    for call in (lambda: DurableAgent("not an agent"),  # type: ignore[arg-type]
                 lambda: DurableAgent(mod.planner, approval_signal="approve"),
                 lambda: DurableAgent(mod.planner, price=3)):  # type: ignore[arg-type]
        with pytest.raises(ArgumentError) as caught:
            call()
        check_error(caught.value)
    from pydantic_ai import Agent
    from pydantic_ai.models.test import TestModel

    with pytest.raises(ArgumentError, match="needs a name"):
        DurableAgent(Agent(TestModel()))

    @workflow(name="pai_no_ctx")
    async def no_ctx(ctx: Any) -> Any:
        return await DurableAgent(mod.planner).run("q", "q")  # type: ignore[arg-type]

    with TestEngine() as engine:
        assert isinstance(engine.sync.run(no_ctx).error, ArgumentError)


def test_streamed_requests_are_steps_and_replay_their_events(effects: Effects) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.test import TestModel

    agent = Agent(TestModel(custom_output_text="streamed words here"), name="streamer")
    durable = DurableAgent(agent)
    seen: list[str] = []

    async def handler(ctx: Any, events: Any) -> None:
        async for event in events:
            seen.append(type(event).__name__)

    @workflow(name="pai_stream")
    async def stream_flow(ctx: Any) -> str:
        return (await durable.run(ctx, "go", event_stream_handler=handler)).output

    with TestEngine() as engine:
        result = engine.sync.run(stream_flow)
        assert result.result == "streamed words here"
        assert [s.label for s in result.steps] == ["streamer: model request"]
        assert "PartStartEvent" in seen


def test_an_approval_that_never_comes_denies_the_call_after_its_timeout(flows: tuple[Path, ModuleType],
                                                                       effects: Effects) -> None:
    _, mod = flows
    durable = DurableAgent(mod.payer, name="payer", approval_timeout=3600)

    @workflow(name="pai_timeout")
    async def timed(ctx: Any) -> str:
        return (await durable.run(ctx, "dan")).output

    with TestEngine() as engine:
        parked = engine.sync.run(timed)
        assert parked.status == "waiting"
        engine.clock.advance(3601)
        done = engine.sync.resume(parked.run_id)
        assert done.result == "paid: No one approved the tool call in time."
    assert effects.count("pay") == 0


def test_streamed_text_goes_to_the_steps_stream_where_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.test import TestModel

    from durably_py import AttemptContext

    emitted: list[tuple[str, Any]] = []
    monkeypatch.setattr(AttemptContext, "emit", lambda self, chunk: emitted.append((self.label, chunk)),
                        raising=False)
    durable = DurableAgent(Agent(TestModel(custom_output_text="one two three"), name="talker"))

    async def handler(ctx: Any, events: Any) -> None:
        async for _ in events:
            pass

    @workflow(name="pai_emit")
    async def talk(ctx: Any) -> str:
        return (await durable.run(ctx, "go", event_stream_handler=handler)).output

    with TestEngine() as engine:
        assert engine.sync.run(talk).result == "one two three"
    assert "".join(chunk for _, chunk in emitted) == "one two three"
    assert {label for label, _ in emitted} == {"talker: model request"}


def test_restate_mode_is_refused_clearly() -> None:
    from durably_py.agents import pydantic_ai as integration

    class RestateLike:
        @property
        def budget(self) -> Any:
            raise NotSupportedError("budgets are not supported in Restate mode", mode="restate")

    with pytest.raises(NotSupportedError, match="Restate mode") as caught:
        integration._refuse_restate(RestateLike())  # type: ignore[arg-type]
    check_error(caught.value)


