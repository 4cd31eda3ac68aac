"""Tests for durably_py._authoring.schema: compiling specs, converting stored values, and storing typed values."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import uuid
from decimal import Decimal
from typing import Annotated, Any, Literal, NamedTuple, Optional, TypedDict

import msgspec
import pytest

from durably_py._authoring.schema import Schema, compile_schema, to_builtins
from durably_py.errors import SerializationError, ValidationError

UTC = dt.UTC
WHERE = "schema of step 'fetch page'"


class Item(msgspec.Struct):
    name: str
    price: float


class Order(msgspec.Struct):
    id: int
    items: list[Item]
    placed_at: dt.datetime
    note: str | None = None


@dataclasses.dataclass
class Point:
    x: int
    y: int = 0


class Movie(TypedDict):
    title: str
    year: int


class Pair(NamedTuple):
    left: str
    right: int


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Plain:
    pass


def convert(spec: Any, value: Any, path: str = "output") -> Any:
    schema = compile_schema(spec, WHERE)
    assert schema is not None
    return schema.convert(value, path)


def roundtrip(spec: Any, live: Any) -> Any:
    schema = compile_schema(spec, WHERE)
    assert schema is not None
    stored = schema.to_builtins(live)
    return schema.convert(stored, "output")


# --- every supported kind converts ---------------------------------------------------------------


def test_none_passes_through() -> None:
    assert compile_schema(None, WHERE) is None


def test_struct() -> None:
    when = dt.datetime(2024, 5, 1, 12, tzinfo=UTC)
    order = convert(Order, {"id": 1, "items": [{"name": "a", "price": 2}], "placed_at": when})
    assert order == Order(id=1, items=[Item("a", 2.0)], placed_at=when)


def test_dataclass() -> None:
    assert convert(Point, {"x": 1}) == Point(1, 0)


def test_typeddict() -> None:
    assert convert(Movie, {"title": "Alien", "year": 1979}) == {"title": "Alien", "year": 1979}


def test_namedtuple() -> None:
    assert convert(Pair, ["a", 1]) == Pair("a", 1)


def test_list_and_dict() -> None:
    assert convert(list[int], [1, 2, 3]) == [1, 2, 3]
    assert convert(dict[str, float], {"a": 1, "b": 2.5}) == {"a": 1.0, "b": 2.5}


def test_optional() -> None:
    assert convert(Optional[int], None) is None  # noqa: UP045
    assert convert(int | None, 3) == 3


def test_literal_and_enum() -> None:
    assert convert(Literal["a", "b"], "b") == "b"
    assert convert(Color, "red") is Color.RED


def test_datetime_from_stored_datetime() -> None:
    when = dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert convert(dt.datetime, when) == when


def test_datetime_from_iso_string_and_lax_coercions() -> None:
    assert convert(dt.datetime, "2024-01-02T03:04:05Z") == dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert convert(int, "42") == 42
    assert convert(dict[int, str], {"1": "a"}) == {1: "a"}


def test_annotated_constraint() -> None:
    spec = Annotated[int, msgspec.Meta(ge=0)]
    assert convert(spec, 3) == 3
    with pytest.raises(ValidationError, match=">= 0"):
        convert(spec, -1)


def test_any_and_object_pass_through() -> None:
    value = {"anything": [1, "x"]}
    assert convert(Any, value) == value
    assert convert(object, value) == value


def test_lossy_coercion_still_rejected() -> None:
    with pytest.raises(ValidationError):
        convert(int, 1.5)
    with pytest.raises(ValidationError):
        convert(int, "abc")


# --- bad data names the path and the expected type ------------------------------------------------


def test_bad_data_names_path_and_type() -> None:
    value = {"id": 1, "items": [{"name": "a", "price": 1}, {"name": "b", "price": 2}, {"name": "c", "price": "x"}],
             "placed_at": "2024-01-01T00:00:00Z"}
    with pytest.raises(ValidationError) as info:
        convert(Order, value)
    err = info.value
    assert err.path == "output.items[2].price"
    assert "output.items[2].price" in str(err)
    assert "`float`" in str(err)
    assert "Order" in str(err) and err.expected == "Order"
    assert WHERE in str(err)
    assert err.hint
    assert isinstance(err.__cause__, msgspec.ValidationError)


def test_missing_field_and_root_path() -> None:
    with pytest.raises(ValidationError) as info:
        convert(Point, {"y": 1}, path="input")
    assert info.value.path == "input"
    assert "`x`" in str(info.value) and "Point" in str(info.value)


def test_bad_list_item_path() -> None:
    with pytest.raises(ValidationError) as info:
        convert(list[int], [1, "two", 3], path="result")
    assert info.value.path == "result[1]"
    assert "Expected `int`" in str(info.value)


def test_bad_dict_key() -> None:
    with pytest.raises(ValidationError, match="dict key"):
        convert(dict[int, str], {"one": "a"})


def test_bad_literal_names_expected_type() -> None:
    with pytest.raises(ValidationError) as info:
        convert(Literal["a", "b"], "c")
    assert "Literal['a', 'b']" in str(info.value)


# --- bad specs fail at compile time ---------------------------------------------------------------


@pytest.mark.parametrize("spec", [5, "int", 1.5, [int], {"a": int}])
def test_bad_spec_fails_early(spec: Any) -> None:
    with pytest.raises(ValidationError) as info:
        compile_schema(spec, WHERE)
    assert WHERE in str(info.value)
    assert info.value.hint


def test_string_spec_hint() -> None:
    with pytest.raises(ValidationError) as info:
        compile_schema("int", WHERE)
    assert "not resolved" in info.value.hint


@pytest.mark.parametrize("spec", [Plain, list[Plain], Optional[Plain], dict[str, Plain]])  # noqa: UP045
def test_unsupported_class_fails_early(spec: Any) -> None:
    with pytest.raises(ValidationError) as info:
        compile_schema(spec, WHERE)
    assert "Plain" in str(info.value)
    assert "lambda" in info.value.hint


def test_struct_with_unsupported_field_fails_early() -> None:
    @dataclasses.dataclass
    class Holder:
        thing: Plain

    with pytest.raises(ValidationError, match="Plain"):
        compile_schema(Holder, WHERE)


# --- callable validators --------------------------------------------------------------------------


def test_callable_validator_ok() -> None:
    schema = compile_schema(lambda v: int(v) * 2, WHERE)
    assert schema is not None and schema.kind == "callable"
    assert schema.convert("21", "output") == 42


def test_callable_validator_raising_is_wrapped() -> None:
    def positive(value: Any) -> int:
        if value <= 0:
            raise ValueError("must be positive")
        return value

    schema = compile_schema(positive, WHERE)
    assert schema is not None
    with pytest.raises(ValidationError) as info:
        schema.convert(-1, "input.n")
    err = info.value
    assert err.path == "input.n"
    assert "must be positive" in str(err) and "positive" in err.expected
    assert isinstance(err.__cause__, ValueError)


def test_callable_validator_using_msgspec_keeps_inner_path() -> None:
    schema = compile_schema(lambda v: msgspec.convert(v, list[int]), WHERE)
    assert schema is not None
    with pytest.raises(ValidationError) as info:
        schema.convert([1, "x"], "output")
    assert info.value.path == "output[1]"


def test_callable_object_validator() -> None:
    class Upper:
        def __call__(self, value: str) -> str:
            return value.upper()

    schema = compile_schema(Upper(), WHERE)
    assert schema is not None
    assert schema.convert("a", "x") == "A"


# --- to_builtins round trips ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "live"),
    [
        (Order, Order(1, [Item("a", 1.5)], dt.datetime(2024, 1, 1, tzinfo=UTC), note="n")),
        (Point, Point(3, 4)),
        (Movie, {"title": "Alien", "year": 1979}),
        (Pair, Pair("a", 1)),
        (list[int], [1, 2]),
        (dict[int, Color], {1: Color.RED, 2: Color.BLUE}),
        (int | None, None),
        (Literal["x"], "x"),
        (dt.datetime, dt.datetime(2024, 1, 1, 10, tzinfo=UTC)),
        (dt.date, dt.date(2024, 1, 1)),
        (Decimal, Decimal("1.25")),
        (uuid.UUID, uuid.UUID(int=7)),
        (bytes, b"\x00\x01"),
        (tuple[int, str], (1, "a")),
        (set[int], {1, 2}),
    ],
)
def test_roundtrip(spec: Any, live: Any) -> None:
    assert roundtrip(spec, live) == live


def test_to_builtins_keeps_datetime() -> None:
    when = dt.datetime(2024, 1, 1, tzinfo=UTC)
    stored = to_builtins(Order(1, [], when))
    assert stored == {"id": 1, "items": [], "placed_at": when, "note": None}
    assert isinstance(stored["placed_at"], dt.datetime)


def test_to_builtins_rejects_unknown_objects_with_path() -> None:
    with pytest.raises(SerializationError) as info:
        to_builtins({"a": [1, {"b": Plain()}]}, path="output")
    assert info.value.path == "output.a[1].b"
    assert "Plain" in str(info.value)


def test_schema_to_builtins_names_where() -> None:
    schema = compile_schema(dict[str, Any], WHERE)
    assert schema is not None
    with pytest.raises(SerializationError, match="fetch page"):
        schema.to_builtins({"x": Plain()})


# --- caching --------------------------------------------------------------------------------------


def test_compiled_schemas_are_cached() -> None:
    assert compile_schema(list[int], WHERE) is compile_schema(list[int], WHERE)
    assert compile_schema(Order, WHERE) is compile_schema(Order, WHERE)
    schema = compile_schema(Order, WHERE)
    assert compile_schema(schema, "elsewhere") is schema


def test_unhashable_callable_is_compiled() -> None:
    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, value: Any) -> Any:
            return value

    spec = Unhashable()
    schema = compile_schema(spec, WHERE)
    assert isinstance(schema, Schema)
    assert compile_schema(spec, WHERE) is schema
    assert schema.convert(1, "x") == 1


# --- pydantic -------------------------------------------------------------------------------------


def test_pydantic_v2_model() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Line(pydantic.BaseModel):
        sku: str
        qty: int

    class Cart(pydantic.BaseModel):
        lines: list[Line]
        at: dt.datetime

    schema = compile_schema(Cart, WHERE)
    assert schema is not None and schema.kind == "pydantic"
    cart = schema.convert({"lines": [{"sku": "a", "qty": "2"}], "at": "2024-01-01T00:00:00Z"}, "output")
    assert cart == Cart(lines=[Line(sku="a", qty=2)], at=dt.datetime(2024, 1, 1, tzinfo=UTC))
    assert schema.convert(schema.to_builtins(cart), "output") == cart

    with pytest.raises(ValidationError) as info:
        schema.convert({"lines": [{"sku": "a", "qty": 1}, {"sku": "b", "qty": "many"}], "at": "2024-01-01"}, "output")
    assert info.value.path == "output.lines[1].qty"
    assert "Cart" in str(info.value)
    assert isinstance(info.value.__cause__, pydantic.ValidationError)


def test_pydantic_v1_model() -> None:
    v1 = pytest.importorskip("pydantic.v1")

    class Legacy(v1.BaseModel):
        n: int

    schema = compile_schema(Legacy, WHERE)
    assert schema is not None and schema.kind == "pydantic"
    assert schema.convert({"n": "3"}, "x") == Legacy(n=3)
    assert schema.convert(schema.to_builtins(Legacy(n=4)), "x") == Legacy(n=4)
    with pytest.raises(ValidationError) as info:
        schema.convert({"n": "no"}, "x")
    assert info.value.path == "x.n"


def test_pydantic_type_adapter_and_dataclass() -> None:
    pydantic = pytest.importorskip("pydantic")

    @pydantic.dataclasses.dataclass
    class Temp:
        celsius: float

        @pydantic.field_validator("celsius")
        @classmethod
        def above_zero_kelvin(cls, v: float) -> float:
            if v < -273.15:
                raise ValueError("below absolute zero")
            return v

    schema = compile_schema(Temp, WHERE)
    assert schema is not None and schema.kind == "pydantic"
    assert schema.convert({"celsius": 3}, "x") == Temp(celsius=3.0)
    with pytest.raises(ValidationError, match="absolute zero"):
        schema.convert({"celsius": -300}, "x")

    adapter = pydantic.TypeAdapter(list[int])
    schema = compile_schema(adapter, WHERE)
    assert schema is not None
    assert schema.convert(["1", 2], "x") == [1, 2]


def test_pydantic_model_nested_in_msgspec_type_fails_early() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Inner(pydantic.BaseModel):
        a: int

    with pytest.raises(ValidationError) as info:
        compile_schema(list[Inner], WHERE)
    assert "TypeAdapter" in info.value.hint


def test_to_builtins_dumps_nested_pydantic_models() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Inner(pydantic.BaseModel):
        a: int

    assert to_builtins({"x": [Inner(a=1)]}) == {"x": [{"a": 1}]}


def test_same_spec_for_another_option_names_that_option() -> None:
    first = compile_schema(Point, "schema of step 'a'")
    second = compile_schema(Point, "schema of step 'b'")
    assert first is not None and second is not None and first is not second
    assert compile_schema(Point, "schema of step 'b'") is second
    with pytest.raises(ValidationError, match="step 'b'"):
        second.convert({}, "output")


def test_pydantic_schema_for_another_option() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Thing(pydantic.BaseModel):
        n: int

    first = compile_schema(Thing, "input schema of workflow 'w'")
    second = compile_schema(Thing, "output schema of workflow 'w'")
    assert first is not None and second is not None
    assert second.convert({"n": 1}, "result") == Thing(n=1)
    with pytest.raises(ValidationError, match="output schema"):
        second.convert({"n": "x"}, "result")
