"""durably-py: local-first durable execution for Python scripts and AI workflows.

The public surface is exactly `__all__` (plus `durably_py.testing`, `durably_py.records` for the log format,
and the `durably_py.storage` adapters); every other module is internal (docs/architecture.md).
"""

from typing import TYPE_CHECKING

from ._authoring.awakeables import Awakeable
from ._authoring.calls import RunHandle
from ._authoring.context import AttemptContext, BudgetView, First, WorkflowContext, attempt
from ._authoring.engine_api import EngineAPI
from ._authoring.graphs import GraphState, NodeState, Task
from ._authoring.handles import Handle
from ._authoring.once import Once, once
from ._authoring.policies import Retry
from ._authoring.queues import Queue, queue
from ._authoring.resources import Breaker, RateLimit, Resource, resource
from ._authoring.result import Err, Ok, is_ok, partition
from ._authoring.usage import set_prices, usage_extractor
from ._authoring.workflow import Workflow, workflow
from ._clock import Clock, FakeClock
from ._engine.awakeables import AwakeableResolution
from ._engine.engine import Engine, create_engine, durably, engine_for, run, run_async
from ._engine.operations import BulkResult
from ._engine.queue import QueueInfo
from ._engine.upgrades import SourceDiff
from ._events import StepEvent
from ._state.advisories import Advisory
from ._state.history import RunState, SignalSent, StepState
from ._worker.schedules import Schedule, schedule
from .errors import (
    ArgumentError,
    AwakeableNotFoundError,
    AwakeableRejectedError,
    AwakeableResolvedError,
    AwakeableTimeoutError,
    AwakeableTokenError,
    BudgetExceededError,
    CircuitOpenError,
    CorruptLogError,
    DependencyFailedError,
    DurablyError,
    EffectFailedError,
    KeyConflictError,
    LeaseLostError,
    LogVersionError,
    LoopLimitError,
    NonRetryableError,
    NotDurableError,
    NotSupportedError,
    PurityError,
    ReplayDivergenceError,
    RunCancelledError,
    RunNotFoundError,
    RunParkedError,
    SerializationError,
    StaleRunError,
    StepFailedError,
    StepInterruptedError,
    StepTimeoutError,
    StorageBusyError,
    StorageFullError,
    ValidationError,
    WaitTimeoutError,
    WorkflowFailedError,
)
from .storage import FileStorage, Storage

if TYPE_CHECKING:
    from .storage.memory import MemoryStorage
    from .storage.postgres import PostgresStorage
    from .storage.sqlite import SqliteStorage

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """The adapters other than files are imported on first use (`durably_py.storage`): a run on files
    imports neither the SQLite adapter nor psycopg."""
    if name in ("MemoryStorage", "SqliteStorage", "PostgresStorage"):
        from . import storage

        return getattr(storage, name)
    raise AttributeError(f"module 'durably_py' has no attribute {name!r}")


__all__ = [
    "Advisory",
    "ArgumentError",
    "AttemptContext",
    "Awakeable",
    "AwakeableNotFoundError",
    "AwakeableRejectedError",
    "AwakeableResolution",
    "AwakeableResolvedError",
    "AwakeableTimeoutError",
    "AwakeableTokenError",
    "Breaker",
    "BudgetExceededError",
    "BudgetView",
    "BulkResult",
    "CircuitOpenError",
    "Clock",
    "CorruptLogError",
    "DependencyFailedError",
    "DurablyError",
    "EffectFailedError",
    "Engine",
    "EngineAPI",
    "Err",
    "FakeClock",
    "FileStorage",
    "First",
    "GraphState",
    "Handle",
    "KeyConflictError",
    "LeaseLostError",
    "LogVersionError",
    "LoopLimitError",
    "MemoryStorage",
    "NodeState",
    "NonRetryableError",
    "NotDurableError",
    "NotSupportedError",
    "Ok",
    "Once",
    "PostgresStorage",
    "PurityError",
    "Queue",
    "QueueInfo",
    "RateLimit",
    "ReplayDivergenceError",
    "Resource",
    "Retry",
    "RunCancelledError",
    "RunHandle",
    "RunNotFoundError",
    "RunParkedError",
    "RunState",
    "Schedule",
    "SerializationError",
    "SignalSent",
    "SourceDiff",
    "SqliteStorage",
    "StaleRunError",
    "StepEvent",
    "StepFailedError",
    "StepInterruptedError",
    "StepState",
    "StepTimeoutError",
    "Storage",
    "StorageBusyError",
    "StorageFullError",
    "Task",
    "ValidationError",
    "WaitTimeoutError",
    "Workflow",
    "WorkflowContext",
    "WorkflowFailedError",
    "attempt",
    "create_engine",
    "durably",
    "engine_for",
    "is_ok",
    "once",
    "partition",
    "queue",
    "resource",
    "run",
    "run_async",
    "schedule",
    "set_prices",
    "usage_extractor",
    "workflow",
]
