"""Child runs: spawn, spawn_all, join, join_all, each child its own durable run."""

import asyncio
import time

import pytest
from helpers import FAN_OUT, Stop, fan_out_sum

from durably_py import (
    FileStorage,
    MemoryStorage,
    RunCancelledError,
    RunHandle,
    ValidationError,
    create_engine,
    is_ok,
    workflow,
)
from durably_py.testing import TestEngine

executed: list[str] = []


def work(item: str) -> str:
    executed.append(item)
    if item == "bad":
        raise ValueError(f"cannot process {item}")
    return item.upper()


@workflow
async def child(ctx, item):
    first = await ctx.step(work, item, name="work")
    second = await ctx.step(work, f"{item}-2", name="work again")
    return f"{first}+{second}"


@workflow
async def parent(ctx, items):
    handles = await ctx.spawn_all([(child, item) for item in items])
    results = await ctx.join_all(handles)
    return [r.value if is_ok(r) else f"error: {r.error}" for r in results]


def test_spawn_and_join_return_the_child_result() -> None:
    executed.clear()

    @workflow
    async def one(ctx):
        handle = await ctx.spawn(child, "a")
        assert isinstance(handle, RunHandle)
        return await ctx.join(handle)

    engine = TestEngine()
    done = engine.sync.run(one)
    assert done.status == "completed" and done.result == "A+A-2"
    assert executed == ["a", "a-2"]
    state = engine.sync.inspect(done.run_id)
    spawned = state.steps[0].output["run_id"]
    assert engine.sync.inspect(spawned).status == "completed"


def test_join_all_reports_each_child() -> None:
    executed.clear()
    engine = TestEngine()
    done = engine.sync.run(parent, ["x", "bad", "y"])
    assert done.result == ["X+X-2", "error: cannot process bad", "Y+Y-2"]
    assert sorted(executed) == sorted(["x", "x-2", "bad", "y", "y-2"])


def test_a_crashed_parent_resumes_its_children_without_redoing_their_steps() -> None:
    executed.clear()
    engine = TestEngine()

    @workflow
    async def slow_parent(ctx, items):
        handles = await ctx.spawn_all([(child, item) for item in items])
        await ctx.step(work, "parent-mid", name="parent step")
        return [r.value for r in await ctx.join_all(handles)]

    crashed = engine.sync.run(slow_parent, ["p", "q"], crash_after="parent step")
    assert crashed.status == "crashed"
    spawned = [s.output["run_id"] for s in engine.sync.inspect(crashed.run_id).steps if s.label == "ctx.spawn"]
    finished = [s.output.lower().replace("+", "") for run_id in spawned
                for s in engine.sync.inspect(run_id).steps if s.status == "ok"]
    done = engine.sync.resume(crashed.run_id)
    assert done.result == ["P+P-2", "Q+Q-2"]
    assert set(executed) == {"p", "p-2", "q", "q-2", "parent-mid"}
    for item in finished:
        assert executed.count(item) == 1, item
    assert len(executed) <= 5 + len(spawned)


def test_engine_concurrency_caps_children_and_is_advised() -> None:
    active = {"now": 0, "peak": 0}

    async def hold(i):
        active["now"] += 1
        active["peak"] = max(active["peak"], active["now"])
        await asyncio.sleep(0.02)
        active["now"] -= 1
        return i

    @workflow
    async def leaf(ctx, i):
        return await ctx.step(hold, i)

    @workflow
    async def fan(ctx, n):
        handles = await ctx.spawn_all([(leaf, i) for i in range(n)])
        return [r.value for r in await ctx.join_all(handles)]

    engine = create_engine(MemoryStorage(), concurrency=2)
    seen = []
    assert asyncio.run(engine.run(fan, 6, advisories="silent", on_advisory=seen.append)) == list(range(6))
    assert active["peak"] == 2
    assert [a.code for a in seen] == ["CONCURRENCY_CAPPED"]
    assert "6 children" in seen[0].msg and "2 at once" in seen[0].msg
    assert "above 2" in seen[0].hint and "the 6 children" in seen[0].hint and "{" not in seen[0].hint


