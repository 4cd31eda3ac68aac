"""The durable boundary's data codec: JSON plus aware datetimes, canonical input identity, and errors as data.

Wire form: plain JSON values where a `datetime` is ``{"$dt": "<isoformat>"}`` and a user dict whose only key is
``"$dt"``, ``"$esc"`` or ``"$blob"`` is wrapped as ``{"$esc": {...}}``, so user data never reads back as a tag (nor
as a storage's reference to a stored value, ``{"$blob": "<sha256>"}``: `storage/valuestore.py`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import datetime as _dt
import enum
import hashlib
import json
import math
import os
import sys
import traceback
import types
from types import TracebackType
from typing import Any

import msgspec

from .errors import DurablyError, SerializationError, StepFailedError

__all__ = [
    "canonical",
    "decode",
    "decode_lines",
    "digest",
    "dump_error",
    "dump_value",
    "encode",
    "encode_line",
    "from_iso",
    "load_error",
    "load_value",
    "to_iso",
]

DT_TAG = "$dt"
ESC_TAG = "$esc"
BLOB_TAG = "$blob"  # a storage's reference to a value stored once; user data with it alone is escaped
_TAGS = frozenset({DT_TAG, ESC_TAG, BLOB_TAG})

_datetime = _dt.datetime
_SCALARS = frozenset({str, int, bool, type(None)})
_isfinite = math.isfinite
_FAST_DEPTH = 64
_REPR_MAX = 80

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()

_GENERIC_HINT = (
    "Convert it to JSON types (dict with str keys, list, str, int, float, bool, None) "
    "or a timezone-aware datetime before it crosses the step boundary."
)


class _Reject(Exception):
    """Internal: a value was refused; `segments` collects the path (innermost first) while unwinding."""

    def __init__(self, what: str, hint: str) -> None:
        super().__init__(what)
        self.what = what
        self.hint = hint
        self.segments: list[str] = []


class _TooDeep(Exception):
    """Internal: nesting passed the fast walk's depth, so walk again with cycle detection."""


def _short_repr(value: Any) -> str:
    """A bounded repr for messages, so a huge offender does not flood the error."""
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= _REPR_MAX else text[: _REPR_MAX - 3] + "..."


def _key_segment(key: str) -> str:
    """Path segment for a dict key: `.name` when identifier-like, `["..."]` otherwise."""
    return "." + key if key.isidentifier() else "[" + json.dumps(key, ensure_ascii=False) + "]"


