"""The contract's closed vocabularies: a run's status, the tuner's phase, a trial's kind, status and outcome.

Each is a `StrEnum`, so a member is its wire string (`TunerPhase.DONE == "done"`, `json.dumps` writes "done")
and events written before these types existed read back unchanged. The event schema declares its fields
with these types, so a consumer gets a member, never a free string; a value outside the set makes the line
malformed, so a new member is a schema change (older readers skip such lines).

The kinds of errors and warnings (ErrorKind, WarningKind) are open instead: an event's `kind` field stays a
string, since a newer trainer may say a kind this version does not know, and readers compare it with these.
"""

from __future__ import annotations

import enum


class RunStatus(enum.StrEnum):
    """What the session is doing (gptop's `status` event, the dashboard's status line)."""

    STARTING = "starting"
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    STOPPING = "stopping"
    DONE = "done"
    STOPPED = "stopped"
    FAILED = "failed"
    RESTARTING = "restarting"
    REPLAY = "replay"  # a finished run's events, read back
    MONITOR = "monitor"  # attached to a run (or to the devices alone), not supervising it

    @property
    def ended(self) -> bool:
        """The run is over: its elapsed time stops."""
        return self in _ENDED

    @property
    def over(self) -> bool:
        """The run's figures move no more: it ended, or this is a replay of its events."""
        return self in _OVER

    @property
    def idle(self) -> bool:
        """Nothing is training under this session (ended, or a view of events that are already written)."""
        return self in _IDLE

    @property
    def live(self) -> bool:
        """A trainer is training now: commands that act on the running process make sense."""
        return self in _LIVE

    @property
    def launching(self) -> bool:
        """A trainer is being started (or restarted) and has not reported its first step yet."""
        return self in _LAUNCHING


_ENDED = frozenset({RunStatus.DONE, RunStatus.STOPPED, RunStatus.FAILED})
_OVER = _ENDED | {RunStatus.REPLAY}
_IDLE = _OVER | {RunStatus.MONITOR}
_LIVE = frozenset({RunStatus.RUNNING, RunStatus.CHECKPOINTING})
_LAUNCHING = frozenset({RunStatus.STARTING, RunStatus.RESTARTING})


class StoppedBy(enum.StrEnum):
    """Who ended a process gptop supervised (an `exit` event's `stopped_by`; None there: nobody, it ended by
    itself: it finished, failed, or something outside gptop killed it)."""

    USER = "user"  # the user's stop: q, Ctrl-C, SIGTERM or SIGHUP to gptop, --no-ui's reader gone (twice: a kill)
    TUNER = "tuner"  # the tuner, to start it again: the next trial, the switch to the best, a failed trial's rollback
    GPTOP = "gptop"  # gptop's own planned end: --tune-only once best.toml is written, gptop closing with it alive


class TunerPhase(enum.StrEnum):
    """Where the tuner's state machine is (the `tuner` event's `phase`), in the order it goes through them."""

    INIT = "init"
    FIND_MICRO_BATCH = "find-micro-batch"
    BASELINE = "baseline"
    TRIALS = "trials"
    REMEASURE = "remeasure"
    DECIDE = "decide"
    CHECK = "check"  # the applied setting measured on the live run, against the start under the same load
    DONE = "done"


class TrialKind(enum.StrEnum):
    """What a measured configuration is to the tuner (a trial event's and a measurement's `kind`)."""

    BASELINE = "baseline"  # the run's starting configuration
    TRIAL = "trial"  # a configuration the study proposed
    REMEASURE = "remeasure"  # a measured candidate measured again before the decision
    CHECK = "check"  # the applied setting measured on the live run after the switch (its realized gain)


class TrialStatus(enum.StrEnum):
    """A trial's state in its `trial` events: running, then how its measurement ended."""

    RUNNING = "running"
    OK = "ok"  # measured to a stable estimate
    CUT = "cut"  # measured, but the time ran out before the estimate was stable
    PRUNED = "pruned"  # stopped early (or skipped): it could not beat the best
    INFEASIBLE = "infeasible"  # failed (out of memory, NaN, compile error, ...): rolled back

    @property
    def measured(self) -> bool:
        """Its throughput counts (a candidate for the best)."""
        return self in _MEASURED


_MEASURED = frozenset({TrialStatus.OK, TrialStatus.CUT})


