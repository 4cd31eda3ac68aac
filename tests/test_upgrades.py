"""The upgrade guard: a run keeps the source it started with, a resume on diverging code runs no step before it
is held `stale`, `durably diff` shows the change, and `durably retry --recorded-source` runs it on its own code.
Replay-safe edits pass unnoticed."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import durably, storage_of

from durably_py import RunParkedError, StaleRunError, ValidationError, create_engine, workflow
from durably_py.testing import TestEngine

PARALLEL_V1 = '''
import os
import time
from durably_py import workflow


def effect(name, pause=0.0):
    time.sleep(pause)
    with open(os.environ["FLOW_EFFECTS"], "a") as f:
        f.write(name + "\\n")
    return name


@workflow(name="fanout")
async def fanout(ctx):
    async def a():
        return [await ctx.step(effect, "a1", name="a1"), await ctx.step(effect, "a2", name="a2")]

    async def b():
        return [await ctx.step(effect, "b1", 0.4, name="b1"), await ctx.step(effect, "b2", name="b2")]

    done = [result.value for result in await ctx.parallel([a, b])]
    await ctx.wait_for("go")
    return [*done[0], *done[1], await ctx.step(effect, "end", name="end")]
'''

# Branch a gains a step past its recorded frontier; branch b renames a recorded step, which the replay meets
# only after branch a has reached its new step.
PARALLEL_V2 = PARALLEL_V1.replace(
    'return [await ctx.step(effect, "a1", name="a1"), await ctx.step(effect, "a2", name="a2")]',
    'out = [await ctx.step(effect, "a1", name="a1"), await ctx.step(effect, "a2", name="a2")]\n'
    '        return [*out, await ctx.step(effect, "a3", name="a3")]').replace(
    'await ctx.step(effect, "b2", name="b2")', 'await ctx.step(effect, "b2", name="b2-renamed")')

SAFE_V1 = '''
import os
from durably_py import workflow


def effect(name):
    with open(os.environ["FLOW_EFFECTS"], "a") as f:
        f.write(name + "\\n")
    return name


@workflow(name="safe")
async def safe(ctx):
    first = await ctx.step(effect, "first", name="first")
    await ctx.wait_for("go")
    return [first, await ctx.step(effect, "second", name="second")]
'''

SAFE_V2 = SAFE_V1.replace('    first = await', '    # a comment, and a step past the frontier: a replay-safe edit\n    first = await').replace(
    'return [first, await ctx.step(effect, "second", name="second")]',
    'return [first, await ctx.step(effect, "second", name="second"), await ctx.step(effect, "third", name="third")]')


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return durably(*args, "--dir", str(tmp_path / "state"), cwd=tmp_path, FLOW_EFFECTS=str(tmp_path / "effects"))


def _effects(tmp_path: Path) -> list[str]:
    path = tmp_path / "effects"
    return path.read_text().splitlines() if path.exists() else []


def _start_until_parked(tmp_path: Path, script: str, name: str) -> str:
    """`durably run SCRIPT` in a real process until its run parks in its wait; SIGKILL it; the run's id."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "FLOW_EFFECTS": str(tmp_path / "effects")}
    proc = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "run", script, "--workflow", name,
                             "--dir", str(tmp_path / "state")], cwd=tmp_path, env=environ,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    runs = tmp_path / "state" / "runs"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for log in runs.glob("*.jsonl") if runs.is_dir() else []:
                if '"t":"wait"' in log.read_text():
                    return log.stem
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        raise AssertionError("the run never parked")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _header(tmp_path: Path, run_id: str) -> dict[str, Any]:
    return dict(json.loads((tmp_path / "state" / "runs" / f"{run_id}.jsonl").read_text().splitlines()[0]))


