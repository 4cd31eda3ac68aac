"""Changing the code of deployed workflows: ctx.patched / ctx.deprecate_patch, `list --without-patch`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import Stop, check_error, durably

from durably_py import MemoryStorage, StaleRunError, ValidationError, create_engine
from durably_py._authoring.workflow import Workflow

FLOW = '''
import os
from durably_py import workflow

VERSION = os.environ["FLOW_VERSION"]


def effect(name):
    with open(os.environ["FLOW_EFFECTS"], "a") as f:
        f.write(name + "\\n")
    return name


def charge_card(order):
    return effect(f"charge-card {order}")


def charge_wallet(order):
    return effect(f"charge-wallet {order}")


def ship(order):
    return effect(f"ship {order}")


if VERSION == "1":
    @workflow(name="order")
    async def order(ctx, order_id):
        paid = await ctx.step(charge_card, order_id, name="charge card")
        await ctx.wait_for("shipped-ok")
        return [paid, await ctx.step(ship, order_id, name="ship")]
elif VERSION == "2":
    @workflow(name="order")
    async def order(ctx, order_id):
        if ctx.patched("wallet"):
            paid = await ctx.step(charge_wallet, order_id, name="charge wallet")
        else:
            paid = await ctx.step(charge_card, order_id, name="charge card")
        await ctx.wait_for("shipped-ok")
        return [paid, await ctx.step(ship, order_id, name="ship")]
else:
    @workflow(name="order")
    async def order(ctx, order_id):
        ctx.deprecate_patch("wallet")
        paid = await ctx.step(charge_wallet, order_id, name="charge wallet")
        await ctx.wait_for("shipped-ok")
        return [paid, await ctx.step(ship, order_id, name="ship")]
'''


RENAMED = '''
import os
from durably_py import workflow

VERSION = os.environ["FLOW_VERSION"]


def effect(name):
    with open(os.environ["FLOW_EFFECTS"], "a") as f:
        f.write(name + "\\n")
    return name


if VERSION == "1":
    @workflow(name="invoice")
    async def invoice(ctx, number):
        total = await ctx.step(effect, f"compute {number}", name="compute total")
        await ctx.wait_for("approved")
        return [total, await ctx.step(effect, f"send {number}", name="send")]
else:
    @workflow(name="invoice")
    async def invoice(ctx, number):
        total = await ctx.step(effect, f"compute {number}", name="total")
        await ctx.wait_for("approved")
        return [total, await ctx.step(effect, f"send {number}", name="send")]
'''


# ---- across real processes ----------------------------------------------------------------------------------
def _cli(tmp_path: Path, version: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return durably(*args, "--dir", str(tmp_path / "state"), cwd=tmp_path, FLOW_VERSION=version,
                   FLOW_EFFECTS=str(tmp_path / "effects"), **env)


def _status(tmp_path: Path, key: str) -> str:
    done = _cli(tmp_path, "1", "inspect", key, "--json")
    assert done.returncode == 0, done.stderr
    return str(json.loads(done.stdout)["status"])


def _start_and_kill(tmp_path: Path, version: str, key: str, script: str = "flow.py", name: str = "order") -> None:
    """Start run `key` in a real process, let it park in its wait, and SIGKILL the process."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "FLOW_VERSION": version,
               "FLOW_EFFECTS": str(tmp_path / "effects")}
    proc = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "run", script, "--workflow", name,
                             "--input", json.dumps(key), "--key", key, "--dir", str(tmp_path / "state")],
                            cwd=tmp_path, env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            runs = tmp_path / "state" / "runs"
            logs = [p.read_text() for p in runs.glob("*.jsonl")] if runs.is_dir() else []
            if any(f'"key":"{key}"' in text and '"t":"wait"' in text for text in logs):
                break
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        else:
            raise AssertionError(f"run {key} never parked")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _effects(tmp_path: Path) -> list[str]:
    path = tmp_path / "effects"
    return path.read_text().splitlines() if path.exists() else []


def _without_patch(tmp_path: Path) -> set[str]:
    done = _cli(tmp_path, "2", "list", "--without-patch", "wallet", "--json")
    assert done.returncode == 0, done.stderr
    return {run["key"] for run in json.loads(done.stdout)}


