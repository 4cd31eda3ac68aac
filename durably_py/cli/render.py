"""How the command line shows runs: the consoles it prints on, the columns of `durably list`, the header and
step tree of `durably inspect`, and the record lines of `durably logs`."""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from .._docs import docs_location
from .._engine.runs import owner_text
from .._run_command import COLOURS, Output, json_default, local_time, parked_detail
from .._state.history import RunState, StepState
from .._view.live import duration_text, is_step, when_text
from .._view.logtext import money, record_segments, short_json

if TYPE_CHECKING:  # imported where used: `durably run` without a terminal needs none of them
    from rich.tree import Tree


def err_console() -> Console:
    """The console for messages: stderr, colour as the settings say."""
    return Console(file=sys.stderr, highlight=False, soft_wrap=True, no_color=not Output.color or None)


def out_console() -> Console:
    """The console for results: stdout, 200 columns wide when piped (unless $COLUMNS says otherwise)."""
    wide = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200
    return Console(file=sys.stdout, highlight=False, width=wide, no_color=not Output.color or None)


def preview(value: Any, limit: int = 100) -> str:
    """A value's repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def utc_text(value: datetime | None) -> str:
    """A time in UTC to the minute (schedules are cron in UTC)."""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC") if value else ""


def path_text(path: tuple[int, ...]) -> str:
    """A step path as Python writes the tuple: (2,) or (2, 0, 1)."""
    return "(" + ", ".join(map(str, path)) + ("," if len(path) == 1 else "") + ")"


def status_text(status: str) -> Text:
    """A status in its colour."""
    return Text(status, style=COLOURS.get(status, ""))


def filters_text(**filters: Any) -> str:
    """The filter flags a command was given, as the user would type them (`--status failed`)."""
    return " ".join(f"--{name.replace('_', '-')} {value}" for name, value in filters.items() if value is not None)


ListColumn = tuple[str, Callable[[RunState], Text | str], dict[str, Any]]


def status_cell(state: RunState) -> Text:
    """A run's status in `list`: `running (owner unresponsive since 10:02:13)` when the process holding it is gone."""
    if state.owner and state.owner.get("alive") is False:
        since = datetime.fromisoformat(state.owner["since"]) if state.owner.get("since") else None
        return Text(f"running (owner unresponsive since {since.astimezone():%H:%M:%S})" if since else
                    "running (owner unresponsive)", "yellow")
    return status_text(state.status)


def list_columns(width: int, states: list[RunState]) -> list[ListColumn]:
    """The columns of `durably list` that fit `width`: the run id always whole, then the most useful others."""
    id_width = max(len(s.run_id) for s in states)
    key_width = min(max((len(s.key or "") for s in states), default=0), 24)
    columns: dict[str, ListColumn] = {
        "run id": ("run id", lambda s: s.run_id, {"no_wrap": True, "min_width": id_width}),
        "workflow": ("workflow", lambda s: s.workflow, {"overflow": "fold"}),
        "key": ("key", lambda s: s.key or "", {"overflow": "fold"}),
        "status": ("status", status_cell, {"no_wrap": True}),
        "attempt": ("attempt", lambda s: str(s.attempt or "-"), {"justify": "right", "no_wrap": True}),
        "created": ("created", lambda s: local_time(s.created_at), {"no_wrap": True}),
        "updated": ("updated", lambda s: local_time(s.updated_at or s.created_at), {"no_wrap": True}),
    }
    def widest(name: str, cells: list[str], cap: int = 24) -> int:
        return min(max([len(name), *map(len, cells)]), cap)

    widths = {"run id": id_width, "status": widest("status", [status_cell(s).plain for s in states], 48), "updated": 19,
              "key": widest("key", [s.key or "" for s in states]),
              "workflow": widest("workflow", [s.workflow for s in states]), "attempt": 7, "created": 19}
    if not key_width:
        del widths["key"]
    chosen: set[str] = set()
    used = 0
    for name, need in widths.items():
        need += 2 if chosen else 0
        if not chosen or used + need <= width:
            chosen.add(name)
            used += need
    return [column for name, column in columns.items() if name in chosen]


def json_text(value: Any, limit: int = 100) -> str:
    """A value as compact JSON (what `--input` and `signal` accept), cut to `limit` characters."""
    return short_json(value, limit, json_default)


@dataclass
class StepExtras:
    """What the timeline adds to a step in `inspect`: each failed attempt, and a sleep's or wait's real length."""

    failures: list[str] = field(default_factory=list)
    seconds: float | None = None


