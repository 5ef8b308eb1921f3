"""The figures views read off a RunState's step and device records, computed on read under its lock: the step
window and its phases, the ranks' spread, the experts' load, energy per token and the steady medians."""

from __future__ import annotations

import threading
from typing import Any

from gptop.energy import Energy
from trainer.contract.events import CpuReading, GpuReading, HelloEvent, StepEvent

from . import formatting, hints, statistics
from .histories import DeviceHistory
from .statistics import Spread, StepTiming, StepWindow


class StepFigures:
    """Part of `RunState` (gptop.state.reducer), which keeps the records these read."""

    lock: threading.RLock
    phase_window: int
    config: dict[str, dict[str, Any]]
    hello: HelloEvent | None
    last_step: StepEvent | None
    live_step: tuple[float, int, int] | None
    ranks: dict[int, StepEvent]
    expert_load: list[list[float]] | None
    devices: DeviceHistory
    device_latest: dict[str, GpuReading | CpuReading]
    _timing: StepTiming
    _progress_ms: float | None

    # --- reading: the step breakdown ----------------------------------------
    def window(self, n: int | None = None) -> StepWindow | None:
        """The step figures over the last `n` step events (default `phase_window`) that are not a process's
        first (those only when there is nothing else yet): see StepWindow. None before the first step event."""
        with self.lock:
            rows, warm_up = self._timing.window_rows(n or self.phase_window)
        return statistics.step_window(rows, warm_up)

    def phase_means(self, n: int | None = None) -> dict[str, float]:
        """Mean ms per phase and step over the window (`window`); absent phases omitted."""
        w = self.window(n)
        return dict(w.phases_ms) if w is not None else {}

    def mean_step_ms(self, n: int | None = None) -> float | None:
        """Mean step time over the window (`window`), the same steps as `phase_means`."""
        w = self.window(n)
        return w.step_ms if w is not None else None

    def mean_gpu_idle_ms(self, n: int | None = None) -> float | None:
        w = self.window(n)
        return w.gpu_idle_ms if w is not None else None

    def first_figures_at(self) -> int | None:
        """Between a run's first step and its first step event (`--log-every`): the step at which the panels'
        first figures come (the next multiple of the log interval); None when there are figures already, no
        step yet, or no known log interval."""
        with self.lock:
            if self.last_step is not None or self.live_step is None:
                return None
            every = self.hello.log_every if self.hello is not None else None
            step = self.live_step[1]
        return statistics.first_figures_at(step, every)

    def last_step_ms(self) -> float | None:
        """The latest progress event's step time (the host's, between step boundaries), or None."""
        with self.lock:
            return self._progress_ms

    def phase_percent(self, n: int | None = None) -> dict[str, float]:
        """Each phase as % of the mean step time (of the phases' sum when step_ms is missing)."""
        w = self.window(n)
        return w.phase_percent() if w is not None else {}

    def gpu_idle_percent(self, n: int | None = None) -> float | None:
        w = self.window(n)
        return w.gpu_idle_percent() if w is not None else None

    # --- reading: ranks, experts, energy ------------------------------------
    def rank_spread(self) -> dict[str, Spread]:
        """For step_ms and each phase: min/max/mean over the ranks' latest step events. Empty with one rank."""
        with self.lock:
            ranks = dict(self.ranks)
        return statistics.rank_spread(ranks)

    def expert_imbalance(self) -> tuple[float, float] | None:
        """(max, mean) over layers of max_load * n_experts: 1.0 is perfectly balanced routing."""
        with self.lock:
            load = self.expert_load
        return statistics.expert_imbalance(load)

    def expert_layer(self, layer: int) -> list[float]:
        """Per-expert load fractions of one MoE layer (clamped index)."""
        with self.lock:
            load = self.expert_load
        return statistics.expert_layer(load, layer)

    def energy(self) -> tuple[Energy | None, int]:
        """(energy over the recent step events, tokens trained in that window), from gptop.energy (the one
        computation: hardware counters, else integrated power) over the span the device samples cover."""
        with self.lock:
            rate = list(self._timing.rate)
            samples = [x for x in self.devices.samples if not rate or x.time >= rate[0][0] - 10.0]
        return statistics.energy_over(rate, samples, self.run_gpus())

    def run_gpus(self) -> list[str] | None:
        """The run's GPUs (the hello's trainer.contract.device.gpu_key list): whose energy counts."""
        with self.lock:
            hello = self.hello
        return hello.gpus if hello is not None else None

    def gpu_verdicts(self) -> dict[str, str]:
        """GPU key ("gpu0") -> why it is busy but slow (gpu_verdict), for the GPUs where it is."""
        with self.lock:
            latest = dict(self.device_latest)
        return hints.gpu_verdicts(latest)

    def joules_per_token(self) -> float | None:
        """Energy per token over the recent step events; None without a reading (see `energy_reason`)."""
        e, tokens = self.energy()
        return None if e is None else e.per_token(tokens)

    def energy_reason(self) -> str | None:
        """Why there is no energy per token, in words; None when there is one."""
        if self.joules_per_token() is not None:
            return None
        with self.lock:
            return formatting.energy_reason(len(self._timing.rate), list(self.devices.samples)[-20:])

    def steady_medians(self, last: int | None = None) -> tuple[float | None, float | None]:
        """(tokens/s, MFU): medians over the step events that are not a process's first (compilation,
        warm-up), the `last` of them if given; over all step events while there are no others."""
        with self.lock:
            steady = self._timing.steady
            rows = list(steady)[-last:] if last else list(steady)
            if not rows and self.last_step is not None:
                rows = [(self.last_step.tokens_per_s, self.last_step.mfu)]
        return statistics.rate_medians(rows)
