"""The console's JSON API (Starlette's test client) over real runs in real storage."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import warnings
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from helpers import durably as run_cli

from durably_py import Engine, FileStorage, SqliteStorage, ValidationError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
pytest.importorskip("starlette")
pytest.importorskip("httpx")

with warnings.catch_warnings():  # Starlette >= 1.10 suggests httpx2 for its test client; httpx still works
    warnings.simplefilter("ignore", DeprecationWarning)
    from starlette.testclient import TestClient  # noqa: E402

from durably_py.ui import create_app  # noqa: E402

FLOWS = Path(__file__).parent / "ui_flows.py"


durably = partial(run_cli, check=True, pythonpath=False)


def run_flow(state: Path, workflow: str, input: Any, *extra: str, check: bool = True) -> None:
    durably("run", str(FLOWS), "--workflow", workflow, "--input", json.dumps(input), "--dir", str(state), *extra,
            check=check)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state dir with real runs: a parallel run with retries, a graph, a run parked on a signal, a key."""
    state = tmp_path_factory.mktemp("ui") / ".durably"
    run_flow(state, "fanout", 5)
    run_flow(state, "pipeline", None)
    run_flow(state, "approval", 42, "--key", "exp-1", "--no-wait", check=False)
    run_flow(state, "slow", {"n": 2, "delay": 0}, "--key", "tiny")
    return state


@pytest.fixture
def client(store: Path) -> TestClient:
    return TestClient(create_app(Engine(FileStorage(store))))


def one(client: TestClient, **query: Any) -> dict[str, Any]:
    runs = client.get("/api/runs", params=query).json()
    assert len(runs) == 1, runs
    return runs[0]


def test_runs_list_has_the_cli_json_shape_and_filters(client: TestClient, store: Path) -> None:
    runs = client.get("/api/runs").json()
    cli = json.loads(durably("list", "--json", "--dir", str(store)).stdout)
    assert [r["run_id"] for r in runs] == [r["run_id"] for r in cli]
    for mine, theirs in zip(runs, cli, strict=True):
        assert {k: v for k, v in mine.items() if k != "steps_done"} == theirs
    fanout = one(client, workflow="fanout")
    assert fanout["status"] == "completed" and fanout["steps_done"] == 6  # 5 fetches and the total (the sleep is a ctx call)
    assert one(client, status="waiting")["key"] == "exp-1"
    assert one(client, key="tiny")["workflow"] == "slow"
    assert one(client, q="PIPE")["workflow"] == "pipeline"
    assert len(client.get("/api/runs", params={"workflow": "stage"}).json()) == 5
    later = (datetime.now(UTC) + timedelta(minutes=5)).isoformat()
    assert client.get("/api/runs", params={"since": later}).json() == []
    assert len(client.get("/api/runs", params={"until": later}).json()) == len(runs)


def test_runs_list_pages_through_every_run_once(client: TestClient) -> None:
    every = [r["run_id"] for r in client.get("/api/runs").json()]
    pages = [client.get("/api/runs", params={"limit": 3, "offset": o}).json() for o in range(0, len(every) + 3, 3)]
    assert [r["run_id"] for page in pages for r in page] == every
    assert pages[-1] == []


def test_count_matches_the_listing_for_every_filter(client: TestClient) -> None:
    later = (datetime.now(UTC) + timedelta(minutes=5)).isoformat()
    for query in ({}, {"workflow": "stage"}, {"status": "waiting"}, {"key": "tiny"}, {"q": "PIPE"},
                  {"since": later}, {"until": later}, {"workflow": "stage", "status": "completed", "q": "stage"}):
        listed = client.get("/api/runs", params={**query, "limit": 1000}).json()
        assert client.get("/api/count", params=query).json() == {"count": len(listed)}, query
    assert client.get("/api/count", params={"workflow": "stage"}).json()["count"] == 5
    answer = client.get("/api/count", params={"status": "done"})
    assert answer.status_code == 400 and answer.json()["hint"]


@pytest.mark.parametrize("query", [{"status": "done"}, {"limit": 0}, {"limit": 5000}, {"offset": -1},
                                   {"limit": "many"}, {"since": "yesterday"}])
def test_bad_list_queries_answer_400_with_a_hint(client: TestClient, query: dict[str, Any]) -> None:
    answer = client.get("/api/runs", params=query)
    assert answer.status_code == 400
    assert answer.json()["error"] == "ValidationError" and answer.json()["hint"]


