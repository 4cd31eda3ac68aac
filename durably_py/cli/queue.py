"""The durable queue's commands: `worker` (run due runs until stopped), `enqueue` (record pending runs) and
`schedules` (the cron schedules the code declares)."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import signal as signals
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from .. import _config as config
from .._authoring.workflow import REGISTRY
from .._config import parse_duration
from .._engine.code import CodeSource
from .._run_command import (
    EXIT_INTERRUPTED,
    check_input_given,
    find_workflow,
    import_script,
    open_engine,
    parse_input,
    script_environment,
)
from .._view.live import duration_text
from .._worker.worker import Worker
from ..errors import ValidationError
from .options import OPTIONS, Options, complete_workflow, shared
from .render import err_console, out_console, utc_text


def import_code(targets: list[str]) -> None:
    """Load the scripts (paths ending in .py) or modules (dotted names) whose workflows and schedules a
    command serves; a target that cannot be imported is a usage error."""
    import importlib

    for target in targets:
        if target.endswith(".py") or os.sep in target:
            path = Path(target)
            if not path.is_file():
                raise ValidationError(f"--import {target}: no such script",
                                      hint="Pass a script path (app/jobs.py) or a module name (app.jobs).")
            import_script(path)
            continue
        try:
            importlib.import_module(target)
        except ImportError as exc:
            raise ValidationError(f"--import {target}: {type(exc).__name__}: {exc}",
                                  hint="Pass a module importable from here (check PYTHONPATH) or a script path.") from None


@shared("dir", "storage", "as_json", "debug")
def schedules(
    imports: Annotated[list[str] | None, typer.Option(
        "--import", metavar="PATH_OR_MODULE", show_default=False,
        help="A script or module declaring schedules (durably_py.schedule); repeatable.")] = None,
    opts: Options = OPTIONS,
) -> None:
    """List the schedules the imported code declares: cron, workflow, last fired tick and next tick (UTC)."""
    from .._worker.schedules import states

    with opts.guard():
        import_code(imports or [])
        found = states(opts.engine())
        if opts.as_json:
            opts.print_json([{"name": s.name, "workflow": s.workflow, "cron": s.cron, "input": s.input,
                          "registered_at": s.registered_at, "last_tick": s.last_tick, "last_run": s.last_run,
                          "next_tick": s.next_tick} for s in found])
            return
        if not found:
            err_console().print(Text("no schedules declared (pass --import with the script or module that calls "
                                      "durably_py.schedule)", "yellow"))
            return
        from rich.table import Table

        table = Table(title_justify="left")
        for column in ("name", "cron (UTC)", "workflow", "last tick", "last run", "next tick"):
            table.add_column(column)
        for s in found:
            table.add_row(s.name, s.cron, s.workflow, utc_text(s.last_tick), s.last_run or "", utc_text(s.next_tick))
        out_console().print(table)


@shared("dir", "storage", "as_json", "debug")
def queues(
    imports: Annotated[list[str] | None, typer.Option(
        "--import", metavar="PATH_OR_MODULE", show_default=False,
        help="A script or module declaring queues (durably_py.queue), to show their limits; repeatable.")] = None,
    opts: Options = OPTIONS,
) -> None:
    """Show each named queue: its runs due now, due later, running and parked, the oldest wait, its partitions,
    and its limits (those the imported code declares) with what is in use of them."""
    with opts.guard():
        import_code(imports or [])
        found = asyncio.run(opts.engine().queues())
        if opts.as_json:
            opts.print_json([info.to_dict() for info in found])
            return
        if not found:
            err_console().print(Text("no queued runs and no declared queue (pass --import with the script or "
                                      "module that calls durably_py.queue to see its limits)", "yellow"))
            return
        from rich.table import Table

        table = Table(title_justify="left")
        for column in ("queue", "due", "later", "running", "parked", "oldest wait", "partitions", "limits"):
            table.add_column(column, justify="right" if column in ("due", "later", "running", "parked") else "left")
        for info in found:
            table.add_row(info.name, str(info.due), str(info.later), str(info.running), str(info.parked),
                          duration_text(info.oldest_wait) if info.oldest_wait is not None else "",
                          str(len(info.partitions)) if info.partitions else "", _limits_text(info))
        out_console().print(table)


def _limits_text(info: Any) -> str:
    """A queue's limits as `durably queues` prints them, with what is in use: `concurrency 3/20, ...`."""
    limits, used = info.limits, info.in_use
    parts = []
    if "concurrency" in limits:
        parts.append(f"concurrency {used.get('runs', 0)}/{limits['concurrency']}")
    if "per_worker" in limits:
        parts.append(f"{limits['per_worker']} per worker")
    if "rate_limit" in limits:
        rate = limits["rate_limit"]
        parts.append(f"rate {used.get('starts', 0)}/{rate['max']} per {rate['per']:g}s")
    if "partition_concurrency" in limits:
        parts.append(f"{limits['partition_concurrency']} per partition")
    return ", ".join(parts)