class TrialOutcome(enum.StrEnum):
    """How a trial's run ended, as the driver tells the controller (`TuneController.finish_trial`): healthy,
    or the failure it was rolled back for."""

    OK = "ok"
    OOM = "oom"
    NAN = "nan"
    DIVERGED = "diverged"
    COMPILE = "compile"
    CRASH = "crash"

    @property
    def failed(self) -> bool:
        return self is not TrialOutcome.OK


# The outcomes a trial is rolled back for (an Optuna trial told infeasible with this kind).
TRIAL_FAILURES: tuple[TrialOutcome, ...] = tuple(o for o in TrialOutcome if o.failed)


class ErrorKind(enum.StrEnum):
    """Why a process ended with an `error` event (ErrorEvent.kind: a newer trainer may send a kind this version
    does not know, so the field stays a string and readers compare with these)."""

    OOM = "oom"
    NAN = "nan"
    CONFIG = "config"
    CRASH = "crash"
    COMPILE = "compile"
    NO_CHECKPOINT = "no_checkpoint"
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"
    DISK = "disk"
    # a process started at a step below the one gptop resumed it from (or had nothing to resume from after steps
    # were trained): training on would silently redo or lose those steps, so gptop stops the run
    LOST_STEPS = "lost_steps"


ERROR_KINDS = tuple(ErrorKind)
# Each kind in words, for a reader who does not know the codes (the end-of-run summary).
ERROR_WORDS: dict[str, str] = {
    ErrorKind.OOM: "out of memory",
    ErrorKind.NAN: "the loss or the gradients became NaN or infinite",
    ErrorKind.CONFIG: "the configuration was refused",
    ErrorKind.CRASH: "the trainer crashed",
    ErrorKind.COMPILE: "torch.compile failed",
    ErrorKind.NO_CHECKPOINT: "there was no checkpoint to resume from",
    ErrorKind.CORRUPT_CHECKPOINT: "no checkpoint could be read (all corrupt)",
    ErrorKind.DISK: "the run directory could not be written (disk full or read-only)",
    ErrorKind.LOST_STEPS: "gptop stopped the run rather than lose trained steps",
}


class WarningKind(enum.StrEnum):
    """The `warning` kinds besides the compile watchdog's (CompileWarning); a warning may have no kind."""

    ESTIMATE = "estimate"  # the early estimate says a step will be slow (trainer.startup)
    SLOW_TOGGLE = "slow_toggle"  # a toggle this device runs slower than without it
    NAN_ROLLBACK = "nan_rollback"  # the trainer rolled back after a non-finite step (trainer.nonfinite)
    PEAK_FLOPS = "peak_flops"  # no MFU: the device's peak is unknown or inconsistent with the FLOPs


class AlertKind(str, enum.Enum):
    """What an alert is about (gptop.alerts raises them; docs/dashboard.md says when each fires)."""

    STALL = "stall"  # no step for several times the recent step time, the process alive
    LOSS_SPIKE = "loss_spike"  # the loss far above its running median (in MADs)
    NAN_ROLLBACK = "nan_rollback"  # the trainer rolled back after a non-finite step
    THROUGHPUT_DROP = "throughput_drop"  # tokens/s sustained well below the run's steady rate
    THROTTLE = "throttle"  # the GPU's clocks held down by heat or the hardware (not a power cap)
    ECC = "ecc"  # new uncorrected ECC memory errors
    XID = "xid"  # the driver reported a critical Xid error
    GPU_LOST = "gpu_lost"  # the GPU fell off the bus (NVML: GPU is lost)


class CompileWarning(enum.StrEnum):
    """The `warning` kinds of the torch.compile watchdog (trainer.compile_watch) and of the compile-cache retry
    (trainer.inductor_cache): a tuner trial that saw them is marked so in its ledger row."""

    GRAPH_BREAK = "graph_break"  # after the first step: the compile split the model (the first reasons)
    RECOMPILE = "recompile"  # a guard failed after the first step and a frame compiled again
    COMPILE_FALLBACK = "compile_fallback"  # a frame hit the recompile limit and runs eagerly from then on
    COMPILE_CACHE = "compile_cache"  # a compiled artefact of the shared cache did not load: retried with
    #                                     the run's own inductor cache


class Severity(str, enum.Enum):
    WARNING = "warning"  # the run goes on, slower or noisier: look when you can
    CRITICAL = "critical"  # the run makes no progress or its hardware fails: look now
