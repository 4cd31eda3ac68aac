"""`durably run`'s work without the command-line parser: run a script (or one of its workflows) under a
watcher of its step events, then print what happened; shared by the `durably` commands that run workflows.

Kept free of typer and of rich at import: `durably run SCRIPT` without options is answered by this module
alone (see `durably_py._launcher`), and on a stderr that is not a terminal its lines are written as plain text,
so a one-step script starts about as fast as `python script.py`. rich is imported only to draw the live view
and to style lines on a terminal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import runpy
import signal as signals
import sys
import sysconfig
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from . import _config as config
from ._authoring.workflow import REGISTRY, Workflow, load_script
from ._docs import docs_location
from ._engine.engine import Engine, engine_for, set_run_hook
from ._view.live import LiveTerminal, Watcher, parked_detail
from ._view.live import duration_text as _duration
from .errors import (
    DurablyError,
    KeyConflictError,
    NotSupportedError,
    RunNotFoundError,
    RunParkedError,
    ValidationError,
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PARKED = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143

COLOURS = {
    "ok": "green", "completed": "green", "replayed": "green", "failed": "red", "retrying": "yellow",
    "running": "cyan", "interrupted": "magenta", "cancelled": "bright_black", "waiting": "blue",
    "sleeping": "blue", "paused": "blue", "corrupt": "red", "pending": "bright_black", "stale": "red",
    "needs_attention": "magenta", "over_budget": "yellow",
    "compensated": "yellow",
}
USAGE_ERRORS = (ValidationError, RunNotFoundError, KeyConflictError, NotSupportedError)


class Output:
    """Process-wide output state of the command line: colour (from the settings) and whether SIGTERM came."""

    color = True
    terminated = False


# ---- where the state is ---------------------------------------------------------------------------


def settings_for(dir: str | None, storage: str | None, restate: str | None = None,
                 restate_admin: str | None = None) -> config.Settings:
    """The effective settings of a command: its `--dir`/`--storage`/`--restate` flags, then env, config, discovery."""
    found = config.resolve(dir, storage, restate=restate, restate_admin=restate_admin)
    Output.color = found.color
    return found


def open_engine(settings: config.Settings) -> Engine:
    """The engine over the state dir or storage URL the settings name (one per location per process), with the
    lease, heartbeat, concurrency and retention they set."""
    engine = engine_for(settings.dir, settings.storage)
    engine.configure(lease=settings.lease, heartbeat=settings.heartbeat, concurrency=settings.concurrency,
                     retention=settings.retention)
    engine.gates.resources.update(settings.resources)  # the config's resources (an operator's) win over the code's
    return engine


def interrupted_exit() -> int:
    """The exit code and message after Ctrl-C or SIGTERM stopped a run."""
    how = "stopped by SIGTERM" if Output.terminated else "interrupted"
    err_print([(f"{how}; run the same command again to resume where it stopped", "yellow")])
    return EXIT_TERMINATED if Output.terminated else EXIT_INTERRUPTED


def on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM stops a command the way Ctrl-C does (same clean-up), then exits 143."""
    Output.terminated = True
    signals.raise_signal(signals.SIGINT)


# ---- output ----------------------------------------------------------------------------------------

Segment = str | tuple[str, str]  # text, or (text, rich style)
Line = list[Segment]
_CONTROL = {7: None, 8: None, 11: None, 12: None, 13: None}  # what rich strips from printed text


def _plain(stream: Any) -> bool:
    """Whether rich would print to `stream` without any styling (not a terminal, nothing forcing one)."""
    if "TTY_COMPATIBLE" in os.environ or os.environ.get("FORCE_COLOR") is not None:
        return False
    try:
        return not stream.isatty()
    except (AttributeError, ValueError):
        return True


