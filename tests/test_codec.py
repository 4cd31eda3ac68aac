"""Tests for durably_py._codec: wire form round-trips, refusals with exact paths, canonical identity, errors as data."""

from __future__ import annotations

import dataclasses
import decimal
import enum
import fractions
import pathlib
import random
import sys
import uuid
from collections import OrderedDict, namedtuple
from datetime import UTC, date, datetime, time, timedelta, timezone
from typing import Any

import msgspec
import pytest

from durably_py import _codec as codec
from durably_py._codec import (
    canonical,
    decode,
    decode_lines,
    digest,
    dump_error,
    dump_value,
    encode,
    encode_line,
    from_iso,
    load_error,
    load_value,
    to_iso,
)
from durably_py.errors import (
    DurablyError,
    SerializationError,
    StepFailedError,
    StepTimeoutError,
    ValidationError,
)

PLUS_0530 = timezone(timedelta(hours=5, minutes=30))
MINUS_8 = timezone(timedelta(hours=-8))
AWARE = datetime(2024, 3, 1, 12, 30, 15, 123456, tzinfo=UTC)
NAIVE = datetime(2024, 3, 1, 12, 30)


def through_json(value: Any) -> Any:
    """The value as a later process sees it: dumped, encoded, decoded, loaded."""
    return load_value(decode(encode(dump_value(value))))


def refusal(value: Any, where: str = "value") -> SerializationError:
    """The SerializationError dump_value raises for `value`."""
    with pytest.raises(SerializationError) as info:
        dump_value(value, where)
    return info.value


# --- round trips -------------------------------------------------------------------------------------------------


ROUND_TRIP_CASES = [
    None,
    True,
    False,
    0,
    -1,
    2**64 + 1,
    -(2**100),
    10**40,
    0.0,
    -0.0,
    1.5,
    1e300,
    -2.5e-300,
    "",
    "plain",
    'üñîçødé ✓ 日本語 \u0000 \n "quoted"',
    [],
    {},
    [1, "two", 3.0, None, True],
    {"a": {"b": {"c": [1, [2, [3, {"d": None}]]]}}},
    {"日本": 1, "clé": "valeur", "with space": [], "": "empty key"},
    AWARE,
    datetime(1999, 12, 31, 23, 59, 59, tzinfo=PLUS_0530),
    datetime(2030, 1, 1, tzinfo=MINUS_8),
    {"events": [{"at": AWARE, "kind": "start"}, {"at": AWARE + timedelta(days=1), "kind": "end"}]},
    {"$dt": "2024-01-01T00:00:00+00:00"},
    {"$dt": AWARE},
    {"$esc": 1},
    {"$esc": {"$dt": "x"}},
    {"$esc": {"$esc": {"$esc": None}}},
    [{"$dt": "not a date"}, {"$esc": [{"$dt": 5}]}],
    {"$dt": "x", "other": 1},
    {"$esc": 1, "$dt": 2},
    {"$other": 1},
]


@pytest.mark.parametrize("value", ROUND_TRIP_CASES, ids=repr)
def test_round_trip_in_memory_and_through_json(value: Any) -> None:
    assert load_value(dump_value(value)) == value
    assert through_json(value) == value


def test_round_trip_keeps_types_exactly() -> None:
    value = {"b": True, "i": 1, "f": 1.0, "n": None, "s": "1"}
    back = through_json(value)
    assert [type(back[k]) for k in "bifns"] == [bool, int, float, type(None), str]


def test_tuples_come_back_as_lists() -> None:
    value = {"pair": (1, 2), "nested": ((1, (2, 3)), [4, (5,)]), "empty": ()}
    expected = {"pair": [1, 2], "nested": [[1, [2, 3]], [4, [5]]], "empty": []}
    assert load_value(dump_value(value)) == expected
    assert through_json(value) == expected
    assert dump_value((1, 2)) == [1, 2]


def test_datetime_offset_is_preserved() -> None:
    for tz in (UTC, PLUS_0530, MINUS_8):
        dt = datetime(2024, 6, 1, 8, 0, 0, 5, tzinfo=tz)
        back = through_json({"when": dt})["when"]
        assert back == dt
        assert back.utcoffset() == dt.utcoffset()
        assert back.microsecond == 5


