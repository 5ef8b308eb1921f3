"""A codec between typed dataclasses and JSON objects: validate a decoded mapping into its class once, at the
boundary, and write an instance back as plain JSON values.

It knows types, not classes. Each field's check comes from its annotation: int, float, str, bool, enums,
`X | None`, `list[X]`, `tuple[X, ...]` of fixed length, `dict[str, X]`, `Any` (taken as it is) and nested
dataclasses. A schema tells it two more things:

- `struct(base, form)`: the classes of `base` are structs, frozen dataclasses with an `extra` mapping that
  keeps the keys they do not declare (a newer producer's fields survive a round trip) and a `__post_init__`
  that calls `validate`, so a decoded struct is filled in directly instead of checked twice. `Form` says what
  goes on the wire besides the fields (an event's version and class tag first; optional fields at None left
  out). Other dataclasses are built through their own `__init__`, their unknown keys dropped.
- `register(tp, decode=..., encode=...)`: a type with its own decoding (the toggles, read as a stored config
  is, so an older version's values read as today's).

Numbers are finite: a float that is not becomes None where the field allows None (JSON has no NaN), and is an
error elsewhere. An int is a number where a float is declared and stays an int, so a line written back holds
the same bytes; a bool is never a number. Errors name the field ("step.loss: expected a number, ...") and are
raised as the schema's own error class.

Why hand-written rather than msgspec or pydantic, both of which decode a line into typed classes several times
faster (BENCHMARKS.md section 6): the wire would change and so would the classes. Both read an int in a float
field as a float, so a line written back gains ".0"; msgspec refuses a NaN where this codec reads null, and
keeps no unknown keys (a second, untyped decode of every line would have to find them); both would replace
the stdlib dataclasses that consumers copy with `dataclasses.replace`, or validate each one twice. Neither is
a dependency of gptop, and importing pydantic would add to every start of it. A dashboard reads a few events
a second: what decoding costs matters less than the wire staying byte for byte what it was.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

Check = Callable[[Any], Any]  # validates a value and returns it normalised, or raises Invalid


class Invalid(ValueError):
    """A value that does not fit its declared type. A registered decoder raises it; the codec prefixes the
    field's name and raises the schema's error."""


class _NonFinite(Exception):
    pass


def expected(what: str, x: Any) -> Invalid:
    """The error for a value `x` where `what` was declared ("expected a mapping, got int '5'")."""
    return Invalid(f"expected {what}, got {type(x).__name__} {str(x)[:60]!r}")


@dataclass(frozen=True)
class Form:
    """What a struct class and its subclasses put on the wire besides their fields."""

    first: tuple[str, ...] = ()  # attributes written first, in this order (an event's `v` and `type`); one
    #                                   that is no field (a ClassVar tag) is not kept in `extra` when read
    omit_none: bool = False  # an optional field (default None) at None is left out: absent means null
    label: str | None = None  # the attribute that names the class in errors (None: the class's name)
    noun: str = ""  # follows the label where a field is missing ("step event missing tokens")


@dataclass(frozen=True)
class Spec:
    """What the codec derived from one class's fields, once."""

    checks: tuple[tuple[str, Check], ...]  # fields whose type needs a check
    by_name: dict[str, Check]  # every field a mapping may set -> its check
    writers: tuple[tuple[str, Check | None, bool], ...]  # (field, to wire (None: as is), omit None)
    first: tuple[str, ...]  # written first (the form's `first`)
    names: frozenset[str]  # fields a producer may set by name
    ignore: frozenset[str]  # keys that are no field and no extra (a class tag)
    required: tuple[str, ...]
    defaults: dict[str, Any]  # the other fields' defaults ...
    factories: dict[str, Callable[[], Any]]  # ... or default factories
    where: str  # the class in errors: "step", "GpuReading"
    what: str  # ... where a field is missing: "step event"
    form: Form | None  # None: a plain dataclass (built by its __init__)


