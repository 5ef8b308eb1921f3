"""The trainer processes of a tuning (`gptop.tuning`'s driver): starting one from a checkpoint with a trial's or
the user's settings, stopping one and waiting for its exit, and rolling a failed trial back to its pinned
pre-trial checkpoint (a command's: held in the run directory, gptop.held_checkpoints). A start that would lose
trained steps (the checkpoint to resume from is gone, or there is none after steps were trained) is never made:
the session is halted with a `lost_steps` error instead. A test hook (`GPTOP_TEST_TRIAL_FAULT`) injects trainer
faults into a chosen trial (a command gets them in GPTOP_TEST_FAULT, for a test script to act on)."""

from __future__ import annotations

import dataclasses
import enum
import math
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from trainer.contract import events as ev
from trainer.contract import rundir
from trainer.contract.config import AUTO, Toggles, TrainConfig
from trainer.contract.states import ErrorKind, StoppedBy

from . import held_checkpoints as held

if TYPE_CHECKING:
    from tuner.tuning_report import TunedCommand
    from tuner.controller import TuneController

    from .tuning import TuningHost

TEST_FAULT_ENV = "GPTOP_TEST_TRIAL_FAULT"  # "N:KIND[@K][+KIND@K...]": trainer faults (trainer/faults.py) K
# How long a command under `gptop tune` may run without a gptop client announcing itself: a client does so when
# imported (gptop.integrations.announce), at the top of a script, within seconds of Python's start.
CLIENT_WAIT_S = 120.0
# How long a failed trial's process that reported its own failure (a crash, an OOM, the NaN it stopped on) is given to
# end by itself before the rollback kills it: a traceback and the interpreter's exit, seconds even with torch loaded.
OWN_END_S = 10.0
NO_CLIENT = (
    "gptop tune -- CMD tunes a transformers.Trainer script through gptop's client: callbacks=[GptopCallback()], "
    "args = tuned_args(TrainingArguments(...)) and trainer.train(resume_from_checkpoint=resume_checkpoint(args)) "
    'from gptop.integrations.transformers (docs/your-code.md, "Tuning your script"); run it as it is with gptop run'
)
COMMAND_FAULT_ENV = "GPTOP_TEST_FAULT"  # a command's trial faults (KIND@STEP,...), for a test script to act on
DEFAULT_FAULT_OFFSET = 2  # steps into this session's N-th trial (tests only; default K=2)
Checkpoint = tuple[int, str]  # (step, path) as a checkpoint event reports it
TUNE_ONLY_END = "tuning done (--tune-only)"  # the `done` reason of the trainer --tune-only stops


class Inbox(enum.Enum):
    """What the driver's queue carries: a trainer's event, its exit code, or the `t` key's stop (with why)."""

    EVENT = "event"
    EXIT = "exit"
    ABORT = "abort"


Pump = Callable[[float], tuple[Inbox, Any] | None]  # the driver's queue: one item, its bookkeeping done


def start_below(hello: ev.HelloEvent, expect: tuple[int, str | None] | None, who: str) -> str | None:
    """Why a process's start loses steps: it started below the step of the checkpoint gptop resumed it from
    (`expect`: that step and path), so it would train the steps between again and lose what they learned.
    None when it did not, or nothing was expected (a start of its own, gptop's early record of a start)."""
    if expect is None or hello.early or hello.start_step >= expect[0]:
        return None
    want, path = expect
    return (
        f"{who} started at step {hello.start_step}, not at step {want} of the checkpoint gptop resumed it from "
        f"({path}): it would train steps {hello.start_step + 1}-{want} again and lose what they learned, so gptop "
        f"stopped it"
    )


def parse_test_fault(spec: str) -> tuple[int, tuple[tuple[str, int], ...]] | None:
    """`N:KIND[@K][+KIND@K...]` -> (N, ((KIND, K), ...)); None when unset or unreadable (a test hook never
    breaks a run). Several faults make a trial's failure independent of how fast it is: `checkpoint@2+nan@3`
    writes a checkpoint and then fails before any pruning rule has the samples to cut the trial first."""
    if not spec or ":" not in spec:
        return None
    n, _, rest = spec.partition(":")
    faults = []
    try:
        for part in rest.split("+"):
            kind, _, k = part.partition("@")
            if not kind.strip():
                return None
            faults.append((kind.strip(), int(k) if k else DEFAULT_FAULT_OFFSET))
        return int(n), tuple(faults)
    except ValueError:
        return None


