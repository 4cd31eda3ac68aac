"""A run's log records as the lines people read: `durably logs` prints them, the console's log panel shows them.

One function per record kind of `records.py` (`LINES`), each turning the plain JSON object of a record into
styled segments; a kind this version does not know shows as its name and fields, so a newer log still reads.
Nothing here imports rich: a segment is its text and a rich style name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from .._engine.runs import owner_text
from .._state.history import path_tuple
from ..records import kind_of
from .live import duration_text, when_text

Segment = tuple[str, str]  # text, rich style ("" for none)
COLOURS = {"completed": "green", "failed": "red", "cancelled": "bright_black"}


def short_json(value: Any, limit: int = 80, default: Callable[[Any], Any] = repr) -> str:
    """A value as compact JSON (what `--input` and `signal` accept), cut to `limit` characters."""
    text = json.dumps(value, ensure_ascii=False, default=default, separators=(", ", ": "))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def path_text(path: tuple[int, ...]) -> str:
    """A step path as `inspect` prints it: (2,) or (3, 1, 0)."""
    return "(" + ", ".join(map(str, path)) + ("," if len(path) == 1 else "") + ")"


def record_path(raw: Any) -> str:
    """The step position a record's `p` names, as `inspect` prints paths; a charge made inside a step
    (`2@ab12`) or between steps (`$3`) names that position too; "" for none."""
    if not isinstance(raw, str) or not raw:
        return ""
    try:
        return path_text(path_tuple(raw.lstrip("$").partition("@")[0]))
    except ValueError:
        return raw


def record_time(rec: dict[str, Any]) -> str:
    """When a record was written, local time with milliseconds (blank when it does not say)."""
    ts = rec.get("ts")
    when: datetime | None = None
    if isinstance(ts, int | float) and not isinstance(ts, bool):
        when = datetime.fromtimestamp(ts, UTC)
    else:
        stamp = rec.get("at") if kind_of(rec) == "claim" else rec.get("created_at")
        try:
            when = datetime.fromisoformat(stamp) if isinstance(stamp, str) else None
        except ValueError:
            when = None
    return when.astimezone().strftime("%H:%M:%S.%f")[:-3] if when else " " * 12


def error_text(error: Any) -> str:
    """A recorded error as `Type: message`."""
    if not isinstance(error, dict):
        return "error"
    return f"{str(error.get('type', '')).rpartition(':')[2]}: {error.get('message', '')}"


def money(kind: str, value: Any) -> str:
    """An amount of one budget kind: $0.05, 1,200 tokens."""
    if not isinstance(value, int | float):
        return f"{value} {kind}"
    return f"${value:,.4g}" if kind == "usd" else f"{value:,.6g} {kind}"


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _run(rec: dict[str, Any]) -> list[Segment]:
    out = [(f"run {rec.get('run_id')} of {rec.get('workflow')} created", "bold")]
    if rec.get("key") is not None:
        out.append((f"  key {rec['key']}", ""))
    if rec.get("input") is not None:
        out.append((f"  input {short_json(rec['input'])}", ""))
    if rec.get("parent"):
        out.append((f"  child of {rec['parent']}", "bright_black"))
    return out


def _ok(rec: dict[str, Any]) -> list[Segment]:
    out = [("ok", "green")]
    if isinstance(rec.get("ms"), int | float):
        out.append((f"  {duration_text(rec['ms'] / 1000)}", "bright_black"))
    if rec.get("sig") is not None:
        out.append((f"  read signal {rec['sig']}", "blue"))
    if rec.get("v") is not None:
        out.append((f"  → {short_json(rec['v'])}", ""))
    return out


def _failed(rec: dict[str, Any]) -> list[Segment]:
    out = [(f"attempt {rec.get('a', 1)} failed: {error_text(rec.get('e'))}", "red")]
    if kind_of(rec) == "fail" and rec.get("next"):
        out.append((f"  retry at {when_text(rec['next'])}", "yellow"))
    return out


def _wait(rec: dict[str, Any]) -> list[Segment]:
    deadline = f" (deadline {when_text(rec['deadline'])})" if rec.get("deadline") else " (no deadline)"
    return [(f"waiting for signal {rec.get('name')!r}{deadline}", "blue")]


def _awake(rec: dict[str, Any]) -> list[Segment]:
    deadline = f" (deadline {when_text(rec['deadline'])})" if rec.get("deadline") else " (no deadline)"
    name = f" {rec['name']!r}" if rec.get("name") else ""
    return [(f"awakeable{name} {rec.get('id')} created{deadline}", "blue")]


def _park(rec: dict[str, Any]) -> list[Segment]:
    over = rec.get("budget")
    if isinstance(over, dict):
        kind = over.get("kind") or "usd"
        need, limit = over.get("needed"), _dict(over.get("limit")).get(kind)
        amount = f" ({money(kind, need)} of {money(kind, limit)})" if need is not None and limit is not None \
            else ""
        return [(f"over budget{amount}: parked until its budget is raised (durably budget RUN --raise)", "yellow")]
    if rec.get("until"):
        return [(f"parked in its retry backoff until {when_text(rec['until'])} (no process holds it)", "blue")]
    children = list(rec.get("children") or [])
    count = rec.get("count") or len(children)
    named = ", ".join(children[:3]) + (", …" if count > 3 else "")
    what = f"{count} child run{'s' if count != 1 else ''}" + (f" ({named})" if named else "")
    return [(f"parked until {what} end{'s' if count == 1 else ''} (no process holds it)", "blue")]


def _graph(rec: dict[str, Any]) -> list[Segment]:
    tasks = _dict(rec.get("tasks"))
    names = ", ".join(list(tasks)[:5]) + (", …" if len(tasks) > 5 else "")
    return [(f"task graph of {len(tasks)} task{'s' if len(tasks) != 1 else ''}: {names}", "cyan")]


def _charge(rec: dict[str, Any]) -> list[Segment]:
    amounts = _dict(rec.get("c"))
    spent = ", ".join(money(kind, value) for kind, value in amounts.items() if value) or "nothing"
    where = "inside this step" if "@" in str(rec.get("p", "")) else "between steps"
    return [(f"charged {spent}", "yellow"), (f"  ({where})", "bright_black")]


def _comp(rec: dict[str, Any]) -> list[Segment]:
    if rec.get("ok"):
        return [("compensated", "yellow")]
    return [(f"compensation failed: {error_text(rec.get('e'))}", "red")]


def _patch(rec: dict[str, Any]) -> list[Segment]:
    branch = "the new code" if rec.get("v") else "the old code"
    return [(f"ctx.patched({rec.get('id')!r}) takes {branch} for good", "cyan")]


def _adopt(rec: dict[str, Any]) -> list[Segment]:
    now = f"the step now called {rec['l']!r}" if rec.get("l") else "whatever step the code now calls"
    return [(f"adopted: {now} here is the recorded {rec.get('recorded')!r}", "cyan")]


def _advice(rec: dict[str, Any]) -> list[Segment]:
    adv = _dict(rec.get("a"))
    level = str(adv.get("level", "")).upper()
    return [(f"advisory [{level}] {adv.get('code')}", "yellow" if level == "WARN" else "blue"),
            (f": {adv.get('msg', '')}", "")]


def _note(rec: dict[str, Any]) -> list[Segment]:
    notes = _dict(rec.get("n"))
    return [("annotated ", "cyan"), (", ".join(f"{k}={short_json(v, 40)}" for k, v in notes.items()), "")]


def _reset(rec: dict[str, Any]) -> list[Segment]:
    paths = [record_path(p) for p in rec.get("paths") or []]
    shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    return [(f"retry from a step: {shown or 'no step'} run{'s' if len(paths) == 1 else ''} again", "yellow")]


def _budget(rec: dict[str, Any]) -> list[Segment]:
    budget = rec.get("b") if isinstance(rec.get("b"), dict) else None
    if not budget:
        return [("budget removed", "yellow")]
    return [("budget set to " + ", ".join(money(k, v) for k, v in budget.items()), "yellow")]


def _stale(rec: dict[str, Any]) -> list[Segment]:
    error = _dict(rec.get("error"))
    return [(f"stale: {error.get('message', 'the code no longer matches the log')}", "red")]


def _cancel(rec: dict[str, Any]) -> list[Segment]:
    until = f" until {when_text(rec['until'])}" if rec.get("until") else ""
    undo = "; compensations run before it ends" if rec.get("compensate") else ""
    return [(f"cancelled: the workflow cleans up{until}{undo}", "magenta")]


def _start(rec: dict[str, Any]) -> list[Segment]:
    """A step's start; an unsafe one's names its policy and the input it was sent."""
    out = [(f"attempt {rec.get('a', 1)} started", "cyan")]
    if rec.get("fx"):
        out.append((f" (replay={'manual' if rec.get('fx') == 'manual' else 'manual, on_interrupt=raise'}, "
                    f"input {short_json(rec.get('in'), 60)})", "bright_black"))
    return out


def _resolve(rec: dict[str, Any]) -> list[Segment]:
    """An operator's decision about a cut-off unsafe step."""
    decision = rec.get("d")
    if decision == "value":
        return [(f"resolved by an operator: attempt {rec.get('a', 1)} happened", "magenta"),
                (f"  → {short_json(rec.get('v'))}", "")]
    if decision == "rerun":
        return [(f"resolved by an operator: attempt {rec.get('a', 1)} runs again", "magenta")]
    error = _dict(rec.get("e"))
    return [(f"resolved by an operator: failed  {error.get('message', '')}", "magenta")]


