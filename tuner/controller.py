"""The tuning state machine, driven by the training loop's events (Zeus style).

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
                # stop in FAILURES, or the process died: roll back to the checkpoint taken
                # before the trial -> finish_trial(kind)  (kind: oom, nan, diverged, compile, crash)
                ctl.finish_trial(outcome)
            case Apply():                 # after a checkpoint, restart with action.toggles
                ...                       # if action.restart; write the report
            case Done():                  # continue with action.toggles (restart if action.restart)
                break
        for ev in ctl.drain_events(): emit(ev)                 # trial / apply / tuner events

Events: `tuner` {phase, budget_left_s, trial, trials_run, trials_planned,
study} at every phase change, trial start and end; `trial` {number, toggles,
status, tokens_per_s, spread, peak_mem, energy_per_token, reason, kind,
source, duration_s} with status "running" when a numbered trial starts (the
unnumbered baseline only reports at its end) and ok / cut / pruned /
infeasible when it ends; a remeasure updates its trial's row with the pooled
estimate (plus remeasure_tokens_per_s); `apply` {toggles, decision, number,
tokens_per_s, baseline_tokens_per_s, step}; the `tuner` event of phase done
also carries `outcome` (the decision or why tuning ended, in words) and
`applied`.

Phases: find-micro-batch -> baseline -> trials -> remeasure -> decide -> done.

* Baseline: the starting configuration is measured first; it is already
  running, so this costs nothing but patience, and every speedup is relative
  to it. It is recorded in the study when it lies in the search space.
* Trials: the starting configuration and the device recipe are enqueued
  (`TuneStudy.warm_start`), then TPE proposes. A trial is started only if the
  budget can afford its estimated duration plus `reserve_trials` more (for
  re-measurements) plus `switch_reserve_s`; one that overruns is cut
  (`trial_should_stop() == "budget"`) when only `switch_reserve_s` is left,
  the time the final checkpoint-and-restart takes, so the budget covers
  tuning up to training on with the chosen setting. A trial still warming up
  after `trial_timeout_s` (a compile on a CPU) is cut, and its compile mode is
  screened out for the rest of the run (`slow_compile`). Proposals whose
  micro-batch cannot fit (above the largest that fits without activation
  checkpointing, 2x for a narrower precision) are recorded infeasible
  without running, unless they also hold less state than the start (a
  smaller optimizer state, a quantized base): those are tried.
* Remeasure: the top-2 are measured again (best last, so it is what runs when
  the decision comes) unless the best's interval is already clear of the
  second's; estimates pool both measurements (the maximum of noisy estimates
  is biased up: the winner's curse).
* Decide: apply only if the best is significantly faster than the start
  (its CI lower bound above the start's estimate) and the saving over the
  remaining steps exceeds the switch cost (`decide.switch_pays`).

Loss health: the run's loss trend (`LossTrend`) is fitted over healthy steps
outside numerics-changing trials; a trial that changes precision, the
optimizer or the base's quantization (`tuner.space.NUMERICS_CHANGING`) must
stay within its tolerance, every trial must stay finite and below 1.5x the
recent maximum. `trial_should_stop()` then returns "nan" or "diverged".

Memory: when the wanted micro-batch does not fit, the space the session
builds is already widened to the memory savers (`tuner.space`); when the
starting configuration itself runs out of memory, the controller widens it
then (`space.for_memory`) and goes on in the study of the wider space
(`study` changes: the session reports from `ctl.study`). A memory-constrained
study enqueues a `memory` first guess: the largest micro-batch with every
saver on. A trial that switches the optimizer says in its reason what happens
to the optimizer state (`capabilities.optimizer_switch`: the AdamW moments
carry over, Adafactor's state starts fresh), relative to `state_optimizer`,
the optimizer of the newest kept checkpoint. A trial's `peak_mem` is the
largest its step events reported, or what its out-of-memory error reported.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Callable

from trainer.contract import capabilities
from trainer.contract.config import AUTO, TrainConfig, Toggles
from trainer.contract.device import DeviceInfo
from trainer.contract.events import (ApplyEvent, CheckpointEvent, ErrorEvent, Event, MeasureProgress, StepEvent,
                                     TrialEvent, TunerEvent)

from .budget import Budget
from .decide import (Decision, clearly_better, hopeless, should_prune, significantly_faster, switch_pays,
                     top_candidates)
from .measure import LossGuard, LossTrend, Measurement
from .space import MEMORY_SAVING, SearchSpace
from .study import FAILURE_KINDS, Candidate, Proposal, TuneStudy

FAILURES: tuple[str, ...] = FAILURE_KINDS


# --- actions ----------------------------------------------------------------------------

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
    """Switch the run to `toggles` after a checkpoint (no-op restart if `restart` is False)."""

    toggles: Toggles
    decision: Decision
    restart: bool = True
    number: int | None = None


@dataclass
class Done:
    """Tuning is over: continue training with `toggles` (restart first if `restart`)."""

    reason: str
    toggles: Toggles
    restart: bool = False


Action = FindMicroBatch | RunTrial | Remeasure | Apply | Done


@dataclass
class _Active:
    kind: str                      # baseline | trial | remeasure
    action: RunTrial | Remeasure
    toggles: Toggles
    proposal: Proposal | None
    number: int | None
    start: float
    measure: Measurement
    guard: LossGuard
    strict: bool
    arrivals: list[float] = field(default_factory=list)
    losses: list[tuple[int, float]] = field(default_factory=list)
    stop: str | None = None
    failure: tuple[str, str] | None = None
    last_touch: float = 0.0
    oom_mem: int | None = None      # the peak an out-of-memory error reported (no step event may have come)
    note: str = ""                  # what the switch does to the optimizer state, for the trial's reason


class TuneController:
    """Decides what the session does next while tuning; see the module doc for the protocol."""

    def __init__(self, base_cfg: TrainConfig, dev: DeviceInfo, space: SearchSpace, study: TuneStudy,
                 budget: Budget, clock: Callable[[], float] = time.monotonic, *, max_trials: int = 16,
                 min_steps: int = 8, rel_ci: float = 0.03, max_steps: int = 200, max_seconds: float = 300.0,
                 prune_margin: float = 0.05, remeasure_top: int = 2, default_restart_s: float = 60.0,
                 trial_timeout_s: float | None = None, max_micro_batch: int | None = None,
                 reserve_trials: int | None = None, switch_reserve_s: float = 0.0,
                 energy: Callable[[float, float], float | None] | None = None, progress_every_s: float = 1.0):
        self.cfg, self.dev, self.space, self.study, self.budget, self.clock = base_cfg, dev, space, study, budget, clock
        self.max_trials = max_trials
        self.measure_kw = dict(min_steps=min_steps, rel_ci=rel_ci, max_steps=max_steps, max_seconds=max_seconds)
        self.prune_margin = prune_margin
        self.progress_every_s = progress_every_s   # a measurement's progress: a tuner event at most this often
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
        self.slow_compile: set[str] = set()     # compile modes that did not warm up within a trial's time
        self.default_restart_s = default_restart_s
        self.trial_timeout_s = trial_timeout_s or (max_seconds + 2 * default_restart_s + 600.0)
        self.tokens_per_step = base_cfg.optim.global_batch * base_cfg.data.seq_len
        self.phase = "init"
        self.max_mb: int | None = max_micro_batch
        self._mb_known = max_micro_batch is not None
        self.running: Toggles | None = None                     # what the trainer process runs, as far as we know
        self.last_step = 0
        self.checkpoint_s = 0.0
        self.trend = LossTrend()
        self.baseline: dict[str, Any] | None = None
        self.baseline_number: int | None = None
        self.results: list[dict[str, Any]] = []                 # this run's finished trials (trial events + extras)
        self.trials_run = 0
        self.screened = 0
        self.kept_tokens = 0
        self.rolled_back_s = 0.0
        self.stop_note = ""
        self.decision: Decision | None = None
        self.applied: Toggles | None = None
        self._active: _Active | None = None
        self._warm_started = False
        self._remeasure_plan: list[Candidate] | None = None
        self._final: Done | None = None
        self._prefix = ""                                       # "stopped by the user: " before the decision
        self._events: list[Event] = []
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

    def _mb_attr(self) -> str:
        t = self.cfg.toggles
        return f"max_micro_batch:{t.precision}:{int(t.activation_checkpointing)}:{t.optimizer}:{t.quantize_base}"

    # --- events -------------------------------------------------------------------------
    def _emit(self, event: Event) -> None:
        self._events.append(event)

    def drain_events(self) -> list[Event]:
        """trial / apply / tuner events produced since the last call, for the session to publish."""
        out, self._events = self._events, []
        return out

    def tuner_event(self) -> TunerEvent:
        a = self._active
        final = self._final if self.phase == "done" else None
        return TunerEvent(phase=self.phase, budget_left_s=round(self.budget.left(), 1),
                          trial=a.number if a else None, trials_run=self.trials_run,
                          trials_planned=self.trials_planned, study=self.study.name,
                          outcome=final.reason if final is not None else None,
                          applied=(self.applied is not None) if final is not None else None,
                          measure=self.measure_progress())

    def measure_progress(self) -> MeasureProgress | None:
        """The running measurement: samples collected of those needed, the estimate and its spread."""
        a = self._active
        if a is None:
            return None
        m = a.measure
        est, spread = m.estimate if m.has_estimate else (math.nan, math.nan)
        finite = math.isfinite(est) and math.isfinite(spread)
        return MeasureProgress(kind=a.kind, number=a.number, steps=len(m.samples), samples=len(m.kept),
                               needed=m.min_steps, warmed_up=m.warmed_up,
                               tokens_per_s=round(est, 1) if finite else None,
                               spread=round(spread, 1) if finite else None, target=m.rel_ci,
                               seconds=round(m.seconds, 1), max_seconds=m.cap_seconds)

    def _set_phase(self, phase: str) -> None:
        if phase != self.phase:
            self.phase = phase
            self._emit(self.tuner_event())

    # --- session inputs -----------------------------------------------------------------
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
            return
        if isinstance(event, ErrorEvent):
            if a is not None and a.failure is None:
                a.failure = (event.kind if event.kind in FAILURES else "crash", event.message)
            if a is not None:
                a.oom_mem = reported_peak(event.memory) or a.oom_mem
            return
        if not isinstance(event, StepEvent):
            return
        step = event.step
        self.last_step = step
        loss = event.loss
        if a is None:
            self.trend.add(step, loss)          # healthy training between trials
            return
        warm = a.measure.warmed_up
        a.measure.add(step, event.step_ms or 0.0, self.tokens_per_step, event.time, loss, event.mem_bytes)
        a.arrivals.append(self.clock())
        if a.measure.warmed_up != warm or self.clock() - self._progress_at >= self.progress_every_s:
            self._progress_at = self.clock()
            self._emit(self.tuner_event())       # the views show the measurement's progress
        if loss is not None:
            a.losses.append((step, loss))
        if a.failure is None:
            verdict = a.guard.check(loss, step)
            if verdict:
                a.failure = (verdict, a.guard.reason)
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
        elif a.kind == "trial" and (should_prune(a.measure, self._best_this_run(), self.prune_margin)
                                    or hopeless(a.measure, self._best_this_run())):
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
        if self.phase == "init":
            if not self._mb_known:
                known = self.study.get_attr(self._mb_attr())
                if known:
                    self.set_max_micro_batch(int(known))
            if not self._mb_known and (self.cfg.toggles.micro_batch == AUTO or "micro_batch" in self.space.params):
                self._set_phase("find-micro-batch")
            else:
                self._set_phase("baseline")
        if self.phase == "find-micro-batch":
            if not self._mb_known:
                return FindMicroBatch()
            self._set_phase("baseline")
        if self.phase == "baseline":
            return self._start("baseline", self.base, None)
        if self.phase == "trials":
            action = self._next_trial()
            if action is not None:
                return action
            self._set_phase("remeasure")
        if self.phase == "remeasure":
            action = self._next_remeasure()
            if action is not None:
                return action
            self._set_phase("decide")
        return self._decide()

    def _start(self, kind: str, toggles: Toggles, proposal: Proposal | None, number: int | None = None,
               source: str = "sampler") -> RunTrial | Remeasure:
        measure = Measurement(**self.measure_kw)
        strict = self.space.numerics_changing(toggles)
        restart = toggles != self.running
        if proposal is not None:
            number = proposal.number
        note = capabilities.optimizer_switch(self.state_optimizer, toggles.optimizer) if restart else None
        # a switch that starts the optimizer state fresh is measured, then rolled back: the run keeps its state
        keep = not note or capabilities.optimizer_state_carries(self.state_optimizer, toggles.optimizer)
        if kind == "remeasure":
            action: RunTrial | Remeasure = Remeasure(number, toggles, measure, restart, keep_steps=keep)
        else:
            action = RunTrial(number, toggles, measure, baseline=kind == "baseline", restart=restart,
                              numerics_changing=strict, source=source, keep_steps=keep)
        self._active = _Active(kind, action, toggles, proposal, number, self.clock(), measure,
                               LossGuard(self.trend, strict), strict, last_touch=self.clock(), note=note or "")
        if number is not None:   # views key trials by number; an unnumbered baseline gets one row, at its end
            self._emit(TrialEvent(number=number, toggles=dataclasses.asdict(toggles), status="running",
                                  tokens_per_s=None, spread=None, peak_mem=None, reason="", kind=kind,
                                  source=source if kind == "trial" else kind))
        self._emit(self.tuner_event())
        return action

    def _recipe(self) -> Toggles:
        """A known-good starting point for the device (clamped into the space)."""
        choices = self.space.choices
        t = capabilities.recipe(self.base, self.dev, choices["precision"])
        mbs = [m for m in choices["micro_batch"] if isinstance(m, int) and (self.max_mb is None or m <= self.max_mb)]
        if mbs:
            t.micro_batch = max(mbs)
        return self.space.clamp(t)

    def _memory_recipe(self) -> Toggles:
        """A first guess for a memory-constrained run: the whole per-rank batch (or the largest micro-batch in
        the space) with every memory saver in the space on: activation checkpointing, the smallest AdamW
        variant (its moments carry over; Adafactor is left to the sampler) and the most quantized base."""
        choices = self.space.choices
        t = dataclasses.replace(self.base)
        if True in choices["activation_checkpointing"]:
            t.activation_checkpointing = True
        adam = [v for v in choices["optimizer"] if capabilities.optimizer_state_carries(self.base.optimizer, v)]
        if adam:
            t.optimizer = min(adam, key=lambda v: capabilities.OPTIMIZER_STATE_BYTES[v])
        t.quantize_base = min(choices["quantize_base"], key=lambda v: capabilities.BASE_BYTES[v])
        mbs = [m for m in choices["micro_batch"] if isinstance(m, int)]
        if mbs:
            t.micro_batch = max(mbs)
        return self.space.clamp(t)

    def _trial_estimate(self) -> float:
        durations = [r["duration_s"] for r in self.results if r["kind"] != "baseline" and r.get("ran", True)]
        if durations:
            return float(median(durations))
        base = self.baseline["duration_s"] if self.baseline else self.measure_kw["max_seconds"] / 2
        return base + self.default_restart_s

    def _next_trial(self) -> RunTrial | None:
        if not self._warm_started:
            self._warm_started = True
            starts = [(self.base, "current"), (self._recipe(), "recipe")]
            if self.space.memory:
                starts.append((self._memory_recipe(), "memory"))
            self.study.warm_start(starts)
        for _ in range(200):
            if self.trials_run >= self.max_trials:
                self.stop_note = f"ran the maximum of {self.max_trials} trials"
                return None
            est = self._trial_estimate()
            if not self.budget.can_afford(est * (1 + self.reserve_trials) + self.switch_reserve_s):
                self.stop_note = f"budget: {self.budget.left():.0f}s left, a trial takes about {est:.0f}s"
                return None
            p = self.study.ask()
            if p is None:
                self.stop_note = "every configuration in the space has been measured"
                return None
            why = self._predicted_oom(p.toggles)
            if why:
                self.study.tell_infeasible(p, "oom", why, extra={"predicted": True})
                self.screened += 1
                self._finish_event(p.number, "trial", p.toggles, "infeasible", None, why, 0.0, ran=False,
                                   source=p.source)
                continue
            bad = capabilities.unsupported(p.toggles, self.dev, self.space.per_rank)
            if bad:          # a combination the trainer would refuse (a CUDA-graph compile mode with accumulation)
                why = f"{bad[0]}={getattr(p.toggles, bad[0])}: {bad[1]}"
                self.study.tell_infeasible(p, "compile" if bad[0] == "compile" else "crash", why,
                                           extra={"predicted": True})
                self.screened += 1
                self._finish_event(p.number, "trial", p.toggles, "infeasible", None, why, 0.0, ran=False,
                                   source=p.source)
                continue
            if p.toggles.compile in self.slow_compile:
                why = (f"compile={p.toggles.compile} did not finish warming up within a trial's "
                       f"{self.trial_timeout_s:.0f} s earlier in this run: not worth this budget")
                self.study.tell_pruned(p, None, why, extra={"screened": True})
                self.screened += 1
                self._finish_event(p.number, "trial", p.toggles, "pruned", None, why, 0.0, ran=False,
                                   source=p.source)
                continue
            self.trials_run += 1
            return self._start("trial", p.toggles, p, source=p.source)  # type: ignore[return-value]
        self.stop_note = "the sampler keeps proposing configurations that cannot fit"
        return None

    def _predicted_oom(self, t: Toggles) -> str | None:
        mb = t.micro_batch_int()
        if self.max_mb is None or mb is None or t.activation_checkpointing:
            return None
        if capabilities.saves_memory(t, self.cfg.toggles):
            return None            # less optimizer state or a quantized base: the micro-batch may fit, try it
        bytes_of = capabilities.activation_bytes
        narrower = bytes_of(t.precision) < bytes_of(self.cfg.toggles.precision)
        limit = self.max_mb * (2 if narrower else 1)
        if mb > limit:
            return (f"predicted OOM: micro-batch {mb} > {limit} (largest that fits with the starting toggles: "
                    f"{self.max_mb}{', x2 for the narrower precision' if narrower else ''}) "
                    "without activation checkpointing")
        return None

    def _next_remeasure(self) -> Remeasure | None:
        if self._remeasure_plan is None:
            top = top_candidates(self.study, self.remeasure_top) if self.remeasure_top > 0 else []
            plan = [c for c in top if c.toggles != self.base]
            fresh = len(top) >= 2 and top[0].run == self.study.run_id and clearly_better(top[0], top[1])
            if len(top) < 2 and top and top[0].run == self.study.run_id:
                fresh = True
            self._remeasure_plan = [] if fresh else sorted(plan, key=lambda c: c.tokens_per_s)
        while self._remeasure_plan:
            c = self._remeasure_plan.pop(0)
            if not self.budget.can_afford(self._trial_estimate() + self.switch_reserve_s):
                self._remeasure_plan = []
                break
            return self._start("remeasure", c.toggles, None, number=c.number)  # type: ignore[return-value]
        return None

    def _best_this_run(self) -> float | None:
        vals = [r["tokens_per_s"] for r in self.results
                if r["status"] in ("ok", "cut") and r.get("tokens_per_s") is not None]
        return max(vals) if vals else None

    # --- finishing a trial ------------------------------------------------------------
    def finish_trial(self, outcome: str = "ok", reason: str = "",
                     rollback: dict[str, Any] | None = None) -> TrialEvent:
        """Record the active trial: "ok" (healthy, steps kept) or a failure kind (rolled back; `rollback`
        says to where, for the event). "ok" with `rollback`: healthy and measured, but rolled back as its
        action asked (`keep_steps` False). Returns the `trial` event (also queued for drain_events)."""
        a = self._active
        if a is None:
            raise RuntimeError("finish_trial without a running trial")
        if outcome != "ok" and outcome not in FAILURES:
            raise ValueError(f"outcome {outcome!r} is not ok or one of {', '.join(FAILURES)}")
        self._active = None
        if a.kind == "baseline":
            self.phase = "trials"
        duration = self.clock() - a.start
        m = a.measure
        summary = m.summary(energy=self.energy)
        if a.oom_mem is not None:    # what ran out of memory had reached at least this: the trial's peak
            summary["peak_mem"] = max(summary.get("peak_mem") or 0, a.oom_mem)
        overhead = self._overhead(a)
        extra = {"duration_s": round(duration, 3), "overhead_s": overhead, "kind_of_run": a.kind}
        if outcome == "ok" and a.failure:
            outcome, reason = a.failure[0], reason or a.failure[1]
        if outcome != "ok":
            reason = _noted(reason or (a.failure[1] if a.failure else outcome), a.note)
            self.running = None
            self.rolled_back_s += duration
            if a.kind == "trial":
                self.study.tell_infeasible(a.proposal, outcome, reason, summary, extra)
            elif a.kind == "remeasure":
                self.study.record_remeasure(a.number, summary, status="infeasible", reason=f"{outcome}: {reason}")
            else:
                self.baseline = None
                self.stop_note = f"the starting configuration failed: {reason}"
                if outcome == "oom":
                    self._widen_for_memory(f"the starting configuration ran out of memory ({reason})")
            return self._finish_event(a.number, a.kind, a.toggles, "infeasible", summary, f"{outcome}: {reason}",
                                      duration, failure=outcome, overhead_s=overhead, source=_source(a),
                                      rollback=rollback)
        if rollback is not None:                          # measured, then rolled back (keep_steps False)
            self.running = None
            self.rolled_back_s += duration
            a.note = _noted(a.note, f"measured, then rolled back to the pre-trial checkpoint so the run keeps "
                                    f"its {self.state_optimizer} state")
        else:
            self.running = a.toggles
            self.state_optimizer = a.toggles.optimizer   # its steps (and checkpoints) are kept
            self.kept_tokens += m.steps * self.tokens_per_step
        if not a.strict and rollback is None:
            for step, loss in a.losses:
                self.trend.add(step, loss)
        est, spread = m.estimate
        n = len(m.kept)
        if a.stop == "prune":
            _, hi = m.interval()
            status = "pruned"
            if math.isfinite(hi):
                reason = reason or (f"slower than the best: at most {hi:.0f} tokens/s "
                                    f"(CI upper end) vs {self._best_this_run():.0f}")
            else:
                fastest = max((s.tokens_per_s for s in m.samples[m.skip:]), default=0.0)
                reason = reason or (f"far slower than the best: no step above {fastest:.0f} tokens/s "
                                    f"vs {self._best_this_run():.0f}")
        elif n >= 3 and math.isfinite(est):
            status = "ok" if m.stable else "cut"
            reason = reason or m.stop_words(m.done_reason or a.stop)
        else:
            status = "pruned"
            reason = reason or f"no steady measurement: {m.stop_words(m.done_reason or a.stop)}"
            if a.stop == "timeout" and not m.kept and a.toggles.compile != "off":
                self.slow_compile.add(a.toggles.compile)   # still compiling: screen this mode for the run
        reason = _noted(reason, a.note)
        if a.kind == "trial":
            if status == "pruned":
                self.study.tell_pruned(a.proposal, summary, reason, extra)
            else:
                self.study.tell_ok(a.proposal, summary, status, reason, extra)
        elif a.kind == "remeasure":
            ok = status in ("ok", "cut")
            self.study.record_remeasure(a.number, summary, status="ok" if ok else "pruned", reason=reason)
            pooled = next((c for c in self.study.candidates() if c.number == a.number), None)
            if pooled is not None:   # the event updates the trial's row: show the pooled estimate
                summary = {**summary, "tokens_per_s": pooled.tokens_per_s, "spread": pooled.spread,
                           "remeasure_tokens_per_s": est, "remeasure_spread": spread}
        else:
            if status in ("ok", "cut"):
                self.baseline = {**summary, "duration_s": duration}
                self.baseline_number = self.study.record(a.toggles, summary, "baseline", status, reason,
                                                         {**extra, "overhead_s": None})
                a.number = self.baseline_number
                self.study.set_attr("baseline", {"run": self.study.run_id, "tokens_per_s": est, "spread": spread,
                                                 "energy_per_token": summary.get("energy_per_token"),
                                                 "toggles": dataclasses.asdict(a.toggles)})
            else:
                self.baseline = None
                self.stop_note = "the starting configuration gave no steady measurement"
        return self._finish_event(a.number, a.kind, a.toggles, status, summary, reason, duration,
                                  overhead_s=overhead, source=_source(a), rollback=rollback)

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
        self._set_phase("done")

    def stop_early(self, reason: str = "stopped by the user", rolled_back: bool = False) -> Apply | Done:
        """Tuning is stopped before its end (the `t` key) while the run goes on: the running trial, if any,
        is abandoned (FAIL) with its steps kept (`rolled_back`: the session rolled it back instead, as it does
        a trial whose action has `keep_steps` False), and the decision is made on what was measured so far
        (the same rules: apply only a significantly faster setting whose saving pays for the switch)."""
        if self._final is not None:
            return self._final
        a = self._active
        self._active = None
        if a is not None:
            if a.proposal is not None:
                self.study.tell_failed(a.proposal, reason)
            if rolled_back:
                self.running = None
                self.rolled_back_s += self.clock() - a.start
            else:
                self.kept_tokens += a.measure.steps * self.tokens_per_step
                self.state_optimizer = a.toggles.optimizer
            if a.kind == "baseline":
                self.phase = "trials"
        if self.baseline is None:
            self.stop_note = f"{reason} before the starting configuration was measured"
            return self._done(f"{reason}; nothing measured to decide on", self.base)
        self.stop_note = reason
        return self._decide(prefix=f"{reason}: ")

    def _finish_event(self, number: int | None, kind: str, toggles: Toggles, status: str,
                      summary: dict[str, Any] | None, reason: str, duration: float, *, ran: bool = True,
                      failure: str | None = None, overhead_s: float | None = None,
                      source: str | None = None, rollback: dict[str, Any] | None = None) -> TrialEvent:
        s = summary or {}
        ev = TrialEvent(number=number, toggles=dataclasses.asdict(toggles), status=status,
                        tokens_per_s=s.get("tokens_per_s"), spread=s.get("spread"), peak_mem=s.get("peak_mem"),
                        energy_per_token=s.get("energy_per_token"), reason=reason, kind=kind,
                        source=source or (kind if kind != "trial" else None), duration_s=round(duration, 3),
                        remeasure_tokens_per_s=s.get("remeasure_tokens_per_s"),
                        remeasure_spread=s.get("remeasure_spread"), rollback=rollback)
        fields = {f.name: getattr(ev, f.name) for f in dataclasses.fields(ev) if f.name != "extra"}
        self.results.append({**fields, "duration_s": duration, "ran": ran, "failure": failure,
                             "overhead_s": overhead_s, "summary": s})
        self._emit(ev)
        self._emit(self.tuner_event())
        return ev

    def _overhead(self, a: _Active) -> float | None:
        """Seconds the restart/compile cost beyond the steps' own time, up to the first kept sample."""
        m = a.measure
        if not m.warmed_up or not m.kept or not a.arrivals:
            return None
        idx = m.warmup_samples
        steps_before = m.kept[0].step - m.samples[0].step + 1
        step_s = m.step_ms / 1000.0
        return round(max(0.0, (a.arrivals[idx] - a.start) - steps_before * step_s), 3)

    # --- deciding -------------------------------------------------------------------
    def _restart_cost(self, toggles: Toggles, cand: Candidate | None) -> float:
        if toggles == self.running:
            return 0.0
        overheads = [r["overhead_s"] for r in self.results
                     if r["overhead_s"] is not None and Toggles(**r["toggles"]) == toggles]
        if not overheads and cand is not None and cand.overhead_s is not None:
            overheads = [cand.overhead_s]
        if not overheads:
            overheads = [r["overhead_s"] for r in self.results
                         if r["overhead_s"] is not None and r["kind"] != "baseline"
                         and r["toggles"]["compile"] == toggles.compile]
        restart = median(overheads) if overheads else self.default_restart_s
        return restart + self.checkpoint_s

    def _decide(self, prefix: str = "") -> Apply | Done:
        self._prefix = prefix
        self._set_phase("decide")
        base = self.base
        cands = self.study.candidates()
        if not cands:
            return self._done(f"no feasible configuration was measured ({self.stop_note or 'no trials'})", base)
        best = cands[0]
        base_c = next((c for c in cands if c.toggles == base), None)
        base_tps = self.baseline["tokens_per_s"] if self.baseline else (base_c.tokens_per_s if base_c else None)
        if best.toggles == base:
            return self._done("the starting configuration is the fastest measured", base)
        remaining = max(0, self.cfg.optim.max_steps - self.last_step)
        cost = max(0.0, self._restart_cost(best.toggles, best) - self._restart_cost(base, base_c))
        if base_tps is None:
            saving = remaining * self.tokens_per_step / best.tokens_per_s if best.tokens_per_s > 0 else 0.0
            decision = Decision(True, saving, cost, "the starting configuration has no measurement (it failed)")
        elif not significantly_faster(best.lo, base_tps):
            return self._done(f"the best ({best.tokens_per_s:.0f} tokens/s, CI from {best.lo:.0f}) is not "
                              f"significantly faster than the start ({base_tps:.0f})", base)
        else:
            decision = switch_pays(base_tps, best.tokens_per_s, remaining, self.tokens_per_step, cost)
        self.decision = decision
        if not decision.apply:
            return self._done(decision.reason, base)
        self.applied = best.toggles
        restart = best.toggles != self.running
        self._emit(ApplyEvent(toggles=dataclasses.asdict(best.toggles), decision=decision.to_dict(),
                              number=best.number, tokens_per_s=best.tokens_per_s, baseline_tokens_per_s=base_tps,
                              step=self.last_step))
        self._final = Done(f"{prefix}applied trial {best.number}: {decision.reason}", best.toggles, restart=False)
        self.phase = "done"
        self._emit(self.tuner_event())
        return Apply(best.toggles, decision, restart, number=best.number)

    def _done(self, reason: str, toggles: Toggles) -> Done:
        reason = self._prefix + reason
        self._final = Done(reason, toggles, restart=toggles != self.running)
        self._set_phase("done")
        return self._final

    # --- report ------------------------------------------------------------------------
    def report_info(self) -> dict[str, Any]:
        """What `tuner.report.write_report` needs besides the study: this run's baseline, decision, ledger."""
        cands = self.study.candidates()
        best = cands[0] if cands else None
        base_tps = self.baseline["tokens_per_s"] if self.baseline else None
        tuning_s = self.budget.elapsed()
        remaining = max(0, self.cfg.optim.max_steps - self.last_step)
        at_base_s = self.kept_tokens / base_tps if base_tps else None
        saved = None
        if self.decision is not None and self.decision.apply:
            saved = self.decision.expected_saving_s - self.decision.cost_s
        return {
            "run": self.study.run_id, "study": self.study.name, "key": self.study.key,
            "device": self.dev.to_dict(), "base": dataclasses.asdict(self.base),
            "baseline": {k: self.baseline.get(k) for k in ("tokens_per_s", "spread", "peak_mem", "energy_per_token",
                                                            "n", "steps")} if self.baseline else None,
            "baseline_number": self.baseline_number,
            "best": dataclasses.asdict(best.toggles) if best else None,
            "best_number": best.number if best else None,
            "best_tokens_per_s": best.tokens_per_s if best else None,
            "best_spread": best.spread if best else None,
            "applied": dataclasses.asdict(self.applied) if self.applied else None,
            "decision": self.decision.to_dict() if self.decision else None,
            "outcome": self._final.reason if self._final else self.stop_note,
            "stop_note": self.stop_note,
            "memory": ({"reason": self.space.memory,
                        "choices": {n: list(self.space.choices[n]) for n in MEMORY_SAVING}}
                       if self.space.memory else None),
            "results": [{k: v for k, v in r.items() if k not in ("summary",)} for r in self.results],
            "ledger": {
                "budget_s": self.budget.total_s, "tuning_s": tuning_s, "trials_run": self.trials_run,
                "screened": self.screened, "kept_tokens": self.kept_tokens,
                "rolled_back_s": self.rolled_back_s,
                "cost_s": (tuning_s - at_base_s) if at_base_s is not None else None,
                "remaining_steps": remaining, "tokens_per_step": self.tokens_per_step,
                "projected_saving_s": saved,
            },
        }


def reported_peak(memory: dict[str, Any] | None) -> int | None:
    """The peak bytes in an error event's memory figures (CUDA: allocated; CPU: resident), None if absent."""
    if not memory:
        return None
    peak = memory.get("allocated_peak") or memory.get("rss_peak")
    return int(peak) if isinstance(peak, (int, float)) and peak > 0 else None


def _noted(reason: str, note: str) -> str:
    """`reason; note`, or whichever of them is not empty."""
    return f"{reason}; {note}" if note and reason else (reason or note)


def _source(a: _Active) -> str:
    return a.action.source if isinstance(a.action, RunTrial) and a.kind == "trial" else a.kind