def _tag_dt(value: _dt.datetime) -> dict[str, str]:
    """Wire form of an aware datetime; raises `_Reject` for a naive one."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise _Reject(
            f"a naive datetime {_short_repr(value)} (it has no timezone)",
            "Make it timezone-aware, e.g. value.replace(tzinfo=timezone.utc) or datetime.now(timezone.utc).",
        )
    return {DT_TAG: _datetime.isoformat(value)}


def _reject_other(value: Any) -> _Reject:
    """The refusal for a value of an unsupported type, with a hint for that type."""
    t = type(value)
    name = f"{t.__module__}.{t.__qualname__}" if t.__module__ != "builtins" else t.__qualname__
    what = f"a {name} ({_short_repr(value)})"
    if isinstance(value, float):
        return _Reject(
            f"a non-finite float {_short_repr(value)}",
            'JSON has no NaN or infinity; replace it with None or a string such as "inf".',
        )
    if isinstance(value, (set, frozenset)):
        return _Reject(what, "Convert it to a sorted list, e.g. sorted(value).")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _Reject(what, "Decode it to a str (value.decode(), or base64 for binary data), or store it in a file.")
    if isinstance(value, _dt.date):
        return _Reject(what, "Convert it to an ISO string with value.isoformat(), or use an aware datetime.")
    if isinstance(value, _dt.time):
        return _Reject(what, "Convert it to an ISO string with value.isoformat().")
    if isinstance(value, enum.Enum):
        return _Reject(what, "Store value.value (or value.name) instead of the enum member.")
    if isinstance(value, msgspec.Struct):
        return _Reject(what, "Convert it with msgspec.to_builtins(value).")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _Reject(what, "Convert it with dataclasses.asdict(value).")
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return _Reject(what, "Convert the named tuple with value._asdict() (or list(value)).")
    if name in ("decimal.Decimal", "fractions.Fraction"):
        return _Reject(what, "Convert it to str(value) to keep it exact, or to float(value).")
    if name == "uuid.UUID":
        return _Reject(what, "Convert it to str(value).")
    if isinstance(value, os.PathLike):
        return _Reject(what, "Convert it to str(value).")
    if hasattr(value, "model_dump"):
        return _Reject(what, 'Convert it with value.model_dump(mode="json").')
    if hasattr(value, "dtype") and hasattr(value, "tolist"):
        return _Reject(what, "Convert it with value.tolist() (or value.item() for a scalar).")
    return _Reject(what, _GENERIC_HINT)


_INT_BOUND = 10**4000  # ints must stay below Python's int/str conversion limit (4300 digits) to be written


def _huge(v: int) -> _Reject:
    return _Reject(f"an integer of about {v.bit_length() * 30103 // 100000 + 1} digits, too large to record",
                   "Record a big number as a string (str(n)) and convert it back in the workflow.")


def _walk(v: Any, depth: int, seen: set[int] | None) -> Any:
    """Wire form of `v`; `seen` is None on the fast walk and holds ids of containers on the path otherwise."""
    t = type(v)
    if t in _SCALARS:
        if t is int and not -_INT_BOUND < v < _INT_BOUND:
            raise _huge(v)
        return v
    if t is float:
        if _isfinite(v):
            return v
        raise _reject_other(v)
    if t is dict or t is list or t is tuple:
        if seen is None:
            if depth > _FAST_DEPTH:
                raise _TooDeep
            return _walk_container(v, t, depth, seen)
        return _walk_sub(v, v, depth, seen)
    if t is _datetime:
        return _tag_dt(v)
    return _walk_other(v, depth, seen)


def _walk_container(v: Any, t: type, depth: int, seen: set[int] | None) -> Any:
    """Wire form of an exact dict, list or tuple."""
    depth += 1
    scalars = _SCALARS
    if t is dict:
        out: dict[str, Any] = {}
        k: Any = None
        try:
            for k, x in v.items():
                if type(k) is not str:
                    if not isinstance(k, str):
                        raise _non_str_key(k)
                    k = str.__str__(k)
                tx = type(x)
                out[k] = x if tx in scalars and (tx is not int or -_INT_BOUND < x < _INT_BOUND) \
                    else _walk(x, depth, seen)
        except _Reject as exc:
            if isinstance(k, str):
                exc.segments.append(_key_segment(k))
            raise
        if len(out) == 1 and not _TAGS.isdisjoint(out):
            return {ESC_TAG: out}
        return out
    kinds = set(map(type, v))
    if scalars.issuperset(kinds) and (int not in kinds or all(-_INT_BOUND < x < _INT_BOUND for x in v
                                                                if type(x) is int)):
        return list(v)
    items: list[Any] = []
    append = items.append
    for i, x in enumerate(v):
        tx = type(x)
        if tx in scalars and (tx is not int or -_INT_BOUND < x < _INT_BOUND):
            append(x)
            continue
        try:
            append(_walk(x, depth, seen))
        except _Reject as exc:
            exc.segments.append(f"[{i}]")
            raise
    return items


def _non_str_key(key: Any) -> _Reject:
    """The refusal for a dict key that is not a str."""
    return _Reject(
        f"a dict with a non-str key {_short_repr(key)} ({type(key).__name__})",
        "JSON object keys are strings; convert the keys, e.g. {str(k): v for k, v in d.items()}, "
        "or use a list of pairs.",
    )


def _walk_other(v: Any, depth: int, seen: set[int] | None) -> Any:
    """Wire form of a subclass of a supported type (converted to the plain type); refuses everything else."""
    if isinstance(v, int):
        if not -_INT_BOUND < v < _INT_BOUND:
            raise _huge(v)
        return int.__int__(v)
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, float):
        if _isfinite(v):
            return float.__float__(v)
        raise _reject_other(v)
    if isinstance(v, _datetime):
        return _tag_dt(v)
    if isinstance(v, dict):
        return _walk(dict(v), depth, seen) if seen is None else _walk_sub(v, dict(v), depth, seen)
    if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
        return _walk(list(v), depth, seen) if seen is None else _walk_sub(v, list(v), depth, seen)
    raise _reject_other(v)


def _walk_sub(original: Any, plain: Any, depth: int, seen: set[int]) -> Any:
    """Walk `plain` (the container itself, or a plain copy of a container subclass) while the original's id marks
    the path (cycle detection)."""
    ident = id(original)
    if ident in seen:
        raise _Reject(
            f"a {type(original).__name__} that contains itself",
            "Break the cycle; a value that refers to itself cannot be recorded.",
        )
    seen.add(ident)
    try:
        return _walk_container(plain, type(plain), depth, seen)
    finally:
        seen.discard(ident)


def dump_value(value: Any, where: str = "value") -> Any:
    """Validate `value` and return its wire form (JSON types, tagged datetimes), else raise `SerializationError`."""
    t = type(value)
    if t is str or t is bool or value is None or (t is int and -_INT_BOUND < value < _INT_BOUND):
        return value
    if t is float and _isfinite(value):
        return value
    try:
        try:
            return _walk(value, 0, None)
        except _TooDeep:
            return _walk(value, 0, set())
    except _Reject as exc:
        path = where + "".join(reversed(exc.segments))
        raise SerializationError(f"cannot record {path}: it is {exc.what}", hint=exc.hint, path=path) from None
    except RecursionError:
        raise SerializationError(
            f"cannot record {where}: it is nested too deeply",
            hint="Flatten the structure; values nested hundreds of levels deep are not supported.",
            path=where,
        ) from None


SCALARS = frozenset({str, int, float, bool, type(None)})
"""The wire types that are their own value (`load_value` returns them as they are)."""
_PLAIN = SCALARS


def dump_output(value: Any) -> tuple[Any, Any]:
    """A live step's output as `(wire, value)`: `dump_value(value, "output")` and what `load_value` rebuilds from
    it, so the step returns exactly what its replay will. A flat dict of plain scalars (the common output) is
    checked once and copied twice instead of walked and then read back."""
    t = type(value)
    if t is dict:
        scalars = _SCALARS
        for k, x in value.items():
            tx = type(x)
            if type(k) is not str or tx not in scalars or (tx is int and not -_INT_BOUND < x < _INT_BOUND):
                break
        else:
            if len(value) != 1 or _TAGS.isdisjoint(value):
                return value.copy(), value.copy()
    elif t is str or t is bool or value is None or (t is int and -_INT_BOUND < value < _INT_BOUND):
        return value, value
    wire = dump_value(value, "output")
    return wire, load_value(wire)


def load_value(wire: Any) -> Any:
    """Rebuild the value from its wire form: tagged datetimes become `datetime`, escaped dicts are unwrapped.

    A flat dict or list of scalars (the common step output) is copied as is: only a one-key dict can be a
    tag, and only a nested container can hold one."""
    t = type(wire)
    if t in _PLAIN:
        return wire
    if t is dict:
        if len(wire) == 1 and (DT_TAG in wire or ESC_TAG in wire):
            return _load(wire)
        plain = _PLAIN
        for x in wire.values():
            if type(x) not in plain:
                return _load(wire)
        return wire.copy()
    if t is list:
        plain = _PLAIN
        for x in wire:
            if type(x) not in plain:
                return _load(wire)
        return wire.copy()
    return _load(wire)


def _load(w: Any) -> Any:
    """Rebuild a wire container (the recursive half of `load_value`)."""
    t = type(w)
    if t is dict:
        if len(w) == 1:
            if DT_TAG in w:
                text = w[DT_TAG]
                try:
                    return from_iso(text)
                except (TypeError, ValueError):
                    raise SerializationError(
                        f"malformed datetime in recorded data: {_short_repr(text)}",
                        hint="The record was not written by durably's codec; check the log file.",
                        path=DT_TAG,
                    ) from None
            if ESC_TAG in w:
                w = w[ESC_TAG]
                if type(w) is not dict:
                    raise SerializationError(
                        f"malformed escaped dict in recorded data: {_short_repr(w)}",
                        hint="The record was not written by durably's codec; check the log file.",
                        path=ESC_TAG,
                    )
        scalars = _SCALARS
        return {k: x if type(x) in scalars or type(x) is float else _load(x) for k, x in w.items()}
    if t is list or t is tuple:
        scalars = _SCALARS
        return [x if type(x) in scalars or type(x) is float else _load(x) for x in w]
    return w


def encode(obj: Any) -> bytes:
    """JSON bytes of an already-wire-form object (no trailing newline)."""
    try:
        return _encoder.encode(obj)
    except (TypeError, msgspec.EncodeError, OverflowError) as exc:
        raise SerializationError(
            f"cannot encode value as JSON: {exc}",
            hint="Pass the value through dump_value() first; encode() only takes wire-form data.",
            path="value",
        ) from None


def encode_line(obj: Any) -> bytes:
    """JSON bytes of a wire-form object plus a newline: one JSONL record."""
    return encode(obj) + b"\n"


def decode(data: bytes | str) -> Any:
    """Parse one JSON document (raises `msgspec.DecodeError`, a `ValueError`, if malformed)."""
    return _decoder.decode(data)


def decode_lines(data: bytes) -> list[Any]:
    """Parse JSONL; blank lines are skipped, and any malformed line raises `msgspec.DecodeError` for the whole batch."""
    return _decoder.decode_lines(data)


def _canon(w: Any) -> Any:
    """Canonical form of a wire value: None-valued dict entries dropped, keys sorted, escapes redone."""
    t = type(w)
    if t is dict:
        if len(w) == 1:
            if DT_TAG in w:
                return w
            if ESC_TAG in w:
                w = w[ESC_TAG]
        out = {k: _canon(w[k]) for k in sorted(w) if w[k] is not None}
        if len(out) == 1 and not _TAGS.isdisjoint(out):
            return {ESC_TAG: out}
        return out
    if t is list:
        return [_canon(x) for x in w]
    return w


def canonical(value: Any) -> bytes:
    """Identity bytes of a workflow input: wire form, keys sorted, and a None-valued dict entry equal to no entry."""
    return _encoder.encode(_canon(dump_value(value, "input")))


def digest(value: Any) -> str:
    """Hex sha256 of `canonical(value)`: a stable id for a workflow input."""
    return hashlib.sha256(canonical(value)).hexdigest()


def to_iso(dt: _dt.datetime) -> str:
    """ISO 8601 text of an aware datetime (offset included); refuses naive datetimes."""
    try:
        return _tag_dt(dt)[DT_TAG]
    except _Reject as exc:
        raise SerializationError(f"cannot record datetime: it is {exc.what}", hint=exc.hint, path="datetime") from None


def from_iso(s: str) -> _dt.datetime:
    """Parse ISO 8601 text (as written by `to_iso`; a trailing "Z" is accepted) into a datetime."""
    return _datetime.fromisoformat(s)


def _type_name(cls: type) -> str:
    """`module:qualname` of a class, the form `load_error` resolves."""
    return f"{cls.__module__}:{cls.__qualname__}"


def _exc_text(exc: BaseException) -> str:
    """`str(exc)`, surviving a broken `__str__`."""
    try:
        return str(exc)
    except Exception:
        return f"<unprintable {type(exc).__name__}>"


_INTERNAL = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(asyncio.__file__) + os.sep,
    os.path.dirname(concurrent.futures.__file__) + os.sep,
)


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback without its leading library frames (the kernel, asyncio, the thread pool), if any remain."""
    start = tb
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_INTERNAL):
        tb = tb.tb_next
    return tb if tb is not None else start


