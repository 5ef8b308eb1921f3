"""The tuning state machine, driven by the training loop's events (Zeus style).

The session asks it what to do next (`tuner.actions` has the loop), does it, and reports back; trial steps
are real training steps. docs/tuning.md says what a tuning does; this module keeps its state and moves it
through the phases: find-micro-batch -> baseline -> trials -> remeasure -> decide -> done.

* baseline: the start runs on and is measured (`RunTrial(baseline=True, restart=False)`).
* trials: the first guesses, then TPE (`tuner.proposals`, which also screens what cannot run), each started
  only if the budget affords it plus `reserve_trials` more plus `switch_reserve_s` and only if it can pay
  (`tuner.economics`). A trial is cut when only `switch_reserve_s` is left (the budget covers tuning up to
  training on with the chosen setting), or when still warming up after `trial_timeout_s`: its compile mode
  is then screened out for the run (`slow_compile`).
* remeasure: `standings.remeasure_plan`; estimates pool both measurements.
* decide: `standings.judge`; Apply or Done.

A finished measurement (`finish_trial`) goes to its kind's handler, healthy or failed: a trial is told to
the study, a re-measurement pools into its trial, the baseline becomes the start's measurement; a failed one
was rolled back. When the start itself runs out of memory the space is widened to the memory savers
(`space.for_memory`) and tuning goes on in that space's study (`study` changes: the session reports from
`ctl.study`).

Events: a `trial` event when a numbered trial starts (status running; the unnumbered baseline only reports
at its end) and when it ends (a re-measurement updates its trial's row with the pooled estimate); a `tuner`
event at every phase change, trial start and end and, at most every `progress_every_s`, on a measurement's
progress; an `apply` event with the decision; the `tuner` event of phase done carries `outcome` and
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
    ApplyEvent,
    CheckpointEvent,
    ErrorEvent,
    Event,
    HelloEvent,
    LogEvent,
    MeasureProgress,
    StepEvent,
    TrialEvent,
    TunerBest,
    TunerEvent,
    WarningEvent,
)
from trainer.contract.states import TRIAL_FAILURES, TrialKind, TrialOutcome, TrialStatus, TunerPhase

from . import standings
from .actions import Action, Apply, Done, FindMicroBatch, Remeasure, RunTrial
from .budget import Budget, format_duration
from .decide import Decision, hopeless, should_prune
from .economics import Costs, Ledger, Outlook, not_a_candidate
from .measure import LossGuard, LossTrend, Measurement, RunPace
from .proposals import AdviceTry, first_guesses, screen
from .space import MEMORY_SAVING, SearchSpace
from .standings import Estimate, Judgement, Standing
from .study import Proposal, TuneStudy
from .trial import ActiveTrial, TrialEnd, compile_words, noted, reported_peak

# the names the session drives the tuner with, importable from here
__all__ = [
    "Action",
    "AdviceTry",
    "Apply",
    "Done",
    "FindMicroBatch",
    "Remeasure",
    "RunTrial",
    "Standing",
    "TuneController",
    "compile_words",
    "reported_peak",
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
        *,
        max_trials: int = 16,
        min_steps: int = 8,
        rel_ci: float = 0.03,
        max_steps: int = 200,
        max_seconds: float = 300.0,
        prune_margin: float = 0.05,
        remeasure_top: int = 2,
        default_restart_s: float = 60.0,
        trial_timeout_s: float | None = None,
        max_micro_batch: int | None = None,
        reserve_trials: int | None = None,
        switch_reserve_s: float = 0.0,
        energy: Callable[[float, float], float | None] | None = None,
        progress_every_s: float = 1.0,
        run_pays: bool = True,
        max_share: float = 0.5,
        max_loss: float = 0.1,
        prior_gain: float = 1.5,
        explore_gain: float = 1.5,
        trust_spread: float = 0.25,
        compile_prior_s: float = 45.0,
        startup_s: float | None = None,
        trial_process_continues: bool = False,
        advice: Callable[[], list[AdviceTry]] | None = None,
    ):
        if base_cfg.toggles.precision == AUTO:  # trials run concrete precisions: what auto is on `dev`
            base_cfg = dataclasses.replace(
                base_cfg,
                toggles=dataclasses.replace(base_cfg.toggles, precision=capabilities.resolve_precision(AUTO, dev)),
            )
        self.cfg, self.dev, self.space, self.study, self.budget, self.clock = base_cfg, dev, space, study, budget, clock
        # trials must pay within this run (tuner.economics; False with --tune-only: best.toml is for later runs)
        self.run_pays = run_pays
        self.ledger = Ledger(
            max_share=max_share, max_loss=max_loss, prior_gain=prior_gain, explore_gain=explore_gain, say=self._say
        )
        self.trust_spread = trust_spread  # a measurement holds when its interval is within this share
        self.compile_prior_s = compile_prior_s  # a compile nobody has measured on this setup is assumed to take this
        self.startup_s = startup_s  # how long this setup's trainer took to start (measured)
        # the run can train on in a trial's own process (its settings are the user's); else applying means a restart
        self.trial_process_continues = trial_process_continues
        # what the advice says to try, asked once when the trials start (the evidence is then the freshest)
        self.advice = advice
        self.continue_free = True  # the process running now can train on without a restart
        self.pace_s: float | None = None  # seconds per step at the start's speed (before the baseline)
        self.run_pace = RunPace()  # the run's time between its steps (checkpoints, evals, logging)
        self._base_failed = False  # the start itself failed (OOM, ...): anything that runs beats it
        self._aborted = False  # tuning was abandoned (the run ended or was interrupted)
        self._ranked: tuple[int, list[Standing]] | None = None
        self.max_trials = max_trials
        self.measure_kw: dict[str, Any] = dict(
            min_steps=min_steps, rel_ci=rel_ci, max_steps=max_steps, max_seconds=max_seconds
        )
        self.prune_margin = prune_margin
        self.progress_every_s = progress_every_s  # a measurement's progress: a tuner event at most this often
        self._progress_at = 0.0
        # joules used in [t0, t1] of event time (the session's gptop.energy over its device samples), for
        # a trial's energy per token; None: no energy figures
        self.energy = energy
        self.remeasure_top = remeasure_top
        # When starting a trial, keep budget for this many more (re-measurements); a trial is cut when only
        # `switch_reserve_s` is left, the time the final switch (checkpoint + restart) takes: the budget
        # covers tuning up to training on with the chosen setting. The session may update the reserve.
        self.reserve_trials = remeasure_top if reserve_trials is None else reserve_trials
        self.switch_reserve_s = switch_reserve_s
        self.slow_compile: set[str] = set()  # compile modes that did not warm up within a trial's time
        self.default_restart_s = default_restart_s
        self.trial_timeout_s = trial_timeout_s or (max_seconds + 2 * default_restart_s + 600.0)
        self.tokens_per_step = base_cfg.optim.global_batch * base_cfg.data.seq_len
        self.phase = TunerPhase.INIT
        self.max_mb: int | None = max_micro_batch
        self._mb_known = max_micro_batch is not None
        self.running: Toggles | None = None  # what the trainer process runs, as far as we know
        self.last_step = 0
        self.checkpoint_s = 0.0
        self.trend = LossTrend()
        self.baseline: dict[str, Any] | None = None
        self.baseline_number: int | None = None
        self.results: list[dict[str, Any]] = []  # this run's finished trials (trial events + extras)
        self.trials_run = 0
        self.screened = 0
        self.kept_tokens = 0
        self.rolled_back_s = 0.0
        self.stop_note = ""
        self.decision: Decision | None = None
        self.applied: Toggles | None = None
        self._active: ActiveTrial | None = None
        self._warm_started = False
        self._remeasure_plan: list[Standing] | None = None
        self._final: Done | None = None
        self._prefix = ""  # "stopped by the user: " before the decision
        self._events: list[Event] = []
        self._version = 0  # bumped when a measurement is recorded (the best may change)
        self.running = self.base
        # the optimizer whose state the newest kept checkpoint holds: what a trial's switch converts from
        self.state_optimizer = self.cfg.toggles.optimizer

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
        return min(self.max_trials, self.space.size())

    @property
    def in_trial(self) -> bool:
        """A trial (or the baseline, or a re-measurement) is running: its steps are its measurement."""
        return self._active is not None

    @property
    def trial_step_ms(self) -> float:
        """The running trial's median step time so far (NaN before it has one, or outside a trial)."""
        return self._active.measure.step_ms if self._active is not None else math.nan

    @property
    def trial_stop(self) -> str | None:
        """Why the running trial stopped measuring ("done", "prune", "budget", "timeout"), or None."""
        return self._active.stop if self._active is not None else None

    @property
    def final(self) -> Done | None:
        """The final decision once tuning is over (what to train on with, and why), else None."""
        return self._final

    @property
    def decisions(self) -> list[Decision]:
        """The ledger's decisions, in order."""
        return self.ledger.decisions

    @property
    def loss_allowance_s(self) -> float | None:
        """What tuning may lose, decided before the first trial (None before, or with --tune-only)."""
        return self.ledger.loss_allowance_s

    def _mb_attr(self) -> str:
        t = self.cfg.toggles
        return f"max_micro_batch:{t.precision}:{int(t.activation_checkpointing)}:{t.optimizer}:{t.quantize_base}"

    # --- events -------------------------------------------------------------------------
    def _emit(self, event: Event) -> None:
        self._events.append(event)

    def _say(self, message: str) -> None:
        self._emit(LogEvent(message=message, source="tuner"))

    def drain_events(self) -> list[Event]:
        """trial / apply / tuner events produced since the last call, for the session to publish."""
        out, self._events = self._events, []
        return out

    def tuner_event(self) -> TunerEvent:
        a = self._active
        final = self._final if self.phase is TunerPhase.DONE else None
        return TunerEvent(
            phase=self.phase,
            budget_left_s=round(self.budget.left(), 1),
            trial=a.number if a else None,
            trials_run=self.trials_run,
            trials_planned=self.trials_planned,
            study=self.study.name,
            outcome=final.reason if final is not None else None,
            applied=(self.applied is not None) if final is not None else None,
            measure=self.measure_progress(),
            budget_s=round(self.budget.total_s, 1),
            best=self.best_event(),
        )

    def best_event(self) -> TunerBest | None:
        """The best so far as the views show it: the trial `_decide` and the report would name."""
        st = self.best()
        return st.event() if st is not None else None

    def measure_progress(self) -> MeasureProgress | None:
        """The running measurement's progress (None outside one)."""
        return self._active.progress() if self._active is not None else None

    def _set_phase(self, phase: TunerPhase) -> None:
        if phase != self.phase:
            self.phase = phase
            self._emit(self.tuner_event())

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
            if self.running is self.cfg.toggles or self.running == self.cfg.toggles:
                self.running = self.base

    def observe(self, event: Event) -> None:
        """Feed every trainer event (other ranks and unknown types are ignored)."""
        if event.rank != 0:
            return
        a = self._active
        if isinstance(event, CheckpointEvent):
            self.checkpoint_s = event.seconds or 0.0
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
        if warmed or self.clock() - self._progress_at >= self.progress_every_s:
            self._progress_at = self.clock()
            self._emit(self.tuner_event())  # the views show the measurement's progress
        if a.proposal is not None and self.clock() - a.last_touch > 60.0:
            self.study.touch(a.proposal)
            a.last_touch = self.clock()

    def trial_should_stop(self) -> str | None:
        """None to go on; "done" (measured or capped), "prune" (clearly slower), "budget" (out of time):
        stop and keep the steps; a failure kind ("nan", "diverged", "oom", ...): stop and roll back."""
        a = self._active
        if a is None:
            return None
        if a.failure:
            return a.failure[0]
        if a.measure.done:
            a.stop = "done"
        elif self.budget.expired() or (self.budget.started and self.budget.left() <= self.switch_reserve_s):
            a.stop = "budget"
        elif a.kind is TrialKind.TRIAL and (
            should_prune(a.measure, self._best_this_run(), self.prune_margin)
            or hopeless(a.measure, self._best_this_run())
        ):
            a.stop = "prune"
        elif self.clock() - a.start > self.trial_timeout_s:
            a.stop = "timeout"
            return "done"
        return a.stop

    # --- the state machine --------------------------------------------------------------
    def next_action(self) -> Action:
        """What the session should do now (the same action again while a trial is unfinished)."""
        if self._active is not None:
            return self._active.action
        if self._final is not None:
            return self._final
        self.budget.start()
        if self.phase is TunerPhase.INIT:
            if not self._mb_known:
                known = self.study.get_attr(self._mb_attr())
                if known:
                    self.set_max_micro_batch(int(known))
            if not self._mb_known and (self.cfg.toggles.micro_batch == AUTO or "micro_batch" in self.space.params):
                self._set_phase(TunerPhase.FIND_MICRO_BATCH)
            else:
                self._set_phase(TunerPhase.BASELINE)
        if self.phase is TunerPhase.FIND_MICRO_BATCH:
            if not self._mb_known:
                return FindMicroBatch()
            self._set_phase(TunerPhase.BASELINE)
        if self.phase is TunerPhase.BASELINE:
            done = self._plan()
            if done is not None:
                return done
            return self._start(TrialKind.BASELINE, self.base, None)
        if self.phase is TunerPhase.TRIALS:
            done = self._plan()
            if done is not None:
                return done
            trial = self._next_trial()
            if trial is not None:
                return trial
            self._set_phase(TunerPhase.REMEASURE)
        if self.phase is TunerPhase.REMEASURE:
            again = self._next_remeasure()
            if again is not None:
                return again
            self._set_phase(TunerPhase.DECIDE)
        return self._decide()

    def _start(
        self,
        kind: TrialKind,
        toggles: Toggles,
        proposal: Proposal | None,
        number: int | None = None,
        source: str = "sampler",
        earlier: bool = False,
        advice: str | None = None,
    ) -> RunTrial | Remeasure:
        measure = Measurement(**self.measure_kw)
        strict = self.space.numerics_changing(toggles)
        restart = toggles != self.running
        if restart:  # a trial's process: training on in it needs a restart unless its settings are the user's
            self.run_pace.restart()
            self.continue_free = self.trial_process_continues
        if proposal is not None:
            number = proposal.number
        note = capabilities.optimizer_switch(self.state_optimizer, toggles.optimizer) if restart else None
        # a switch that starts the optimizer state fresh is measured, then rolled back: the run keeps its state
        keep = not note or capabilities.optimizer_state_carries(self.state_optimizer, toggles.optimizer)
        if kind is TrialKind.REMEASURE:
            assert number is not None
            action: RunTrial | Remeasure = Remeasure(number, toggles, measure, restart, keep_steps=keep)
        else:
            action = RunTrial(
                number,
                toggles,
                measure,
                baseline=kind is TrialKind.BASELINE,
                restart=restart,
                numerics_changing=strict,
                source=source,
                keep_steps=keep,
                advice=advice,
            )
        self._active = ActiveTrial(
            kind,
            action,
            toggles,
            proposal,
            number,
            self.clock(),
            measure,
            LossGuard(self.trend, strict),
            strict,
            last_touch=self.clock(),
            note=note or "",
            earlier=earlier,
            advice=advice,
        )
        if number is not None:  # views key trials by number; an unnumbered baseline gets one row, at its end
            self._emit(
                TrialEvent(
                    number=number,
                    toggles=toggles,
                    status=TrialStatus.RUNNING,
                    tokens_per_s=None,
                    spread=None,
                    peak_mem=None,
                    reason="",
                    kind=kind,
                    source=source if kind is TrialKind.TRIAL else kind,
                    earlier=earlier,
                    advice=advice,
                    compile=None,
                    unsteady=False,
                )
            )
        self._emit(self.tuner_event())
        return action

    def _next_trial(self) -> RunTrial | None:
        if not self._warm_started:
            self._warm_started = True
            tries = self.advice() if self.advice is not None else []
            self.study.warm_start(first_guesses(self.base, self.space, self.dev, self.max_mb, tries))
        for _ in range(200):
            if self.trials_run >= self.max_trials:
                self.stop_note = f"ran the maximum of {self.max_trials} trials"
                return None
            est = self._trial_estimate()
            if not self.budget.can_afford(est * (1 + self.reserve_trials) + self.switch_reserve_s):
                self.stop_note = f"budget: {self.budget.left():.0f}s left, a trial takes about {est:.0f}s"
                return None
            if self.run_pays and self._gate(est) is not None:
                return None
            p = self._ask(est)
            if p is None:
                self.stop_note = (
                    "every configuration in the space has been measured"
                    if not self.ledger.dropped
                    else "no configuration left to try can pay for itself in this run"
                )
                return None
            s = screen(
                p.toggles,
                start=self.cfg.toggles,
                max_mb=self.max_mb,
                dev=self.dev,
                space=self.space,
                slow_compile=self.slow_compile,
                trial_timeout_s=self.trial_timeout_s,
            )
            if s is not None:
                if s.failure is None:
                    self.study.tell_pruned(p, None, s.reason, extra={"screened": True})
                else:
                    self.study.tell_infeasible(p, s.failure, s.reason, extra={"predicted": True})
                self.screened += 1
                self._finish_event(
                    p.number, TrialKind.TRIAL, p.toggles, s.status, None, s.reason, 0.0, ran=False, source=p.source
                )
                continue
            self.trials_run += 1
            action = self._start(TrialKind.TRIAL, p.toggles, p, source=p.source, advice=p.advice)
            assert isinstance(action, RunTrial)
            return action
        self.stop_note = "the sampler keeps proposing configurations that cannot fit"
        return None

    def _ask(self, est: float) -> Proposal | None:
        """The study's next proposal: the cheap ones that can pay first, then what can still pay, however
        expensive (any proposal with --tune-only)."""
        if not self.run_pays:
            return self.study.ask(accept=None)
        p = self.study.ask(accept=self.ledger.accept(self._outlook(), est, cheap_first=True))
        if p is None:
            p = self.study.ask(accept=self.ledger.accept(self._outlook(), est, cheap_first=False))
        return p

    def _next_remeasure(self) -> Remeasure | None:
        if self._remeasure_plan is None:
            start = standings.start_standing(
                self.base, self._base_estimate(), self._base_number(), self.study.run_id, self.trust_spread
            )
            self._remeasure_plan = standings.remeasure_plan(
                self._standings(), start, self.remeasure_top, self.ledger.stopped_exploring
            )
        while self._remeasure_plan:
            st = self._remeasure_plan.pop(0)
            base = self._base_estimate()
            if not st.start and st.anchor == "this run" and (base is None or not self._holds(*base)):
                continue  # compared with a start that does not hold, a re-measurement proves nothing
            est = self._trial_estimate()
            if not self.budget.can_afford(est + self.switch_reserve_s):
                self._remeasure_plan = []
                break
            step_s = self._step_s()
            if self.run_pays and step_s is not None:
                # worth what the speed-up it may confirm saves (the start's own: what the best it makes claimable saves)
                gain = max([st.speedup] + [o.speedup for o in self._remeasure_plan])
                if not self.ledger.remeasure(self._outlook(), st, est, gain).apply:
                    continue
            action = self._start(TrialKind.REMEASURE, st.cand.toggles, None, number=st.cand.number, earlier=st.earlier)
            assert isinstance(action, Remeasure)
            return action
        return None

    def _best_this_run(self) -> float | None:
        """The fastest measurement of this run that holds: the pruning reference."""
        return standings.pruning_reference(self.results, self.trust_spread)

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
        end = a.end(self.clock(), self.energy)
        if outcome is TrialOutcome.OK and a.failure:
            outcome, reason = a.failure[0], reason or a.failure[1]
        if outcome.failed:
            return self._finish_failed(a, end, outcome, reason, rollback)
        return self._finish_measured(a, end, reason, rollback)

    def _finish_failed(
        self, a: ActiveTrial, end: TrialEnd, outcome: TrialOutcome, reason: str, rollback: dict[str, Any] | None
    ) -> TrialEvent:
        """A measurement that failed: rolled back, and its kind's handler records why."""
        reason = noted(
            noted(reason or (a.failure[1] if a.failure else outcome), a.note), compile_words(a.compile, False)
        )
        self.running = None
        self.rolled_back_s += end.duration
        self._FAILED[a.kind](self, a, end, outcome, reason)
        return self._finish_event(
            a.number,
            a.kind,
            a.toggles,
            TrialStatus.INFEASIBLE,
            end.summary,
            f"{outcome}: {reason}",
            end.duration,
            failure=outcome,
            overhead_s=end.overhead_s,
            source=a.source,
            rollback=rollback,
            earlier=a.earlier,
            **a.marks,
        )

    def _finish_measured(
        self, a: ActiveTrial, end: TrialEnd, reason: str, rollback: dict[str, Any] | None
    ) -> TrialEvent:
        """A healthy measurement: its steps kept (or rolled back as its action asked), its verdict, and its
        kind's handler records it."""
        if rollback is not None:  # measured, then rolled back (keep_steps False)
            self.running = None
            self.rolled_back_s += end.duration
            a.note = noted(
                a.note,
                f"measured, then rolled back to the pre-trial checkpoint so the run keeps "
                f"its {self.state_optimizer} state",
            )
        else:
            self.running = a.toggles
            self.state_optimizer = a.toggles.optimizer  # its steps (and checkpoints) are kept
            self.kept_tokens += a.measure.steps * self.tokens_per_step
        if not a.strict and rollback is None:
            for step, loss in a.losses:
                self.trend.add(step, loss)
        status, reason = a.verdict(reason, self._best_this_run())
        if a.still_compiling:
            self.slow_compile.add(a.toggles.compile)  # still compiling: screen this mode for the run
        unsteady = a.unsteady and a.kind is not TrialKind.BASELINE
        reason = noted(noted(reason, a.note), compile_words(a.compile, unsteady))
        if unsteady and status.measured:
            self._refuse_unsteady(a, a.measure.estimate[0])
        summary = self._MEASURED[a.kind](self, a, end, status, reason)
        return self._finish_event(
            a.number,
            a.kind,
            a.toggles,
            status,
            summary,
            reason,
            end.duration,
            overhead_s=end.overhead_s,
            source=a.source,
            rollback=rollback,
            earlier=a.earlier,
            **a.marks,
        )

    # the handlers per kind: a failed one records why (the measurement was rolled back), a measured one records
    # the measurement and returns the summary its event shows
    def _trial_failed(self, a: ActiveTrial, end: TrialEnd, outcome: TrialOutcome, reason: str) -> None:
        assert a.proposal is not None
        self.study.tell_infeasible(a.proposal, outcome, reason, end.summary, end.extra)

    def _remeasure_failed(self, a: ActiveTrial, end: TrialEnd, outcome: TrialOutcome, reason: str) -> None:
        assert a.number is not None
        self.study.record_remeasure(a.number, end.summary, status=TrialStatus.INFEASIBLE, reason=f"{outcome}: {reason}")

    def _baseline_failed(self, a: ActiveTrial, end: TrialEnd, outcome: TrialOutcome, reason: str) -> None:
        self.baseline = None
        self._base_failed = True
        self.stop_note = f"the starting configuration failed: {reason}"
        if outcome is TrialOutcome.OOM:
            self._widen_for_memory(f"the starting configuration ran out of memory ({reason})")

    def _trial_measured(self, a: ActiveTrial, end: TrialEnd, status: TrialStatus, reason: str) -> dict[str, Any]:
        assert a.proposal is not None
        if status is TrialStatus.PRUNED:
            self.study.tell_pruned(a.proposal, end.summary, reason, end.extra)
        else:  # one that kept recompiling is told with a violated constraint: never a candidate, in any run
            self.study.tell_ok(a.proposal, end.summary, status, reason, end.extra, feasible=not a.unsteady)
        return end.summary

    def _remeasure_measured(self, a: ActiveTrial, end: TrialEnd, status: TrialStatus, reason: str) -> dict[str, Any]:
        assert a.number is not None
        ok = status.measured and not a.unsteady
        self.study.record_remeasure(
            a.number,
            end.summary,
            reason=reason,
            status=TrialStatus.OK if ok else "unsteady" if a.unsteady else TrialStatus.PRUNED,
        )
        pooled = next((c for c in self.study.candidates(run=self.study.run_id) if c.number == a.number), None)
        if pooled is None:
            return end.summary
        est, spread = a.measure.estimate  # the event updates the trial's row: show the pooled estimate
        return {
            **end.summary,
            "tokens_per_s": pooled.tokens_per_s,
            "spread": pooled.spread,
            "remeasure_tokens_per_s": est,
            "remeasure_spread": spread,
        }

    def _baseline_measured(self, a: ActiveTrial, end: TrialEnd, status: TrialStatus, reason: str) -> dict[str, Any]:
        if status.measured:
            self.baseline = {**end.summary, "duration_s": end.duration}
            self.baseline_number = self.study.record(
                a.toggles, end.summary, "baseline", status, reason, {**end.extra, "overhead_s": None}
            )
            a.number = self.baseline_number
            self.study.record_baseline(a.toggles, end.summary, status)
        else:
            self.baseline = None
            self.stop_note = "the starting configuration gave no steady measurement"
        return end.summary

    _FAILED: dict[TrialKind, Callable[[TuneController, ActiveTrial, TrialEnd, TrialOutcome, str], None]] = {
        TrialKind.TRIAL: _trial_failed,
        TrialKind.REMEASURE: _remeasure_failed,
        TrialKind.BASELINE: _baseline_failed,
    }
    _MEASURED: dict[TrialKind, Callable[[TuneController, ActiveTrial, TrialEnd, TrialStatus, str], dict[str, Any]]] = {
        TrialKind.TRIAL: _trial_measured,
        TrialKind.REMEASURE: _remeasure_measured,
        TrialKind.BASELINE: _baseline_measured,
    }

    def _refuse_unsteady(self, a: ActiveTrial, est: float) -> None:
        """Into the ledger: a configuration whose compile kept recompiling is not a candidate, whatever it measured
        (a measurement between recompilations, or of a frame that fell back to eager, is luck, not the setting)."""
        what = "trial" if a.kind is TrialKind.TRIAL else "re-measured trial"
        d = not_a_candidate(
            f"{what} {a.number} kept recompiling ({a.recompiling})",
            est,
            self._base_estimate(),
            self._remaining(),
            self.tokens_per_step,
            self._costs().switch_s(a.toggles),
        )
        self.ledger.record(d, self.last_step, say=True)

    def _widen_for_memory(self, reason: str) -> None:
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
        if a is not None and a.proposal is not None:
            self.study.tell_failed(a.proposal, reason)
        self._final = Done(reason, self.running or self.base, restart=False)
        self._aborted = True
        self.budget.stop()
        self._set_phase(TunerPhase.DONE)

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
        if a is not None:
            if a.proposal is not None:
                self.study.tell_failed(a.proposal, reason)
            if rolled_back:
                self.running = None
                self.rolled_back_s += self.clock() - a.start
            else:
                self.kept_tokens += a.measure.steps * self.tokens_per_step
                self.state_optimizer = a.toggles.optimizer
            if a.kind is TrialKind.BASELINE:
                self.phase = TunerPhase.TRIALS
        if self.baseline is None:
            self.stop_note = f"{reason} before the starting configuration was measured"
            return self._done(f"{reason}; nothing measured to decide on", self.base)
        self.stop_note = reason
        return self._decide(prefix=f"{reason}: ")

    def _finish_event(
        self,
        number: int | None,
        kind: TrialKind,
        toggles: Toggles,
        status: TrialStatus,
        summary: dict[str, Any] | None,
        reason: str,
        duration: float,
        *,
        ran: bool = True,
        failure: TrialOutcome | None = None,
        overhead_s: float | None = None,
        source: str | None = None,
        rollback: dict[str, Any] | None = None,
        earlier: bool = False,
        advice: str | None = None,
        compile: dict[str, int] | None = None,
        unsteady: bool = False,
    ) -> TrialEvent:
        s = summary or {}
        ev = TrialEvent(
            number=number,
            toggles=toggles,
            status=status,
            tokens_per_s=s.get("tokens_per_s"),
            spread=s.get("spread"),
            peak_mem=s.get("peak_mem"),
            energy_per_token=s.get("energy_per_token"),
            reason=reason,
            kind=kind,
            source=source or (kind if kind is not TrialKind.TRIAL else None),
            duration_s=round(duration, 3),
            remeasure_tokens_per_s=s.get("remeasure_tokens_per_s"),
            remeasure_spread=s.get("remeasure_spread"),
            rollback=rollback,
            earlier=earlier,
            advice=advice,
            compile=compile,
            unsteady=unsteady,
        )
        fields = {f.name: getattr(ev, f.name) for f in dataclasses.fields(ev) if f.name != "extra"}
        self.results.append(
            {**fields, "duration_s": duration, "ran": ran, "failure": failure, "overhead_s": overhead_s, "summary": s}
        )
        self._emit(ev)
        self._emit(self.tuner_event())
        return ev

    # --- the figures the economics take -------------------------------------------------
    def _remaining(self) -> int:
        return max(0, self.cfg.optim.max_steps - self.last_step)

    def _step_s(self) -> float | None:
        """Seconds per step at the start's speed: this run's baseline, else the pace the session reported."""
        base = self._base_estimate()
        if base is not None and base[0] > 0:
            return self.tokens_per_step / base[0]
        return self.pace_s

    def _costs(self) -> Costs:
        start = self.startup_s if self.startup_s is not None else self.default_restart_s
        return Costs(
            self.results,
            self.study,
            self.base,
            self.running,
            self.continue_free,
            start + self.checkpoint_s,
            self.compile_prior_s,
            self.measure_kw,
            self.run_pace,
            self.baseline["duration_s"] if self.baseline else None,
        )

    def _trial_estimate(self) -> float:
        """How long a trial takes, restart and measurement (`Costs.trial_estimate`)."""
        return self._costs().trial_estimate(self._step_s())

    def _cost_so_far(self) -> float | None:
        """The tuning's own cost so far: its time beyond what the steps it kept take at the start's speed."""
        base = self._base_estimate()
        if base is None or not base[0] > 0:
            return None
        return max(0.0, self.budget.elapsed() - self.kept_tokens / base[0])

    def _outlook(self) -> Outlook:
        best, switch, _ = self._judge()
        return Outlook(
            self._costs(),
            self.last_step,
            self._remaining(),
            self._step_s(),
            self.run_pace.between_s(),
            best,
            switch,
            self._cost_so_far(),
        )

    def gain_bound(self) -> float:
        """The most a trial may be assumed to gain over the start (`Ledger.gain_bound`)."""
        return self.ledger.gain_bound(self.best())

    # --- paying for itself ------------------------------------------------------------
    def _plan(self) -> Done | None:
        """Before the first trial: the budget the run affords (at most `max_share` of the time it has left), what
        tuning may lose (`max_loss` of it) and whether any trial can pay. Made on the pace the session reported
        (the `t` key), and again on the baseline's own measurement; None to go on, or the Done that ends tuning."""
        ledger = self.ledger
        if not self.run_pays or ledger.planned:
            return None
        step_s = self._step_s()
        if step_s is None:
            return None
        measured = self._base_estimate() is not None
        if not measured and ledger.decisions:  # planned on the reported pace already; wait for the baseline
            return None
        ledger.planned = measured
        left_s = self._remaining() * (step_s + self.run_pace.between_s())  # the run's wall time, not only its steps'
        ledger.loss_allowance_s = ledger.max_loss * left_s
        limited = self.budget.limit(ledger.max_share * left_s)
        d = ledger.plan(self._outlook(), self._trial_estimate())
        if not d.apply:
            ledger.record(d, self.last_step)
            self.stop_note = d.reason
            return self._done(d.reason, self.base)
        if limited and measured:
            self._say(
                f"tuner: budget {format_duration(self.budget.total_s)}: at most {ledger.max_share:.0%} of the "
                f"{format_duration(left_s)} the run has left "
                f"(asked for {format_duration(self.budget.requested_s)})"
            )
        ledger.record(d, self.last_step, say=measured)
        return None

    def _gate(self, est: float) -> Decision | None:
        """Before a trial: None to go on; else why not (`Ledger.gate`, recorded)."""
        if self._step_s() is None:
            return None
        d = self.ledger.gate(self._outlook(), est)
        if d is not None:
            self.stop_note = d.reason
        return d

    # --- standings ------------------------------------------------------------------
    def _base_number(self) -> int | None:
        """The start's trial in the study (this run's baseline, or an earlier run's trial of the same toggles)."""
        if self.baseline_number is not None:
            return self.baseline_number
        return next((c.number for c in self.study.candidates() if c.toggles == self.base), None)

    def _base_estimate(self) -> Estimate | None:
        """This run's measurement of the start (tokens/s, lo, hi): its baseline pooled with this run's
        re-measurements of it; None before it was measured (or when it failed)."""
        if self.baseline is None:
            return None
        return standings.start_estimate(self.study, self.baseline, self._base_number())

    def _holds(self, est: float, lo: float, hi: float) -> bool:
        return standings.holds(est, lo, hi, self.trust_spread)

    def _standings(self) -> list[Standing]:
        """Every measured configuration but the start, fastest first (`standings.rank`), until the next
        measurement is recorded."""
        if self._ranked is not None and self._ranked[0] == self._version:
            return self._ranked[1]
        ranked = standings.rank(self.study, self.base, self._base_estimate(), self.trust_spread)
        self._ranked = (self._version, ranked)
        return ranked

    def best(self) -> Standing | None:
        """The best so far (`standings.best_of`): what the views, the decision and the report name."""
        return standings.best_of(self._standings(), self.study, self._base_failed, self.trust_spread)

    def _judge(self) -> Judgement:
        """The best and whether switching to it now pays (`standings.judge`)."""
        best = self.best()
        return standings.judge(
            best,
            self._standings(),
            self._base_estimate(),
            base=self.base,
            remaining=self._remaining(),
            tokens_per_step=self.tokens_per_step,
            switch_s=self._costs().switch_s,
            trust_spread=self.trust_spread,
            stop_note=self.stop_note,
        )

    # --- deciding -------------------------------------------------------------------
    def _decide(self, prefix: str = "") -> Apply | Done:
        self._prefix = prefix
        self._set_phase(TunerPhase.DECIDE)
        base = self.base
        best, decision, why = self._judge()
        if decision is None:
            return self._done(why, base)
        decision = dataclasses.replace(decision, step=self.last_step)
        self.decision = decision
        self.ledger.record(decision, self.last_step)
        if not decision.apply:
            return self._done(decision.reason, base)
        assert best is not None
        c = best.cand
        base_est = self._base_estimate()
        self.applied = c.toggles
        restart = c.toggles != self.running
        best_tps = (
            base_est[0] * best.speedup if base_est is not None and math.isfinite(best.speedup) else c.tokens_per_s
        )
        self._emit(
            ApplyEvent(
                toggles=c.toggles,
                decision=decision.to_dict(),
                number=c.number,
                tokens_per_s=best_tps,
                baseline_tokens_per_s=base_est[0] if base_est else None,
                step=self.last_step,
                earlier=best.earlier,
            )
        )
        self._final = Done(f"{prefix}applied {best.label}: {decision.reason}", c.toggles, restart=False)
        self.budget.stop()
        self.phase = TunerPhase.DONE
        self._emit(self.tuner_event())
        return Apply(c.toggles, decision, restart, number=c.number, label=best.label)

    def _done(self, reason: str, toggles: Toggles) -> Done:
        reason = self._prefix + reason
        self._final = Done(reason, toggles, restart=toggles != self.running)
        self.budget.stop()
        self._set_phase(TunerPhase.DONE)
        return self._final

    # --- report ------------------------------------------------------------------------
    def report_info(self) -> dict[str, Any]:
        """What `tuner.tuning_report.write_report` needs besides the study: this run's baseline, best, decision, ledger.

        The ledger weighs the whole tuning against not tuning: `cost_s` is its time beyond what the steps it
        kept take at the start's speed (slow, rolled-back and restarting trials all count), `switch_s` the
        switch that follows it (to the applied setting, or back to the start), `saving_s` what the applied
        setting saves over the remaining steps, and `net_s` = saving - cost - switch; `decisions` are the
        plan, the kinds of trial dropped, the stop of exploring and the switch, with their figures."""
        best = self.best()
        c = best.cand if best is not None else None
        base = self._base_estimate()
        tuning_s = self.budget.elapsed()
        remaining = self._remaining()
        cost = self._cost_so_far()
        applied = self.decision is not None and self.decision.apply and self.applied is not None
        saving = self.decision.expected_saving_s if applied and self.decision is not None else 0.0
        final = self._final
        if applied and self.decision is not None:
            switch = self.decision.cost_s
        elif final is None or self._aborted or not self.run_pays or remaining == 0:
            switch = 0.0  # the run ended or stopped while tuning, or --tune-only stops it: no switch
        else:
            switch = self._costs().switch_s(final.toggles)
        return {
            "run": self.study.run_id,
            "study": self.study.name,
            "key": self.study.key,
            "device": self.dev.to_dict(),
            "base": dataclasses.asdict(self.base),
            "baseline": {
                **{
                    k: self.baseline.get(k)
                    for k in ("tokens_per_s", "spread", "peak_mem", "energy_per_token", "n", "steps")
                },
                "holds": self._holds(*base) if base is not None else False,
            }
            if self.baseline
            else None,
            "baseline_number": self.baseline_number,
            "best": dataclasses.asdict(c.toggles) if c else None,
            "best_number": c.number if c else None,
            "best_tokens_per_s": c.tokens_per_s if c else None,
            "best_spread": c.spread if c else None,
            "best_speedup": best.speedup if best is not None and math.isfinite(best.speedup) else None,
            "best_label": best.label if best is not None else None,
            "applied": dataclasses.asdict(self.applied) if self.applied else None,
            "decision": self.decision.to_dict() if self.decision else None,
            "outcome": self._final.reason if self._final else self.stop_note,
            "stop_note": self.stop_note,
            "memory": (
                {"reason": self.space.memory, "choices": {n: list(self.space.choices[n]) for n in MEMORY_SAVING}}
                if self.space.memory
                else None
            ),
            "results": [
                {**{k: v for k, v in r.items() if k not in ("summary",)}, "toggles": dataclasses.asdict(r["toggles"])}
                for r in self.results
            ],
            "ledger": {
                "budget_s": self.budget.total_s,
                "requested_budget_s": self.budget.requested_s,
                "tuning_s": tuning_s,
                "trials_run": self.trials_run,
                "screened": self.screened,
                "skipped": self.study.skipped(self.study.run_id),
                "kept_tokens": self.kept_tokens,
                "rolled_back_s": self.rolled_back_s,
                "cost_s": cost,
                "switch_s": switch,
                "saving_s": saving,
                "net_s": saving - cost - switch if cost is not None else None,
                # the steps the saving is over: the decision's (a few more ran while the switch was made)
                "remaining_steps": self.decision.remaining_steps
                if applied and self.decision is not None
                else remaining,
                "tokens_per_step": self.tokens_per_step,
                "step_s": self._step_s(),
                "between_s": self.run_pace.between_s(),
                "loss_allowance_s": self.loss_allowance_s,
                "projected_saving_s": saving - switch if applied else None,
                "decisions": [d.to_dict() for d in self.decisions],
            },
        }
