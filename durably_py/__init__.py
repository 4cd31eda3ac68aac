"""durably-py: local-first durable execution for Python scripts and AI workflows."""

from .advisories import Advisory
from .clock import Clock, FakeClock
from .context import AttemptContext, BudgetView, WorkflowContext, attempt
from .engine import Engine, create_engine, durably, engine_for, run, run_async
from .errors import (
    BudgetExceededError,
    CircuitOpenError,
    CorruptLogError,
    DependencyFailedError,
    DurablyError,
    KeyConflictError,
    LeaseLostError,
    LoopLimitError,
    PurityError,
    RunCancelledError,
    RunNotFoundError,
    RunParkedError,
    SerializationError,
    StaleRunError,
    StepFailedError,
    StepInterruptedError,
    StepTimeoutError,
    ValidationError,
    WaitTimeoutError,
    WorkflowFailedError,
)
from .events import StepEvent
from .graphs import GraphState, NodeState, Task
from .history import RunState, StepState
from .kernel import RunHandle
from .policies import Retry
from .resources import Breaker, RateLimit, Resource, resource
from .result import Err, Ok, is_ok, partition
from .storage import FileStorage, MemoryStorage, SqliteStorage, Storage
from .workflow import Workflow, workflow

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """`PostgresStorage` is imported on first use, so durably_py never needs psycopg unless it is used."""
    if name == "PostgresStorage":
        from .storage.postgres import PostgresStorage

        return PostgresStorage
    raise AttributeError(f"module 'durably_py' has no attribute {name!r}")

__all__ = [
    "Advisory", "AttemptContext", "Breaker", "RateLimit", "Resource", "resource", "durably", "BudgetExceededError", "BudgetView", "CircuitOpenError", "Clock",
    "CorruptLogError", "DependencyFailedError", "GraphState", "NodeState", "Task", "DurablyError", "Engine", "Err", "FakeClock", "FileStorage", "KeyConflictError",
    "LeaseLostError", "LoopLimitError", "MemoryStorage", "Ok", "PurityError", "Retry", "RunCancelledError", "RunHandle", "RunNotFoundError", "RunParkedError",
    "RunState", "SerializationError", "SqliteStorage", "StaleRunError", "StepEvent", "StepFailedError",
    "StepInterruptedError", "StepState", "StepTimeoutError", "Storage", "ValidationError", "WaitTimeoutError", "Workflow",
    "WorkflowContext", "WorkflowFailedError", "attempt", "create_engine", "engine_for", "is_ok", "partition",
    "run", "run_async", "workflow",
]
