"""Static task graphs: a DAG of child runs, validated before work starts, with node status and wait reasons."""

import asyncio

import pytest

from durably_py import (
    DependencyFailedError,
    FileStorage,
    MemoryStorage,
    Task,
    ValidationError,
    create_engine,
    is_ok,
    workflow,
)
from durably_py.testing import Crash, TestEngine

ran: list[str] = []


def work(topic: str) -> str:
    ran.append(topic)
    if topic.startswith("bad"):
        raise RuntimeError(f"cannot research {topic}")
    return f"notes on {topic}"


@workflow
async def research(ctx, topic):
    return await ctx.step(work, topic, name="research")


@workflow
async def write(ctx, inputs):
    return " + ".join(f"{k}: {v}" for k, v in sorted(inputs.items()))


def project(first: str = "market") -> dict[str, Task]:
    return {
        "market": Task(research, first),
        "product": Task(research, "product"),
        "report": Task(write, lambda deps: deps, depends_on=["market", "product"]),
        "appendix": Task(research, "appendix"),
        "summary": Task(write, lambda deps: {"report": deps["report"]}, depends_on=["report"]),
    }


@workflow
async def plan(ctx, first):
    results = await ctx.graph(project(first))
    return {task: (r.value if is_ok(r) else f"{type(r.error).__name__}") for task, r in results.items()}


def test_a_graph_runs_each_task_after_its_prerequisites() -> None:
    ran.clear()
    engine = TestEngine()
    done = engine.sync.run(plan, "market")
    assert done.status == "completed"
    assert done.result["report"] == "market: notes on market + product: notes on product"
    assert done.result["summary"] == "report: market: notes on market + product: notes on product"
    assert sorted(ran) == ["appendix", "market", "product"]


def test_a_failed_task_blocks_its_dependents_and_not_the_rest() -> None:
    ran.clear()
    engine = create_engine(MemoryStorage())
    result = asyncio.run(engine.run(plan, "bad-market"))
    assert result == {"market": "RuntimeError", "product": "notes on product",
                      "report": "DependencyFailedError", "appendix": "notes on appendix",
                      "summary": "DependencyFailedError"}
    (state,) = asyncio.run(engine.graph(next(r.run_id for r in asyncio.run(engine.list())
                                              if r.workflow.endswith("plan"))))
    nodes = {n.id: (n.status, n.wait) for n in state.nodes}
    assert nodes == {"market": ("failed", None), "product": ("completed", None),
                     "report": ("blocked", "dependency_failed"), "appendix": ("completed", None),
                     "summary": ("blocked", "dependency_failed")}
    assert state.status == "blocked"


def test_a_crashed_graph_resumes_without_redoing_finished_tasks() -> None:
    ran.clear()
    die = {"in": "report"}

    def die_once(inputs):
        if die.pop("in", None):
            raise Crash()  # the process dies while the report runs
        return inputs

    @workflow
    async def fragile_write(ctx, inputs):
        return await ctx.step(die_once, inputs, name="write")

    @workflow
    async def fragile_plan(ctx):
        tasks = project()
        tasks["report"] = Task(fragile_write, lambda deps: deps, depends_on=["market", "product"])
        results = await ctx.graph(tasks)
        return sorted(task for task, r in results.items() if is_ok(r))

    engine = TestEngine()
    crashed = engine.sync.run(fragile_plan)
    assert crashed.status == "crashed"
    done = engine.sync.resume(crashed.run_id)
    assert done.status == "completed"
    assert done.result == ["appendix", "market", "product", "report", "summary"]
    assert ran.count("market") == ran.count("product") == 1  # both completed before the report started
    assert set(ran) == {"appendix", "market", "product"}


