"""The checkpoint a tuning of a user's command resumes from, held by gptop in the run directory.

`gptop tune -- CMD` switches settings through a checkpoint and a restart, and rolls a failed trial back to the
checkpoint before it. Those checkpoints are the script's own, in the script's own folder (a Trainer's
`output_dir/checkpoint-N`), where the script's rotation (`save_total_limit`) deletes what it does not count
among its newest: a failed trial's own saves can delete the checkpoint it is to roll back to. So before each
restart gptop takes the checkpoint the next process resumes from into `RUN_DIR/tuner-checkpoints/step-N/`:

- a checkpoint written only because gptop stopped the process for a switch is moved there: the script's
  folder keeps what the script itself saves, no more, and its rotation counts only those;
- a checkpoint the script saves at that step anyway (its own interval, its last step) stays where it is, and
  gptop holds hard links to its files (copies where links cannot be made, e.g. another filesystem): the
  rotation's deletion unlinks the script's names, never gptop's.

The process resumes from the held copy, and so does a rollback, whatever the script deleted meanwhile. gptop
holds one checkpoint at a time (holding a newer one releases the older), and releases the last once the run
has a newer checkpoint of its own or ends at its last step (gptop.program.ProgramSession).

Why a copy of gptop's own rather than the other ways: pinning the checkpoint in `output_dir` would go through
the Trainer's `state.best_model_checkpoint` (the one checkpoint its rotation spares), which is the script's own
setting (`load_best_model_at_end`, `metric_for_best_model`) and is written into every checkpoint it saves; and
transformers 5 rotates by modification time, not by step, so no name gptop could choose keeps a checkpoint
safe. Refusing `save_total_limit` would refuse most real scripts. Only `save_total_limit=1` is refused
(gptop.integrations.transformers): with it the Trainer deletes the script's own last checkpoint at every save.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from trainer.contract.rundir import RunDir


def held_dir(run_dir: str | Path) -> Path:
    return RunDir(run_dir).tuner_checkpoints


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or one without hard links
        shutil.copy2(src, dst)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def is_held(run_dir: str | Path, path: str | Path) -> bool:
    """Whether `path` is (inside) a checkpoint gptop holds for this run."""
    return Path(path).resolve().is_relative_to(held_dir(run_dir).resolve())


def hold(run_dir: str | Path, step: int, path: str | Path, *, move: bool) -> Path:
    """Hold the checkpoint of `step` at `path` (a file or a directory) in the run directory: `move` it there (a
    switch's own checkpoint) or link its files (one the script keeps). Returns the held path; any other held
    checkpoint is released. A path already held is returned as it is."""
    src = Path(path)
    if is_held(run_dir, src):
        return src
    dest = held_dir(run_dir) / f"step-{step}" / src.name
    partial = dest.parent.with_name(dest.parent.name + ".partial")
    for p in (dest.parent, partial):
        _remove(p)
    partial.mkdir(parents=True)
    if move:
        try:
            os.rename(src, partial / src.name)  # one filesystem: instant, and never half there
        except OSError:
            _copy(src, partial / src.name, shutil.copy2)
            _remove(src)
    else:
        _copy(src, partial / src.name, _link_or_copy)
    os.rename(partial, dest.parent)
    release(run_dir, keep=dest)
    return dest


def _copy(src: Path, dst: Path, copy: Callable[[str, str], object]) -> None:
    if src.is_dir():
        shutil.copytree(src, dst, copy_function=copy)
    else:
        copy(str(src), str(dst))


def release(run_dir: str | Path, keep: Path | None = None) -> list[Path]:
    """Delete the held checkpoints but `keep` (all of them without it); returns what was deleted."""
    root = held_dir(run_dir)
    if not root.is_dir():
        return []
    keep_dir = keep.parent.resolve() if keep is not None else None
    gone = []
    for p in sorted(root.iterdir()):
        if keep_dir is None or p.resolve() != keep_dir:
            _remove(p)
            gone.append(p)
    if keep is None:
        _remove(root)
    return gone


def held_step(run_dir: str | Path) -> int | None:
    """The step of the checkpoint held now, or None."""
    root = held_dir(run_dir)
    steps = [int(p.name[len("step-") :]) for p in root.glob("step-*") if p.name[len("step-") :].isdigit()]
    return max(steps) if steps else None