class Codec:
    """The checks and writers of a schema's classes, derived from their annotations on first use."""

    def __init__(self, error: type[ValueError]) -> None:
        self.error = error
        self._caught = (Invalid, error)
        self._structs: dict[type, Form] = {}
        self._types: dict[Any, tuple[Check, Check]] = {}
        self._specs: dict[type, Spec] = {}

    def struct(self, base: type, form: Form | None = None) -> None:
        """Make `base` and its subclasses structs (see the module's docstring)."""
        self._structs[base] = form if form is not None else Form()

    def register(self, tp: Any, *, decode: Check, encode: Check) -> None:
        """Decode values of type `tp` with `decode` and write them with `encode`. `decode` gets a wire value,
        or an instance given to a struct's constructor; it returns the field's value or raises Invalid."""
        self._types[tp] = (decode, encode)

    # ------------------------------------------------------------------ the three operations

    def decode(self, cls: type, d: dict[str, Any]) -> Any:
        """An instance of `cls` from a mapping: declared fields by name, each checked once; the other keys
        into `extra` (a struct) or dropped. Raises the schema's error."""
        spec = self._specs.get(cls) or self.spec(cls)
        values = dict(spec.defaults)
        by_name, ignore = spec.by_name, spec.ignore
        extra: dict[str, Any] = {}
        for k, x in d.items():
            check = by_name.get(k)
            if check is None:
                if k not in ignore:
                    extra[k] = x
                continue
            try:
                values[k] = check(x)
            except _NonFinite:
                raise self.error(f"{spec.where}.{k}: {x!r} is not a finite number") from None
            except self._caught as e:
                raise self.error(f"{spec.where}.{k}: {e}") from None
        for k in spec.required:
            if k not in values:
                raise self.error(f"{spec.what} missing {', '.join(k for k in spec.required if k not in values)}")
        for k, factory in spec.factories.items():
            if k not in values:
                values[k] = factory()
        if spec.form is None:
            return cls(**values)  # a plain dataclass: its own __init__
        values["extra"] = extra
        obj: Any = object.__new__(cls)
        obj.__dict__.update(values)  # what __init__ and __post_init__ (validate) would do again
        return obj

    def validate(self, obj: Any) -> None:
        """Check and normalise every field of a struct in place (its `__post_init__`): frozen, so set through
        object."""
        spec = self._specs.get(obj.__class__) or self.spec(obj.__class__)
        for name, check in spec.checks:
            value = getattr(obj, name)
            try:
                new = check(value)
            except _NonFinite:
                raise self.error(f"{self._where(obj, spec)}.{name}: {value!r} is not a finite number") from None
            except self._caught as e:
                raise self.error(f"{self._where(obj, spec)}.{name}: {e}") from None
            if new is not value:
                object.__setattr__(obj, name, new)

    def encode(self, obj: Any) -> dict[str, Any]:
        """The wire form of an instance: plain JSON-able values, a struct's `extra` merged back in."""
        spec = self._specs.get(obj.__class__) or self.spec(obj.__class__)
        out: dict[str, Any] = {}
        for k in spec.first:
            out[k] = getattr(obj, k)
        for name, wire, omit_none in spec.writers:
            value = getattr(obj, name)
            if value is None:
                if not omit_none:
                    out[name] = None
            else:
                out[name] = value if wire is None else wire(value)
        if spec.form is not None and obj.extra:
            for k, value in obj.extra.items():
                out.setdefault(k, value)
        return out

    # ------------------------------------------------------------------ deriving a class's spec

    def spec(self, cls: type) -> Spec:
        """The class's checks, writers and field names (derived once)."""
        spec = self._specs.get(cls)
        if spec is not None:
            return spec
        form = next((self._structs[b] for b in cls.__mro__ if b in self._structs), None)
        first = form.first if form is not None else ()
        hints = typing.get_type_hints(cls)
        checks, writers, names, required = [], [], [], []
        by_name: dict[str, Check] = {}
        defaults: dict[str, Any] = {}
        factories: dict[str, Callable[[], Any]] = {}
        for f in dataclasses.fields(cls):
            check = self.checker(hints[f.name])
            if check is not _same:  # Any: nothing to check
                checks.append((f.name, check))
            if f.default is not dataclasses.MISSING:
                defaults[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                factories[f.name] = f.default_factory
            if form is not None and f.name == "extra":
                continue
            names.append(f.name)
            by_name[f.name] = check
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                required.append(f.name)
            if f.name not in first:
                omit = form is not None and form.omit_none and f.default is None
                writers.append((f.name, self.writer(hints[f.name]), omit))
        fields = {f.name for f in dataclasses.fields(cls)}
        ignore = frozenset(k for k in first if k not in fields)
        label = getattr(cls, form.label, None) if form is not None and form.label else None
        where = label if isinstance(label, str) else cls.__name__
        what = f"{where} {form.noun}" if form is not None and form.noun else where
        spec = self._specs[cls] = Spec(
            tuple(checks),
            by_name,
            tuple(writers),
            first,
            frozenset(names),
            ignore,
            tuple(required),
            defaults,
            factories,
            where,
            what,
            form,
        )
        return spec

    def _where(self, obj: Any, spec: Spec) -> str:
        """The class in an error about an instance (an unknown event names its own type)."""
        if spec.form is not None and spec.form.label:
            label = getattr(obj, spec.form.label, None)
            if isinstance(label, str):
                return label
        return spec.where

    def checker(self, tp: Any) -> Check:
        """A function that validates a value of type `tp` and returns it normalised (or raises)."""
        if tp is Any:
            return _same
        if tp is int:
            return _int
        if tp is float:
            return _float
        if tp is str:
            return _str
        if tp is bool:
            return _bool
        custom = self._types.get(tp)
        if custom is not None:
            return custom[0]
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return _enum_checker(tp)
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin in (typing.Union, types.UnionType):
            rest = [a for a in args if a is not type(None)]
            if len(rest) != 1:
                raise TypeError(f"unsupported union {tp!r}: only X | None")
            fast = _OPTIONAL.get(rest[0])
            return fast if fast is not None else _optional(self.checker(rest[0]))
        if origin is list:
            return _list_checker(self.checker(args[0]))
        if origin is tuple:
            return _tuple_checker([self.checker(a) for a in args])
        if origin is dict:
            return _dict_checker(self.checker(args[1]))
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return self._nested_checker(tp)
        raise TypeError(f"unsupported type {tp!r}")

    def _nested_checker(self, tp: type) -> Check:
        def check_nested(x: Any) -> Any:
            if isinstance(x, tp):
                return x
            if not isinstance(x, dict):
                raise expected("a mapping", x)
            return self.decode(tp, x)

        return check_nested

    def writer(self, tp: Any) -> Check | None:
        """How a validated value of type `tp` goes on the wire (None: as it is)."""
        custom = self._types.get(tp)
        if custom is not None:
            return custom[1]
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin in (typing.Union, types.UnionType):
            return self.writer(next(a for a in args if a is not type(None)))
        if origin is list:
            item = self.writer(args[0])
            return None if item is None else (lambda x: [item(i) for i in x])
        if origin is tuple:
            return list
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return self.encode
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return _enum_value
        return None


# --------------------------------------------------------------------------- checks


def _same(x: Any) -> Any:
    return x


def _enum_value(x: enum.Enum) -> Any:
    return x.value


def _int(x: Any) -> int:
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    raise expected("an integer", x)


def _float(x: Any) -> float:
    if isinstance(x, float):
        if x - x == 0.0:
            return x
        raise _NonFinite()
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    raise expected("a number", x)


def _str(x: Any) -> str:
    if isinstance(x, str):
        return x
    raise expected("a string", x)


def _bool(x: Any) -> bool:
    if isinstance(x, bool):
        return x
    raise expected("true or false", x)


def _enum_checker(tp: type[enum.Enum]) -> Check:
    def check_enum(x: Any) -> Any:
        if isinstance(x, tp):
            return x
        try:
            return tp(x)
        except ValueError:
            raise expected(f"one of {', '.join(str(m.value) for m in tp)}", x) from None

    return check_enum


def _optional(inner: Check) -> Check:
    def optional(x: Any) -> Any:
        if x is None:
            return None
        try:
            return inner(x)
        except _NonFinite:
            if isinstance(x, float):
                return None  # JSON has no NaN: null
            raise  # a non-finite number inside a list or mapping of numbers

    return optional


def _list_checker(item: Check) -> Check:
    if item is _float:
        return _float_list

    def check_list(x: Any) -> Any:
        if not isinstance(x, (list, tuple)):
            raise expected("a list", x)
        if item is _same:
            return x if isinstance(x, list) else list(x)
        return [item(i) for i in x]

    return check_list


def _tuple_checker(items: list[Check]) -> Check:
    def check_tuple(x: Any) -> Any:
        if not isinstance(x, (list, tuple)) or len(x) != len(items):
            raise expected(f"a list of {len(items)}", x)
        return tuple(c(i) for c, i in zip(items, x))

    return check_tuple


def _dict_checker(value: Check) -> Check:
    def check_dict(x: Any) -> Any:
        if not isinstance(x, dict) or not all(isinstance(k, str) for k in x):
            raise expected("a mapping", x)
        if value is _same:
            return x
        return {k: value(i) for k, i in x.items()}

    return check_dict


# The common cases without a call per level (events are parsed on the dashboard's reader thread).


def _opt_float(x: Any) -> float | None:
    if x is None:
        return None
    t = type(x)
    if t is float:
        return x if x - x == 0.0 else None  # JSON has no NaN: null
    if t is int:
        return x
    return None if _float(x) is None else x  # raises for what is not a number


def _opt_int(x: Any) -> int | None:
    if x is None or type(x) is int:
        return x
    return _int(x)


def _opt_str(x: Any) -> str | None:
    if x is None or type(x) is str:
        return x
    return _str(x)


def _float_list(x: Any) -> list[float]:
    if type(x) is list:
        for i in x:
            if type(i) is not float or i - i != 0.0:
                break
        else:
            return x  # all finite floats: the list as it is
    if not isinstance(x, (list, tuple)):
        raise expected("a list", x)
    return [_float(i) for i in x]


_OPTIONAL: dict[Any, Check] = {float: _opt_float, int: _opt_int, str: _opt_str}
