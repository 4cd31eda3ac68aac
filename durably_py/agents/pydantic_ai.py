"""Pydantic AI agents as durable workflows: each model request and each tool call of a run is a durably step.

`DurableAgent(agent)` wraps a Pydantic AI `Agent`; `await durable.run(ctx, prompt, deps=...)` inside a durably
workflow runs it with a capability attached for that run only. The capability wraps the model serving each request
(`get_wrapper_model`) and the run's toolset (`get_wrapper_toolset`), so that:

* a model request is a step whose recorded value is the `ModelResponse`, serialised with Pydantic AI's own
  `ModelMessagesTypeAdapter` so the replayed response equals the live one; a streamed request (an
  `event_stream_handler`) is drained inside its step, each text delta handed to `attempt().emit` where the running
  durably has streamed steps;
* a tool call is a step named by the tool, its return (or the `ModelRetry`, `ToolFailed`, `ApprovalRequired` or
  `CallDeferred` it raised) recorded as data and given back, or raised again, on replay;
* a tool that needs approval waits with `ctx.wait_for("approve:<tool_call_id>")`, so the run parks until an operator
  sends `durably signal RUN approve:<id> true` (or `false`, or `{"approved": false, "message": "why"}`);
* every model request's usage is charged to the run's budget with `ctx.charge(tokens=..., usd=...)`.

A run killed between two tool calls resumes without repeating a completed model request or tool call. No server is
needed: the steps live in the run's log like any other. See docs/agents.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from .. import errors
from .._authoring.context import WorkflowContext, attempt

try:
    import pydantic_core
    from pydantic import TypeAdapter
    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.exceptions import ApprovalRequired, CallDeferred, ModelRetry, ToolFailed
    from pydantic_ai.messages import (
        ModelMessage,
        ModelMessagesTypeAdapter,
        ModelResponse,
        PartDeltaEvent,
        PartStartEvent,
        TextPart,
        TextPartDelta,
        ToolReturn,
    )
    from pydantic_ai.models import CompletedStreamedResponse, Model, ModelRequestParameters, StreamedResponse
    from pydantic_ai.models.wrapper import WrapperModel
    from pydantic_ai.run import AgentRunResult
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.tools import DeferredToolRequests, DeferredToolResults, RunContext, ToolApproved, ToolDenied
    from pydantic_ai.toolsets import AbstractToolset, ToolsetTool, WrapperToolset
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise errors.ValidationError("durably_py.agents.pydantic_ai needs Pydantic AI",
                                 hint="pip install 'durably-py[pydantic-ai]'", docs="docs/agents.md") from exc

__all__ = ["APPROVAL_SIGNAL", "DurableAgent", "TokenPrice"]

DepsT = TypeVar("DepsT")
OutputT = TypeVar("OutputT")

APPROVAL_SIGNAL = "approve:{tool_call_id}"
"""The signal a tool call that needs approval waits for; `{tool_call_id}` is the model's id of the call."""

_DOCS = "docs/agents.md#pydantic-ai"
_TOOL_RETURN = TypeAdapter(ToolReturn)


@dataclass(frozen=True)
class TokenPrice:
    """What a model charges, in US dollars per million tokens, so each request's cost is charged as `usd`."""

    input_per_million: float
    output_per_million: float

    def cost(self, response: ModelResponse) -> float:
        """The dollars `response`'s usage costs at this price."""
        usage = response.usage
        return (usage.input_tokens * self.input_per_million + usage.output_tokens * self.output_per_million) / 1e6


Price = TokenPrice | Callable[[ModelResponse], float]


def _dump_response(response: ModelResponse) -> Any:
    """The JSON form of one response, as Pydantic AI itself serialises message histories."""
    return ModelMessagesTypeAdapter.dump_python([response], mode="json")[0]


def _load_response(data: Any) -> ModelResponse:
    message = ModelMessagesTypeAdapter.validate_python([data])[0]
    if not isinstance(message, ModelResponse):
        raise errors.ValidationError("a recorded model request holds no model response",
                                     hint="The run's log was not written by this integration; restart the run.",
                                     docs=_DOCS)
    return message


async def _record_tool_call(call: Any) -> dict[str, Any]:
    """Run one tool call; its return, or the control-flow exception Pydantic AI expects, as JSON data."""
    try:
        value = await call
    except ApprovalRequired as exc:
        return {"raise": "approval_required", "metadata": pydantic_core.to_jsonable_python(exc.metadata)}
    except CallDeferred as exc:
        return {"raise": "call_deferred", "metadata": pydantic_core.to_jsonable_python(exc.metadata),
                "call_kind": getattr(exc, "kind", "external")}
    except ModelRetry as exc:
        return {"raise": "model_retry", "message": exc.message}
    except ToolFailed as exc:
        return {"raise": "tool_failed", "message": exc.message}
    if isinstance(value, ToolReturn):
        return {"tool_return": _TOOL_RETURN.dump_python(value, mode="json")}
    return {"return": pydantic_core.to_jsonable_python(value)}


