"""Static task graphs: a DAG of child runs, validated before any work starts, with each node's status and
the reason it waits."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ValidationError
from .workflow import Workflow, as_workflow

TASK_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TASKS = 100
DOCS = "docs/authoring.md#task-graphs"


@dataclass(frozen=True)
class Task:
    """One node of a graph: a workflow to run as a child run, its input, and the tasks it waits for.

    `input` may be a function of the prerequisites' results (`lambda deps: ...`, keyed by task id); it
    runs in the workflow body, so it must be deterministic."""

    workflow: Any
    input: Any = None
    depends_on: tuple[str, ...] | list[str] = field(default_factory=tuple)


@dataclass(frozen=True)
class Node:
    """A validated task: its workflow object and sorted-out prerequisites."""

    id: str
    workflow: Workflow
    input: Any
    depends_on: tuple[str, ...]

    def make_input(self, deps: Mapping[str, Any]) -> Any:
        """The child's input, built from the prerequisites' results when `input` is a function."""
        return self.input(dict(deps)) if callable(self.input) else self.input


def validate(tasks: Mapping[str, Task]) -> list[Node]:
    """Check a graph before any work starts: 1-100 tasks, valid ids, known prerequisites, no cycles."""
    if not isinstance(tasks, Mapping) or not 1 <= len(tasks) <= MAX_TASKS:
        raise ValidationError(f"ctx.graph takes a dict of 1-{MAX_TASKS} tasks, got {tasks!r:.80}",
                              hint="ctx.graph({'fetch': Task(fetch, url), 'sum': Task(summ, depends_on=['fetch'])})",
                              docs=DOCS)
    nodes = []
    for task_id, task in tasks.items():
        if not isinstance(task_id, str) or not TASK_ID.match(task_id):
            raise ValidationError(f"graph task id {task_id!r} is not 1-64 letters, digits, '-' or '_'",
                                  hint="Use short stable ids such as 'market' or 'report-1'.", docs=DOCS)
        if not isinstance(task, Task):
            raise ValidationError(f"graph task {task_id!r} is {task!r:.60}, not a Task(...)",
                                  hint="Wrap each node: Task(workflow, input, depends_on=[...]).", docs=DOCS)
        deps = task.depends_on
        if isinstance(deps, str) or not all(isinstance(d, str) for d in deps):
            raise ValidationError(f"depends_on of graph task {task_id!r} must be a list of task ids, got {deps!r}",
                                  hint="depends_on=['market', 'product']", docs=DOCS)
        for dep in deps:
            if dep == task_id:
                raise ValidationError(f"graph task {task_id!r} depends on itself", hint="Remove it from depends_on.",
                                      docs=DOCS)
            if dep not in tasks:
                raise ValidationError(f"graph task {task_id!r} depends on unknown task {dep!r}",
                                      hint=f"Known tasks: {', '.join(tasks)}.", docs=DOCS)
        nodes.append(Node(task_id, as_workflow(task.workflow), task.input, tuple(dict.fromkeys(deps))))
    cycle = find_cycle({n.id: n.depends_on for n in nodes})
    if cycle:
        raise ValidationError(f"graph has a cycle: {' -> '.join(cycle)}",
                              hint="A task can only wait for tasks that do not wait for it.", docs=DOCS, cycle=cycle)
    return nodes


def find_cycle(edges: Mapping[str, tuple[str, ...]]) -> list[str] | None:
    """A dependency cycle as a list of ids (first id repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in edges[node]:
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in edges:
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def topological(edges: Mapping[str, tuple[str, ...]]) -> list[str]:
    """The ids of an acyclic graph, every task after the tasks it depends on."""
    order: list[str] = []
    seen: set[str] = set()

    def visit(node: str) -> None:
        if node not in seen:
            seen.add(node)
            for dep in edges[node]:
                visit(dep)
            order.append(node)

    for node in edges:
        visit(node)
    return order


@dataclass
class NodeState:
    """One node as `engine.graph()` shows it: its child run, status, and why it waits (if it does)."""

    id: str
    workflow: str
    depends_on: list[str]
    run_id: str | None
    status: str
    wait: str | None


@dataclass
class GraphState:
    """A graph of a run: its overall status and its nodes."""

    run_id: str
    path: tuple[int, ...]
    status: str
    nodes: list[NodeState]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready form (for `--json`)."""
        return {"run_id": self.run_id, "path": list(self.path), "status": self.status,
                "nodes": [vars(n) for n in self.nodes]}


FAILED = ("failed", "cancelled", "blocked")


def describe(run_id: str, path: tuple[int, ...], record: dict[str, Any], children: Mapping[str, str | None],
             status_of: Callable[[str], str], parent_live: bool, parent_end: str | None = None) -> GraphState:
    """Each node's status (its child run's, or pending/blocked before it starts) and the reason it waits:
    `dependencies` (a prerequisite has not completed), `dependency_failed` (one failed, was cancelled or is
    blocked), `capacity` (created, waiting for an engine slot) or the child's own parking state.

    Once the parent has ended (`parent_end` is its final status) nothing more starts: a node with no child
    run whose prerequisites all completed failed to start (`input_failed`: its `Task.input` function
    raised) when the parent completed, else it was `cancelled` with the parent (`parent_ended`)."""
    nodes: dict[str, NodeState] = {}
    tasks = record["tasks"]
    for task_id in topological({t: tuple(s["depends_on"]) for t, s in tasks.items()}):
        spec = tasks[task_id]
        child = children.get(task_id)
        status = status_of(child) if child else "pending"
        wait = None
        if child is None:
            deps = [nodes[d].status if d in nodes else "pending" for d in spec["depends_on"]]
            if any(s in FAILED for s in deps):
                status, wait = "blocked", "dependency_failed"
            elif parent_end is not None:
                ready = all(s == "completed" for s in deps)
                status, wait = ("failed", "input_failed") if ready and parent_end == "completed" \
                    else ("cancelled", "parent_ended")
            elif any(s != "completed" for s in deps):
                wait = "dependencies"
        elif status == "interrupted" and parent_live:
            wait = "capacity"
        elif status in ("waiting", "sleeping", "paused"):
            wait = status
        nodes[task_id] = NodeState(task_id, spec["workflow"], list(spec["depends_on"]), child, status, wait)
    statuses = [n.status for n in nodes.values()]
    ordered = [nodes[t] for t in tasks]
    if all(s == "completed" for s in statuses):
        overall = "completed"
    elif any(s in FAILED for s in statuses):
        overall = "blocked"
    elif any(s in ("running", "pending") for s in statuses):
        overall = "running"
    else:
        overall = "waiting"
    return GraphState(run_id, path, overall, ordered)
