"""What a tuning is asked to do: the settings a `TuneController` is built with (gptop.tuning chooses them
from the budget; tests pick their own)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from trainer.contract.config import ConfigError

from .load import LoadSource
from .proposals import AdviceTry

# A measurement is stable when its 95% interval's half-width is within this share of its estimate (`--stable-within`).
STABLE_WITHIN = 0.03
# Wider than this, a "stable" measurement could not tell a 1.5x speed-up from noise.
MAX_STABLE_WITHIN = 0.25
# A tuning runs at most this many trials (`--max-trials`); re-measurements and the applied setting's check are
# not trials.
MAX_TRIALS = 16
MAX_TRIALS_LIMIT = 1000
_SHARE = re.compile(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*%\s*")


def parse_stable_within(text: str, option: str = "--stable-within") -> float:
    """The share `text` names, written as a percentage ("5%"): above 0 and at most 25%."""
    m = _SHARE.fullmatch(text)
    if m is None:
        raise ConfigError(option, f"{text!r}: write a percentage with its sign, e.g. 5% (default {STABLE_WITHIN:.0%})")
    share = float(m.group(1)) / 100
    if not (math.isfinite(share) and 0 < share <= MAX_STABLE_WITHIN):
        raise ConfigError(option, f"{text!r} is out of range; accepted: above 0% and at most {MAX_STABLE_WITHIN:.0%}")
    return share


def stable_within_arg(option: str = "--stable-within") -> Callable[[str], float]:
    """An argparse `type=` for `--stable-within`: the share, checked at parse time."""
    import argparse

    def convert(text: str) -> float:
        try:
            return parse_stable_within(text, option)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(e.message) from None

    convert.__name__ = "percentage"
    return convert


@dataclass(frozen=True)
class TunerSettings:
    """The controller's settings; the defaults suit a half-hour budget on a GPU."""

    max_trials: int = MAX_TRIALS
    # a measurement (tuner.measure.Measurement): at least `min_steps`, done within `rel_ci`, capped by
    # `max_steps` and `max_seconds`
    min_steps: int = 8
    rel_ci: float = STABLE_WITHIN
    max_steps: int = 200
    max_seconds: float = 300.0
    prune_margin: float = 0.05  # a trial is pruned when clearly this share slower than the best (tuner.decide)
    remeasure_top: int = 2  # the best this many are measured again before deciding
    default_restart_s: float = 60.0  # a restart nobody has measured on this setup is assumed to take this
    # a trial still warming up after this is cut and its compile mode screened out (None: from max_seconds)
    trial_timeout_s: float | None = None
    max_micro_batch: int | None = None  # the largest micro-batch that fits, when already known
    # when starting a trial, keep budget for this many more (re-measurements); None: remeasure_top
    reserve_trials: int | None = None
    # a trial is cut when only this is left: the final switch's checkpoint and restart (the budget covers
    # tuning up to training on with the chosen setting)
    switch_reserve_s: float = 0.0
    # joules used in [t0, t1] of event time (the session's gptop.energy over its device samples), for
    # a trial's energy per token; None: no energy figures
    energy: Callable[[float, float], float | None] | None = None
    # the machine's background load over [t0, t1] of event time (the session's, from its device samples): a
    # measurement keeps the samples under one load, and only measurements under the same load are compared
    # (tuner.load); None: not tracked
    load: LoadSource | None = None
    progress_every_s: float = 1.0  # a measurement's progress: a tuner event at most this often
    # trials must pay within this run (tuner.economics; False with --tune-only: best.toml is for later runs)
    run_pays: bool = True
    # the ledger (tuner.economics.Ledger): the budget's share of the run's rest, what tuning may lose of it,
    # and the most a trial is assumed to gain over the start, or over the best
    max_share: float = 0.5
    max_loss: float = 0.1
    prior_gain: float = 1.5
    explore_gain: float = 1.5
    trust_spread: float = 0.25  # a measurement holds when its interval is within this share
    compile_prior_s: float = 45.0  # a compile nobody has measured on this setup is assumed to take this
    startup_s: float | None = None  # how long this setup's trainer took to start (measured)
    # the run can train on in a trial's own process (its settings are the user's); else applying means a restart
    trial_process_continues: bool = False
    # after an Apply, measure the applied setting on the live run against the start under the same load, and
    # switch back when it is slower beyond noise (tuner.check); the session asks for it when the run trains on
    check_applied: bool = False
    # what the advice says to try, asked once when the trials start (the evidence is then the freshest)
    advice: Callable[[], list[AdviceTry]] | None = None

    def measure_kw(self) -> dict[str, Any]:
        """A measurement's settings, as `tuner.measure.Measurement` takes them."""
        return dict(
            min_steps=self.min_steps, rel_ci=self.rel_ci, max_steps=self.max_steps, max_seconds=self.max_seconds
        )
