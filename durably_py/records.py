"""The run log's format: every record kind as a typed struct, its version, and how lines encode and decode.

A run's log is JSON lines; each line is one record whose ``"t"`` names its kind, and the first is the
``run`` header whose ``v`` is the log version. This module is the only place that knows record shapes:
the kernel, the engine, history and the storage adapters build records here and read them through
`load`, which validates a whole log (and migrates older versions) before anything interprets it.
The attribute names are readable; the on-disk names stay short (``p``, ``l``, ``v`` ...) so existing
logs keep loading. See docs/log-format.md for the table of kinds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import msgspec

from .errors import CorruptLogError, LogVersionError

__all__ = [
    "LOG_VERSION",
    "Adopt",
    "Advice",
    "Awake",
    "Budget",
    "Cancel",
    "Charge",
    "Claim",
    "Code",
    "Comp",
    "End",
    "Err",
    "Fail",
    "Graph",
    "Header",
    "Note",
    "Ok",
    "Park",
    "Patch",
    "Pause",
    "Record",
    "Reopen",
    "Reset",
    "Resolve",
    "Resume",
    "Signal",
    "Snap",
    "Start",
    "Stash",
    "Wait",
    "Wake",
    "decode_fast",
    "encode",
    "is_end_line",
    "is_open_line",
    "kind",
    "may_change_state",
    "load",
    "load_one",
]

LOG_VERSION = 1
"""The log version this code writes. Older versions are migrated on read; newer ones are refused."""


class _Base(msgspec.Struct, tag_field="t", kw_only=True, omit_defaults=True, gc=False):
    """Common base: readable attributes; ``rec["p"]`` / ``rec.get("p")`` also read by on-disk name.

    Records are not tracked by the cycle collector (``gc=False``): a record holds JSON values, which can
    never refer back to it, so it cannot be part of a cycle; decoding a long log then allocates no tracked
    object per record (a quarter less time than tracked structs, measured) and keeps each record smaller."""

    def __getitem__(self, name: str) -> Any:
        if name == "t":
            return kind(self)
        attr = _wire_names(type(self)).get(name)
        if attr is None:
            raise KeyError(name)
        return getattr(self, attr)

    def get(self, name: str, default: Any = None) -> Any:
        """The field stored on disk as `name` (``"t"``: the kind), else `default`."""
        try:
            return self[name]
        except KeyError:
            return default


_WIRE_NAMES: dict[type, dict[str, str]] = {}


def _wire_names(cls: type) -> dict[str, str]:
    names = _WIRE_NAMES.get(cls)
    if names is None:
        fields = cls.__struct_fields__  # type: ignore[attr-defined]
        names = _WIRE_NAMES[cls] = dict(zip(cls.__struct_encode_fields__, fields, strict=True))  # type: ignore[attr-defined]
    return names


# ---- the header -------------------------------------------------------------------------------------------
class Header(_Base, tag="run", omit_defaults=False):
    """First line of every log: who the run is and what it was started with."""

    v: int
    run_id: str
    workflow: str
    created_at: str | None = None
    fingerprint: str | None = None
    key: str | None = None
    input: Any = None
    input_digest: str | None = None
    identity: str | None = None
    budget: dict[str, float] | None = None
    script: str | None = None
    module: str | None = None
    parent: str | None = None
    detached: bool = False
    scheduled_at: str | None = None  # the tick (ISO 8601) a run a schedule started serves
    queue: str | None = None  # the named queue it was enqueued on (None: "default")
    partition: str | None = None  # and its partition there, if any
    forked_from: dict[str, Any] | None = None  # a fork's lineage: {"run", "path", "label", "edited"}
    source: str | None = None  # sha256 of the source file defining the workflow (kept in the store: `Blobs`)
    ts: float | None = None


# ---- process and code -------------------------------------------------------------------------------------
class Claim(_Base, tag="claim"):
    """A process took the run's lease; `epoch` counts workflow attempts."""

    epoch: int
    owner: str
    at: str


class Code(_Base, tag="code"):
    """The workflow's code changed since the header (a resume with edited code): its function's fingerprint
    and the digest of the source file defining it, as the resuming process has them."""

    fingerprint: str | None
    source: str | None = None
    ts: float | None = None


class Budget(_Base, tag="budget"):
    """The run's budget changed."""

    budget: dict[str, float] | None = msgspec.field(name="b")
    ts: float | None = None


