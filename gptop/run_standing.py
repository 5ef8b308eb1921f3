"""Where a run stands (running now, finished, stopped, failed, cut short), from its lock and the end of its last
process: gptop's `exit` event of it (its exit status or signal, and who ended it), with what the process itself
said (`done`, `error`); a run recorded before gptop wrote `exit` events, or a process whose end gptop did not see
(both were killed), is read from what the process said alone. A tuner's restart ends a process, not the run."""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass
from pathlib import Path

from trainer.contract import rundir
from trainer.contract.events import (
    MAX_STEPS,
    STOPPED_BEFORE_FIRST_STEP,
    TUNER_RESTART,
    DoneEvent,
    ErrorEvent,
    ExitEvent,
    StatusEvent,
)
from trainer.contract.runlock import holder_words, lock_holders
from trainer.contract.states import ErrorKind, StoppedBy

from .state import fmt_duration


# What a command without a gptop client cannot tell (its steps, its model, its checkpoints), as the report and the
# summary say it.
NOT_REPORTED = "not reported: add a gptop client to the script (docs/your-code.md)"


class RunStanding(enum.StrEnum):
    """Where a run stands, from its lock and the end of its last process (a member is its word: "run
    finished"); the end-of-run summary says one of FINISHED, STOPPED and FAILED."""

    RUNNING = "running"  # its lock is held: gptop (or a trainer) is at it now
    FINISHED = "finished"  # trained to --max-steps, or a program that exited 0 by itself
    STOPPED = "stopped"  # stopped on request (you, gptop's planned end, a signal to the trainer itself)
    FAILED = "failed"  # its last process failed: an error it reported, a non-zero exit, a signal from outside gptop
    CUT_SHORT = "cut short"  # its last process ended without a word or a record (killed with gptop), or mid-restart


@dataclass(frozen=True)
class Standing:
    state: RunStanding
    words: str  # in words, for the report's `state` line
    done: DoneEvent | None  # the last process's own end, if it said one


def status_words(e: ExitEvent) -> str:
    """A process's exit status in words: 'exit 3', 'signal 9 (SIGKILL)'."""
    if e.signal is not None:
        try:
            return f"signal {e.signal} ({signal.Signals(e.signal).name})"
        except ValueError:
            return f"signal {e.signal}"
    return f"exit {e.exit_code}"


def end_words(e: ExitEvent) -> str:
    """How a process ended, as the report and the summary say it: 'finished (exit 0)', 'failed (exit 3)', 'stopped
    by you (exit 0)', 'killed by signal 9 (SIGKILL)', 'stopped by the tuner (exit 0)', 'stopped by gptop'."""
    how = status_words(e)
    if e.stopped_by is StoppedBy.USER:
        return f"stopped by you ({how})"
    if e.stopped_by is StoppedBy.TUNER:
        return f"stopped by the tuner ({how})"
    if e.stopped_by is StoppedBy.GPTOP:
        return f"stopped by gptop ({how})"
    if e.signal is not None:
        return f"killed by {how}"
    return f"finished ({how})" if e.exit_code == 0 else f"failed ({how})"


def ended_standing(
    done: DoneEvent | None,
    error: ErrorEvent | None,
    ended: ExitEvent | None,
    stop: StatusEvent | None = None,
    newest_checkpoint: int | None = None,
) -> Standing | None:
    """How the last process ended, from its own `done` and `error` and gptop's record of its end (`ended`), and
    gptop's record of a stop that ended the run after it (`stop`); None when none says (it ended without a word
    and without a record). `newest_checkpoint`: the step of the run's newest checkpoint, if it has one."""
    if done is not None and done.reason == MAX_STEPS:
        return Standing(RunStanding.FINISHED, f"finished at step {done.step} (--max-steps)", done)
    if ended is not None:
        return _recorded(done, error, ended, stop, newest_checkpoint)
    if done is not None and done.reason == TUNER_RESTART:
        return Standing(
            RunStanding.CUT_SHORT,
            f"ended during a restart by the tuner at step {done.step} (gptop ended before the next trainer started)",
            done,
        )
    if done is not None and done.reason == STOPPED_BEFORE_FIRST_STEP:
        return Standing(RunStanding.STOPPED, f"stopped {_before_first(newest_checkpoint)}", done)
    if done is not None:
        return Standing(RunStanding.STOPPED, f"stopped at step {done.step} ({done.reason or 'no reason given'})", done)
    if error is not None:
        return Standing(RunStanding.FAILED, f"failed at step {error.step}: {error.kind}: {error.message}", None)
    return None


