"""A run's log read back: what replay answers from, and what `inspect` shows.

Record types (``"t"``), one JSON object per line, first the header:
``run`` header (``v`` = log version) · ``claim`` a process took the lease (``epoch``
is the workflow attempt) · ``code`` the workflow's fingerprint changed ·
``budget`` the budget changed · ``ok`` / ``err`` a step finished (``p`` path, ``l``
label, ``v`` value or ``e`` error, ``a`` attempt, ``ms``, ``ts``) · ``fail`` an attempt
failed and the step will retry at ``next`` · ``start`` an unsafe step began ·
``stash`` partial progress · ``wake`` a durable sleep's wake time (``at``) ·
``wait`` a wait for signal ``name`` (``deadline``); the ``ok`` that ends it names the signal
(``sig``) · ``graph`` a ``ctx.graph`` definition (``tasks``) ·
``snap`` a ``ctx.loop`` snapshot (state ``s``
after iteration ``i``) · ``charge`` spend (``c``) · ``comp`` a compensation ran ·
``adv`` an advisory · ``note`` annotations · ``reopen`` a failed run was resumed ·
``reset`` `retry --from-step` invalidated the steps at ``paths`` ·
``pause`` / ``resume`` the run was paused / resumed (paused while a ``pause`` follows the last ``resume``) ·
``end`` the run finished (``status``, ``result`` or ``error``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from .codec import load_value

BUDGET_KINDS = ("usd", "tokens", "units")


class History:
    """Everything replay needs from a run's records, with superseded records already dropped."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.header: dict[str, Any] = records[0]
        self.done: dict[str, dict[str, Any]] = {}
        self.fails: dict[str, dict[str, Any]] = {}
        self.starts: dict[str, dict[str, Any]] = {}
        self.stashes: dict[str, dict[str, Any]] = {}
        self.comps: dict[str, dict[str, Any]] = {}
        self.snaps: dict[str, dict[str, Any]] = {}
        self.graphs: dict[str, dict[str, Any]] = {}
        self.wakes: dict[str, dict[str, Any]] = {}
        self.waits: dict[str, dict[str, Any]] = {}
        self.signals: set[str] = set()
        self.charges: dict[str, dict[str, Any]] = {}
        self.advisories: dict[str, dict[str, Any]] = {}
        self.notes: dict[str, Any] = {}
        self.end: dict[str, Any] | None = None
        self.claim: dict[str, Any] | None = None
        self.paused = False
        self.budget: dict[str, float] | None = self.header.get("budget")
        self.fingerprint: str | None = self.header.get("fingerprint")
        self.updated: float | None = None
        for rec in records[1:]:
            self.add(rec)

    def add(self, rec: dict[str, Any]) -> None:
        """Fold one record into the history (records must come in log order)."""
        t = rec["t"]
        if t == "ok" or t == "err":
            self.done[rec["p"]] = rec
            if "sig" in rec:
                self.signals.add(rec["sig"])
        elif t == "fail":
            self.fails[rec["p"]] = rec
        elif t == "start":
            self.starts[rec["p"]] = rec
        elif t == "stash":
            self.stashes[rec["p"]] = rec
        elif t == "charge":
            self.charges[rec["p"]] = rec
        elif t == "comp":
            self.comps[rec["p"]] = rec
        elif t == "claim":
            self.claim = rec
        elif t == "adv":
            self.advisories[rec["a"]["code"]] = rec["a"]
        elif t == "note":
            self.notes.update(rec["n"])
        elif t == "end":
            self.end = rec
        elif t == "reopen":
            self.reopen()
        elif t == "reset":
            self.reset(rec["paths"])
        elif t == "wait":
            self.waits[rec["p"]] = rec
        elif t == "wake":
            self.wakes[rec["p"]] = rec
        elif t == "graph":
            self.graphs[rec["p"]] = rec
        elif t == "snap":
            self.snaps[rec["p"]] = rec
        elif t == "code":
            self.fingerprint = rec["fingerprint"]
        elif t == "budget":
            self.budget = rec["b"]
        elif t == "pause":
            self.paused = True
        elif t == "resume":
            self.paused = False
        if "ts" in rec:
            self.updated = rec["ts"]

    def reopen(self) -> None:
        """A failed run resumes: failed and compensated steps run again, with fresh attempts."""
        for path in [p for p, r in self.done.items() if r["t"] == "err" or p in self.comps]:
            del self.done[path]
            self.fails.pop(path, None)
            self.starts.pop(path, None)
            self.waits.pop(path, None)
        self.comps.clear()
        self.end = None

    def reset(self, paths: list[str]) -> None:
        """`retry --from-step`: the steps at `paths` run again (loops rewind past them); the run is open again."""
        if self.end is not None and self.end.get("status") == "failed":
            self.reopen()
        drop = set(paths)
        for table in (self.done, self.fails, self.starts, self.stashes, self.waits, self.wakes, self.comps):
            for path in [p for p in table if p in drop]:
                del table[path]
        for loop, snap in list(self.snaps.items()):
            inner = [q[len(loop) + 1:].partition(".")[0] for q in paths if q.startswith(f"{loop}.")]
            if loop in drop or any(i.isdigit() and int(i) <= snap["i"] for i in inner):
                del self.snaps[loop]
        self.end = None

    @property
    def attempt(self) -> int:
        """The workflow attempt: how many times a process has claimed the run."""
        return self.claim["epoch"] if self.claim else 0

    def parked(self) -> str | None:
        """"waiting" or "sleeping" while a wait or sleep has no result yet, else None."""
        if any(p not in self.done for p in self.waits):
            return "waiting"
        if any(p not in self.done for p in self.wakes):
            return "sleeping"
        return None

    def spent(self) -> dict[str, float]:
        """Total charges per budget kind."""
        totals = dict.fromkeys(BUDGET_KINDS, 0.0)
        for rec in self.charges.values():
            for kind, amount in rec["c"].items():
                totals[kind] += amount
        return totals

    def snapshotted(self, path: str) -> bool:
        """True for a step inside a loop iteration that a later snapshot already covers."""
        for loop, snap in self.snaps.items():
            if path.startswith(loop + "."):
                iteration = path[len(loop) + 1:].partition(".")[0]
                if iteration.isdigit() and int(iteration) <= snap["i"]:
                    return True
        return False

    def compacted(self) -> list[dict[str, Any]]:
        """The fewest records that rebuild this same history (for log compaction)."""
        out: list[dict[str, Any]] = [self.header]
        if self.fingerprint != self.header.get("fingerprint"):
            out.append({"t": "code", "fingerprint": self.fingerprint})
        if self.budget != self.header.get("budget"):
            out.append({"t": "budget", "b": self.budget})
        if self.claim:
            out.append(self.claim)
        out.extend(r for p, r in self.done.items() if not self.snapshotted(p))
        out.extend(s for p, s in self.snaps.items() if p not in self.done)
        for table in (self.fails, self.starts, self.stashes, self.waits, self.wakes):
            out.extend(r for p, r in table.items() if p not in self.done)
        out.extend(self.graphs.values())
        out.extend(self.charges.values())
        out.extend(self.comps.values())
        out.extend({"t": "adv", "a": a} for a in self.advisories.values())
        if self.notes:
            out.append({"t": "note", "n": self.notes})
        if self.end:
            out.append(self.end)
        if self.paused:
            out.append({"t": "pause"})
        return out


