"""Approval forms: a `ctx.wait_for(name, schema=...)` records its JSON Schema, and the console's
`POST /api/runs/{run}/submit` checks a submitted value against it before it sends the signal (Starlette's test
client over real runs: `run(wait=False)` in file storage, `TestEngine`, a `durably worker` process).
The same forms in Chromium are in test_ui_browser.py."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal, TypedDict

import msgspec
import pytest
from helpers import check_error, wait_until

from durably_py import Engine, FileStorage, RunParkedError, create_engine, records, workflow
from durably_py._authoring.jsonschema import check
from durably_py._authoring.schema import compile_schema
from durably_py.testing import TestEngine

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
pytest.importorskip("starlette")
pytest.importorskip("httpx")

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from starlette.testclient import TestClient  # noqa: E402

from durably_py.ui import create_app  # noqa: E402


class Level(enum.Enum):
    LOW = "low"
    HIGH = "high"


class Expense(msgspec.Struct, forbid_unknown_fields=True):
    amount: Annotated[int, msgspec.Meta(ge=1, le=10_000)]
    reason: str
    urgent: bool = False
    level: Level = Level.LOW
    note: str | None = None


@workflow
async def expense(ctx: Any, who: str) -> str:
    got = await ctx.wait_for("expense", Expense, timeout=3600)
    return f"{who}: {got.amount} for {got.reason} ({got.level.value}, urgent={got.urgent})"


@workflow
async def yes_or_no(ctx: Any, _: Any = None) -> str:
    return "approved" if await ctx.wait_for("approve", bool, timeout=3600) else "denied"


def parked(engine: Engine, wf: Any, input: Any = None) -> str:
    """Start `wf` with `run(wait=False)` until it parks on its wait; its run id."""
    started: list[str] = []
    with pytest.raises(RunParkedError):
        asyncio.run(engine.run(wf, input, wait=False, on_run=started.append))
    return started[0]


def client_of(engine: Engine) -> TestClient:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return TestClient(create_app(engine))


def unchanged(engine: Engine, run_id: str) -> tuple[Any, ...]:
    """What a refused submit must leave as it was: the log and the run's inbox."""
    return tuple(asyncio.run(engine.records(run_id))), tuple(engine.storage.inbox(run_id))


# ---- the recorded JSON Schema -----------------------------------------------------------------------------


@dataclasses.dataclass
class Trip:
    city: str
    nights: int = 1


class Vote(TypedDict):
    choice: Literal["a", "b"]


def test_each_kind_of_spec_gives_its_json_schema() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Model(pydantic.BaseModel):
        seats: int = pydantic.Field(ge=1)

    schemas = {spec: compile_schema(spec, "schema").json_schema() for spec in  # type: ignore[union-attr]
               (Expense, Trip, Vote, Model, bool, Literal["yes", "no"], int | None)}
    expense_schema = schemas[Expense]
    assert expense_schema["$defs"]["Expense"]["required"] == ["amount", "reason"]
    assert schemas[Trip]["$defs"]["Trip"]["properties"]["nights"] == {"type": "integer", "default": 1}
    assert schemas[Vote]["$defs"]["Vote"]["properties"]["choice"] == {"enum": ["a", "b"]}
    assert schemas[Model]["properties"]["seats"]["minimum"] == 1
    assert schemas[bool] == {"type": "boolean"} and schemas[Literal["yes", "no"]] == {"enum": ["no", "yes"]}
    assert compile_schema(lambda v: v, "schema").json_schema() is None  # type: ignore[union-attr]
    huge = Literal.__getitem__(tuple(f"choice-{i}" for i in range(8000)))  # over JSON_SCHEMA_MAX: no form
    assert compile_schema(huge, "schema").json_schema() is None  # type: ignore[union-attr]
    assert check(schemas[Model], {"seats": 0}).field == "seats"  # type: ignore[union-attr]
    assert check(schemas[Trip], {"city": "Oslo"}) is None


def test_the_wait_record_carries_the_schema_and_old_logs_read_without_it(tmp_path: Path) -> None:
    engine = create_engine(FileStorage(tmp_path / "state"))
    run_id = parked(engine, expense, "ana")
    wait = next(r for r in asyncio.run(engine.records(run_id)) if r["t"] == "wait")
    assert wait["schema"] == msgspec.json.schema(Expense)
    step = asyncio.run(engine.inspect(run_id)).steps[0]
    assert step.output["schema"] == wait["schema"] and step.output["signal"] == "expense"
    old = records.load_one({"t": "wait", "p": "0", "name": "go", "deadline": None, "ts": 1.0})
    assert isinstance(old, records.Wait) and old.schema is msgspec.UNSET
    assert b"schema" not in records.encode(records.Wait(path="0", name="go"))  # absent, never null


