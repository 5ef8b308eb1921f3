"""Decisions: prune a slow trial, whether switching pays, whether a trial can still pay, whether exploring on is
worth more than applying the best now.

Pruning is conservative: a trial is stopped only when even the optimistic end
of its confidence interval is clearly below the best measured so far, so a
noisy start never kills a configuration that might win; or, before that, when
not one of its first steps after the warm-up skip reached half the best's
throughput (`hopeless`).

Switching is plain arithmetic over the rest of the run: time at the current
speed minus time at the best speed must exceed the one-off cost of the switch
(checkpoint, restart, recompilation). Throughput noise is handled before this
(the caller only offers a best that is significantly faster).

The same arithmetic is asked before every trial (`trial_pays`): a trial costs
its restart, warm-up and compile (and, when it displaces the setting the run
would train on, the switch back), and it can at most save what a setting
`gain_bound` times faster than the start saves over the steps left after it.
It is run only if that bound exceeds its cost and its cost fits in what tuning
may still lose (a share of the remaining run, plus what the best found so far
already saves, minus what tuning has cost so far). Asked before the first
trial (`Choice.PLAN`) this says whether tuning can pay at all. Once a setting
that pays is found, `keep_exploring` weighs one more trial (at most the step
from the best to the bound, over the steps left after it) against its cost
plus the saving forgone while it runs instead of the best: when exploring is
worth less, the best is applied now.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass
from typing import Any

from .measure import Measurement


def should_prune(
    measurement: Measurement, best_tokens_per_s: float | None, margin: float = 0.05, min_samples: int = 3
) -> bool:
    """True when the trial is clearly slower than the best: after warm-up, with at least `min_samples`
    samples, the upper end of its CI is below best * (1 - margin)."""
    if best_tokens_per_s is None or not best_tokens_per_s > 0 or not measurement.warmed_up:
        return False
    if len(measurement.kept) < min_samples:
        return False
    _, hi = measurement.interval()
    return math.isfinite(hi) and hi < best_tokens_per_s * (1.0 - margin)


def hopeless(
    measurement: Measurement, best_tokens_per_s: float | None, factor: float = 0.5, min_samples: int = 3
) -> bool:
    """True when, before warm-up has even been judged, no step after the first `skip` reached `factor` of the
    best's throughput in `min_samples` tries: warm-up only makes steps slower, so such a trial cannot win.
    Spares waiting for a slow configuration (bf16 autocast on a CPU, activation checkpointing at a tiny
    micro-batch) to settle, which at seconds a step can take a whole trial's time."""
    if best_tokens_per_s is None or not best_tokens_per_s > 0:
        return False
    after = measurement.samples[measurement.skip :]
    if len(after) < min_samples:
        return False
    return max(s.tokens_per_s for s in after) < factor * best_tokens_per_s


class Choice(enum.Enum):
    """What a decision in the tuning's ledger decided."""

    PLAN = "plan"  # before the first trial: can any trial pay over the rest of the run?
    TRIAL = "trial"  # can a kind of trial (a compile mode, a plain restart) still pay?
    EXPLORE = "explore"  # one more trial, or apply the best found now?
    SWITCH = "switch"  # apply the best, or keep the start?
    CANDIDATE = "candidate"  # can a measured configuration win at all? (one whose compile kept recompiling cannot)


@dataclass(frozen=True)
class Decision:
    """A yes/no (`apply`: switch, plan, run that kind of trial, explore on) with the figures that say so:
    `expected_saving_s` what it may save, `cost_s` what it costs, both in seconds of the run."""

    apply: bool
    expected_saving_s: float
    cost_s: float
    reason: str
    choice: Choice = Choice.SWITCH
    step: int | None = None  # the run's step when it was decided
    remaining_steps: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["choice"] = self.choice.value
        return d


def switch_pays(
    current_tps: float,
    best_tps: float,
    remaining_steps: int,
    tokens_per_step: int,
    switch_cost_s: float,
    min_net_s: float = 0.0,
    fallback_cost_s: float = 0.0,
    claim: str | None = None,
) -> Decision:
    """Apply iff (remaining time at current speed - at best speed) - switch cost > `min_net_s` - the cost of
    the alternative (`fallback_cost_s`: going back to the start from a trial's process is a restart too).
    `claim` says the speed-up in words with its interval ('1.31x (1.24-1.38x)')."""
    cost = max(0.0, float(switch_cost_s))
    fallback = max(0.0, float(fallback_cost_s))
    if remaining_steps <= 0:
        return Decision(False, 0.0, cost, "no steps left to benefit from a switch", remaining_steps=remaining_steps)
    if not (best_tps > 0 and current_tps > 0):
        return Decision(False, 0.0, cost, "no valid throughput to compare", remaining_steps=remaining_steps)
    tokens = remaining_steps * tokens_per_step
    saving = tokens / current_tps - tokens / best_tps
    if saving <= 0:
        return Decision(
            False,
            saving,
            cost,
            f"not faster: {best_tps:.0f} vs {current_tps:.0f} tokens/s",
            remaining_steps=remaining_steps,
        )
    switch = f"the {cost:.0f}s switch" + (f" (going back to the start costs {fallback:.0f}s too)" if fallback else "")
    if saving - cost + fallback > min_net_s:
        return Decision(
            True,
            saving,
            cost,
            f"{claim or f'{best_tps / current_tps:.2f}x'} faster saves {saving:.0f}s over the remaining "
            f"{remaining_steps} steps, more than {switch}",
            remaining_steps=remaining_steps,
        )
    return Decision(
        False,
        saving,
        cost,
        f"saves {saving:.0f}s over the remaining {remaining_steps} steps, not more than {switch}",
        remaining_steps=remaining_steps,
    )