def err_print(*lines: Line) -> None:
    """Print lines of styled segments on stderr: through rich on a terminal, else as the same plain text
    rich would write (control characters dropped, tabs expanded), without importing rich."""
    if _plain(sys.stderr):
        sys.stderr.write("".join("".join(s if isinstance(s, str) else s[0] for s in line)
                                 .translate(_CONTROL).expandtabs(8) + "\n" for line in lines))
        sys.stderr.flush()
        return
    from rich.console import Console
    from rich.text import Text

    console = Console(file=sys.stderr, highlight=False, soft_wrap=True, no_color=not Output.color or None)
    for line in lines:
        console.print(Text.assemble(*line))


def json_default(value: Any) -> Any:
    """How a CLI result that is not JSON prints: times as ISO text, sets and tuples as lists, typed values as
    their stored form, anything else as its repr."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    from ._authoring.schema import to_builtins

    try:  # a typed result (dataclass, Struct, pydantic model...) prints as the JSON it is stored as
        return to_builtins(value)
    except Exception:  # noqa: BLE001 - anything else prints as its repr
        return repr(value)


def to_json(value: Any) -> str:
    """JSON text of a CLI result (datetimes as ISO strings)."""
    return json.dumps(value, indent=2, ensure_ascii=False, default=json_default)


def print_json(value: Any, jsonl: bool = False) -> None:
    """Print a JSON value on stdout: indented, or on one line (`jsonl`)."""
    if jsonl:
        sys.stdout.write(json.dumps(value, ensure_ascii=False, default=json_default) + "\n")
    else:
        sys.stdout.write(to_json(value) + "\n")
    sys.stdout.flush()


def local_time(value: datetime | None) -> str:
    """A time as the tables show it: local, to the second."""
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S") if value else ""


def exit_code(exc: BaseException, started: bool) -> int:
    """The exit code for an error: usage errors before any step ran are 2, parked runs 3, the rest 1."""
    if isinstance(exc, RunParkedError):
        return EXIT_PARKED
    if isinstance(exc, USAGE_ERRORS) and not started:
        return EXIT_USAGE
    return EXIT_FAILED


def report_durably_error(exc: DurablyError, debug: bool) -> None:
    """A durably error on stderr: its message, hint and docs location (and with `debug`, its traceback)."""
    lines: list[Line] = []
    if debug:
        lines.append([("".join(traceback.format_exception(exc)).rstrip(), "bright_black")])
    lines.append([(exc.describe().replace(f"docs: {exc.docs}", f"docs: {docs_location(exc.docs)}"), "red")])
    for note in getattr(exc, "__notes__", None) or []:
        if debug or not note.startswith("recorded traceback:"):
            lines.append([(f"  note: {note}", "red")])
    err_print(*lines)


# ---- user frames of a traceback ------------------------------------------------------------------

_PACKAGE_DIR = str(Path(__file__).resolve().parent)
_LIBRARY_DIRS = tuple({str(Path(p).resolve()) for key in ("stdlib", "platstdlib", "purelib", "platlib")
                       if (p := sysconfig.get_paths().get(key))})


def _is_user_file(filename: str) -> bool:
    if filename.startswith("<"):
        return False
    try:
        resolved = str(Path(filename).resolve())
    except OSError:
        return False
    if resolved.startswith(_PACKAGE_DIR):
        return False
    return not any(resolved.startswith(d + os.sep) for d in _LIBRARY_DIRS)


def user_frame(exc: BaseException) -> tuple[str, int, str, str] | None:
    """The last traceback frame of user code (file, line, function, source) that raised `exc`."""
    frames = [(f.filename, f.lineno or 0, f.name, f.line or "")
              for f in traceback.extract_tb(exc.__traceback__) if _is_user_file(f.filename)]
    if frames:
        return frames[-1]
    recorded = getattr(exc, "remote_traceback", None)
    if isinstance(recorded, str):
        found = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n(?: {4}(.*)\n)?', recorded)
        found = [(f, int(n), fn, src.strip()) for f, n, fn, src in found if _is_user_file(f)]
        if found:
            return found[-1]
    return None


def report_exception(exc: BaseException, debug: bool, source: str = "durably") -> None:
    """Any other error on stderr in one red line naming `source`, with the user's frame that raised it."""
    lines: list[Line] = []
    if debug:
        lines.append([("".join(traceback.format_exception(exc)).rstrip(), "bright_black")])
    lines.append([(f"{source} raised {type(exc).__name__}: {exc}", "red")])
    frame = user_frame(exc)
    if frame is not None:
        filename, line, func, source = frame
        lines.append([(f"  at {filename}:{line} in {func}", "red")])
        if source:
            lines.append([(f"      {source}", "bright_black")])
    for note in getattr(exc, "__notes__", None) or []:
        if not note.startswith("recorded traceback:"):
            lines.append([(f"  note: {note}", "red")])
    if not debug:
        lines.append([("  (--debug shows the full traceback)", "bright_black")])
    err_print(*lines)


