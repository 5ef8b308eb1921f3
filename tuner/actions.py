"""What the tuning controller asks the session to do next.

The controller never starts a process. The session asks it what to do next,
does it, and reports back; trial steps are real training steps.

    ctl = TuneController(cfg, dev, space, study, Budget(parse_duration("30m")))
    while True:
        action = ctl.next_action()
        match action:
            case FindMicroBatch():        # run `--micro-batch auto` once, report what fits
                ctl.set_max_micro_batch(n)                     # or None if it could not be found
            case RunTrial() | Remeasure():
                # checkpoint, then (if action.restart) restart the trainer from it with
                # action.toggles; the baseline runs on (restart=False).
                for event in trainer_events():                 # every event: step, checkpoint, error
                    ctl.observe(event)
                    stop = ctl.trial_should_stop()             # polled also when no event comes
                    if stop: break
                # stop in ("done", "prune", "budget"): healthy, steps kept -> finish_trial("ok")
                # stop in TRIAL_FAILURES, or the process died: roll back to the checkpoint taken
                # before the trial -> finish_trial(kind)  (kind: oom, nan, diverged, compile, crash)
                ctl.finish_trial(outcome)
            case Apply():                 # after a checkpoint, restart with action.toggles
                ...                       # if action.restart
            case Check():                 # measure the applied setting on the live run, as a trial
                ...                       # (no restart); then finish_trial("ok")
            case Done():                  # continue with action.toggles (restart if action.restart)
                break
        for ev in ctl.drain_events(): emit(ev)                 # trial / apply / tuner events
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.contract.config import Toggles

from .decide import Decision
from .measure import Measurement


@dataclass
class FindMicroBatch:
    """Run `--micro-batch auto` with the starting toggles and report the largest micro-batch that fits."""

    reason: str = "the largest micro-batch that fits bounds the search and the recipe"


@dataclass
class RunTrial:
    """Train with `toggles` from the latest checkpoint and feed the step events to `observe`.

    `number` is the Optuna trial number (None for a baseline outside the space
    or not yet recorded). `restart` is False when the process already runs
    these toggles (the baseline). `keep_steps` False: the trial switches to an
    optimizer whose state cannot be converted from the checkpoint's (Adafactor
    to or from AdamW), so once measured it is rolled back like a failure,
    `finish_trial("ok", rollback=...)`: the run keeps its own optimizer state.
    """

    number: int | None
    toggles: Toggles
    measure: Measurement
    baseline: bool = False
    restart: bool = True
    numerics_changing: bool = False
    source: str = "sampler"
    keep_steps: bool = True
    advice: str | None = None  # source "advice": the evidence of the advice it tries


@dataclass
class Remeasure:
    """Measure trial `number`'s configuration again before deciding (same protocol as RunTrial)."""

    number: int
    toggles: Toggles
    measure: Measurement
    restart: bool = True
    keep_steps: bool = True


@dataclass
class Apply:
    """Switch the run to `toggles` after a checkpoint (no-op restart if `restart` is False). `label` names
    the trial in words ("trial 7 (from an earlier run, re-measured on this one)")."""

    toggles: Toggles
    decision: Decision
    restart: bool = True
    number: int | None = None
    label: str = ""


@dataclass
class Check:
    """After an `Apply`: measure the applied setting on the live run, in the process training on with it (no
    restart: the switch was the restart), with the same protocol as RunTrial, `finish_trial("ok")` at its end,
    then ask again: the answer is a Done that keeps it, or one that switches back to the start
    (`restart`), when its realized speed is below the start's beyond noise."""

    number: int | None
    toggles: Toggles
    measure: Measurement
    label: str = ""
    restart: bool = True  # the switch into it was a restart: its overhead is the switch's cost
    keep_steps: bool = True


@dataclass
class Done:
    """Tuning is over: continue training with `toggles` (restart first if `restart`)."""

    reason: str
    toggles: Toggles
    restart: bool = False


Action = FindMicroBatch | RunTrial | Remeasure | Apply | Check | Done