def test_datetime_wire_form_is_tagged_iso() -> None:
    assert dump_value(AWARE) == {"$dt": "2024-03-01T12:30:15.123456+00:00"}
    assert dump_value([AWARE]) == [{"$dt": AWARE.isoformat()}]


def test_zoneinfo_datetime_round_trips_as_same_instant() -> None:
    zoneinfo = pytest.importorskip("zoneinfo")
    try:
        paris = zoneinfo.ZoneInfo("Europe/Paris")
    except zoneinfo.ZoneInfoNotFoundError:
        pytest.skip("no tz database")
    dt = datetime(2024, 7, 1, 9, 0, tzinfo=paris)
    back = through_json(dt)
    assert back == dt
    assert back.utcoffset() == timedelta(hours=2)


def test_user_dicts_shaped_like_tags_are_escaped() -> None:
    assert dump_value({"$dt": "2024-01-01T00:00:00+00:00"}) == {"$esc": {"$dt": "2024-01-01T00:00:00+00:00"}}
    assert dump_value({"$esc": 1}) == {"$esc": {"$esc": 1}}
    assert dump_value({"$dt": AWARE}) == {"$esc": {"$dt": {"$dt": AWARE.isoformat()}}}
    assert dump_value({"$dt": 1, "x": 2}) == {"$dt": 1, "x": 2}
    back = load_value(dump_value({"$dt": "2024-01-01T00:00:00+00:00"}))
    assert back == {"$dt": "2024-01-01T00:00:00+00:00"}
    assert isinstance(back, dict)