def test_old_and_new_runs_take_their_own_branch_across_killed_processes(tmp_path: Path) -> None:
    (tmp_path / "flow.py").write_text(FLOW)
    _start_and_kill(tmp_path, "1", "old-a")  # recorded by the code before the change, then killed
    _start_and_kill(tmp_path, "1", "old-b")
    _start_and_kill(tmp_path, "2", "new-c")  # started by the new code, then killed
    assert _effects(tmp_path) == ["charge-card old-a", "charge-card old-b", "charge-wallet new-c"]
    assert _without_patch(tmp_path) == {"old-a", "old-b"}

    for key in ("old-a", "new-c"):
        assert _cli(tmp_path, "2", "signal", key, "shipped-ok").returncode == 0
        done = _cli(tmp_path, "2", "retry", key, "--json")
        assert done.returncode == 0, done.stderr
        expected = ["charge-card old-a", "ship old-a"] if key == "old-a" else ["charge-wallet new-c", "ship new-c"]
        assert json.loads(done.stdout)["result"] == expected
    # the old run replayed its card charge under the new code; no step ran twice, none of the other branch ran
    assert sorted(_effects(tmp_path)) == sorted(["charge-card old-a", "charge-card old-b", "charge-wallet new-c",
                                                 "ship old-a", "ship new-c"])
    inspected = json.loads(_cli(tmp_path, "2", "inspect", "old-a", "--json").stdout)
    assert inspected["patches"] == {"wallet": False}
    assert json.loads(_cli(tmp_path, "2", "inspect", "new-c", "--json").stdout)["patches"] == {"wallet": True}
    assert _without_patch(tmp_path) == {"old-b"}

    # the old branch is deleted while old-b still needs it: reported, the run is stale, nothing ran
    assert _cli(tmp_path, "3", "signal", "old-b", "shipped-ok").returncode == 0
    done = _cli(tmp_path, "3", "retry", "old-b")
    assert done.returncode == 1
    assert "StaleRunError" in done.stderr and "deprecate_patch('wallet')" in done.stderr
    assert "durably list --without-patch wallet" in done.stderr
    assert _status(tmp_path, "old-b") == "stale"
    listed = json.loads(_cli(tmp_path, "3", "list", "--status", "stale", "--json").stdout)
    assert [run["key"] for run in listed] == ["old-b"]
    assert _effects(tmp_path).count("charge-wallet old-b") == 0 and "ship old-b" not in _effects(tmp_path)

    # a run started by the cleaned-up code passes deprecate_patch and records that it is on the new branch
    assert _cli(tmp_path, "3", "run", "flow.py", "--workflow", "order", "--input", '"new-d"', "--key", "new-d",
                "--no-wait").returncode == 3
    assert json.loads(_cli(tmp_path, "3", "inspect", "new-d", "--json").stdout)["patches"] == {"wallet": True}
    assert _without_patch(tmp_path) == {"old-b"}


# ---- the rule, in process ------------------------------------------------------------------------------------
def _two_versions(before: Any, after: Any, name: str = "flow") -> tuple[Workflow, Workflow]:
    return Workflow(before, name=name), Workflow(after, name=name)


def test_patched_is_true_at_the_frontier_and_false_where_old_work_is_recorded() -> None:
    stop = {"at": "b"}
    ran: list[str] = []

    def step(name: str) -> str:
        ran.append(name)
        if stop["at"] == name:
            raise Stop()
        return name

    async def v1(ctx: Any, _: Any) -> list[str]:
        return [await ctx.step(step, "a", name="a"), await ctx.step(step, "b", name="b")]

    async def v2(ctx: Any, _: Any) -> list[str]:
        first = await ctx.step(step, "a", name="a")
        if ctx.patched("p"):
            return [first, await ctx.step(step, "b2", name="b2")]
        return [first, await ctx.step(step, "b", name="b")]

    old, new = _two_versions(v1, v2)
    engine = create_engine(MemoryStorage())
    # cut off before step 1 ran: at the frontier, even an old run takes the new code
    with pytest.raises(Stop):
        asyncio.run(engine.run(old, 1))
    stop["at"] = ""
    assert asyncio.run(engine.run(new, 1)) == ["a", "b2"]
    # cut off after step 1 was recorded by the old code: the old branch, for good
    stop["at"] = "never"

    async def v1_stops(ctx: Any, _: Any) -> None:
        await ctx.step(step, "a", name="a")
        await ctx.step(step, "b", name="b")
        raise Stop()

    with pytest.raises(Stop):
        asyncio.run(engine.run(Workflow(v1_stops, name="flow"), 2))
    ran.clear()
    assert asyncio.run(engine.run(new, 2)) == ["a", "b"]
    assert ran == []
    states = {s.input: s for s in [asyncio.run(engine.inspect(r.run_id)) for r in asyncio.run(engine.list())]}
    assert states[1].patches == {"p": True} and states[2].patches == {"p": False}


