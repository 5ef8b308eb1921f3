"""The tuning driver's part after a decision to apply (`gptop.tuning.TuningDriver` takes it in): switch the run
to the applied setting, then measure that setting on the live run for the controller's check (tuner.check),
which keeps it or switches back to the start.

The switch is a graceful stop (a checkpoint) and a restart with the applied toggles and the user's own settings;
the check measures the process that trains on, asked (a command, no restart) to log every step while it is
measured and given its own interval back after. Its steps are the run's: nothing is rolled back. If that process
ends during the check (the run reached --max-steps, a crash, an interrupt), the run's end is the session's, as
after any switch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer.contract.states import TrialOutcome
from tuner.actions import Apply, Check
from tuner.measure import TrialStop

STEADY = frozenset(TrialStop)  # a healthy measurement's stops (gptop.tuning.STEADY)
# gptop.tuning.MeasureEnd's values: the session's reasons to stop measuring (this module sits below it)
ABORT, INTERRUPTED, FINISHED = "abort", "interrupted", "finished"

if TYPE_CHECKING:
    from tuner.controller import TuneController

    from .trial_processes import TrialProcesses


class AppliedCheck:
    """The switch to an applied setting and its check on the live run (a part of the tuning driver)."""

    if TYPE_CHECKING:  # the driver's, which this part uses
        procs: TrialProcesses
        session: Any
        trial_log_every: int
        ended_in_check: bool

        def _say(self, message: str, **fields: Any) -> None: ...
        def _publish(self) -> None: ...
        def _conclude(self, action: Any) -> None: ...
        def _restart(self, toggles: Any, fault: Any = None, strict: bool = True) -> tuple[int, str] | None: ...
        def _end_reason(self) -> str: ...
        def _measure(self, ctl: TuneController, on_hello: Any = None) -> tuple[Any, str]: ...

    def _switch(self, ctl: TuneController, action: Apply) -> bool:
        """Train on with the applied toggles and the user's settings (a restart when they differ from what
        runs); False when the run must not go on (interrupted, finished, stopped), tuning concluded."""
        self._say(
            f"applying {action.label or f'trial {action.number}'}: {action.decision.reason}",
            decision=action.decision.to_dict(),
        )
        procs = self.procs
        want = procs.cfg_for(action.toggles, strict=False)
        if not procs.alive or procs.differs(want, log_every=False):
            if self._restart(action.toggles, strict=False) is None:
                ctl.abort(self._end_reason())
                self._publish()
                self._conclude(None)
                return False
        return True

    def _run_check(self, ctl: TuneController, action: Check) -> bool:
        """Measure the applied setting on the live run and tell the controller; False when the tuning concluded
        meanwhile (the run ended, was interrupted, or the user stopped tuning)."""
        procs = self.procs
        interval = procs.cfg_for(action.toggles, strict=False).log.log_every
        finer = interval > self.trial_log_every

        def log_every_step() -> None:  # the process that trains on logs every step while it is measured
            if finer:
                procs.log_every(self.trial_log_every)

        if procs.alive and procs.steps_since_spawn > 0:  # no restart: it runs already
            log_every_step()
        outcome, reason = self._measure(ctl, on_hello=log_every_step)
        if finer and procs.alive:
            procs.log_every(interval)
        if outcome == ABORT:
            self._conclude(ctl.stop_early(reason))
            return False
        if outcome in STEADY:
            ctl.finish_trial(TrialOutcome.OK)
        elif ctl.in_trial:
            ctl.finish_trial(outcome if isinstance(outcome, TrialOutcome) else TrialOutcome.OK, reason)
        if outcome in (INTERRUPTED, FINISHED) or not procs.alive:
            self.ended_in_check = not procs.alive  # its exit is the session's to handle, as after any switch
            ctl.abort(reason or self._end_reason())
            self._publish()
            self._conclude(None)
            return False
        self._publish()
        return True
