"""The wire codec on a schema of its own: it derives checks and writers from any typed dataclasses, keeps a
struct's unknown keys, builds plain dataclasses through their __init__, decodes registered types with their
own functions and raises the schema's error naming the field. The event schema's use of it is in
test_events.py."""

from __future__ import annotations

import ast
import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest

from trainer.contract.codec import Codec, Form, Invalid, expected

ROOT = Path(__file__).resolve().parent.parent


class Bad(ValueError):
    pass


class Colour(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Money:
    cents: int


def money(x: Any) -> Money:
    if isinstance(x, Money):
        return x
    if not isinstance(x, str) or not x.endswith("$"):
        raise expected("an amount like 1.50$", x)
    return Money(round(float(x[:-1]) * 100))


CODEC = Codec(Bad)
CODEC.register(Money, decode=money, encode=lambda m: f"{m.cents / 100:.2f}$")


@dataclass
class Point:  # a plain dataclass: no `extra`, built by its __init__
    x: int
    y: int = 0
    pair: tuple[int, int] | None = None


@dataclass(frozen=True, kw_only=True)
class Base:
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        CODEC.validate(self)


CODEC.struct(Base)


@dataclass(frozen=True, kw_only=True)
class Item(Base):
    name: str
    price: Money
    colour: Colour | None = None
    weights: list[float] = field(default_factory=list)
    where: Point | None = None
    tags: dict[str, int | None] | None = None
    discount: float | None = None


@dataclass(frozen=True, kw_only=True)
class Message(Base):
    kind: ClassVar[str] = "order"
    v: int = 1
    items: list[Item]
    note: str | None = None
    meta: Any = None


CODEC.struct(Message, Form(first=("v", "kind"), omit_none=True, label="kind", noun="message"))


def test_a_struct_round_trips_with_its_tag_first_and_none_left_out():
    m = Message(
        items=[
            Item(
                name="pen",
                price=Money(150),
                colour=Colour.RED,
                weights=[1, 2.5],
                where=Point(x=1, pair=(2, 3)),
                tags={"a": 1, "b": None},
            )
        ]
    )
    d = CODEC.encode(m)
    assert list(d)[:2] == ["v", "kind"] and d["kind"] == "order" and "note" not in d and "meta" not in d
    item = d["items"][0]
    assert item == {
        "name": "pen",
        "price": "1.50$",
        "colour": "red",
        "weights": [1, 2.5],  # a record writes nulls
        "where": {"x": 1, "y": 0, "pair": [2, 3]},
        "tags": {"a": 1, "b": None},
        "discount": None,
    }
    assert type(item["weights"][0]) is int  # an int stays an int where a float is declared
    back = CODEC.decode(Message, json.loads(json.dumps(d)))
    assert back == m and "kind" not in back.extra  # the tag is the class's, not an unknown key
    assert CODEC.encode(back) == d


def test_unknown_keys_are_kept_by_a_struct_and_dropped_by_a_plain_dataclass():
    d = {
        "v": 1,
        "kind": "order",
        "items": [{"name": "pen", "price": "1$", "where": {"x": 1, "z": 9}, "size": "XL"}],
        "coupon": "SAVE",
    }
    m = CODEC.decode(Message, d)
    assert m.extra == {"coupon": "SAVE"} and m.items[0].extra == {"size": "XL"}
    assert m.items[0].where == Point(x=1)
    out = CODEC.encode(m)
    assert out["coupon"] == "SAVE" and out["items"][0]["size"] == "XL" and "z" not in out["items"][0]["where"]


def test_non_finite_floats_are_none_where_allowed_and_an_error_elsewhere():
    item = CODEC.decode(Item, {"name": "a", "price": "1$", "discount": float("inf")})
    assert item.discount is None
    assert Item(name="a", price=Money(1), discount=float("nan")).discount is None
    with pytest.raises(Bad, match=r"Item.weights: .* is not a finite number"):
        CODEC.decode(Item, {"name": "a", "price": "1$", "weights": [1.0, float("nan")]})


@pytest.mark.parametrize(
    "d, why",
    [
        ({"v": 1, "items": 3}, "order.items: expected a list, got int '3'"),
        ({"v": 1}, "order message missing items"),
        ({"v": 1, "items": [{"name": "a"}]}, "order.items: Item missing price"),
        ({"v": 1, "items": [{"name": "a", "price": 5}]}, r"order.items: Item.price: expected an amount like 1.50\$"),
        (
            {"v": 1, "items": [{"name": "a", "price": "1$", "colour": "green"}]},
            "Item.colour: expected one of red, blue",
        ),
        ({"v": 1, "items": [{"name": "a", "price": "1$", "where": {"y": 1}}]}, "Item.where: Point missing x"),
        (
            {"v": 1, "items": [{"name": "a", "price": "1$", "where": {"x": 1, "pair": [1]}}]},
            "Point.pair: expected a list of 2",
        ),
        ({"v": True, "items": []}, "order.v: expected an integer"),
        ({"v": 1, "items": [], "note": 5}, "order.note"),
        ({"v": 1, "items": [{"name": "a", "price": "1$", "tags": {"a": "x"}}]}, "Item.tags"),
    ],
)
def test_errors_name_the_field_and_use_the_schemas_error(d, why):
    with pytest.raises(Bad, match=why):
        CODEC.decode(Message, d)


def test_construction_validates_and_normalises():
    item = Item(name="a", price="2.5$", colour="blue")
    assert item.price == Money(250) and item.colour is Colour.BLUE
    with pytest.raises(Bad, match="Item.name: expected a string"):
        Item(name=3, price=Money(1))
    assert CODEC.spec(Message).names == {"v", "items", "note", "meta"}
    assert CODEC.spec(Message).required == ("items",)


def test_an_unsupported_annotation_is_refused_when_the_class_is_first_used():
    @dataclass
    class Odd:
        x: int | str

    with pytest.raises(TypeError, match="unsupported union"):
        CODEC.spec(Odd)
    assert isinstance(expected("x", 1), Invalid) and issubclass(Invalid, ValueError)


def test_the_codec_knows_no_schema():
    """Generic over dataclasses: it imports no other module of the contract and names no event class."""
    source = (ROOT / "trainer" / "contract" / "codec.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"codec imports {node.module} from the contract"
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
    assert imported <= {"__future__", "dataclasses", "enum", "types", "typing"}, imported
    from trainer.contract import events as ev

    schema = {c.__name__ for c in (*ev.EVENT_TYPES.values(), *ev.RECORDS, ev.Event, ev.Record)}
    schema |= {"Toggles", "DeviceInfo", "MalformedEvent"}
    used = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            used |= set(node.value.replace(".", " ").replace("`", " ").split())
    assert not schema & used, f"the codec names classes of the event schema: {sorted(schema & used)}"