def test_a_recorded_answer_wins_over_the_rule() -> None:
    stop = {"on": True}

    async def body(ctx: Any) -> list[Any]:
        answers = [ctx.patched("p")]
        await ctx.step(lambda: 1, name="one")
        answers.append(ctx.patched("p"))  # asked again further on: the same answer
        if stop["on"]:
            raise Stop()
        return answers

    engine = create_engine(MemoryStorage())
    wf = Workflow(body, name="again")
    with pytest.raises(Stop):
        asyncio.run(engine.run(wf))
    stop["on"] = False
    assert asyncio.run(engine.run(wf)) == [True, True]  # the step at path 0 is recorded now; the answer stays


def test_parallel_branches_of_a_new_run_do_not_count_each_other() -> None:
    async def slow(ctx: Any) -> bool:
        await asyncio.sleep(0.05)  # the other branch records its steps meanwhile
        return ctx.patched("p")

    async def fast(ctx: Any) -> int:
        await ctx.step(lambda: 1, name="x")
        return await ctx.step(lambda: 2, name="y")

    async def body(ctx: Any) -> list[Any]:
        results = await ctx.parallel([lambda: slow(ctx), lambda: fast(ctx)])
        return [r.value for r in results]

    engine = create_engine(MemoryStorage())
    assert asyncio.run(engine.run(Workflow(body, name="fan"))) == [True, 2]


def test_a_loop_iteration_of_an_old_run_sees_the_later_iterations() -> None:
    stop = {"on": True}

    async def v1(ctx: Any) -> int:
        async def turn(state: int, it: Any) -> Any:
            if state == 3:
                if stop["on"]:
                    raise Stop()
                return it.done(state)
            await it.step(lambda: state, name="tick")
            return state + 1
        return await ctx.loop(0, turn, snapshot_every=100)

    seen: list[bool] = []

    async def v2(ctx: Any) -> int:
        async def turn(state: int, it: Any) -> Any:
            if state == 3:
                return it.done(state)
            await it.step(lambda: state, name="tick")
            if state == 0:
                seen.append(ctx.patched("p"))  # iteration 0 has nothing after this point, iterations 1-2 do
            return state + 1
        return await ctx.loop(0, turn, snapshot_every=100)

    old, new = _two_versions(v1, v2, "looping")
    engine = create_engine(MemoryStorage())
    with pytest.raises(Stop):
        asyncio.run(engine.run(old))
    assert asyncio.run(engine.run(new)) == 3
    assert seen == [False]


def test_deprecate_patch_stops_a_run_on_the_old_branch_as_stale() -> None:
    stop = {"on": True}

    async def v2(ctx: Any, _: Any) -> str:
        branch = "new" if ctx.patched("p") else "old"
        await ctx.step(lambda: branch, name="work")
        if stop["on"]:
            raise Stop()
        return branch

    async def v1(ctx: Any, _: Any) -> str:
        await ctx.step(lambda: "old", name="work")
        raise Stop()

    async def v3(ctx: Any, _: Any) -> str:
        ctx.deprecate_patch("p")
        await ctx.step(lambda: "new", name="work")
        return "new"

    engine = create_engine(MemoryStorage())
    with pytest.raises(Stop):
        asyncio.run(engine.run(Workflow(v1, name="flow"), "old"))
    with pytest.raises(Stop):
        asyncio.run(engine.run(Workflow(v2, name="flow"), "old"))  # replays: records False
    with pytest.raises(Stop):
        asyncio.run(engine.run(Workflow(v2, name="flow"), "new"))  # records True
    assert {s.input for s in asyncio.run(engine.list(without_patch="p"))} == {"old"}
    with pytest.raises(StaleRunError) as info:
        asyncio.run(engine.run(Workflow(v3, name="flow"), "old"))
    check_error(info.value)
    assert info.value.path == (0,) and info.value.patch == "p"
    assert "docs/versioning.md" in info.value.docs
    assert asyncio.run(engine.run(Workflow(v3, name="flow"), "new")) == "new"
    statuses = {s.input: s.status for s in asyncio.run(engine.list())}
    assert statuses == {"old": "stale", "new": "completed"}
    assert {s.input for s in asyncio.run(engine.list(without_patch="p"))} == {"old"}