def _replay_tool_call(data: dict[str, Any]) -> Any:
    """What the tool call gave, from its recorded data: the same live and on replay."""
    if "return" in data:
        return data["return"]
    if "tool_return" in data:
        return _TOOL_RETURN.validate_python(data["tool_return"])
    kind = data.get("raise")
    if kind == "approval_required":
        raise ApprovalRequired(metadata=data.get("metadata"))
    if kind == "call_deferred":
        kind = data.get("call_kind", "external")
        raise CallDeferred(metadata=data.get("metadata"), **({} if kind == "external" else {"kind": kind}))
    if kind == "model_retry":
        raise ModelRetry(data["message"])
    if kind == "tool_failed":
        raise ToolFailed(data["message"])
    raise errors.ValidationError(f"a recorded tool call holds data of no known shape: {sorted(data)}",
                                 hint="The run's log was not written by this integration; restart the run.",
                                 docs=_DOCS)


def _decision(value: Any) -> ToolApproved | ToolDenied:
    """An operator's answer to an approval: `true`, `false`, or `{"approved": ..., "message": ..., "args": ...}`."""
    if isinstance(value, bool):
        return ToolApproved() if value else ToolDenied()
    if isinstance(value, dict) and isinstance(value.get("approved"), bool) and set(value) <= {"approved", "message",
                                                                                              "args"}:
        if value["approved"]:
            args = value.get("args")
            if args is not None and not isinstance(args, dict):
                raise ValueError('"args" must be an object of the tool\'s arguments')
            return ToolApproved(override_args=args)
        message = value.get("message")
        return ToolDenied(message) if isinstance(message, str) else ToolDenied()
    raise ValueError('an approval is true, false, or {"approved": bool, "message": str, "args": {...}}')


def _emit(text: str) -> None:
    """Hand a streamed text delta to the running step's stream, where this durably has streamed steps."""
    emit = getattr(attempt(), "emit", None)
    if emit is not None:
        emit(text)


class _Broker:
    """Calls into the workflow's ctx made from the tasks Pydantic AI runs a model request or a tool call in.

    A step's path is fixed by the task that owns the workflow's strand, so the agent runs in a task of its own and
    asks the workflow's task to call `ctx`: one request at a time (model requests and tool calls go one after
    another), which gives every replay the same paths. A call that returns a handle is relayed when it completes.
    """

    def __init__(self) -> None:
        self._requests: asyncio.Queue[tuple[Callable[[], Any], asyncio.Future[Any]]] = asyncio.Queue()

    async def call(self, make: Callable[[], Any]) -> Any:
        """`make()` called in the workflow's task; its value, or the outcome of the handle it returned."""
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._requests.put_nowait((make, reply))
        return await reply

    async def serve(self, work: Awaitable[Any]) -> Any:
        """Run `work` in a task of its own, serving its calls from this (the workflow's) task, until it ends."""
        # Outside the run's tasks (a fresh context): when the run parks or stops, the kernel closes its tasks'
        # coroutines from outside, which Pydantic AI's task groups cannot survive cleanly; this task is cancelled
        # instead, in its own turn, as anyio expects. Its calls into ctx go through this (the workflow's) task.
        task: asyncio.Task[Any] = asyncio.get_running_loop().create_task(_awaited(work), context=contextvars.Context())
        try:
            while True:
                getter = asyncio.ensure_future(self._requests.get())
                await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    return task.result()
                self._start(*getter.result())
        finally:
            if not task.done():
                task.cancel()

    @staticmethod
    def _start(make: Callable[[], Any], reply: asyncio.Future[Any]) -> None:
        try:
            value = make()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
            reply.set_exception(exc)
            return
        if not isinstance(value, asyncio.Future):
            reply.set_result(value)
            return

        def relay(done: asyncio.Future[Any]) -> None:
            if reply.done():
                return
            if done.cancelled():
                reply.cancel()
            elif (exc := done.exception()) is not None:
                reply.set_exception(exc)
            else:
                reply.set_result(done.result())

        value.add_done_callback(relay)


async def _awaited(work: Awaitable[Any]) -> Any:
    return await work


