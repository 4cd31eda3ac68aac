"""Check a JSON value against a recorded JSON Schema, without the type it was made from.

A `ctx.wait_for(name, schema=...)` records its spec's JSON Schema (`Schema.json_schema`) in its `wait` record,
so the console can check a value a person submits before it becomes a signal, without importing the
workflow's code. This is the part of JSON Schema (2020-12) that msgspec and pydantic write: `type`, `enum`,
`const`, `properties`, `required`, `additionalProperties`, `items`, `prefixItems`, `minItems`, `maxItems`,
`uniqueItems`, `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`, `multipleOf`, `minLength`,
`maxLength`, `pattern`, the `date-time` / `date` / `time` / `uuid` formats, `anyOf`, `oneOf`, `allOf`, `not`
and local `$ref`s (`#/$defs/...`, `#/definitions/...`). Other keywords (titles, defaults, descriptions)
describe and do not constrain. The check is strict JSON, as a form sends it ("42" is not an integer); the
workflow still converts the value with its own schema when it reads the signal.
"""

from __future__ import annotations

import datetime
import math
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Problem", "check"]

_MAX_DEPTH = 64
_WANTED = re.compile(r"^expected (.*)[;,] got ", re.DOTALL)


@dataclass(frozen=True)
class Problem:
    """Why a value does not fit: where (`$.amount`, `$.items[2]`), the top-level field it is in, and what."""

    path: str
    field: str | None
    detail: str

    def text(self) -> str:
        """`invalid value at $.amount: expected a number >= 1, got 0`."""
        return f"invalid value at {self.path}: {self.detail}"


def check(schema: Any, value: Any) -> Problem | None:
    """The first reason `value` does not fit `schema`, or None when it fits (a schema of `{}` or `true` takes
    anything)."""
    found = _Checker(schema if isinstance(schema, dict) else {}).check(schema, value, (), 0)
    if found is None:
        return None
    where, detail = found
    field = where[0] if where and isinstance(where[0], str) else None
    return Problem(_render(where), field, detail)


def _render(where: tuple[str | int, ...]) -> str:
    """`("items", 2, "name")` as `$.items[2].name`."""
    return "$" + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in where)


_Found = tuple[tuple[str | int, ...], str] | None


def _type_of(value: Any) -> str:
    """The JSON type name of a decoded JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _is(kind: str, value: Any) -> bool:
    """True when `value` is of JSON Schema type `kind` (1.0 is an integer; a boolean is not a number)."""
    actual = _type_of(value)
    if kind == "number":
        return actual in ("integer", "number") and (actual == "integer" or math.isfinite(value))
    if kind == "integer":
        return actual == "integer" or (actual == "number" and math.isfinite(value) and float(value).is_integer())
    return actual == kind


_A = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
      "null": "null", "array": "a list", "object": "an object"}


_NOUN = {**_A, "boolean": "a boolean", "null": "null"}


def _show(value: Any) -> str:
    """A short rendering of a submitted value for a message: JSON-like, long ones cut."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = '"' + value.replace('"', '\\"') + '"'
    elif isinstance(value, dict | list):
        text = repr(value) if len(repr(value)) <= 40 else _A[_type_of(value)]
    else:
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _time_format(fmt: str) -> Callable[[str], Any] | None:
    """The parser that checks a string `format`, for the formats a form may meet; None for the others."""
    def date_time(text: str) -> Any:
        if "T" not in text.upper() and " " not in text:
            raise ValueError(text)
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))

    return {"date-time": date_time, "date": datetime.date.fromisoformat,
            "time": lambda t: datetime.time.fromisoformat(t.replace("Z", "+00:00")), "uuid": uuid.UUID}.get(fmt)