def test_unjoined_children_finish_before_the_parent_completes(tmp_path) -> None:
    executed.clear()

    @workflow
    async def fire_and_wait(ctx):
        await ctx.spawn(child, "bg")
        return "parent done"

    engine = create_engine(FileStorage(tmp_path))
    assert asyncio.run(engine.run(fire_and_wait)) == "parent done"
    assert sorted(executed) == ["bg", "bg-2"]
    statuses = sorted(r.status for r in asyncio.run(engine.list()))
    assert statuses == ["completed", "completed"]


def test_a_failed_child_is_resumed_when_its_parent_is() -> None:
    state = {"fail": True}

    def maybe(x):
        if state["fail"]:
            raise RuntimeError("not yet")
        return x

    @workflow
    async def fragile(ctx, x):
        return await ctx.step(maybe, x)

    @workflow
    async def boss(ctx):
        return await ctx.join(await ctx.spawn(fragile, 7))

    engine = TestEngine()
    failed = engine.sync.run(boss)
    assert failed.status == "failed" and isinstance(failed.error, RuntimeError)
    state["fail"] = False
    assert engine.sync.resume(failed.run_id).result == 7


def test_bad_spawn_arguments() -> None:
    @workflow
    async def wrong(ctx):
        await ctx.spawn_all([child])

    @workflow
    async def wrong_join(ctx):
        await ctx.join("some-run-id")

    engine = TestEngine()
    for wf in (wrong, wrong_join):
        result = engine.sync.run(wf)
        assert result.status == "failed" and isinstance(result.error, ValidationError)


def test_children_run_concurrently_with_real_time() -> None:
    async def nap(i):
        await asyncio.sleep(0.5)
        return i

    @workflow
    async def sleeper(ctx, i):
        return await ctx.step(nap, i)

    @workflow
    async def many(ctx):
        handles = await ctx.spawn_all([(sleeper, i) for i in range(4)])
        return [r.value for r in await ctx.join_all(handles)]

    started = time.monotonic()
    assert asyncio.run(create_engine(MemoryStorage()).run(many)) == [0, 1, 2, 3]
    assert time.monotonic() - started < 1.5  # one after another they would take 2 s


@pytest.mark.parametrize("detached", [False, True])
def test_spawn_records_parent_and_detached(tmp_path, detached) -> None:
    @workflow
    async def p(ctx):
        return (await ctx.spawn(child, "z", detached=detached)).run_id

    engine = create_engine(FileStorage(tmp_path))
    child_id = asyncio.run(engine.run(p))
    header = engine.storage.info(child_id).header
    assert header["parent"] and header["detached"] is detached


KILL_SCRIPT = """
import asyncio, sys
from durably_py import run, workflow

EFFECTS = sys.argv[2]


async def tick(label):
    with open(EFFECTS, "a") as f:
        f.write(label + "\\n")
    await asyncio.sleep(0.15)
    return label


@workflow
async def kid(ctx, name):
    return [await ctx.step(tick, f"{name}-{i}", name="tick") for i in range(4)]


@workflow
async def mom(ctx, names):
    handles = await ctx.spawn_all([(kid, n) for n in names])
    return [r.value for r in await ctx.join_all(handles)]


print(run(mom, ["a", "b"], dir=sys.argv[1]))
"""


