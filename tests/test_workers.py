"""Real `durably worker` processes sharing one queue: SIGKILLed every few seconds and replaced, they finish
every run exactly once with the right result, and no step whose completion was recorded runs again. The mix
has parents that park in `join_all` while their children run on any worker, and steps whose retry backoff
parks the run; workers are also killed while such runs are parked.

Each step appends `key token` to an effects file before it returns `token`; the recorded token of every
step must be the last effect line for its key (a step cut off before it was recorded may run again; a
step recorded as done never does)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import pytest

from durably_py import FileStorage, create_engine
from durably_py._authoring.workflow import REGISTRY, load_script

JOBS = '''
import os, secrets, time
from durably_py import Retry, attempt, workflow

EFFECTS = os.environ["JOBS_EFFECTS"]


def effect(key):
    token = secrets.token_hex(6)
    fd = os.open(EFFECTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{key} {token}\\n".encode())
    finally:
        os.close(fd)
    time.sleep(0.03)
    return token


@workflow
async def soak_chain(ctx, n):
    tokens = [await ctx.step(effect, f"chain{n}.{i}") for i in range(5)]
    return {"n": n, "kind": "chain", "tokens": tokens}


@workflow
async def soak_napper(ctx, n):
    first = await ctx.step(effect, f"napper{n}.0")
    await ctx.sleep(0.5 + (n % 3) * 0.3)
    second = await ctx.step(effect, f"napper{n}.1")
    return {"n": n, "kind": "napper", "tokens": [first, second]}


def flaky_effect(key):
    token = effect(key)
    if attempt().number == 1:
        raise ConnectionError(f"{key}: the first attempt fails")
    return token


@workflow
async def soak_kid(ctx, key):
    token = await ctx.step(effect, key)
    await ctx.sleep(1.0)  # its parent is parked in its join meanwhile
    return token


@workflow
async def soak_parent(ctx, n):
    first = await ctx.step(effect, f"parent{n}.0")
    kids = await ctx.join_all(await ctx.spawn_all([(soak_kid, f"parent{n}.kid{i}") for i in range(2)]))
    return {"n": n, "kind": "parent", "tokens": [first], "kids": [k.value for k in kids]}


@workflow
async def soak_flaky(ctx, n):
    first = await ctx.step(flaky_effect, f"flaky{n}.0", retry=Retry(2, backoff="linear", base=5.5))
    return {"n": n, "kind": "flaky", "tokens": [first]}


@workflow
async def soak_asker(ctx, n):
    first = await ctx.step(effect, f"asker{n}.0")
    answer = await ctx.wait_for("go", timeout=600)
    second = await ctx.step(effect, f"asker{n}.1")
    return {"n": n, "kind": "asker", "answer": answer, "tokens": [first, second]}
'''

KINDS = ("chain", "napper", "asker", "parent", "flaky")  # workflows soak_<kind>, apart from other modules' ones


def _cli(*args: str, env: dict[str, str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "durably_py.cli", *args], env=env, capture_output=True, text=True,
                          timeout=60, **kwargs)


class Fleet:
    """Worker processes on one storage; kill and replace them."""

    def __init__(self, storage_args: list[str], env: dict[str, str], jobs: Path, lease: float | None = None) -> None:
        self.args = [sys.executable, "-m", "durably_py.cli", "worker", *storage_args, "--import", str(jobs),
                     "-c", "4", "--poll", "0.05", "-q"] + (["--lease", str(lease)] if lease else [])
        self.env = env
        self.procs: list[subprocess.Popen[bytes]] = []
        self.killed = 0
        self.killed_parked = 0
        self.last_start = 0.0

    def start(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(self.args, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.procs.append(proc)
        self.last_start = time.monotonic()
        return proc

    def live(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.procs if p.poll() is None]

    def kill_one(self) -> None:
        live = self.live()
        if live:
            victim = random.choice(live)
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            self.killed += 1

    def stop_all(self) -> list[int]:
        """SIGTERM the live workers (once each has had time to start) and return their exit codes."""
        time.sleep(max(0.0, self.last_start + 3.0 - time.monotonic()))
        live = self.live()
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        codes = []
        for proc in live:
            try:
                codes.append(proc.wait(timeout=30))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(-9)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return codes


def _setup(tmp_path: Path) -> tuple[Path, dict[str, str], Path]:
    jobs = tmp_path / "jobs.py"
    jobs.write_text(JOBS)
    effects = tmp_path / "effects.log"
    env = {**os.environ, "JOBS_EFFECTS": str(effects)}
    env.pop("DURABLY_DIR", None)
    env.pop("DURABLY_STORAGE", None)
    return jobs, env, effects


def _enqueue_all(engine: Any, jobs: Path, env: dict[str, str], count: int) -> dict[int, str]:
    os.environ["JOBS_EFFECTS"] = env["JOBS_EFFECTS"]
    for name in (*KINDS, "kid"):
        REGISTRY.pop(f"soak_{name}", None)
    load_script(jobs)

    async def main() -> dict[int, str]:
        ids = {}
        for n in range(count):
            handle = await engine.enqueue(REGISTRY[f"soak_{KINDS[n % len(KINDS)]}"], n, priority=n % 2)
            ids[n] = handle.run_id
        return ids

    return asyncio.run(main())


def _soak(engine: Any, fleet: Fleet, ids: dict[int, str], env: dict[str, str], storage_args: list[str],
          deadline: float, kill_every: float, cli_signals: int, milestones: int = 4) -> None:
    """Keep 3 workers up, kill one every `kill_every` s, one as progress passes each of `milestones` evenly
    spaced fractions (so a fast machine still sees that many kills) and one the first time a parent is seen
    parked in its join and a flaky run in its backoff; signal waiting askers, until every run ended."""
    for _ in range(3):
        fleet.start()
    signalled: set[str] = set()
    next_kill = time.monotonic() + kill_every
    sent_by_cli = 0
    marks = [(i + 0.5) / (milestones + 1) for i in range(milestones)]
    parked_kinds = {"parent": "waiting", "flaky": "sleeping"}
    while time.monotonic() < deadline:
        states = {s.run_id: s.status for s in asyncio.run(engine.list())}
        for kind, status in list(parked_kinds.items()):
            if any(KINDS[n % len(KINDS)] == kind and states.get(r) == status for n, r in ids.items()):
                del parked_kinds[kind]
                fleet.kill_one()
                fleet.start()
                fleet.killed_parked += 1
        done = sum(states.get(r) == "completed" for r in ids.values())
        while marks and done >= marks[0] * len(ids):
            marks.pop(0)
            fleet.kill_one()
            fleet.start()
        if done == len(ids):
            return
        for n, run_id in ids.items():
            if KINDS[n % len(KINDS)] == "asker" and run_id not in signalled and states.get(run_id) == "waiting":
                if sent_by_cli < cli_signals:
                    done = _cli("signal", *storage_args, run_id, "go", f'"yes-{n}"', env=env)
                    assert done.returncode == 0, done.stderr
                    sent_by_cli += 1
                else:
                    asyncio.run(engine.signal(run_id, "go", f"yes-{n}"))
                signalled.add(run_id)
        if time.monotonic() >= next_kill:
            fleet.kill_one()
            fleet.start()
            next_kill = time.monotonic() + kill_every
        time.sleep(0.1)
    states = {s.run_id: s.status for s in asyncio.run(engine.list())}
    unfinished = {r: states.get(r) for r in ids.values() if states.get(r) != "completed"}
    raise AssertionError(f"{len(unfinished)} runs did not complete in time: {list(unfinished.items())[:10]}")


def _verify(engine: Any, ids: dict[int, str], effects: Path) -> None:
    lines = effects.read_text().splitlines()
    last: dict[str, str] = {}
    seen: defaultdict[str, int] = defaultdict(int)
    for line in lines:
        key, token = line.split()
        last[key] = token
        seen[key] += 1
    for n, run_id in ids.items():
        state = asyncio.run(engine.inspect(run_id))
        assert state.status == "completed", (run_id, state.status)
        result = state.result
        kind = KINDS[n % len(KINDS)]
        assert result["n"] == n and result["kind"] == kind
        if kind == "asker":
            assert result["answer"] == f"yes-{n}"
        keys = [f"{kind}{n}.{i}" for i in range(len(result["tokens"]))]
        tokens = list(result["tokens"])
        if kind == "parent":
            keys += [f"parent{n}.kid{i}" for i in range(2)]
            tokens += result["kids"]
            assert len(state.children) == 2
            # parked in its join at least once (a worker may find both children ended when it gets there)
            assert any(r.get("t") == "park" for r in engine.storage.read(run_id).records) or \
                max(asyncio.run(engine.inspect(c)).updated_at for c in state.children) <= state.updated_at
        for key, token in zip(keys, tokens, strict=True):
            assert last[key] == token, f"step {key} ran again after it was recorded ({seen[key]} runs)"
        ends = [s for s in state.steps if s.label in ("effect", "flaky_effect")]
        assert len(ends) == len(result["tokens"])
        if kind == "flaky":
            _check_parked_backoff(engine, run_id)
    assert engine.storage.due(10) == []


def _check_parked_backoff(engine: Any, run_id: str) -> None:
    """The flaky step failed once, parked for its backoff, and its second attempt began at the backoff's end,
    not earlier, with the failed attempt recorded once whatever was killed meanwhile.

    A worker SIGKILLed after it recorded the failure and before it parked the run leaves no park: the worker that
    takes the run over when the lease lapses finds less than `PARK_BACKOFF` of the backoff left and waits it out
    in place."""
    from durably_py._codec import from_iso
    from durably_py._replay.steps import PARK_BACKOFF

    plain = [r if isinstance(r, dict) else msgspec.to_builtins(r) for r in engine.storage.read(run_id).records]
    shown = "\n".join(map(str, plain))
    fails = [r for r in plain if r.get("t") == "fail"]
    [ok] = [r for r in plain if r.get("t") == "ok" and r.get("l") == "flaky_effect"]
    assert [f["a"] for f in fails] == [1] and ok["a"] == 2
    due = from_iso(fails[0]["next"]).timestamp()
    parks = [r for r in plain if r.get("t") == "park"]
    if not any(r.get("until") == fails[0]["next"] for r in parks):
        takeover = next((r for r in plain[plain.index(fails[0]) + 1:] if r.get("t") == "claim"), None)
        assert takeover is not None and not parks, shown  # its worker was killed before it parked
        assert due - from_iso(takeover["at"]).timestamp() < PARK_BACKOFF, shown
    began = ok["ts"] - ok["ms"] / 1000
    assert began >= due - 0.05, "the next attempt ran before its backoff ended"


def test_three_workers_on_one_dir_survive_sigkills(tmp_path: Path) -> None:
    jobs, env, effects = _setup(tmp_path)
    state = tmp_path / "state"
    engine = create_engine(FileStorage(state))
    ids = _enqueue_all(engine, jobs, env, 30)
    fleet = Fleet(["--dir", str(state)], env, jobs)
    try:
        _soak(engine, fleet, ids, env, ["--dir", str(state)], time.monotonic() + 45, kill_every=1.5, cli_signals=3)
    finally:
        codes = fleet.stop_all()
    _verify(engine, ids, effects)
    assert fleet.killed >= 4 and fleet.killed_parked == 2
    assert codes == [0, 0, 0]  # SIGTERM stops a worker gracefully


@pytest.mark.slow
def test_three_hundred_runs_through_workers_killed_every_few_seconds(tmp_path: Path) -> None:
    jobs, env, effects = _setup(tmp_path)
    state = tmp_path / "state"
    engine = create_engine(FileStorage(state))
    ids = _enqueue_all(engine, jobs, env, 300)
    fleet = Fleet(["--dir", str(state)], env, jobs)
    try:
        _soak(engine, fleet, ids, env, ["--dir", str(state)], time.monotonic() + 400, kill_every=1.5,
              cli_signals=10, milestones=8)
    finally:
        fleet.stop_all()
    _verify(engine, ids, effects)
    assert fleet.killed >= 8


def _pg_url(postgres_dsn: str, schema: str) -> str:
    parts = dict(p.split("=", 1) for p in postgres_dsn.split())
    return f"postgresql://{parts['user']}@/{parts['dbname']}?host={parts['host']}&schema={schema}"


@pytest.fixture
def pg_url(postgres_dsn: str) -> Any:
    import uuid

    import psycopg

    schema = f"test_{uuid.uuid4().hex[:16]}"
    yield _pg_url(postgres_dsn, schema)
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.mark.slow  # the same fleet on files runs by default (test_three_workers_on_one_dir_survive_sigkills)
def test_three_workers_on_postgres_survive_sigkills_and_take_over_within_the_lease(tmp_path: Path, pg_url: str,
                                                                                      capsys: Any) -> None:
    jobs, env, effects = _setup(tmp_path)
    engine = create_engine(pg_url)
    ids = _enqueue_all(engine, jobs, env, 24)
    lease = 2.0
    fleet = Fleet(["--storage", pg_url], env, jobs, lease=lease)
    try:
        _soak(engine, fleet, ids, env, ["--storage", pg_url], time.monotonic() + 40, kill_every=3.0, cli_signals=2)
    finally:
        fleet.stop_all()
    _verify(engine, ids, effects)

    # Takeover: a run held by a worker that is SIGKILLed is taken over within lease + one poll.
    REGISTRY.pop("soak_slow", None)
    (tmp_path / "slow.py").write_text(
        "import time\nfrom durably_py import workflow\n\n@workflow\nasync def soak_slow(ctx, x):\n"
        "    await ctx.step(time.sleep, 0.3)\n    await ctx.step(time.sleep, 30)\n    return x\n")
    load_script(tmp_path / "slow.py")
    handle = asyncio.run(engine.enqueue(REGISTRY["soak_slow"], 1))
    solo = Fleet(["--storage", pg_url], env, tmp_path / "slow.py", lease=lease)
    first = solo.start()
    deadline = time.monotonic() + 20
    while not asyncio.run(engine.inspect(handle.run_id)).steps and time.monotonic() < deadline:
        time.sleep(0.05)
    second = solo.start()
    time.sleep(0.5)
    first.send_signal(signal.SIGKILL)
    first.wait()
    killed_at = time.monotonic()
    while time.monotonic() < deadline:
        if asyncio.run(engine.inspect(handle.run_id)).attempt >= 2:
            break
        time.sleep(0.02)
    takeover = time.monotonic() - killed_at
    second.send_signal(signal.SIGKILL)
    second.wait()
    with capsys.disabled():
        print(f"\n  takeover after SIGKILL: {takeover:.2f}s (lease {lease:g}s + poll 0.05s)")
    assert takeover <= lease + 0.05 + 1.5  # lease + one poll, plus process scheduling slack on a busy machine


SLOW_STEPS = '''
import time
from durably_py import workflow


@workflow
async def soak_slow_pair(ctx, x):
    a = await ctx.step(time.sleep, 1.5, name="first")
    b = await ctx.step(time.sleep, 0.01, name="second")
    return x


@workflow
async def soak_dozer(ctx, x):
    await ctx.step(lambda: x, name="before")
    await ctx.sleep(1)
    return await ctx.step(lambda: x * 10, name="after")
'''


def test_sigterm_lets_the_running_step_finish_and_run_no_wait_is_picked_up(tmp_path: Path) -> None:
    script = tmp_path / "slow.py"
    script.write_text(SLOW_STEPS)
    env = {**os.environ}
    env.pop("DURABLY_DIR", None)
    env.pop("DURABLY_STORAGE", None)
    state = tmp_path / "state"
    queued = _cli("enqueue", str(script), "--workflow", "soak_slow_pair", "--input", "7", "--dir", str(state), "--json",
                  env=env)
    assert queued.returncode == 0, queued.stderr
    import json

    run_id = json.loads(queued.stdout)["run_id"]
    parked = _cli("run", str(script), "--workflow", "soak_dozer", "--input", "4", "--no-wait", "--dir", str(state), env=env)
    assert parked.returncode == 3, parked.stderr  # parked on its sleep; no process holds it now
    worker = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "worker", "--dir", str(state), "--poll", "0.05",
                               "--import", str(script)],
                              env=env, stderr=subprocess.PIPE, text=True)
    engine = create_engine(FileStorage(state))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not asyncio.run(engine.inspect(run_id)).attempt:
        time.sleep(0.05)
    time.sleep(0.4)  # inside the 1.5 s step
    worker.send_signal(signal.SIGTERM)
    _, err = worker.communicate(timeout=30)
    assert worker.returncode == 0, err
    state_after = asyncio.run(engine.inspect(run_id))
    assert [s.label for s in state_after.steps] == ["first"]  # the running step finished and was recorded
    assert state_after.status == "interrupted" and run_id in engine.storage.due(10)
    second = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "worker", "--dir", str(state), "--poll",
                               "0.05", "-q", "--import-recorded", "--code-root", str(tmp_path)], env=env)
    try:
        while time.monotonic() < deadline + 10:
            states = {s.workflow: s for s in asyncio.run(engine.list())}
            if all(s.status == "completed" for s in states.values()) and len(states) == 2:
                break
            time.sleep(0.1)
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=30)
    assert states["soak_slow_pair"].status == "completed" and states["soak_dozer"].result == 40
    steps = asyncio.run(engine.inspect(run_id)).steps
    assert [(s.label, s.attempts) for s in steps] == [("first", 1), ("second", 1)]