def dump_error(exc: BaseException) -> dict[str, Any]:
    """Wire form of a failure: class path, message, formatted traceback, JSON-able args and public attributes."""
    try:
        tb = "".join(traceback.format_exception(type(exc), exc, _user_frames(exc.__traceback__)))
    except Exception:
        tb = f"{type(exc).__name__}: {_exc_text(exc)}\n"
    attrs: dict[str, Any] = {}
    for name, value in (getattr(exc, "__dict__", None) or {}).items():
        if type(name) is not str or name.startswith("_"):
            continue
        try:
            attrs[name] = dump_value(value, name)
        except SerializationError:
            continue
    data: dict[str, Any] = {
        "type": _type_name(type(exc)),
        "message": _exc_text(exc),
        "traceback": tb,
        "attrs": attrs,
    }
    try:
        data["args"] = dump_value(list(exc.args), "args")
    except (SerializationError, TypeError):
        pass
    return data


def _resolve(type_name: str) -> type[Exception]:
    """The exception class named `module:qualname` in a module the program has already imported.

    Raises if the module is not loaded, the class is gone, or it is not an `Exception` subclass. A log never
    decides what code is imported: a recorded type from a module nobody imported stays a `StepFailedError`."""
    module_name, _, qualname = type_name.partition(":")
    if not module_name or not qualname:
        raise LookupError(type_name)
    obj: Any = sys.modules.get(module_name)
    if obj is None:
        raise LookupError(f"module {module_name!r} is not imported")
    for part in qualname.split("."):
        if not isinstance(obj, type | types.ModuleType):
            raise LookupError(type_name)
        obj = vars(obj).get(part) if isinstance(obj, types.ModuleType) else getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Exception)):
        raise TypeError(f"{type_name} is not an Exception subclass")
    return obj