class Reopen(_Base, tag="reopen"):
    """A failed run was resumed: its failed and compensated steps run again."""

    ts: float | None = None


class Reset(_Base, tag="reset"):
    """`retry --from-step` invalidated the steps at `paths`."""

    paths: list[str]
    ts: float | None = None


class Pause(_Base, tag="pause"):
    """The run was paused."""

    ts: float | None = None


class Resume(_Base, tag="resume"):
    """The run was resumed after a pause."""

    ts: float | None = None


class Cancel(_Base, tag="cancel"):
    """The run's cancel request reached its workflow here: what the workflow does from now on is clean-up,
    until `until` (ISO 8601); `compensate`: the compensations of its completed steps run before it ends."""

    compensate: bool = False
    until: str | None = None
    ts: float | None = None


class Stale(_Base, tag="stale"):
    """The replay stopped with `StaleRunError`: the code no longer matches the log (a later claim clears it)."""

    error: dict[str, Any] | None = None
    ts: float | None = None


class End(_Base, tag="end", omit_defaults=False):
    """The run finished: `status` is completed, failed or cancelled."""

    status: str
    result: Any = None
    error: dict[str, Any] | None = None
    ts: float | None = None


# ---- steps ------------------------------------------------------------------------------------------------
class Ok(_Base, tag="ok"):
    """A step (or sleep, wait, spawn, join, loop) finished with `value` (wire form)."""

    path: str = msgspec.field(name="p")
    label: str = msgspec.field(name="l")
    value: Any = msgspec.field(name="v")
    attempt: int = msgspec.field(name="a")
    ms: float | None = None
    signal: str | None = msgspec.field(default=None, name="sig")
    ts: float | None = None


class Err(_Base, tag="err"):
    """A step failed for good with `error` (see `codec.dump_error`)."""

    path: str = msgspec.field(name="p")
    label: str = msgspec.field(name="l")
    error: dict[str, Any] = msgspec.field(name="e")
    attempt: int = msgspec.field(name="a")
    ms: float | None = None
    ts: float | None = None


class Fail(_Base, tag="fail"):
    """An attempt failed; the step retries at `next`. `first` (ISO 8601, on the run's clock) is when the
    step's first attempt started, carried from attempt to attempt for `Retry(deadline=)`; logs written
    before it existed have none."""

    path: str = msgspec.field(name="p")
    label: str = msgspec.field(name="l")
    attempt: int = msgspec.field(name="a")
    error: dict[str, Any] = msgspec.field(name="e")
    next: str
    ms: float | None = None
    first: str | None = None
    ts: float | None = None


class Start(_Base, tag="start"):
    """A step began: an unsafe one (written and fsynced before it runs, so a resume that finds no result refuses
    to run it again), or any step still running after a while (the heartbeat's, for `inspect`).

    An unsafe step's start carries `effect`, what a cut-off attempt leads to (``"manual"``: the run needs an
    operator's attention; ``"raise"``: the workflow gets `StepInterruptedError`), and `input`, the step's
    arguments as a JSON list (an argument that is not JSON as its `repr`), so an operator sees what was sent.
    The heartbeat's starts, and logs written before these fields existed, have neither."""

    path: str = msgspec.field(name="p")
    label: str = msgspec.field(name="l")
    attempt: int = msgspec.field(name="a")
    effect: str | None = msgspec.field(default=None, name="fx")
    input: Any = msgspec.field(default=None, name="in")
    ts: float | None = None


class Resolve(_Base, tag="resolve"):
    """An operator's decision about a cut-off unsafe step (`durably resolve`, `Engine.resolve_effect`): the
    step at `path`, whose attempt `attempt` started and never finished, is answered by `decision`: ``"value"``
    (it happened, with result `value`, wire form), ``"rerun"`` (run it again, as a new attempt) or ``"fail"``
    (it fails with `error`, an `EffectFailedError`)."""

    path: str = msgspec.field(name="p")
    label: str = msgspec.field(name="l")
    attempt: int = msgspec.field(name="a")
    decision: str = msgspec.field(name="d")
    value: Any = msgspec.field(default=None, name="v")
    error: dict[str, Any] | None = msgspec.field(default=None, name="e")
    ts: float | None = None


class Stash(_Base, tag="stash"):
    """Partial progress a step stashed; its next attempt starts from `value`."""

    path: str = msgspec.field(name="p")
    value: Any = msgspec.field(name="v")
    ts: float | None = None


