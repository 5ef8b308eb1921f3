"""Decisions: prune a slow trial, whether switching pays, which candidates to re-measure.

Pruning is conservative: a trial is stopped only when even the optimistic end
of its confidence interval is clearly below the best measured so far, so a
noisy start never kills a configuration that might win; or, before that, when
not one of its first steps after the warm-up skip reached half the best's
throughput (`hopeless`).

Switching is plain arithmetic over the rest of the run: time at the current
speed minus time at the best speed must exceed the one-off cost of the switch
(checkpoint, restart, recompilation). Throughput noise is handled before this
(the caller only offers a best that is significantly faster).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .measure import Measurement
from .study import Candidate, TuneStudy


def should_prune(measurement: Measurement, best_tokens_per_s: float | None, margin: float = 0.05,
                 min_samples: int = 3) -> bool:
    """True when the trial is clearly slower than the best: after warm-up, with at least `min_samples`
    samples, the upper end of its CI is below best * (1 - margin)."""
    if best_tokens_per_s is None or not best_tokens_per_s > 0 or not measurement.warmed_up:
        return False
    if len(measurement.kept) < min_samples:
        return False
    _, hi = measurement.interval()
    return math.isfinite(hi) and hi < best_tokens_per_s * (1.0 - margin)


def hopeless(measurement: Measurement, best_tokens_per_s: float | None, factor: float = 0.5,
             min_samples: int = 3) -> bool:
    """True when, before warm-up has even been judged, no step after the first `skip` reached `factor` of the
    best's throughput in `min_samples` tries: warm-up only makes steps slower, so such a trial cannot win.
    Spares waiting for a slow configuration (bf16 autocast on a CPU, activation checkpointing at a tiny
    micro-batch) to settle, which at seconds a step can take a whole trial's time."""
    if best_tokens_per_s is None or not best_tokens_per_s > 0:
        return False
    after = measurement.samples[measurement.skip:]
    if len(after) < min_samples:
        return False
    return max(s.tokens_per_s for s in after) < factor * best_tokens_per_s


@dataclass(frozen=True)
class Decision:
    """Whether to switch to the best configuration, with the arithmetic that says so."""

    apply: bool
    expected_saving_s: float
    cost_s: float
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def switch_pays(current_tps: float, best_tps: float, remaining_steps: int, tokens_per_step: int,
                switch_cost_s: float, min_net_s: float = 0.0) -> Decision:
    """Apply iff (remaining time at current speed - at best speed) - switch cost > `min_net_s`."""
    cost = max(0.0, float(switch_cost_s))
    if remaining_steps <= 0:
        return Decision(False, 0.0, cost, "no steps left to benefit from a switch")
    if not (best_tps > 0 and current_tps > 0):
        return Decision(False, 0.0, cost, "no valid throughput to compare")
    tokens = remaining_steps * tokens_per_step
    saving = tokens / current_tps - tokens / best_tps
    if saving <= 0:
        return Decision(False, saving, cost, f"not faster: {best_tps:.0f} vs {current_tps:.0f} tokens/s")
    net = saving - cost
    if net > min_net_s:
        return Decision(True, saving, cost,
                        f"{best_tps / current_tps:.2f}x faster saves {saving:.0f}s over the remaining "
                        f"{remaining_steps} steps, more than the {cost:.0f}s switch")
    return Decision(False, saving, cost,
                    f"saves {saving:.0f}s over the remaining {remaining_steps} steps, "
                    f"not more than the {cost:.0f}s switch")


def top_candidates(study: TuneStudy, k: int) -> list[Candidate]:
    """The k best feasible configurations (pooled over re-measurements), best first."""
    return study.candidates()[:max(0, k)]


def clearly_better(a: Candidate, b: Candidate) -> bool:
    """a's CI lies entirely above b's: a re-measurement would not change the order."""
    return a.lo > b.hi


def significantly_faster(best_lo: float, current_tps: float) -> bool:
    """The best's CI lower bound is above the current estimate: not a noise win."""
    return math.isfinite(best_lo) and best_lo > current_tps
