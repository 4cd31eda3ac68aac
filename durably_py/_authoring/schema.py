"""Typed boundaries: compile `schema=` / `input=` / `output=` options once, then convert values across them.

A spec is one of
  * a type msgspec can convert to (Struct, dataclass, TypedDict, NamedTuple, `list[int]`,
    `dict[str, float]`, `int | None`, Literal, Enum, datetime, Annotated constraints, ...);
  * a pydantic model class (v2 `model_validate`, v1 `parse_obj`), a pydantic v2 dataclass or a
    `pydantic.TypeAdapter` -- detected by attributes, so pydantic is never imported by this module
    unless the spec itself came from it;
  * any other callable `f(value) -> converted`, which raises on bad data.

Conversion from stored builtins uses msgspec's *lax* mode (`strict=False`). Stored values are JSON
plus datetime, so lax mode is required to read back what `to_builtins` wrote: dict keys become strings
(`dict[int, str]` needs "1" -> 1) and non-JSON scalars become strings or numbers. Lax mode also accepts
the loosely typed data that arrives from a CLI `--input`, a webhook or a signal ("42" for an int, an ISO
string or a unix timestamp for a datetime). Well-typed values convert identically in both modes, and lossy
coercions (1.5 -> int, "abc" -> int) are still rejected.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import re
import typing
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import msgspec.inspect as mi

from ..errors import SerializationError, ValidationError

__all__ = ["JSON_SCHEMA_MAX", "Schema", "compile_schema", "to_builtins"]

JSON_SCHEMA_MAX = 65_536
"""Bytes a spec's JSON Schema may take to be recorded with a wait (a larger one is left out: no form)."""

_KEEP_TYPES = (datetime.datetime,)
_UNKNOWN = object()
_CACHE: dict[Any, Schema] = {}
_BASE: dict[Any, Schema] = {}
_CACHE_MAX = 2048
_AT = re.compile(r"^(?P<detail>.*) - at `(?P<key>key` in `)?\$(?P<suffix>[^`]*)`$", re.DOTALL)
_QUALIFIER = re.compile(r"\b(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_])")
_BAD_DATA_HINT = (
    "Make the data at the named path match the declared type, or loosen the schema "
    "(e.g. make the field optional or give it a default)."
)
_SPEC_HINT = (
    "Pass a type (int, list[str], a msgspec.Struct, a dataclass, a TypedDict), a pydantic model class, "
    "or a function `value -> converted value` that raises on bad data."
)


class Schema:
    """A compiled spec: `convert` turns stored builtins into the declared type, `to_builtins` goes back."""

    __slots__ = ("spec", "where", "kind", "name", "_json_schema")

    def __init__(self, spec: Any, where: str, kind: str, name: str) -> None:
        self.spec = spec
        self.where = where
        self.kind = kind
        self.name = name
        self._json_schema: Any = _UNKNOWN

    def json_schema(self) -> dict[str, Any] | None:
        """The spec's JSON Schema (computed once), or None when it has none a form could use.

        Recorded with a `ctx.wait_for` so the console can render the wait as a form and check a submitted
        value without importing the workflow's code. msgspec types get `msgspec.json.schema`, pydantic specs
        their own `model_json_schema` / `TypeAdapter.json_schema`; a validator function has none, and neither
        has a spec whose schema cannot be built or is larger than `JSON_SCHEMA_MAX` bytes."""
        if self._json_schema is _UNKNOWN:
            try:
                found = self._build_json_schema()
                if found is not None and len(msgspec.json.encode(found)) > JSON_SCHEMA_MAX:
                    found = None
            except Exception:
                found = None
            self._json_schema = found
        return self._json_schema

    def _build_json_schema(self) -> dict[str, Any] | None:
        """The JSON Schema of the spec, or None (a validator function: nothing to describe)."""
        return None

    def convert(self, value: Any, path: str) -> Any:
        """Return `value` (JSON types plus datetime) as the declared type; raise ValidationError naming the path."""
        raise NotImplementedError

    def to_builtins(self, value: Any, *, path: str = "value") -> Any:
        """Return `value` as JSON types plus datetime, ready to store; `convert` of it rebuilds an equal value."""
        return _to_builtins(value, path, self.where)

    def rebind(self, where: str) -> Schema:
        """The same compiled schema, reporting errors for another option."""
        clone = copy.copy(self)
        clone.where = where
        return clone

    def __repr__(self) -> str:
        return f"<Schema {self.kind} {self.name} for {self.where}>"

    def _invalid(self, exc: BaseException, path: str) -> ValidationError:
        """Build the ValidationError for data `exc` rejected at `path`."""
        full_path, detail = _describe(exc, path)
        return ValidationError(
            f"invalid value at {full_path}: {detail} ({self.where} expects {self.name})",
            hint=_BAD_DATA_HINT,
            path=full_path,
            expected=self.name,
            where=self.where,
        )