def step_extras(spans: list[Any]) -> dict[tuple[int, ...], StepExtras]:
    """Failed attempts (with their errors) and sleep/wait durations per step path, from `Engine.timeline`."""
    out: dict[tuple[int, ...], StepExtras] = {}
    for span in spans:
        if span.kind == "attempt" and span.status == "failed":
            took = f" after {duration_text(span.end - span.start)}" if span.end is not None else ""
            out.setdefault(span.path, StepExtras()).failures.append(
                f"attempt {span.attempt} failed{took}: {span.detail or 'error'}")
        elif span.kind in ("sleep", "wait"):  # the latest one (a retry from a step may have run it again)
            out.setdefault(span.path, StepExtras()).seconds = None if span.end is None else span.end - span.start
    return out


def step_line(step: StepState, extras: StepExtras | None = None) -> Text:
    """One step of the tree in `inspect`: path, label, status, attempts, time, and what it returned or waits for."""
    line = Text.assemble((path_text(step.path), "bright_black"), " ", (step.label, "bold"), "  ", status_text(step.status))
    if step.attempts != 1:
        line.append(f"  {step.attempts} attempts", "yellow" if step.attempts > 1 else "")
    if extras is not None and extras.seconds is not None:
        line.append(f"  {duration_text(extras.seconds)}", "bright_black")
    elif step.ms is not None:
        line.append(f"  {duration_text(step.ms / 1000)}", "bright_black")
    if step.status == "waiting" and isinstance(step.output, dict) and "children" in step.output:
        count = step.output.get("count") or len(step.output["children"])
        named = ", ".join(step.output["children"][:3]) + (", ..." if count > 3 else "")
        line.append(f"  → waiting for {count} child run{'s' if count != 1 else ''} to end ({named})", "blue")
    elif step.status == "waiting" and isinstance(step.output, dict) and "awakeable" in step.output:
        deadline = step.output.get("deadline")
        until = f" until {when_text(deadline)}" if deadline else " (no deadline)"
        line.append(f"  → waiting for awakeable {step.output['awakeable']}{until}", "blue")
    elif step.status == "waiting" and isinstance(step.output, dict):
        deadline = step.output.get("deadline")
        until = f" until {when_text(deadline)}" if deadline else " (no deadline)"
        line.append(f"  → waiting for signal {step.output.get('signal')!r}{until}", "blue")
    elif step.status == "running" and step.started_at is not None:
        line.append(f"  running for {duration_text(max(time.time() - step.started_at.timestamp(), 0))}", "cyan")
    elif step.status == "sleeping" and isinstance(step.output, dict):
        line.append(f"  → sleeping until {when_text(step.output.get('until'))}", "blue")
    elif step.error:
        line.append(f"  → {step.preview()}", "red")
    elif step.status in ("ok", "compensated") and not (step.label == "ctx.sleep" and step.output is None):
        line.append(f"  → {json_text(step.output)}")
    if step.stashed is not None:
        line.append(f"  stashed: {json_text(step.stashed, 60)}", "yellow")
    if step.compensation == "failed":
        line.append("  compensation failed", "red")
    return line


def step_tree(steps: list[StepState], title: str = "steps",
              extras: dict[tuple[int, ...], StepExtras] | None = None) -> Tree:
    """The steps as a tree: branches of a fan-out nest under the position of their `ctx.parallel`."""
    from rich.tree import Tree

    root = Tree(Text(title, "bold"))
    nodes: dict[tuple[int, ...], Tree] = {(): root}
    loops = {step.path for step in steps if step.label == "ctx.loop"}
    per_branch: dict[tuple[int, ...], int] = {}
    for step in steps:
        for end in range(2, len(step.path), 2):
            per_branch[step.path[:end]] = per_branch.get(step.path[:end], 0) + 1

    def node(prefix: tuple[int, ...]) -> Tree:
        found = nodes.get(prefix)
        if found is not None:
            return found
        if len(prefix) % 2 == 0 and per_branch.get(prefix, 0) <= 1:
            return node(prefix[:-1])
        parent = node(prefix[:-1])
        if len(prefix) % 2:
            label = Text.assemble((path_text(prefix), "bright_black"), " ", ("parallel", "bold"))
        else:
            label = Text(f"{'iteration' if prefix[:-1] in loops else 'branch'} {prefix[-1]}", "bright_black")
        made = nodes[prefix] = parent.add(label)
        return made

    for step in sorted(steps, key=lambda s: s.path):
        more = (extras or {}).get(step.path)
        existing = nodes.get(step.path)
        if existing is not None:
            existing.label = step_line(step, more)
        else:
            existing = nodes[step.path] = node(step.path[:-1]).add(step_line(step, more))
        for failure in more.failures if more is not None else ():
            existing.add(Text(failure, "red"))
    return root