def path_tuple(path: str) -> tuple[int, ...]:
    """'0.3.1' -> (0, 3, 1)."""
    return tuple(int(p) for p in path.split(".")) if path else ()


def _preview(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class StepState:
    """One step as `inspect` shows it."""

    path: tuple[int, ...]
    label: str
    status: str
    attempts: int
    ms: float | None = None
    output: Any = None
    error: dict[str, Any] | None = None
    stashed: Any = None
    finished_at: datetime | None = None
    compensation: str | None = None

    def preview(self) -> str:
        """A one-line preview of the output or the error."""
        if self.error:
            return f"{self.error['type'].rpartition(':')[2]}: {self.error['message']}"
        return _preview(self.output) if self.status == "ok" else ""


@dataclass
class RunState:
    """A run as `inspect` and `list` describe it."""

    run_id: str
    status: str
    workflow: str
    key: str | None
    input: Any
    created_at: datetime
    updated_at: datetime | None
    attempt: int
    steps: list[StepState] = field(default_factory=list)
    advisories: list[dict[str, Any]] = field(default_factory=list)
    annotations: dict[str, Any] = field(default_factory=dict)
    result: Any = None
    error: dict[str, Any] | None = None
    script: str | None = None
    parent: str | None = None
    children: list[str] = field(default_factory=list)
    budget: dict[str, float] | None = None
    spent: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready form (for `--json`)."""
        data = asdict(self)
        for key in ("created_at", "updated_at"):
            data[key] = data[key].isoformat() if data[key] else None
        for step in data["steps"]:
            step["path"] = list(step["path"])
            step["finished_at"] = step["finished_at"].isoformat() if step["finished_at"] else None
        return data


def _ts(value: float | None) -> datetime | None:
    return datetime.fromtimestamp(value, UTC) if value is not None else None


def run_status(history: History, held: bool) -> str:
    """completed / failed / cancelled from the end record; paused, waiting, sleeping; running while held; interrupted."""
    if history.paused and (not history.end or history.end["status"] == "failed"):
        return "paused"
    if history.end:
        return history.end["status"]
    return history.parked() or ("running" if held else "interrupted")


def describe(history: History, *, held: bool, warnings: list[str] | None = None, steps: bool = True) -> RunState:
    """Build the `RunState` of a run from its history."""
    header = history.header
    state = RunState(
        run_id=header["run_id"], status=run_status(history, held), workflow=header["workflow"],
        key=header.get("key"), input=load_value(header.get("input")),
        created_at=datetime.fromisoformat(header["created_at"]), updated_at=_ts(history.updated),
        attempt=history.attempt, advisories=list(history.advisories.values()), annotations=dict(history.notes),
        script=header.get("script"), parent=header.get("parent"), budget=history.budget, spent=history.spent(), warnings=warnings or [],
    )
    if history.end:
        state.result = load_value(history.end.get("result"))
        state.error = history.end.get("error")
    state.children = [r["v"]["run_id"] for r in history.done.values() if r["l"] == "ctx.spawn" and r["t"] == "ok"]
    if not steps:
        return state
    paths = list(history.done) + [p for p in (*history.fails, *history.starts, *history.waits, *history.wakes)
                                  if p not in history.done]
    for path in dict.fromkeys(paths):
        rec = history.done.get(path)
        fail = history.fails.get(path)
        if rec is not None:
            status = rec["t"]
            step = StepState(path_tuple(path), rec["l"], "ok" if status == "ok" else "failed", rec.get("a", 1),
                             rec.get("ms"), load_value(rec.get("v")), rec.get("e"), finished_at=_ts(rec.get("ts")))
        elif path in history.waits:
            wait = history.waits[path]
            step = StepState(path_tuple(path), "ctx.wait_for", "waiting", 1,
                             output={"signal": wait["name"], "deadline": wait["deadline"]})
        elif path in history.wakes:
            step = StepState(path_tuple(path), "ctx.sleep", "sleeping", 1, output={"until": history.wakes[path]["at"]})
        elif fail is not None:
            step = StepState(path_tuple(path), fail["l"], "retrying", fail["a"], fail.get("ms"), error=fail["e"],
                             finished_at=_ts(fail.get("ts")))
        else:
            start = history.starts[path]
            step = StepState(path_tuple(path), start["l"], "interrupted", start.get("a", 1))
        if path in history.stashes and step.status != "ok":
            step.stashed = load_value(history.stashes[path]["v"])
        comp = history.comps.get(path)
        if comp is not None:
            step.compensation = "ok" if comp["ok"] else "failed"
        state.steps.append(step)
    state.steps.sort(key=lambda s: s.path)
    return state
