"""The event contract: every field a consumer can read is written by some producer.

Consumers read event attributes (typed dataclasses), so they can only read declared fields; this test
proves every declared field is set by name somewhere in the producers' source (trainer/, gptop/, tuner/),
scanned with `ast`: keywords of a call that builds the event (`StepEvent(...)`, `emit("step", ...)`,
`make("step", ...)`), the keys of a local dict splatted into it (`emit("step", **fields)`), the keys of the
`dict(...)` a function returns when its call is splatted in (`emit0("hello", **build.hello(...))`), keywords given
to a function that forwards its `**kwargs` into one (`_fail(..., lost_peer=True)`), and the keys of a dict
literal given for a nested record (`model={"family": ...}`). A field declared but produced nowhere (the
tuner once read `energy_j` from step events that nobody wrote) fails here.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import typing
from pathlib import Path

import pytest

from trainer.contract import events as ev
from fixtures import source

ROOT = Path(__file__).resolve().parent.parent
PRODUCER_PACKAGES = ("trainer", "gptop", "tuner")
EMITTERS = {"emit", "emit0", "emit_live", "emit_node", "make"}  # calls whose first argument names the event type
BASE = {"v", "time", "rank", "extra"}  # set by every constructor


@functools.lru_cache(maxsize=1)
def real_scan() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    return produced_fields(producer_sources())


def producer_sources() -> dict[str, str]:
    out = {}
    for pkg in PRODUCER_PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path != ROOT / "trainer" / "contract" / "events.py":
                out[str(path.relative_to(ROOT))] = source.text(path)
    return out


def schema(event_types: dict[str, type] | None = None) -> tuple[dict[str, type], dict[tuple[str, str], str]]:
    """Class name or wire type -> class; and (key, field) -> the record class name of a nested record field."""
    event_types = event_types if event_types is not None else ev.EVENT_TYPES
    classes: dict[str, type] = {}
    for name, cls in event_types.items():
        classes[name] = cls
        classes[cls.__name__] = cls
    for rec in ev.RECORDS:
        classes[rec.__name__] = rec
    nested: dict[tuple[str, str], str] = {}
    for cls in set(classes.values()):
        for f, tp in typing.get_type_hints(cls).items():
            for rec in ev.RECORDS:
                args = typing.get_args(tp)
                if rec is tp or rec in args or any(rec in typing.get_args(a) for a in args):
                    nested[(_key(cls), f)] = rec.__name__
    return classes, nested


def _key(cls: type) -> str:
    return cls.type if issubclass(cls, ev.Event) else cls.__name__


def _name(func: ast.expr) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _local_keys(fn: ast.AST, var: str) -> set[str]:
    """Keys a function gives the local dict `var`: dict(k=...) / {"k": ...} assignments, var["k"] = ..."""
    keys: set[str] = set()
    for node in ast.walk(fn):
        value = None
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == var for t in node.targets):
            value = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == var:
            value = node.value
        if isinstance(value, ast.Call) and _name(value.func) == "dict":
            keys |= {k.arg for k in value.keywords if k.arg}
        elif isinstance(value, ast.Dict):
            keys |= {k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if (
                    isinstance(t, ast.Subscript)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == var
                    and isinstance(t.slice, ast.Constant)
                    and isinstance(t.slice.value, str)
                ):
                    keys.add(t.slice.value)
    return keys


@functools.lru_cache(maxsize=4)
def indexed(
    sources: tuple[str, ...],
) -> tuple[list[tuple[ast.Call, ast.AST]], dict[str, list[tuple[ast.AST, ast.Call]]]]:
    """Every call in `sources` with the scope (function or module) it is in, and function name -> the dict(...)
    calls it returns: parsed once for the scans of one set of sources (the trees are only read)."""
    trees = [ast.parse(src) for src in sources]
    functions = [
        fn for tree in trees for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    scopes: list[ast.AST] = [*functions, *trees]
    calls = [(node, scope) for scope in scopes for node in ast.walk(scope) if isinstance(node, ast.Call)]
    returned: dict[str, list[tuple[ast.AST, ast.Call]]] = {}
    for fn in functions:
        for node in ast.walk(fn):
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Call) and _name(node.value.func) == "dict":
                returned.setdefault(fn.name, []).append((fn, node.value))
    return calls, returned


def produced_fields(
    sources: dict[str, str], event_types: dict[str, type] | None = None
) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(key -> every field name producers set, key -> names set directly at a building call), where key is an
    event's wire type or a record's class name."""
    classes, nested = schema(event_types)
    produced: dict[str, set[str]] = {}
    direct: dict[str, set[str]] = {}
    forwarders: dict[str, str] = {}  # function name -> the key its **kwargs build

    def target(call: ast.Call) -> str | None:
        name = _name(call.func)
        if name in classes and name not in (event_types or ev.EVENT_TYPES):
            return _key(classes[name])
        if name in EMITTERS and call.args and isinstance(call.args[0], ast.Constant) and call.args[0].value in classes:
            return _key(classes[call.args[0].value])
        return None

    calls, returned = indexed(tuple(sources.values()))

    def add(key: str, call: ast.Call, scope: ast.AST, is_direct: bool) -> bool:
        before = (len(produced.get(key, ())), len(forwarders))
        names = produced.setdefault(key, set())
        for kw in call.keywords:
            if kw.arg is not None:
                names.add(kw.arg)
                if is_direct:
                    direct.setdefault(key, set()).add(kw.arg)
                rec = nested.get((key, kw.arg))
                if rec is not None and isinstance(kw.value, ast.Dict):
                    produced.setdefault(rec, set()).update(
                        k.value for k in kw.value.keys if isinstance(k, ast.Constant)
                    )
            elif isinstance(kw.value, ast.Call) and _name(kw.value.func) in returned:
                for fn, ret in returned[_name(kw.value.func)]:
                    add(key, ret, fn, is_direct)
            elif isinstance(kw.value, ast.Name):
                kwarg = getattr(getattr(scope, "args", None), "kwarg", None)
                if kwarg is not None and kwarg.arg == kw.value.id:
                    forwarders[scope.name] = key  # type: ignore[attr-defined]
                else:
                    names |= _local_keys(scope, kw.value.id)
        return (len(names), len(forwarders)) != before

    for node, scope in calls:
        if (key := target(node)) is not None:
            add(key, node, scope, is_direct=True)
    changed = True
    while changed:  # forwarders of forwarders (_report -> emit)
        changed = False
        for node, scope in calls:
            if _name(node.func) in forwarders:
                changed |= add(forwarders[_name(node.func)], node, scope, is_direct=False)
    return produced, direct