class Wake(_Base, tag="wake"):
    """A durable sleep's wake time (`at`, ISO 8601)."""

    path: str = msgspec.field(name="p")
    at: str
    ts: float | None = None


class Wait(_Base, tag="wait", omit_defaults=False):
    """A wait for signal `name`, until `deadline` (ISO 8601) if any; `schema` is the JSON Schema of its
    `schema=` when it has one (the console's form), absent otherwise (and in logs written before it)."""

    path: str = msgspec.field(name="p")
    name: str
    deadline: str | None = None
    schema: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET  # never written as null: absent when unknown
    ts: float | None = None


class Awake(_Base, tag="awk"):
    """An awakeable `ctx.awakeable` created at `path`: `id` is what an outside system resolves it by (the run id
    and the path, so a resumed run asking again gets the same one), `token` the unguessable secret of its
    callback URL, `deadline` (ISO 8601) when it fails unresolved, `name` the workflow's label for it, and `schema`
    the JSON Schema a resolution must match (checked when it is resolved; None: any JSON value). Its outcome is
    the `ok` (the value, `sig` naming the inbox message that carried it) or `err` (rejected, or past its deadline)
    recorded at the same path."""

    path: str = msgspec.field(name="p")
    id: str
    token: str
    deadline: str | None = None
    name: str | None = None
    schema: dict[str, Any] | None = None
    ts: float | None = None


class Park(_Base, tag="park"):
    """The run parked holding no process (a worker served it): in the join at `path` until its child runs
    end (`count` of them, the first ids in `children`), in the retry backoff of the step at `path` until
    `until` (ISO 8601), or (`limit`, e.g. "tenant:alice concurrency 2/2") waiting for a limit to let the step
    at `path` start, until a permit comes back or `until` at the latest. With `budget` the run is over its budget
    before the step at `path`: ``{"limit": {kind: n}, "spent": {kind: n}, "by": {label: {kind: n}}, "owner": run
    id}`` (what it spent, and on what); a raise of the budget (a `budget` record) ends that park, as does the next
    claim of the run for any park."""

    path: str = msgspec.field(name="p")
    children: list[str] | None = None
    count: int | None = None
    until: str | None = None
    limit: str | None = None
    budget: dict[str, Any] | None = None
    ts: float | None = None


class Graph(_Base, tag="graph"):
    """A `ctx.graph` definition: task id -> its workflow name and prerequisites, in definition order."""

    path: str = msgspec.field(name="p")
    tasks: dict[str, Any]
    ts: float | None = None


class Snap(_Base, tag="snap"):
    """A `ctx.loop` snapshot: the state after iteration `iteration`."""

    path: str = msgspec.field(name="p")
    iteration: int = msgspec.field(name="i")
    state: Any = msgspec.field(name="s")
    ts: float | None = None


class Charge(_Base, tag="charge"):
    """Spend recorded at a step, per budget kind; `label` names what it was spent on (the step's label, or
    ``ctx.charge``), and logs written before it existed have none."""

    path: str = msgspec.field(name="p")
    amounts: dict[str, float] = msgspec.field(name="c")
    label: str | None = msgspec.field(default=None, name="l")
    ts: float | None = None


class Comp(_Base, tag="comp"):
    """A compensation ran for the step at `path` (`ok`, or failed with `error`)."""

    path: str = msgspec.field(name="p")
    ok: bool
    error: dict[str, Any] | None = msgspec.field(default=None, name="e")
    ts: float | None = None


class Patch(_Base, tag="patch"):
    """The answer `ctx.patched(change)` (or `ctx.deprecate_patch`) gave this run, fixed for the rest of its life.

    `path` is where the strand stood when it was first asked (its next step's path); it is informative,
    the answer is looked up by `change`."""

    change: str = msgspec.field(name="id")
    path: str = msgspec.field(name="p")
    value: bool = msgspec.field(name="v")
    ts: float | None = None


class Adopt(_Base, tag="adopt"):
    """`adopt`: the step the code now calls at `path` is the recorded one (`recorded`) under a new name, so
    replay answers it from the log. `label` is that new name; None accepts whatever the code calls there."""

    path: str = msgspec.field(name="p")
    recorded: str
    label: str | None = msgspec.field(default=None, name="l")
    ts: float | None = None