def _end(rec: dict[str, Any]) -> list[Segment]:
    status = str(rec.get("status"))
    out = [(f"run {status}", COLOURS.get(status, "bold"))]
    if rec.get("error"):
        out.append((f"  {error_text(rec['error'])}", "red"))
    elif status == "completed":
        out.append((f"  → {short_json(rec.get('result'))}", ""))
    return out


LINES: dict[str, Callable[[dict[str, Any]], list[Segment]]] = {
    "run": _run,
    "claim": lambda rec: [(f"attempt {rec.get('epoch')} started by {owner_text(rec.get('owner'))}", "cyan")],
    "code": lambda rec: [(f"the workflow's code changed (fingerprint {rec.get('fingerprint')})", "yellow")],
    "budget": _budget,
    "reopen": lambda rec: [("run reopened: its failed and compensated steps run again", "yellow")],
    "reset": _reset,
    "pause": lambda rec: [("paused", "blue")],
    "resume": lambda rec: [("resumed", "blue")],
    "cancel": _cancel,
    "stale": _stale,
    "end": _end,
    "ok": _ok,
    "err": _failed,
    "fail": _failed,
    "start": _start,
    "resolve": _resolve,
    "stash": lambda rec: [("stashed ", "yellow"), (short_json(rec.get("v"), 60), "")],
    "wake": lambda rec: [(f"sleeping until {when_text(rec.get('at'))}", "blue")],
    "wait": _wait,
    "awk": _awake,
    "park": _park,
    "graph": _graph,
    "snap": lambda rec: [(f"loop snapshot after iteration {rec.get('i')}", "cyan"),
                         (f"  state {short_json(rec.get('s'), 60)}", "bright_black")],
    "charge": _charge,
    "comp": _comp,
    "patch": _patch,
    "adopt": _adopt,
    "adv": _advice,
    "note": _note,
}
"""How each record kind of `records.py` reads (one entry per kind, checked by the tests)."""