def declared(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} - BASE - {"type"}


def unproduced(produced: dict[str, set[str]], event_types: dict[str, type] | None = None) -> dict[str, set[str]]:
    out = {}
    for cls in [*(event_types or ev.EVENT_TYPES).values(), *ev.RECORDS]:
        missing = declared(cls) - produced.get(_key(cls), set())
        if missing:
            out[cls.__name__] = missing
    return out


# --------------------------------------------------------------------------- the contract


def test_every_declared_field_is_written_by_some_producer():
    produced, _ = real_scan()
    assert unproduced(produced) == {}, "declared event fields that no producer writes (consumers would read None)"


def test_producers_set_only_declared_fields():
    _, direct = real_scan()
    classes, _ = schema()
    bad = {
        key: names - declared(classes[key]) - BASE
        for key, names in direct.items()
        if names - declared(classes[key]) - BASE
    }
    assert bad == {}


def test_every_event_type_has_a_producer():
    produced, _ = real_scan()
    assert set(ev.EVENT_TYPES) <= set(produced)


def test_consumers_do_not_read_events_as_dicts():
    """Events are read as attributes: no `event["type"]` / `.get("type")` left in gptop or the tuner."""
    bad = []
    for pkg in ("gptop", "tuner"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in source.nodes(path):
                if (
                    isinstance(node, ast.Subscript)
                    and isinstance(node.slice, ast.Constant)
                    and node.slice.value == "type"
                ):
                    bad.append(f'{path.relative_to(ROOT)}:{node.lineno} ["type"]')
                if (
                    isinstance(node, ast.Call)
                    and _name(node.func) == "get"
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and node.args[0].value == "type"
                ):
                    bad.append(f'{path.relative_to(ROOT)}:{node.lineno} .get("type")')
    assert bad == []


# --------------------------------------------------------------------------- the check catches mistakes


def test_a_declared_field_that_nobody_produces_fails_the_contract():
    """Today's mistake, replayed: a step field consumers read (energy_j) that no producer writes."""

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class StepWithEnergy(ev.StepEvent):
        energy_j: float | None = None

    types = dict(ev.EVENT_TYPES, step=StepWithEnergy)
    produced, _ = produced_fields(producer_sources(), types)
    assert unproduced(produced, types) == {"StepWithEnergy": {"energy_j"}}


def test_the_scan_follows_local_dicts_forwarders_and_nested_records():
    src = """
def flush(ch):
    fields: dict = dict(step=1, tokens=2)
    fields["loss"] = 3.0
    ch.emit("step", **fields)

def _fail(ch, kind, **extra):
    ch.emit("error", kind=kind, message="m", **extra)

def _report(ch, **extra):
    _fail(ch, "crash", **extra)

def main(ch):
    extra = {"toggles": {}}
    _report(ch, lost_peer=True, **extra)
    ch.emit0("hello", config={}, device={}, model={"family": "llama"})
    GpuReading(index=0, name="g")

def hello_fields(n):
    return dict(world_size=n, model={"size": "tiny"})

def announce(ch):
    ch.emit0("hello", **hello_fields(2))
"""
    produced, direct = produced_fields({"x.py": src})
    assert {"step", "tokens", "loss"} <= produced["step"]
    assert {"kind", "message", "lost_peer", "toggles"} <= produced["error"]
    assert "lost_peer" not in direct["error"]  # forwarded, not set at the building call
    assert produced["ModelInfo"] == {"family", "size"} and produced["GpuReading"] == {"index", "name"}
    assert {"world_size", "model"} <= direct["hello"]  # from the dict hello_fields returns
    missing = unproduced(produced)
    assert "interval_steps" in missing["StepEvent"] and "exit_code" in missing["ErrorEvent"]


def test_attributes_are_the_only_way_in():
    """Events are not mappings: a consumer reading an undeclared field fails at once (AttributeError) in the
    tests, instead of getting a silent None from `.get` in production."""
    for cls in [*ev.EVENT_TYPES.values(), *ev.RECORDS]:
        assert not hasattr(cls, "get") and not hasattr(cls, "__getitem__"), cls
    step = ev.make(
        "step",
        step=1,
        tokens=1,
        loss=None,
        lr=None,
        grad_norm=None,
        step_ms=None,
        phases_ms=None,
        tokens_per_s=None,
        mfu=None,
        mem_bytes=None,
    )
    with pytest.raises(AttributeError):
        step.energy_j  # noqa: B018