def _rebuild(cls: type[Exception], message: str, args: list[Any] | None, attrs: dict[str, Any]) -> Exception:
    """Rebuild `cls` from recorded data: the first constructor whose `str()` matches, else the first that works."""
    attempts: list[Any] = []
    if issubclass(cls, DurablyError):
        hint, docs, details = attrs.get("hint"), attrs.get("docs"), attrs.get("details")
        if isinstance(details, dict) and details:
            attempts.append(lambda: cls(message, hint=hint, docs=docs, **details))
        attempts.append(lambda: cls(message, hint=hint, docs=docs))
    if args is not None:
        attempts.append(lambda: cls(*args))
    attempts.append(lambda: cls(message))
    built: Exception | None = None
    failure: Exception | None = None
    for attempt in attempts:
        try:
            exc = attempt()
        except Exception as err:
            failure = err
            continue
        if not isinstance(exc, Exception):
            continue
        if _exc_text(exc) == message:
            return exc
        if built is None:
            built = exc
    if built is None:
        raise TypeError(f"cannot rebuild {cls!r}") from failure
    return built


def load_error(data: dict[str, Any]) -> BaseException:
    """Rebuild a recorded failure as its own class when possible, else as a `StepFailedError` describing it."""
    type_name = str(data.get("type") or "builtins:Exception")
    message = str(data.get("message") or "")
    tb = str(data.get("traceback") or "")
    raw_attrs = data.get("attrs")
    attrs = load_value(raw_attrs) if type(raw_attrs) is dict else {}
    raw_args = data.get("args")
    args = load_value(raw_args) if type(raw_args) is list else None
    exc: Exception
    try:
        exc = _rebuild(_resolve(type_name), message, args, attrs)
    except Exception:
        exc = StepFailedError(f"{type_name}: {message}", type_name=type_name, traceback=tb)
        exc.original_message = message
    else:
        for name, value in attrs.items():
            try:
                setattr(exc, name, value)
            except Exception:
                continue
    try:
        exc.remote_traceback = tb  # type: ignore[attr-defined]
        if tb:
            exc.add_note("recorded traceback:\n" + tb.rstrip("\n"))
    except Exception:
        pass
    return exc
