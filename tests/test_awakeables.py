"""Awakeables: `ctx.awakeable()` hands out an id (and a callback URL with an unguessable token) that an outside
system resolves, also while no process runs the run. Proven through the public API in `run()` (a process waiting
on it), `run(wait=False)` (parked, resolved by another process, resumed with the same awakeable), real
`durably worker` processes (holding no slot while parked, woken by a resolution and by a deadline) resolved by an
HTTP POST to a real `durably ui` while no worker runs, `TestEngine` (on its fake clock), the CLI in subprocesses,
the console's routes, and every bad input (nothing changed by any of them)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import urllib.parse
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import durably, wait_until
from helpers import storage_url as store_of

from durably_py import (
    AwakeableNotFoundError,
    AwakeableRejectedError,
    AwakeableResolvedError,
    AwakeableTimeoutError,
    AwakeableTokenError,
    Engine,
    FileStorage,
    RunParkedError,
    ValidationError,
    WaitTimeoutError,
    create_engine,
    workflow,
)
from durably_py.testing import TestEngine


@dataclass
class Approval:
    approved: bool
    by: str


def hand_out(awakeable_id: str, url: str | None) -> list[Any]:
    """What a workflow sends the outside system (recorded once)."""
    return [awakeable_id, url]


@workflow(name="awk_approval")
async def approval(ctx: Any, order: int) -> dict[str, Any]:
    a = await ctx.awakeable(timeout=600, schema=Approval, name="approval")
    sent = await ctx.step(hand_out, a.id, a.url, name="hand out")
    got = await a
    return {"order": order, "id": a.id, "url": a.url, "sent": sent, "approved": got.approved, "by": got.by}


@workflow(name="awk_plain")
async def plain(ctx: Any, timeout: float | None) -> Any:
    a = await ctx.awakeable(timeout=timeout)
    try:
        return {"value": await a, "again": await a.result()}
    except AwakeableRejectedError as exc:
        return {"rejected": exc.message}
    except AwakeableTimeoutError as exc:
        return {"timed_out": isinstance(exc, WaitTimeoutError), "deadline": exc.deadline}


def storage_url(tmp_path: Path) -> str:
    return f"sqlite:{tmp_path / 'runs.db'}"


def parked(engine: Engine, wf: Any, input: Any) -> str:
    with pytest.raises(RunParkedError) as stop:
        asyncio.run(engine.run(wf, input, wait=False))
    assert "resolve-awakeable" in stop.value.hint
    return stop.value.run_id


def open_awakeable(engine: Engine, run_id: str) -> dict[str, Any]:
    state = asyncio.run(engine.inspect(run_id))
    assert state.status == "waiting" and len(state.awakeables) == 1, state
    return state.awakeables[0]


def test_a_process_waiting_on_it_gets_the_value_another_process_sends(tmp_path: Path) -> None:
    engine = create_engine(storage_url(tmp_path), callback_url="https://callbacks.example/")

    async def main() -> Any:
        task = asyncio.ensure_future(engine.run(approval, 1))
        while not (found := await engine.list(status="waiting")) or not found[0].awakeables:
            assert not task.done(), task.result()
            await asyncio.sleep(0.02)
        awakeable = found[0].awakeables[0]
        other = create_engine(storage_url(tmp_path))  # any process: here a second engine over the same store
        done = await other.resolve_awakeable(awakeable["id"], {"approved": True, "by": "ana"})
        assert done.held and not done.rejected
        return awakeable, await asyncio.wait_for(task, 30)

    awakeable, result = asyncio.run(main())
    assert result["approved"] is True and result["by"] == "ana" and result["id"] == awakeable["id"]
    assert awakeable["name"] == "approval" and awakeable["deadline"]
    url = urllib.parse.urlsplit(result["url"])
    token = url.path.rsplit("/", 1)[1]
    assert url.netloc == "callbacks.example" and url.path == f"/callbacks/{awakeable['id']}/{token}"
    assert len(token) >= 32 and token not in awakeable["id"]
    assert result["sent"] == [result["id"], result["url"]]


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def test_a_parked_run_is_resolved_while_no_process_runs_it_and_asks_again_for_the_same_awakeable(
        tmp_path: Path, kind: str, request: pytest.FixtureRequest) -> None:
    url = store_of(kind, tmp_path, request)
    engine = create_engine(url, callback_url="http://127.0.0.1:8765")
    run_id = parked(engine, approval, 2)
    awakeable = open_awakeable(engine, run_id)
    assert awakeable["id"] == f"{run_id}:0" and awakeable["path"] == [0]
    with pytest.raises(RunParkedError):  # resumed before any answer: it parks again on the same awakeable
        asyncio.run(engine.retry(run_id, wait=False))
    assert open_awakeable(engine, run_id) == awakeable

    done = durably("resolve-awakeable", awakeable["id"], '{"approved": false, "by": "bo"}', "--storage", url, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"awakeable": awakeable["id"], "run_id": run_id, "path": [0],
                                       "rejected": False, "held": False, "resolved": True}
    state = asyncio.run(engine.inspect(run_id))
    assert state.status == "waiting" and state.ready == f"awakeable {awakeable['id']} resolved"
    result = asyncio.run(engine.retry(run_id))
    assert result["approved"] is False and result["by"] == "bo" and result["id"] == awakeable["id"]
    assert result["sent"] == [result["id"], result["url"]]  # the step ran once: the id and URL are the same
    records = asyncio.run(engine.records(run_id))
    assert [r["t"] for r in records].count("awk") == 1
    assert sum(1 for r in records if r["t"] == "ok" and r["l"] == "hand out") == 1


def test_bad_resolutions_are_refused_and_change_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="callback_url must be an http"):
        create_engine(storage_url(tmp_path), callback_url="ftp://files.example")
    engine = create_engine(storage_url(tmp_path))
    run_id = parked(engine, approval, 3)
    awakeable = open_awakeable(engine, run_id)["id"]
    before = asyncio.run(engine.records(run_id)), engine.storage.inbox(run_id)

    bad: list[tuple[Any, type[Exception], str]] = [
        (lambda: engine.resolve_awakeable(awakeable, {"approved": "maybe", "by": "x"}), ValidationError,
         "invalid value at $.approved: expected true or false"),
        (lambda: engine.resolve_awakeable(awakeable, {"approved": True}), ValidationError, "invalid value at $.by: a required field is missing"),
        (lambda: engine.resolve_awakeable(f"{run_id}:7", {}), AwakeableNotFoundError, "created no awakeable"),
        (lambda: engine.resolve_awakeable("nobody-0000:0", {}), AwakeableNotFoundError, "no such run"),
        (lambda: engine.resolve_awakeable("not an id", {}), AwakeableNotFoundError, "is not an awakeable id"),
        (lambda: engine.resolve_awakeable(awakeable, {"approved": True, "by": "x"}, token="forged"),
         AwakeableTokenError, "is not the one"),
        (lambda: engine.reject_awakeable(awakeable, ""), ValidationError, "needs a message"),
        (lambda: engine.resolve_awakeable(awakeable, {"approved": True, "by": {1, 2}}), Exception, "set"),
    ]
    for call, kind, words in bad:
        with pytest.raises(kind) as refused:
            asyncio.run(call())
        assert words in str(refused.value), (words, refused.value)
        assert getattr(refused.value, "hint", None)
    assert (asyncio.run(engine.records(run_id)), engine.storage.inbox(run_id)) == before

    asyncio.run(engine.resolve_awakeable(awakeable, {"approved": True, "by": "first"}))
    for twice in (lambda: engine.resolve_awakeable(awakeable, {"approved": False, "by": "second"}),
                  lambda: engine.reject_awakeable(awakeable, "too late")):
        with pytest.raises(AwakeableResolvedError, match="resolved already; the first resolution stands"):
            asyncio.run(twice())
    assert asyncio.run(engine.retry(run_id))["by"] == "first"
    with pytest.raises(AwakeableResolvedError, match="was resolved already"):
        asyncio.run(engine.resolve_awakeable(awakeable, {"approved": False, "by": "after the end"}))

    cli = [("resolve-awakeable", f"{run_id}:9", "1"), ("resolve-awakeable", awakeable, "2"),
           ("resolve-awakeable", awakeable, "1", "--reject", "both"), ("resolve-awakeable", "x", "{not json")]
    codes = []
    for args in cli:
        done = durably(*args, "--storage", storage_url(tmp_path))
        assert "Traceback" not in done.stderr and "hint:" in done.stderr, done.stderr
        codes.append(done.returncode)
    assert codes == [2, 1, 2, 2]


def test_a_rejection_and_a_deadline_reach_the_workflow_as_errors(tmp_path: Path) -> None:
    engine = create_engine(storage_url(tmp_path))
    rejected = parked(engine, plain, None)
    done = durably("resolve-awakeable", f"{rejected}:0", "--reject", "card declined", "--storage",
                   storage_url(tmp_path))
    assert done.returncode == 0 and "rejected" in done.stderr, done.stderr
    assert asyncio.run(engine.retry(rejected)) == {"rejected": "card declined"}

    late = parked(engine, plain, 0.3)
    wait_until(lambda: asyncio.run(engine.inspect(late)).ready is not None, 10)
    assert "passed its deadline" in (asyncio.run(engine.inspect(late)).ready or "")
    with pytest.raises(AwakeableResolvedError, match="passed its deadline"):
        asyncio.run(engine.resolve_awakeable(f"{late}:0", 1))
    result = asyncio.run(engine.retry(late))
    assert result["timed_out"] is True and result["deadline"] == open_deadline(engine, late)


def open_deadline(engine: Engine, run_id: str) -> str:
    return next(r["deadline"] for r in asyncio.run(engine.records(run_id)) if r["t"] == "awk")


def test_the_test_engine_resolves_and_times_out_on_its_fake_clock() -> None:
    with TestEngine() as t:
        first = t.sync.run(approval, 4)
        assert first.status == "waiting"
        awakeable = t.sync.inspect(first.run_id).awakeables[0]
        t.sync.resolve_awakeable(awakeable["id"], {"approved": True, "by": "tess"})
        done = t.sync.resume(first.run_id)
        assert done.status == "completed" and done.result["by"] == "tess" and done.result["url"] is None
        t.sync.verify(first.run_id)  # a shadow replay answers the awakeable from the log

        timed = t.sync.run(plain, 3600)
        assert timed.status == "waiting"
        t.clock.advance(3599)
        assert t.sync.inspect(timed.run_id).status == "waiting"
        t.clock.advance(2)  # past the deadline: the parked run wakes on the fake clock
        state = t.sync.inspect(timed.run_id)
        assert state.status == "completed" and state.result["timed_out"] is True, state

        rejected = t.sync.run(plain, None)
        t.sync.reject_awakeable(f"{rejected.run_id}:0", "no")
        assert t.sync.resume(rejected.run_id).result == {"rejected": "no"}


@pytest.mark.filterwarnings("ignore::Warning")
def test_the_console_resolves_with_its_token_and_a_callback_with_the_awakeable_token_alone(tmp_path: Path) -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from starlette.testclient import TestClient

    from durably_py.ui import create_app

    engine = create_engine(storage_url(tmp_path), callback_url="http://testserver")
    first, second = parked(engine, plain, None), parked(engine, approval, 5)
    client = TestClient(create_app(engine, token="s3cret", loopback=False))

    def post(path: str, body: Any, **headers: str) -> Any:
        return client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json", **headers})

    assert post(f"/api/awakeables/{first}:0", {"value": 1}).status_code == 401
    ok = post(f"/api/awakeables/{first}:0", {"value": [1, 2]}, Authorization="Bearer s3cret")
    assert ok.status_code == 200 and ok.json()["resolved"] is True
    again = post(f"/api/awakeables/{first}:0", {"value": 3}, Authorization="Bearer s3cret")
    assert again.status_code == 409 and "already" in again.json()["message"] and again.json()["hint"]
    assert post("/api/awakeables/nope:0", {"value": 3}, Authorization="Bearer s3cret").status_code == 404

    url = open_url(engine, second)
    path = urllib.parse.urlsplit(url).path
    forged = path.rsplit("/", 1)[0] + "/" + "A" * 32
    assert post(forged, {"approved": True, "by": "eve"}).status_code == 403
    assert post(path.replace(f"{second}:0", f"{second}:4"), True).status_code == 404
    invalid = post(path, {"approved": "yes", "by": "x"})
    assert invalid.status_code == 400 and "approved" in invalid.json()["message"]
    assert engine.storage.inbox(second) == []
    assert post(path, {"approved": True, "by": "webhook"}).status_code == 200  # no console token needed
    assert post(path, {"approved": False, "by": "replayed"}).status_code == 409
    assert asyncio.run(engine.retry(second))["by"] == "webhook"
    assert asyncio.run(engine.retry(first)) == {"value": [1, 2], "again": [1, 2]}


def open_url(engine: Engine, run_id: str) -> str:
    """The callback URL the run handed out (its `hand out` step's recorded output)."""
    step = next(s for s in asyncio.run(engine.inspect(run_id)).steps if s.label == "hand out")
    return step.output[1]


SCRIPT = textwrap.dedent('''
    import pathlib
    from durably_py import AwakeableTimeoutError, workflow

    def hand_out(url):
        pathlib.Path("callback-url").write_text(url)
        return url

    @workflow
    async def order(ctx, n):
        a = await ctx.awakeable(timeout=600, name="payment")
        await ctx.step(hand_out, a.url)
        return {"n": n, "paid": await a}

    @workflow
    async def expiring(ctx, seconds):
        a = await ctx.awakeable(timeout=seconds)
        try:
            return await a
        except AwakeableTimeoutError:
            return "expired"
''')


class Console:
    """A real `durably ui` over `state` on a free port."""

    def __init__(self, state: Path, cwd: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}
        env["PYTHONPATH"] = os.pathsep.join(sys.path)
        self.proc = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "ui", "--dir", str(state), "--port",
                                      "0"], cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        wait_until(lambda: self.url is not None or self.proc.poll() is not None, 30)
        assert self.url is not None, "".join(self.err)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)

    @property
    def url(self) -> str | None:
        found = re.search(r"(http://\S+?:\d+)/", "".join(self.err))
        return found.group(1) if found else None

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def post(url: str, body: Any) -> tuple[int, dict[str, Any]]:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("POST", parts.path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def worker(project: Path, state: Path, callback: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}
    env.update(PYTHONPATH=os.pathsep.join(sys.path), DURABLY_CALLBACK_URL=callback)
    return subprocess.Popen([sys.executable, "-m", "durably_py.cli", "worker", "--import", "flows.py", "--dir",
                             str(state), "-c", "1", "--poll", "0.05", "-q"], cwd=project, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=30)[1]


def test_a_worker_parks_it_a_post_to_the_real_console_resolves_it_with_no_worker_and_a_new_worker_finishes(
        tmp_path: Path) -> None:
    (tmp_path / "flows.py").write_text(SCRIPT)
    state = tmp_path / ".durably"
    engine = Engine(FileStorage(state))
    order = durably("enqueue", "flows.py", "-w", "order", "-i", "7", "--dir", str(state), cwd=tmp_path).stdout.strip()
    expiring = durably("enqueue", "flows.py", "-w", "expiring", "-i", "2", "--dir", str(state),
                       cwd=tmp_path).stdout.strip()
    assert order and expiring
    console = Console(state, tmp_path)
    try:
        assert console.url is not None
        first = worker(tmp_path, state, console.url)
        try:  # one slot: both runs wait at once only because a parked run holds none
            wait_until(lambda: (tmp_path / "callback-url").exists() and first.poll() is None, 60)
            wait_until(lambda: asyncio.run(engine.inspect(expiring)).status == "waiting", 60)
            assert asyncio.run(engine.inspect(order)).status == "waiting"
            wait_until(lambda: asyncio.run(engine.inspect(expiring)).status == "completed", 60)  # its deadline woke it
        finally:
            err = stop(first)
        assert asyncio.run(engine.inspect(expiring)).result == "expired", err
        assert not engine.storage.held(order)

        url = (tmp_path / "callback-url").read_text()
        assert url.startswith(console.url + f"/callbacks/{order}:0/")
        forged = url[:-4] + "AAAA"
        assert post(forged, {"ok": 1})[0] == 403
        status, body = post(url, {"charge": "ch_1"})  # no worker runs now
        assert status == 200 and body == {"awakeable": f"{order}:0", "run_id": order, "path": [0],
                                          "rejected": False, "held": False, "resolved": True}
        status, body = post(url, {"charge": "ch_2"})
        assert status == 409 and "already" in body["message"]
        assert asyncio.run(engine.inspect(order)).ready == f"awakeable {order}:0 resolved"

        second = worker(tmp_path, state, console.url)
        try:
            wait_until(lambda: asyncio.run(engine.inspect(order)).status == "completed", 60)
        finally:
            stop(second)
        assert asyncio.run(engine.inspect(order)).result == {"n": 7, "paid": {"charge": "ch_1"}}
    finally:
        console.close()


def test_a_process_killed_while_it_waits_leaves_the_awakeable_that_the_resumed_run_gets_back(tmp_path: Path) -> None:
    (tmp_path / "flows.py").write_text(SCRIPT)
    state = tmp_path / ".durably"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}
    env.update(PYTHONPATH=os.pathsep.join(sys.path), DURABLY_CALLBACK_URL="https://hooks.example")
    waiting = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "run", "flows.py", "-w", "order", "-i", "9",
                                "--dir", str(state)], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: (tmp_path / "callback-url").exists() or waiting.poll() is not None, 60)
        assert waiting.poll() is None
        url = (tmp_path / "callback-url").read_text()
        run_id = urllib.parse.urlsplit(url).path.split("/")[2].rsplit(":", 1)[0]
        engine = Engine(FileStorage(state))
        wait_until(lambda: any(s.label == "hand_out" and s.status == "ok"
                               for s in asyncio.run(engine.inspect(run_id)).steps), 30)
    finally:
        waiting.kill()  # SIGKILL while it waits on the awakeable
        waiting.wait(timeout=30)
    awakeable = urllib.parse.urlsplit(url).path.split("/")[2]
    assert [a["id"] for a in asyncio.run(engine.inspect(run_id)).awakeables] == [awakeable]
    assert durably("resolve-awakeable", awakeable, '"paid"', "--dir", str(state)).returncode == 0
    (tmp_path / "callback-url").unlink()
    done = subprocess.run([sys.executable, "-m", "durably_py.cli", "retry", run_id, "--dir", str(state)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert asyncio.run(engine.inspect(run_id)).result == {"n": 9, "paid": "paid"}
    assert not (tmp_path / "callback-url").exists()  # the step that handed the URL out did not run again
    kinds = [r["t"] for r in asyncio.run(engine.records(run_id))]
    assert kinds.count("awk") == 1 and kinds.count("claim") == 2


def test_resolutions_sent_at_the_same_moment_leave_exactly_one_standing(tmp_path: Path) -> None:
    engine = create_engine(storage_url(tmp_path))
    run_id = parked(engine, plain, None)
    barrier = threading.Barrier(8)
    outcomes: dict[int, str] = {}

    def resolve(n: int) -> None:
        other = create_engine(storage_url(tmp_path))  # each its own engine, as separate processes would be
        barrier.wait()
        try:
            asyncio.run(other.resolve_awakeable(f"{run_id}:0", n))
            outcomes[n] = "won"
        except AwakeableResolvedError:
            outcomes[n] = "refused"

    threads = [threading.Thread(target=resolve, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [n for n, how in outcomes.items() if how == "won"]
    print(f"8 simultaneous resolutions: {len(winners)} accepted, {list(outcomes.values()).count('refused')} refused")
    assert len(outcomes) == 8 and len(winners) == 1, outcomes
    assert len(engine.storage.inbox(run_id)) == 1
    assert asyncio.run(engine.retry(run_id)) == {"value": winners[0], "again": winners[0]}
