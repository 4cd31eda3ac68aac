"""What storage holds and the rules every adapter shares: records, leases, queue entries, ids and their checks.

The protocol itself, split into the roles services name, is `roles.py`; the front that checks every
argument once for all adapters is `front.py`.

A run is an append-only sequence of records (JSON objects, one per line in the
file adapter). The first record is the run header ``{"t": "run", "v": 1, ...}``.
Adapters store and return records; they never interpret them beyond the header,
the last record, and whether an appended line is an end, reopen or reset record (the run catalog,
`catalog.py`, that `list_runs` answers from). The kernel encodes records to bytes once
(``msgspec``) and hands the adapter complete newline-terminated lines.

Signals (`send`/`inbox`/`ack`) live in a per-run inbox beside the log, not in it: any process may send
one while another holds the lease, or while no process runs the run at all.

The queue (`create`, `schedule`, `join_wait`, `unschedule`, `wake`, `due`, `claim_due`, `entry`) is an index
beside the logs: one entry per run that has not ended, saying when it is next due, its priority, which signals
make it due early, and which of its child runs it waits for in a join (the last of them to end makes it due). Every run enters the queue when it is created and leaves it when the engine records its
end, so "the next due runs" is answered from the entries of unfinished runs alone, however many ended runs
the store keeps. A run whose entry is due and that no live owner holds is due: pending work, a sleep or
wait whose time came, a woken wait, or an orphan whose process died or whose lease lapsed.
"""

from __future__ import annotations

import errno
import hashlib
import heapq
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec

from ..errors import CorruptLogError, RunNotFoundError, StorageFullError, ValidationError
from ..records import LOG_VERSION, Claim, Header, decode_fast, end_status, kind_of
from ..records import encode as encode_record
from .roles import Catalog, DueQueue, Fleet, Identities, Inbox, RunLogs, Storage
from .valuestore import TOKEN, Blobs, resolve

__all__ = [
    "LOG_VERSION", "Catalog", "Check", "Choose", "DueQueue", "Fleet", "Identities", "Inbox", "Lease", "Log",
    "QueueEntry", "QueueStats", "RunInfo", "RunLogs", "Storage",
]

Check = Callable[[list[Any], str], list[Any]]
Choose = Callable[[list[Any], str], bytes | None]
"""What `amend` appends: (checked records, where) -> complete record lines, or None to append nothing."""
"""A log check `claim` runs before writing anything: (records, where) -> the records the lease keeps.
The engine passes `records.load`, so a damaged log raises before a claim record is appended."""
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")
MAX_KEY_LEN = 512


def validate_run_id(run_id: object) -> str:
    """Return `run_id` if it is a safe run id, else raise `ValidationError` (no path can escape the state dir)."""
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id) or ".." in run_id:
        raise ValidationError(
            f"invalid run id {run_id!r}: a run id is 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '..'",
            hint="Copy the id from `durably list`; ids never contain slashes.",
        )
    return run_id


def is_run_id(name: str) -> bool:
    """True if `name` is a valid run id (listings of a directory skip other files)."""
    return bool(RUN_ID_RE.match(name)) and ".." not in name


def validate_key(key: object) -> str:
    """Return `key` if it is a usable run key (1-512 printable characters), else raise `ValidationError`."""
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LEN or any(
        ord(c) < 32 or ord(c) == 127 for c in key
    ):
        raise ValidationError(
            f"invalid run key {key!r}: a key is 1-{MAX_KEY_LEN} printable characters (no control characters or NUL)",
            hint="Pick a short readable name, e.g. key='nightly-harvest'.",
        )
    return key



MAX_LIMIT_KEY_LEN = 200
LIMITS_DOCS = "docs/policies.md#resources"
FLOW_DOCS = "docs/deploying.md#flow-control"
DEFAULT_QUEUE = "default"
"""The queue of a run whose header names none."""
Live = Callable[[str, int], bool]
"""`live(run_id, epoch)`: whether the lease taken at `epoch` on `run_id` is still held by a live owner."""
LimitStep = Callable[[bytes | None, float, Live], tuple[bytes | None, Any]]
"""What an adapter's `_do_limit` runs inside its atomic step: (the stored document's JSON bytes or None, now,
live) -> (the JSON bytes to store, None: remove; what `limit` returns). The front builds it from the caller's
`update` (it decodes, checks and encodes), so adapters store bytes and never judge a document."""


