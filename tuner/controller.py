"""The tuning state machine, driven by the training loop's events (Zeus style).

The session asks it what to do next (`tuner.actions` has the loop), does it, and reports back; trial steps
are real training steps. docs/tuning.md says what a tuning does; this module keeps its state and moves it
through the phases: find-micro-batch -> baseline -> trials -> remeasure -> decide -> check -> done.

* baseline: the start runs on and is measured (`RunTrial(baseline=True, restart=False)`).
* trials (`tuner.schedule`): the first guesses, then TPE (`tuner.proposals` screens what cannot run), each
  started only if the budget affords it (plus `reserve_trials` more and the final switch's reserve) and it
  can pay (`tuner.economics` over `tuner.run_figures`). A trial is cut when only the switch's reserve is left,
  or when still warming up after the trial timeout (its compile mode is then screened out for the run).
* remeasure: `standings.remeasure_plan` (`tuner.schedule`): the start first when no measurement of it can
  be compared with the leaders (`tuner.windows`: the same load, each to its precision target).
* decide: `standings.judge`; Apply or Done. check (`tuner.check`, with `check_applied`): the applied setting
  measured on the live run against the start under the same load; slower beyond noise: switch back.

Only this class (and `TuningRecord.apply`, which it calls) writes the record of what tuning measured and did
(`tuner.record`); `tuner.finishing`, `tuner.schedule`, `tuner.run_figures`, `tuner.starting`, `tuner.deciding`
and `tuner.check` read it through a `TunerView` and return the changes `apply` applies in order. When the start
runs out of memory the space is widened to the memory savers and tuning goes on in that space's study (the
session reports from `ctl.study`).

Events: a `trial` event when a numbered measurement starts (status running) and ends; a `tuner` event at
every phase change, trial start and end and, at most every `progress_every_s`, on a measurement's progress;
an `apply` event with the decision and its claim; the `tuner` event of phase done carries `outcome` and
`applied`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

from trainer.contract import capabilities
from trainer.contract.config import AUTO, TrainConfig, Toggles
from trainer.contract.device import DeviceInfo
from trainer.contract.events import (
    CheckpointEvent,
    ErrorEvent,
    Event,
    HelloEvent,
    LogEvent,
    StepEvent,
    TrialEvent,
    TunerEvent,
    WarningEvent,
)
from trainer.contract.states import TRIAL_FAILURES, TrialKind, TrialOutcome, TunerPhase

from . import check, deciding, finishing, report_info, run_figures, standings, starting
from .actions import Action, Apply, Check, Done, FindMicroBatch, Remeasure, RunTrial
from .budget import Budget
from .economics import Ledger
from .load import Load
from .measure import LossTrend, RunPace, TrialStop
from . import record as rec
from .record import Change, Reserves, TuningRecord
from .schedule import STUCK, MAX_ASKS, Over, Run, Schedule, Screen
from .settings import TunerSettings
from .space import SearchSpace
from .standings import Judgement, Standing
from .study import Proposal, TuneStudy
from .trial import ActiveTrial

# the names the session drives the tuner with, importable from here
__all__ = [
    "Action",
    "Apply",
    "Done",
    "FindMicroBatch",
    "Remeasure",
    "RunTrial",
    "TuneController",
    "TunerSettings",
    "Check",
]


class TuneController:
    """Decides what the session does next while tuning; see the module doc for the protocol."""

    def __init__(
        self,
        base_cfg: TrainConfig,
        dev: DeviceInfo,
        space: SearchSpace,
        study: TuneStudy,
        budget: Budget,
        clock: Callable[[], float] = time.monotonic,
        settings: TunerSettings | None = None,
    ):
        s = self.settings = settings if settings is not None else TunerSettings()
        if base_cfg.toggles.precision == AUTO:  # trials run concrete precisions: what auto is on `dev`
            base_cfg = dataclasses.replace(
                base_cfg,
                toggles=dataclasses.replace(base_cfg.toggles, precision=capabilities.resolve_precision(AUTO, dev)),
            )
        self.cfg, self.dev, self.space, self.study, self.budget, self.clock = base_cfg, dev, space, study, budget, clock
        self.ledger = Ledger(
            max_share=s.max_share,
            max_loss=s.max_loss,
            prior_gain=s.prior_gain,
            explore_gain=s.explore_gain,
            say=self.say,
        )
        self.reserves = Reserves.of(s)  # what the session learns of this setup as it goes (`learn_restart`)
        self.pace_s: float | None = None  # seconds per step at the start's speed (before the baseline)
        self.run_pace = RunPace()  # the run's time between its steps (checkpoints, evals, logging)
        self._ranked: tuple[int, list[Standing]] | None = None
        self._progress_at = 0.0
        self.tokens_per_step = base_cfg.optim.global_batch * base_cfg.data.seq_len
        self.phase = TunerPhase.INIT
        self.max_mb: int | None = s.max_micro_batch
        self._mb_known = s.max_micro_batch is not None
        self.last_step = 0
        self.trend = LossTrend()
        self._active: ActiveTrial | None = None
        self._schedule = Schedule()
        self._final: Done | None = None
        self._check: check.PendingCheck | None = None  # the applied setting to check on the live run
        self._prefix = ""  # "stopped by the user: " before the decision
        self._events: list[Event] = []
        self._version = 0  # bumped when a measurement is recorded (the best may change)
        # what the trainer process runs, and the optimizer whose state the newest kept checkpoint holds (what a
        # trial's switch converts from)
        self.record = TuningRecord(running=self.base, state_optimizer=self.cfg.toggles.optimizer)

    # --- derived ----------------------------------------------------------------------
    @property
    def base(self) -> Toggles:
        """The starting toggles with `micro_batch=auto` resolved to what fits (once known)."""
        t = self.cfg.toggles
        if t.micro_batch == AUTO and self.max_mb:
            return dataclasses.replace(t, micro_batch=self.max_mb)
        return t

    @property
    def trials_planned(self) -> int:
        return min(self.settings.max_trials, self.space.size())

    @property
    def in_trial(self) -> bool:
        """A trial (or the baseline, or a re-measurement) is running: its steps are its measurement."""
        return self._active is not None

    @property
    def trial_step_ms(self) -> float:
        """The running trial's median step time so far (NaN before it has one, or outside a trial)."""
        return self._active.measure.step_ms if self._active is not None else math.nan

    @property
    def trial_stop(self) -> TrialStop | None:
        """Why the running trial stopped measuring, or None."""
        return self._active.stop if self._active is not None else None

    @property
    def final(self) -> Done | None:
        """The final decision once tuning is over (what to train on with, and why), else None."""
        return self._final

    @property
    def checkpoint_s(self) -> float:
        """How long this setup's last checkpoint took to write."""
        return self.reserves.checkpoint_s

    def _mb_attr(self) -> str:
        t = self.cfg.toggles
        return f"max_micro_batch:{t.precision}:{int(t.activation_checkpointing)}:{t.optimizer}:{t.quantize_base}"

    # --- events -------------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        """Queue an event for `drain_events`."""
        self._events.append(event)

    def say(self, message: str) -> None:
        """A `log` line from the tuner, queued with the events."""
        self.emit(LogEvent(message=message, source="tuner"))

    def drain_events(self) -> list[Event]:
        """trial / apply / tuner events produced since the last call, for the session to publish."""
        out, self._events = self._events, []
        return out

    def tuner_event(self) -> TunerEvent:
        """The `tuner` event of now (`deciding.tuner_event`)."""
        final = self._final if self.phase is TunerPhase.DONE else None
        return deciding.tuner_event(self, self.phase, self._active, final, self.trials_planned)

    def set_phase(self, phase: TunerPhase) -> None:
        """Move to `phase`, with the tuner event that says so."""
        if phase != self.phase:
            self.phase = phase
            self.emit(self.tuner_event())

    # --- session inputs -----------------------------------------------------------------
    def set_pace(self, step: int, step_s: float | None) -> None:
        """Where the run is before tuning starts (the `t` key on a running trainer): its step and its seconds per
        step, so the plan can be made before the baseline is measured."""
        self.last_step = max(self.last_step, int(step))
        if step_s is not None and math.isfinite(step_s) and step_s > 0:
            self.pace_s = float(step_s)

    def set_max_micro_batch(self, n: int | None) -> None:
        """The largest micro-batch that fits with the starting toggles (None: could not be found)."""
        self.max_mb = int(n) if n else None
        self._mb_known = True
        if self.max_mb:
            self.study.set_attr(self._mb_attr(), self.max_mb)
            if self.record.running is self.cfg.toggles or self.record.running == self.cfg.toggles:
                self.record.running = self.base

    def observe(self, event: Event) -> None:
        """Feed every trainer event (other ranks and unknown types are ignored)."""
        if event.rank != 0:
            return
        a = self._active
        if isinstance(event, CheckpointEvent):
            self.reserves.checkpoint_s = event.seconds or 0.0
        elif isinstance(event, HelloEvent):
            self.run_pace.restart()
        elif isinstance(event, WarningEvent):
            if a is not None:  # the compile watchdog, during this trial
                a.note_warning(event)
        elif isinstance(event, ErrorEvent):
            if a is not None:
                a.note_error(event)
        elif isinstance(event, StepEvent):
            self.last_step = event.step
            self.run_pace.add(event.step, event.step_ms, event.time)
            if a is None:
                self.trend.add(event.step, event.loss)  # healthy training between trials
            else:
                self._observe_trial_step(a, event)

    def _observe_trial_step(self, a: ActiveTrial, event: StepEvent) -> None:
        warmed = a.note_step(event, self.tokens_per_step, self.clock())
        if warmed or self.clock() - self._progress_at >= self.settings.progress_every_s:
            self._progress_at = self.clock()
            a.tag_loads(self.settings.load)  # the samples under another load than most leave the estimate
            self.emit(self.tuner_event())  # the views show the measurement's progress
        if a.proposal is not None and self.clock() - a.last_touch > 60.0:
            self.study.touch(a.proposal)
            a.last_touch = self.clock()

    def trial_should_stop(self) -> TrialStop | TrialOutcome | None:
        """None to go on; a TrialStop other than TIMEOUT (which it answers as DONE): stop and keep the steps; a
        failure (TrialOutcome: nan, diverged, oom, ...): stop and roll back."""
        a = self._active
        if a is None:
            return None
        if a.failure:
            return a.failure[0]
        if a.measure.done:
            a.tag_loads(self.settings.load)
            why = check.again(self, a, self._time_left())
            if why is not None:
                self.say(f"tuner: {a.measure_again(self.settings.measure_kw(), why)}")
                return None
            a.stop = TrialStop.DONE
        elif a.kind is not TrialKind.CHECK and (
            self.budget.expired() or (self.budget.started and self.budget.left() <= self.reserves.switch_reserve_s)
        ):
            a.stop = TrialStop.BUDGET
        elif a.kind is TrialKind.TRIAL and a.prune(self.best_this_run(a.measure.load), self.settings.prune_margin):
            return a.stop
        elif self.clock() - a.start > a.timeout_s(self.reserves.trial_timeout_s, self.settings.max_seconds):
            a.stop = TrialStop.TIMEOUT
            return TrialStop.DONE
        return a.stop

    def _time_left(self) -> float:
        """What the budget leaves for measuring, the final switch's reserve kept."""
        return self.budget.left() - self.reserves.switch_reserve_s if self.budget.started else math.inf

    # --- the state machine --------------------------------------------------------------
    def next_action(self) -> Action:
        """What the session should do now (the same action again while a trial is unfinished)."""
        if self._active is not None:
            return self._active.action
        if self._final is not None:
            return self._final
        if self._check is not None:
            return self._checking(self._check)
        self.budget.start()
        if self.phase is TunerPhase.INIT:
            if not self._mb_known:
                known = self.study.get_attr(self._mb_attr())
                if known:
                    self.set_max_micro_batch(int(known))
            if not self._mb_known and (self.cfg.toggles.micro_batch == AUTO or "micro_batch" in self.space.params):
                self.set_phase(TunerPhase.FIND_MICRO_BATCH)
            else:
                self.set_phase(TunerPhase.BASELINE)
        if self.phase is TunerPhase.FIND_MICRO_BATCH:
            if not self._mb_known:
                return FindMicroBatch()
            self.set_phase(TunerPhase.BASELINE)
        if self.phase in (TunerPhase.BASELINE, TunerPhase.TRIALS):
            changes, end = run_figures.plan(self)
            self.apply(changes)
            if end is not None:
                return self.done(end, self.base)
        if self.phase is TunerPhase.BASELINE:
            return self.start_measurement(TrialKind.BASELINE, self.base, None)
        if self.phase is TunerPhase.TRIALS:
            trial = self._next_trial()
            if trial is not None:
                return trial
            self.set_phase(TunerPhase.REMEASURE)
        if self.phase is TunerPhase.REMEASURE:
            st = self._schedule.next_remeasure(self)
            if st is not None:
                again = self.start_measurement(
                    TrialKind.REMEASURE, st.cand.toggles, None, number=st.cand.number, earlier=st.earlier
                )
                assert isinstance(again, Remeasure)
                return again
            self.set_phase(TunerPhase.DECIDE)
        return self.decide()

    def _next_trial(self) -> RunTrial | None:
        """Start the next trial the schedule lets through (recording the proposals it screens out), or None
        with the record's `stop_note` saying why the trials are over."""
        for _ in range(MAX_ASKS):
            step = self._schedule.next_trial(self)
            if isinstance(step, Over):
                self.apply([rec.Note(step.note)])
                return None
            p = step.proposal
            if isinstance(step, Screen):
                self.apply(finishing.screened_out(self, p, step.screened))
                continue
            assert isinstance(step, Run)
            self.apply([rec.TrialStarted()])
            action = self.start_measurement(TrialKind.TRIAL, p.toggles, p, source=p.source, advice=p.advice)
            assert isinstance(action, RunTrial)
            return action
        self.apply([rec.Note(STUCK)])
        return None

    def apply(self, changes: list[Change]) -> None:
        """Apply what a finished measurement, the plan or the schedule changed, in order: the record's own
        changes by the record (`TuningRecord.apply`), the rest to the ledger, the budget, the loss trend, the
        space and the event stream."""
        for c in changes:
            self.record.apply(c)
            match c:
                case rec.StartFailed() if c.memory is not None:
                    self.widen_for_memory(c.memory)
                case rec.TrendPoints():
                    for step, loss in c.points:
                        self.trend.add(step, loss)
                case rec.Decided():
                    self.ledger.record(c.decision, self.last_step, say=c.say)
                case rec.Said():
                    self.say(c.message)
                case rec.Planned():
                    self.ledger.set_plan(c.loss_allowance_s, c.measured)
                    self.budget.limit(c.budget_s)
                case rec.Result():
                    self.emit(c.event)
                    self.emit(self.tuner_event())

    def learn_restart(self, restart_s: float, trial_timeout_s: float) -> None:
        """What a restart of this setup's trainer takes (measured by the session): the trainer's start, the
        budget kept for the final switch (a restart and a checkpoint), and a trial's time limit (at least
        `trial_timeout_s`)."""
        rv = self.reserves
        rv.startup_s = restart_s
        rv.switch_reserve_s = restart_s + rv.checkpoint_s
        rv.trial_timeout_s = max(rv.trial_timeout_s, trial_timeout_s)

    def start_measurement(
        self,
        kind: TrialKind,
        toggles: Toggles,
        proposal: Proposal | None,
        number: int | None = None,
        source: str = "sampler",
        earlier: bool = False,
        advice: str | None = None,
    ) -> RunTrial | Remeasure:
        """Start measuring `toggles` as a `kind` (the trial of `proposal`, or trial `number` again)."""
        b = starting.begin(self, kind, toggles, proposal, self.clock(), number, source, earlier, advice)
        if b.restart:  # a trial's process: training on in it needs a restart unless its settings are the user's
            self.run_pace.restart()
            self.record.continue_free = self.settings.trial_process_continues
        action = self._begin(b)
        assert not isinstance(action, Check)
        return action

    def _begin(self, b: starting.Begun) -> RunTrial | Remeasure | Check:
        """A measurement starts: keep it running, and say so."""
        self._active = b.active
        if b.event is not None:
            self.emit(b.event)
        self.emit(self.tuner_event())
        return b.action

    def best_this_run(self, load: Load | None = None) -> float | None:
        """The fastest measurement of this run that holds, under `load`: the pruning reference."""
        return standings.pruning_reference(run_figures.windows(self), load, self.settings.trust_spread)

    # --- finishing a trial ------------------------------------------------------------
    def finish_trial(
        self, outcome: TrialOutcome = TrialOutcome.OK, reason: str = "", rollback: dict[str, Any] | None = None
    ) -> TrialEvent:
        """Record the active trial: "ok" (healthy, steps kept) or a failure kind (rolled back; `rollback`
        says to where, for the event). "ok" with `rollback`: healthy and measured, but rolled back as its
        action asked (`keep_steps` False). Returns the `trial` event (also queued for drain_events)."""
        a = self._active
        if a is None:
            raise RuntimeError("finish_trial without a running trial")
        try:
            outcome = TrialOutcome(outcome)
        except ValueError:
            raise ValueError(f"outcome {outcome!r} is not ok or one of {', '.join(TRIAL_FAILURES)}") from None
        self._active = None
        self._version += 1
        if a.kind is TrialKind.BASELINE:
            self.phase = TunerPhase.TRIALS
        a.tag_loads(self.settings.load)
        end = a.end(self.clock(), self.settings.energy)
        if outcome is TrialOutcome.OK and a.failure:
            outcome, reason = a.failure[0], reason or a.failure[1]
        if a.kind is TrialKind.CHECK:
            assert self._check is not None
            why = f"{outcome}: {reason or (a.failure[1] if a.failure else '')}" if outcome.failed else ""
            changes = check.finish_check(self, a, end, self._check.claimed, self._check.step, failed=why)
        elif outcome.failed:
            changes = finishing.finish_failed(self, a, end, outcome, reason, rollback)
        else:
            changes = finishing.finish_measured(self, a, end, reason, rollback)
        self.apply(changes)
        result = changes[-1]
        assert isinstance(result, rec.Result)
        return result.event

    def widen_for_memory(self, reason: str) -> None:
        """Memory is the constraint after all: the trials to come search the space widened to the memory-saving
        values (tuner.space), a study of its own (the space is part of the study's key). The session takes
        the new `study` for its report."""
        if self.space.memory:
            return
        wider = self.space.for_memory(reason, self.dev)
        if wider.key() == self.space.key():
            return
        self.space = wider
        self.study = self.study.for_space(wider)

    def abort(self, reason: str = "tuning stopped") -> None:
        """The session stops mid-trial (user quit): the trial is recorded FAIL, which teaches the sampler nothing."""
        a = self._active
        self._active = None
        if self._check is not None:  # the switch was made: tuning ends there, checked or not
            self._end_check(a, reason)
            return
        if a is not None and a.proposal is not None:
            self.study.tell_failed(a.proposal, reason)
        self._final = Done(reason, self.record.running or self.base, restart=False)
        self.record.aborted = True
        self.budget.stop()
        self.set_phase(TunerPhase.DONE)

    def stop_early(self, reason: str = "stopped by the user", rolled_back: bool = False) -> Apply | Done:
        """Tuning is stopped before its end (the `t` key) while the run goes on: the running trial, if any,
        is abandoned (FAIL) with its steps kept (`rolled_back`: the session rolled it back instead, as it does
        a trial whose action has `keep_steps` False), and the decision is made on what was measured so far
        (the same rules: apply only a significantly faster setting whose saving pays for the switch)."""
        if self._final is not None:
            return self._final
        a = self._active
        self._active = None
        self._version += 1
        if self._check is not None:
            return self._end_check(a, reason)
        if a is not None:
            if a.proposal is not None:
                self.study.tell_failed(a.proposal, reason)
            if rolled_back:
                self.record.running = None
                self.record.rolled_back_s += self.clock() - a.start
            else:
                self.record.kept_tokens += a.steps * self.tokens_per_step
                self.record.state_optimizer = a.toggles.optimizer
            if a.kind is TrialKind.BASELINE:
                self.phase = TunerPhase.TRIALS
        if self.record.baseline is None:
            self.record.stop_note = f"{reason} before the starting configuration was measured"
            return self.done(f"{reason}; nothing measured to decide on", self.base)
        self.record.stop_note = reason
        return self.decide(prefix=f"{reason}: ", verify=False)

    def gain_bound(self) -> float:
        """The most a trial may be assumed to gain over the start (`Ledger.gain_bound`)."""
        return self.ledger.gain_bound(self.best())

    # --- standings ------------------------------------------------------------------
    def holds(self, est: float, lo: float, hi: float) -> bool:
        """Whether a measurement (estimate, interval) is tight enough to act on (`standings.holds`)."""
        return standings.holds(est, lo, hi, self.settings.trust_spread)

    def standings(self) -> list[Standing]:
        """Every measured configuration but the start, fastest first (`standings.rank`), until the next
        measurement is recorded."""
        if self._ranked is not None and self._ranked[0] == self._version:
            return self._ranked[1]
        ranked = standings.rank(self.study, self.base, run_figures.windows(self), self.settings.trust_spread)
        self._ranked = (self._version, ranked)
        return ranked

    def best(self) -> Standing | None:
        """The best so far (`standings.best_of`): what the views, the decision and the report name."""
        return standings.best_of(self.standings(), run_figures.windows(self), self.base, self.record.base_failed)

    def judge(self) -> Judgement:
        """The best and whether switching to it now pays (`standings.judge`)."""
        best = self.best()
        return standings.judge(
            best,
            self.standings(),
            run_figures.base_estimate(self),
            base=self.base,
            remaining=run_figures.remaining(self),
            tokens_per_step=self.tokens_per_step,
            switch_s=run_figures.costs(self).switch_s,
            start_steady=run_figures.start_steady(self),
            stop_note=self.record.stop_note,
        )

    # --- deciding -------------------------------------------------------------------
    def decide(self, prefix: str = "", verify: bool = True) -> Apply | Done:
        """Apply the best if switching to it pays (`standings.judge`), else end keeping what runs. An applied
        setting is then checked on the live run (`Check`) when the settings ask for it and `verify`."""
        self._prefix = prefix
        self.set_phase(TunerPhase.DECIDE)
        base = self.base
        best, decision, why = self.judge()
        if decision is None:
            return self.done(why, base)
        decision = dataclasses.replace(decision, step=self.last_step)
        self.record.decision = decision
        self.ledger.record(decision, self.last_step)
        if not decision.apply:
            return self.done(decision.reason, base)
        assert best is not None
        c = best.cand
        self.record.applied = c.toggles
        restart = c.toggles != self.record.running
        self.emit(deciding.apply_event(self, best, decision))
        apply = Apply(c.toggles, decision, restart, number=c.number, label=best.label)
        reason = f"{prefix}applied {best.label}: {decision.reason}"
        self.budget.stop()
        if verify and self.settings.check_applied:
            claimed = (best.speedup, best.floor, best.hi) if math.isfinite(best.speedup) else None
            self._check = check.PendingCheck(apply, reason, claimed, self.clock(), self.last_step)
            self.set_phase(TunerPhase.CHECK)
            return apply
        self._final = Done(reason, c.toggles, restart=False)
        self.phase = TunerPhase.DONE
        self.emit(self.tuner_event())
        return apply

    def _checking(self, p: check.PendingCheck) -> Check | Done:
        """The check of the applied setting: start it, or, once it is over, end tuning (`_end_check`)."""
        if self.record.realized is not None:
            return self._end_check(None, "")
        action = self._begin(p.begin(self))
        assert isinstance(action, Check)
        return action

    def _end_check(self, a: ActiveTrial | None, reason: str) -> Done:
        """End tuning after the check (`reason`: why it ended before it measured anything): keep the applied
        setting, or switch back to the start when it realized less than the start beyond noise."""
        p = self._check
        assert p is not None
        if self.record.realized is None:
            self.apply([rec.Checked(check.unchecked(a, reason, p.claimed, p.step))])
        assert self.record.realized is not None
        self._final = p.done(self.record.realized, self.base)
        self.set_phase(TunerPhase.DONE)
        return self._final

    def done(self, reason: str, toggles: Toggles) -> Done:
        """End tuning: train on with `toggles` (`reason` after any prefix of an early stop)."""
        reason = self._prefix + reason
        self._final = Done(reason, toggles, restart=toggles != self.record.running)
        self.budget.stop()
        self.set_phase(TunerPhase.DONE)
        return self._final

    def report_info(self) -> dict[str, Any]:
        """What `tuner.tuning_report.write_report` needs besides the study (`tuner.report_info`)."""
        return report_info.report_info(self, self._final)