def steps_title(steps: list[StepState]) -> str:
    """`steps (3 · 1 running) · ctx calls (2 · 1 waiting)`: the steps that ended, counted as the end-of-run
    summary counts them (`ctx.step` calls), and apart from them the sleeps, waits, spawns, joins and loops."""
    def counted(chosen: list[StepState]) -> str:
        ended = sum(s.status in ("ok", "failed") for s in chosen)
        still = Counter(s.status for s in chosen if s.status not in ("ok", "failed"))
        return f"{ended}" + "".join(f" · {n} {status}" for status, n in still.items())

    own = [s for s in steps if is_step(s.label)]
    calls = [s for s in steps if not is_step(s.label)]
    return f"steps ({counted(own)})" + (f" · ctx calls ({counted(calls)})" if calls else "")


def next_move(state: RunState) -> str | None:
    """The command that moves a run on from where it stands (None for a finished or running run)."""
    run_id = state.run_id
    if state.ready:
        return f"durably retry {run_id} continues it now, or the next worker does ({state.ready})"
    if state.status == "pending":
        code = f" --import {state.script}" if state.script else ""
        return (f"a worker: nothing runs it until `durably worker{code}` (or `durably retry {run_id}`) claims it; "
                "none has yet")
    if state.status == "waiting":
        awaiting = [s.output["awakeable"] for s in state.steps if s.status == "waiting"
                    and isinstance(s.output, dict) and "awakeable" in s.output]
        if awaiting:
            return " or ".join(f"durably resolve-awakeable {a} JSON" for a in awaiting)
        names = [s.output.get("signal") for s in state.steps if s.status == "waiting" and isinstance(s.output, dict)
                 and "signal" in s.output]
        if not names and any(s.label == "ctx.join" for s in state.steps if s.status == "waiting"):
            return "nothing: a worker continues it once its child runs end"
        return " or ".join(f"durably signal {run_id} {name} PAYLOAD" for name in names or ["NAME"])
    if state.status == "sleeping":
        return f"durably retry {run_id} continues it after its wake time (a waiting process does it by itself)"
    if state.status == "paused":
        return f"durably resume {run_id}"
    if state.status == "interrupted":
        done = [s for s in state.steps if s.status in ("ok", "failed")]
        inside = [s for s in state.steps if s.status == "interrupted"]
        after = f" (cut off in {', '.join(f'{path_text(s.path)} {s.label}' for s in inside)})" if inside else \
            f" (cut off after {path_text(done[-1].path)} {done[-1].label})" if done else " (cut off before its first step)"
        return f"durably retry {run_id} resumes it{after}"
    if state.status == "failed":
        return f"durably retry {run_id} resumes it at the failed step"
    if state.status == "needs_attention" and state.attention:
        where = ".".join(map(str, state.attention[0]["path"]))
        return (f"check whether the effect happened, then durably resolve {run_id} --path {where} with --value JSON "
                "(its result), --rerun or --fail")
    if state.status == "over_budget":
        over = state.over_budget or {}
        return (f"durably budget {over.get('owner') or run_id} --raise {over.get('kind') or 'usd'}=N lets it go on; "
                f"durably budget {over.get('owner') or run_id} --cancel gives up")
    if state.status == "stale" and state.stale and state.stale.get("patch") is None and state.stale.get("called"):
        return (f"durably adopt {run_id} if {state.stale['called']!r} is {state.stale['recorded']!r} renamed; "
                f"else restore the old code, or durably restart {run_id}")
    if state.status == "stale":
        return f"deploy code that matches the log again, then durably retry {run_id}; or durably restart {run_id}"
    return None


def owner_line(owner: dict[str, Any]) -> Text:
    """Who holds a running run: `pid 4242 on build-7`, and when that process no longer runs, since when and how
    long its lease still keeps the run from any other process."""
    text = Text(owner_text(owner.get("owner")))
    if owner.get("alive") is False:
        expires = owner.get("expires")
        left = f"; its lease lapses in {duration_text(max(expires - time.time(), 0))}, then any process may continue " \
               "the run" if expires else ""
        text.append(f"  not responding since {when_text(owner.get('since'))}{left}", "yellow")
    return text


def stale_text(stale: dict[str, Any]) -> str:
    """Where a stale run's replay stopped, in one line."""
    path = path_text(tuple(stale.get("path") or ()))
    if stale.get("patch") is not None:
        return f"at {path}: on the old branch of patch {stale['patch']!r}, which the code retired"
    if stale.get("called") is None:
        return f"at {path}: {stale.get('message')}"
    return f"at {path}: recorded as {stale.get('recorded')!r}, now called {stale.get('called')!r}"


def attention_text(effect: dict[str, Any]) -> Text:
    """A cut-off unsafe step that needs an operator's decision: its path and label, then its operation id, the
    input it was sent and when it started, one per line."""
    text = Text(f"{path_text(tuple(effect.get('path') or ()))} {effect.get('label')} was cut off (attempt "
                f"{effect.get('attempt')}); did its effect happen?", "magenta")
    text.append(f"\noperation id  {effect.get('operation_id')}")
    text.append(f"\ninput         {json_text(effect.get('input'), 200)}")
    text.append(f"\nstarted       {when_text(effect.get('started_at'))}")
    return text


