"""Remote controls: a real `durably ui` server (a free port, a token) over a store with runs in every state an
operator meets; `durably_py.client.Client` and the CLI with `--remote URL` read and operate them, and each CLI
command prints the same output with the same exit code as the same command run locally. Operations that
change a run act on twin runs (one run locally, its twin remotely) and compare with the twin's id and key
read as the other's. A wrong token, an unreachable console, an unknown run and the commands that need the
store itself are clear errors."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import durably, wait_until

from durably_py import (
    RunNotFoundError,
    RunState,
    SignalSent,
    StepState,
    ValidationError,
    create_engine,
)
from durably_py._state.timeline import Span
from durably_py.client import Client, rebuild_error
from durably_py.errors import DurablyError, RemoteAuthError, RemoteError, WorkflowFailedError

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

TOKEN = "s3cret-remote-token"
TWINS = ("local", "remote", "client")  # each twin's runs: one for the local CLI, the remote CLI, the client

FLOWS = textwrap.dedent('''
    """Workflows in every state an operator meets: `python flows.py` records them, and is killed inside the
    unsafe step of its `pays` runs, which are left needing attention."""
    import asyncio
    import pathlib
    import time

    from durably_py import RunParkedError, create_engine, workflow

    HERE = pathlib.Path(__file__).resolve().parent
    TWINS = ("local", "remote", "client")


    def add(a, b):
        return a + b


    def flaky(x):
        if not (HERE / "fixed").exists():
            raise ValueError(f"not yet: {x}")
        return x * 2


    def charge(order):
        with open(HERE / "charging", "a") as out:
            out.write(order + "\\n")
        if (HERE / "hang").exists():
            time.sleep(600)
        return {"charged": order}


    @workflow
    async def ok(ctx, n):
        return await ctx.step(add, n, 1)


    @workflow
    async def fails(ctx, n):
        a = await ctx.step(add, n, 1)
        return await ctx.step(flaky, a)


    @workflow
    async def waits(ctx, n):
        got = await ctx.wait_for("go", timeout=3600)
        return {"n": n, "got": got}


    @workflow
    async def pays(ctx, order):
        return await ctx.step(charge, order, replay="unsafe")


    async def setup():
        engine = create_engine(str(HERE / ".durably"))
        await engine.run(ok, 1, key="ok")
        for twin in TWINS:
            try:
                await engine.run(fails, 1, key=f"fails-{twin}")
            except ValueError:
                pass
            for kind in ("signal", "cancel", "paused"):
                try:
                    await engine.run(waits, 1, key=f"{kind}-{twin}", wait=False)
                except RunParkedError:
                    pass
            await engine.pause(f"paused-{twin}")
        (HERE / "hang").write_text("")
        await asyncio.gather(*(engine.run(pays, "A1", key=f"pays-{twin}") for twin in TWINS))


    if __name__ == "__main__":
        asyncio.run(setup())
''')


@dataclass
class Project:
    """The store's folder, its console's URL and a map from each run's id and key to its local twin's."""

    dir: Path
    url: str
    ids: dict[str, str]
    twin: dict[str, str]  # remote (and client) run id or key -> the local twin's


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Project]:
    folder = tmp_path_factory.mktemp("remote")
    (folder / "flows.py").write_text(FLOWS)
    setup = subprocess.Popen([sys.executable, "flows.py"], cwd=folder, env=env(), stderr=subprocess.PIPE, text=True)
    charging = folder / "charging"
    try:
        wait_until(lambda: (charging.exists() and len(charging.read_text().split()) == len(TWINS))
                   or setup.poll() is not None, 60)
        assert setup.poll() is None, setup.communicate()[1]
    finally:
        setup.send_signal(signal.SIGKILL)
        setup.communicate(timeout=30)
    (folder / "hang").unlink()
    states = asyncio.run(create_engine(str(folder / ".durably")).list())
    ids = {s.key: s.run_id for s in states if s.key}
    twin: dict[str, str] = {}
    for key, run_id in ids.items():
        if key.endswith(("-remote", "-client")):
            local = key.rsplit("-", 1)[0] + "-local"
            twin[run_id], twin[key] = ids[local], local

    server = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "ui", "--port", "0"], cwd=folder,
                              env={**env(), "DURABLY_UI_TOKEN": TOKEN, "PYTHONPATH": os.pathsep.join(sys.path)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(server.stderr or []), daemon=True).start()
    try:
        wait_until(lambda: any("http://" in line for line in err) or server.poll() is not None, 30)
        found = re.search(r"(http://[^/\s]+)/", "".join(err))
        assert found is not None, "".join(err)
        yield Project(folder, found.group(1), ids, twin)
    finally:
        server.terminate()
        server.wait(timeout=30)


def cli(project: Project, *args: str, remote: bool = False, token: str = TOKEN) -> subprocess.CompletedProcess[str]:
    """`durably ARGS` in the project (its store found as `.durably` there), or against its console."""
    where = ["--remote", project.url, "--token", token] if remote else []
    return durably(*args, *where, cwd=project.dir, columns=200, unset=("DURABLY_*",))


def twin_args(project: Project, args: tuple[str, ...], twin: str) -> tuple[str, ...]:
    """The same command for the twin run: `X-local` read as `X-remote`."""
    return tuple(arg.replace("-local", f"-{twin}") if re.fullmatch(r"[a-z]+-local", arg) else arg for arg in args)


def as_local(project: Project, text: str) -> str:
    """Output about a twin run, with its id and key read as its local twin's."""
    for theirs, ours in sorted(project.twin.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(theirs, ours)
    return text


def both(project: Project, *args: str, twins: bool = False) -> tuple[subprocess.CompletedProcess[str],
                                                                        subprocess.CompletedProcess[str]]:
    """The command run locally and (on the twin run when `twins`) remotely, side by side."""
    remote_args = twin_args(project, args, "remote") if twins else args
    with ThreadPoolExecutor(2) as pool:
        local = pool.submit(cli, project, *args)
        remote = pool.submit(cli, project, *remote_args, remote=True)
        return local.result(), remote.result()


def same(project: Project, local: subprocess.CompletedProcess[str], remote: subprocess.CompletedProcess[str], *,
         stderr: bool = False, drop: tuple[str, ...] = (), twins: bool = False) -> None:
    """Same exit code and stdout (and stderr); `drop` names JSON fields left out (a duration); `twins`: the
    remote command acted on the twin run, so its id and key read as the local twin's."""
    assert local.returncode == remote.returncode, (local.returncode, remote.returncode, local.stderr, remote.stderr)
    mapped = (lambda text: as_local(project, text)) if twins else (lambda text: text)
    ours, theirs = local.stdout, mapped(remote.stdout)
    if drop:
        ours, theirs = (json.dumps({k: v for k, v in json.loads(text).items() if k not in drop}) for text in
                        (ours, theirs))
    assert ours == theirs, (local.stdout, remote.stdout, remote.stderr)
    if stderr:
        assert local.stderr == mapped(remote.stderr), (local.stderr, remote.stderr)


# ---- the CLI: the same output and exit codes, locally and with --remote -----------------------------------


READS = [("list",), ("list", "--json"), ("inspect", "pays-local"), ("inspect", "fails-local", "--json")]
MORE_READS = [("list", "-q", "-s", "waiting", "-s", "paused"), ("list", "-n", "3"), ("list", "--key", "fails", "-o", "jsonl"),
              ("list", "-w", "nothing"), ("inspect", "fails-local"), ("inspect", "paused-local", "--json"),
              ("inspect", "ok", "--json")]


def compare_reads(project: Project, commands: list[tuple[str, ...]]) -> dict[tuple[str, ...], str]:
    """Each read locally and remotely: the same stdout, exit code 0; the remote stdouts."""
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda args: (args, both(project, *args)), commands))
    for args, (local, remote) in done:
        assert local.returncode == 0, (args, local.stderr)
        same(project, local, remote)
    return {args: remote.stdout for args, (_, remote) in done}