def test_a_change_id_is_validated() -> None:
    async def body(ctx: Any) -> bool:
        return ctx.patched("")

    with pytest.raises(ValidationError) as info:
        asyncio.run(create_engine(MemoryStorage()).run(Workflow(body, name="bad")))
    check_error(info.value)


def test_restate_mode_says_patches_are_not_supported() -> None:
    from durably_py.errors import NotSupportedError
    from durably_py.restate.context import RestateWorkflowContext

    ctx = RestateWorkflowContext.__new__(RestateWorkflowContext)
    for call in (lambda: ctx.patched("p"), lambda: ctx.deprecate_patch("p")):
        with pytest.raises(NotSupportedError) as info:
            call()
        check_error(info.value)
        assert "deployment" in info.value.hint


# ---- stale runs and adopt ------------------------------------------------------------------------------------
def test_a_renamed_step_makes_the_run_stale_and_adopt_continues_it_through_the_cli(tmp_path: Path) -> None:
    (tmp_path / "renamed.py").write_text(RENAMED)
    _start_and_kill(tmp_path, "1", "inv-1", "renamed.py", "invoice")
    assert _cli(tmp_path, "2", "signal", "inv-1", "approved").returncode == 0
    done = _cli(tmp_path, "2", "retry", "inv-1")
    assert done.returncode == 1
    run_id = json.loads(_cli(tmp_path, "2", "inspect", "inv-1", "--json").stdout)["run_id"]
    assert "StaleRunError" in done.stderr and f"durably adopt {run_id}" in done.stderr

    expected = {"path": [0], "recorded": "compute total", "called": "total"}
    (listed,) = json.loads(_cli(tmp_path, "2", "list", "--json").stdout)
    assert listed["status"] == "stale" and {k: listed["stale"][k] for k in expected} == expected
    inspected = json.loads(_cli(tmp_path, "2", "inspect", "inv-1", "--json").stdout)
    assert inspected["status"] == "stale" and {k: inspected["stale"][k] for k in expected} == expected
    table = _cli(tmp_path, "2", "list", COLUMNS="200").stdout
    assert "stale at (0,): recorded as 'compute total', now called 'total'" in table
    text = _cli(tmp_path, "2", "inspect", "inv-1", COLUMNS="200").stdout
    assert "recorded as 'compute total', now called 'total'" in text and f"durably adopt {run_id}" in text

    refused = _cli(tmp_path, "2", "adopt", "inv-1")  # no terminal to confirm on, no --yes: nothing changes
    assert refused.returncode == 2
    assert (f"would adopt {run_id}: at (0,), the step now called 'total' is the recorded 'compute total' (its "
            "recorded result \"compute inv-1\"); then the run continues; nothing was touched") in refused.stderr
    assert _status(tmp_path, "inv-1") == "stale"
    done = _cli(tmp_path, "2", "adopt", "inv-1", "--json", "--yes")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["result"] == ["compute inv-1", "send inv-1"]
    assert _effects(tmp_path) == ["compute inv-1", "send inv-1"]  # the adopted step did not run again
    assert _status(tmp_path, "inv-1") == "completed"
    records = [json.loads(line) for line in (tmp_path / "state" / "runs" / f"{run_id}.jsonl").read_text().splitlines()]
    assert {"t": "adopt", "p": "0", "recorded": "compute total", "l": "total"}.items() <= \
        next(r for r in records if r["t"] == "adopt").items()

    again = _cli(tmp_path, "2", "adopt", "inv-1", "--yes")
    assert again.returncode == 2
    assert "is completed, not stale; there is nothing to adopt" in again.stderr and "hint:" in again.stderr