def test_engine_list_filters_and_pages(store: Path) -> None:
    engine = Engine(FileStorage(store))
    stages = asyncio.run(engine.list(workflow="stage"))
    assert [s.run_id for s in asyncio.run(engine.list(workflow="stage", limit=2, offset=1))] == \
        [s.run_id for s in stages[1:3]]
    assert asyncio.run(engine.list(search="exp-")) [0].key == "exp-1"
    with pytest.raises(ValidationError, match="timezone-aware"):
        asyncio.run(engine.list(since=datetime.now()))
    with pytest.raises(ValidationError, match="offset"):
        asyncio.run(engine.list(offset=-2))


def test_run_timeline_and_graph_match_the_cli(client: TestClient, store: Path) -> None:
    run_id = one(client, workflow="fanout")["run_id"]
    state = client.get(f"/api/runs/{run_id}").json()
    assert state == json.loads(durably("inspect", run_id, "--json", "--dir", str(store)).stdout)
    spans = client.get(f"/api/runs/{run_id}/timeline").json()
    failed = [s for s in spans if s["path"] == [1] and s["kind"] == "attempt"]
    assert [s["status"] for s in failed] == ["failed", "failed", "ok"]  # fetch 1 failed twice, then succeeded
    backoffs = [s for s in spans if s["path"] == [1] and s["kind"] == "backoff"]
    assert len(backoffs) == 2 and all(b["end"] > b["start"] for b in backoffs)
    assert failed[0]["detail"].startswith("ConnectionError")
    sleep = next(s for s in spans if s["kind"] == "sleep")
    assert sleep["end"] - sleep["start"] >= 0.25
    starts = sorted(s["start"] for s in spans if s["kind"] == "attempt" and s["path"][0] < 4)
    assert starts[3] - starts[0] < 0.1  # four fetches began together (concurrency=4)

    pipeline = one(client, workflow="pipeline")["run_id"]
    graphs = client.get(f"/api/runs/{pipeline}/graph").json()
    assert graphs == json.loads(durably("graph", pipeline, "--json", "--dir", str(store)).stdout)
    assert {n["id"]: n["depends_on"] for n in graphs[0]["nodes"]}["train"] == ["clean", "features"]
    assert client.get("/api/runs/exp-1").json()["status"] == "waiting"  # a key works as well as an id


def test_unknown_run_is_404_with_hint(client: TestClient) -> None:
    for path in ("/api/runs/nope-20260101-00000000", "/api/runs/nope-20260101-00000000/timeline",
                 "/api/runs/nope-20260101-00000000/events"):
        answer = client.get(path)
        assert answer.status_code == 404
        assert answer.json()["error"] == "RunNotFoundError" and answer.json()["hint"]


def test_run_events_stream_sends_the_state_first(client: TestClient) -> None:
    with client.stream("GET", "/api/runs/tiny/events") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        lines = stream.iter_lines()
        assert next(lines) == "event: state"
        snap = json.loads(next(lines)[len("data: "):])
    assert snap["run"]["key"] == "tiny" and snap["run"]["status"] == "completed"
    assert [s["label"] for s in snap["timeline"]] == ["tick 0", "tick 1"]