class _TypeSchema(Schema):
    """A type msgspec converts to."""

    __slots__ = ()

    def _build_json_schema(self) -> dict[str, Any] | None:
        """msgspec's JSON Schema of the type."""
        return msgspec.json.schema(self.spec)

    def convert(self, value: Any, path: str) -> Any:
        """Return `value` converted by msgspec in lax mode."""
        try:
            return msgspec.convert(value, self.spec, strict=False)
        except msgspec.ValidationError as exc:
            raise self._invalid(exc, path) from exc


class _PydanticSchema(Schema):
    """A pydantic model class, pydantic dataclass or TypeAdapter."""

    __slots__ = ("_validate", "_dump")

    def __init__(self, spec: Any, where: str, name: str, validate: Callable[[Any], Any], dump: Callable[[Any], Any]) -> None:
        super().__init__(spec, where, "pydantic", name)
        self._validate = validate
        self._dump = dump

    def _build_json_schema(self) -> dict[str, Any] | None:
        """pydantic's JSON Schema (validation mode) of the model, dataclass or adapter."""
        spec: Any = self.spec
        model_schema = getattr(spec, "model_json_schema", None)
        if isinstance(spec, type) and callable(model_schema):
            return model_schema()
        if callable(getattr(spec, "json_schema", None)):
            return spec.json_schema()
        if dataclasses.is_dataclass(spec):
            import pydantic

            return pydantic.TypeAdapter(spec).json_schema()
        v1_schema = getattr(spec, "schema_json", None)
        if isinstance(spec, type) and callable(v1_schema):
            return json.loads(v1_schema())  # pydantic v1
        return None

    def convert(self, value: Any, path: str) -> Any:
        """Return `value` validated by pydantic."""
        try:
            return self._validate(value)
        except Exception as exc:
            raise self._invalid(exc, path) from exc

    def to_builtins(self, value: Any, *, path: str = "value") -> Any:
        """Return pydantic's JSON-mode dump of `value`, or the generic conversion for non-model values."""
        try:
            dumped = self._dump(value)
        except Exception as exc:
            raise SerializationError(
                f"cannot store {path} for {self.where}: pydantic could not dump {type(value).__name__}: {exc}",
                path=path,
            ) from exc
        return _to_builtins(dumped, path, self.where)


class _CallableSchema(Schema):
    """A plain validator function."""

    __slots__ = ()

    def convert(self, value: Any, path: str) -> Any:
        """Return the validator's result; any exception it raises becomes a ValidationError."""
        try:
            return self.spec(value)
        except Exception as exc:
            raise self._invalid(exc, path) from exc


def compile_schema(spec: Any, where: str) -> Schema | None:
    """Compile `spec` once (cached), failing now rather than at the first value; `where` names the option."""
    if spec is None:
        return None
    if isinstance(spec, Schema):
        return spec
    try:
        cached = _CACHE.get((spec, where))
        spec_key: Any = spec
    except TypeError:
        spec_key = ("#id", id(spec))
        cached = _CACHE.get((spec_key, where))
    if cached is not None:
        return cached
    base = _BASE.get(spec_key)
    if base is None:
        base = _build(spec, where)
        _store(_BASE, spec_key, base)
    schema = base if base.where == where else base.rebind(where)
    _store(_CACHE, (spec_key, where), schema)
    return schema


def _store(cache: dict[Any, Schema], key: Any, schema: Schema) -> None:
    """Put `schema` in a bounded cache, cleared when full; an id key stays valid because the entry holds the spec."""
    if len(cache) >= _CACHE_MAX:
        cache.clear()
    cache[key] = schema


def to_builtins(value: Any, *, path: str = "value") -> Any:
    """Return `value` (Struct, dataclass, NamedTuple, Enum, pydantic model...) as JSON types plus datetime."""
    return _to_builtins(value, path, None)