def validate_limit_key(key: object) -> str:
    """Return `key` if every adapter can store it as a limit key: 1-200 characters of text, no NUL and no lone
    surrogate (`validate_name`); adapters hash it before it names a file."""
    if not isinstance(key, str) or not key or len(key) > MAX_LIMIT_KEY_LEN or "\x00" in key or not _utf8(key):
        raise ValidationError(
            f"invalid limit key {key!r}: a limit key is 1-{MAX_LIMIT_KEY_LEN} characters of text without NUL or "
            "lone surrogates",
            hint="Name the limit by what it guards, e.g. 'rate:openai' or 'concurrency:customer-42'.",
            docs=LIMITS_DOCS,
        )
    return key


def validate_limit_prefix(prefix: object) -> str:
    """Return `prefix` if it is a str (the start of the limit keys `limits` lists; "" lists them all)."""
    if not isinstance(prefix, str):
        raise ValidationError(f"a limit key prefix is a str, got {prefix!r}",
                              hint="limits('rate:') lists the rate limits; limits() lists every one.", docs=LIMITS_DOCS)
    return prefix


BLOBS_DOCS = "docs/storage.md#blobs"
VALUES_DOCS = "docs/storage.md#values-stored-once"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def validate_blob(digest: object, data: object = None) -> str:
    """Return `digest` if it is a sha256 in lower-case hex (and, given `data`, the sha256 of those bytes)."""
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise ValidationError(f"a blob's digest is a sha256 in lower-case hex (64 characters), got {digest!r}",
                              hint="Records name their blobs by digest (a run's header names its source's: "
                                   "`durably inspect RUN --json`).", docs=BLOBS_DOCS)
    if data is not None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ValidationError(f"a blob is bytes, got {type(data).__name__}", docs=BLOBS_DOCS)
        if hashlib.sha256(data).hexdigest() != digest:
            raise ValidationError(f"the blob given under {digest[:12]}... is not the data of that digest",
                                  hint="Keep a blob under hashlib.sha256(data).hexdigest().", docs=BLOBS_DOCS)
    return digest


def validate_limit_update(update: object) -> Callable[..., Any]:
    """Return `update` if it can be called, before `limit` opens its atomic step."""
    if not callable(update):
        raise ValidationError(
            f"a limit's update must be callable as update(doc, now, live) -> (new doc, result), got {update!r}",
            hint="Pass a function without side effects: it may run more than once.", docs=LIMITS_DOCS)
    return update


def _not_json(value: object, depth: int = 0) -> str | None:
    """What keeps `value` from being a plain JSON document (None: nothing), so what a limit stores comes back equal
    from every adapter: no set, bytes, date or object that an encoder would quietly turn into something else."""
    if value is None or isinstance(value, bool | int):
        return None
    if isinstance(value, str):
        return None if _utf8(value) else f"the string {value!r} holds a lone surrogate"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value!r} is not a JSON number"
    if depth >= 64:
        return "it is nested more than 64 levels deep"
    if isinstance(value, dict):
        for name, item in value.items():
            if not isinstance(name, str):
                return f"the object key {name!r} is not a str"
            problem = _not_json(name) or _not_json(item, depth + 1)
            if problem:
                return problem
        return None
    if isinstance(value, list | tuple):
        for item in value:
            problem = _not_json(item, depth + 1)
            if problem:
                return problem
        return None
    return f"{type(value).__name__} {value!r:.80} is not a JSON value"


def encode_limit_doc(key: str, doc: object) -> bytes:
    """The JSON bytes of the document an update returned for limit `key`; `ValidationError` (nothing written)
    unless it is plain JSON (`_not_json`)."""
    problem = _not_json(doc)
    if problem is None:
        try:
            return msgspec.json.encode(doc)
        except (TypeError, OverflowError, msgspec.EncodeError, UnicodeEncodeError) as exc:
            problem = str(exc)
    raise ValidationError(
        f"the document the update of limit {key!r} returned is not plain JSON: {problem}; nothing was stored",
        hint="Return dicts with str keys, lists, str, int, float, bool or None (e.g. timestamps as floats).",
        docs=LIMITS_DOCS)


def decode_limit_doc(key: str, data: bytes, where: str) -> Any:
    """The stored document of limit `key` (JSON bytes written by `encode_limit_doc`); `CorruptLogError` when it
    is not JSON (damaged outside durably)."""
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise CorruptLogError(
            f"the stored document of limit {key!r} in {where} is not JSON ({exc})", path=where, line=None, field=key,
            hint="Remove that limit's document (its row, or its file under limits/): the limit starts afresh.",
        ) from None


