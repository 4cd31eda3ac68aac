"""durably workflows as Restate workflows named `durably.<workflow>`, and the ASGI app that serves them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import restate
from restate import TerminalError

from .._authoring.workflow import REGISTRY, Workflow, as_workflow
from .._codec import load_value
from .context import RestateWorkflowContext, run_body
from .runtime import WIRE, Pump, failure_of

PREFIX = "durably."


def service_name(workflow_name: str) -> str:
    """The Restate service a durably workflow runs as."""
    return f"{PREFIX}{workflow_name}"


def workflow_service(workflow: Workflow) -> restate.Workflow:
    """One Restate workflow: `run` drives the durably function; `signal` queues a signal for `ctx.wait_for`."""
    service = restate.Workflow(service_name(workflow.name), description=(workflow.__doc__ or "").strip() or None)

    @service.main(name="run", input_serde=WIRE, output_serde=WIRE)
    async def run(ctx: restate.WorkflowContext, wire: Any) -> Any:
        value = load_value(wire)
        if workflow.input_schema is not None:
            try:
                value = workflow.input_schema.convert(value, "input")
            except Exception as exc:  # noqa: BLE001 - bad input fails the run, as on files
                raise failure_of(exc) from None
        pump = Pump(ctx, ctx.key())
        durable_ctx = RestateWorkflowContext(pump, ctx.key())
        kind, outcome = await pump.drive(lambda: run_body(pump, durable_ctx, workflow, value))
        if kind == "ok":
            return outcome
        if kind == "err":
            raise failure_of(outcome[0]) from None
        raise outcome

    @service.handler(name="signal", input_serde=WIRE, output_serde=WIRE)
    async def signal(ctx: restate.WorkflowSharedContext, request: Any) -> Any:
        name, payload = request["name"], request.get("payload")
        slot = 0
        while True:
            promise = ctx.promise(f"signal:{name}:{slot}", serde=WIRE)
            if await promise.peek() is None:
                try:
                    await promise.resolve({"v": payload})
                    return {"slot": slot}
                except TerminalError:
                    pass
            slot += 1

    return service


def app(*workflows: Any) -> Any:
    """The ASGI app serving `workflows` (default: every `@workflow` imported so far) on Restate."""
    chosen: Iterable[Workflow] = [as_workflow(w) for w in workflows] if workflows else list(REGISTRY.values())
    return restate.app([workflow_service(w) for w in chosen])