@pytest.mark.parametrize(("value", "path", "words"), [
    ({"amount": 5, "reason": "taxi"}, None, None),
    ({"amount": 5.0, "reason": "taxi", "note": None, "level": "high"}, None, None),
    ({"amount": 0, "reason": "taxi"}, "$.amount", "expected a number >= 1, got 0"),
    ({"reason": "taxi"}, "$.amount", "a required field is missing"),
    ({"amount": "5", "reason": "taxi"}, "$.amount", 'expected an integer, got a string "5"'),
    ({"amount": True, "reason": "taxi"}, "$.amount", "expected an integer, got a boolean true"),
    ({"amount": 5, "reason": "taxi", "level": "mid"}, "$.level", 'expected one of "high", "low"; got "mid"'),
    ({"amount": 5, "reason": "taxi", "note": 3}, "$.note", "expected a string or null; got 3"),
    ({"amount": 5, "reason": "taxi", "tip": 1}, "$.tip", "an unknown field"),
    ([5, "taxi"], "$", "expected an object, got a list"),
])
def test_values_are_checked_against_the_json_schema(value: Any, path: str | None, words: str | None) -> None:
    problem = check(msgspec.json.schema(Expense), value)
    if words is None:
        assert problem is None
        msgspec.convert(value, Expense, strict=False)  # what the form accepts the workflow reads
        return
    assert problem is not None and problem.path == path and words in problem.detail, problem
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(value, Expense, strict=True)


def test_the_rest_of_json_schema_a_form_meets() -> None:
    tuple_schema = msgspec.json.schema(tuple[int, str])
    assert check(tuple_schema, [1, "a"]) is None
    assert "at most 2 items" in check(tuple_schema, [1, "a", 2]).detail  # type: ignore[union-attr]
    assert check(tuple_schema, [1, 2]).path == "$[1]"  # type: ignore[union-attr]
    assert check({"type": "string", "format": "date-time"}, "2026-05-01T12:00:00Z") is None
    assert check({"type": "string", "format": "date-time"}, "yesterday") is not None
    assert check({"type": "string", "pattern": "^[A-Z]{3}$"}, "eur").detail.startswith("expected text matching")  # type: ignore[union-attr]
    assert check({"oneOf": [{"type": "integer"}, {"type": "number"}]}, 2) is not None  # fits both
    assert check({"type": "array", "uniqueItems": True}, [1, 2, 1]).path == "$[2]"  # type: ignore[union-attr]
    assert check({"type": "number", "multipleOf": 0.5}, 1.25) is not None
    assert check({"allOf": [{"minimum": 2}], "not": {"const": 3}}, 3) is not None
    assert check({"$ref": "#/definitions/missing"}, 1) is None and check({}, {"any": [1]}) is None
    assert check(msgspec.json.schema(dict[str, int]), {"a": "x"}).path == "$.a"  # type: ignore[union-attr]


# ---- the submit route -------------------------------------------------------------------------------------


def test_refused_values_are_a_400_naming_the_field_and_change_nothing(tmp_path: Path) -> None:
    engine = create_engine(FileStorage(tmp_path / "state"))
    run_id = parked(engine, expense, "ana")
    client = client_of(engine)
    before = unchanged(engine, run_id)
    cases: list[tuple[dict[str, Any], str | None, str]] = [
        ({"name": "expense", "value": {"amount": 0, "reason": "taxi"}}, "amount", "$.amount: expected a number >= 1"),
        ({"name": "expense", "value": {"amount": 12}}, "reason", "$.reason: a required field is missing"),
        ({"name": "expense", "value": {"amount": "twelve", "reason": "taxi"}}, "amount",
         '$.amount: expected an integer, got a string "twelve"'),
        ({"name": "expense", "value": "yes"}, None, "$: expected an object, got a string"),
        ({"name": "approval", "value": {"amount": 12, "reason": "taxi"}}, None,
         "has no open wait for 'approval' (it is waiting; it waits for 'expense')"),
        ({"name": "expense", "path": "3", "value": {"amount": 12, "reason": "taxi"}}, None, "at path 3"),
        ({"name": "expense"}, None, "needs the value"),
        ({"value": 1}, None, "needs the name"),
    ]
    for body, field, words in cases:
        refused = client.post(f"/api/runs/{run_id}/submit", json=body)
        assert refused.status_code == 400, (body, refused.json())
        answer = refused.json()
        assert answer["error"] == "ValidationError" and words in answer["message"], answer
        assert answer["hint"] and answer["docs"] == "docs/ui.md#approval-forms"
        assert answer.get("field") == field, answer
        if field is not None:
            assert "nothing was sent" in answer["message"] and field in answer["hint"]
        assert unchanged(engine, run_id) == before, body
    assert client.get(f"/api/runs/{run_id}").json()["status"] == "waiting"
    assert client.post("/api/runs/no-such-run/submit", json={"name": "expense", "value": 1}).status_code == 404

    sent = client.post(f"/api/runs/{run_id}/submit", json={"name": "expense", "path": "0",
                                                           "value": {"amount": 12, "reason": "taxi", "level": "high"}})
    assert sent.status_code == 200 and sent.json()["sent"] is True, sent.json()
    assert [m["payload"] for m in engine.storage.inbox(run_id)] == [{"amount": 12, "reason": "taxi", "level": "high"}]
    assert asyncio.run(engine.retry(run_id)) == "ana: 12 for taxi (high, urgent=False)"
    again = client.post(f"/api/runs/{run_id}/submit", json={"name": "expense", "value": {"amount": 1, "reason": "x"}})
    assert again.status_code == 400 and "it is completed; nothing in it waits" in again.json()["message"]