def validate_identity(identity: object) -> str:
    """Return `identity` if it can be bound (a non-empty str without NUL); adapters hash it, never use it as a path."""
    if not isinstance(identity, str) or not identity or "\x00" in identity:
        raise ValidationError(
            f"invalid run identity {identity!r}: an identity is a non-empty string without NUL",
            hint="Pass the key (or workflow name plus canonical input) as a plain string.",
        )
    return identity


def validate_owner(owner: object) -> str:
    """Return `owner` if it is a non-empty str, so claim records always say who claimed."""
    if not isinstance(owner, str) or not owner:
        raise ValidationError(f"invalid lease owner {owner!r}: an owner is a non-empty string")
    return owner


def validate_ttl(ttl: object) -> float:
    """Return `ttl` as seconds if it is a non-negative number, so lease expiry arithmetic cannot fail later."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl >= 0:
        raise ValidationError(f"invalid lease ttl {ttl!r}: a ttl is a non-negative number of seconds")
    return float(ttl)


def validate_lines(data: object) -> bytes:
    """Return `data` if it is bytes of complete lines (non-empty, ending in a newline), so no append can tear a line."""
    if not isinstance(data, bytes | bytearray) or not data.endswith(b"\n"):
        raise ValidationError(
            f"records must be bytes of complete newline-terminated lines, got {type(data).__name__} "
            f"ending in {bytes(data[-1:]) if isinstance(data, bytes | bytearray) else data!r}",
            hint="Encode each record with msgspec and end it with b'\\n'.",
        )
    return bytes(data) if type(data) is not bytes else data


_RECORD_DECODER = msgspec.json.Decoder(dict[str, Any])


def decode_record(line: bytes) -> dict[str, Any] | None:
    """One line as a record, or None when it is not a JSON object (for best-effort views such as `list_runs`)."""
    try:
        return _RECORD_DECODER.decode(line)
    except msgspec.DecodeError:
        return None


def decode_signal(line: bytes) -> dict[str, Any] | None:
    """One stored signal line as a dict, or None unless it is a JSON object with a non-empty string "id"."""
    record = decode_record(line)
    if record is None or not isinstance(record.get("id"), str) or not record["id"]:
        return None
    return record


def validate_name(name: object, what: str = "a signal name") -> str:
    """Return `name` if every adapter can store it as text: a non-empty str with no NUL (PostgreSQL text
    cannot hold one) and no lone surrogate (not UTF-8). Checked before anything is written."""
    if not isinstance(name, str) or not name or "\x00" in name or not _utf8(name):
        raise ValidationError(f"{what} must be text without NUL or lone surrogates, got {name!r}",
                              hint="Use printable text, e.g. 'approval'.", docs="docs/authoring.md#parking")
    return name


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validate_signal(data: object) -> tuple[bytes, str]:
    """The line and id if `data` is one newline-terminated JSON-object line with a non-empty string "id"
    (and, when it has one, a storable "name": `validate_name`)."""
    data = validate_lines(data)
    signal = decode_signal(data) if data.count(b"\n") == 1 else None
    if signal is None:
        raise ValidationError(
            "a signal must be one newline-terminated line holding a JSON object with a non-empty string \"id\"",
            hint="Encode a dict with a unique \"id\" key with msgspec and end it with b'\\n'.",
        )
    if signal.get("name") is not None:
        validate_name(signal["name"])
    return bytes(data), signal["id"]


def validate_signal_id(signal_id: object) -> str:
    """Return `signal_id` if it is a non-empty str, so `ack` can never match a malformed id."""
    if not isinstance(signal_id, str) or not signal_id:
        raise ValidationError(f"invalid signal id {signal_id!r}: a signal id is a non-empty string")
    return signal_id


def validate_header(run_id: str, header: object) -> dict[str, Any]:
    """The decoded header if `header` is one ``{"t": "run", ...}`` line for `run_id`, else `ValidationError`."""
    header = validate_lines(header)
    record = decode_record(header) if header.count(b"\n") == 1 else None
    if record is None or kind_of(record) != "run" or record.get("run_id", run_id) != run_id:
        raise ValidationError(
            f"invalid header for run {run_id!r}: expected one line {{\"t\": \"run\", \"run_id\": {run_id!r}, ...}}",
            hint="Create runs through the kernel, which writes the header.",
        )
    for name in ("queue", "partition"):  # where the run waits: text every adapter's queue can store
        if record.get(name) is not None:
            validate_queue_name(record[name], f"the {name} of run {run_id!r}")
    return record


def parse_log(data: bytes, where: str, blobs: Blobs | None = None) -> tuple[list[Any], int, str | None]:
    """Decode a log into (records, bytes of good lines, torn-tail message or None).

    With `blobs` (the run's stored values, `valuestore`), a log holding reference tokens is read with each token
    replaced by its value (`_parse_resolved`); the length of good lines is still counted in stored bytes.

    Records are typed (`durably_py.records`) when every line is a valid record of this log version, the
    fast path a run's own log takes; otherwise they are plain JSON objects, left for `records.load` to
    validate (adapters store records, they do not judge them).

    A last line without its newline, or that is not a JSON object, is torn: it is left out and described.
    Any bad line before the last raises `CorruptLogError` naming `where` and the 1-based line number.
    Blank lines are skipped. Nothing is modified: callers decide whether to truncate to the good length.
    """
    if blobs is not None and TOKEN in data:
        return _parse_resolved(data, where, blobs)
    good = data.rfind(b"\n") + 1
    tail = len(data) - good
    typed = decode_fast(data if tail == 0 else data[:good])
    if typed is not None:
        if tail == 0:
            return typed, good, None
        line_no = data.count(b"\n", 0, good) + 1
        return typed, good, f"dropped a torn last line ({tail} bytes) at line {line_no} of {where}"
    try:
        records = _RECORD_DECODER.decode_lines(data if tail == 0 else data[:good])
    except msgspec.DecodeError:
        return _parse_slowly(data, good, where)
    if tail == 0:
        return records, good, None
    line_no = data.count(b"\n", 0, good) + 1
    return records, good, f"dropped a torn last line ({tail} bytes) at line {line_no} of {where}"


def _parse_resolved(data: bytes, where: str, blobs: Blobs) -> tuple[list[Any], int, str | None]:
    """`parse_log` of a log whose lines refer to stored values: each token replaced by its value. A last line
    whose value was never stored (its write cut short by a machine crash) is dropped as torn; one before it is
    damage (`CorruptLogError`)."""
    good = data.rfind(b"\n") + 1
    body, missing = resolve(data[:good], blobs)
    torn_line: str | None = None
    if missing:
        starts = [0, *(i + 1 for i, byte in enumerate(data[:good]) if byte == 10)]
        for number in range(1, len(starts)):
            line = data[starts[number - 1]:starts[number]]
            lost = next((digest for digest in missing if digest.encode() in line), None)
            if lost is None:
                continue
            if number < len(starts) - 1:
                raise CorruptLogError(
                    f"line {number} of {where} refers to a stored value ({lost[:12]}...) the run does not hold",
                    path=where, line=number, field=None,
                    hint="The run's stored values were removed or damaged outside durably; restore them from a "
                         "backup, or delete the run.", docs=VALUES_DOCS)
            torn_line = (f"dropped the last line (line {number} of {where}): it refers to a stored value "
                         f"({lost[:12]}...) that was never made durable")
            good = starts[number - 1]
            body, _ = resolve(data[:good], blobs)
            break
    records, resolved_good, torn = parse_log(body + data[good:] if torn_line is None else body, where)
    if resolved_good < len(body):  # a damaged last line: count the good ones in stored bytes
        lines = body.count(b"\n", 0, resolved_good)
        good = 0
        for _ in range(lines):
            good = data.index(b"\n", good) + 1
    return records, good, torn_line or torn


def _parse_slowly(data: bytes, good: int, where: str) -> tuple[list[dict[str, Any]], int, str | None]:
    """Line-by-line `parse_log`, only run once the fast path failed, to find the damaged line."""
    records: list[dict[str, Any]] = []
    lines = data[:good].split(b"\n")[:-1]
    has_tail = good < len(data)
    offset = 0
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                records.append(_RECORD_DECODER.decode(line))
            except msgspec.DecodeError as exc:
                if number == len(lines) and not has_tail:
                    message = f"dropped a torn last line ({len(line) + 1} bytes) at line {number} of {where}"
                    return records, offset, message
                raise CorruptLogError(
                    f"line {number} of {where} is damaged ({exc}); it is not the last line, so it is not a torn write",
                    path=where,
                    line=number,
                ) from None
        offset += len(line) + 1
    raise AssertionError("parse_log's fast path rejected a log the slow path accepts")  # pragma: no cover


def validate_rewrite(run_id: str, data: object) -> bytes:
    """Return `data` if it is a whole log (complete records, header first), so a compaction cannot damage a run."""
    data = bytes(validate_lines(data))
    try:
        records, _, torn = parse_log(data, f"the rewrite of run {run_id}")
    except CorruptLogError as exc:
        raise ValidationError(str(exc)) from None
    if torn or kind_of(records[0]) != "run":
        raise ValidationError(
            f"a rewrite of run {run_id} must be whole JSON-object lines starting with the run header",
            hint=torn or "Put the header record first.",
        )
    return data


def max_epoch(records: list[Any]) -> int:
    """The highest claim epoch among `records` (0 when never claimed)."""
    if records and isinstance(records[0], Header):
        epochs: list[Any] = [r.epoch for r in records if type(r) is Claim]
    else:
        epochs = [r.get("epoch") for r in records if isinstance(r, dict) and kind_of(r) == "claim"]
    return max((e for e in epochs if isinstance(e, int) and not isinstance(e, bool)), default=0)


FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)})


def storage_full(exc: OSError, what: str, where: str) -> StorageFullError | OSError:
    """`StorageFullError` for a write refused for lack of space or size (ENOSPC, EFBIG, EDQUOT), else `exc`."""
    if isinstance(exc, StorageFullError) or exc.errno not in FULL_ERRNOS:
        return exc
    error = StorageFullError(f"could not {what} {where}: {exc.strerror or exc}", path=where)
    error.errno = exc.errno
    return error


def iso_now() -> str:
    """The current UTC time as ISO 8601, as claim records carry it."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


def claim_line(epoch: int, owner: str) -> bytes:
    """The claim record every adapter appends on a successful claim, as one line."""
    return encode_record(Claim(epoch=epoch, owner=owner, at=iso_now()))


def claimed(records: list[Any], epoch: int, owner: str) -> bytes:
    """Append the claim record to `records` (typed, or a plain object when they are) and return its line."""
    record = Claim(epoch=epoch, owner=owner, at=iso_now())
    records.append(record if records and isinstance(records[0], Header) else msgspec.to_builtins(record))
    return encode_record(record)


def ended(records: list[Any]) -> bool:
    """True when the log's last record is an end record: `claim` refuses such a run unless it reopens it."""
    last = records[-1] if records else None
    return kind_of(last) == "end"


def checked(records: list[Any], where: str, check: Check | None) -> list[Any]:
    """`records` after the caller's `check` (before a claim writes anything), or as they are without one."""
    if not records:
        raise CorruptLogError(f"{where}, line 1: no header line: the log is empty, or its only line was cut short",
                              path=where, line=1, field=None)
    return check(records, where) if check is not None else records


def last_line(data: bytes | bytearray) -> bytes | bytearray:
    """The last complete line of newline-terminated `data` (without scanning the rest)."""
    return data[data.rfind(b"\n", 0, len(data) - 1) + 1 :]


@dataclass
class Lease:
    """The right to append to one run, fenced by `epoch` (every claim bumps it)."""

    run_id: str
    owner: str
    epoch: int
    state: dict[str, Any] = field(default_factory=dict)  # adapter-private fencing data
    records: list[Any] = field(default_factory=list)  # the log as claimed, its claim record last
    torn: str | None = None  # a torn tail the claim trimmed, if any
    where: str = ""  # the log's location, for error messages
    size: int = -1  # bytes of the log as claimed, its claim record included (-1: not known)


@dataclass
class Log:
    """A run's records as read; `torn` describes a damaged last line that was dropped, if any."""

    records: list[Any]  # typed records (`durably_py.records`), or plain JSON objects when not all decode
    torn: str | None = None
    where: str = ""  # the log's location (file path or table), for error messages


@dataclass
class RunInfo:
    """What `list_runs` knows of one run without reading its whole log."""

    run_id: str
    header: dict[str, Any]
    last: dict[str, Any]
    held: bool
    updated_at: float
    epoch: int = 0  # how many times the run was claimed (its workflow attempt)
    state: str | None = None  # the catalog's state ("open" or the end status) where the adapter keeps one

    @property
    def kind(self) -> str | None:
        """The kind of the run's last record: "run" before its first claim, "end" once it ended, ..."""
        return kind_of(self.last)

    @property
    def ended(self) -> bool:
        """True when the run's last record is its end."""
        return kind_of(self.last) == "end"

    @property
    def end_status(self) -> str | None:
        """How the run ended ("completed", "failed" or "cancelled"), None while it has not."""
        return end_status(self.last)

    @property
    def parent(self) -> str | None:
        """The run this one is a child of, from its header."""
        return _text(self.header, "parent")

    @property
    def detached(self) -> bool:
        """A child run its parent does not wait for or cancel with it (its header says)."""
        return self.header.get("detached") is True if isinstance(self.header, dict) else False

    @property
    def input_digest(self) -> str | None:
        """The digest of the run's input (its identity under a key), from its header."""
        return _text(self.header, "input_digest")

    @property
    def identity(self) -> str | None:
        """How the run was named (by input or by key), from its header."""
        return _text(self.header, "identity")


def _text(header: object, name: str) -> str | None:
    value = header.get(name) if isinstance(header, dict) else None
    return value if isinstance(value, str) else None


@dataclass
class QueueEntry:
    """A run's place in the queue: due at `at` (epoch seconds; None: only a `wake` makes it due), in the named
    `queue` and `partition` its header gives (`catalog.queue_fields`; they never change while it is queued)."""

    run_id: str
    at: float | None
    priority: int = 0
    wait: tuple[str, ...] = ()  # signal names whose arrival makes the run due at once
    created: float = 0.0
    queue: str = DEFAULT_QUEUE
    partition: str | None = None


@dataclass(frozen=True)
class QueueStats:
    """What one queue, or one partition of it, holds (`DueQueue.queue_stats`): each entry is counted once, as
    `running` while a live owner holds its run, else as `due` (due by now), `later` (due at a later time) or
    `parked` (due only when woken). `oldest` is the earliest due time (epoch seconds) among the `due` ones, so
    an operator sees how long the queue's oldest waiting run has waited (None: none is due)."""

    queue: str
    partition: str | None
    due: int = 0
    later: int = 0
    running: int = 0
    parked: int = 0
    oldest: float | None = None


def validate_priority(priority: object) -> int:
    """Return `priority` if it is an int (not a bool), so the queue's order is always defined."""
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > 2**62:
        raise ValidationError(f"priority= must be an int, got {priority!r}", hint="Higher runs first: priority=10.",
                              docs="docs/running.md#the-queue")
    return priority


def validate_at(at: object) -> float | None:
    """Return `at` as epoch seconds if it is a finite number or None."""
    if at is None:
        return None
    if isinstance(at, bool) or not isinstance(at, int | float) or not (-1e12 < at < 1e12):
        raise ValidationError(f"a due time is epoch seconds or None, got {at!r}")
    return float(at)


def validate_wait(wait: object) -> tuple[str, ...]:
    """Return `wait` as a tuple of storable signal names (`validate_name`)."""
    if isinstance(wait, str) or not isinstance(wait, list | tuple) or not all(
        isinstance(name, str) and name for name in wait
    ):
        raise ValidationError(f"wait= is a list of signal names, got {wait!r}")
    for name in wait:
        validate_name(name)
    return tuple(wait)


def validate_workflows(workflows: object) -> frozenset[str] | None:
    """Return `workflows` (the names a `due` or `claim_due` keeps; None: every workflow) as a frozenset."""
    if workflows is None:
        return None
    if isinstance(workflows, str) or not isinstance(workflows, Iterable) or not all(
        isinstance(name, str) for name in workflows
    ):
        raise ValidationError(f"workflows= is a set of workflow names or None, got {workflows!r}")
    return frozenset(workflows)


def validate_queue_name(name: object, what: str = "a queue name") -> str:
    """Return `name` if every adapter can store it as text: a non-empty str without NUL (PostgreSQL text holds
    none) or lone surrogates (not UTF-8)."""
    if not isinstance(name, str) or not name or "\x00" in name or not _utf8(name):
        raise ValidationError(f"{what} must be non-empty text without NUL or lone surrogates, got {name!r}",
                              hint='queue="emails", partition="tenant-42"', docs=FLOW_DOCS)
    return name


def validate_queue_set(names: object, what: str, *, none: bool) -> frozenset[str] | None:
    """`names` (a set, or any iterable other than a string, of queue names, or "QUEUE/PARTITION" for `full=`)
    as a frozenset; None only when `none` allows it. Checked before anything is claimed."""
    if names is None and none:
        return None
    if isinstance(names, str | bytes) or not isinstance(names, Iterable):
        raise ValidationError(
            f"{what}= is a set of queue names{' or None' if none else ''}, got {names!r}",
            hint=f'{what}=frozenset({{"emails"}})' + (' (a partition: "emails/tenant-42")' if what == "full" else ""),
            docs=FLOW_DOCS)
    found = frozenset(names)
    for name in found:
        validate_queue_name(name, f"each name in {what}=")
    return found


def queue_allows(entry: QueueEntry, queues: frozenset[str] | None, full: frozenset[str]) -> bool:
    """Whether `due(queues=, full=)` keeps `entry`: its queue is one of `queues` (None: any) and neither its
    queue nor its "QUEUE/PARTITION" is in `full`."""
    if queues is not None and entry.queue not in queues:
        return False
    return not full or entry.queue not in full and (
        entry.partition is None or f"{entry.queue}/{entry.partition}" not in full)


def validate_worker(owner: object, info: object) -> bytes:
    """The JSON line of a worker's advertisement (`Storage.advertise`): a non-empty owner, a JSON object."""
    validate_owner(owner)
    if not isinstance(info, dict):
        raise ValidationError(f"a worker advertises a dict, got {info!r}")
    try:
        return msgspec.json.encode({**info, "owner": owner})
    except (TypeError, msgspec.EncodeError, UnicodeEncodeError) as exc:
        raise ValidationError(f"a worker's advertisement must be JSON: {exc}") from None


def decode_worker(data: bytes) -> dict[str, Any] | None:
    """One stored advertisement, or None when it is not a JSON object with an owner."""
    record = decode_record(bytes(data))
    return record if record is not None and isinstance(record.get("owner"), str) else None


def validate_limit(limit: object) -> int:
    """Return `limit` if it is an int >= 0."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValidationError(f"limit= must be an int >= 0, got {limit!r}")
    return limit


def due_order(entry: QueueEntry) -> tuple[float, float, float, str]:
    """How due entries are ordered before partitions take turns (`fair_order`): highest priority first, then
    earliest due, then oldest, then by id."""
    return (-entry.priority, entry.at if entry.at is not None else float("inf"), entry.created, entry.run_id)


def fair_order(ready: list[QueueEntry], eligible: Callable[[QueueEntry], bool]) -> Iterator[QueueEntry]:
    """The entries of `ready` (sorted by `due_order`) that `eligible` accepts, in the queue's fair order: highest
    priority first; within one priority, partitions take turns (the first eligible run of each (queue,
    partition) comes before the second of any), each turn in due order; a run without a partition takes its
    turn first, as if alone in a partition of its own, so without partitions this is `due_order`. The order
    the SQL adapters give with ``ROW_NUMBER() OVER (PARTITION BY queue, partition, priority)``.

    Lazy: `eligible` is asked once per entry, only as far as the caller reads (a file adapter's check is a
    lock probe), and a queue without partitions is one pass with no grouping."""
    i, count = 0, len(ready)
    while i < count:
        entry = ready[i]
        if entry.partition is None:  # ahead of every partitioned entry of its priority: due no later, rank 1
            i += 1
            if eligible(entry):
                yield entry
            continue
        end = i
        while end < count and ready[end].priority == entry.priority:
            end += 1
        yield from _in_turns(ready[i:end], eligible)
        i = end


def _in_turns(level: list[QueueEntry], eligible: Callable[[QueueEntry], bool]) -> Iterator[QueueEntry]:
    """`fair_order` of entries of one priority (in due order): turn after turn, each partition's next eligible
    entry, merged in due order (runs without a partition all in the first turn)."""
    plain: list[QueueEntry] = []
    groups: dict[tuple[str, str], list[QueueEntry]] = {}
    for entry in level:
        if entry.partition is None:
            plain.append(entry)
        else:
            groups.setdefault((entry.queue, entry.partition), []).append(entry)

    def key(entry: QueueEntry) -> tuple[float, float, str]:
        return (entry.at if entry.at is not None else float("inf"), entry.created, entry.run_id)

    # the heap holds each source's next entry: (its order, its position, its group; None: the plain runs)
    heap: list[tuple[tuple[float, float, str], int, tuple[str, str] | None]] = []
    if plain:
        heap.append((key(plain[0]), 0, None))
    heap.extend((key(entries[0]), 0, group) for group, entries in groups.items())
    heapq.heapify(heap)
    turn: list[tuple[str, str]] = []  # the groups that gave an entry this turn, back in the next one
    position = dict.fromkeys(groups, 0)
    while heap or turn:
        if not heap:
            for group in turn:
                at = position[group]
                if at < len(groups[group]):
                    heapq.heappush(heap, (key(groups[group][at]), at, group))
            turn = []
            continue
        _, at, source = heapq.heappop(heap)
        entries = plain if source is None else groups[source]
        entry = entries[at]
        ok = eligible(entry)
        if source is None:
            if at + 1 < len(plain):
                heapq.heappush(heap, (key(plain[at + 1]), at + 1, None))
        else:
            position[source] = at + 1
            if ok:
                turn.append(source)
            elif at + 1 < len(entries):
                heapq.heappush(heap, (key(entries[at + 1]), at + 1, source))
        if ok:
            yield entry


def count_queues(entries: Iterable[tuple[QueueEntry, bool]], now: float) -> list[QueueStats]:
    """`queue_stats` from (entry, held by a live owner) pairs, for adapters that count in Python."""
    counts: dict[tuple[str, str | None], list[Any]] = {}
    for entry, held in entries:
        row = counts.setdefault((entry.queue, entry.partition), [0, 0, 0, 0, None])
        if held:
            row[2] += 1
        elif entry.at is None:
            row[3] += 1
        elif entry.at > now:
            row[1] += 1
        else:
            row[0] += 1
            row[4] = entry.at if row[4] is None else min(row[4], entry.at)
    return sorted_stats(QueueStats(queue, partition, *row) for (queue, partition), row in counts.items())


def sorted_stats(stats: Iterable[QueueStats]) -> list[QueueStats]:
    """`stats` by queue, then partition (none first), in Python's string order (not a database's collation)."""
    return sorted(stats, key=lambda s: (s.queue, s.partition is not None, s.partition or ""))


def claim_candidates(storage: Any, candidates: list[str], owner: str, ttl: float, limit: int,
                     check: Check | None = None) -> list[Lease]:
    """Claim up to `limit` of `candidates` in order, skipping runs someone else claimed meanwhile and runs
    whose log is missing or damaged (a damaged log never hides the other runs)."""
    leases: list[Lease] = []
    for run_id in candidates:
        if len(leases) >= limit:
            break
        try:
            lease = storage.claim(run_id, owner, ttl, check=check)
        except (RunNotFoundError, CorruptLogError):
            continue
        if lease is not None:
            leases.append(lease)
    return leases


@dataclass(frozen=True, slots=True)
class NewRun:
    """A run to create bound to an identity (see `Storage.create_bound`): `identity` must still point at
    `expect` (None: at nothing, or a run id whose run is gone) when it is bound to `run_id`. `queued` False:
    the run needs no queue entry (a child its parent's process runs at once; the parent's own entry brings
    both back after a crash); an adapter may queue it all the same. A queued run is due at `at` (None: now)
    with `priority`, as `create` queues it."""

    run_id: str
    header: bytes
    identity: str
    expect: str | None = None
    queued: bool = True
    at: float | None = None
    priority: int = 0


def validate_new_runs(runs: list[NewRun]) -> list[dict[str, Any]]:
    """Check every run of a `create_bound` batch before any is written; the validated header of each."""
    headers = []
    for run in runs:
        validate_identity(run.identity)
        validate_run_id(run.run_id)
        if run.expect is not None:
            validate_run_id(run.expect)
        validate_at(run.at)
        validate_priority(run.priority)
        headers.append(validate_header(run.run_id, run.header))
    return headers


def sync_each(storage: Any, leases: list[Lease]) -> None:
    """`Storage.sync_all` as one `sync` per lease, for adapters whose commits cost the same grouped or not."""
    for lease in leases:
        storage.sync(lease)


def finish_each(storage: Any, leases: list[Lease]) -> list[BaseException | None]:
    """`Storage.finish_all` as `sync_all`, then `unschedule` and `release` of each lease, for adapters whose
    commits cost the same grouped or not (and the fallback of the others when the group commit fails)."""
    errors: list[BaseException | None] = []
    try:
        storage.sync_all(leases)
        grouped = True
    except Exception:  # noqa: BLE001 - each lease is then made durable (or fails) on its own
        grouped = False
    for lease in leases:
        try:
            if not grouped:
                storage.sync(lease)
            storage.unschedule(lease.run_id)
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - this run's outcome
            errors.append(exc)
        finally:
            storage.release(lease)
    return errors


def bind_and_create(storage: Any, runs: list[NewRun]) -> str | None:
    """`Storage.create_bound` as one `bind` and one `create` per run, for adapters without a cheaper way (the
    front checked every run before this binds the first)."""
    for run in runs:
        if not storage.bind(run.identity, run.run_id, expect=run.expect):
            return run.identity
        storage.create(run.run_id, run.header, at=run.at, priority=run.priority)
    return None


def lookup_each(storage: Any, identities: list[str]) -> list[str | None]:
    """`Storage.lookup_many` as one `lookup` per identity, for adapters where a lookup costs no round trip."""
    return [storage.lookup(identity) for identity in identities]
