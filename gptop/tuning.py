"""Tuning on the live run: the session side of the tuner.

The `TuneController` (tuner/) decides; this driver does. It runs in its own
thread, watches the trainer's events through a session hook, and turns the
controller's actions into process restarts (`gptop.trial_processes` starts,
stops and rolls back the processes):

- a trial starts by a graceful stop of the running trainer (it checkpoints:
  the pre-trial checkpoint) and a restart from that checkpoint with the
  trial's toggles; its steps are real training steps and are kept;
- a failed trial (OOM, NaN, divergence, compile error, crash) is killed if it
  still runs, the checkpoints it wrote are deleted, and the next process
  resumes from the pre-trial checkpoint: the step count and weights are those
  of before the trial. The pre-trial checkpoint is pinned while a trial runs
  (trainer.contract.rundir), so the trial's own checkpoint pruning
  (`--keep-checkpoints`) cannot take the rollback target away;
- the best setting is applied the same way, after a checkpoint, and training
  goes on to --max-steps. Trial processes run with `--nan-policy stop` (a NaN
  must end the trial, not be trained around) and log every step; the process
  that trains on after tuning runs with the user's own settings, so it is
  restarted when those differ (the log interval alone is a command: the
  start's own process trains on without a restart when tuning cannot pay).

What a trial costs and whether it can pay is the controller's (tuner.decide);
the driver gives it the figures only the session has: where a running run is
and its pace (the `t` key), and how long this setup's trainer takes to start
(the first process's start to its built hello; every restart's to its first
step). With `--tune-only` the trials pay off in later runs (best.toml), not in
this one: the controller then keeps the whole budget and search.

The driver is the session's controller (`Session.set_controller`, the
`gptop.session.Controller` protocol) while it tunes: it sees every event and
owns every trainer exit. An expected exit (a restart) or a failed trial is
handled here; the end of the run, an interrupt or a failure outside a trial is
handed back to the session (`Session.handle_exit`) after the tuning report is
written, so the exit code and status are the session's as always and no report
is lost to a racing exit. The session starts a driver (`Session.start_tuning`)
for `gptop tune`, `--tune` and the `t` key.

Trial, apply, tuner and `log` events (the decision, said either way, and each
rollback) go through `Session.publish`, which appends them to the run's
events.jsonl, so a replay or `gptop report` sees the tuning as it happened.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from trainer.contract import events as ev
from trainer.contract.config import AUTO, Toggles, TrainConfig
from trainer.contract.states import ErrorKind, TrialOutcome
from tuner.measure import TrialStop
from tuner.settings import MAX_TRIALS, STABLE_WITHIN

from .advice import tries as advice_tries
from .trial_processes import TEST_FAULT_ENV, Inbox, TrialProcesses, parse_test_fault
from .tuning_check import AppliedCheck
from .tuning_space import tuning_space

if TYPE_CHECKING:
    from tuner.controller import Remeasure, RunTrial, TuneController
    from tuner.load import LoadPoint
    from tuner.study import TuneStudy

    from .state import RunState
    from .supervisor import Supervisor

STEADY = frozenset(TrialStop)  # a healthy trial's stops: its steps are kept (or rolled back by choice)


class MeasureEnd(enum.StrEnum):
    """Why the driver stopped measuring a trial for a reason of the session's, not the controller's."""

    ABORT = "abort"  # the `t` key: decide on what was measured, train on
    INTERRUPTED = "interrupted"  # the run was interrupted, or gptop halted it (Session.halt)
    FINISHED = "finished"  # the trainer reached --max-steps during the trial


PACE_STEPS = 50  # the recent step events whose median pace a `t` key plans on


class TuningHost(Protocol):
    """What the driver needs of the session that runs it (gptop.session.Session is one): the run's config,
    directory, state and process, and the session's controller slot, event log and exit handling."""

    cfg: TrainConfig
    run_dir: Path
    state: RunState
    supervisor: Supervisor | None
    interrupted: bool
    command: list[str] | None  # a user's program (gptop tune -- CMD); None: gptop's own trainer
    halted: str | None  # gptop ended the run itself (`halt`): nothing is started again
    rank_errors: dict[int, ev.ErrorEvent]  # the running process's first error event per rank (its own failure)

    @property
    def finished(self) -> bool: ...
    def set_controller(self, controller: TuningDriver | None) -> None: ...
    def publish(self, event: ev.Event) -> None: ...
    def log(self, message: str) -> None: ...
    def spawn(
        self, cfg: TrainConfig | None = None, resume: str | None = None, start_step: int | None = None
    ) -> None: ...
    def halt(self, kind: ErrorKind, message: str) -> None: ...
    def handle_exit(self, code: int) -> None: ...
    def energy_between(self, t0: float, t1: float) -> float | None: ...
    def load_between(self, t0: float, t1: float) -> Sequence[LoadPoint]: ...