# ---- watching runs -----------------------------------------------------------------------------


def settle(watcher: Watcher, engine: Engine | None) -> None:
    """Read back the final status of every run the watcher saw (and what a parked one waits for)."""
    for tally in watcher.runs.values():
        try:
            if engine is None:
                raise LookupError
            state = asyncio.run(engine.inspect(tally.run_id))
        except Exception:  # noqa: BLE001 - a run recorded elsewhere (another dir=) keeps status None
            tally.status = tally.detail = None
            continue
        tally.status = state.status
        tally.detail = parked_detail(state)


def print_summary(watcher: Watcher, code: int, as_json: bool) -> None:
    """The end-of-command summary on stderr: one line per run the watcher saw (JSON with `as_json`)."""
    if as_json:
        sys.stderr.write(json.dumps({"runs": [t.to_dict() for t in watcher.runs.values()],
                                     "elapsed": round(watcher.elapsed, 3), "exit_code": code}) + "\n")
        return
    if not watcher.runs:
        err_print([(f"durably: no durable run started ({_duration(watcher.elapsed)})", "bright_black")])
        return
    lines: list[Line] = []
    for t in watcher.runs.values():
        mark, style = {"completed": ("✓", "green"), "failed": ("✗", "red")}.get(t.status or "", ("•", "yellow"))
        steps = t.steps
        status = t.status or "unknown"
        line: Line = [(mark, style), " ", (t.run_id, "bold"), "  ", (status, COLOURS.get(status, "")),
                      f"  {steps} step{'s' * (steps != 1)}: {t.ran} ran · {t.replayed} replayed"]
        if t.failed:
            line.append((f" · {t.failed} failed", "red"))
        if t.retries:
            line.append((f" · {t.retries} retr{'ies' if t.retries != 1 else 'y'}", "yellow"))
        lines.append(line)
        if t.detail:
            lines.append([(f"  {t.detail}", "blue")])
        if t.status not in ("completed", None):
            lines.append([(f"  see: durably inspect {t.run_id}", "bright_black")])
    lines.append([(f"done in {_duration(watcher.elapsed)}", "bright_black")])
    err_print(*lines)


def outcome(watcher: Watcher, run_id: str | None, code: int, result: Any, error: BaseException | None) -> dict[str, Any]:
    """The one JSON object `run --workflow`, `retry` and `restart` print with `--json`."""
    tally = watcher.runs.get(run_id) if run_id is not None else None
    failure = None
    if error is not None:
        failure = {"type": type(error).__name__, "message": getattr(error, "message", None) or str(error)}
    return {"run_id": run_id, "status": tally.status if tally else None, "detail": tally.detail if tally else None,
            "result": result if code == EXIT_OK else None, "error": failure, "exit_code": code,
            "elapsed": round(watcher.elapsed, 3), "runs": [t.to_dict() for t in watcher.runs.values()]}


@contextmanager
def live_view(watcher: Watcher, enabled: bool) -> Iterator[None]:
    """Show the live view on stderr while the body runs; what the body prints goes above it (stdout too, when it
    is the terminal). See `durably_py._view.live`."""
    if not enabled:
        yield
        return
    terminal = LiveTerminal(watcher, color=Output.color)
    terminal.start()
    try:
        yield
    finally:
        terminal.stop()