def test_reads_print_the_same_remotely(project: Project) -> None:
    shown = compare_reads(project, READS)
    listed = json.loads(shown[("list", "--json")])
    assert {row["status"] for row in listed} == {"completed", "failed", "waiting", "paused", "needs_attention"}
    assert "needs_attention" in shown[("inspect", "pays-local")] and "operation id" in shown[("inspect", "pays-local")]

    local, remote = both(project, "inspect", "no-such-run")
    assert local.returncode == 2 and "RunNotFoundError" in remote.stderr and "hint:" in remote.stderr
    same(project, local, remote, stderr=True)


@pytest.mark.slow
def test_more_reads_print_the_same_remotely(project: Project) -> None:
    shown = compare_reads(project, MORE_READS)
    assert "more (--offset 3" in shown[("list", "-n", "3")]
    assert "no runs match --workflow nothing in " in shown[("list", "-w", "nothing")]


OPERATIONS: list[tuple[tuple[str, ...], int, tuple[str, ...]]] = [  # command, exit code, JSON fields to drop
    (("signal", "signal-local", "go", '"yes"', "--json"), 0, ()),
    (("retry", "signal-local"), 0, ()),  # continues it (remotely: in the console's process)
    (("cancel", "cancel-local", "--json"), 0, ()),
    (("resume", "paused-local", "--json"), 0, ()),
    (("retry", "fails-local", "--json"), 1, ("elapsed",)),  # fails again
    (("resolve", "pays-local", "--path", "0", "--value", '{"charged": "by hand"}', "--yes", "--json"), 0,
     ("elapsed",)),
]
MORE_OPERATIONS: list[tuple[tuple[str, ...], int, tuple[str, ...]]] = [  # mostly refused, nothing changed
    (("retry", "fails-local", "--from-step", "add#1", "--json"), 0, ("elapsed",)),  # runs `add` again
    (("signal", "ok", "go"), 2, ()),  # an ended run
    (("cancel", "cancel-local"), 0, ()),  # already cancelled
    (("resume", "paused-local"), 2, ()),  # not paused any more
    (("resolve", "pays-local", "--path", "0", "--value", "1", "--json"), 2, ()),  # not needing attention now
    (("resolve", "fails-local", "--path", "1", "--rerun", "--yes"), 2, ()),
    (("signal", "nope", "go", "--json"), 2, ()),
]