def _before_first(newest_checkpoint: int | None) -> str:
    """A process stopped before its first step: a run's first, or a restart of one that has checkpoints."""
    if newest_checkpoint is None:
        return "before its first step: a run that made no checkpoint"
    return f"before its process's first step: nothing lost, the newest checkpoint is step {newest_checkpoint}"


def _stopper(by: StoppedBy) -> str:
    return "you" if by is StoppedBy.USER else "gptop" if by is StoppedBy.GPTOP else f"the {by.value}"


def _recorded(
    done: DoneEvent | None,
    error: ErrorEvent | None,
    e: ExitEvent,
    stop: StatusEvent | None = None,
    newest_checkpoint: int | None = None,
) -> Standing:
    """`ended_standing` of a process whose end gptop recorded."""
    at = f" at step {done.step}" if done is not None and done.step else ""
    after = f" after {fmt_duration(e.seconds)}" if e.seconds is not None else ""
    said = f" ({done.reason})" if done is not None and done.reason else ""
    before_first = done is not None and done.reason == STOPPED_BEFORE_FIRST_STEP
    if error is not None and error.kind == ErrorKind.LOST_STEPS:  # gptop ended it rather than lose steps: failed
        return Standing(RunStanding.FAILED, f"{end_words(e)}{at}{after}: {error.kind}: {error.message}", done)
    if e.stopped_by is StoppedBy.TUNER and stop is not None and stop.stopped_by is not None:
        kept = f", after its checkpoint of step {done.step}" if done is not None and done.checkpoint else ""
        return Standing(
            RunStanding.STOPPED,
            f"stopped by {_stopper(stop.stopped_by)} during a restart by the tuner{at}{kept} (the next process was "
            "not started)",
            done,
        )
    if e.stopped_by is StoppedBy.TUNER:
        return Standing(
            RunStanding.CUT_SHORT,
            f"ended during a restart by the tuner{at} (gptop ended before the next process started)",
            done,
        )
    if e.stopped_by is not None:
        if before_first:
            return Standing(RunStanding.STOPPED, f"{end_words(e)} {_before_first(newest_checkpoint)}", done)
        return Standing(RunStanding.STOPPED, f"{end_words(e)}{at}{after}", done)
    if error is not None:  # its own words on why, with how it ended
        state = RunStanding.STOPPED if e.exit_code == 0 and done is not None else RunStanding.FAILED
        return Standing(state, f"{end_words(e)} at step {error.step}{after}: {error.kind}: {error.message}", done)
    if e.exit_code == 0 and done is not None and done.reason:  # it stopped before its end (a signal to it)
        return Standing(RunStanding.STOPPED, f"stopped{at}{said}, exit 0{after}", done)
    if e.exit_code == 0:
        return Standing(RunStanding.FINISHED, f"{end_words(e)}{at}{after}", done)
    last = f": {e.stderr[-1]}" if e.stderr else ""
    return Standing(RunStanding.FAILED, f"{end_words(e)}{at}{after}{last}", done)


def standing_of(
    run_dir: Path,
    done: DoneEvent | None,
    error: ErrorEvent | None,
    ended: ExitEvent | None = None,
    *,
    stop: StatusEvent | None = None,
    newest_checkpoint: int | None = None,
) -> Standing:
    """How the run stands: running while its lock is held, else how its last process ended (`done`, `error`: its
    own end and error; `ended`: gptop's record of its end; `stop`: gptop's record of a stop after it), as a
    streaming reader keeps them."""
    holders = lock_holders(run_dir)
    if holders is not None:
        return Standing(RunStanding.RUNNING, f"running now ({'; '.join(holder_words(h) for h in holders)})", None)
    known = ended_standing(done, error, ended, stop, newest_checkpoint)
    if known is not None:
        return known
    return Standing(
        RunStanding.CUT_SHORT,
        "ended without a word from its last process and without gptop's record of its end (killed, or gptop and "
        f"the process died); see {rundir.RunDir(run_dir).trainer_stderr}",
        None,
    )