@contextmanager
def script_environment(script: Path, settings: config.Settings, argv: list[str]) -> Iterator[None]:
    """Set DURABLY_SCRIPT, DURABLY_DIR (or DURABLY_STORAGE), sys.argv and sys.path as the script should see them."""
    saved_env = {k: os.environ.get(k) for k in ("DURABLY_SCRIPT", "DURABLY_DIR", "DURABLY_STORAGE")}
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    os.environ["DURABLY_SCRIPT"] = str(script)
    if settings.storage is not None:
        os.environ["DURABLY_STORAGE"] = settings.storage
    elif settings.dir is not None:
        os.environ["DURABLY_DIR"] = os.path.abspath(settings.dir)
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(script.parent))
    try:
        yield
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        sys.argv, sys.path[:] = saved_argv, saved_path


def parse_input(text: str | None, option: str = "--input") -> Any:
    """A JSON value given as text or as @file (`option` names the flag in errors); None when not given."""
    if text is None:
        return None
    source = option
    if text.startswith("@"):
        source = text[1:]
        try:
            text = Path(source).read_text()
        except OSError as exc:
            raise ValidationError(f"cannot read {option} file {source!r}: {exc.strerror or exc}",
                                  hint=f"Pass {option} as @path/to/file.json with a file that exists.") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValidationError(f"{source} is not valid JSON: {exc}",
                              hint=f"Pass JSON, e.g. {option} '{{\"n\": 3}}', or {option} @file.json (strings "
                                   "need quotes: '\"yes\"').") from None
    except RecursionError:
        raise ValidationError(f"{source} is JSON nested too deeply to record",
                              hint="Flatten the structure; values nested hundreds of levels deep are not supported."
                              ) from None
    except ValueError as exc:  # e.g. an integer beyond Python's 4300-digit conversion limit
        raise ValidationError(f"{source} cannot be read: {exc}",
                              hint="Pass a big number as a JSON string and convert it in the workflow.") from None


def find_workflow(name: str, script: Path) -> Workflow:
    """The workflow `name` of the imported `script`; a usage error listing the ones it defines."""
    wf = REGISTRY.get(name)
    if wf is not None:
        return wf
    known = ", ".join(sorted(REGISTRY)) or "none"
    raise ValidationError(f"{script.name} defines no workflow named {name!r} (it defines: {known})",
                          hint="Pass --workflow with the name @workflow gave it (the function's name by default).")