def compare_operations(project: Project, steps: list[tuple[tuple[str, ...], int, tuple[str, ...]]]) -> None:
    for args, code, drop in steps:
        local, remote = both(project, *args, twins=True)
        assert local.returncode == code, (args, local.stdout, local.stderr)
        same(project, local, remote, drop=drop, stderr=not drop and args[0] != "retry", twins=True)


def operate(project: Project) -> None:
    """Each operation locally and on the twin remotely, then the failing run fixed and retried both ways."""
    compare_operations(project, OPERATIONS)
    (project.dir / "fixed").write_text("")
    local, remote = both(project, "retry", "fails-local", twins=True)
    assert local.returncode == 0 and local.stdout.strip() == "4"
    same(project, local, remote, twins=True)

    # every twin ended where its local twin did
    engine = create_engine(str(project.dir / ".durably"))
    for kind in ("signal", "cancel", "paused", "fails", "pays"):
        ours, theirs = (asyncio.run(engine.inspect(f"{kind}-{twin}")) for twin in ("local", "remote"))
        assert (ours.status, ours.result) == (theirs.status, theirs.result), kind
    assert [s.status for s in asyncio.run(engine.inspect("pays-remote")).steps] == ["ok"]


def test_operations_print_the_same_remotely(project: Project) -> None:
    operate(project)


@pytest.mark.slow
def test_more_operations_print_the_same_remotely(project: Project) -> None:
    if not (project.dir / "fixed").exists():  # run alone (pytest -m slow): operate first
        operate(project)
    compare_operations(project, MORE_OPERATIONS)