def _build(spec: Any, where: str) -> Schema:
    """Decide what kind of spec this is and build its Schema, or raise ValidationError."""
    pydantic_schema = _pydantic_schema(spec, where)
    if pydantic_schema is not None:
        return pydantic_schema
    try:
        info = mi.type_info(spec)
    except Exception as exc:
        if _looks_like_type(spec):
            raise ValidationError(
                f"{where}: msgspec cannot convert to {_type_name(spec)} ({exc})",
                hint=_SPEC_HINT,
                where=where,
            ) from exc
        if callable(spec):
            return _CallableSchema(spec, where, "callable", _callable_name(spec))
        hint = _SPEC_HINT
        if isinstance(spec, str):
            hint = f"Names are not resolved: pass the type itself (e.g. `{spec}`, not `{spec!r}`). " + _SPEC_HINT
        raise ValidationError(
            f"{where} must be a type, a pydantic model class or a callable validator; "
            f"got {spec!r} ({type(spec).__name__})",
            hint=hint,
            where=where,
        ) from None
    name = _type_name(spec)
    unsupported = _unsupported_class(info, set())
    if unsupported is not None:
        inside = "" if unsupported is spec else f" (inside {name})"
        raise ValidationError(
            f"{where}: msgspec cannot build a {unsupported.__qualname__} from stored JSON{inside}",
            hint=_unsupported_hint(unsupported),
            where=where,
        )
    try:
        msgspec.convert(None, spec, strict=False)
    except msgspec.ValidationError:
        pass
    except Exception as exc:
        raise ValidationError(f"{where}: msgspec cannot convert to {name} ({exc})", hint=_SPEC_HINT, where=where) from exc
    return _TypeSchema(spec, where, "type", name)


def _unsupported_hint(cls: type) -> str:
    """The hint for a class msgspec cannot build."""
    name = cls.__qualname__
    if _pydantic_schema(cls, "") is not None:
        return (
            f"msgspec types cannot contain the pydantic model {name}: use a pydantic model at the top level, "
            f"or `pydantic.TypeAdapter(...)` of the whole type as the spec."
        )
    return (
        f"Make {name} a msgspec.Struct, dataclass, TypedDict or pydantic model, "
        f"or pass a function such as `lambda v: {name}(**v)` as the validator."
    )


def _pydantic_schema(spec: Any, where: str) -> Schema | None:
    """Return a Schema for pydantic specs (detected by attributes, without importing pydantic), else None."""
    if isinstance(spec, type):
        model: Any = spec
        if callable(getattr(spec, "model_validate", None)) and callable(getattr(spec, "model_dump", None)):
            return _PydanticSchema(spec, where, spec.__qualname__, model.model_validate, _model_dumper(spec))
        if callable(getattr(spec, "parse_obj", None)) and hasattr(spec, "__fields__"):
            return _PydanticSchema(spec, where, spec.__qualname__, model.parse_obj, _v1_dumper(spec))
        if dataclasses.is_dataclass(spec) and hasattr(spec, "__pydantic_validator__"):
            import pydantic

            return _adapter_schema(pydantic.TypeAdapter(spec), spec, where, spec.__qualname__)
        return None
    if callable(getattr(spec, "validate_python", None)) and callable(getattr(spec, "dump_python", None)):
        return _adapter_schema(spec, spec, where, _type_name(getattr(spec, "_type", spec)))
    return None


def _adapter_schema(adapter: Any, spec: Any, where: str, name: str) -> Schema:
    """Return a Schema validating and dumping through a pydantic TypeAdapter."""
    return _PydanticSchema(spec, where, name, adapter.validate_python, lambda v: adapter.dump_python(v, mode="json"))


def _model_dumper(model: type) -> Callable[[Any], Any]:
    """Return a dump function for a pydantic v2 model class."""

    def dump(value: Any) -> Any:
        return value.model_dump(mode="json") if isinstance(value, model) else value  # type: ignore[attr-defined]

    return dump


def _v1_dumper(model: type) -> Callable[[Any], Any]:
    """Return a dump function for a pydantic v1 model class (JSON round trip: v1 has no JSON-mode dict)."""

    def dump(value: Any) -> Any:
        return json.loads(value.json()) if isinstance(value, model) else value  # type: ignore[attr-defined]

    return dump