def test_a_bool_wait_and_a_wait_recorded_without_a_schema_under_the_test_engine() -> None:
    te = TestEngine()
    client = client_of(te.engine)
    result = asyncio.run(te.run(yes_or_no))
    run_id = result.run_id
    assert client.get(f"/api/runs/{run_id}").json()["steps"][0]["output"]["schema"] == {"type": "boolean"}
    refused = client.post(f"/api/runs/{run_id}/submit", json={"name": "approve", "value": "yes"})
    assert refused.status_code == 400 and 'expected true or false, got a string "yes"' in refused.json()["message"]
    assert client.post(f"/api/runs/{run_id}/submit", json={"name": "approve", "value": False}).status_code == 200
    assert asyncio.run(te.engine.retry(run_id)) == "denied"

    @workflow
    async def anything(ctx: Any, _: Any = None) -> Any:
        return await ctx.wait_for("data", timeout=3600)

    plain = asyncio.run(te.run(anything)).run_id
    assert "schema" not in client.get(f"/api/runs/{plain}").json()["steps"][0]["output"]
    sent = client.post(f"/api/runs/{plain}/submit", json={"name": "data", "value": {"free": ["form"]}})
    assert sent.status_code == 200
    assert asyncio.run(te.engine.retry(plain)) == {"free": ["form"]}


def test_the_console_keeps_its_guards_on_submit(tmp_path: Path) -> None:
    engine = create_engine(FileStorage(tmp_path / "state"))
    run_id = parked(engine, yes_or_no)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        client = TestClient(create_app(engine, token="s3cret"))
    body = {"name": "approve", "value": True}
    assert client.post(f"/api/runs/{run_id}/submit", json=body).status_code == 401
    cross = client.post(f"/api/runs/{run_id}/submit", json=body,
                        headers={"Authorization": "Bearer s3cret", "Sec-Fetch-Site": "cross-site"})
    assert cross.status_code == 403
    assert engine.storage.inbox(run_id) == []
    ok = client.post(f"/api/runs/{run_id}/submit", json=body, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200


WORKER_FLOW = textwrap.dedent('''
    import msgspec
    from durably_py import workflow

    class Seats(msgspec.Struct):
        seats: int
        section: str = "stalls"

    @workflow
    async def booking(ctx, show):
        got = await ctx.wait_for("seats", Seats, timeout=3600)
        return f"{show}: {got.seats} in the {got.section}"
''')


def test_a_submitted_form_wakes_a_parked_run_a_worker_process_finishes(tmp_path: Path) -> None:
    (tmp_path / "booking.py").write_text(WORKER_FLOW)
    state = tmp_path / "state"
    cli = [sys.executable, "-m", "durably_py.cli"]
    enqueued = subprocess.run([*cli, "enqueue", "booking.py", "-w", "booking", "-i", '"Hamlet"', "--dir", str(state)],
                              cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    worker = subprocess.Popen([*cli, "worker", "--import", "booking.py", "--dir", str(state)], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        engine = create_engine(FileStorage(state))
        client = client_of(engine)

        def status() -> str:
            return str(client.get(f"/api/runs/{enqueued}").json()["status"])
        wait_until(lambda: status() == "waiting" and not client.get(f"/api/runs/{enqueued}").json().get("owner"),
                   seconds=60, every=0.1)
        refused = client.post(f"/api/runs/{enqueued}/submit", json={"name": "seats", "value": {"seats": "two"}})
        assert refused.status_code == 400 and refused.json()["field"] == "seats"
        sent = client.post(f"/api/runs/{enqueued}/submit", json={"name": "seats", "value": {"seats": 2}})
        assert sent.status_code == 200
        wait_until(lambda: status() == "completed", seconds=60, every=0.1)
        assert client.get(f"/api/runs/{enqueued}").json()["result"] == "Hamlet: 2 in the stalls"
    finally:
        worker.terminate()
        _, err = worker.communicate(timeout=30)
    assert worker.returncode == 0, err


def test_a_refusal_is_a_durably_error_with_hint_and_docs(tmp_path: Path) -> None:
    from durably_py.errors import ValidationError
    from durably_py.ui.forms import submit

    engine = create_engine(FileStorage(tmp_path / "state"))
    run_id = parked(engine, expense, "bo")

    async def read(call: Any) -> Any:
        return await call()
    with pytest.raises(ValidationError) as refused:
        asyncio.run(submit(engine, read, run_id, {"name": "expense", "value": {"amount": -1, "reason": "x"}}))
    check_error(refused.value)
    assert refused.value.details["field"] == "amount" and refused.value.details["path"] == "$.amount"
    assert json.loads(json.dumps(refused.value.details))  # JSON-ready, as the console sends it
