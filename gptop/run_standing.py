"""Where a run stands (running now, finished, stopped, failed, cut short), from its lock and the events of its
last trainer process: a tuner's restart ends a trainer, not the run."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from trainer.contract import rundir
from trainer.contract.events import (
    MAX_STEPS,
    STOPPED_BEFORE_FIRST_STEP,
    TUNER_RESTART,
    DoneEvent,
    ErrorEvent,
    Event,
    HelloEvent,
)
from trainer.contract.runlock import holder_words, lock_holders


class RunStanding(enum.StrEnum):
    """Where a run stands, from its lock and the events of its last trainer process (a member is its word:
    "run finished"); the end-of-run summary says one of FINISHED, STOPPED and FAILED."""

    RUNNING = "running"  # its lock is held: gptop (or a trainer) is at it now
    FINISHED = "finished"  # trained to --max-steps
    STOPPED = "stopped"  # stopped on request (a user, a signal, a planned end)
    FAILED = "failed"  # its last trainer reported an error and ended
    CUT_SHORT = "cut short"  # its last trainer ended without a word (killed), or gptop ended mid-restart


@dataclass(frozen=True)
class Standing:
    state: RunStanding
    words: str  # in words, for the report's `state` line
    done: DoneEvent | None  # the last trainer's own end, if it said one


def standing(run_dir: Path, events: list[Event]) -> Standing:
    """How the run stands. A live run (its lock held) is running whatever its events say; else the last trainer
    process's events say how it ended (an earlier process's `done`, a tuner's restart, is not the run's end)."""
    starts = (
        [i for i, e in enumerate(events) if isinstance(e, HelloEvent) and e.early]
        or [i for i, e in enumerate(events) if isinstance(e, HelloEvent)][-1:]
        or [0]
    )
    last = events[starts[-1] :]
    done = next((e for e in reversed(last) if isinstance(e, DoneEvent)), None)
    error = next((e for e in reversed(last) if isinstance(e, ErrorEvent)), None)
    return standing_of(run_dir, done, error)


def standing_of(run_dir: Path, done: DoneEvent | None, error: ErrorEvent | None) -> Standing:
    """`standing` from the last trainer process's own end (`done`) and error, as a streaming reader keeps them."""
    holders = lock_holders(run_dir)
    if holders is not None:
        return Standing(RunStanding.RUNNING, f"running now ({'; '.join(holder_words(h) for h in holders)})", None)
    if done is not None and done.reason == MAX_STEPS:
        return Standing(RunStanding.FINISHED, f"finished at step {done.step} (--max-steps)", done)
    if done is not None and done.reason == TUNER_RESTART:
        return Standing(
            RunStanding.CUT_SHORT,
            f"ended during a restart by the tuner at step {done.step} (gptop ended before the next trainer started)",
            done,
        )
    if done is not None and done.reason == STOPPED_BEFORE_FIRST_STEP:
        return Standing(RunStanding.STOPPED, "stopped before its first step: a run that made no checkpoint", done)
    if done is not None:
        return Standing(RunStanding.STOPPED, f"stopped at step {done.step} ({done.reason or 'no reason given'})", done)
    if error is not None:
        return Standing(RunStanding.FAILED, f"failed at step {error.step}: {error.kind}: {error.message}", None)
    return Standing(
        RunStanding.CUT_SHORT,
        "ended without a word from its last trainer (killed, or gptop and the trainer "
        f"died); see {rundir.RunDir(run_dir).trainer_stderr}",
        None,
    )
