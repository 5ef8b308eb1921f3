"""The applied setting, checked on the live run (the controller's check phase, after an `Apply`).

Once the run trains on with the applied setting, that process's steps are measured as a trial's are, and set
against the start's measurements under the same background load (`tuner.windows.ratio`): the realized
speed-up, with its interval, beside what the decision claimed. A measurement that did not reach its precision
target, or found no measurement of the start under its load, realizes nothing (the report says why, and the
applied setting stays: nothing shows it slower). When the realized interval lies wholly below 1, the setting
is slower than the start beyond noise: the run switches back to the start at once (after a checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.contract.config import Toggles
from trainer.contract.states import TrialKind

from . import run_figures, starting
from .actions import Apply, Done
from .finishing import trial_end
from .load import same
from .record import Change, Checked, KeptSteps, Realized, TunerView
from .trial import LOAD_CHANGED, LOAD_RETRIES, ActiveTrial, TrialEnd, noted
from .windows import Window, ratio, ratio_words

NOT_VERIFIED = "not verified"


@dataclass(frozen=True)
class PendingCheck:
    """An applied setting to check on the live run: the Apply, the decision in words, the claimed speed-up
    (with its interval), and the time and step it was decided at (its overhead from then is the switch's)."""

    apply: Apply
    reason: str
    claimed: tuple[float, float, float] | None
    at: float
    step: int

    def begin(self, v: TunerView) -> starting.Begun:
        """The check's measurement, from the decision on."""
        return starting.begin(v, TrialKind.CHECK, self.apply.toggles, None, self.at, number=self.apply.number)

    def done(self, r: Realized, start: Toggles) -> Done:
        """Tuning's end once checked: keep the applied setting, or switch back to the `start`."""
        toggles = start if r.switch_back else self.apply.toggles
        return Done(f"{self.reason}; {r.why}", toggles, restart=r.switch_back)


NO_START = "no measurement of the start under the load the applied setting runs under; measuring it again"


def again(v: TunerView, a: ActiveTrial, time_left: float) -> str | None:
    """Why a measurement that is done is measured again (None: it is not): the load changed under it (within
    the budget), or, for the check, the start was never measured under its load (the load may come back)."""
    if a.load_retries >= LOAD_RETRIES:
        return None
    if a.load_changed and (a.kind is TrialKind.CHECK or time_left >= v.settings.max_seconds):
        return LOAD_CHANGED
    m = a.measure
    if a.kind is TrialKind.CHECK and m.stable and m.load is not None:
        starts = [w for w in run_figures.windows(v) if w.toggles == v.base and w.stable]
        if not any(same(m.load, w.load) for w in starts):
            return NO_START
    return None


def finish_check(
    v: TunerView,
    a: ActiveTrial,
    end: TrialEnd,
    claimed: tuple[float, float, float] | None,
    step: int,
    failed: str = "",
) -> list[Change]:
    """The check is over (`failed`: how the applied setting failed, in words): what it realized, and whether
    the run switches back."""
    m = a.measure
    window = Window(TrialKind.CHECK, a.number, a.toggles, tuple(s.tokens_per_s for s in m.kept), m.stable, m.load)
    starts = [w for w in run_figures.windows(v) if w.toggles == v.base]
    r = ratio([window], starts) if window.samples else None
    switch_back = False
    if failed:
        why = f"{NOT_VERIFIED}: {failed}"
    elif not m.stable:
        why = f"{NOT_VERIFIED}: its measurement on the live run did not reach its target ({m.stop_words(m.done_reason or a.stop)})"
    elif r is None:
        under = f" ({m.load.words()})" if m.load is not None else ""
        why = f"{NOT_VERIFIED}: no measurement of the start under the load it ran under{under}"
    else:
        why = f"realized {r.words()} against the start under the same load"
        if r.hi < 1.0:
            switch_back = True
            why += ": slower than the start beyond noise, so the run switches back to the starting configuration"
    claim = f"claimed {ratio_words(*claimed)}, " if claimed is not None else ""
    status, verdict = a.verdict("", None)
    realized = Realized(
        claimed=claimed,
        ratio=(r.speedup, r.lo, r.hi) if r is not None and m.stable and not failed else None,
        why=why,
        switch_back=switch_back,
        switch_s=end.overhead_s,
        steps=a.steps,
        step=step,
        load=m.load.to_dict() if m.load is not None else None,
    )
    event = trial_end(
        a.number,
        TrialKind.CHECK,
        a.toggles,
        status,
        end.summary,
        noted(claim + why, verdict),
        end.duration,
        overhead_s=end.overhead_s,
        source=TrialKind.CHECK,
    )
    return [KeptSteps(a.toggles, a.toggles.optimizer, 0), Checked(realized), event]


def unchecked(a: ActiveTrial | None, reason: str, claimed: tuple[float, float, float] | None, step: int) -> Realized:
    """The check ended before it measured anything that could be compared (the user stopped it, the run ended)."""
    return Realized(claimed, None, f"{NOT_VERIFIED}: {reason}", False, None, a.steps if a else 0, step, None)