def record_segments(rec: dict[str, Any]) -> list[Segment]:
    """One log record as the segments of its line: time, the step it is about, what happened."""
    kind = str(kind_of(rec))
    out: list[Segment] = [(record_time(rec), "bright_black"), ("  ", "")]
    where = record_path(rec.get("p"))
    if where and kind != "patch":
        label = {"wake": "ctx.sleep", "wait": "ctx.wait_for", "snap": "ctx.loop", "graph": "ctx.graph",
                 "awk": "ctx.awakeable"}.get(kind) \
            or (rec.get("l") if isinstance(rec.get("l"), str) and kind != "adopt" else "")
        out.append((f"{where} {label}".rstrip() + "  ", "bold"))
    if kind == "signal":  # not a record: a signal waiting unread in the run's inbox (`durably logs` shows them)
        payload = f"  payload {short_json(rec.get('payload'), 60)}" if rec.get("payload") is not None else ""
        return [(record_time({"t": "claim", "at": rec.get("at")}), "bright_black"), ("  ", ""),
                (f"signal {rec.get('name')!r} sent, unread: it waits in the run's inbox", "yellow"),
                (payload, "bright_black")]
    describe = LINES.get(kind)
    if describe is not None:
        try:
            return out + describe(rec)
        except Exception:  # noqa: BLE001 - a record of an odd shape still shows, as its fields
            pass
    rest = {k: v for k, v in rec.items() if k not in ("t", "p", "l", "ts")}
    return out + [(kind, "yellow")] + ([(f"  {short_json(rest, 100)}", "bright_black")] if rest else [])


def record_text(rec: dict[str, Any]) -> str:
    """`record_segments` as plain text."""
    return "".join(text for text, _ in record_segments(rec))