class _StepModel(WrapperModel):
    """The model of one run: each request, plain or streamed, is one step recording the `ModelResponse`."""

    def __init__(self, wrapped: Model, durable: _Durability) -> None:
        super().__init__(wrapped)
        self._durable = durable

    async def request(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                      model_request_parameters: ModelRequestParameters) -> ModelResponse:
        async def send() -> Any:
            return _dump_response(await self.wrapped.request(messages, model_settings, model_request_parameters))

        return await self._durable.model_step(send)

    @contextlib.asynccontextmanager
    async def request_stream(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                             model_request_parameters: ModelRequestParameters,
                             run_context: RunContext[Any] | None = None) -> AsyncIterator[StreamedResponse]:
        async def stream() -> Any:
            async with self.wrapped.request_stream(messages, model_settings, model_request_parameters,
                                                   run_context) as streamed:
                async for event in streamed:
                    if isinstance(event, PartDeltaEvent) and isinstance(event.delta, TextPartDelta):
                        if event.delta.content_delta:
                            _emit(event.delta.content_delta)
                    elif isinstance(event, PartStartEvent) and isinstance(event.part, TextPart) and event.part.content:
                        _emit(event.part.content)
                return _dump_response(streamed.get())

        response = await self._durable.model_step(stream)
        yield CompletedStreamedResponse(response, model_request_parameters=model_request_parameters,
                                        replay_events=True)


@dataclass
class _StepToolset(WrapperToolset[Any]):
    """The run's toolset: each tool call is one step named by its tool."""

    durable: _Durability = field(repr=False, kw_only=True)

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any],
                        tool: ToolsetTool[Any]) -> Any:
        async def call() -> dict[str, Any]:
            return await _record_tool_call(self.wrapped.call_tool(name, tool_args, ctx, tool))

        durable = self.durable
        data = await durable.broker.call(
            lambda: durable.ctx.step(call, name=f"{durable.name}: tool {name}", **durable.tool_options))
        return _replay_tool_call(data)


@dataclass
class _Durability(AbstractCapability[Any]):
    """The capability one `DurableAgent.run` attaches: it routes the run's I/O through `ctx`'s steps."""

    ctx: WorkflowContext
    name: str
    price: Price | None
    approval_signal: str
    approval_timeout: float | None
    model_options: dict[str, Any]
    tool_options: dict[str, Any]
    broker: _Broker

    async def model_step(self, send: Callable[[], Any]) -> ModelResponse:
        """Send (or replay) one model request as a step, and charge its usage to the run's budget."""
        recorded = await self.broker.call(
            lambda: self.ctx.step(send, name=f"{self.name}: model request", charge=False,  # charged below, once
                                  **self.model_options))
        response = _load_response(recorded)
        usage = response.usage
        usd = 0.0
        if self.price is not None:
            usd = self.price.cost(response) if isinstance(self.price, TokenPrice) else float(self.price(response))
        tokens = usage.input_tokens + usage.output_tokens
        if tokens or usd:
            await self.broker.call(lambda: self.ctx.charge(tokens=tokens, usd=usd))
        return response

    def get_wrapper_model(self, model: Model) -> Model | None:
        return _StepModel(model, self)

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
        return _StepToolset(toolset, durable=self)

    async def handle_deferred_tool_calls(self, ctx: RunContext[Any], *,
                                         requests: DeferredToolRequests) -> DeferredToolResults | None:
        """Each call that needs approval waits for its signal; calls run elsewhere are left to the caller."""
        if not requests.approvals:
            return None
        approvals: dict[str, bool | ToolApproved | ToolDenied] = {}
        for call in requests.approvals:
            signal = self.approval_signal.format(tool_call_id=call.tool_call_id, tool_name=call.tool_name)
            while True:
                try:
                    approvals[call.tool_call_id] = await self.broker.call(
                        functools.partial(self.ctx.wait_for, signal, _decision, timeout=self.approval_timeout))
                    break
                except errors.WaitTimeoutError:
                    approvals[call.tool_call_id] = ToolDenied("No one approved the tool call in time.")
                    break
                except errors.ValidationError as exc:
                    # the malformed signal is consumed and changes nothing: wait for the next one
                    message = f"ignored signal {signal!r}: {exc}"
                    await self.broker.call(functools.partial(self.ctx.log, message))
        return DeferredToolResults(approvals=approvals)