def _enc_hook(obj: Any) -> Any:
    """Dump pydantic models met inside other values; reject everything else msgspec cannot encode."""
    if callable(getattr(obj, "model_dump", None)) and hasattr(type(obj), "model_fields"):
        return obj.model_dump(mode="json")
    if callable(getattr(obj, "json", None)) and hasattr(type(obj), "__fields__"):
        return json.loads(obj.json())
    raise TypeError(f"Encoding objects of type {type(obj).__qualname__} is unsupported")


def _raw_builtins(value: Any) -> Any:
    """msgspec.to_builtins with datetime kept and dict keys as strings."""
    return msgspec.to_builtins(value, builtin_types=_KEEP_TYPES, str_keys=True, enc_hook=_enc_hook)


def _to_builtins(value: Any, path: str, where: str | None) -> Any:
    """Convert to builtins, raising SerializationError naming the first part that cannot be stored."""
    try:
        return _raw_builtins(value)
    except Exception as exc:
        bad_path, bad = _locate(value, path, 0)
        context = f" for {where}" if where else ""
        raise SerializationError(
            f"cannot store {bad_path}{context}: {type(bad).__qualname__} is not convertible to JSON types ({exc})",
            path=bad_path,
        ) from exc


def _locate(value: Any, path: str, depth: int) -> tuple[str, Any]:
    """Find the deepest part of `value` that does not convert (slow; error path only)."""
    if depth > 50:
        return path, value
    children: Iterable[tuple[str, Any]] = ()
    if isinstance(value, dict):
        children = ((f"{path}.{k}" if isinstance(k, str) else f"{path}[{k!r}]", v) for k, v in value.items())
    elif isinstance(value, list | tuple | set | frozenset):
        children = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    elif isinstance(value, msgspec.Struct):
        children = ((f"{path}.{f}", getattr(value, f)) for f in value.__struct_fields__)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        children = ((f"{path}.{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value))
    for child_path, child in children:
        try:
            _raw_builtins(child)
        except Exception:
            return _locate(child, child_path, depth + 1)
    return path, value


def _unsupported_class(info: Any, seen: set[int]) -> type | None:
    """Return the first class in a msgspec type tree that msgspec can only pass through, never build."""
    if isinstance(info, mi.CustomType):
        return None if info.cls is object else info.cls
    if id(info) in seen:
        return None
    seen.add(id(info))
    for field_name in info.__struct_fields__:
        attr = getattr(info, field_name)
        for item in attr if isinstance(attr, tuple) else (attr,):
            node = item.type if isinstance(item, mi.Field) else item
            if isinstance(node, mi.Type):
                found = _unsupported_class(node, seen)
                if found is not None:
                    return found
    return None


def _describe(exc: BaseException, path: str) -> tuple[str, str]:
    """Return (full path, detail) for an error from msgspec, pydantic or a validator."""
    base = path or "$"
    if isinstance(exc, msgspec.ValidationError):
        match = _AT.match(str(exc))
        if match is None:
            return base, str(exc)
        detail = match["detail"] + (" (in a dict key)" if match["key"] else "")
        return base + match["suffix"], detail
    errors = getattr(exc, "errors", None)
    if callable(errors) and isinstance(exc, ValueError):
        try:
            items = list(errors())
        except Exception:
            items = []
        if items:
            parts = [(base + _loc_suffix(item.get("loc", ())), str(item.get("msg", ""))) for item in items]
            first_path = parts[0][0]
            detail = "; ".join(msg if p == first_path else f"{p}: {msg}" for p, msg in parts[:5])
            if len(parts) > 5:
                detail += f"; and {len(parts) - 5} more"
            return first_path, detail
    return base, f"{type(exc).__name__}: {exc}"


def _loc_suffix(loc: Any) -> str:
    """Render a pydantic error location tuple as `.field[0]`."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)


def _looks_like_type(spec: Any) -> bool:
    """True for classes and typing constructs, which must never fall back to being called as validators."""
    return (
        isinstance(spec, type)
        or typing.get_origin(spec) is not None
        or getattr(spec, "__module__", None) == "typing"
    )


def _type_name(spec: Any) -> str:
    """A short readable name for a type: `Order`, `list[Item]`, `int | None`."""
    if isinstance(spec, type) and typing.get_origin(spec) is None:
        return spec.__qualname__
    return _QUALIFIER.sub("", repr(spec))


def _callable_name(spec: Any) -> str:
    """A readable name for a validator function or callable object."""
    return getattr(spec, "__qualname__", None) or getattr(spec, "__name__", None) or type(spec).__qualname__