def check_input_given(wf: Workflow, given: bool, script: Path, command: str = "run") -> None:
    """A usage error, before any run is created, for a workflow whose input parameter has no default when
    no `--input` was given (it would only fail on its first use of the input)."""
    if given or not wf.takes_input:
        return
    import inspect

    params = [p for p in inspect.signature(wf.fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    param = params[1]
    if param.default is not param.empty:
        return
    raise ValidationError(f"workflow {wf.name!r} takes an input ({param.name}) and no --input was given",
                          hint=f"Pass it as JSON: durably {command} {script.name} -w {wf.name} --input '{{...}}' (or "
                               f"--input @file.json); a workflow that may run without one gives it a default: "
                               f"async def {wf.__name__}(ctx, {param.name}=None).",
                          docs="docs/cli.md#durably-run")


def import_script(script: Path) -> None:
    """Import the script for `--workflow`; a script that cannot be imported is reported as such."""
    try:
        load_script(script)
    except SyntaxError as exc:
        where = f"{exc.filename}:{exc.lineno}" if exc.filename else str(script)
        raise ValidationError(f"cannot import {script.name}: SyntaxError: {exc.msg} at {where}",
                              hint="Fix the syntax error; `python -m py_compile SCRIPT` shows it too.",
                              docs="docs/cli.md#durably-run") from None
    except ImportError as exc:
        raise ValidationError(f"cannot import {script.name}: {type(exc).__name__}: {exc}",
                              hint="Install the missing module in this environment, or fix the import.",
                              docs="docs/cli.md#durably-run") from None


def run_script(script: Path, args: list[str], settings: config.Settings, *, workflow: str | None = None,
               input: str | None = None, key: str | None = None, fresh: bool = False, no_wait: bool = False,
               as_json: bool = False, jsonl: bool = False, debug: bool = False) -> int:
    """Run `script` as __main__ (or its `workflow`) with the live view when stderr is a terminal, print the
    result and the summary, and return the exit code. `script` is resolved and checked by the caller."""
    engine: Engine | None = None
    if settings.storage is None and settings.dir is not None:
        with contextlib.suppress(OSError):  # a state dir that cannot be made is reported by the run itself
            config.ignore_in_git(Path(settings.dir))
    with contextlib.suppress(DurablyError):
        engine = open_engine(settings)
    watcher = Watcher(engine)
    live = not as_json and sys.stderr.isatty()
    main_run: list[str] = []
    watcher.say = lambda line: err_print([(line, "cyan")])
    set_run_hook(watcher)
    code = EXIT_OK
    result: Any = None
    error: BaseException | None = None
    try:
        with script_environment(script, settings, args):
            try:
                with live_view(watcher, live):
                    if workflow is None:
                        runpy.run_path(str(script), run_name="__main__")
                    else:
                        value = parse_input(input)
                        import_script(script)
                        wf = find_workflow(workflow, script)
                        check_input_given(wf, input is not None, script)
                        result = asyncio.run(open_engine(settings).run(wf, value, key=key, fresh=fresh,
                                                                       wait=not no_wait, on_run=main_run.append))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_FAILED)
                if exc.code is not None and not isinstance(exc.code, int):
                    err_print([(str(exc.code), "red")])
            except KeyboardInterrupt:
                code = interrupted_exit()
            except DurablyError as exc:
                code, error = exit_code(exc, started=bool(watcher.runs)), exc
                report_durably_error(exc, debug)
            except Exception as exc:  # noqa: BLE001 - the script's own error, reported without a traceback
                code, error = EXIT_FAILED, exc
                report_exception(exc, debug, "the script" if workflow is None else f"workflow {workflow!r}")
    finally:
        set_run_hook(None)
    settle(watcher, engine)
    if workflow is not None and as_json:
        if main_run or code != EXIT_USAGE:
            print_json(outcome(watcher, main_run[0] if main_run else None, code, result, error), jsonl)
    else:
        if workflow is not None and code == EXIT_OK:
            print_json(result, jsonl)
        if watcher.runs or code != EXIT_USAGE:
            print_summary(watcher, code, as_json)
    return code


def direct_run(argv: list[str]) -> int | None:
    """The exit code of `durably run SCRIPT [ARGS...]` written without options, run here; None when the line
    is not of that shape (or the run is on Restate), for the command-line parser."""
    if argv[:1] != ["run"]:
        return None
    rest = argv[1:]
    cut = rest.index("--") if "--" in rest else len(rest)
    before, after = rest[:cut], rest[cut + 1:]
    if not before or any(token.startswith("-") for token in before):
        return None
    return run_plain(Path(before[0]), before[1:] + after)


def run_plain(script: Path, args: list[str]) -> int | None:
    """`durably run SCRIPT [ARGS...]` without options: the settings from the environment, config and discovery,
    errors in them or a missing script reported as the command's usage errors. None when the settings name a
    Restate ingress (`durably run` on Restate is the command line's, with its parser)."""
    try:
        settings = settings_for(None, None)
        if settings.restate:
            return None
        if not script.is_file():
            raise ValidationError(f"no script file {str(script)!r}",
                                  hint="Pass the path of a Python file, e.g. durably run job.py.")
    except DurablyError as exc:
        report_durably_error(exc, False)
        return exit_code(exc, started=False)
    except KeyboardInterrupt:
        return EXIT_TERMINATED if Output.terminated else EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - shown as one red line, the traceback only with --debug
        report_exception(exc, False)
        return EXIT_FAILED
    return run_script(script.resolve(), args, settings)
