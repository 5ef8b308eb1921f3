"""Tuning on the live run: the session side of the tuner.

The `TuneController` (tuner/) decides; this driver does. It runs in its own
thread, watches the trainer's events through a session hook, and turns the
controller's actions into process restarts:

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
import os
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from trainer.contract import events as ev
from trainer.contract import rundir
from trainer.contract.config import AUTO, Toggles, TrainConfig
from trainer.contract.device import DeviceInfo
from trainer.contract.states import TrialOutcome

from .advice import tries as advice_tries

if TYPE_CHECKING:
    from tuner.controller import Remeasure, RunTrial, TuneController
    from tuner.study import TuneStudy

    from .state import RunState
    from .supervisor import Supervisor

STEADY = ("done", "prune", "budget", "timeout")
PACE_STEPS = 50  # the recent step events whose median pace a `t` key plans on
TEST_FAULT_ENV = "GPTOP_TEST_TRIAL_FAULT"  # "N:KIND[@K][+KIND@K...]": trainer faults (trainer/faults.py) K
DEFAULT_FAULT_OFFSET = 2  # steps into this session's N-th trial (tests only; default K=2)
CPU_COMPILE_MIN_BUDGET_S = 600.0  # below this, a CPU run's tuning leaves compile alone by default


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


def tuning_space(
    cfg: TrainConfig,
    dev: DeviceInfo,
    fits: int | None,
    world: int,
    spec: str | None,
    budget_s: float,
    command: list[str] | None = None,
) -> tuple[Any, str]:
    """The search space of this run's tuning and what the first line says about it beyond its toggles.

    `cfg` holds the starting toggles (micro-batch as the user gave it), `fits` what `--micro-batch auto`
    found to fit (None: not probed). Memory is the constraint when the wanted micro-batch does not fit
    (tuner.space.memory_pressure): the space then includes the memory-saving toggles. On a CPU with a short
    budget, compile is left alone unless the spec names it. `command`: the run is a user's script whose
    client can take these toggles (`gptop tune -- CMD`): the space is narrowed to what its TrainingArguments
    hold (tuner.command_space) before the spec applies."""
    from tuner.space import MEMORY_SAVING, SearchSpace, memory_pressure, quantizable

    memory = memory_pressure(cfg, fits, world)
    space = SearchSpace.for_device(
        cfg.toggles,
        dev,
        cfg.optim.global_batch,
        world_size=world,
        spec=spec if command is None else None,
        memory=memory,
        quantizable=quantizable(cfg),
    )
    if command is not None:
        from tuner.command_space import command_space

        space = command_space(space, dev, command, spec)
    note = ""
    if memory:
        savers = [f"{n} {'/'.join(str(v) for v in space.choices[n])}" for n in MEMORY_SAVING if n in space.params]
        note = f"; memory is the constraint ({memory}): trying {', '.join(savers) or 'no memory saver'}"
    if (
        not dev.is_cuda
        and budget_s < CPU_COMPILE_MIN_BUDGET_S
        and "compile" in space.params
        and "compile" not in (spec or "")
    ):
        # inductor's C++ build takes from 20 s to minutes on a CPU: in a short budget a compile trial
        # costs several others and rarely finishes warming up; naming compile in --tune-space opts in
        space = space.apply_spec("-compile", dev)
        note += (
            f"; compile stays {cfg.toggles.compile} (on a CPU its warm-up does not fit a budget under "
            f"{CPU_COMPILE_MIN_BUDGET_S / 60:.0f} minutes; name it in --tune-space to try it)"
        )
    return space, note


class TuningHost(Protocol):
    """What the driver needs of the session that runs it (gptop.session.Session is one): the run's config,
    directory, state and process, and the session's controller slot, event log and exit handling."""

    cfg: TrainConfig
    run_dir: Path
    state: RunState
    supervisor: Supervisor | None
    interrupted: bool

    @property
    def finished(self) -> bool: ...
    def set_controller(self, controller: TuningDriver | None) -> None: ...
    def publish(self, event: ev.Event) -> None: ...
    def log(self, message: str) -> None: ...
    def spawn(self, cfg: TrainConfig | None = None, resume: str | None = None) -> None: ...
    def handle_exit(self, code: int) -> None: ...
    def energy_between(self, t0: float, t1: float) -> float | None: ...