class DurableAgent(Generic[DepsT, OutputT]):
    """A Pydantic AI `Agent` whose runs, inside a durably workflow, record every model request and tool call.

    ```python
    durable = DurableAgent(agent, name="support")

    @workflow
    async def answer(ctx, question: str) -> str:
        result = await durable.run(ctx, question, deps=Deps(...))
        return result.output
    ```

    `price` charges each request's cost as `usd` (a `TokenPrice`, or a function of the `ModelResponse`);
    `approval_signal` names the signal a call that needs approval waits for (`{tool_call_id}`, `{tool_name}`), at
    most `approval_timeout` seconds (durably: a parked run counts them too) before the call is denied;
    `model_retry`/`tool_retry` (a `Retry`) and `model_timeout`/`tool_timeout` (seconds) are the steps' policies.
    Tool calls of one model response run one after another, so every resume allocates the same step paths.
    """

    def __init__(self, agent: Agent[DepsT, OutputT], *, name: str | None = None, price: Price | None = None,
                 approval_signal: str = APPROVAL_SIGNAL, approval_timeout: float | None = None,
                 model_retry: Any = None, tool_retry: Any = None, model_timeout: float | None = None,
                 tool_timeout: float | None = None) -> None:
        if not isinstance(agent, Agent):
            raise errors.ArgumentError(f"DurableAgent wraps a pydantic_ai.Agent, not {type(agent).__name__}",
                                       hint="Pass the Agent itself: DurableAgent(agent).", docs=_DOCS)
        label = name or agent.name
        if not label:
            raise errors.ArgumentError("DurableAgent needs a name: its steps are recorded under it",
                                       hint="Pass name='...' or give the Agent a name (Agent(..., name='...')); "
                                            "keep it stable, since recorded runs replay by it.", docs=_DOCS)
        if "{tool_call_id}" not in approval_signal:
            raise errors.ArgumentError("approval_signal must contain {tool_call_id}",
                                       hint='Use e.g. "approve:{tool_call_id}": each call waits for its own signal.',
                                       docs=_DOCS)
        if price is not None and not isinstance(price, TokenPrice) and not callable(price):
            raise errors.ArgumentError("price is a TokenPrice or a function of the ModelResponse",
                                       hint="Pass TokenPrice(input_per_million=..., output_per_million=...).",
                                       docs=_DOCS)
        self.agent = agent
        self.name = label
        self.price = price
        self.approval_signal = approval_signal
        self.approval_timeout = approval_timeout
        self._model_options = _options(model_retry, model_timeout)
        self._tool_options = _options(tool_retry, tool_timeout)

    async def run(self, ctx: WorkflowContext, user_prompt: Any = None, *,
                  capabilities: Sequence[Any] | None = None, **kwargs: Any) -> AgentRunResult[Any]:
        """Run the agent inside the workflow of `ctx`, each model request and tool call a step of its run.

        Takes `Agent.run`'s arguments (`deps=`, `message_history=`, `event_stream_handler=`, `output_type=`, ...).
        With an `event_stream_handler` each request streams inside its step; the handler, which runs in the
        workflow, sees every response's events, on replay too.
        """
        if not isinstance(ctx, WorkflowContext):
            raise errors.ArgumentError("DurableAgent.run takes the workflow's ctx first",
                                       hint="Call it inside a workflow: await durable.run(ctx, prompt, ...).",
                                       docs=_DOCS)
        _refuse_restate(ctx)
        broker = _Broker()
        durability = _Durability(ctx=ctx, name=self.name, price=self.price, approval_signal=self.approval_signal,
                                 approval_timeout=self.approval_timeout, model_options=self._model_options, tool_options=self._tool_options, broker=broker)
        with Agent.parallel_tool_call_execution_mode("sequential"):
            run = self.agent.run(user_prompt, capabilities=[durability, *(capabilities or ())], **kwargs)
            result: AgentRunResult[Any] = await broker.serve(run)
        return result


def _options(retry: Any, timeout: float | None) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if retry is not None:
        options["retry"] = retry
    if timeout is not None:
        options["timeout"] = timeout
    return options


def _refuse_restate(ctx: WorkflowContext) -> None:
    """Restate mode keeps no budgets and no streamed steps: say so before anything runs."""
    try:
        ctx.budget.spent("tokens")
    except errors.NotSupportedError as exc:
        mode = exc.details.get("mode")
        where = "Restate mode" if mode == "restate" else f"mode {mode!r}"
        raise errors.NotSupportedError(
            f"DurableAgent (Pydantic AI) is not supported in {where}: it charges every model request to the "
            "run's budget and relays streamed output through the run's steps, which this mode does not keep",
            hint="Run this workflow on FileStorage, SQLite or PostgreSQL to use DurableAgent.", docs=_DOCS,
            feature="durably_py.agents.pydantic_ai", mode=mode) from exc