def test_node_states_say_why_they_wait(tmp_path) -> None:
    @workflow
    async def approve(ctx, what):
        return await ctx.wait_for("approved", timeout=600)

    @workflow
    async def gated(ctx):
        results = await ctx.graph({
            "draft": Task(research, "draft"),
            "approval": Task(approve, "draft", depends_on=["draft"]),
            "publish": Task(research, "publish", depends_on=["approval"]),
        })
        return sorted(results)

    engine = create_engine(FileStorage(tmp_path))

    async def until_parked():
        task = asyncio.ensure_future(engine.run(gated))
        for _ in range(200):
            await asyncio.sleep(0.02)
            parents = [r for r in await engine.list() if r.workflow.endswith("gated")]
            if parents and (await engine.graph(parents[0].run_id))[0].nodes[1].status == "waiting":
                break
        state = (await engine.graph(parents[0].run_id))[0]
        task.cancel()
        return state

    state = asyncio.run(until_parked())
    nodes = {n.id: (n.status, n.wait) for n in state.nodes}
    assert nodes == {"draft": ("completed", None), "approval": ("waiting", "waiting"),
                     "publish": ("pending", "dependencies")}
    assert state.status == "running"
    assert state.to_dict()["nodes"][2]["depends_on"] == ["approval"]


@pytest.mark.parametrize(("tasks", "needle"), [
    ({}, "1-100 tasks"),
    ({"a": Task(research, "x", depends_on=["b"]), "b": Task(research, "y", depends_on=["a"])}, "cycle: a -> b -> a"),
    ({"a": Task(research, "x", depends_on=["nope"])}, "unknown task 'nope'"),
    ({"a": Task(research, "x", depends_on=["a"])}, "depends on itself"),
    ({"a b": Task(research, "x")}, "not 1-64 letters"),
    ({"a": (research, "x")}, "not a Task"),
    ({"a": Task(research, "x", depends_on="b")}, "list of task ids"),
    ({f"t{i}": Task(research, i) for i in range(101)}, "1-100 tasks"),
])
def test_bad_graphs_are_refused_before_any_work(tasks, needle) -> None:
    ran.clear()

    @workflow
    async def broken(ctx):
        await ctx.step(work, "before")
        return await ctx.graph(tasks)

    engine = TestEngine()
    failed = engine.sync.run(broken)
    assert failed.status == "failed"
    assert isinstance(failed.error, ValidationError) and needle in str(failed.error) and failed.error.hint
    assert ran == ["before"]
    assert DependencyFailedError("x").hint


def test_resuming_a_failed_graph_retries_the_failed_task_and_releases_its_dependents() -> None:
    ran.clear()
    topic = {"first": "bad-market"}

    def flaky(name: str) -> str:
        ran.append(name)
        if name == "market" and topic["first"].startswith("bad"):
            raise RuntimeError("market data down")
        return name

    @workflow
    async def fetch(ctx, name):
        return await ctx.step(flaky, name, name="fetch")

    @workflow
    async def strict_plan(ctx):
        results = await ctx.graph({
            "market": Task(fetch, "market"),
            "product": Task(fetch, "product"),
            "report": Task(write, lambda deps: deps, depends_on=["market", "product"]),
        })
        failed = [task for task, r in results.items() if not is_ok(r)]
        if failed:
            raise RuntimeError(f"graph tasks failed: {failed}")
        return results["report"].value

    engine = TestEngine()
    first = engine.sync.run(strict_plan)
    assert first.status == "failed" and "market" in str(first.error)
    topic["first"] = "market"
    done = engine.sync.resume(first.run_id)
    assert done.result == "market: market + product: product"
    assert ran.count("product") == 1 and ran.count("market") == 2


def test_cli_graph_shows_nodes(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from durably_py import run
    from durably_py.cli import app

    run(plan, "bad-x", dir=tmp_path)
    runner = CliRunner()
    parent = next(r["run_id"] for r in json.loads(runner.invoke(app, ["list", "--dir", str(tmp_path),
                                                                       "--json"]).stdout)
                  if r["workflow"].endswith("plan"))
    shown = runner.invoke(app, ["graph", parent, "--dir", str(tmp_path)])
    assert shown.exit_code == 0 and "dependency_failed" in shown.stdout
    data = json.loads(runner.invoke(app, ["graph", parent, "--dir", str(tmp_path), "--json"]).stdout)
    assert [n["status"] for n in data[0]["nodes"]] == ["failed", "completed", "blocked", "completed", "blocked"]