class TuningDriver(AppliedCheck):
    """The session's controller while it tunes (gptop.session.Controller); `Session.start_tuning` makes one.
    After a decision to apply, the switch and the applied setting's check on the live run are
    `gptop.tuning_check.AppliedCheck`'s."""

    def __init__(
        self,
        session: TuningHost,
        budget_s: float,
        space_spec: str | None = None,
        storage: str | None = None,
        tune_only: bool = False,
        trial_log_every: int = 1,
        hello: ev.HelloEvent | None = None,
        stable_within: float = STABLE_WITHIN,
        max_trials: int = MAX_TRIALS,
    ):
        self.session = session
        self.budget_s = budget_s
        self.space_spec = space_spec
        self.storage = storage
        self.tune_only = tune_only
        self.stable_within = stable_within
        self.max_trials = max_trials
        self.trial_log_every = trial_log_every
        self.q: "queue.Queue[tuple[Inbox, Any]]" = queue.Queue()
        self.ctl: TuneController | None = None
        self.study: TuneStudy | None = None
        self.thread: threading.Thread | None = None
        self.finished = threading.Event()
        self.error: str | None = None
        self.report_paths: dict[str, Path] | None = None
        self.procs = TrialProcesses(session, self._say, self._next, trial_log_every)
        self.procs.hello = hello
        self._lock = threading.Lock()
        self._attached = False
        self._exit_code: int | None = None
        self._complete = False  # the run reached --max-steps
        self._abort: str | None = None
        self._restart_s: list[float] = []
        self._pace_known = False
        self._per_trial = 0.0
        self.ended_in_check = False  # the applied setting's process ended while it was checked
        self.test_fault = parse_test_fault(os.environ.get(TEST_FAULT_ENV, ""))

    # ------------------------------------------------------------- wiring
    def attach(self) -> "TuningDriver":
        s = self.session
        procs = self.procs
        procs.user_cfg = TrainConfig.from_dict(s.cfg.to_dict())
        sup = s.supervisor
        procs.alive = sup is not None and sup.alive()
        if not procs.alive and procs.hello is None:
            # not started yet (gptop tune): the first process is the baseline and logs every step
            s.cfg.log.log_every = min(s.cfg.log.log_every, self.trial_log_every)
        with self._lock:
            s.set_controller(self)
            self._attached = True
        self.thread = threading.Thread(target=self._run_safely, name="gptop-tuning", daemon=True)
        self.thread.start()
        return self

    def on_event(self, event: ev.Event) -> None:
        """Every event the session sees: the ones a tuning decides on go to this driver's thread."""
        if isinstance(event, ev.CheckpointEvent) and event.rank == 0:
            self.procs.saw_checkpoint(event)
        # warnings: the compile watchdog's, which mark a trial that recompiled (tuner.controller)
        if isinstance(
            event, (ev.HelloEvent, ev.StepEvent, ev.CheckpointEvent, ev.ErrorEvent, ev.DoneEvent, ev.WarningEvent)
        ):
            self.q.put((Inbox.EVENT, event))

    def on_trainer_exit(self, code: int) -> bool:
        """While attached, every trainer exit is the driver's to handle (this thread decides what it means)."""
        with self._lock:
            if not self._attached:
                return False
            self.q.put((Inbox.EXIT, code))
            return True

    def stop_tuning(self) -> None:
        """The `t` key while tuning: stop now and train on (with the running configuration if it is healthy)."""
        self.q.put((Inbox.ABORT, "stopped by the user"))

    def _detach(self) -> None:
        """Give the session back its exit handling; hand it an exit the tuning consumed but did not handle."""
        s = self.session
        with self._lock:
            if not self._attached:
                return
            self._attached = False
            s.set_controller(None)
            while True:  # exits queued but not yet seen by this thread
                try:
                    kind, payload = self.q.get_nowait()
                except queue.Empty:
                    break
                if kind is Inbox.EXIT:
                    self.procs.alive, self._exit_code = False, payload
        sup = s.supervisor
        if not self.procs.alive and not s.finished and not (sup is not None and sup.alive()):
            code = self._exit_code if self._exit_code is not None else 0
            s.handle_exit(code)

    # ---------------------------------------------------------- main loop
    def _run_safely(self) -> None:
        try:
            self._run()
        except Exception as e:  # tuning must never take the run down with it
            import traceback

            self.error = f"{type(e).__name__}: {e}"
            self._say(f"tuning stopped by an internal error: {self.error}")
            self.session.log(traceback.format_exc())
            try:
                procs = self.procs
                if (
                    procs.user_cfg is not None
                    and not procs.alive
                    and not self.session.interrupted
                    and self.session.halted is None
                    and not self._complete
                ):
                    procs.spawn(procs.cfg_for(procs.user_cfg.toggles, strict=False), procs.last_ckpt)
            finally:
                self._detach()
        finally:
            self.finished.set()

    def _publish(self) -> None:
        if self.ctl is None:
            return
        for event in self.ctl.drain_events():
            self.session.publish(event)

    def _say(self, message: str, **fields: Any) -> None:
        """A `log` event: the log panel in the TUI, a line in --no-ui, a JSON line with --json."""
        self.session.publish(ev.LogEvent(message=f"tuner: {message}", source="tuner", **fields))

    def _next(self, timeout: float = 0.2) -> tuple[Inbox, Any] | None:
        """One queue item, with the bookkeeping every waiter needs (process alive, run complete, abort)."""
        try:
            item = self.q.get(timeout=timeout)
        except queue.Empty:
            return None
        kind, payload = item
        if kind is Inbox.EXIT:
            self.procs.alive, self._exit_code = False, payload
        elif kind is Inbox.ABORT:
            self._abort = self._abort or str(payload)
        elif kind is Inbox.EVENT:
            if payload.rank == 0:
                if isinstance(payload, ev.HelloEvent):
                    self.procs.saw_hello()
                elif isinstance(payload, ev.StepEvent):
                    took = self.procs.saw_step(payload.step)
                    if took is not None:  # how long this setup's trainer takes to start
                        self._restart_s.append(took)
                        self._update_reserve()
                elif isinstance(payload, ev.DoneEvent) and payload.reason == "max_steps":
                    self._complete = True
        return item

    def _wait_hello(self) -> ev.HelloEvent | None:
        since = time.monotonic()
        while True:
            item = self._next(1.0)
            if item is None:
                if self.session.finished:
                    return None
                self.procs.check_client(time.monotonic() - since)  # a command without a client is refused
                continue
            kind, payload = item
            if kind is Inbox.EVENT and isinstance(payload, ev.HelloEvent) and not payload.early:
                return payload  # the built run (an early hello comes before anything is built)
            if kind in (Inbox.EXIT, Inbox.ABORT):
                if kind is Inbox.EXIT:
                    self.procs.check_client(time.monotonic() - since, exit_code=payload)
                return None

    def _update_reserve(self) -> None:
        """Keep enough budget for the final switch: a restart as long as the ones seen, plus a checkpoint; and
        tell the controller how long this setup's trainer takes to start."""
        if self.ctl is not None and self._restart_s:
            from statistics import median

            restart = median(self._restart_s)
            self.ctl.learn_restart(restart, 2 * self._per_trial + 2 * restart)

    def _startup_s(self, hello: ev.HelloEvent) -> float | None:
        """How long the running trainer took from its start to its built hello: what a restart costs at least."""
        sup = self.session.supervisor
        started = sup.started_at if sup is not None else None
        return max(0.0, hello.time - started) if started is not None and hello.time >= started else None

    def _run(self) -> None:
        from tuner.controller import Apply, Check, Done, FindMicroBatch, Remeasure, RunTrial

        procs = self.procs
        self._pace_known = procs.hello is not None  # a trainer that ran before tuning (the `t` key)
        hello = procs.hello or self._wait_hello()
        if hello is None:
            return self._conclude(None)
        procs.hello = hello
        command = hello.client is not None  # a user's script (gptop tune -- CMD) through its client
        if command:
            if hello.tunable is None:  # its client refuses a tune itself; an old one may not
                self._say(f"the command's {hello.client} client takes no toggles: nothing to tune")
                return self._conclude(None)
            procs.command = True
            procs.user_cfg = procs.command_cfg(
                hello, self.session.cfg.run.run_dir, getattr(self.session, "log_every", None)
            )
            procs.running_cfg = procs.cfg_for(procs.user_cfg.toggles, strict=True)  # the baseline's process
        user_mb = procs.user().toggles.micro_batch
        ctl = self._open_controller(hello, command)
        trial_index = 0
        while True:
            if self.session.halted is not None:
                ctl.abort(self.session.halted)
                return self._conclude(None)
            if self._abort:
                return self._conclude(ctl.stop_early(self._abort))
            action = ctl.next_action()
            self._publish()
            if isinstance(action, FindMicroBatch):
                ctl.set_max_micro_batch(hello.micro_batch if user_mb == AUTO else None)
                continue
            if isinstance(action, (RunTrial, Remeasure)):
                fault = None
                if isinstance(action, RunTrial) and not action.baseline:
                    trial_index += 1
                    if self.test_fault and self.test_fault[0] == trial_index:
                        fault = self.test_fault[1]
                if not self._run_trial(ctl, action, fault):
                    return None
                continue
            if isinstance(action, Apply) and ctl.final is None:  # checked on the live run next
                if not self._switch(ctl, action):
                    return None
                continue
            if isinstance(action, Check):
                if not self._run_check(ctl, action):
                    return None
                continue
            if isinstance(action, (Apply, Done)):
                return self._conclude(action)

    def _open_controller(self, hello: ev.HelloEvent, command: bool) -> "TuneController":
        """The study of this setup and the controller that tunes over it, from the trainer's hello."""
        from tuner.budget import Budget
        from tuner.controller import TuneController, TunerSettings
        from tuner.study import TuneStudy

        dev = hello.device
        cfg = TrainConfig.from_dict(hello.config)
        base_mb = self.procs.user().toggles.micro_batch
        start = dataclasses.replace(cfg.toggles, micro_batch=base_mb)
        world = hello.world_size
        space, note = tuning_space(
            dataclasses.replace(cfg, toggles=start),
            dev,
            hello.micro_batch if base_mb == AUTO else None,
            world,
            self.space_spec,
            self.budget_s,
            command=hello.tunable if command else None,
        )
        cfg.toggles = start
        self.study = study = TuneStudy.open(cfg, dev, space, storage=self.storage, world_size=world)
        # A trial measures for at most ~1/12 of the budget (>= 8 s), so a short budget still sees several trials;
        # one that has not produced a measurement in twice that (a slow compile) is cut.
        per_trial = max(8.0, min(300.0, self.budget_s / 12))
        restart_guess = min(30.0, max(5.0, self.budget_s / 20))
        self._per_trial = per_trial
        startup = self._startup_s(hello)
        # a trial that has not warmed up after twice its measuring time plus two starts of this setup's trainer
        # (a compile that does not finish) is cut; a loaded machine's slow starts do not cut healthy trials
        restart = max(restart_guess, startup or 0.0)
        settings = TunerSettings(
            rel_ci=self.stable_within,
            max_trials=self.max_trials,
            max_seconds=per_trial,
            default_restart_s=restart_guess,
            # re-measuring the top two is worth a trial only in longer budgets;
            # in short ones more configurations measured once win
            reserve_trials=1 if self.budget_s >= 600 else 0,
            trial_timeout_s=2 * per_trial + 2 * restart,
            switch_reserve_s=restart,
            energy=self.session.energy_between,
            load=self.session.load_between,  # measurements compared only under the same background load
            run_pays=not self.tune_only,
            check_applied=not self.tune_only,  # the applied setting, measured on the live run
            startup_s=startup,
            # a trial's process trains on as it is only if its settings are the user's
            trial_process_continues=command or self.procs.user().run.nan_policy == "stop",
            # the advice's toggles are the first proposals (asked when trials start)
            advice=lambda: advice_tries(self.session.state.advice()),
        )
        self.ctl = self.procs.ctl = ctl = TuneController(
            cfg, dev, space, study, Budget(self.budget_s), settings=settings
        )
        if self._pace_known and self.session.state.step:  # the `t` key: where the run is and how fast it goes
            tps, _ = self.session.state.steady_medians(last=PACE_STEPS)
            ctl.set_pace(self.session.state.step, ctl.tokens_per_step / tps if tps else None)
        self._say(
            f"tuning for up to {self.budget_s:.0f} s over {', '.join(space.params) or 'nothing'} "
            f"(study {study.name}){note}",
            study=study.name,
        )
        return ctl

    def _run_trial(
        self, ctl: "TuneController", action: "RunTrial | Remeasure", fault: tuple[tuple[str, int], ...] | None
    ) -> bool:
        """Run one measurement the controller asked for and tell it how it went; False when the tuning
        concluded meanwhile (interrupted, finished, stopped by the user)."""
        procs = self.procs
        pre = procs.last_ckpt
        restore_log = None
        if not action.restart and procs.alive:
            # measured on the running process (the baseline after `t`): it logs every step meanwhile
            restore_log = (procs.running_cfg or self.session.cfg).log.log_every
            if restore_log > self.trial_log_every:
                procs.log_every(self.trial_log_every)
            else:
                restore_log = None
        if action.restart or not procs.alive:
            pre = self._restart(action.toggles, fault=fault, strict=True)
            if pre is None:  # interrupted, stopped or finished while switching
                if self._abort and not (self.session.interrupted or self.session.halted or self._complete):
                    self._conclude(ctl.stop_early(self._abort))
                    return False
                ctl.abort(self._end_reason())
                self._publish()
                self._conclude(None)
                return False
        outcome, reason = self._measure(ctl)
        if restore_log is not None:
            procs.log_every(restore_log)
        if outcome is MeasureEnd.ABORT:
            if not action.keep_steps:  # its fresh optimizer state must not become the run's
                procs.rollback(pre)
            self._conclude(ctl.stop_early(reason, rolled_back=not action.keep_steps))
            return False
        if outcome in (MeasureEnd.INTERRUPTED, MeasureEnd.FINISHED):
            if outcome is MeasureEnd.FINISHED and ctl.in_trial:
                ctl.finish_trial(TrialOutcome.OK)  # its steps are the run's last: kept
            ctl.abort(reason)
            self._publish()
            self._conclude(None)
            return False
        if outcome in STEADY and action.keep_steps:
            ctl.finish_trial(TrialOutcome.OK)
        elif outcome in STEADY:  # measured; rolled back so the run keeps its optimizer state
            ctl.finish_trial(TrialOutcome.OK, rollback=procs.rollback(pre))
        else:
            assert isinstance(outcome, TrialOutcome)
            ctl.finish_trial(outcome, reason, rollback=procs.rollback(pre))
        self._publish()
        if ctl.study is not self.study:  # the start ran out of memory: memory is the constraint
            self.study = ctl.study
            self._say(
                f"memory is the constraint ({ctl.space.memory}): tuning over "
                f"{', '.join(ctl.space.params) or 'nothing'} (study {ctl.study.name})",
                study=ctl.study.name,
            )
        return True

    def _end_reason(self) -> str:
        if self.session.halted is not None:
            return self.session.halted
        if self._abort:
            return self._abort
        if self.session.interrupted:
            return "the run was interrupted"
        if self._complete:
            return "the run reached --max-steps while tuning"
        return "the trainer stopped while tuning"

    def _measure(
        self, ctl: "TuneController", on_hello: Callable[[], None] | None = None
    ) -> tuple[MeasureEnd | TrialStop | TrialOutcome, str]:
        """Feed events to the controller until the trial should stop (`on_hello`: called on the process's built
        hello); returns (why it stopped, reason)."""
        while True:
            item = self._next()
            if self.session.halted is not None:
                return MeasureEnd.INTERRUPTED, self.session.halted
            if self._abort:
                return MeasureEnd.ABORT, self._abort
            if item is not None:
                kind, payload = item
                if kind is Inbox.EVENT:
                    if on_hello is not None and isinstance(payload, ev.HelloEvent) and not payload.early:
                        on_hello()
                    ctl.observe(payload)
                    self._publish()  # the measurement's progress (about once a second)
                elif kind is Inbox.EXIT:
                    stop = ctl.trial_should_stop()
                    if self.session.interrupted:
                        return MeasureEnd.INTERRUPTED, "the run was interrupted"
                    if stop and stop not in STEADY:
                        return stop, ""
                    if payload == 0 and self._complete:
                        return MeasureEnd.FINISHED, "the run reached --max-steps while tuning"
                    return TrialOutcome.CRASH, f"the trainer exited with code {payload} during the trial"
            stop = ctl.trial_should_stop()
            if stop:
                return stop, ""

    def _conclude(self, action) -> None:
        """Train on with the decided toggles (or hand the ended run back), write the report, detach."""
        from tuner.controller import Apply

        ctl = self.ctl
        s = self.session
        procs = self.procs
        if ctl is not None:
            self._publish()
            early = f"{self._abort}: " if self._abort else ""
            if isinstance(action, Apply):
                self._say(
                    f"{early}applying {action.label or f'trial {action.number}'}: {action.decision.reason}",
                    decision=action.decision.to_dict(),
                )
            elif action is not None and ctl.record.realized is not None:  # applied, then checked on the live run
                self._say(action.reason)
            elif action is not None:
                self._say(f"keeping the starting configuration: {action.reason}")
            else:
                self._say(f"tuning ended: {ctl.final.reason if ctl.final else self._end_reason()}")
        ended = (
            s.interrupted
            or s.halted is not None
            or self._complete
            or (action is None and s.finished)
            or self.ended_in_check
        )
        if action is not None and not ended:
            toggles = action.toggles
            if self.tune_only:
                procs.stop(last=True)
                self._complete = False
                self._exit_code = 0
            else:
                want = procs.cfg_for(toggles, strict=False)
                if not procs.alive or procs.differs(want, log_every=False):
                    self._restart(toggles, strict=False)
                elif procs.differs(want):  # only the log interval: a command, no restart
                    procs.log_every(want.log.log_every)
                    if procs.running_cfg is not None:
                        procs.running_cfg.log.log_every = want.log.log_every
        elif action is None and not ended and ctl is not None:
            # tuning ended early without a decision: train on with what runs, or (nothing runs) the start
            if not procs.alive and not self._complete:
                self._restart(ctl.base, strict=False)
        if ctl is not None:
            self._publish()
            from tuner.tuning_report import write_report

            study = ctl.study  # the one the controller tuned over last (memory may have changed it)
            self.report_paths = write_report(
                s.run_dir, study, ctl.report_info(), procs.tuned_command(self.session.state.command, ctl.base)
            )
            self._say(f"report {self.report_paths['md']}; best configuration {self.report_paths['toml']}")
            if study.storage_url:
                from tuner.storage import dashboard_command

                self._say(f"study {study.name}; browse it: {dashboard_command(study.storage_url)}")
        procs.release_guard()
        if procs.running_cfg is None or procs.hello is not None and procs.hello.client is not None:
            # gptop tune's first process logged every step for the baseline
            s.cfg.log.log_every = procs.user().log.log_every
        self._detach()

    def _restart(
        self, toggles: Toggles, fault: tuple[tuple[str, int], ...] | None = None, strict: bool = True
    ) -> tuple[int, str] | None:
        """Checkpoint (graceful stop), then start a trainer with `toggles` from that checkpoint.
        Returns the checkpoint it resumes from ((0, "") for none), or None if the run must not go on."""
        self.procs.stop()
        if self.session.interrupted or self.session.halted or self._complete or (self._abort and strict):
            return None
        return self.procs.start(toggles, fault, strict)