def _clock(seconds: float) -> str:
    s = int(round(max(0.0, seconds)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def trial_pays(
    cost_s: float,
    trial_s: float,
    remaining_steps: int,
    step_s: float,
    gain_bound: float,
    loss_left_s: float,
    *,
    what: str = "a trial",
    choice: Choice = Choice.TRIAL,
    step: int | None = None,
    loss_note: str = "",
    between_s: float = 0.0,
) -> Decision:
    """Whether a trial costing `cost_s` (restart, warm-up, compile, the switch back) and lasting `trial_s` can
    pay: at most `gain_bound` times faster than the start, over the steps left after it (at `step_s` seconds
    each, plus `between_s` of the run's time between steps, which a faster setting does not shorten), it must
    save more than it costs, and its cost must fit in `loss_left_s`, what tuning may still lose (`loss_note`
    says how that is set). `expected_saving_s` is that most it could save."""
    cost = max(0.0, float(cost_s))
    between = max(0.0, float(between_s))
    pace = step_s + between
    left_s = max(0, remaining_steps) * pace
    after = max(0.0, left_s - max(0.0, trial_s))
    share = step_s / pace if pace > 0 else 0.0  # the part of the time after it that a setting speeds up
    bound = after * share * (1.0 - 1.0 / gain_bound) if gain_bound > 1.0 else 0.0
    figures = (
        f"the run ends in {_clock(left_s)} ({remaining_steps} steps at {pace:.2f} s"
        + (f", {between:.2f} s of it between steps" if between >= 0.005 else "")
        + f"); {what} costs ~{cost:.0f} s here"
    )
    if cost >= bound:
        return Decision(
            False,
            bound,
            cost,
            f"{figures}, more than the {bound:.0f} s it could save "
            f"(at {gain_bound:.2f}x over the {_clock(after)} after it)",
            choice,
            step,
            remaining_steps,
        )
    if cost > loss_left_s:
        return Decision(
            False,
            bound,
            cost,
            f"{figures}, more than the {max(0.0, loss_left_s):.0f} s tuning may still lose{loss_note}",
            choice,
            step,
            remaining_steps,
        )
    return Decision(
        True,
        bound,
        cost,
        f"{figures}; it could save up to {bound:.0f} s (at {gain_bound:.2f}x over the {_clock(after)} after it)",
        choice,
        step,
        remaining_steps,
    )


def keep_exploring(
    best_gain: float,
    gain_bound: float,
    trial_cost_s: float,
    trial_s: float,
    remaining_steps: int,
    step_s: float,
    switch: Decision,
    best_number: int | None = None,
    step: int | None = None,
) -> Decision:
    """One more trial, or apply the best now (`switch`, which pays)? Another trial can at most add the step from
    `best_gain` to `gain_bound` over the steps left after it; it costs its own cost (its restart) plus the
    saving forgone while its steps run at about the start's speed instead of the best's. `apply` True: explore
    on."""
    after = max(0.0, max(0, remaining_steps) * step_s - max(0.0, trial_s))
    value = after * (1.0 / best_gain - 1.0 / gain_bound) if gain_bound > best_gain > 0 else 0.0
    stepping = max(0.0, trial_s - max(0.0, trial_cost_s))  # the trial's time that is not its restart
    forgone = stepping * (1.0 - 1.0 / best_gain) if best_gain > 1.0 else 0.0
    cost = max(0.0, trial_cost_s) + forgone
    net_now = switch.expected_saving_s - switch.cost_s
    if value > cost:
        return Decision(
            True,
            value,
            cost,
            f"another trial could add up to {value:.0f} s, more than its ~{cost:.0f} s",
            Choice.EXPLORE,
            step,
            remaining_steps,
        )
    at = f" at step {step}" if step is not None else ""
    which = f"trial {best_number}" if best_number is not None else "the best"
    return Decision(
        False,
        value,
        cost,
        f"stopped exploring{at}: {remaining_steps} steps left, applying {which} "
        f"saves {net_now:.0f} s, another trial costs ~{cost:.0f} s and could add at most {value:.0f} s",
        Choice.EXPLORE,
        step,
        remaining_steps,
    )


def significantly_faster(best_lo: float, current_tps: float) -> bool:
    """The best's CI lower bound is above the current estimate: not a noise win."""
    return math.isfinite(best_lo) and best_lo > current_tps
