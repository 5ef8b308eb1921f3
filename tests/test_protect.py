"""What gptop may delete (trainer.contract.protect): `--force` replaces an earlier export, nothing else.

Every protected kind of path (a live run, a finished run, a run stopped before its first step, a run's
checkpoints/ and anything inside, a folder holding runs, the current directory, a directory that is
not an export), reached directly, through a symlink, with a trailing slash or through `..`, is refused
with exit 2 naming what it is, before anything loads, and nothing on disk changes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trainer.contract import protect, rundir
from trainer.contract.config import ConfigError
from trainer.contract.protect import EXPORT_MARKER, Kind
from trainer.contract.runlock import RunLock


def make_run(path: Path, *, steps=(2, 4), config: bool = True) -> Path:
    (path / "checkpoints").mkdir(parents=True)
    if config:
        (path / "config.toml").write_text('[model]\nmodel = "llama"\n')
    (path / "events.jsonl").write_text('{"v": 1, "type": "hello"}\n')
    (path / "trainer.log").write_text("log\n")
    for s in steps:
        rundir.path_for(path, s).write_bytes(b"weights")
    return path


def make_export(path: Path, extra: dict[str, str] | None = None, marker: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "gptop": {"family": "llama"}}))
    (path / "model.safetensors").write_bytes(b"w")
    (path / "tokenizer.json").write_text("{}")
    if marker:
        protect.write_marker(path, run="r", step=4, format="model")
    for name, text in (extra or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


def snapshot(top: Path) -> dict[str, bytes | None]:
    """Every path under `top` with its content (None for a directory or a link)."""
    out = {}
    for root, dirs, files in os.walk(top):
        for name in dirs + files:
            p = Path(root) / name
            out[str(p.relative_to(top))] = None if p.is_dir() or p.is_symlink() else p.read_bytes()
    return out


@pytest.fixture
def world(tmp_path, monkeypatch):
    """runs/finished, runs/live (its lock held), runs/early (stopped before its first step: events and lock
    only), an export, a folder of notes; the working directory is work/ (empty) inside it."""
    runs = tmp_path / "runs"
    make_run(runs / "finished")
    make_run(runs / "live")
    early = runs / "early"
    early.mkdir()
    (early / "events.jsonl").write_text('{"v": 1, "type": "done", "reason": "stopped before the first step"}\n')
    (early / ".gptop.lock").write_text("")
    (runs / "finished" / "checkpoints" / "step-00000006.dcp").mkdir()
    (runs / "finished" / "profiles").mkdir()
    make_export(tmp_path / "exports" / "old")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    (tmp_path / "work").mkdir()
    (tmp_path / "file.txt").write_text("a file")
    lock = RunLock.acquire(runs / "live", command="gptop train")
    monkeypatch.chdir(tmp_path / "work")
    yield tmp_path
    lock.release()


def link(world: Path, target: str) -> str:
    """A symlink in world/links to `target`; returns its path."""
    d = world / "links"
    d.mkdir(exist_ok=True)
    name = d / target.strip("/.").replace("/", "_")
    if not name.exists():
        name.symlink_to(world / target)
    return str(name)


# (how OUT_DIR is written, relative to world unless it starts with "."; the kind it must be found)
PROTECTED = [
    ("runs/live", Kind.LIVE_RUN),
    ("runs/finished", Kind.RUN),
    ("runs/early", Kind.RUN),
    ("runs/finished/checkpoints", Kind.RUN_PART),
    ("runs/live/checkpoints", Kind.RUN_PART),
    ("runs/finished/checkpoints/step-00000006.dcp", Kind.RUN_PART),
    ("runs/finished/checkpoints/new", Kind.RUN_PART),  # not there yet: still inside checkpoints/
    ("runs/finished/profiles", Kind.RUN_PART),
    ("runs/live/wandb", Kind.RUN_PART),
    ("runs", Kind.HOLDS_RUN),
    ("", Kind.CURRENT_DIR),  # "" is the world itself: it holds the cwd
    (".", Kind.CURRENT_DIR),
    ("..", Kind.CURRENT_DIR),
    ("./", Kind.CURRENT_DIR),
    ("notes", Kind.OTHER),
    ("file.txt", Kind.FILE),
]
SPELLINGS = ["plain", "trailing slash", "dotdot", "symlink"]


def spell(world: Path, rel: str, how: str) -> str:
    if rel.startswith("."):
        return rel if how != "trailing slash" else rel.rstrip("/") + "/"
    path = str(world / rel) if rel else str(world)
    if how == "trailing slash":
        return path + "/"
    if how == "dotdot":
        return str(world / "runs" / ".." / rel) if rel else str(world / "work" / "..")
    if how == "symlink":
        return link(world, rel) if rel else str(world)
    return path


@pytest.mark.parametrize("how", SPELLINGS)
@pytest.mark.parametrize("rel, kind", PROTECTED)
@pytest.mark.parametrize("force", [True, False])
def test_every_protected_path_is_refused_and_kept(world, rel, kind, how, force):
    out = spell(world, rel, how)
    before = snapshot(world)
    assert protect.classify(out).kind is kind, out
    with pytest.raises(ConfigError) as e:
        protect.check_replaceable(out, "OUT_DIR", force=force)
    assert e.value.option == "OUT_DIR"
    words = {
        Kind.LIVE_RUN: "live run",
        Kind.RUN: "run directory",
        Kind.RUN_PART: "of the run",
        Kind.HOLDS_RUN: "holds",
        Kind.CURRENT_DIR: "current directory",
        Kind.OTHER: "not an export",
        Kind.FILE: "not a directory",
    }[kind]
    assert words in e.value.message, e.value.message
    assert snapshot(world) == before


def test_a_live_run_is_named_by_its_holder(world):
    msg = protect.classify(world / "runs" / "live").what
    assert f"pid {os.getpid()}" in msg and "gptop train" in msg


@pytest.mark.parametrize("how", SPELLINGS)
def test_an_earlier_export_is_replaced_only_with_force(world, how):
    out = spell(world, "exports/old", how)
    assert protect.classify(out).kind is Kind.EXPORT
    assert protect.check_replaceable(out, "OUT_DIR", force=True) == (world / "exports" / "old")
    with pytest.raises(ConfigError, match="add --force"):
        protect.check_replaceable(out, "OUT_DIR", force=False)


def test_new_and_empty_directories_need_no_force(world):
    (world / "empty").mkdir()
    for out in (world / "new", world / "empty", world / "runs" / "finished" / "export", world / "a" / "b"):
        assert protect.check_replaceable(out, "OUT_DIR", force=False) == out


def test_an_export_is_recognized_by_what_export_wrote(world):
    exports = world / "exports"
    make_export(exports / "legacy", marker=False)  # before the marker: config.json's gptop
    assert protect.classify(exports / "legacy").kind is Kind.EXPORT
    make_export(exports / "added", extra={"notes.txt": "mine"})  # a file export did not write
    assert protect.classify(exports / "added").kind is Kind.OTHER
    make_export(exports / "deep", extra={"base/mine.txt": "x"})
    assert protect.classify(exports / "deep").kind is Kind.OTHER
    plain = exports / "plain"  # config.json of some other model: not ours
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (plain / "model.safetensors").write_bytes(b"w")
    assert protect.classify(plain).kind is Kind.OTHER
    make_export(exports / "holder")  # an export with a run put inside it
    make_run(exports / "holder" / "base" / "run")
    assert protect.classify(exports / "holder").kind is Kind.HOLDS_RUN
    assert protect.classify(world / "runs" / "finished").kind is Kind.RUN  # run files win over a marker
    protect.write_marker(world / "runs" / "finished", run="x", step=1, format="model")
    assert protect.classify(world / "runs" / "finished").kind is Kind.RUN


def test_a_run_deep_below_is_found(world):
    make_run(world / "deep" / "a" / "b" / "c" / "run")
    f = protect.classify(world / "deep")
    assert f.kind is Kind.HOLDS_RUN and "deep/a/b/c/run" in f.what


def test_replace_checks_again_and_keeps_the_old_export_until_the_new_one_is_in_place(world):
    out = world / "exports" / "old"
    tmp = protect.make_temp_dir(out)
    (tmp / "config.json").write_text("{}")
    protect.replace_dir(tmp, out, "OUT_DIR", force=True)
    assert (out / "config.json").read_text() == "{}" and not tmp.exists()
    assert [p.name for p in out.parent.iterdir()] == ["old"]
    tmp = protect.make_temp_dir(out)
    (out / "events.jsonl").write_text("")  # a run started there while the export worked
    with pytest.raises(ConfigError, match="run directory"):
        protect.replace_dir(tmp, out, "OUT_DIR", force=True)
    assert (out / "config.json").exists() and tmp.exists()


def test_what_a_killed_export_left_is_cleaned_by_the_next_one(world, monkeypatch):
    out = world / "exports" / "old"
    live = protect.make_temp_dir(out)  # this process: alive, kept
    gone = live.with_name(live.name.replace(f"-{os.getpid()}-", "-999999999-"))
    gone.mkdir()
    (gone / "model.safetensors").write_bytes(b"partial")
    other_host = out.parent / ".old.export-otherhost-999999999-abc"
    other_host.mkdir()
    assert protect.remove_stale(out) == [gone]
    assert live.exists() and other_host.exists() and not gone.exists()
    # killed between its two renames: OUT_DIR is missing and the previous export is aside; it goes back
    aside = out.with_name(live.name.replace(".export-", ".replaced-").rsplit("-", 2)[0] + "-999999999")
    os.replace(out, aside)
    assert protect.remove_stale(out) == [aside]
    assert (out / EXPORT_MARKER).exists() and not aside.exists()


@pytest.mark.parametrize("rel, kind", PROTECTED)
def test_gptop_export_force_refuses_before_starting_anything(world, rel, kind, monkeypatch, capsys):
    """The command as typed: exit 2, one line naming OUT_DIR and what it is, no tool process, nothing changed."""
    import subprocess

    from gptop import cli

    def no_process(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    out = spell(world, rel, "plain")
    before = snapshot(world)
    try:
        code = cli.main(["export", str(world / "runs" / "finished"), out, "--force"])
    except SystemExit as e:  # argparse's own check of the path (a file where a directory goes)
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "OUT_DIR" in err and "Traceback" not in err, err
    said = [line for line in err.splitlines() if line.startswith("gptop")]  # argparse adds its usage lines
    assert len(said) == 1 and snapshot(world) == before
