"""Alerts: gptop notices when a run goes wrong, and when it stops going wrong.

`AlertMonitor` is fed every event the session sees (the trainer's, the device samples, gptop's own) and a
clock; it returns `AlertEvent`s for the session to publish (views, events.jsonl, notifications, metrics).
It is the core's, not a view's: the dashboard's banner, the headless line, `--json`, `gptop report` and
the end summary all show the same alerts. An alert is raised once and resolved once, whatever a rule sees
while it is open (`_raise`). The rules (docs/dashboard.md, "Alerts"):

- stall: no step for `stall_factor` times the recent median step time, and at least `stall_after_s`,
  while the trainer process is alive and has done a step (compilation and loading before the first step
  are startup, not a stall); a step about to checkpoint or evaluate gets the longest such pause seen so
  far three times over (at least CHECKPOINT_GRACE_S before the first). Says which ranks are behind and
  what each reported last. Resolved by the next step.
- loss spike: a logged loss more than `loss_spike_mads` scaled MADs above the median of the recent losses
  (robust to the loss's own noise, no fixed threshold), and at least MIN_SPIKE_RISE above it. Resolved
  when a loss is back under the line.
- NaN rollback: the trainer rolled back after a non-finite step. Resolved once a step with a finite loss
  goes past the step the run had reached.
- throughput drop: the median tokens/s over the last `throughput_after_s` seconds below
  (1 - `throughput_drop`) of the trainer process's steady rate before them, with the phase that grew.
  Resolved when it is back above (1 - `throughput_drop` / 2) of it.
- device trouble (NVML, per GPU of the run): clocks held down by heat, the hardware or a power brake for
  `throttle_after_s` (a power cap is a GPU working at its limit, not trouble); new uncorrected ECC
  errors; critical Xid errors (the application Xids 13, 31, 43 and 45, a program that faulted or was killed,
  are a warning); a GPU that fell off the bus.

Thresholds are declared once (gptop.alert_options): defaults, ranges and help, from which the command line's
`--alert-*` flags are made and checked at entry (exit 2 naming the flag).
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from trainer.contract.device import gpu_key
from trainer.contract.events import (
    AlertEvent,
    AlertKind,
    CheckpointEvent,
    DeviceEvent,
    DoneEvent,
    ErrorEvent,
    EvalEvent,
    Event,
    HelloEvent,
    PhaseEvent,
    ProgressEvent,
    Severity,
    StepEvent,
    WarningEvent,
)
from trainer.contract.states import WarningKind

from .alert_options import (
    LOSS_WINDOW,
    AlertOptions,
    add_alert_arguments,
    alert_options,
)
from .alert_rules import (
    APPLICATION_XIDS,
    BAD_CLOCK_REASONS,
    CHECKPOINT_GRACE_S,
    LOSS_RECOMPUTE,
    MAD_SCALE,
    MIN_LOSSES,
    MIN_RATE_EVENTS,
    MIN_SPIKE_RISE,
    MIN_STEPS,
    RATE_CHECKS,
    RATE_HISTORY,
    STEP_WINDOW,
    median,
    phase_means,
    positive_int,
)

__all__ = ["AlertMonitor", "AlertOptions", "add_alert_arguments", "alert_options"]


@dataclass
class _Rank:
    """What one rank said last: its step and the event it sent last (its "phase" as far as events tell)."""

    step: int | None = None
    what: str = "nothing yet"
    at: float | None = None  # receipt time


@dataclass
class _Gpu:
    ecc_base: int | None = None
    throttled_since: float | None = None
    clear_samples: int = 0


class AlertMonitor:
    """Turns a run's events into alerts. Thread-safe: events come from the trainer's and the sampler's threads.

    `alive()` says whether the trainer process runs (no stall without one); `clock` is the receipt clock the
    stall is judged on (the trainer's own event times can come from another machine's clock)."""

    def __init__(
        self,
        options: AlertOptions | None = None,
        *,
        alive: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.time,
        node: str | None = None,
    ) -> None:
        self.options = options or AlertOptions()
        self.alive = alive
        self.clock = clock
        self.node = node
        self._lock = threading.Lock()
        self._open: dict[str, AlertEvent] = {}  # key -> the raise (with its notes), while not resolved
        self._serial = 0
        self._gptop = secrets.token_hex(3)  # in the ids: a resumed run's next gptop raises ids of its own
        self._step: int | None = None  # the run's latest step
        self._reached: int = 0  # the highest step the run has reached
        # stall
        self._stepped = False  # this trainer process has done a step
        self._ended = False  # it said done or failed
        self._last_progress: float | None = None  # receipt time of its latest step
        self._last_step_time: tuple[float, int] | None = None  # (event time, step) of the latest progress
        self._intervals: deque[float] = deque(maxlen=STEP_WINDOW)  # seconds per step
        self._slowest_pause = 0.0  # longest checkpoint or eval seen, seconds
        self._checkpoint_every: int | None = None
        self._eval_every: int | None = None
        self._ranks: dict[int, _Rank] = {}
        # loss
        self._primary: int | None = None
        self._losses: deque[float] = deque(maxlen=LOSS_WINDOW)
        self._loss_stats: tuple[float, float] | None = None  # (median, MAD), recomputed every LOSS_RECOMPUTE
        self._losses_since = 0
        # throughput: (event time, tokens/s, phases) of this process's steady step events
        self._rates: deque[tuple[float, float, dict[str, float]]] = deque(maxlen=RATE_HISTORY)
        self._warm = True
        self._frozen_base: tuple[float, dict[str, float]] | None = None
        self._rate_checked = float("-inf")
        # devices
        self._gpus: dict[str, _Gpu] = {}
        self._run_gpus: set[str] | None = None

    # --- feeding ----------------------------------------------------------------------------------------------
    def on_event(self, event: Event) -> list[AlertEvent]:
        """Fold one event in; the alerts it raises or resolves (device samples also run the clock's checks)."""
        if isinstance(event, AlertEvent) or not self.options.enabled:
            return []
        now = self.clock()
        out: list[AlertEvent] = []
        with self._lock:
            self._rank_saw(event, now)
            if isinstance(event, HelloEvent):
                self._on_hello(event)
            elif isinstance(event, (ProgressEvent, StepEvent)):
                self._on_progress(event, now, out)
                if isinstance(event, StepEvent):
                    self._on_step(event, out)
            elif isinstance(event, (CheckpointEvent, EvalEvent)):
                if event.seconds is not None:
                    self._slowest_pause = max(self._slowest_pause, event.seconds)
            elif isinstance(event, WarningEvent) and event.kind == WarningKind.NAN_ROLLBACK:
                self._on_rollback(event, out)
            elif isinstance(event, (DoneEvent, ErrorEvent)):
                self._ended = True
            elif isinstance(event, DeviceEvent):
                self._on_device(event, now, out)
                self._check_stall(now, out)
        return out

    def check(self) -> list[AlertEvent]:
        """The clock's checks (a stall) without an event: for a caller with a timer of its own."""
        if not self.options.enabled:
            return []
        out: list[AlertEvent] = []
        with self._lock:
            self._check_stall(self.clock(), out)
        return out

    def active(self) -> list[AlertEvent]:
        """The alerts raised and not resolved, oldest first."""
        with self._lock:
            return list(self._open.values())

    # --- raising and resolving --------------------------------------------------------------------------------
    def _raise(
        self,
        out: list[AlertEvent],
        kind: AlertKind,
        severity: Severity,
        message: str,
        *,
        key: str | None = None,
        **kw: Any,
    ) -> None:
        """Raise an alert of `kind`, one open per `key` (default the kind). While it is open a rule that still
        sees the trouble raises nothing more: one raise, one resolution, the raise's step and time kept (what
        the rule sees meanwhile goes to `_note`, and out with the resolution)."""
        key = key or kind.value
        if key in self._open:
            self._note(key, **(kw.get("figures") or {}))
            return
        self._serial += 1
        alert = AlertEvent(
            time=self.clock(),
            id=f"{key}-{self._gptop}-{self._serial}",
            kind=kind,
            severity=severity,
            message=message,
            step=self._step,
            node=kw.pop("node", self.node),
            **kw,
        )
        self._open[key] = alert
        out.append(alert)

    def _note(self, key: str, **figures: Any) -> None:
        """Figures of an open alert seen after its raise (a spike's peak, another rollback, more ECC errors):
        kept in it, not sent; its resolution carries them."""
        old = self._open.get(key)
        if old is not None and figures:
            self._open[key] = dataclasses.replace(old, figures={**old.figures, **figures})

    def _resolve(self, out: list[AlertEvent], key: str, message: str, **figures: Any) -> None:
        old = self._open.pop(key, None)
        if old is None:
            return
        out.append(
            AlertEvent(
                time=self.clock(),
                id=old.id,
                kind=old.kind,
                severity=old.severity,
                message=message,
                resolved=True,
                step=self._step,
                figures={**old.figures, **figures},
                ranks=old.ranks,
                node=old.node,
                device=old.device,
            )
        )

    def is_open(self, key: str) -> bool:
        with self._lock:
            return key in self._open

    # --- the rules --------------------------------------------------------------------------------------------
    def _rank_saw(self, event: Event, now: float) -> None:
        if isinstance(event, DeviceEvent):
            return
        r = self._ranks.setdefault(event.rank, _Rank())
        if isinstance(event, (StepEvent, ProgressEvent)):
            r.step = event.step  # a rollback lowers it: the latest is what the rank is at
            r.what = f"step {event.step}"
        elif isinstance(event, PhaseEvent):
            r.what = f"startup: {event.message}"
        elif isinstance(event, CheckpointEvent):
            r.what = f"checkpoint of step {event.step}"
        elif isinstance(event, EvalEvent):
            r.what = f"eval at step {event.step}"
        else:
            r.what = f"{event.type} event"
        r.at = now

    def _on_hello(self, e: HelloEvent) -> None:
        if e.early:  # a new trainer process: not judged until its first step
            self._stepped = False
            self._ended = False
            self._last_progress = None
            self._last_step_time = None
            return
        cfg = e.config
        self._checkpoint_every = positive_int((cfg.get("checkpoint") or {}).get("checkpoint_every"))
        self._eval_every = positive_int((cfg.get("log") or {}).get("eval_every"))
        if e.gpus:
            self._run_gpus = set(e.gpus)
        self._rates.clear()  # new toggles, a new steady rate
        self._warm = True
        self._frozen_base = None
        self._rate_checked = float("-inf")

    def _on_progress(self, e: ProgressEvent | StepEvent, now: float, out: list[AlertEvent]) -> None:
        if self._primary is None or e.rank < self._primary:
            self._primary = e.rank
        if e.rank != self._primary:
            return
        step = e.step
        if self._last_step_time is not None:
            t0, s0 = self._last_step_time
            if step > s0 and e.time > t0:
                self._intervals.append((e.time - t0) / (step - s0))
        if self._last_step_time is None or step != self._last_step_time[1]:
            self._last_step_time = (e.time, step)
        self._step = step
        self._reached = max(self._reached, step)
        self._stepped = True
        stalled = self._open.get(AlertKind.STALL.value)
        if stalled is not None and self._last_progress is not None:
            quiet = now - self._last_progress
            self._resolve(
                out,
                AlertKind.STALL.value,
                f"progress again: step {step} after {quiet:.0f} s without one",
                stalled_s=round(quiet, 1),
            )
        self._last_progress = now

    def stall_limit(self) -> float | None:
        """Seconds without a step after which the run counts as stalled now; None before it can be judged."""
        o = self.options
        if len(self._intervals) < MIN_STEPS:
            return None
        limit = max(o.stall_after_s, o.stall_factor * median(self._intervals))
        nxt = (self._step or 0) + 1
        if any(every and nxt % every == 0 for every in (self._checkpoint_every, self._eval_every)):
            limit += max(CHECKPOINT_GRACE_S, 3 * self._slowest_pause)
        return limit

    def _check_stall(self, now: float, out: list[AlertEvent]) -> None:
        if not self._stepped or self._ended or self._last_progress is None or AlertKind.STALL.value in self._open:
            return
        limit = self.stall_limit()
        if limit is None or now - self._last_progress < limit or not self.alive():
            return
        quiet = now - self._last_progress
        typical = median(self._intervals)  # stall_limit is not None: MIN_STEPS intervals at least
        msg = (
            f"no step for {quiet:.0f} s (last: step {self._step}; recent median {typical:.3g} s per step, "
            f"alert after {limit:.0f} s); the trainer process is alive"
        )
        behind: list[int] = []
        steps = {r: x.step for r, x in self._ranks.items() if x.step is not None}
        if len(steps) > 1:
            top = max(steps.values())
            behind = sorted(r for r, s in steps.items() if s < top)
            parts = []
            for r in sorted(self._ranks):
                x = self._ranks[r]
                ago = f", {now - x.at:.0f} s ago" if x.at is not None else ""
                parts.append(f"rank {r}{' (behind)' if r in behind else ''}: {x.what}{ago}")
            msg += "; " + "; ".join(parts)
        self._raise(
            out,
            AlertKind.STALL,
            Severity.CRITICAL,
            msg,
            ranks=behind or None,
            figures={
                "seconds": round(quiet, 1),
                "median_step_s": typical,
                "limit_s": round(limit, 1),
                "last_step": self._step,
                "rank_steps": {str(r): s for r, s in sorted(steps.items())} if len(steps) > 1 else None,
            },
        )

    def _on_step(self, e: StepEvent, out: list[AlertEvent]) -> None:
        if e.rank != self._primary:
            return
        self._loss(e, out)
        nan = self._open.get(AlertKind.NAN_ROLLBACK.value)
        if nan is not None and e.loss is not None and e.step > (nan.figures.get("reached") or 0):
            again = nan.figures.get("rollbacks") or 1
            self._resolve(
                out,
                AlertKind.NAN_ROLLBACK.value,
                f"past the rollback: step {e.step} with a finite loss ({e.loss:.4g})"
                + (f" after {again} rollbacks" if again > 1 else ""),
            )
        self._throughput(e, out)

    def _loss(self, e: StepEvent, out: list[AlertEvent]) -> None:
        loss = e.loss
        if loss is None:
            return
        key = AlertKind.LOSS_SPIKE.value
        if len(self._losses) >= MIN_LOSSES:
            if self._loss_stats is None or self._losses_since >= LOSS_RECOMPUTE:
                m = median(self._losses)
                self._loss_stats = (m, median(abs(x - m) for x in self._losses))
                self._losses_since = 0
            med, mad = self._loss_stats
            scale = MAD_SCALE * mad
            line = med + max(self.options.loss_spike_mads * scale, MIN_SPIKE_RISE * abs(med))
            spike = self._open.get(key)
            if loss <= line:
                if spike is not None:
                    f = spike.figures
                    self._resolve(
                        out,
                        key,
                        f"loss back to {loss:.4g} at step {e.step} (median {med:.4g}); the spike began at step "
                        f"{f['step']} and peaked at {f['peak_loss']:.4g} at step {f['peak_step']}",
                        back_loss=loss,
                    )
            elif spike is not None:  # still above the line: the same spike
                if loss > spike.figures["peak_loss"]:
                    self._note(key, peak_loss=loss, peak_step=e.step)
            else:
                mads = (loss - med) / scale if scale > 0 else float("inf")
                self._raise(
                    out,
                    AlertKind.LOSS_SPIKE,
                    Severity.WARNING,
                    f"loss {loss:.4g} at step {e.step}: {'%.0f' % mads if mads != float('inf') else 'many'} "
                    f"MADs above the median {med:.4g} of the last {len(self._losses)} logged losses "
                    f"(alert above {line:.4g})",
                    figures={
                        "loss": loss,
                        "median": med,
                        "mad": mad,
                        "line": line,
                        "step": e.step,
                        "peak_loss": loss,  # the spike's highest loss so far (`_note` moves it)
                        "peak_step": e.step,
                    },
                )
        self._losses.append(loss)
        self._losses_since += 1

    def _on_rollback(self, e: WarningEvent, out: list[AlertEvent]) -> None:
        key = AlertKind.NAN_ROLLBACK.value
        raised = self._open.get(key)
        rollbacks = 1 if raised is None else (raised.figures.get("rollbacks") or 1) + 1
        figures = {
            "reached": self._reached,
            "rolled_back_to": e.step,
            "lr_scale": e.lr_scale,
            "skipped_batches": len(e.skip_batches or []),
            "rollbacks": rollbacks,  # while it is open, another rollback is counted here, not raised again
        }
        self._raise(out, AlertKind.NAN_ROLLBACK, Severity.WARNING, f"non-finite step: {e.message}", figures=figures)

    def _throughput(self, e: StepEvent, out: list[AlertEvent]) -> None:
        if self._warm:  # a process's first step event carries compilation and warm-up
            self._warm = False
            return
        if e.tokens_per_s is None:
            return
        phases = {p: v for p, v in (e.phases_ms or {}).items() if v is not None}
        self._rates.append((e.time, e.tokens_per_s, phases))
        o = self.options
        window = o.throughput_after_s
        t_end = e.time
        if t_end - self._rate_checked < window / RATE_CHECKS:
            return  # judged a few dozen times per window, not per step event
        self._rate_checked = t_end
        recent = [x for x in self._rates if x[0] > t_end - window]
        older = [x for x in self._rates if x[0] <= t_end - window]
        if len(recent) < MIN_RATE_EVENTS or recent[-1][0] - recent[0][0] < 0.8 * window:
            return
        key = AlertKind.THROUGHPUT_DROP.value
        if self._frozen_base is not None:
            base, base_phases = self._frozen_base
        else:
            if len(older) < 2 * MIN_RATE_EVENTS or older[-1][0] - older[0][0] < window:
                return
            base = median(x[1] for x in older)
            base_phases = phase_means(older)
        now_rate = median(x[1] for x in recent)
        if now_rate < (1 - o.throughput_drop) * base:
            if key not in self._open:
                recent_phases = phase_means(recent)
                grew = max(recent_phases, key=lambda p: recent_phases[p] - base_phases.get(p, 0.0), default=None)
                what = ""
                if grew is not None and recent_phases[grew] > base_phases.get(grew, 0.0):
                    what = (
                        f"; {grew} grew most ({base_phases.get(grew, 0.0):.0f} -> {recent_phases[grew]:.0f} ms "
                        "per step)"
                    )
                self._frozen_base = (base, base_phases)
                self._raise(
                    out,
                    AlertKind.THROUGHPUT_DROP,
                    Severity.WARNING,
                    f"{now_rate:,.0f} tokens/s over the last {window:.0f} s, {1 - now_rate / base:.0%} below "
                    f"the steady {base:,.0f}{what}",
                    figures={
                        "tokens_per_s": now_rate,
                        "steady_tokens_per_s": base,
                        "phase": grew,
                        "phases_ms": recent_phases,
                        "steady_phases_ms": base_phases,
                    },
                )
        elif key in self._open and now_rate >= (1 - o.throughput_drop / 2) * base:
            self._frozen_base = None
            self._resolve(
                out,
                key,
                f"throughput back to {now_rate:,.0f} tokens/s (steady {base:,.0f})",
                back_tokens_per_s=now_rate,
            )

    def _on_xids(self, out: list[AlertEvent], xids: list[int], name: str, where: str, tag: str) -> None:
        """Xid errors of one GPU: an application's (a program faulted or was killed) a warning, the rest critical."""
        for app in (False, True):
            codes = [x for x in xids if (x in APPLICATION_XIDS) == app]
            if not codes:
                continue
            key = f"{'xid_app' if app else 'xid'}:{tag}"
            old = self._open.get(key)
            seen = list((old.figures.get("xids") or []) if old is not None else []) + codes
            what = ", ".join(map(str, seen[-10:]))
            self._raise(
                out,
                AlertKind.XID,
                Severity.WARNING if app else Severity.CRITICAL,
                f"{where}: the driver reported Xid {what}, a program that faulted or was killed, not GPU hardware "
                f"trouble"
                if app
                else f"{where}: the driver reported Xid error(s) {what}",
                key=key,
                device=name,
                figures={"xids": seen[-50:]},
            )

    def _on_device(self, e: DeviceEvent, now: float, out: list[AlertEvent]) -> None:
        for g in e.devices:
            ident = gpu_key(g.uuid, g.pci_bus_id)
            if self._run_gpus and ident is not None and ident not in self._run_gpus:
                continue  # a neighbour's GPU: not this run's trouble
            name = f"gpu{g.index}"
            where = f"{name} ({g.name})" if g.name else name
            state = self._gpus.setdefault(name, _Gpu())
            tag = f"{self.node}:{name}" if self.node else name
            if g.lost:
                self._raise(
                    out,
                    AlertKind.GPU_LOST,
                    Severity.CRITICAL,
                    f"{where} fell off the bus (NVML: GPU is lost); the run cannot use it until the machine is reset",
                    key=f"gpu_lost:{tag}",
                    device=name,
                    figures={"index": g.index},
                )
                continue
            if g.ecc_uncorrected is not None:
                if state.ecc_base is None:
                    state.ecc_base = g.ecc_uncorrected
                elif g.ecc_uncorrected > state.ecc_base:
                    self._raise(
                        out,
                        AlertKind.ECC,
                        Severity.CRITICAL,
                        f"{where}: {g.ecc_uncorrected - state.ecc_base} new uncorrected ECC error(s) during "
                        f"the run ({g.ecc_uncorrected} since the driver loaded)",
                        key=f"ecc:{tag}",
                        device=name,
                        figures={"new": g.ecc_uncorrected - state.ecc_base, "total": g.ecc_uncorrected},
                    )
            if g.xids:
                self._on_xids(out, g.xids, name, where, tag)
            bad = [r for r in (g.clock_reasons or []) if r in BAD_CLOCK_REASONS]
            key = f"throttle:{tag}"
            if bad:
                state.clear_samples = 0
                if state.throttled_since is None:
                    state.throttled_since = now
                if key not in self._open and now - state.throttled_since >= self.options.throttle_after_s:
                    clock = (
                        f" (SM clock {g.sm_clock_mhz:.0f} of {g.sm_clock_max_mhz:.0f} MHz)"
                        if g.sm_clock_mhz is not None and g.sm_clock_max_mhz
                        else ""
                    )
                    self._raise(
                        out,
                        AlertKind.THROTTLE,
                        Severity.WARNING,
                        f"{where} throttled for {now - state.throttled_since:.0f} s: {', '.join(bad)}{clock}"
                        + (f", {g.temp_c:.0f} °C" if g.temp_c is not None else ""),
                        key=key,
                        device=name,
                        figures={
                            "reasons": bad,
                            "sm_clock_mhz": g.sm_clock_mhz,
                            "sm_clock_max_mhz": g.sm_clock_max_mhz,
                            "temp_c": g.temp_c,
                        },
                    )
            else:
                state.clear_samples += 1
                if state.clear_samples >= 3:
                    state.throttled_since = None
                    self._resolve(out, key, f"{where}: clocks no longer held down")