def run_header(state: RunState) -> Text:
    """The header of `inspect`: one aligned row per fact about the run, its next move last."""
    rows: list[tuple[str, Text | str]] = [("run", Text(state.run_id, "bold")), ("workflow", state.workflow),
                                          ("status", status_text(state.status))]
    if state.key is not None:
        rows.append(("key", state.key))
    if state.input is not None:
        rows.append(("input", json_text(state.input, 200)))
    rows += [("created", local_time(state.created_at)), ("updated", local_time(state.updated_at)),
             ("attempt", str(state.attempt))]
    if state.script:
        rows.append(("script", state.script))
    if state.parent:
        rows.append(("parent", state.parent))
    if state.children:
        rows.append(("children", "\n".join(state.children)))
    if state.forked_from:
        origin = state.forked_from
        step = ".".join(map(str, origin.get("path") or []))
        rows.append(("forked from", f"{origin.get('run')} at step {step} ({origin.get('label')}"
                                    f"{', output set' if origin.get('edited') else ''})"))
    if state.forks:
        rows.append(("forks", "\n".join(state.forks)))
    spent = {k: v for k, v in state.spent.items() if v}
    if state.budget:
        rows.append(("budget", ", ".join(f"{money(k, state.spent.get(k, 0.0))} of {money(k, limit)}"
                                         for k, limit in state.budget.items())))
    elif spent:
        rows.append(("spent", ", ".join(money(k, v) for k, v in spent.items())))
    if len(state.spent_by) > 1 or state.over_budget:
        rows.append(("spent on", "\n".join(f"{label}: {', '.join(money(k, v) for k, v in kinds.items())}"
                                           for label, kinds in state.spent_by.items())))
    if state.over_budget and state.over_budget.get("owner") not in (None, state.run_id):
        rows.append(("budget of", str(state.over_budget["owner"])))
    for name, value in state.annotations.items():
        rows.append((f"· {name}", preview(value, 200)))
    if state.patches:
        rows.append(("patches", ", ".join(f"{change}: {'the new code' if new else 'the old code'}"
                                          for change, new in state.patches.items())))
    for adv in state.advisories:
        level = str(adv.get("level", "")).upper()
        text = Text.assemble((f"[{level}] {adv.get('code')}", "yellow" if level == "WARN" else "blue"),
                             f": {adv.get('msg', '')}")
        count = adv.get("count") or 1
        if count > 1:
            text.append(f" (×{count})", "bright_black")
        if adv.get("hint"):
            text.append(f"\nhint: {adv['hint']}", "bright_black")
        if adv.get("docs"):
            text.append(f"\ndocs: {docs_location(str(adv['docs']))}", "bright_black")
        rows.append(("advisory", text))
    if state.error:
        rows.append(("error", Text(f"{str(state.error.get('type', '')).rpartition(':')[2]}: "
                                   f"{state.error.get('message', '')}", "red")))
    elif state.status == "completed":
        rows.append(("result", json_text(state.result, 200)))
    detail = parked_detail(state)
    if detail is not None:
        rows.append(("parked", Text(detail, "blue")))
    if state.queued is not None:
        due = state.queued.get("due")
        queue, partition = state.queued.get("queue"), state.queued.get("partition")
        rows.append(("queued", f"due {when_text(due) if due is not None else 'when woken'} · priority "
                               f"{state.queued.get('priority', 0)}"
                               + (f" · queue {queue}" if queue and queue != "default" else "")
                               + (f" (partition {partition})" if partition else "")))
    if state.owner:
        rows.append(("owner", owner_line(state.owner)))
    for sig in state.signals:
        rows.append(("signal", Text(f"{sig['name']!r} unread since {when_text(sig.get('at'))}"
                                    + (f"  payload {json_text(sig.get('payload'), 60)}" if sig.get("payload")
                                       is not None else ""), "yellow")))
    if state.stale:
        rows.append(("stale", Text(stale_text(state.stale), "red")))
    for effect in state.attention:
        rows.append(("attention", attention_text(effect)))
    move = next_move(state)
    if move:
        rows.append(("next", Text(move, "bright_black")))
    for warning in state.warnings:
        rows.append(("warning", Text(warning, "yellow")))
    width = max(len(name) for name, _ in rows) + 2
    out = Text()
    for name, value in rows:
        value = value if isinstance(value, Text) else Text(value)
        for i, line in enumerate(value.split("\n")):
            out.append((name if i == 0 else "").ljust(width), "bold")
            out.append_text(line)
            out.append("\n")
    out.rstrip()
    return out


def record_line(rec: dict[str, Any]) -> Text:
    """One log record as a line of `durably logs`: its time, the step it is about, and what happened."""
    return Text.assemble(*record_segments(rec))