class TuningDriver:
    """The session's controller while it tunes (gptop.session.Controller); `Session.start_tuning` makes one."""

    def __init__(
        self,
        session: TuningHost,
        budget_s: float,
        space_spec: str | None = None,
        storage: str | None = None,
        tune_only: bool = False,
        trial_log_every: int = 1,
        hello: ev.HelloEvent | None = None,
    ):
        self.session = session
        self.budget_s = budget_s
        self.space_spec = space_spec
        self.storage = storage
        self.tune_only = tune_only
        self.trial_log_every = trial_log_every
        self.q: "queue.Queue[tuple[str, Any]]" = queue.Queue()
        self.ctl: TuneController | None = None
        self.study: TuneStudy | None = None
        self.thread: threading.Thread | None = None
        self.finished = threading.Event()
        self.error: str | None = None
        self.report_paths: dict[str, Path] | None = None
        self.last_ckpt: tuple[int, str] | None = None
        self._hello = hello
        self._lock = threading.Lock()
        self._attached = False
        self._alive = False  # a trainer process runs (as far as the queue has told this thread)
        self._expect_exit = False
        self._exit_code: int | None = None
        self._steps_since_spawn = 0
        self._complete = False  # the run reached --max-steps
        self._abort: str | None = None
        self._running_cfg: TrainConfig | None = None  # the config of the process we started (None: the session's)
        self._spawned_at: float | None = None
        self._restart_s: list[float] = []
        self._pace_known = False
        self._per_trial = 0.0
        self.user_cfg: TrainConfig | None = None
        self._reported: list[tuple[int, str]] = []  # checkpoints the processes reported (step, path)
        self._command = False  # the run is a user's script (gptop tune -- CMD), known at its hello
        self.test_fault = parse_test_fault(os.environ.get(TEST_FAULT_ENV, ""))

    # ------------------------------------------------------------- wiring
    def attach(self) -> "TuningDriver":
        s = self.session
        self.user_cfg = TrainConfig.from_dict(s.cfg.to_dict())
        sup = s.supervisor
        self._alive = sup is not None and sup.alive()
        if not self._alive and self._hello is None:
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
            self.last_ckpt = (event.step, event.path)
            self._reported.append((event.step, event.path))
        # warnings: the compile watchdog's, which mark a trial that recompiled (tuner.controller)
        if isinstance(
            event, (ev.HelloEvent, ev.StepEvent, ev.CheckpointEvent, ev.ErrorEvent, ev.DoneEvent, ev.WarningEvent)
        ):
            self.q.put(("event", event))

    def on_trainer_exit(self, code: int) -> bool:
        """While attached, every trainer exit is the driver's to handle (this thread decides what it means)."""
        with self._lock:
            if not self._attached:
                return False
            self.q.put(("exit", code))
            return True

    def stop_tuning(self) -> None:
        """The `t` key while tuning: stop now and train on (with the running configuration if it is healthy)."""
        self.q.put(("abort", "stopped by the user"))

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
                if kind == "exit":
                    self._alive, self._exit_code = False, payload
        sup = s.supervisor
        if not self._alive and not s.finished and not (sup is not None and sup.alive()):
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
                if (
                    self.user_cfg is not None
                    and not self._alive
                    and not self.session.interrupted
                    and not self._complete
                ):
                    self._spawn(self._cfg_for(self.user_cfg.toggles, strict=False), self.last_ckpt)
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

    def _next(self, timeout: float = 0.2) -> tuple[str, Any] | None:
        """One queue item, with the bookkeeping every waiter needs (process alive, run complete, abort)."""
        try:
            item = self.q.get(timeout=timeout)
        except queue.Empty:
            return None
        kind, payload = item
        if kind == "exit":
            self._alive, self._exit_code = False, payload
        elif kind == "abort":
            self._abort = self._abort or str(payload)
        elif kind == "event":
            if payload.rank == 0:
                if isinstance(payload, ev.HelloEvent):
                    self._alive = True
                    self._steps_since_spawn = 0
                elif isinstance(payload, ev.StepEvent):
                    if self._steps_since_spawn == 0 and self._spawned_at is not None:
                        self._restart_s.append(time.monotonic() - self._spawned_at)
                        self._spawned_at = None
                        self._update_reserve()
                    self._steps_since_spawn += 1
                elif isinstance(payload, ev.DoneEvent) and payload.reason == "max_steps":
                    self._complete = True
        return item

    def _wait_hello(self) -> ev.HelloEvent | None:
        while True:
            item = self._next(1.0)
            if item is None:
                if self.session.finished:
                    return None
                continue
            kind, payload = item
            if kind == "event" and isinstance(payload, ev.HelloEvent) and not payload.early:
                return payload  # the built run (an early hello comes before anything is built)
            if kind == "exit" or (kind == "abort"):
                return None

    def _update_reserve(self) -> None:
        """Keep enough budget for the final switch: a restart as long as the ones seen, plus a checkpoint; and
        tell the controller how long this setup's trainer takes to start."""
        if self.ctl is not None and self._restart_s:
            from statistics import median

            restart = median(self._restart_s)
            self.ctl.startup_s = restart
            self.ctl.switch_reserve_s = restart + self.ctl.checkpoint_s
            self.ctl.trial_timeout_s = max(self.ctl.trial_timeout_s, 2 * self._per_trial + 2 * restart)

    def _startup_s(self, hello: ev.HelloEvent) -> float | None:
        """How long the running trainer took from its start to its built hello: what a restart costs at least."""
        sup = self.session.supervisor
        started = sup.started_at if sup is not None else None
        return max(0.0, hello.time - started) if started is not None and hello.time >= started else None

    def _run(self) -> None:
        from tuner.controller import Apply, Done, FindMicroBatch, Remeasure, RunTrial

        self._pace_known = self._hello is not None  # a trainer that ran before tuning (the `t` key)
        hello = self._hello or self._wait_hello()
        if hello is None:
            return self._conclude(None)
        self._hello = hello
        command = hello.client is not None  # a user's script (gptop tune -- CMD) through its client
        if command:
            if hello.tunable is None:  # its client refuses a tune itself; an old one may not
                self._say(f"the command's {hello.client} client takes no toggles: nothing to tune")
                return self._conclude(None)
            self._command = True
            self.user_cfg = self._command_cfg(hello)
            self._running_cfg = self._cfg_for(self.user_cfg.toggles, strict=True)  # the baseline's process
        user_mb = self._user().toggles.micro_batch
        ctl = self._open_controller(hello, command)
        trial_index = 0
        while True:
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
            if isinstance(action, (Apply, Done)):
                return self._conclude(action)

    def _user(self) -> TrainConfig:
        """The user's own settings: known from `attach` on (a command's from its client's first hello)."""
        if self.user_cfg is None:
            raise RuntimeError("the tuning driver was not attached")
        return self.user_cfg

    def _open_controller(self, hello: ev.HelloEvent, command: bool) -> "TuneController":
        """The study of this setup and the controller that tunes over it, from the trainer's hello."""
        from tuner.budget import Budget
        from tuner.controller import TuneController, TunerSettings
        from tuner.study import TuneStudy

        dev = hello.device
        cfg = TrainConfig.from_dict(hello.config)
        base_mb = self._user().toggles.micro_batch
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
            max_seconds=per_trial,
            default_restart_s=restart_guess,
            # re-measuring the top two is worth a trial only in longer budgets;
            # in short ones more configurations measured once win
            reserve_trials=1 if self.budget_s >= 600 else 0,
            trial_timeout_s=2 * per_trial + 2 * restart,
            switch_reserve_s=restart,
            energy=self.session.energy_between,
            run_pays=not self.tune_only,
            startup_s=startup,
            # a trial's process trains on as it is only if its settings are the user's
            trial_process_continues=command or self._user().run.nan_policy == "stop",
            # the advice's toggles are the first proposals (asked when trials start)
            advice=lambda: advice_tries(self.session.state.advice()),
        )
        self.ctl = ctl = TuneController(cfg, dev, space, study, Budget(self.budget_s), settings=settings)
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
        pre = self.last_ckpt
        restore_log = None
        if not action.restart and self._alive:
            # measured on the running process (the baseline after `t`): it logs every step meanwhile
            restore_log = (self._running_cfg or self.session.cfg).log.log_every
            if restore_log > self.trial_log_every:
                self._log_every(self.trial_log_every)
            else:
                restore_log = None
        if action.restart or not self._alive:
            pre = self._restart(action.toggles, fault=fault, strict=True)
            if pre is None:  # interrupted, stopped or finished while switching
                if self._abort and not (self.session.interrupted or self._complete):
                    self._conclude(ctl.stop_early(self._abort))
                    return False
                ctl.abort(self._end_reason())
                self._publish()
                self._conclude(None)
                return False
        outcome, reason = self._measure(ctl)
        if restore_log is not None:
            self._log_every(restore_log)
        if outcome == "abort":  # the `t` key: decide on what was measured, train on
            if not action.keep_steps:  # its fresh optimizer state must not become the run's
                self._rollback(pre)
            self._conclude(ctl.stop_early(reason, rolled_back=not action.keep_steps))
            return False
        if outcome in ("interrupted", "finished"):
            if outcome == "finished" and ctl.in_trial:
                ctl.finish_trial(TrialOutcome.OK)  # its steps are the run's last: kept
            ctl.abort(reason)
            self._publish()
            self._conclude(None)
            return False
        if outcome in STEADY and action.keep_steps:
            ctl.finish_trial(TrialOutcome.OK)
        elif outcome in STEADY:  # measured; rolled back so the run keeps its optimizer state
            ctl.finish_trial(TrialOutcome.OK, rollback=self._rollback(pre))
        else:
            ctl.finish_trial(TrialOutcome(outcome), reason, rollback=self._rollback(pre))
        self._publish()
        if ctl.study is not self.study:  # the start ran out of memory: memory is the constraint
            self.study = ctl.study
            self._say(
                f"memory is the constraint ({ctl.space.memory}): tuning over "
                f"{', '.join(ctl.space.params) or 'nothing'} (study {ctl.study.name})",
                study=ctl.study.name,
            )
        return True

    def _command_cfg(self, hello: ev.HelloEvent) -> TrainConfig:
        """A command's own settings as the tuner's config, from its client's first hello: its toggles,
        the batch of an optimizer step, sequence length, max_steps and model (the study's key); the log
        interval gptop asks of the process that trains on after tuning (--log-every, else the default)."""
        cfg = TrainConfig.from_dict(hello.config)
        cfg.run.run_dir = self.session.cfg.run.run_dir
        given = getattr(self.session, "log_every", None)
        cfg.log.log_every = given if given is not None else TrainConfig().log.log_every
        return cfg

    def _end_reason(self) -> str:
        if self._abort:
            return self._abort
        if self.session.interrupted:
            return "the run was interrupted"
        if self._complete:
            return "the run reached --max-steps while tuning"
        return "the trainer stopped while tuning"

    def _measure(self, ctl: "TuneController") -> tuple[str, str]:
        """Feed events to the controller until the trial should stop; returns (stop kind, reason)."""
        while True:
            item = self._next()
            if self._abort:
                return "abort", self._abort
            if item is not None:
                kind, payload = item
                if kind == "event":
                    ctl.observe(payload)
                    self._publish()  # the measurement's progress (about once a second)
                elif kind == "exit":
                    stop = ctl.trial_should_stop()
                    if self.session.interrupted:
                        return "interrupted", "the run was interrupted"
                    if stop and stop not in STEADY:
                        return stop, ""
                    if payload == 0 and self._complete:
                        return "finished", "the run reached --max-steps while tuning"
                    return "crash", f"the trainer exited with code {payload} during the trial"
            stop = ctl.trial_should_stop()
            if stop:
                return stop, ""

    def _conclude(self, action) -> None:
        """Train on with the decided toggles (or hand the ended run back), write the report, detach."""
        from tuner.controller import Apply

        ctl = self.ctl
        s = self.session
        if ctl is not None:
            self._publish()
            early = f"{self._abort}: " if self._abort else ""
            if isinstance(action, Apply):
                self._say(
                    f"{early}applying {action.label or f'trial {action.number}'}: {action.decision.reason}",
                    decision=action.decision.to_dict(),
                )
            elif action is not None:
                self._say(f"keeping the starting configuration: {action.reason}")
            else:
                self._say(f"tuning ended: {ctl.final.reason if ctl.final else self._end_reason()}")
        ended = s.interrupted or self._complete or (action is None and s.finished)
        if action is not None and not ended:
            toggles = action.toggles
            if self.tune_only:
                self._stop_trainer()
                self._complete = False
                self._exit_code = 0
            else:
                want = self._cfg_for(toggles, strict=False)
                if not self._alive or self._differs(want, log_every=False):
                    self._restart(toggles, strict=False)
                elif self._differs(want):  # only the log interval: a command, no restart
                    self._log_every(want.log.log_every)
                    if self._running_cfg is not None:
                        self._running_cfg.log.log_every = want.log.log_every
        elif action is None and not ended and ctl is not None:
            # tuning ended early without a decision: train on with what runs, or (nothing runs) the start
            if not self._alive and not self._complete:
                self._restart(ctl.base, strict=False)
        if ctl is not None:
            self._publish()
            from tuner.tuning_report import write_report

            study = ctl.study  # the one the controller tuned over last (memory may have changed it)
            self.report_paths = write_report(s.run_dir, study, ctl.report_info())
            self._say(f"report {self.report_paths['md']}; best configuration {self.report_paths['toml']}")
            if study.storage_url:
                from tuner.storage import dashboard_command

                self._say(f"study {study.name}; browse it: {dashboard_command(study.storage_url)}")
        self._cleanup_guard()
        if self._running_cfg is None or self._hello is not None and self._hello.client is not None:
            # gptop tune's first process logged every step for the baseline
            s.cfg.log.log_every = self._user().log.log_every
        self._detach()

    # ------------------------------------------------------------ processes
    def _differs(self, want: TrainConfig, log_every: bool = True) -> bool:
        """Whether the running process was started with other toggles or run settings than `want` (the log
        interval counted only with `log_every`: a command changes it)."""
        have = self._running_cfg or self.session.cfg
        toggles = have.toggles
        if (
            toggles.micro_batch == AUTO
            and self._running_cfg is None
            and self._hello is not None
            and self._hello.micro_batch is not None
        ):
            toggles = dataclasses.replace(toggles, micro_batch=self._hello.micro_batch)  # what `auto` resolved to
        return (
            toggles != want.toggles
            or have.run.nan_policy != want.run.nan_policy
            or (log_every and have.log.log_every != want.log.log_every)
        )

    def _log_every(self, steps: int) -> None:
        """Ask the running trainer for a step event every `steps` steps (a command: no restart). One
        synchronization per step while it measures; the interval is given back when it is done."""
        sup = self.session.supervisor
        if sup is not None and self._alive:
            sup.send({"cmd": "log_every", "steps": steps})

    def _stop_trainer(self, kill: bool = False) -> None:
        """Stop the trainer and wait for its exit: graceful (it checkpoints) unless `kill`. A graceful stop that
        takes far longer than a step (a compile in progress, a hung process) is turned into a kill."""
        sup = self.session.supervisor
        if not self._alive or sup is None:
            self._alive = False
            return
        self._expect_exit = True
        if kill:
            sup.kill()
        else:
            sup.request_stop(reason=ev.TUNER_RESTART)  # its `done`: a trainer's end, not the run's
        step_s = 0.0
        if self.ctl is not None and self.ctl.in_trial:
            import math

            ms = self.ctl.trial_step_ms
            step_s = ms / 1000.0 if math.isfinite(ms) else 0.0
        ckpt_s = self.ctl.checkpoint_s if self.ctl is not None else 0.0
        grace = 5.0 if self._steps_since_spawn == 0 else max(30.0, 5 * step_s + 3 * ckpt_s)
        deadline = time.monotonic() + grace
        feed_steps = self.ctl is not None and not self.ctl.in_trial
        while self._alive:
            item = self._next(0.5)
            if item is not None and item[0] == "event" and self.ctl is not None:
                # the last steps of the process being stopped: healthy steps between trials feed the loss
                # trend; they must not count as the measurement of a trial that is about to start
                if feed_steps or isinstance(item[1], ev.CheckpointEvent):
                    self.ctl.observe(item[1])
            if not kill and self._alive and time.monotonic() > deadline:
                self._say(f"the trainer did not stop within {grace:.0f} s; killing it")
                sup.kill()
                kill = True
        self._expect_exit = False

    def _spawn(self, cfg: TrainConfig, pre: tuple[int, str] | None) -> None:
        self._running_cfg = cfg
        self._alive = True
        self._steps_since_spawn = 0
        self._spawned_at = time.monotonic()
        self.session.spawn(cfg, resume=pre[1] if pre and pre[1] else None)

    def _restart(
        self, toggles: Toggles, fault: tuple[tuple[str, int], ...] | None = None, strict: bool = True
    ) -> tuple[int, str] | None:
        """Checkpoint (graceful stop), then start a trainer with `toggles` from that checkpoint.
        Returns the checkpoint it resumes from ((0, "") for none), or None if the run must not go on."""
        self._stop_trainer()
        if self.session.interrupted or self._complete or (self._abort and strict):
            return None
        pre = self.last_ckpt
        if pre is not None and not Path(pre[1]).exists():  # pruned between trials: the newest there is
            newest = rundir.list_checkpoints(self.session.run_dir)
            pre = (newest[-1].step, str(newest[-1].path)) if newest else None
        cfg = self._cfg_for(toggles, strict)
        if fault:
            cfg.run.fault = ",".join(f"{kind}@{(pre[0] if pre else 0) + k}" for kind, k in fault)
        if strict:
            self._guard(pre)
        self._spawn(cfg, pre)
        return pre or (0, "")

    def _cfg_for(self, toggles: Toggles, strict: bool) -> TrainConfig:
        """The user's config with `toggles`; trial processes (strict) stop on NaN and log every step."""
        cfg = TrainConfig.from_dict(self._user().to_dict())
        cfg.toggles = dataclasses.replace(toggles)
        cfg.run.fault = None
        if strict:
            if not self._command:  # a command's NaN is the loss check's (its step events)
                cfg.run.nan_policy = "stop"  # a NaN ends the trial; the driver rolls back
            cfg.log.log_every = min(cfg.log.log_every, self.trial_log_every)
        return cfg

    # ------------------------------------------------------------ rollback
    def _guard(self, pre: tuple[int, str] | None) -> None:
        """Pin the pre-trial checkpoint: the trial's own pruning (--keep-checkpoints) must keep the rollback
        target. One pin at a time: the previous trial's target is released."""
        run_dir = self.session.run_dir
        rundir.unpin(run_dir)
        if pre and pre[1] and Path(pre[1]).exists():
            rundir.pin(run_dir, pre[0])

    def _cleanup_guard(self) -> None:
        rundir.unpin(self.session.run_dir)

    def _delete_reported(self, keep_step: int) -> list[str]:
        """Delete the checkpoints after `keep_step` that a failed trial's process reported outside the run
        directory (a command's own, e.g. a Trainer's output_dir/checkpoint-N): the next process resumes from
        the pre-trial one, and the script's own rotation (save_total_limit) must not count the failed ones."""
        import shutil

        run_dir = Path(self.session.run_dir).resolve()
        deleted, kept = [], []
        for step, path in self._reported:
            p = Path(path)
            inside = p.resolve().is_relative_to(run_dir)
            if step <= keep_step or inside:
                kept.append((step, path))
            elif p.exists():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                deleted.append(path)
        self._reported = kept
        return deleted

    def _rollback(self, pre: tuple[int, str] | None) -> dict[str, Any]:
        """Kill the failed trial if it still runs and delete the checkpoints it wrote: the run directory's
        newest checkpoint is the pinned pre-trial one again (or none: the start)."""
        self._stop_trainer(kill=True)
        run_dir = Path(self.session.run_dir)
        keep_step = pre[0] if pre and pre[1] else -1
        deleted = [str(p) for p in rundir.rollback_to(run_dir, keep_step)] + self._delete_reported(keep_step)
        self.last_ckpt = pre if pre and pre[1] and Path(pre[1]).exists() else None
        step = max(keep_step, 0)
        self._say(
            f"trial rolled back to step {step}"
            + (f" ({self.last_ckpt[1]})" if self.last_ckpt else " (the start)")
            + (f"; deleted {len(deleted)} checkpoint(s) it wrote" if deleted else "")
        )
        return {"step": step, "path": self.last_ckpt[1] if self.last_ckpt else None, "deleted": deleted}