def test_a_diverging_edit_holds_the_run_stale_before_any_step_runs_and_it_resumes_on_its_recorded_source(
        tmp_path: Path) -> None:
    script = tmp_path / "fanout.py"
    script.write_text(PARALLEL_V1)
    run_id = _start_until_parked(tmp_path, "fanout.py", "fanout")
    assert sorted(_effects(tmp_path)) == ["a1", "a2", "b1", "b2"]
    header = _header(tmp_path, run_id)
    assert header["source"] == hashlib.sha256(PARALLEL_V1.encode()).hexdigest()
    assert (tmp_path / "state" / "blobs" / header["source"]).read_text() == PARALLEL_V1

    script.write_text(PARALLEL_V2)  # deploy: branch a gains a3, branch b renames b2
    assert _cli(tmp_path, "signal", run_id, "go").returncode == 0
    done = _cli(tmp_path, "retry", run_id)
    assert done.returncode == 1 and "StaleRunError" in done.stderr, done.stderr
    assert "recorded as 'b2', now called 'b2-renamed'" in done.stderr
    # branch a reached its new step before branch b met the rename: held, it never ran
    assert sorted(_effects(tmp_path)) == ["a1", "a2", "b1", "b2"]
    inspected = json.loads(_cli(tmp_path, "inspect", run_id, "--json").stdout)
    assert inspected["status"] == "stale" and inspected["stale"]["called"] == "b2-renamed"

    diff = _cli(tmp_path, "diff", run_id)
    assert diff.returncode == 1, diff.stderr
    assert '-        return [await ctx.step(effect, "a1", name="a1")' in diff.stdout
    assert '+        return [*out, await ctx.step(effect, "a3", name="a3")]' in diff.stdout
    assert f"(run started {header['source'][:12]})" in diff.stdout
    shown = json.loads(_cli(tmp_path, "diff", run_id, "--json").stdout)
    assert shown["changed"] is True and shown["started"] == header["source"]
    assert shown["current"] == hashlib.sha256(PARALLEL_V2.encode()).hexdigest()

    # the operator runs it on the code it started with: it completes as version 1 would, nothing run twice
    done = _cli(tmp_path, "retry", run_id, "--recorded-source", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["result"] == ["a1", "a2", "b1", "b2", "end"]
    assert sorted(_effects(tmp_path)) == ["a1", "a2", "b1", "b2", "end"]


def test_a_replay_safe_edit_passes_unnoticed_and_diff_says_when_nothing_changed(tmp_path: Path) -> None:
    script = tmp_path / "safe.py"
    script.write_text(SAFE_V1)
    run_id = _start_until_parked(tmp_path, "safe.py", "safe")
    same = _cli(tmp_path, "diff", run_id)
    assert same.returncode == 0 and "is the file the run started with" in same.stderr, same.stderr
    script.write_text(SAFE_V2)
    assert _cli(tmp_path, "signal", run_id, "go").returncode == 0
    done = _cli(tmp_path, "retry", run_id, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["result"] == ["first", "second", "third"]
    assert _effects(tmp_path) == ["first", "second", "third"]
    log = (tmp_path / "state" / "runs" / f"{run_id}.jsonl").read_text().splitlines()
    code = [json.loads(line) for line in log if '"t":"code"' in line]
    assert [c["source"] for c in code] == [hashlib.sha256(SAFE_V2.encode()).hexdigest()]
    assert _cli(tmp_path, "diff", run_id).returncode == 1  # still: against the file it started with


def test_diff_and_recorded_source_refuse_clearly(tmp_path: Path) -> None:
    missing = _cli(tmp_path, "diff", "no-such-run")
    assert missing.returncode == 2 and "no-such-run" in missing.stderr
    engine = create_engine(storage_of("file", tmp_path))

    # a run whose header names no source (a log from before sources were kept)
    @workflow(name="upg-nosource")
    async def nosource(ctx: Any) -> int:
        return 1

    import asyncio

    handle = asyncio.run(engine.run(nosource, key="ns", wait=False))
    run_id = handle.run_id if hasattr(handle, "run_id") else engine.resolve("ns")
    (log,) = Path(engine.storage.dir).glob(f"runs/{run_id}.jsonl")
    lines = log.read_text().splitlines()
    header = json.loads(lines[0])
    header.pop("source", None)
    log.write_text("\n".join([json.dumps(header, separators=(",", ":")), *lines[1:]]) + "\n")
    with pytest.raises(ValidationError, match="recorded no source file") as caught:
        asyncio.run(engine.diff(run_id))
    assert caught.value.hint and caught.value.docs == "docs/versioning.md#upgrades"


@pytest.mark.parametrize("kind", ["memory", "file", "sqlite", "postgres"])
def test_every_adapter_keeps_a_source_once_and_refuses_a_wrong_digest(kind: str, tmp_path: Path,
                                                                       request: pytest.FixtureRequest) -> None:
    storage = storage_of(kind, tmp_path, request)
    text = b"print('v1')\n"
    digest = hashlib.sha256(text).hexdigest()
    assert storage.blob(digest) is None
    storage.keep_blob(digest, text)
    storage.keep_blob(digest, text)  # once
    assert storage.blob(digest) == text
    for bad in ("abc", digest.upper(), 42):
        with pytest.raises(ValidationError):
            storage.blob(bad)
    with pytest.raises(ValidationError, match="is not the data of that digest"):
        storage.keep_blob(hashlib.sha256(b"other").hexdigest(), text)
    assert storage.blob(hashlib.sha256(b"other").hexdigest()) is None


def test_the_guard_holds_a_new_parallel_step_in_process_and_under_the_test_engine() -> None:
    import asyncio

    ran: list[str] = []

    def effect(name: str, pause: float = 0.0) -> str:
        time.sleep(pause)
        ran.append(name)
        return name

    def version(extra: bool, renamed: bool) -> Any:
        async def body(ctx: Any) -> list[str]:
            async def a() -> list[str]:
                out = [await ctx.step(effect, "a1", name="a1"), await ctx.step(effect, "a2", name="a2")]
                return [*out, await ctx.step(effect, "a3", name="a3")] if extra else out

            async def b() -> list[str]:
                return [await ctx.step(effect, "b1", 0.3, name="b1"),
                        await ctx.step(effect, "b2", name="b2-renamed" if renamed else "b2")]

            done = [result.value for result in await ctx.parallel([a, b])]
            await ctx.wait_for("go")
            return [*done[0], *done[1]]

        wf = workflow(name="upg-guard")(body)
        wf.fingerprint = f"v-{extra}-{renamed}"  # each version is other code, as an edited file would be
        return wf

    async def diverge(engine: Any, run_id: str) -> None:
        version(True, True)  # the diverging deploy
        await engine.signal(run_id, "go")
        with pytest.raises(StaleRunError, match="now called 'b2-renamed'"):
            await engine.retry(run_id)

    async def in_process() -> str:
        engine = create_engine(storage_of("memory", Path(".")))
        with pytest.raises(RunParkedError) as parked:
            await engine.run(version(False, False), wait=False)
        assert sorted(ran) == ["a1", "a2", "b1", "b2"]
        await diverge(engine, parked.value.run_id)
        return (await engine.inspect(parked.value.run_id)).status

    async def under_test_engine() -> str:
        with TestEngine() as engine:
            started = await engine.run(version(False, False))
            assert sorted(ran) == ["a1", "a2", "b1", "b2"] and started.status not in ("completed", "failed")
            await diverge(engine.engine, started.run_id)
            return (await engine.inspect(started.run_id)).status

    for mode in (in_process, under_test_engine):
        ran.clear()
        assert asyncio.run(mode()) == "stale"
        assert "a3" not in ran, ran  # held until the replay met the rename, then never run


def test_a_worker_holds_a_diverging_run_stale_before_any_step_runs(tmp_path: Path) -> None:
    script = tmp_path / "fanout.py"
    script.write_text(PARALLEL_V1)
    run_id = _start_until_parked(tmp_path, "fanout.py", "fanout")
    script.write_text(PARALLEL_V2)
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]),
               "FLOW_EFFECTS": str(tmp_path / "effects")}
    worker = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "worker", "--import", "fanout", "--dir",
                               str(tmp_path / "state"), "--poll", "0.05"], cwd=tmp_path, env=environ,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert _cli(tmp_path, "signal", run_id, "go").returncode == 0
        deadline = time.monotonic() + 60
        while json.loads(_cli(tmp_path, "inspect", run_id, "--json").stdout)["status"] != "stale":
            assert time.monotonic() < deadline and worker.poll() is None, \
                worker.stderr.read() if worker.stderr and worker.poll() is not None else "timed out"
            time.sleep(0.1)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    assert sorted(_effects(tmp_path)) == ["a1", "a2", "b1", "b2"]