def test_random_nested_values_round_trip() -> None:
    rng = random.Random(1234)
    keys = ["a", "b", "$dt", "$esc", "key with space", "ключ", "9lives", ""]

    def make(depth: int) -> Any:
        kind = rng.randrange(9 if depth < 4 else 6)
        if kind == 0:
            return rng.randrange(-(2**70), 2**70)
        if kind == 1:
            return rng.uniform(-1e9, 1e9)
        if kind == 2:
            return rng.choice([None, True, False])
        if kind == 3:
            return "".join(rng.choice('ab$é日 \n"\\') for _ in range(rng.randrange(6)))
        if kind == 4 or kind == 5:
            offset = timezone(timedelta(minutes=rng.randrange(-720, 720)))
            return datetime(2000, 1, 1, tzinfo=offset) + timedelta(seconds=rng.randrange(10**9), microseconds=7)
        if kind == 6:
            return [make(depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice(keys): make(depth + 1) for _ in range(rng.randrange(4))}

    for _ in range(500):
        value = make(0)
        assert load_value(dump_value(value)) == value
        assert through_json(value) == value


class Key(str):
    pass


class Count(int):
    pass


DUMP_OUTPUT_CASES = [
    *ROUND_TRIP_CASES,
    {"i": 1}, {"a": 1, "b": "x", "c": None, "d": True}, {"f": 1.5}, {"f": float("inf")}, {"big": 10**5000},
    {Key("k"): 1}, {"n": Count(3)}, {"t": (1, 2)}, {"$dt": 1}, {"$esc": "x"}, {"a": AWARE}, {1: "non-str key"},
    Count(3), Key("s"), 10**5000, float("nan"), (1, [2]), {"nested": {"x": [1, {"$dt": "y"}]}},
]


def short_id(value: Any) -> str:
    try:
        return repr(value)[:40]
    except ValueError:  # an int too long to print
        return f"{type(value).__name__} too long to print"


@pytest.mark.parametrize("value", DUMP_OUTPUT_CASES, ids=short_id)
def test_dump_output_is_dump_value_then_load_value(value: Any) -> None:
    """A live step's (wire, value) pair: the same as the dump/load round trip, refusals included, and neither half
    is the step's own object (the workflow can mutate what it got without touching the record)."""
    try:
        expected_wire = dump_value(value, "output")
    except SerializationError as exc:
        with pytest.raises(SerializationError) as raised:
            codec.dump_output(value)
        assert str(raised.value) == str(exc)
        return
    wire, back = codec.dump_output(value)
    assert wire == expected_wire and type(wire) is type(expected_wire)
    assert back == load_value(expected_wire) and type(back) is type(load_value(expected_wire))
    if isinstance(value, dict):
        assert wire is not value and back is not value and back is not wire
        assert [type(k) for k in wire] == [str] * len(wire)
        assert [type(x) for x in wire.values()] == [type(x) for x in expected_wire.values()]


def test_dump_does_not_alias_or_mutate_input() -> None:
    inner = [1, 2]
    value = {"inner": inner, "when": AWARE}
    wire = dump_value(value)
    assert wire["inner"] is not inner
    inner.append(3)
    assert wire["inner"] == [1, 2]
    assert value == {"inner": [1, 2, 3], "when": AWARE}


def test_subclasses_of_plain_types_become_plain() -> None:
    class Color(enum.IntEnum):
        RED = 1

    class Kind(enum.StrEnum):
        A = "a"

    class MyStr(str):
        pass

    class MyFloat(float):
        pass

    wire = dump_value({"c": Color.RED, "k": Kind.A, MyStr("key"): MyStr("v"), "f": MyFloat(2.5), "b": True})
    assert wire == {"c": 1, "k": "a", "key": "v", "f": 2.5, "b": True}
    assert [type(wire[k]) for k in ("c", "k", "key", "f", "b")] == [int, str, str, float, bool]
    assert all(type(k) is str for k in wire)
    od = OrderedDict([("x", 1)])
    assert dump_value({"od": od, "l": type("L", (list,), {})([1])}) == {"od": {"x": 1}, "l": [1]}


def test_scalars_are_returned_as_is() -> None:
    big = 10**50
    text = "x" * 100
    assert dump_value(big) is big
    assert dump_value(text) is text
    assert dump_value(True) is True
    assert load_value(text) is text


def test_deep_but_finite_nesting_is_fine() -> None:
    value: Any = "leaf"
    for i in range(150):
        value = {"n": value} if i % 2 else [value]
    assert load_value(dump_value(value)) == value


def test_load_value_rejects_malformed_tags() -> None:
    with pytest.raises(SerializationError):
        load_value({"$dt": 5})
    with pytest.raises(SerializationError):
        load_value({"$dt": "yesterday"})
    with pytest.raises(SerializationError):
        load_value({"$esc": [1]})


# --- refusals ----------------------------------------------------------------------------------------------------


def test_naive_datetime_path_in_nested_input() -> None:
    err = refusal({"items": [1, 2, 3, {"when": NAIVE}]}, "input")
    assert err.path == "input.items[3].when"
    assert "input.items[3].when" in str(err)
    assert "naive" in str(err)
    assert "timezone" in err.hint
    assert isinstance(err, TypeError)


def test_weird_keys_use_brackets() -> None:
    assert refusal({"weird key": {1, 2}}, "output").path == 'output["weird key"]'
    assert refusal({"9x": float("nan")}, "output").path == 'output["9x"]'
    assert refusal({'q"uote': set()}, "v").path == 'v["q\\"uote"]'
    assert refusal({"ok_name": [b"x"]}, "v").path == "v.ok_name[0]"
    assert refusal({"é": {"日本": set()}}, "v").path == "v.é.日本"
    assert refusal({"": set()}, "v").path == 'v[""]'


def test_escaped_user_dict_paths_use_user_keys() -> None:
    assert refusal({"$dt": set()}, "v").path == 'v["$dt"]'


def test_top_level_offender_path_is_where() -> None:
    assert refusal(set(), "input").path == "input"
    assert refusal(NAIVE).path == "value"


@pytest.mark.parametrize(
    ("value", "hint_word"),
    [
        (float("nan"), "NaN"),
        (float("inf"), "infinity"),
        (float("-inf"), "infinity"),
        ({1, 2}, "sorted list"),
        (frozenset({1}), "sorted list"),
        (b"raw", "decode"),
        (bytearray(b"raw"), "decode"),
        (memoryview(b"raw"), "decode"),
        (NAIVE, "timezone-aware"),
        (date(2024, 1, 1), "isoformat"),
        (time(12, 0), "isoformat"),
        (time(12, 0, tzinfo=UTC), "isoformat"),
        (decimal.Decimal("1.10"), "str(value)"),
        (fractions.Fraction(1, 3), "str(value)"),
        (uuid.UUID(int=5), "str(value)"),
        (pathlib.PurePosixPath("/tmp"), "str(value)"),
        (object(), "JSON types"),
        (timedelta(seconds=1), "JSON types"),
        (complex(1, 2), "JSON types"),
        (print, "JSON types"),
        (int, "JSON types"),
    ],
    ids=lambda v: repr(v).split(" at 0x")[0],  # no memory addresses: the same ids in every process
)
def test_each_offender_type_has_path_and_hint(value: Any, hint_word: str) -> None:
    err = refusal({"items": [0, {"x": value}]}, "input")
    assert err.path == "input.items[1].x"
    assert hint_word in err.hint
    assert err.path in str(err)


class Mood(enum.Enum):
    HAPPY = "happy"


@dataclasses.dataclass
class Point:
    x: int
    y: int


class Item(msgspec.Struct):
    name: str


Pair = namedtuple("Pair", "a b")


@pytest.mark.parametrize(
    ("value", "hint_word"),
    [
        (Mood.HAPPY, "value.value"),
        (Point(1, 2), "dataclasses.asdict"),
        (Item("x"), "msgspec.to_builtins"),
        (Pair(1, 2), "_asdict"),
    ],
    ids=repr,
)
def test_structured_objects_are_refused_with_conversion_hint(value: Any, hint_word: str) -> None:
    err = refusal([value], "output")
    assert err.path == "output[0]"
    assert hint_word in err.hint


def test_first_offender_wins_in_order() -> None:
    err = refusal({"a": [1, {"b": NAIVE}], "c": set()}, "input")
    assert err.path == "input.a[1].b"
    err = refusal([1, (2, [3, float("inf")]), set()], "input")
    assert err.path == "input[1][1][1]"
    err = refusal({"a": 1, 5: "x", "b": set()}, "input")
    assert err.path == "input"
    assert "non-str key 5" in str(err)


@pytest.mark.parametrize("key", [1, (1, 2), None, 1.5, True, b"k"], ids=repr)
def test_non_str_keys_are_refused_at_the_dict(key: Any) -> None:
    err = refusal({"outer": {key: 1}}, "input")
    assert err.path == "input.outer"
    assert "non-str key" in str(err)
    assert "str(k)" in err.hint


def test_self_containing_list_is_a_cycle() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    err = refusal({"data": loop}, "output")
    assert err.path == "output.data[1]"
    assert "contains itself" in str(err)
    assert "cycle" in err.hint


def test_indirect_dict_cycle() -> None:
    a: dict[str, Any] = {}
    b: dict[str, Any] = {"a": a}
    a["b"] = b
    err = refusal({"root": a}, "input")
    assert err.path == "input.root.b.a"
    assert "contains itself" in str(err)


def test_cycle_through_a_subclass() -> None:
    class D(dict):
        pass

    d = D()
    d["self"] = d
    assert refusal(d).path == "value.self"


def test_shared_non_cyclic_references_are_fine() -> None:
    shared = [1, 2]
    value = {"a": shared, "b": shared, "c": [shared, shared]}
    assert load_value(dump_value(value)) == {"a": [1, 2], "b": [1, 2], "c": [[1, 2], [1, 2]]}
    deep: Any = shared
    for _ in range(100):
        deep = [deep, shared]
    assert load_value(dump_value(deep)) == deep


def test_offender_below_fast_depth_limit_has_full_path() -> None:
    value: Any = {"bad": set()}
    for _ in range(100):
        value = [value]
    err = refusal(value, "v")
    assert err.path == "v" + "[0]" * 100 + ".bad"


def test_absurd_nesting_is_refused_not_crashing() -> None:
    value: Any = []
    for _ in range(sys.getrecursionlimit() * 2):
        value = [value]
    err = refusal(value, "input")
    assert err.path == "input"
    assert "deep" in str(err)


# --- encode / decode ---------------------------------------------------------------------------------------------


def test_encode_and_lines() -> None:
    wire = dump_value({"a": [1, 2.5, None, True], "é": "日本", "when": AWARE})
    data = encode(wire)
    assert isinstance(data, bytes)
    assert not data.endswith(b"\n")
    assert decode(data) == wire
    assert decode(data.decode()) == wire
    line = encode_line(wire)
    assert line == data + b"\n"
    records = [{"t": "run", "n": 1}, {"t": "step", "out": wire}, [1, 2], "s", None]
    blob = b"".join(encode_line(r) for r in records)
    assert decode_lines(blob) == records
    assert decode_lines(blob + b"\n\n") == records
    assert decode_lines(blob.rstrip(b"\n")) == records
    assert decode_lines(b"") == []


def test_decode_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        decode(b'{"a": ')
    with pytest.raises(ValueError):
        decode_lines(b'{"a": 1}\n{"a": \n')


def test_encode_refuses_non_wire_objects() -> None:
    with pytest.raises(SerializationError):
        encode({"x": object()})


def test_big_ints_survive_encoding() -> None:
    value = {"big": 2**200, "neg": -(2**100)}
    assert decode(encode(value)) == value


# --- canonical / digest ------------------------------------------------------------------------------------------


def test_canonical_key_order_never_matters() -> None:
    a = {"b": 1, "a": {"y": [1, {"q": 1, "p": 2}], "x": 2}}
    b = {"a": {"x": 2, "y": [1, {"p": 2, "q": 1}]}, "b": 1}
    assert canonical(a) == canonical(b)
    assert digest(a) == digest(b)
    assert canonical(a) == b'{"a":{"x":2,"y":[1,{"p":2,"q":1}]},"b":1}'


def test_canonical_none_entry_equals_absent_entry() -> None:
    assert canonical({"b": 1, "a": None}) == canonical({"b": 1})
    assert canonical({"a": {"b": None, "c": 1}}) == canonical({"a": {"c": 1}})
    assert canonical({"a": {"b": None}}) == canonical({"a": {}})
    assert canonical({"a": [{"x": None}]}) == canonical({"a": [{}]})
    assert canonical({"a": None}) == canonical({}) == b"{}"


def test_canonical_keeps_none_list_elements_and_distinctions() -> None:
    assert canonical([None, 1]) != canonical([1])
    assert canonical({"a": [None]}) != canonical({"a": []})
    assert canonical({"a": {}}) != canonical({})
    assert canonical({"a": 1}) != canonical({"a": "1"})
    assert canonical({"a": 1}) != canonical({"a": 1.0})
    assert canonical({"a": 1}) != canonical({"a": True})
    assert canonical([1, 2]) != canonical([2, 1])
    assert canonical(None) == b"null"
    assert canonical((1, 2)) == canonical([1, 2])


def test_canonical_keeps_escapes_correct_after_dropping_none() -> None:
    assert canonical({"$dt": "x", "other": None}) == canonical({"$dt": "x"})
    assert canonical({"$dt": "x"}) != canonical(datetime(2024, 1, 1, tzinfo=UTC))
    assert canonical({"$dt": None}) == canonical({})
    assert canonical({"$dt": "2024-01-01T00:00:00+00:00"}) != canonical(datetime(2024, 1, 1, tzinfo=UTC))
    assert canonical({"when": AWARE, "x": None}) == canonical({"when": AWARE})
    assert canonical({"a": 1, "$esc": None}) == canonical({"a": 1})


def test_canonical_datetimes_keep_their_offset() -> None:
    utc = datetime(2024, 1, 1, 12, tzinfo=UTC)
    same_instant = utc.astimezone(PLUS_0530)
    assert canonical(utc) != canonical(same_instant)
    assert canonical({"at": utc}) == canonical({"at": datetime(2024, 1, 1, 12, tzinfo=UTC)})


def test_digest_is_stable_hex_sha256() -> None:
    value = {"name": "nightly", "limit": 10, "since": datetime(2024, 1, 1, tzinfo=UTC), "tags": ["a", "b"]}
    first = digest(value)
    assert len(first) == 64
    assert int(first, 16) >= 0
    assert digest(value) == first
    assert digest(dict(reversed(list(value.items())))) == first
    assert digest({"": None}) == digest({})
    assert digest(None) == "74234e98afe7498fb5daf1f36ac2d78acc339464f950703b8c019892f982b90b"
    assert digest({"a": 1}) == "015abd7f5cc57a2dd94b7590f04ad8084273905ee33ec5cebeae62276a97f862"


def test_canonical_refuses_bad_input_with_input_path() -> None:
    with pytest.raises(SerializationError) as info:
        canonical({"items": [1, 2, 3, {"when": NAIVE}]})
    assert info.value.path == "input.items[3].when"
    with pytest.raises(SerializationError) as info:
        digest({"tags": {"a"}})
    assert info.value.path == "input.tags"


# --- iso helpers -------------------------------------------------------------------------------------------------


def test_iso_helpers() -> None:
    assert to_iso(AWARE) == "2024-03-01T12:30:15.123456+00:00"
    assert from_iso(to_iso(AWARE)) == AWARE
    dt = datetime(2024, 1, 1, tzinfo=PLUS_0530)
    assert from_iso(to_iso(dt)).utcoffset() == timedelta(hours=5, minutes=30)
    assert from_iso("2024-01-01T00:00:00Z") == datetime(2024, 1, 1, tzinfo=UTC)
    with pytest.raises(SerializationError):
        to_iso(NAIVE)


# --- errors ------------------------------------------------------------------------------------------------------


class InventoryError(Exception):
    """A module-level exception class the loader can import."""

    def __init__(self, sku: str, count: int) -> None:
        super().__init__(sku, count)
        self.sku = sku
        self.count = count
        self.seen_at = AWARE
        self.unjsonable = {1, 2}
        self._private = "hidden"

    def __str__(self) -> str:
        return f"sku {self.sku} has {self.count} left"


class QuotaError(DurablyError):
    """A module-level DurablyError subclass."""

    default_hint = "Wait for the quota to reset."
    anchor = "quotaerror"


class StrictError(DurablyError):
    """A DurablyError subclass whose constructor requires a detail."""

    def __init__(self, message: str, *, run_id: str, **kwargs: Any) -> None:
        super().__init__(message, run_id=run_id, **kwargs)


class Outer:
    class Nested(Exception):
        """An exception class resolved through a dotted qualname."""


def raised(exc: BaseException) -> BaseException:
    """`exc` after being raised and caught, so it carries a traceback."""
    try:
        raise exc
    except BaseException as caught:
        return caught


def round_trip_error(exc: BaseException) -> BaseException:
    """`exc` as a later process rebuilds it from the log."""
    return load_error(decode(encode(dump_error(exc))))


def test_dump_error_shape() -> None:
    exc = raised(ValueError("bad value"))
    data = dump_error(exc)
    assert data["type"] == "builtins:ValueError"
    assert data["message"] == "bad value"
    assert "Traceback (most recent call last)" in data["traceback"]
    assert "ValueError: bad value" in data["traceback"]
    assert data["attrs"] == {}
    assert data["args"] == ["bad value"]
    assert decode(encode(data)) == data


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("bad value"),
        KeyError("missing"),
        RuntimeError("boom"),
        TimeoutError("too slow"),
        LookupError(),
        ZeroDivisionError("division by zero"),
        OSError(2, "No such file or directory"),
        Exception("x", 1, None),
    ],
    ids=repr,
)
def test_builtin_errors_round_trip(exc: Exception) -> None:
    back = round_trip_error(raised(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert isinstance(back.remote_traceback, str)
    assert type(exc).__name__ in back.remote_traceback


def test_key_error_message_keeps_its_quotes() -> None:
    back = round_trip_error(KeyError("x"))
    assert str(back) == str(KeyError("x")) == "'x'"


def test_tuple_args_come_back_as_lists_but_class_is_kept() -> None:
    back = round_trip_error(KeyError(("a", 1)))
    assert type(back) is KeyError
    assert back.args == (["a", 1],)


def test_custom_error_round_trips_with_attributes() -> None:
    exc = raised(InventoryError("A-1", 0))
    data = dump_error(exc)
    assert data["type"] == f"{__name__}:InventoryError"
    assert data["attrs"] == {"sku": "A-1", "count": 0, "seen_at": {"$dt": AWARE.isoformat()}}
    back = round_trip_error(exc)
    assert type(back) is InventoryError
    assert str(back) == "sku A-1 has 0 left"
    assert back.sku == "A-1"
    assert back.count == 0
    assert back.seen_at == AWARE


def test_nested_class_resolves_by_qualname() -> None:
    back = round_trip_error(Outer.Nested("inside"))
    assert type(back) is Outer.Nested
    assert str(back) == "inside"


def test_durably_error_keeps_hint_docs_and_details() -> None:
    exc = raised(QuotaError("quota hit", hint="try tomorrow", resource="api", remaining=0))
    back = round_trip_error(exc)
    assert type(back) is QuotaError
    assert str(back) == "quota hit"
    assert back.hint == "try tomorrow"
    assert back.docs == "docs/errors.md#quotaerror"
    assert back.resource == "api"
    assert back.remaining == 0
    assert back.details == {"resource": "api", "remaining": 0}

    timeout = round_trip_error(StepTimeoutError("step fetch took 3s"))
    assert type(timeout) is StepTimeoutError
    assert isinstance(timeout, TimeoutError)
    assert timeout.hint == StepTimeoutError.default_hint


def test_durably_error_with_required_detail_is_rebuilt() -> None:
    back = round_trip_error(StrictError("lost", run_id="r-1", hint="h"))
    assert type(back) is StrictError
    assert back.run_id == "r-1"
    assert back.hint == "h"
    assert str(back) == "lost"


def test_serialization_error_round_trips_with_path() -> None:
    with pytest.raises(SerializationError) as info:
        dump_value({"a": set()}, "output")
    back = round_trip_error(info.value)
    assert type(back) is SerializationError
    assert back.path == "output.a"
    assert back.hint == info.value.hint


def local_failure() -> BaseException:
    class LocalOnly(Exception):
        pass

    return raised(LocalOnly("cannot import me"))


def test_unrebuildable_class_becomes_step_failed_error() -> None:
    exc = local_failure()
    data = dump_error(exc)
    assert "<locals>" in data["type"]
    back = load_error(data)
    assert type(back) is StepFailedError
    assert back.type_name == data["type"]
    assert back.original_message == "cannot import me"
    assert back.traceback == data["traceback"]
    assert back.remote_traceback == data["traceback"]
    assert str(back) == f"{data['type']}: cannot import me"
    assert "LocalOnly: cannot import me" in back.traceback


@pytest.mark.parametrize(
    "type_name",
    [
        "no_such_module_xyz:Boom",
        "builtins:NoSuchError",
        "builtins:len",
        "builtins:KeyboardInterrupt",
        "builtins:object",
        "missing-colon",
        f"{__name__}:Outer",
    ],
)
def test_unresolvable_or_non_exception_types_fall_back(type_name: str) -> None:
    back = load_error({"type": type_name, "message": "m", "traceback": "tb text", "attrs": {}})
    assert type(back) is StepFailedError
    assert back.type_name == type_name
    assert back.original_message == "m"
    assert back.traceback == "tb text"


def test_incompatible_constructor_falls_back() -> None:
    exc = raised(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"))
    data = dump_error(exc)
    assert "args" not in data
    back = load_error(data)
    assert type(back) is StepFailedError
    assert back.type_name == "builtins:UnicodeDecodeError"
    assert "invalid start byte" in str(back)


def test_rebuilt_error_carries_recorded_traceback_note() -> None:
    back = round_trip_error(raised(RuntimeError("boom")))
    assert back.__notes__[0].startswith("recorded traceback:\n")
    assert "RuntimeError: boom" in back.__notes__[0]


def test_step_failed_error_survives_another_round_trip() -> None:
    first = load_error(dump_error(local_failure()))
    second = round_trip_error(first)
    assert type(second) is StepFailedError
    assert str(second) == str(first)
    assert second.type_name == first.type_name
    assert second.original_message == "cannot import me"


def test_dump_error_survives_broken_str() -> None:
    class Broken(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    data = dump_error(Broken())
    assert data["message"] == "<unprintable Broken>"
    assert isinstance(load_error(data), BaseException)


def test_validation_error_is_rebuilt_as_itself() -> None:
    back = round_trip_error(ValidationError("bad arg", hint="fix it"))
    assert type(back) is ValidationError
    assert back.hint == "fix it"
    assert isinstance(back, ValueError)


def test_module_exports() -> None:
    for name in codec.__all__:
        assert callable(getattr(codec, name))


def test_load_value_copies_flat_containers_and_still_decodes_tags() -> None:
    from datetime import UTC, datetime

    from durably_py._codec import dump_value, load_value

    for wire in ({"a": 1, "b": "x", "c": 2.5, "d": None, "e": True}, [1, "x", 2.5, None], {"i": 1}):
        value = load_value(wire)
        assert value == wire and value is not wire  # the caller may mutate what a step returned
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert load_value(dump_value({"at": when})) == {"at": when}
    assert load_value(dump_value([when, {"$dt": "not a tag"}])) == [when, {"$dt": "not a tag"}]