def _import_code(target: str) -> None:
    """Load a script (a path to a .py file) or import a module (dotted name) so its @workflows register."""
    path = Path(target)
    if target.endswith(".py") or path.is_file():
        if not path.is_file():
            raise ValidationError(f"--import {target}: no such script file",
                                  hint="Pass a path to a .py file or a dotted module name, e.g. --import jobs.py "
                                       "or --import myapp.workflows.", docs="docs/deploying.md")
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        import_script(path.resolve())
        return
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        importlib.import_module(target)
    except ImportError as exc:
        raise ValidationError(f"--import {target}: {type(exc).__name__}: {exc}",
                              hint="Pass a path to a .py file or a module importable from here (or on "
                                   "PYTHONPATH).", docs="docs/deploying.md") from None


@shared("dir", "storage", "debug")
def worker(
    concurrency: Annotated[int | None, typer.Option("--concurrency", "-c", metavar="N", show_default=False,
                                                    help="Runs (and child runs) at once in this worker "
                                                         "[default: 4, or $DURABLY_CONCURRENCY / config].")] = None,
    imports: Annotated[list[str] | None, typer.Option("--import", metavar="PATH_OR_MODULE",
                                                      help="A script or module whose @workflows this worker "
                                                           "serves (repeatable); runs of other workflows are left "
                                                           "for workers that serve them.")] = None,
    import_recorded: Annotated[bool | None, typer.Option(
        "--import-recorded/--no-import-recorded", show_default=False,
        help="Also run other workflows' runs by importing the module or script each recorded, if it lies "
             "under --code-root [default: off, or $DURABLY_IMPORT_RECORDED / config].")] = None,
    code_root: Annotated[str | None, typer.Option("--code-root", metavar="DIR", show_default=False,
                                                  help="Where --import-recorded may import from [default: the "
                                                       "folder holding .durably/, else the current one].")] = None,
    lease: Annotated[float | None, typer.Option("--lease", metavar="SECONDS", show_default=False,
                                                help="Lease of each run on SQLite and PostgreSQL (at least 2): "
                                                     "after a kill, another worker takes a run over within this "
                                                     "plus one poll [default: 30].")] = None,
    heartbeat: Annotated[float | None, typer.Option("--heartbeat", metavar="SECONDS", show_default=False,
                                                    help="How often held leases are renewed (at most half the "
                                                         "lease) [default: a third of the lease].")] = None,
    poll: Annotated[float | None, typer.Option("--poll", metavar="SECONDS", show_default=False,
                                               help="How often to look for due runs when idle [default: 0.2].")]
        = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing per run (only the start, the "
                                                              "stop and warnings).")] = False,
    retention: Annotated[str | None, typer.Option("--retention", metavar="DURATION",
                                                  help="Delete runs this long after they ended (30d, 12h), "
                                                       "checked every tenth of it, at most hourly.")] = None,
    queues: Annotated[list[str] | None, typer.Option("--queue", metavar="NAME",
                                                     help="Serve only the runs of this named queue (repeatable; "
                                                          "'default' is the queue of runs enqueued without one) "
                                                          "[default: every queue].")] = None,
    opts: Options = OPTIONS,
) -> None:
    """Run due runs of the imported workflows until stopped: claim, run, park, release, repeat. SIGTERM or
    Ctrl-C stops gracefully (no new claims or steps; running steps finish and are recorded; leases released;
    exit 0). The limits of the named queues the imported code declares (durably_py.queue) hold across every
    worker sharing the store."""
    with opts.guard():
        settings = opts.settings()
        for name, value, flag in (("concurrency", concurrency, "--concurrency"), ("lease", lease, "--lease"),
                                  ("heartbeat", heartbeat, "--heartbeat"), ("poll", poll, "--poll"),
                                  ("retention", None if retention is None else parse_duration(retention),
                                   "--retention"),
                                  ("import_recorded", import_recorded, "--import-recorded"),
                                  ("code_root", None if code_root is None else os.path.abspath(code_root),
                                   "--code-root")):
            config.override(settings, name, value, flag)
        config.check_engine(settings)
        if not imports and not settings.import_recorded:
            raise ValidationError("durably worker was given no code to serve",
                                  hint="Pass --import with the script or module that declares the workflows "
                                       "(repeatable), or --import-recorded to import the code each run recorded.",
                                  docs="docs/deploying.md#what-a-worker-serves")
        before = set(REGISTRY)
        for target in imports or []:
            _import_code(target)
        engine = open_engine(settings)
        engine.code = CodeSource(serves=frozenset(set(REGISTRY) - before) if imports else frozenset(),
                                 recorded=settings.import_recorded, root=settings.code_root or config.project_root(
                                     settings))

        def tell(message: str) -> None:
            sys.stderr.write(f"{time.strftime('%H:%M:%S')} {message}\n")
            sys.stderr.flush()

        def say(message: str) -> None:  # what happens to each run; --quiet keeps only the start, stop and warnings
            if not quiet:
                tell(message)

        engine.heartbeat.report = tell
        loop_worker = Worker(engine, concurrency=engine.concurrency,
                             poll=settings.poll if settings.poll is not None else 0.2, log=say, queues=queues)
        where = settings.storage or os.path.abspath(settings.dir or ".durably")
        served = ", ".join(sorted(engine.code.serves or ())) or "no imported workflow"
        if queues:
            served += f" on the queue{'s' if len(set(queues)) > 1 else ''} {', '.join(sorted(set(queues)))}"
        recorded = f"; recorded code under {engine.code.root}" if engine.code.recorded else ""
        tell(f"durably worker {engine.owner} on {where}: concurrency {loop_worker.concurrency}, lease "
            f"{engine.lease_ttl:g}s renewed every {engine.heartbeat_every:g}s, poll {loop_worker.poll:g}s, "
            f"serving {served}{recorded}")
        asyncio.run(_serve(loop_worker, tell))
        tell(f"durably worker stopped after {loop_worker.ran} run turns"
            + (f"; pruned {loop_worker.pruned} ended runs" if loop_worker.pruned else "")
            + (f"; {len(loop_worker.stopped)} stopped part-way and due again" if loop_worker.stopped else ""))
    raise typer.Exit(0)