def test_a_big_run_streams_its_first_steps_before_the_whole_run(client: TestClient,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from durably_py.ui import app

    monkeypatch.setattr(app, "FIRST_STEPS", 1)  # "tiny" has two steps: more than one is a big run here
    with client.stream("GET", "/api/runs/tiny/events") as stream:
        lines = stream.iter_lines()
        events = []
        for _ in range(2):
            assert next(lines) == "event: state"
            events.append(json.loads(next(lines)[len("data: "):]))
            assert next(lines) == ""
    first, whole = events
    assert first["partial"] == {"steps": 2, "done": 2}
    assert [s["label"] for s in first["run"]["steps"]] == ["tick 0"] and first["timeline"] == []
    assert "partial" not in whole
    assert [s["label"] for s in whole["run"]["steps"]] == ["tick 0", "tick 1"]
    assert [s["label"] for s in whole["timeline"]] == ["tick 0", "tick 1"]


def test_runs_events_stream_sends_the_page(client: TestClient) -> None:
    with client.stream("GET", "/api/events", params={"workflow": "slow"}) as stream:
        lines = stream.iter_lines()
        assert next(lines) == "event: runs"
        page = json.loads(next(lines)[len("data: "):])
    assert [r["key"] for r in page] == ["tiny"]


def post(client: TestClient, path: str, body: Any = None, **headers: str) -> Any:
    return client.post(path, content=json.dumps(body if body is not None else {}),
                       headers={"Content-Type": "application/json", **headers})


def test_signal_validates_and_delivers(tmp_path: Path) -> None:
    state = tmp_path / ".durably"
    run_flow(state, "approval", 10, "--key", "a1", "--no-wait", check=False)
    client = TestClient(create_app(Engine(FileStorage(state))))
    bad = post(client, "/api/runs/a1/signal", {"name": "$cancel"})
    assert bad.status_code == 400 and "hint" in bad.json()
    sent = post(client, "/api/runs/a1/signal", {"name": "approval", "payload": {"ok": True, "by": "ana"}})
    answer = sent.json()
    assert {k: answer.pop(k) for k in ("run_id", "status", "awaited", "held")} == {  # what remote clients get
        "run_id": client.get("/api/runs/a1").json()["run_id"], "status": "waiting", "awaited": ["approval"],
        "held": False}
    assert answer == {"run": "a1", "signal": "approval", "payload": {"ok": True, "by": "ana"}, "sent": True}
    durably("retry", "a1", "--dir", str(state))  # the run reads its inbox and completes
    assert client.get("/api/runs/a1").json()["result"] == "paid 10.00, approved by ana"
    late = post(client, "/api/runs/a1/signal", {"name": "approval", "payload": None})
    assert late.status_code == 400 and "has not ended" in late.json()["hint"]


def test_cancel_pause_resume_retry_restart(tmp_path: Path) -> None:
    state = tmp_path / ".durably"
    run_flow(state, "approval", 5, "--key", "b1", "--no-wait", check=False)
    client = TestClient(create_app(Engine(FileStorage(state))))
    assert post(client, "/api/runs/b1/pause").json() == {"run_id": client.get("/api/runs/b1").json()["run_id"],
                                                         "status": "paused", "paused": True}
    refused = post(client, "/api/runs/b1/retry")
    assert refused.status_code == 400 and "resume" in refused.json()["hint"].lower()
    assert post(client, "/api/runs/b1/resume").json()["resumed"] is True
    assert post(client, "/api/runs/b1/cancel").json()["cancelled"] is True
    again = post(client, "/api/runs/b1/cancel")
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
    assert post(client, "/api/runs/b1/retry").json()["hint"].startswith("Start it over")

    run_flow(state, "slow", {"n": 3, "delay": 0}, "--key", "c1")
    old = client.get("/api/runs/c1").json()["run_id"]
    retried = post(client, "/api/runs/c1/retry", {"from_step": "1"})
    assert retried.status_code == 200 and retried.json()["run_id"] == old
    wrong = post(client, "/api/runs/c1/retry", {"from_step": "no such step"})
    assert wrong.status_code in (400, 409) and "tick 0" in wrong.json()["message"]
    restarted = post(client, "/api/runs/c1/restart")
    assert restarted.status_code == 200 and restarted.json()["run_id"] != old


def test_mutations_refuse_cross_site_requests(client: TestClient) -> None:
    for headers in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
        answer = post(client, "/api/runs/tiny/pause", **headers)
        assert answer.status_code == 403 and answer.json()["hint"]
    form = client.post("/api/runs/tiny/cancel", data={"x": "1"})  # what a plain cross-site form could send
    assert form.status_code == 403
    same = post(client, "/api/runs/tiny/signal", {"name": "go"}, Origin="http://testserver",
                **{"Sec-Fetch-Site": "same-origin"})
    assert same.status_code == 400 and "completed" in same.json()["message"]  # passed the guard, then validated
    assert client.get("/", headers={"Host": "attacker.example"}).status_code == 403


def test_token_guards_pages_api_and_operations(store: Path) -> None:
    client = TestClient(create_app(Engine(FileStorage(store)), token="s3cret", loopback=False))
    assert client.get("/api/runs").status_code == 401
    assert client.get("/").status_code == 401
    assert client.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    opened = client.get("/?token=s3cret", follow_redirects=False)
    assert opened.status_code == 303 and "durably_ui_token" in opened.headers["set-cookie"]
    assert client.get("/api/runs").status_code == 200  # the cookie now carries the token
    assert 'content="s3cret"' in client.get("/").text
    assert post(client, "/api/runs/tiny/pause").status_code == 401  # a cookie alone does not operate
    answer = post(client, "/api/runs/tiny/signal", {"name": "go"}, Authorization="Bearer s3cret")
    assert answer.status_code == 400  # authorized; refused only because the run completed


def test_pages_and_assets_are_served_from_the_package(client: TestClient) -> None:
    page = client.get("/runs/tiny")
    assert page.status_code == 200 and "/static/app.js" in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for asset in ("app.js", "app.css", "icon.svg"):
        assert client.get(f"/static/{asset}").status_code == 200
    assert "http" not in client.get("/static/app.css").text.replace("http://www.w3.org", "")


def test_sqlite_storage_is_served_too(tmp_path: Path) -> None:
    from tests.ui_flows import slow

    engine = Engine(SqliteStorage(tmp_path / "runs.db"))
    asyncio.run(engine.run(slow, {"n": 2, "delay": 0}, key="sq"))
    client = TestClient(create_app(engine))
    assert client.get("/api/runs").json()[0]["key"] == "sq"
    assert client.get("/api/runs/sq").json()["status"] == "completed"


def test_cli_serves_a_storage_url(tmp_path: Path) -> None:
    """`durably ui --storage sqlite:PATH` in a real process: the printed URL answers with that store's runs."""
    import re

    import httpx

    from tests.ui_flows import slow

    db = tmp_path / "runs.db"
    asyncio.run(Engine(SqliteStorage(db)).run(slow, {"n": 1, "delay": 0}, key="via-url"))
    server = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "ui", "--storage", f"sqlite:{db}", "--port", "0"],
                              stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        url = re.search(r"http://\S+", server.stderr.readline())
        assert url is not None
        assert [r["key"] for r in httpx.get(url.group(0) + "api/runs", timeout=10).json()] == ["via-url"]
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_cli_off_loopback_makes_and_prints_a_token_unless_one_is_set(tmp_path: Path) -> None:
    import re

    import httpx

    def start(env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
        proc = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "ui", "--dir", str(tmp_path), "--host",
                                 "0.0.0.0", "--port", "0"], stderr=subprocess.PIPE, text=True, env={**{k: v for k, v in os.environ.items() if k != "DURABLY_UI_TOKEN"}, **env})
        assert proc.stderr is not None
        found = re.search(r"http://\S+", proc.stderr.readline())
        assert found is not None
        return proc, found.group(0)

    proc, url = start({})
    try:
        made = re.search(r"\?token=([\w-]{20,})$", url)
        assert made is not None, url
        port = url.split(":")[2].split("/")[0]
        assert httpx.get(f"http://127.0.0.1:{port}/api/runs", timeout=10).status_code == 401
        assert httpx.get(f"http://127.0.0.1:{port}/api/runs", timeout=10,
                         headers={"Authorization": f"Bearer {made.group(1)}"}).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    proc, url = start({"DURABLY_UI_TOKEN": "mine-0123456789abcdefghij"})
    try:
        assert url.endswith("?token=mine-0123456789abcdefghij")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_cli_port_in_use_is_an_error_with_a_hint(tmp_path: Path) -> None:
    import re

    first = subprocess.Popen([sys.executable, "-m", "durably_py.cli", "ui", "--dir", str(tmp_path), "--port", "0"],
                             stderr=subprocess.PIPE, text=True)
    try:
        assert first.stderr is not None
        found = re.search(r":(\d+)/", first.stderr.readline())
        assert found is not None
        second = durably("ui", "--dir", str(tmp_path), "--port", found.group(1), check=False)
        assert second.returncode != 0
        assert "cannot listen on 127.0.0.1" in second.stderr and "hint: " in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.terminate()
        first.wait(timeout=10)