# ---- annotations ------------------------------------------------------------------------------------------
class Advice(_Base, tag="adv"):
    """An advisory the run raised (see `advisories.Advisory.to_dict`)."""

    advisory: dict[str, Any] = msgspec.field(name="a")
    ts: float | None = None


class Note(_Base, tag="note"):
    """Annotations set with `ctx.annotate`. `strand` and `index` say which call set them: the `index`-th call
    (from 0) of the workflow strand whose paths start with `strand` ("" for the body), so a replay of that
    call appends nothing; a call inside a step, and logs written before these fields existed, have neither."""

    notes: dict[str, Any] = msgspec.field(name="n")
    strand: str | None = msgspec.field(default=None, name="sp")  # not "p": it is no step path
    index: int | None = msgspec.field(default=None, name="i")
    ts: float | None = None


Record = Union[  # noqa: UP007 - msgspec needs a runtime Union object here
    Header, Claim, Code, Budget, Reopen, Reset, Pause, Resume, Cancel, Stale, End,
    Ok, Err, Fail, Start, Resolve, Stash, Wake, Wait, Awake, Graph, Snap, Charge, Comp, Patch, Adopt, Advice, Note, Park,
]
"""Any record of a run's log."""

KINDS: dict[str, type[_Base]] = {c.__struct_config__.tag: c for c in Record.__args__}  # type: ignore[attr-defined]


class Signal(msgspec.Struct, tag_field="t", tag="signal", kw_only=True):
    """One message in a run's inbox (not its log): signal `name` with `payload`, or a `$`-control request."""

    id: str
    name: str
    payload: Any = None
    at: str | None = None


# ---- encoding ---------------------------------------------------------------------------------------------
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Record)


def encode(record: _Base | Signal) -> bytes:
    """One record as a newline-terminated JSON line."""
    return _encoder.encode(record) + b"\n"


# How `encode` starts the lines of the records that change a run's state (its tag is always its first key), so
# storage can tell an end, reopen or reset line from a step's without decoding the line.
_END_LINE = b'{"t":"end"'
_REOPEN_LINE = b'{"t":"reopen"'
_RESET_LINE = b'{"t":"reset"'


def is_end_line(line: bytes | bytearray) -> bool:
    """True when the encoded record line `line` is an end record."""
    return line.startswith(_END_LINE)


def is_open_line(line: bytes | bytearray) -> bool:
    """True when the encoded record line `line` is a reopen or reset record (either opens an ended run again)."""
    return line.startswith(_REOPEN_LINE) or line.startswith(_RESET_LINE)


def may_change_state(data: bytes | bytearray) -> bool:
    """False when the encoded record lines `data` hold no end, reopen or reset record (three substring checks,
    the test an append takes before it looks at any line)."""
    return _END_LINE in data or _REOPEN_LINE in data or _RESET_LINE in data


def kind(record: _Base) -> str:
    """The record's kind, as stored in ``"t"``."""
    return type(record).__struct_config__.tag  # type: ignore[return-value]


def kind_of(record: object) -> str | None:
    """The kind of a record, typed or as a plain object (what storage summaries hold); None when it is neither."""
    if isinstance(record, _Base):
        return kind(record)
    found = record.get("t") if isinstance(record, dict) else None
    return found if isinstance(found, str) else None


def end_status(record: object) -> str | None:
    """How a run ended, when `record` (typed or a plain object) is its end record ("completed", "failed",
    "cancelled"); None for any other record."""
    if isinstance(record, End):
        return record.status
    if kind_of(record) != "end":
        return None
    assert isinstance(record, dict)
    status = record.get("status")
    return status if isinstance(status, str) else None


