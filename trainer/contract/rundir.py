"""The run-directory layout, owned here and nowhere else.

A run directory holds everything a run produces:

    config.toml            the resolved configuration (what `--resume DIR` starts from)
    events.jsonl           every event of rank 0 (events.rankN.jsonl for the other ranks)
    device.jsonl           gptop's device samples
    trainer.log            the trainer's stdout; trainer.stderr.log its stderr
    checkpoints/           step-NNNNNNNN.pt (one process) or step-NNNNNNNN.dcp/ (several ranks)
    checkpoints/pins.json  steps that pruning must keep (the tuner's rollback target)
    tuner-checkpoints/     `gptop tune -- CMD`: the command's checkpoint its restarts resume from, held by gptop
                           (gptop.held_checkpoints)
    profiles/              torch.profiler traces
    tensorboard/, wandb/   with --tensorboard, --wandb
    tuning.json, tuning.md, best.toml   after tuning
    .gptop.lock            the owner's lock (trainer.contract.runlock); .gptop.lock.<node> per node of a multi-node run

A multi-node run shares the directory on purpose: each node's gptop writes its own
trainer.<node>.log, trainer.<node>.stderr.log and device.<node>.jsonl (RunDir(path, node)),
each rank its own events file and checkpoint shards, rank 0 the rest.

The trainer writes checkpoints (trainer.checkpoint_files, with torch); gptop and the
tuner list, pin and roll back through this module without importing torch.
Pruning keeps the newest `keep` checkpoints, every pinned one and the newest
verified-good one, so a tuning trial's own pruning can never delete the checkpoint
it would roll back to, and a NaN rollback always has a good checkpoint to go to.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .atomic import atomic_write
from .common import STEP_DIGITS

if TYPE_CHECKING:
    from .config_schema import TrainConfig

CONFIG = "config.toml"
EVENTS = "events.jsonl"
DEVICE = "device.jsonl"
TRAINER_LOG = "trainer.log"
TRAINER_STDERR = "trainer.stderr.log"
CHECKPOINTS = "checkpoints"
PROFILES = "profiles"
TENSORBOARD = "tensorboard"  # --tensorboard's event files
WANDB = "wandb"  # --wandb: W&B keeps its run there (wandb.init(dir=RUN_DIR))
PINS = "pins.json"
# a command's checkpoint a tuner's restart resumes from (gptop.held_checkpoints)
TUNER_CHECKPOINTS = "tuner-checkpoints"
LOCK = ".gptop.lock"  # the owner's lock (trainer.contract.runlock); LOCK.<node> per node
TUNING_JSON, TUNING_MD, BEST_TOML = "tuning.json", "tuning.md", "best.toml"

_CKPT_NAME = re.compile(rf"^step-(\d{{{STEP_DIGITS}}})\.(pt|dcp)$")


class RunDir:
    """Where each file of one run lives (paths only; nothing is created).

    `node`: the node key of a multi-node run (None on one node); the files each node's gptop writes
    (trainer logs, device samples) carry it, so nodes sharing the directory never write one file."""

    def __init__(self, path: str | Path, node: str | None = None):
        self.path = Path(path)
        self.node = node

    def _per_node(self, name: str) -> Path:
        if not self.node:
            return self.path / name
        stem, dot, ext = name.partition(".")
        return self.path / f"{stem}.{self.node}{dot}{ext}"

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    def events(self, rank: int = 0) -> Path:
        return self.path / (EVENTS if rank == 0 else f"events.rank{rank}.jsonl")

    @property
    def device(self) -> Path:
        return self._per_node(DEVICE)

    @property
    def trainer_log(self) -> Path:
        return self._per_node(TRAINER_LOG)

    @property
    def trainer_stderr(self) -> Path:
        return self._per_node(TRAINER_STDERR)

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def tuner_checkpoints(self) -> Path:
        return self.path / TUNER_CHECKPOINTS

    @property
    def profiles(self) -> Path:
        return self.path / PROFILES

    @property
    def tensorboard(self) -> Path:
        return self.path / TENSORBOARD

    def tuning(self, name: str) -> Path:
        """tuning.json, tuning.md or best.toml."""
        return self.path / name


def run_markers(path: str | Path) -> list[str]:
    """What makes `path` a run directory: the names of its run files present (config.toml, events.jsonl or a
    rank's events file, checkpoints/, the lock); empty for any other directory. A run stopped before its
    first step has its events and lock but no config.toml or checkpoints/, and is a run all the same."""
    p = Path(path)
    found = [name for name in (CONFIG, EVENTS, CHECKPOINTS, LOCK) if (p / name).exists()]
    try:
        found += sorted(
            e.name for e in p.iterdir() if e.name.startswith((LOCK + ".", "events.rank")) and e.name not in found
        )
    except OSError:
        pass
    return found


def is_run_dir(path: str | Path) -> bool:
    return bool(run_markers(path))


RUN_OWNED = (
    CHECKPOINTS,
    TUNER_CHECKPOINTS,
    PROFILES,
    TENSORBOARD,
    WANDB,
)  # a run's folders that only the run writes into


# What gptop and its trainer write into a run directory (RunDir's names, a node's and a rank's files included): a
# directory that holds anything else (not hidden) holds a user's files, where no new run goes.
_RUN_FILE = re.compile(
    r"^(?:config\.toml|events(?:\.rank\d+)?\.jsonl|device(?:\.[^/]+)?\.jsonl|trainer(?:\.[^/]+)?(?:\.stderr)?\.log|"
    r"checkpoints|tuner-checkpoints|profiles|tensorboard|wandb|inductor-cache|tuning\.json|tuning\.md|best\.toml)$"
)


def foreign_files(path: str | Path) -> list[str]:
    """The names in `path` that no run wrote (a user's scripts, data, notes), sorted; hidden names are left out.
    Empty for a new, empty or run directory."""
    try:
        names = [e.name for e in Path(path).iterdir()]
    except OSError:
        return []
    return sorted(n for n in names if not n.startswith(".") and not _RUN_FILE.match(n))


def run_part(path: str | Path) -> tuple[Path, str] | None:
    """(the run, its folder) when `path` (resolved) is or lies inside a folder a run owns (RUN_OWNED:
    checkpoints/, tuner-checkpoints/, profiles/, tensorboard/, wandb/), where neither a new run nor an export may
    go; else None."""
    p = Path(os.path.realpath(os.path.expanduser(os.fspath(path))))
    for a in (p, *p.parents):
        if a.name in RUN_OWNED and run_markers(a.parent):
            return a.parent, a.name
    return None


def run_name(cfg: "TrainConfig", when: float | None = None, size: str | None = None) -> str:
    """`<time>-<model>-<size>`; a model given as a path contributes its last component. `size`: what
    `--size auto` resolves to (trainer.contract.capabilities.auto_size), when the caller knows it."""
    model = cfg.model.model
    name = Path(model).name if os.sep in model else model
    return f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(when))}-{name}-{size or cfg.model.size}"


def default_run_dir(cfg: "TrainConfig", size: str | None = None) -> str:
    return os.path.join("runs", run_name(cfg, size=size))


def run_dir_of(target: str | Path) -> Path:
    """The run directory of a `--resume` target: the directory itself, or the run a checkpoint is in."""
    p = Path(target)
    return p if p.is_dir() and not is_sharded(p) else p.parent.parent


def resumes_into(resume: str | Path | None, run_dir: str | Path) -> bool:
    """Whether a run that resumes from `resume` continues the run in `run_dir` (not a new run there)."""
    if not resume:
        return False
    return os.path.realpath(run_dir_of(resume)) == os.path.realpath(run_dir)


def other_run(run_dir: str | Path) -> str | None:
    """What another run left in `run_dir` that a new run there would mix with (its events, its
    checkpoints), in words; None when there is nothing (a new, empty or unrelated directory)."""
    p = Path(run_dir)
    try:
        events = [f for f in (p / EVENTS, *sorted(p.glob("events.rank*.jsonl"))) if f.is_file() and f.stat().st_size]
        found = list_checkpoints(p)
    except OSError:
        return None
    parts = [f.name for f in events[:1]]
    if found:
        parts.append(f"{len(found)} checkpoint{'s' if len(found) > 1 else ''} up to step {found[-1].step}")
    elif events:
        parts.append("no checkpoint")
    return ", ".join(parts) if events or found else None


# --- checkpoints ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int

    @property
    def sharded(self) -> bool:
        return is_sharded(self.path)


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def path_for(run_dir: str | Path, step: int) -> Path:
    """A one-process checkpoint file."""
    return checkpoint_dir(run_dir) / f"step-{step:0{STEP_DIGITS}d}.pt"


def dcp_path_for(run_dir: str | Path, step: int) -> Path:
    """A sharded (torch.distributed.checkpoint) checkpoint directory."""
    return checkpoint_dir(run_dir) / f"step-{step:0{STEP_DIGITS}d}.dcp"


def is_sharded(path: str | Path) -> bool:
    return Path(path).name.endswith(".dcp")


def list_checkpoints(run_dir: str | Path) -> list[CheckpointInfo]:
    """Completed checkpoints, oldest first (temporary files and directories are not checkpoints)."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        m = _CKPT_NAME.match(p.name)
        if m:
            out.append(CheckpointInfo(p, int(m.group(1))))
    return sorted(out, key=lambda c: c.step)


def has_checkpoint(run_dir: str | Path) -> bool:
    return bool(list_checkpoints(run_dir))


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def prune(run_dir: str | Path, keep: int, newest_good: int | None = None) -> list[Path]:
    """Delete all but the newest `keep` checkpoints (pinned ones are kept too) and stale temporary
    files of dead writers; returns what was deleted.

    `newest_good` is the step of the newest checkpoint known to be good (the trainer verifies a state
    finite before writing it, so the one it just wrote): it is never deleted, even when `keep` newer
    steps are on disk (a stale or poisoned checkpoint of an older history with a higher step number)."""
    deleted = []
    protected = pinned(run_dir) | ({newest_good} if newest_good is not None else set())
    for info in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        if info.step in protected:
            continue
        _remove(info.path)
        deleted.append(info.path)
    d = checkpoint_dir(run_dir)
    if d.is_dir():
        for p in list(d.glob("*.dcp.tmp")) + list(d.glob("*.dcp.old")):
            # Only rank 0 prunes, after a save completed on every rank: no sharded save is in flight.
            shutil.rmtree(p, ignore_errors=True)
            deleted.append(p)
        for p in d.glob("*.tmp"):
            if p.is_dir():
                continue
            pid = p.name.rsplit(".", 2)[-2]
            if not pid.isdigit() or not pid_alive(int(pid)):
                p.unlink(missing_ok=True)
                deleted.append(p)
    return deleted


def rollback_to(run_dir: str | Path, step: int) -> list[Path]:
    """Delete every checkpoint newer than `step` (a failed tuning trial's), so that resuming the run
    directory continues from `step`; returns what was deleted."""
    deleted = []
    for info in list_checkpoints(run_dir):
        if info.step > step:
            _remove(info.path)
            deleted.append(info.path)
    return deleted


# --- pins: checkpoints that pruning keeps ----------------------------------------------------------


def _pins_path(run_dir: str | Path) -> Path:
    return checkpoint_dir(run_dir) / PINS


def pinned(run_dir: str | Path) -> set[int]:
    """The pinned steps (an unreadable pins file pins nothing: pruning then keeps `keep` as always)."""
    try:
        data = json.loads(_pins_path(run_dir).read_text())
        return {int(s) for s in data.get("steps", [])}
    except (OSError, ValueError, TypeError, AttributeError):
        return set()


def pin(run_dir: str | Path, step: int) -> None:
    """Keep the checkpoint of `step` through any pruning until `unpin`."""
    steps = pinned(run_dir) | {int(step)}
    atomic_write(_pins_path(run_dir), json.dumps({"steps": sorted(steps)}) + "\n")


def unpin(run_dir: str | Path, step: int | None = None) -> None:
    """Release one pinned step, or every pin (None)."""
    steps = set() if step is None else pinned(run_dir) - {int(step)}
    path = _pins_path(run_dir)
    if not steps:
        path.unlink(missing_ok=True)
    else:
        atomic_write(path, json.dumps({"steps": sorted(steps)}) + "\n")


def pid_alive(pid: int) -> bool:
    """The process exists and has not exited: a zombie (which an init that does not reap keeps) is not alive."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]  # the field after the command's name
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")