class TrialProcesses:
    """What the driver knows of the trainer process and starts it with: whether one runs, the config it was
    started with, the user's own settings, and the checkpoints the processes reported. `pump` is the driver's
    queue (exits and events while a stop is awaited); `ctl` the controller, once tuning started."""

    def __init__(self, session: TuningHost, say: Callable[[str], None], pump: Pump, trial_log_every: int):
        self.session = session
        self.say = say
        self.pump = pump
        self.trial_log_every = trial_log_every
        self.ctl: TuneController | None = None
        self.user_cfg: TrainConfig | None = None  # the user's own settings (a command's from its first hello)
        self.command = False  # the run is a user's script (gptop tune -- CMD), known at its hello
        self.hello: ev.HelloEvent | None = None  # the first process's built hello
        self.alive = False  # a trainer process runs (as far as the queue has told the driver)
        self.steps_since_spawn = 0
        self.spawned_at: float | None = None
        self.running_cfg: TrainConfig | None = None  # the config of the process we started (None: the session's)
        self.last_ckpt: Checkpoint | None = None
        self.reported: list[Checkpoint] = []  # checkpoints the processes reported
        # a command's checkpoints saved at a step it saves at anyway, not only for gptop's stop: never moved
        self.own: set[str] = set()
        self.reached = 0  # the step the run stands at: the furthest step seen since the last rollback
        self.client_wait_s = CLIENT_WAIT_S
        self.own_end_s = OWN_END_S

    def user(self) -> TrainConfig:
        """The user's own settings: known from `TuningDriver.attach` on (a command's from its client's first hello)."""
        if self.user_cfg is None:
            raise RuntimeError("the tuning driver was not attached")
        return self.user_cfg

    # ------------------------------------------------------------ what runs
    def saw_hello(self) -> None:
        """The running process said hello: it runs, no step yet."""
        self.alive = True
        self.steps_since_spawn = 0

    def saw_step(self, step: int | None = None) -> float | None:
        """A step of the running process; the first after a spawn returns how long that start took."""
        if step is not None:
            self.reached = max(self.reached, step)
        took = None
        if self.steps_since_spawn == 0 and self.spawned_at is not None:
            took = time.monotonic() - self.spawned_at
            self.spawned_at = None
        self.steps_since_spawn += 1
        return took

    def saw_checkpoint(self, event: ev.CheckpointEvent) -> None:
        """A checkpoint a process wrote: the next restart's and rollback's reference."""
        self.last_ckpt = (event.step, event.path)
        self.reported.append((event.step, event.path))
        if event.reason != "stop":  # its own interval or last step (or a client that does not say): the script's
            self.own.add(event.path)

    def check_client(self, waited: float, exit_code: int | None = None) -> None:
        """`gptop tune -- CMD` of a program with no gptop client, rather than train it untuned: refused (a
        `config` error: one line, exit 2) once it exited (`exit_code`), or ran `client_wait_s`, before a client
        announced itself."""
        s = self.session
        sup = s.supervisor
        if s.command is None or sup is None or sup.client_connected or s.interrupted or s.halted is not None:
            return
        if exit_code is None and waited < self.client_wait_s:
            return
        if exit_code is None:
            how = f"no client announced itself in the {waited:.0f} s it ran"
        else:
            how = f"it exited ({f'code {exit_code}' if exit_code >= 0 else f'signal {-exit_code}'}) without one"
        s.halt(ErrorKind.CONFIG, f"gptop tune: the command has no gptop client ({how}); {NO_CLIENT}")

    def cfg_for(self, toggles: Toggles, strict: bool) -> TrainConfig:
        """The user's config with `toggles`; trial processes (strict) stop on NaN and log every step."""
        cfg = TrainConfig.from_dict(self.user().to_dict())
        cfg.toggles = dataclasses.replace(toggles)
        cfg.run.fault = None
        if strict:
            if not self.command:  # a command's NaN is the loss check's (its step events)
                cfg.run.nan_policy = "stop"  # a NaN ends the trial; the driver rolls back
            cfg.log.log_every = min(cfg.log.log_every, self.trial_log_every)
        return cfg

    def differs(self, want: TrainConfig, log_every: bool = True) -> bool:
        """Whether the running process was started with other toggles or run settings than `want` (the log
        interval counted only with `log_every`: a command changes it)."""
        have = self.running_cfg or self.session.cfg
        toggles = have.toggles
        if self.running_cfg is None and self.hello is not None:
            # the user's own process: its toggles as its trainer resolved them (`auto` precision is a concrete one
            # in its hello, as in the tuner's start), not as typed; keeping the start restarts nothing
            toggles = TrainConfig.from_dict(self.hello.config).toggles
            if toggles.micro_batch == AUTO and self.hello.micro_batch is not None:
                toggles = dataclasses.replace(toggles, micro_batch=self.hello.micro_batch)  # what `auto` resolved to
        return (
            toggles != want.toggles
            or have.run.nan_policy != want.run.nan_policy
            or (log_every and have.log.log_every != want.log.log_every)
        )

    # ------------------------------------------------------------ starting and stopping
    def log_every(self, steps: int) -> None:
        """Ask the running trainer for a step event every `steps` steps (a command: no restart). One
        synchronization per step while it measures; the interval is given back when it is done."""
        sup = self.session.supervisor
        if sup is not None and self.alive:
            sup.send({"cmd": "log_every", "steps": steps})

    def stop(self, kill: bool = False, *, last: bool = False) -> None:
        """Stop the trainer and wait for its exit: graceful (it checkpoints) unless `kill`. A graceful stop that
        takes far longer than a step (a compile in progress, a hung process) is turned into a kill. `last`: no
        trainer follows (--tune-only's end), so it is gptop's end of the run, not the tuner's restart."""
        sup = self.session.supervisor
        if not self.alive or sup is None:
            self.alive = False
            return
        by = StoppedBy.GPTOP if last else StoppedBy.TUNER
        if kill:
            sup.kill(by=by)
        else:  # its `done`: a trainer's end, not the run's (a restart follows), or the planned end
            sup.request_stop(reason=TUNE_ONLY_END if last else ev.TUNER_RESTART, by=by)
        ctl = self.ctl
        step_s = 0.0
        if ctl is not None and ctl.in_trial:
            ms = ctl.trial_step_ms
            step_s = ms / 1000.0 if math.isfinite(ms) else 0.0
        ckpt_s = ctl.checkpoint_s if ctl is not None else 0.0
        grace = 5.0 if self.steps_since_spawn == 0 else max(30.0, 5 * step_s + 3 * ckpt_s)
        deadline = time.monotonic() + grace
        feed_steps = ctl is not None and not ctl.in_trial
        while self.alive:
            item = self.pump(0.5)
            if item is not None and item[0] is Inbox.EVENT and ctl is not None:
                # the last steps of the process being stopped: healthy steps between trials feed the loss
                # trend; they must not count as the measurement of a trial that is about to start
                if feed_steps or isinstance(item[1], ev.CheckpointEvent):
                    ctl.observe(item[1])
            if not kill and self.alive and time.monotonic() > deadline:
                self.say(f"the trainer did not stop within {grace:.0f} s; killing it")
                sup.kill(by=by)
                kill = True

    def await_own_end(self) -> None:
        """A process that reported its own failure is ending by itself: wait up to `own_end_s` for it, so that
        gptop records its end as its own (its exit code and last stderr lines: the user's traceback), not as a
        kill by the tuner. One that reported nothing (a trial the tuner judged) or lingers is killed after."""
        if not self.alive or 0 not in self.session.rank_errors:
            return
        deadline = time.monotonic() + self.own_end_s
        while self.alive and time.monotonic() < deadline:
            self.pump(0.5)

    def spawn(self, cfg: TrainConfig, pre: Checkpoint | None) -> None:
        """Start a trainer with `cfg`, resuming from `pre` when it names a checkpoint; the session checks that
        it starts at that checkpoint's step."""
        self.running_cfg = cfg
        self.alive = True
        self.steps_since_spawn = 0
        self.spawned_at = time.monotonic()
        resume = pre[1] if pre and pre[1] else None
        self.session.spawn(cfg, resume=resume, start_step=pre[0] if resume and pre else 0)

    def start(self, toggles: Toggles, fault: tuple[tuple[str, int], ...] | None, strict: bool) -> Checkpoint | None:
        """Start a trainer with `toggles` from the newest checkpoint (once the last one stopped); a trial's
        (`strict`) pins it as the rollback target. Returns the checkpoint it resumes from ((0, "") for none),
        or None when no start can keep the steps trained (the session is halted)."""
        pre = self.resume_point()
        if self.session.halted is not None:
            return None
        cfg = self.cfg_for(toggles, strict)
        if fault:
            cfg.run.fault = ",".join(f"{kind}@{(pre[0] if pre else 0) + k}" for kind, k in fault)
        if strict and not self.command:  # a command's is held in the run directory (resume_point)
            self.guard(pre)
        self.spawn(cfg, pre)
        return pre or (0, "")

    def resume_point(self) -> Checkpoint | None:
        """The checkpoint the next process starts from: the newest one reported (a command's, held in the run
        directory: gptop.held_checkpoints), None for the start. A start that would lose trained steps halts the
        session instead: the checkpoint is gone, or there is none and the run has trained steps."""
        pre = self.last_ckpt
        run_dir = self.session.run_dir
        if pre is not None and not Path(pre[1]).exists():
            if self.command:  # the script deleted it (its own rotation): no other holds those steps
                self.lost(f"the checkpoint of step {pre[0]} to resume from is gone ({pre[1]})", pre[0])
                return None
            newest = rundir.list_checkpoints(run_dir)  # pruned between trials: the newest there is
            pre = (newest[-1].step, str(newest[-1].path)) if newest else None
        if pre is None and self.reached > 0:
            self.lost(f"there is no checkpoint to resume from after step {self.reached}", self.reached)
            return None
        if self.command and pre is not None:
            try:
                path = held.hold(run_dir, pre[0], pre[1], move=pre[1] not in self.own)
            except OSError as e:  # a full disk: resume from it where it is
                self.say(f"could not hold the checkpoint of step {pre[0]} in {held.held_dir(run_dir)} ({e})")
            else:
                pre = self.last_ckpt = (pre[0], str(path))
        return pre

    def lost(self, why: str, step: int) -> None:
        """Halt the session rather than start a process that would redo the run from an earlier step."""
        self.session.halt(
            ErrorKind.LOST_STEPS,
            f"{why}: a restart would lose the steps the run trained up to step {step}, so gptop stopped the "
            f"tuning and the run instead",
        )

    # ------------------------------------------------------------ a command's (gptop tune -- CMD)
    def command_cfg(self, hello: ev.HelloEvent, run_dir: str | None, log_every: int | None) -> TrainConfig:
        """A command's own settings as the tuner's config, from its client's first hello: its toggles, the batch
        of an optimizer step, sequence length, max_steps and model (the study's key); the log interval gptop
        asks of the process that trains on after tuning (--log-every, else the default)."""
        cfg = TrainConfig.from_dict(hello.config)
        cfg.run.run_dir = run_dir
        cfg.log.log_every = log_every if log_every is not None else TrainConfig().log.log_every
        return cfg

    def tuned_command(self, argv: list[str] | None, start: Toggles) -> TunedCommand | None:
        """The script `gptop tune -- CMD` tunes, for best.toml's words on applying its best (`start`: the
        toggles it started with); None for gptop's own trainer."""
        from tuner.tuning_report import TunedCommand

        hello = self.hello
        if not self.command or argv is None:
            return None
        per_device = (
            hello.micro_batch * hello.accumulation if hello and hello.micro_batch and hello.accumulation else None
        )
        return TunedCommand(argv=list(argv), start=start, per_device=per_device)

    # ------------------------------------------------------------ rollback
    def guard(self, pre: Checkpoint | None) -> None:
        """Pin the pre-trial checkpoint: the trial's own pruning (--keep-checkpoints) must keep the rollback
        target. One pin at a time: the previous trial's target is released."""
        run_dir = self.session.run_dir
        rundir.unpin(run_dir)
        if pre and pre[1] and Path(pre[1]).exists():
            rundir.pin(run_dir, pre[0])

    def release_guard(self) -> None:
        """Unpin the last rollback target: tuning is over."""
        rundir.unpin(self.session.run_dir)

    def delete_reported(self, keep_step: int) -> list[str]:
        """Delete the checkpoints after `keep_step` that a failed trial's process reported outside the run
        directory (a command's own, e.g. a Trainer's output_dir/checkpoint-N): the next process resumes from
        the pre-trial one, and the script's own rotation (save_total_limit) must not count the failed ones."""
        run_dir = Path(self.session.run_dir).resolve()
        deleted, kept = [], []
        for step, path in self.reported:
            p = Path(path)
            inside = p.resolve().is_relative_to(run_dir)
            if step <= keep_step or inside:
                kept.append((step, path))
            elif p.exists():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                deleted.append(path)
        self.reported = kept
        return deleted

    def rollback(self, pre: Checkpoint | None) -> dict[str, Any]:
        """Kill the failed trial if it still runs and delete the checkpoints it wrote: the run directory's
        newest checkpoint is the pinned pre-trial one again (none: the start, when the trial started there). A
        pre-trial checkpoint that is gone halts the session (`lost`) rather than go back to the start."""
        self.await_own_end()
        self.stop(kill=True)
        run_dir = Path(self.session.run_dir)
        keep_step = pre[0] if pre and pre[1] else -1
        deleted = [str(p) for p in rundir.rollback_to(run_dir, keep_step)] + self.delete_reported(keep_step)
        gone = pre is not None and bool(pre[1]) and not Path(pre[1]).exists()
        self.last_ckpt = pre if pre and pre[1] and not gone else None
        step = self.reached = max(keep_step, 0)
        done = f"; deleted {len(deleted)} checkpoint(s) it wrote" if deleted else ""
        if gone and pre is not None:
            self.say(f"trial could not roll back: the checkpoint of step {step} is gone ({pre[1]}){done}")
            self.lost(f"the checkpoint of step {step} a failed trial rolls back to is gone ({pre[1]})", step)
        else:
            where = f" ({self.last_ckpt[1]})" if self.last_ckpt else " (the start)"
            self.say(f"trial rolled back to step {step}{where}{done}")
        return {"step": step, "path": self.last_ckpt[1] if self.last_ckpt else None, "deleted": deleted}