def decode_fast(data: bytes) -> list[Any] | None:
    """Every line of `data` as typed records, or None when any line is not a valid record of this version.

    The fast path storage takes first; on None it falls back to plain JSON objects, which `load` then
    validates line by line (and migrates when the header's version is older)."""
    try:
        return _decoder.decode_lines(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


# ---- validating and migrating -----------------------------------------------------------------------------
MIGRATIONS: dict[int, Callable[[list[dict[str, Any]]], list[dict[str, Any]]]] = {}
"""``MIGRATIONS[n]`` turns the records of a version-``n`` log into version ``n + 1`` (as plain dicts).

Version 1 is the first, so the table is empty; a format change bumps `LOG_VERSION` and adds the step from
the old version here, so every older log still loads through the chain."""

_HINT_DAMAGED = (
    "The log was edited or written by something else. Move the file aside (or restore it from a backup) to "
    "make the run disappear; durably never rewrites a damaged log, and other runs are unaffected."
)


_HINT_EMPTY = ("A log whose header was never completely written holds nothing to resume; move the file aside. "
               "Other runs are unaffected.")


def _corrupt(where: str, line: int, message: str, field: str | None = None, hint: str = _HINT_DAMAGED) -> CorruptLogError:
    return CorruptLogError(f"{where}, line {line}: {message}", hint=hint, path=where, line=line, field=field)


def _field_of(error: msgspec.ValidationError) -> str | None:
    """The field a msgspec validation message names (``... at `$.p` `` or ``missing required field `p` ``)."""
    text = str(error)
    if "`$." in text:
        return text.rsplit("`$.", 1)[1].split("`", 1)[0].split("[", 1)[0]
    if "field `" in text:
        return text.split("field `", 1)[1].split("`", 1)[0]
    if "`t`" in text or "tag" in text:
        return "t"
    return None


def load_one(raw: Any, where: str = "record", line: int = 1) -> Record:
    """One plain JSON object as a typed record of this version, else `CorruptLogError` naming the field."""
    if not isinstance(raw, dict):
        raise _corrupt(where, line, f"expected a JSON object, got {type(raw).__name__}")
    try:
        return msgspec.convert(raw, Record)
    except msgspec.ValidationError as exc:
        tag = raw.get("t")
        field = _field_of(exc)
        if isinstance(tag, str) and tag not in KINDS:
            message = f"unknown record kind {tag!r} (known: {', '.join(sorted(KINDS))})"
            field = "t"
        elif field is None or field == "t" and "t" not in raw:
            message = f"record has no kind (\"t\"): {exc}"
        else:
            message = f"{tag or 'record'} record: {exc}"
        raise _corrupt(where, line, message, field) from None


def _check_header(first: Any, where: str) -> int:
    """The version the first record declares, after checking it is a header with a run id."""
    version: Any
    run_id: Any
    if isinstance(first, Header):
        version, run_id = first.v, first.run_id
    elif isinstance(first, dict) and first.get("t") == "run":
        version, run_id = first.get("v"), first.get("run_id")
        if not isinstance(version, int) or isinstance(version, bool):
            raise _corrupt(where, 1, f"the header's version \"v\" is {version!r}, not an integer", "v")
    else:
        got = kind(first) if isinstance(first, _Base) else (first.get("t") if isinstance(first, dict) else first)
        raise _corrupt(where, 1, f"the first line is not a run header (\"t\": \"run\"), it is {got!r}", "t")
    if not isinstance(run_id, str) or not run_id:
        raise _corrupt(where, 1, "the header has no run id (\"run_id\")", "run_id")
    if version > LOG_VERSION:
        raise LogVersionError(
            f"{where}, line 1: log version {version}; this durably-py reads versions up to {LOG_VERSION}",
            hint="Upgrade durably-py to the version that wrote this run (the log is left untouched).",
            path=where, line=1, field="v", version=version)
    if any(v not in MIGRATIONS for v in range(version, LOG_VERSION)):
        raise _corrupt(where, 1, f"log version {version} does not exist (the first is 1)", "v")
    return version


def load(records: list[Any], where: str) -> list[Record]:
    """A whole log as validated typed records of `LOG_VERSION` (header first), or the error naming line and field.

    `records` come from storage: typed already when every line decoded on the fast path, else plain JSON
    objects. Raises `CorruptLogError` (empty log, no header, no run id, a record that does not decode) or
    `LogVersionError` (a log newer than this code). Nothing is written either way."""
    if not records:
        raise _corrupt(where, 1, "no header line: the log is empty, or its only line was cut short", None,
                       hint=_HINT_EMPTY)
    version = _check_header(records[0], where)
    if version == LOG_VERSION and isinstance(records[0], Header) and isinstance(records[-1], _Base):
        return records  # storage decodes a log all typed or all plain, so the ends tell which
    raw = [msgspec.to_builtins(r) if isinstance(r, _Base) else r for r in records]
    while version < LOG_VERSION:
        raw = MIGRATIONS[version](raw)
        version += 1
    out: list[Record] = []
    for number, rec in enumerate(raw, 1):
        typed = load_one(rec, where, number)
        if number > 1 and isinstance(typed, Header):
            raise _corrupt(where, number, "a second run header inside the log", "t")
        out.append(typed)
    return out