def test_cli_says_what_to_install_without_the_extra(tmp_path: Path) -> None:
    code = (f"import sys; sys.modules['starlette'] = None; sys.argv = ['durably', 'ui', '--dir', {str(tmp_path)!r}]; "
            "from durably_py.cli import main; main()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    assert "pip install 'durably-py[ui]'" in done.stderr


def test_queues_has_the_cli_json_shape(tmp_path: Path) -> None:
    from durably_py import create_engine, queue, workflow

    queue("ui-mail", concurrency=4, partition_concurrency=1)

    @workflow(queue="ui-mail")
    async def ui_mail(ctx: Any, to: str) -> str:
        return to

    engine = create_engine(tmp_path / ".durably")
    import asyncio

    asyncio.run(engine.enqueue(ui_mail, "a@x", partition="acme"))
    asyncio.run(engine.enqueue(ui_mail, "b@x", partition="globex", delay=3600))
    shown = TestClient(create_app(Engine(FileStorage(tmp_path / ".durably")))).get("/api/queues").json()
    mail = next(q for q in shown if q["name"] == "ui-mail")
    assert (mail["due"], mail["later"], mail["running"], mail["parked"]) == (1, 1, 0, 0)
    assert set(mail["partitions"]) == {"acme", "globex"}
    assert mail["limits"] == {"concurrency": 4, "partition_concurrency": 1}
    assert set(mail) == set(asyncio.run(engine.queues())[0].to_dict())  # the same fields as `durably queues --json`