def closed_port() -> str:
    """The URL of a port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def call_all(calls: dict[str, Any]) -> dict[str, subprocess.CompletedProcess[str]]:
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(calls, pool.map(lambda call: call(), calls.values()), strict=True))


def test_remote_refusals_are_clear_errors(project: Project) -> None:
    closed = closed_port()
    done = call_all({
        "wrong token": (lambda: cli(project, "list", remote=True, token="wrong")),
        "unreachable": (lambda: durably("list", "--remote", closed, cwd=project.dir, unset=("DURABLY_*",))),
        "pause": (lambda: cli(project, "pause", "ok", remote=True)),
        "token from the environment": (lambda: durably("inspect", "ok", "--json", cwd=project.dir, unset=(
            "DURABLY_*",), DURABLY_REMOTE=project.url, DURABLY_UI_TOKEN=TOKEN)),
    })
    assert done["wrong token"].returncode == 2, done["wrong token"].stderr
    assert "RemoteAuthError" in done["wrong token"].stderr and "refused the request (401)" in done["wrong token"].stderr
    assert "hint: Pass the console's token with --token" in done["wrong token"].stderr
    assert done["unreachable"].returncode == 1 and "RemoteError: cannot reach the console" in done["unreachable"].stderr
    assert "hint:" in done["unreachable"].stderr
    assert done["pause"].returncode == 2, done["pause"].stderr
    assert "NotSupportedError" in done["pause"].stderr and "durably pause does not work with --remote" in \
        done["pause"].stderr
    assert json.loads(done["token from the environment"].stdout)["run_id"] == project.ids["ok"]


@pytest.mark.slow
def test_more_remote_refusals_are_clear_errors(project: Project) -> None:
    done = call_all({
        "no token": (lambda: durably("inspect", "ok", "--remote", project.url, cwd=project.dir, unset=("DURABLY_*",))),
        "not a URL": (lambda: durably("list", "--remote", "ftp:nowhere", cwd=project.dir, unset=("DURABLY_*",))),
        "two places": (lambda: cli(project, "list", "--dir", ".durably", remote=True)),
        "by filter": (lambda: cli(project, "cancel", "--status", "waiting", "--yes", remote=True)),
        "fork": (lambda: cli(project, "fork", "ok", "--from-step", "0", remote=True)),
    })
    assert done["no token"].returncode == 2 and "RemoteAuthError" in done["no token"].stderr
    assert done["not a URL"].returncode == 2 and "is not a console URL" in done["not a URL"].stderr
    assert done["two places"].returncode == 2 and "--remote and --dir/--storage" in done["two places"].stderr
    for what in ("by filter", "fork"):
        assert done[what].returncode == 2, done[what].stderr
        assert "NotSupportedError" in done[what].stderr and "does not work with --remote" in done[what].stderr


# ---- the Python client ----------------------------------------------------------------------------------


def test_the_client_returns_the_engines_types_and_raises_its_errors(project: Project) -> None:
    engine = create_engine(str(project.dir / ".durably"))
    client = Client(f"{project.url}/?token={TOKEN}")  # the URL as `durably ui` prints it carries the token
    assert client.token == TOKEN and client.url == project.url

    state = client.inspect("fails-client")
    assert isinstance(state, RunState) and all(isinstance(s, StepState) for s in state.steps)
    assert state.to_dict() == asyncio.run(engine.inspect("fails-client")).to_dict()
    spans = client.timeline(state.run_id)
    assert spans and all(isinstance(s, Span) for s in spans)
    assert [s.to_dict() for s in spans] == [s.to_dict() for s in asyncio.run(engine.timeline(state.run_id))]
    listed = client.list(status=["waiting", "paused"], key_prefix="signal")
    assert [s.run_id for s in listed] == [s.run_id for s in asyncio.run(engine.list(
        status=["waiting", "paused"], key_prefix="signal"))] and listed
    assert client.count(status="needs_attention") == asyncio.run(engine.count(status="needs_attention"))
    assert client.log("ok")["records"] == len(asyncio.run(engine.records("ok")))

    with pytest.raises(RunNotFoundError) as missing:
        client.inspect("no-such-run")
    assert missing.value.hint and missing.value.docs and "no-such-run" in missing.value.message
    with pytest.raises(ValidationError) as ended:
        client.signal("ok", "go")
    assert "is completed" in ended.value.message and ended.value.hint
    with pytest.raises(RemoteAuthError):
        Client(project.url, token="wrong").inspect("ok")

    sent = client.signal("signal-client", "go", "hi")
    assert isinstance(sent, SignalSent) and sent.status == "waiting" and sent.awaited == ["go"]
    assert client.retry("signal-client") == {"n": 1, "got": "hi"}
    assert client.cancel("cancel-client").status == "cancelled"
    assert client.resume("paused-client").status == "waiting"
    (project.dir / "fixed").unlink(missing_ok=True)
    with pytest.raises(WorkflowFailedError) as failed:
        client.retry("fails-client")
    assert failed.value.message == "ValueError: not yet: 2" and failed.value.hint
    (project.dir / "fixed").write_text("")
    assert client.retry("fails-client") == 4
    assert client.resolve_effect("pays-client", (0,), value={"charged": "checked"}) == {"charged": "checked"}
    assert asyncio.run(engine.inspect("pays-client")).status == "completed"

    async def concurrently() -> list[RunState]:
        return list(await asyncio.gather(client.ainspect("ok"), client.ainspect("pays-client")))
    assert [s.status for s in asyncio.run(concurrently())] == ["completed", "completed"]


def test_error_answers_become_the_engines_errors() -> None:
    """An error answer names its type: the client raises that class (with the answer's message, hint and docs);
    what no engine raised (a route the console lacks, a crash) is a `RemoteError`."""
    def rebuilt(status: int, body: Any) -> DurablyError:
        return rebuild_error(status, body, "http://console")

    found = rebuilt(404, {"error": "RunNotFoundError", "message": "no run 'x'", "hint": "h", "docs": "docs/x.md"})
    assert type(found) is RunNotFoundError and (found.message, found.hint, found.docs) == ("no run 'x'", "h",
                                                                                          "docs/x.md")
    assert type(rebuilt(400, {"error": "BodyTooLarge", "message": "m", "hint": "h", "docs": "d"})) is ValidationError
    assert type(rebuilt(409, {"error": "MyOwnError", "message": "m", "hint": "h", "docs": "d"})) is DurablyError
    assert type(rebuilt(401, {"error": "Unauthorized", "message": "m", "hint": "h", "docs": "d"})) is RemoteAuthError
    for status, body in ((404, {"error": "NotFound", "message": "no operation 'x'", "hint": None, "docs": None}),
                         (500, {"error": "TypeError", "message": "boom"}), (404, None), (502, "<html>")):
        error = rebuilt(status, body)
        assert type(error) is RemoteError and f"HTTP {status}" in error.message and error.hint, (status, body)


def test_an_unreachable_console_is_a_remote_error() -> None:
    url = closed_port()
    with pytest.raises(RemoteError) as exc:
        Client(url, timeout=5).list()
    assert "cannot reach the console" in exc.value.message and exc.value.hint
    with pytest.raises(ValidationError):
        Client("not a url")