async def _serve(loop_worker: Worker, say: Any) -> None:
    """Run the worker until SIGTERM/SIGINT; a second signal exits at once."""
    loop = asyncio.get_running_loop()
    asked = {"n": 0}

    def on_signal(name: str) -> None:
        asked["n"] += 1
        if asked["n"] > 1:
            say(f"{name} again: exiting now")
            os._exit(EXIT_INTERRUPTED)
        say(f"{name}: stopping (no new claims or steps; running steps finish)")
        loop_worker.request_stop()

    for sig in (signals.SIGTERM, signals.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal, sig.name)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - Windows
            signals.signal(sig, lambda *_: loop.call_soon_threadsafe(on_signal, "signal"))
    await loop_worker.run()


@shared("dir", "storage", "as_json", "debug")
def enqueue(
    script: Annotated[Path, typer.Argument(metavar="SCRIPT", help="The script defining the workflow.",
                                           show_default=False)],
    workflow: Annotated[str, typer.Option("--workflow", "-w", metavar="NAME", help="The workflow to enqueue.",
                                               autocompletion=complete_workflow)],
    input: Annotated[str | None, typer.Option("--input", "-i", metavar="JSON|@FILE",
                                              help="Workflow input: JSON text or @file.json.")] = None,
    key: Annotated[str | None, typer.Option("--key", metavar="KEY", help="Run key.")] = None,
    priority: Annotated[int, typer.Option("--priority", "-p", metavar="P",
                                          help="Higher runs first among due runs.")] = 0,
    delay: Annotated[str | None, typer.Option("--delay", metavar="SECONDS",
                                              help="Not due before this long from now: 30, 30s, 5m, 2h.")] = None,
    lines: Annotated[str | None, typer.Option("--from", metavar="FILE|-",
                                              help="Enqueue one run per line of a JSON-lines file (- reads "
                                                   "stdin): each line {\"input\": ..., \"key\": ...}, both "
                                                   "optional; written a batch at a time.")] = None,
    queue: Annotated[str | None, typer.Option("--queue", metavar="NAME",
                                              help="The named queue it waits on [default: its workflow's, "
                                                   "else 'default'].")] = None,
    partition: Annotated[str | None, typer.Option("--partition", metavar="NAME",
                                                  help="Its partition of the queue (a tenant, say): runs are "
                                                       "taken round-robin across partitions.")] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="A new run even when one with this input or key "
                                                        "exists.")] = False,
    debounce: Annotated[str | None, typer.Option("--debounce", metavar="SECONDS",
                                                 help="With --key: due once this long passes with no newer "
                                                      "enqueue of the key, which supersedes it until it "
                                                      "starts.")] = None,
    on_conflict: Annotated[str | None, typer.Option("--on-conflict", metavar="POLICY",
                                                    help="With --key, while a run with the key has not ended: "
                                                         "use_existing, fail or cancel_existing.")] = None,
    opts: Options = OPTIONS,
) -> None:
    """Record a pending run of one of SCRIPT's workflows and print its id; a worker runs it when due. With
    --from, one run per line of a JSON-lines file or stdin, in batches of one durable write each, printing
    their ids in order."""
    with opts.guard():
        settings = opts.settings()
        if not script.is_file():
            raise ValidationError(f"no script file {str(script)!r}",
                                  hint="Pass the path of a Python file, e.g. durably enqueue jobs.py -w nightly.")
        if lines is not None and (input is not None or key is not None):
            raise ValidationError("--from gives each run its input and key: it takes no --input or --key",
                                  hint='Put them in each line: {"input": {"n": 1}, "key": "job-1"}.',
                                  docs="docs/cli.md#durably-enqueue")
        if lines is not None and (fresh or debounce is not None or on_conflict is not None):
            raise ValidationError("--from takes no --fresh, --debounce or --on-conflict: they act on one run",
                                  hint="Enqueue such runs one at a time.", docs="docs/cli.md#durably-enqueue")
        seconds = parse_duration(delay) if delay is not None else 0.0
        quiet = parse_duration(debounce) if debounce is not None else None
        items = _enqueue_lines(lines) if lines is not None else None
        value = parse_input(input) if items is None else None
        script = script.resolve()
        with script_environment(script, settings, []):
            import_script(script)
            wf = find_workflow(workflow, script)
            engine = open_engine(settings)
            if items is None:
                check_input_given(wf, input is not None, script, "enqueue")
                handles = [asyncio.run(engine.enqueue(wf, value, key=key, priority=priority, delay=seconds,
                                                      queue=queue, partition=partition, fresh=fresh,
                                                      debounce=quiet, on_conflict=on_conflict))]
            else:
                handles = asyncio.run(engine.enqueue_many([(wf, item_input, item_key) for item_input, item_key
                                                           in items], priority=priority, delay=seconds,
                                                          queue=queue, partition=partition))
        if opts.as_json:
            opts.print_json({"run_id": handles[0].run_id} if items is None else
                        {"run_ids": [handle.run_id for handle in handles]})
        else:
            sys.stdout.write("".join(handle.run_id + "\n" for handle in handles))
            if sys.stderr.isatty():
                when = "now" if not seconds else f"in {duration_text(seconds)}"
                what = handles[0].run_id + " is" if len(handles) == 1 else f"{len(handles):,} runs are"
                err_console().print(Text(f"{what} pending (due {when}, priority {priority}): nothing runs "
                                          f"{'it' if len(handles) == 1 else 'them'} until a worker does: "
                                          f"`durably worker --import {script.name}`", "bright_black"))


def _enqueue_lines(source: str) -> list[tuple[Any, str | None]]:
    """(input, key) of each non-blank line of `source` (a path, or - for stdin), every line checked before
    anything is enqueued."""
    where = "stdin" if source == "-" else source
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValidationError(f"cannot read {where}: {exc}", hint="Pass a readable JSON-lines file, or - for stdin.",
                              docs="docs/cli.md#durably-enqueue") from None
    items: list[tuple[Any, str | None]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            item = exc
        if not isinstance(item, dict) or set(item) - {"input", "key"} or \
                not isinstance(item.get("key"), str | type(None)):
            raise ValidationError(f"line {number} of {where} is not {{\"input\": ..., \"key\": \"...\"}}: {line[:80]!r}",
                                  hint='Each line is a JSON object with an optional "input" and an optional '
                                       'string "key", e.g. {"input": {"n": 1}, "key": "job-1"}; nothing was '
                                       "enqueued.", docs="docs/cli.md#durably-enqueue")
        items.append((item.get("input"), item.get("key")))
    return items
