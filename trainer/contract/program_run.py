"""A run directory of a user's program (`gptop run -- CMD`, `gptop tune -- CMD`): its checkpoints are the program's
own, in its own format and where it chose to write them, so gptop's export, sample and --resume, which load gptop's
own checkpoints, refuse it with what to do instead."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from .client import ClientKind
from .events import CheckpointEvent, HelloEvent, read_events
from .rundir import RunDir


@dataclass(frozen=True)
class ProgramRun:
    """What a program's run recorded: the command, its client (None: none said hello), and the newest checkpoint
    it reported that is still there."""

    command: list[str]
    client: str | None
    newest: str | None


def program_run(run_dir: str | Path) -> ProgramRun | None:
    """The run in `run_dir` if its process was a user's program (gptop's record of the command comes first in its
    events), else None (gptop's own trainer, or no events). One streaming pass."""
    path = RunDir(run_dir).events()
    command: list[str] | None = None
    client: str | None = None
    newest: str | None = None
    try:
        for e in read_events(path):
            if isinstance(e, HelloEvent):
                if command is None and e.command is None:
                    return None  # gptop's own trainer said hello first
                command = command or e.command
                client = e.client or client
            elif isinstance(e, CheckpointEvent) and e.rank == 0:
                newest = e.path
    except OSError:
        return None
    if command is None:
        return None
    return ProgramRun(command, client, newest if newest is not None and os.path.exists(newest) else None)


def program_refusal(run_dir: str | Path, run: ProgramRun, doing: str) -> str:
    """Why gptop cannot `doing` (export, sample, resume) this program's run, and what to do instead: the program
    resumes itself; transformers' from_pretrained loads a Trainer's checkpoint-N and output_dir; else the script's
    own code loads what it saved."""
    head = (
        f"{run_dir} is a run of your own program ({shlex.join(run.command)}): gptop cannot {doing} it, as its "
        "checkpoints are the program's own"
    )
    newest = f" (its newest reported: {run.newest})" if run.newest is not None else ""
    if doing == "resume":
        return f"{head}{newest}; it resumes from them itself: gptop run --run-dir NEW_DIR -- {shlex.join(run.command)}"
    if run.client == ClientKind.TRANSFORMERS and run.newest is not None:
        return (
            f"{head}; load them with transformers' from_pretrained: the newest, {run.newest}, or what the script "
            f"saves to its output_dir ({Path(run.newest).parent})"
        )
    return f"{head}{newest}; load them with the script's own code (what it saves with torch.save or save_pretrained)"