class _Checker:
    """One check of a value against a schema document (its root holds the `$defs` refs point at)."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root

    def resolve(self, ref: str) -> Any:
        """The schema a local `$ref` names; a ref that leads nowhere constrains nothing."""
        if not ref.startswith("#"):
            return {}
        node: Any = self.root
        for part in ref[1:].split("/"):
            if not part:
                continue
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return {}
            node = node[part]
        return node

    def check(self, schema: Any, value: Any, where: tuple[str | int, ...], depth: int) -> _Found:
        """The first misfit of `value` under `schema` at `where`, or None."""
        if schema is True or schema is None:
            return None
        if schema is False:
            return where, "no value is allowed here"
        if not isinstance(schema, dict) or depth > _MAX_DEPTH:
            return None
        if "$ref" in schema and isinstance(schema["$ref"], str):
            found = self.check(self.resolve(schema["$ref"]), value, where, depth + 1)
            if found is not None:
                return found
        for check in (self._choices, self._type, self._combined, self._number, self._string, self._array,
                      self._object):
            found = check(schema, value, where, depth)
            if found is not None:
                return found
        return None

    def _choices(self, schema: dict[str, Any], value: Any, where: tuple[str | int, ...], depth: int) -> _Found:
        if "const" in schema and not _same(value, schema["const"]):
            return where, f"expected {_show(schema['const'])}, got {_show(value)}"
        choices = schema.get("enum")
        if isinstance(choices, list) and not any(_same(value, choice) for choice in choices):
            shown = ", ".join(_show(c) for c in choices[:10]) + (", ..." if len(choices) > 10 else "")
            return where, f"expected one of {shown}; got {_show(value)}"
        return None

    def _type(self, schema: dict[str, Any], value: Any, where: tuple[str | int, ...], depth: int) -> _Found:
        kinds = schema.get("type")
        if kinds is None:
            return None
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        if any(_is(kind, value) for kind in kinds):
            return None
        wanted = " or ".join(_A.get(kind, str(kind)) for kind in kinds)
        actual = _type_of(value)
        shown = "" if actual in ("object", "array", "null") else f" {_show(value)}"
        return where, f"expected {wanted}, got {_NOUN.get(actual, actual)}{shown}"

    def _combined(self, schema: dict[str, Any], value: Any, where: tuple[str | int, ...], depth: int) -> _Found:
        for sub in schema.get("allOf") or ():
            found = self.check(sub, value, where, depth + 1)
            if found is not None:
                return found
        for key in ("anyOf", "oneOf"):
            options = schema.get(key)
            if not isinstance(options, list) or not options:
                continue
            misfits = [self.check(sub, value, where, depth + 1) for sub in options]
            fits = sum(found is None for found in misfits)
            if fits == 0:
                return _closest(misfits, where, value)
            if key == "oneOf" and fits > 1:
                return where, f"{_show(value)} fits more than one of the allowed shapes"
        if "not" in schema and self.check(schema["not"], value, where, depth + 1) is None:
            return where, f"{_show(value)} is not allowed here"
        return None

    def _number(self, schema: dict[str, Any], value: Any, where: tuple[str | int, ...], depth: int) -> _Found:
        if not _is("number", value):
            return None
        for key, fails, words in (("minimum", lambda x, n: x < n, ">="), ("maximum", lambda x, n: x > n, "<="),
                                  ("exclusiveMinimum", lambda x, n: x <= n, ">"),
                                  ("exclusiveMaximum", lambda x, n: x >= n, "<")):
            bound = schema.get(key)
            if isinstance(bound, int | float) and not isinstance(bound, bool) and fails(value, bound):
                return where, f"expected a number {words} {bound:g}, got {_show(value)}"
        step = schema.get("multipleOf")
        if isinstance(step, int | float) and not isinstance(step, bool) and step > 0:
            ratio = value / step
            if not math.isclose(ratio, round(ratio), rel_tol=0, abs_tol=1e-9):
                return where, f"expected a multiple of {step:g}, got {_show(value)}"
        return None

    def _string(self, schema: dict[str, Any], value: Any, where: tuple[str | int, ...], depth: int) -> _Found:
        if not isinstance(value, str):
            return None
        low, high = schema.get("minLength"), schema.get("maxLength")
        if isinstance(low, int) and len(value) < low:
            return where, f"expected at least {low} character{'s' if low != 1 else ''}, got {len(value)}"
        if isinstance(high, int) and len(value) > high:
            return where, f"expected at most {high} character{'s' if high != 1 else ''}, got {len(value)}"
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            try:
                matched = re.search(pattern, value) is not None
            except re.error:
                matched = True  # a pattern Python cannot read constrains nothing here; the workflow decides
            if not matched:
                return where, f"expected text matching {pattern!r}, got {_show(value)}"
        parse = _time_format(schema.get("format", "")) if isinstance(schema.get("format"), str) else None
        if parse is not None:
            try:
                parse(value)
            except ValueError:
                return where, f"expected a {schema['format']} string, got {_show(value)}"
        return None

    def _array(self, schema: dict[str, Any], value: Any, where: tuple[str | int, ...], depth: int) -> _Found:
        if not isinstance(value, list):
            return None
        low, high = schema.get("minItems"), schema.get("maxItems")
        if isinstance(low, int) and len(value) < low:
            return where, f"expected at least {low} item{'s' if low != 1 else ''}, got {len(value)}"
        if isinstance(high, int) and len(value) > high:
            return where, f"expected at most {high} item{'s' if high != 1 else ''}, got {len(value)}"
        prefix = schema.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        for i, item in enumerate(value):
            sub = prefix[i] if i < len(prefix) else schema.get("items", True)
            found = self.check(sub, item, (*where, i), depth + 1)
            if found is not None:
                return found
        if schema.get("uniqueItems") is True:
            for i, item in enumerate(value):
                if any(_same(item, other) for other in value[:i]):
                    return (*where, i), f"{_show(item)} is repeated; the items must differ"
        return None

    def _object(self, schema: dict[str, Any], value: Any, where: tuple[str | int, ...], depth: int) -> _Found:
        if not isinstance(value, dict):
            return None
        for name in schema.get("required") or ():
            if name not in value:
                return (*where, name), "a required field is missing"
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            if name in properties:
                found = self.check(properties[name], item, (*where, name), depth + 1)
            elif extra is False:
                allowed = ", ".join(sorted(properties)) or "none"
                return (*where, name), f"an unknown field (the fields are: {allowed})"
            else:
                found = self.check(extra, item, (*where, name), depth + 1)
            if found is not None:
                return found
        return None


def _closest(misfits: list[_Found], where: tuple[str | int, ...], value: Any) -> _Found:
    """The misfit of a failed `anyOf` to report: the one deepest inside the value (it got furthest), else one
    listing what would have fitted."""
    deepest = max((m for m in misfits if m is not None), key=lambda m: len(m[0]))
    if len(deepest[0]) > len(where):
        return deepest
    shapes = [_WANTED.match(m[1]) for m in misfits if m is not None]
    if all(shapes):
        wanted = dict.fromkeys(m.group(1) for m in shapes if m)
        return where, f"expected {' or '.join(wanted)}; got {_show(value)}"
    return deepest


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 equals 1.0, but true is not 1 and "1" is not 1."""
    ta, tb = _type_of(a), _type_of(b)
    numbers = ("integer", "number")
    if ta != tb and not (ta in numbers and tb in numbers):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)