def test_killed_parent_process_resumes_children(tmp_path) -> None:
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "family.py"
    script.write_text(KILL_SCRIPT)
    effects = tmp_path / "effects.txt"
    cmd = [sys.executable, str(script), str(tmp_path / "state"), str(effects)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not effects.exists() or len(effects.read_text().split()) < 3:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    engine = create_engine(FileStorage(tmp_path / "state"))
    recorded = {s.output for r in asyncio.run(engine.list()) if r.workflow == "kid"
                for s in asyncio.run(engine.inspect(r.run_id)).steps if s.status == "ok"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str([[f"a-{i}" for i in range(4)], [f"b-{i}" for i in range(4)]])
    lines = effects.read_text().split()
    for label in recorded:
        assert lines.count(label) == 1, label
    assert set(lines) == {f"{n}-{i}" for n in "ab" for i in range(4)}


def test_cancelling_a_parent_cancels_its_attached_children_only(tmp_path) -> None:
    @workflow
    async def waiting_child(ctx, name):
        return await ctx.wait_for(f"go-{name}", timeout=3600)

    @workflow
    async def family(ctx):
        await ctx.spawn(waiting_child, "attached")
        await ctx.spawn(waiting_child, "free", detached=True)
        raise Stop()

    engine = create_engine(FileStorage(tmp_path))

    async def start():
        try:
            await engine.run(family)
        except Stop:
            pass

    asyncio.run(start())
    parent_id = next(r.run_id for r in asyncio.run(engine.list()) if r.workflow.endswith("family"))
    state = asyncio.run(engine.cancel(parent_id))
    assert state.status == "cancelled"
    after = {r.input: r.status for r in asyncio.run(engine.list()) if r.workflow.endswith("waiting_child")}
    assert after["attached"] == "cancelled"
    assert after["free"] != "cancelled"


def test_pausing_a_parent_pauses_its_attached_children_and_resume_resumes_them(tmp_path) -> None:
    @workflow
    async def sleepy_child(ctx, name):
        await ctx.step(work, name, name="work")
        return await ctx.wait_for(f"go-{name}", timeout=3600)

    @workflow
    async def household(ctx):
        await ctx.spawn(sleepy_child, "kept")
        await ctx.spawn(sleepy_child, "loose", detached=True)
        raise Stop()

    engine = create_engine(FileStorage(tmp_path))

    async def start():
        try:
            await engine.run(household)
        except Stop:
            pass

    asyncio.run(start())

    def statuses():
        return {r.input: r.status for r in asyncio.run(engine.list()) if r.workflow.endswith("sleepy_child")}

    parent_id = next(r.run_id for r in asyncio.run(engine.list()) if r.workflow.endswith("household"))
    before = statuses()
    assert asyncio.run(engine.pause(parent_id)).status == "paused"
    assert statuses() == {"kept": "paused", "loose": before["loose"]}
    assert asyncio.run(engine.resume(parent_id)).status != "paused"
    assert statuses()["kept"] != "paused"


def test_a_child_the_parent_recorded_as_failed_is_not_run_again_when_the_parent_resumes() -> None:
    executed.clear()
    undone: list[str] = []

    @workflow
    async def saga_child(ctx, item):
        await ctx.step(work, f"{item}-prep", name="prep", compensate=lambda v: undone.append(v))
        return await ctx.step(work, item, name="work")

    @workflow
    async def tolerant(ctx, items):
        results = await ctx.join_all(await ctx.spawn_all([(saga_child, item) for item in items]))
        await ctx.step(work, "after", name="after")
        await ctx.step(work, "last", name="last")
        return [r.value if is_ok(r) else "failed" for r in results]

    engine = TestEngine()
    crashed = engine.sync.run(tolerant, ["ok", "bad"], crash_after="after")
    assert crashed.status == "crashed"
    assert executed.count("bad") == 1 and undone == ["BAD-PREP"]
    done = engine.sync.resume(crashed.run_id)
    assert done.result == ["OK", "failed"]
    assert executed.count("bad") == 1 and executed.count("bad-prep") == 1
    assert undone == ["BAD-PREP"]
    assert engine.sync.resume(crashed.run_id).status == "completed"
    assert executed.count("bad") == 1 and undone == ["BAD-PREP"]


@pytest.mark.parametrize("concurrency", [1, 2])
def test_nested_fan_out_wider_than_the_concurrency_completes(tmp_path, concurrency) -> None:
    @workflow
    async def leaf(ctx, n):
        return await ctx.step(lambda: n * 10, name="leaf")

    @workflow
    async def middle(ctx, n):
        results = await ctx.join_all(await ctx.spawn_all([(leaf, n * 10 + i) for i in range(3)]))
        return sum(r.value for r in results)

    @workflow
    async def top(ctx, width):
        handles = await ctx.spawn_all([(middle, i) for i in range(width)])
        return [r.value for r in await ctx.join_all(handles)]

    engine = create_engine(FileStorage(tmp_path), concurrency=concurrency)
    result = asyncio.run(asyncio.wait_for(engine.run(top, 4, advisories="silent"), 30))
    assert result == [sum((n * 10 + i) * 10 for i in range(3)) for n in range(4)]
    assert all(r.status == "completed" for r in asyncio.run(engine.list()))


def test_cancelling_a_parent_parked_in_join_all_cancels_it_and_its_attached_children(tmp_path) -> None:
    @workflow
    async def held_child(ctx, name):
        return await ctx.wait_for(f"go-{name}", timeout=3600)

    @workflow
    async def waiting_parent(ctx):
        handles = await ctx.spawn_all([(held_child, "a"), (held_child, "b")])
        free = await ctx.spawn(held_child, "free", detached=True)
        del free
        return await ctx.join_all(handles)

    runner = create_engine(FileStorage(tmp_path))
    operator = create_engine(FileStorage(tmp_path))

    async def scenario():
        parent = asyncio.ensure_future(runner.run(waiting_parent))
        while len(await operator.list()) < 4:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        parent_id = next(r.run_id for r in await operator.list() if r.workflow.endswith("waiting_parent"))
        state = await operator.cancel(parent_id, timeout=10)
        with pytest.raises(RunCancelledError):
            await asyncio.wait_for(parent, 10)
        return state

    state = asyncio.run(scenario())
    assert state.status == "cancelled"
    after = {r.input: r.status for r in asyncio.run(operator.list()) if r.workflow.endswith("held_child")}
    assert after["a"] == after["b"] == "cancelled"
    assert after["free"] != "cancelled"


def test_only_running_children_hold_tasks(tmp_path) -> None:
    seen: list[int] = []

    async def count_tasks(i):
        seen.append(len(asyncio.all_tasks()))
        return i

    @workflow
    async def counted(ctx, i):
        return await ctx.step(count_tasks, i)

    @workflow
    async def wide(ctx, n):
        results = await ctx.join_all(await ctx.spawn_all([(counted, i) for i in range(n)]))
        return sum(r.value for r in results)

    engine = create_engine(FileStorage(tmp_path), concurrency=4)
    assert asyncio.run(engine.run(wide, 300, advisories="silent")) == sum(range(300))
    assert len(seen) == 300
    # the parent (its task and its workflow's), its join watcher and recorder, 4 running children with their
    # workflows' tasks, ...: a bound that does not grow with the 300 children
    assert max(seen) <= 16, max(seen)
    assert not engine.children.pool.outcomes and not engine.children.pool.running and not engine.children.pool.asked \
        and not engine.children.pool.queued


BATCH_SCRIPT = """
import asyncio, os, signal, sys
from durably_py import FileStorage, SqliteStorage, create_engine, workflow

kind, state, effects, where, at = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
storage = FileStorage(state) if kind == "file" else SqliteStorage(os.path.join(state, "runs.db"))
seen = {"bind": 0, "create": 0, "append": 0}


def counted(name, method):
    def wrapper(*args, **kwargs):
        if where == name and seen[name] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        out = method(*args, **kwargs)
        if name != "append" or b'"ctx.spawn"' in args[1]:
            seen[name] += 1
        return out
    return wrapper


if kind == "file":  # inside FileStorage.create_bound: each binding, then each log; SQLite's is one commit
    storage._bind = counted("bind", storage._bind)
    storage._new_log = counted("create", storage._new_log)
storage.append = counted("append", storage.append)

""" + FAN_OUT + """

print(asyncio.run(create_engine(storage, lease=2).run(mom, 12, key="mom")))  # a killed holder lapses in 2 s
"""


@pytest.mark.parametrize(("kind", "where", "at"), [("file", "bind", 5), ("file", "create", 5),
                                                    ("file", "append", 0), ("sqlite", "append", 0)])
def test_a_parent_killed_in_a_spawn_all_batch_resumes_with_each_child_once(tmp_path, kind, where, at) -> None:
    """SIGKILL inside the batch that creates the children, or at the spawn records written after it: the
    resumed parent finds every child created before the kill (recorded or not), creates the others, and each
    child runs once; no child is left over that the parent does not name."""
    import json
    import subprocess
    import sys

    from durably_py import SqliteStorage

    script = tmp_path / "batch.py"
    script.write_text(BATCH_SCRIPT)
    state, effects = tmp_path / "state", tmp_path / "effects.txt"
    state.mkdir()
    killed = subprocess.run([sys.executable, str(script), kind, str(state), str(effects), where, str(at)],
                            capture_output=True, text=True, timeout=60)
    assert killed.returncode == -9, killed.stderr
    done = subprocess.run([sys.executable, str(script), kind, str(state), str(effects), "none", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == fan_out_sum(12)
    assert sorted(int(n) for n in effects.read_text().split()) == list(range(12))
    storage = FileStorage(state) if kind == "file" else SqliteStorage(state / "runs.db")
    engine = create_engine(storage)
    recorded = [r for r in asyncio.run(engine.records("mom")) if r.get("l") == "ctx.spawn"]
    named = [r["v"]["run_id"] for r in recorded]
    assert len(named) == len(set(named)) == 12
    kids = [r.run_id for r in asyncio.run(engine.list()) if r.workflow == "kid"]
    assert sorted(kids) == sorted(named), json.dumps([kids, named])


def test_a_wide_spawn_all_is_created_in_bounded_batches(tmp_path, monkeypatch) -> None:
    """The children of one spawn_all are created CREATE_BATCH at a time (each batch one durable write), so
    a very wide fan-out never holds every child's header in memory at once; all of them run."""
    from durably_py import SqliteStorage
    from durably_py._engine import children as children_module

    monkeypatch.setattr(children_module, "CREATE_BATCH", 5)
    storage = SqliteStorage(tmp_path / "runs.db")
    sizes: list[int] = []
    create_bound = storage.create_bound

    def counted(runs):
        sizes.append(len(runs))
        return create_bound(runs)

    monkeypatch.setattr(storage, "create_bound", counted)
    executed.clear()
    items = [f"w{i}" for i in range(12)]
    assert asyncio.run(create_engine(storage).run(parent, items)) == [f"{i.upper()}+{i.upper()}-2" for i in items]
    assert sizes == [5, 5, 2]


ENDS_SCRIPT = """
import asyncio, os, random, signal, sys, threading, time
from durably_py import FileStorage, create_engine, workflow

state, effects, where, at, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
storage = FileStorage(state)
seen = {"sync_all": 0, "unschedule": 0, "append": 0}


def counted(name, method):
    def wrapper(*args, **kwargs):
        if name != "append" or b'"ctx.join"' in args[1]:
            weight = len(args[0]) if name == "sync_all" else 1  # a group commit counts the ends it syncs
            if where == name and seen[name] <= at < seen[name] + weight:
                os.kill(os.getpid(), signal.SIGKILL)
            seen[name] += weight
        return method(*args, **kwargs)
    return wrapper


storage.sync_all = counted("sync_all", storage.sync_all)  # the group commit of children's ends (at: the nth end)
storage.unschedule = counted("unschedule", storage.unschedule)  # a child's end durable, not yet released
storage.append = counted("append", storage.append)  # the parent records a join
if where == "random":
    delay = random.Random(seed).uniform(0.05, 0.5)
    timer = threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL))
    timer.daemon = True
    timer.start()

""" + FAN_OUT.replace("def mark", "async def mark") + """

async def served():
    engine = create_engine(storage, concurrency=4)
    await engine.drain()
    return (await engine.inspect("mom")).result


if where == "worker":  # resumed by a worker: the parent is due; its unqueued children are queued at its join
    print(asyncio.run(served()), flush=True)
else:
    print(asyncio.run(create_engine(storage, concurrency=4).run(mom, 40, key="mom")), flush=True)
"""


@pytest.mark.parametrize(("where", "at", "resume"), [
    ("sync_all", 0, "none"), ("sync_all", 20, "none"), ("unschedule", 5, "none"), ("append", 1, "none"),
    ("random", 1, "none"), ("random", 2, "none"), ("random", 3, "none"),
    ("unschedule", 5, "worker"), ("append", 1, "worker"), ("random", 4, "worker")])
def test_a_wide_spawn_all_killed_while_its_children_end_resumes_with_each_child_step_once(tmp_path, where, at,
                                                                                         resume) -> None:
    """SIGKILL while children's ends wait for their group commit, between a group commit and the children's
    release, among the parent's join records, or at a random moment: the resumed parent gets every child's
    result and each child's step ran once; no child is created twice. A kill from another thread (the group
    commit's, or a timer) may also cut off a step while it runs: only such a step, at most one per running
    child, runs again. The children of a parent running in its own process have no queue entry: resumed by a
    worker instead, the parent queues those it finds unended at its join, and they run there."""
    import subprocess
    import sys

    script = tmp_path / "ends.py"
    script.write_text(ENDS_SCRIPT)
    state, effects = tmp_path / "state", tmp_path / "effects.txt"
    state.mkdir()
    effects.touch()
    killed = subprocess.run([sys.executable, str(script), str(state), str(effects), where, str(at), str(at)],
                            capture_output=True, text=True, timeout=60)
    assert killed.returncode == -9 or where == "random" and killed.returncode == 0, killed.stderr
    completed = [r for r in asyncio.run(create_engine(FileStorage(state)).list(workflow="mom"))
                 if r.status == "completed"]
    if not killed.stdout.strip() and not completed:
        done = subprocess.run([sys.executable, str(script), str(state), str(effects), resume, "0", "0"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == fan_out_sum(40)
    else:  # a random kill may come once the run completed (a run started again then is a new run): no resume
        assert where == "random" and killed.stdout.strip() in ("", fan_out_sum(40))
    ran = [int(n) for n in effects.read_text().split()]
    assert sorted(set(ran)) == list(range(40))
    again = len(ran) - 40
    assert again == 0 if where in ("unschedule", "append") else again <= 4, sorted(ran)
    engine = create_engine(FileStorage(state))
    named = [r["v"]["run_id"] for r in asyncio.run(engine.records("mom")) if r.get("l") == "ctx.spawn"]
    kids = [r for r in asyncio.run(engine.list()) if r.workflow == "kid"]
    assert sorted(k.run_id for k in kids) == sorted(named) and len(set(named)) == 40
    assert {k.status for k in kids} == {"completed"}
    for run_id in named:
        steps = [r for r in asyncio.run(engine.records(run_id)) if r.get("t") == "ok"]
        assert len(steps) == 1, steps


def test_a_parent_records_a_join_only_after_the_child_end_is_durable(tmp_path) -> None:
    """The group commit comes first: every join record the parent appends names a child whose log (with its
    end) a `sync_all` made durable before, and the children's ends are made durable in groups, not one
    fsync each."""
    storage = FileStorage(tmp_path)
    events: list[tuple[str, str]] = []
    sync_all, append = storage.sync_all, storage.append

    def grouped(leases):
        sync_all(leases)
        events.extend(("durable", lease.run_id) for lease in leases)

    def appended(lease, data):  # one append may carry the join records of several children, in order
        events.extend(("join", lease.run_id) for _ in range(data.count(b'"ctx.join"')))
        append(lease, data)

    storage.sync_all = grouped  # type: ignore[method-assign]
    storage.append = appended  # type: ignore[method-assign]

    @workflow
    async def leaf(ctx, n):
        return await ctx.step(lambda: n * 2, name="double")

    @workflow
    async def wide_parent(ctx, n):
        results = await ctx.join_all(await ctx.spawn_all([(leaf, i) for i in range(n)]))
        return [r.value for r in results]

    engine = create_engine(storage, concurrency=4)
    before = storage.fsyncs
    assert asyncio.run(engine.run(wide_parent, 60, advisories="silent")) == [i * 2 for i in range(60)]
    records = asyncio.run(engine.records(next(r.run_id for r in asyncio.run(engine.list())
                                              if r.workflow.endswith("wide_parent"))))
    child_of = {r["p"].rsplit(".", 1)[1]: r["v"]["run_id"] for r in records if r.get("l") == "ctx.spawn"}
    joins = [r["p"].split(".")[1] for r in records if r.get("l") == "ctx.join"]
    durable: set[str] = set()
    order = iter(joins)
    for kind, _ in events:
        if kind == "durable":
            durable.add(_)
        else:
            child = child_of[next(order)]
            assert child in durable, (child, events)
    assert len([e for e in events if e[0] == "join"]) == 60 and durable == set(child_of.values())
    assert all(asyncio.run(engine.inspect(c)).status == "completed" for c in child_of.values())
    assert storage.fsyncs - before < 60 + 10  # not an fsync per child end plus one per child directory entry