def _invoice(steps: list[str], stop: dict[str, bool], ran: list[str]) -> Workflow:
    def work(name: str) -> str:
        ran.append(name)
        return name

    async def body(ctx: Any, number: int) -> list[str]:
        out = [await ctx.step(work, f"{name} {number}", name=name) for name in steps[:-1]]
        if stop["on"]:
            raise Stop()
        return [*out, await ctx.step(work, f"{steps[-1]} {number}", name=steps[-1])]

    wf = Workflow(body, name="invoice")
    wf.fingerprint = "-".join(steps)  # each version is other code, as an edited source file would be
    return wf


def test_adopt_through_the_api_one_rename_at_a_time() -> None:
    ran: list[str] = []
    stop = {"on": True}
    engine = create_engine(MemoryStorage())
    with pytest.raises(Stop):
        asyncio.run(engine.run(_invoice(["compute", "check", "send"], stop, ran), 7))
    run_id = asyncio.run(engine.list())[0].run_id
    stop["on"] = False
    renamed = _invoice(["total", "verify", "send"], stop, ran)
    with pytest.raises(StaleRunError) as info:
        asyncio.run(engine.run(renamed, 7))
    check_error(info.value)
    assert "durably adopt" in info.value.hint and info.value.docs.endswith("versioning.md#adopt")
    state = asyncio.run(engine.inspect(run_id))
    assert state.status == "stale" and state.stale is not None
    assert (state.stale["path"], state.stale["recorded"], state.stale["called"]) == ([0], "compute", "total")

    with pytest.raises(ValidationError) as bad:
        asyncio.run(engine.adopt(run_id, path=(5,)))
    assert "path 5 has no recorded step" in bad.value.message and "0 compute" in bad.value.message
    ran.clear()  # `renamed` registered itself under the workflow's name: adopt resumes the run with it
    with pytest.raises(StaleRunError) as second:  # adopted (0,); the next rename stops it again
        asyncio.run(engine.adopt(run_id))
    assert second.value.path == (1,) and ran == []
    assert asyncio.run(engine.adopt(run_id, path="1")) == ["compute 7", "check 7", "send 7"]
    assert ran == ["send 7"]

    with pytest.raises(ValidationError) as info2:
        asyncio.run(engine.adopt(run_id))
    check_error(info2.value)
    assert "not stale" in info2.value.message


def test_adopt_refuses_a_run_that_is_not_stale_and_a_retired_patch() -> None:
    ran: list[str] = []
    stop = {"on": True}
    engine = create_engine(MemoryStorage())
    with pytest.raises(Stop):
        asyncio.run(engine.run(_invoice(["compute", "send"], stop, ran), 1))
    run_id = asyncio.run(engine.list())[0].run_id
    with pytest.raises(ValidationError) as info:
        asyncio.run(engine.adopt(run_id))
    check_error(info.value)
    assert "is interrupted, not stale" in info.value.message and "durably retry" in info.value.hint

    async def old(ctx: Any, _: Any) -> None:
        await ctx.step(lambda: 1, name="work")
        raise Stop()

    async def retired(ctx: Any, _: Any) -> int:
        ctx.deprecate_patch("p")
        return await ctx.step(lambda: 1, name="work")

    with pytest.raises(Stop):
        asyncio.run(engine.run(Workflow(old, name="patchy"), 2))
    with pytest.raises(StaleRunError):
        asyncio.run(engine.run(Workflow(retired, name="patchy"), 2))
    stale = next(s for s in asyncio.run(engine.list()) if s.workflow == "patchy")
    assert stale.status == "stale" and stale.stale is not None and stale.stale["patch"] == "p"
    with pytest.raises(ValidationError) as refused:
        asyncio.run(engine.adopt(stale.run_id))
    assert "old branch of patch 'p'" in refused.value.message and "ctx.patched('p')" in refused.value.hint
