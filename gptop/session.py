"""The run session: the logic that both views (TUI, headless) share.

A Session owns the trainer supervisor, the device sampler and the RunState.
Views subscribe to it and render; they call the Commands methods (stop,
checkpoint, profile, toggle_tuning, restart) and never decide anything
themselves. Restart-on-failure, graceful stop, the exit code and the device
telemetry file all live here, so `--no-ui` behaves exactly like the TUI.

The tuning driver (gptop.tuning) plugs in through one public seam: a
`Controller` in the session's one controller slot sees every event and every
trainer exit, and publishes its own events and log lines through `publish`
and `log`. What it shares with a session that watches a run
(gptop.monitor.MonitorSession) is `gptop.session_base.SessionBase`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from trainer.contract import events as ev
from trainer.contract.states import ErrorKind, RunStatus, StoppedBy
from trainer.contract.config import TrainConfig, cli_args
from trainer.contract.rundir import RunDir, has_checkpoint, list_checkpoints

from .alerts import AlertMonitor
from .session_base import (
    EXIT_DONE,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_PIPE,
    EXIT_USAGE,
    ClosingView,
    SessionBase,
    View,
)
from .session_options import DEFAULT_T_BUDGET_S, SessionOptions, TuningOptions
from .supervisor import Supervisor, torchrun_failures, trainer_argv
from .trial_processes import start_below

if TYPE_CHECKING:  # imported where used: each is an optional extra or costs start-up time
    from tuner.load import LoadPoint

    from .notify import Notifier
    from .tensorboard import TensorBoardWriter
    from .wandb_writer import WandbWriter

__all__ = [
    "DEFAULT_T_BUDGET_S",
    "EXIT_DONE",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_PIPE",
    "EXIT_USAGE",
    "NO_RESTART_KINDS",
    "ClosingView",
    "Controller",
    "Session",
    "SessionBase",
    "SessionOptions",
    "TuningOptions",
    "View",
]

# Failures a restart from the last checkpoint cannot cure: restarting would only loop (a full disk).
NO_RESTART_KINDS = ("disk",)


class Controller(Protocol):
    """What sits in a Session's controller slot (the tuning driver): it sees every event and, while it is
    there, owns every trainer exit."""

    def on_event(self, event: ev.Event) -> None: ...

    def on_trainer_exit(self, code: int) -> bool:
        """True if the controller handled the exit; False hands it to the session (`Session.handle_exit`)."""

    def stop_tuning(self) -> None:
        """The user asked to stop tuning (the `t` key): decide on what was measured and train on."""


class Session(SessionBase):
    process_name = "the trainer"  # what the views call the process the session runs
    command: list[str] | None = None  # a user's program (gptop run -- CMD) instead of gptop's trainer

    def __init__(self, cfg: TrainConfig, options: SessionOptions | None = None, *, sampler: Any = None):
        if cfg.run.run_dir is None:
            raise ValueError("a session runs in a run directory: resolve cfg.run.run_dir first (gptop.preflight)")
        run_dir = Path(cfg.run.run_dir)
        super().__init__(run_dir, sampler)
        self.run_dir: Path = run_dir
        self.cfg = cfg
        self.options = options or SessionOptions()
        lock = self.options.run_lock
        self.layout = RunDir(self.run_dir, lock.node if lock is not None else None)  # this node's files
        self.supervisor: Supervisor | None = None
        self.restarts_left = self.options.restart_on_failure
        self.interrupted = False
        self.stopping = False
        self.forced = False  # the user's second stop killed the trainer (no checkpoint of its own)
        self.killed_after_completion = False  # a forced stop after the trainer's `done`: still a finished run
        self.spawns = 0
        self.rank_errors: dict[int, ev.ErrorEvent] = {}  # this spawn's first error event per rank
        self.hello: ev.HelloEvent | None = None  # this spawn's rank-0 hello, once it came
        # the step this spawn must start at and the checkpoint it holds (a tuning's resume), when known
        self.expect_start: tuple[int, str | None] | None = None
        self.halted: str | None = None  # why gptop ended the run itself (`halt`)
        self._device_file: IO[str] | None = None
        self._tb: TensorBoardWriter | None = None
        self._wandb: WandbWriter | None = None
        self._controller: Controller | None = None
        self.alerts = AlertMonitor(
            self.options.alerts, alive=self._trainer_working, node=lock.node if lock is not None else None
        )
        self.notifier: Notifier | None = None  # from start() when --notify/--notify-cmd

    # ------------------------------------------------------------- lifecycle
    def start(self, resume: str | None = None) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.options.notify or self.options.notify_cmd:
            from .notify import Notifier

            self.notifier = Notifier(
                self.options.notify, self.options.notify_cmd, self.log, run_name=self.state.run_name
            )
        if self.options.wandb:  # first: a refused W&B login (exit 2) leaves no files of the run behind
            from .wandb_writer import WandbWriter

            self._wandb = WandbWriter(self.run_dir, self.run_config())
        self._device_file = open(self.layout.device, "a", buffering=1)
        if self.options.tensorboard:
            from .tensorboard import TensorBoardWriter

            self._tb = TensorBoardWriter(self.layout.tensorboard)
        if self.sampler is None:
            from .telemetry import DeviceSampler

            self.sampler = DeviceSampler(interval=self.options.interval, pids=self.pids)
        self.sampler.subscribe(self._on_device_sample)
        self.sampler.start()
        self.spawn(resume=resume)

    def run_config(self) -> dict[str, dict[str, Any]]:
        """The run's configuration as a W&B run records it (sections of settings)."""
        return self.cfg.to_dict()

    def spawn(self, cfg: TrainConfig | None = None, resume: str | None = None, start_step: int | None = None) -> None:
        """Start (or restart) the trainer process with `cfg` (default: the session's). A session that is over
        (stopped before its trainer started, say) starts nothing. `start_step`: the step `resume` holds, which
        the process must start at (`check_start`)."""
        with self._lock:
            if self.finished:
                return
            self.expect_start = None if start_step is None else (start_step, resume)
            if cfg is not None:
                self.cfg = cfg
            run_cfg = dataclasses.replace(self.cfg)
            run_cfg.checkpoint = dataclasses.replace(self.cfg.checkpoint, resume=resume)
            lock = self.options.run_lock
            sup = Supervisor(
                [],
                self.run_dir,
                on_event=self._on_event,
                on_log=self._on_log,
                on_exit=self._on_exit,
                on_malformed=self._on_malformed,
                launcher=self.options.launcher is not None,
                env=None if lock is None else {**os.environ, **lock.env()},
                pass_fds=lock.fds if lock is not None else (),
                node=self.layout.node,
            )
            self.rank_errors = {}
            self.hello = None
            run_cfg.run = dataclasses.replace(self.cfg.run, run_dir=str(self.run_dir), channel=sup.channel_uri)
            if cfg is None and self.spawns > 0:
                run_cfg.run.fault = None  # a restart after a failure does not re-inject a test fault
            self.spawns += 1
            args = cli_args(run_cfg, full=True)
            sup.argv = self.options.launcher(args) if self.options.launcher else trainer_argv(args)
            self.supervisor = sup
            self.stopping = False
            self._set_status(RunStatus.STARTING if resume is None else RunStatus.RESTARTING)
            sup.start()

    def pids(self) -> list[int]:
        sup = self.supervisor
        return sup.pids() if sup else []

    def _trainer_working(self) -> bool:
        """A trainer process is alive and nobody asked it to stop: a run that can stall."""
        sup = self.supervisor
        return sup is not None and sup.alive() and not self.stopping and not self.finished

    def energy_between(self, t0: float, t1: float) -> float | None:
        """Joules the run's devices used in [t0, t1] (unix time), from the sampler's history through the
        one energy computation (gptop.energy); None without a reading. The tuner measures trials with it."""
        if self.sampler is None:
            return None
        from .energy import energy_between

        return energy_between(self.sampler.history(), t0, t1, run_gpus=self.state.run_gpus())

    def load_between(self, t0: float, t1: float) -> list[LoadPoint]:
        """The machine's background load over [t0, t1] (unix time), from the sampler's history (gptop.load):
        what the tuner holds equal between the measurements it compares."""
        if self.sampler is None:
            return []
        from .load import load_points

        return load_points(self.sampler.history(), t0, t1, run_gpus=self.state.run_gpus())

    def close(self) -> None:
        """Stop everything; never leaves a trainer process behind."""
        if self.supervisor is not None:
            self.supervisor.close()
        super().close()
        if self._device_file:
            with contextlib.suppress(OSError):  # a full disk fails the last flush too
                self._device_file.close()
            self._device_file = None
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()
        if self.notifier is not None:
            self.notifier.close()

    # --------------------------------------------------------------- commands
    def stop(self, force: bool = False, *, interrupted: bool = True) -> None:
        """Graceful stop (the trainer checkpoints); `force` or a second call kills it at once.

        `interrupted=False` is a planned end of gptop's own: the exit code stays 0."""
        sup = self.supervisor
        by = StoppedBy.USER if interrupted else StoppedBy.GPTOP
        if sup is not None and self.state.completed and (sup.alive() or sup.exiting):
            # the trainer trained to its last step and is on its way out, or out with its exit not yet
            # handled: the run is finished, not stopped (exit 0); a forced stop only shortens its teardown
            if force and sup.alive():
                self.killed_after_completion = True
                sup.kill(by=by)
            return
        self.interrupted = self.interrupted or interrupted
        if sup is not None and sup.exiting:
            return  # the trainer just exited: handle_exit, on its way, says how the run ended and what it kept
        if sup is None or not sup.alive():
            if self._exit_code is None and self.interrupted:
                self._set_status(RunStatus.STOPPED)
            self._record_stop_between_processes(by)
            self._finish(EXIT_INTERRUPTED if self._exit_code is None else self._exit_code)
            return
        if force or self.stopping:
            self.forced = True
            self._set_status(
                RunStatus.STOPPING, "a second stop: ending the trainer at once, without a checkpoint of its own"
            )
            sup.kill(by=by)
        else:
            self.stopping = True
            if self.state.stepped:
                self._set_status(RunStatus.STOPPING, "finishing the step and checkpointing")
            else:  # the trainer abandons its startup at once (trainer.channel.StartupStopped)
                self._set_status(RunStatus.STOPPING, "stopping before the first step (nothing to checkpoint)")
            sup.request_stop(by=by)

    def checkpoint(self) -> None:
        if self.supervisor:
            self.supervisor.send({"cmd": "checkpoint"})

    def profile(self, steps: int = 3) -> None:
        if self.supervisor:
            self.supervisor.send({"cmd": "profile", "steps": steps})

    @property
    def can_start_tuning(self) -> bool:  # type: ignore[override]
        return self.options.tuning is not None or self._controller is not None

    def toggle_tuning(self) -> None:
        """The `t` key: stop the tuning that runs, or start one on the running trainer."""
        if self._controller is not None:
            self.stop_tuning()
            return
        if self.options.tuning is None:
            self.log("tuning is not available in this session (start with gptop tune or --tune)")
            return
        sup = self.supervisor
        if self.hello is None or sup is None or not sup.alive():
            self.log("tuning starts once the trainer runs")
            raise RuntimeError("the trainer is not running")
        self.start_tuning(self.options.tuning)

    def start_tuning(self, options: TuningOptions) -> Controller:
        """Put a tuning driver in the controller slot: before `start` (the first process is its baseline)
        or on the running trainer (from its hello)."""
        from .tuning import TuningDriver

        return TuningDriver(
            self,
            options.budget_s,
            space_spec=options.space_spec,
            storage=options.storage,
            tune_only=options.tune_only,
            stable_within=options.stable_within,
            max_trials=options.max_trials,
            hello=self.hello,
        ).attach()

    def stop_tuning(self) -> None:
        """Stop the tuning that runs, if one does: it decides on what it measured and training goes on."""
        controller = self._controller
        if controller is not None:
            controller.stop_tuning()

    def restart(self) -> None:
        """Restart from the newest valid checkpoint after a failure."""
        if self.supervisor is not None and self.supervisor.alive():
            return
        self._finished.clear()
        self._exit_code = None
        self.spawn(resume=str(self.run_dir) if has_checkpoint(self.run_dir) else None)

    # ------------------------------------------------------ controller seam
    @property
    def controller(self) -> Controller | None:
        """The controller in the slot (the tuning driver while it tunes), or None."""
        return self._controller

    def set_controller(self, controller: Controller | None) -> None:
        """Fill the one controller slot (None empties it). A second controller is refused: two tunings
        would both claim every trainer exit."""
        with self._lock:
            if controller is not None and self._controller not in (None, controller):
                raise RuntimeError("a controller is already attached to this session")
            self._controller = controller

    def publish(self, event: ev.Event) -> None:
        """One of gptop's own events (a trial, a decision, a log event): shown like the trainer's, and
        appended to the run's events.jsonl so that a replay or `gptop report` sees it."""
        self._dispatch(event)
        self.append_event(event)

    def append_event(self, event: ev.Event) -> None:
        """Append one of gptop's events to the run's events.jsonl, unseen by the views."""
        with open(self.run_dir / "events.jsonl", "a") as f:  # one small O_APPEND write per line: no
            f.write(ev.dumps(event) + "\n")  # tearing with the trainer's own lines

    # --------------------------------------------------------------- plumbing
    def _dispatch(self, event: ev.Event) -> None:
        """Apply one event to the state, then the views, TensorBoard, W&B and the controller."""
        super()._dispatch(event)
        if self._tb is not None:
            self._tb.on_event(event)
        if self._wandb is not None:
            self._wandb.on_event(event)
        controller = self._controller
        if controller is not None:
            controller.on_event(event)
        if isinstance(event, ev.AlertEvent):
            if self.notifier is not None:
                self.notifier.send(event)
            return
        for alert in self.alerts.on_event(event):
            try:
                self.publish(alert)
            except OSError as e:  # shown, not kept: a full disk must not take the alert (or the run) down
                self.log(f"alert not written to events.jsonl: {e}")

    def halt(self, kind: ErrorKind, message: str) -> None:
        """gptop ends the run for a reason of its own (a start that would lose steps, a command it cannot tune):
        an error event of `kind`, the trainer killed (lost steps: before it writes anything) or asked to stop,
        and the run failed with `message`, restarted by nothing. Once."""
        with self._lock:
            if self.halted is not None:
                return
            self.halted = message
        self.publish(ev.ErrorEvent(kind=kind, message=message, step=self.state.step))
        sup = self.supervisor
        if sup is not None and sup.alive():
            self.stopping = True
            sup.kill(by=StoppedBy.GPTOP) if kind == ErrorKind.LOST_STEPS else sup.request_stop(by=StoppedBy.GPTOP)
        elif self._controller is None and (sup is None or not sup.exiting):
            self.handle_exit(EXIT_FAILED)  # nothing runs to end: the run ends here (a controller ends it itself)

    def check_start(self, hello: ev.HelloEvent) -> None:
        """A process that starts below the step gptop resumed it from is halted before its first step."""
        lost = start_below(hello, self.expect_start, self.process_name)
        if lost is not None:
            self.halt(ErrorKind.LOST_STEPS, lost)

    def _on_event(self, event: ev.Event) -> None:
        started = isinstance(event, (ev.StepEvent, ev.ProgressEvent)) or (
            isinstance(event, ev.HelloEvent) and not event.early
        )  # the early hello: nothing is built yet
        if started and self.state.status.launching:
            self._set_status(RunStatus.RUNNING)
        if isinstance(event, ev.ErrorEvent):
            self.rank_errors.setdefault(event.rank, event)
        if isinstance(event, ev.HelloEvent) and event.rank == 0:
            self.hello = event
        self._dispatch(event)
        if isinstance(event, ev.HelloEvent) and event.rank == 0:
            self.check_start(event)

    def _on_device_sample(self, sample: ev.DeviceEvent) -> None:
        if self._device_file:
            try:
                self._device_file.write(ev.dumps(sample) + "\n")
            except ValueError:
                return
            except OSError as e:  # a full or read-only disk: keep showing samples, stop writing them
                f, self._device_file = self._device_file, None
                with contextlib.suppress(OSError):
                    f.close()
                self.log(f"device samples are no longer written to {self.layout.device}: {e}")
        self._dispatch(sample)

    def _on_malformed(self, line: bytes, why: str) -> None:
        super()._on_malformed(line, why)
        self.log(f"malformed event ignored ({why}): {line[:200]!r}")

    def _on_exit(self, code: int) -> None:
        self.record_exit(code)
        controller = self._controller
        if controller is not None and controller.on_trainer_exit(code):
            return
        self.handle_exit(code)

    def record_exit(self, code: int) -> None:
        """gptop's `exit` event for the process that just ended, before anything acts on its end (so a restart's
        start follows it in events.jsonl): its exit status or signal, how long it ran, who ended it, and a
        failure's last stderr lines. A full disk loses the record, not the run."""
        sup = self.supervisor
        if sup is None:
            return
        by = sup.stopped_by
        started, ended = sup.started_at, sup.ended_at
        event = ev.ExitEvent(
            pid=sup.pid,
            exit_code=code if code >= 0 else None,
            signal=-code if code < 0 else None,
            seconds=ended - started if started is not None and ended is not None else None,
            stopped_by=by,
            stderr=(sup.stderr_tail(ev.EXIT_STDERR_LINES) if by is None and code != 0 else None) or None,
        )
        try:
            self.publish(event)
        except OSError as e:
            self.log(f"how {self.process_name} ended is not recorded in events.jsonl: {e}")

    def handle_exit(self, code: int) -> None:
        """The session's own handling of a trainer exit: done, stopped, restarted or failed. A controller
        hands an exit here when it does not handle it itself."""
        if self.halted is not None:
            self._set_status(RunStatus.FAILED, self.halted)
            self._finish(EXIT_FAILED)
            return
        if self.interrupted:
            self._stopped(code)
            return
        if code == 0 or (self.killed_after_completion and self.state.completed):
            self._set_status(RunStatus.DONE)
            self._finish(EXIT_DONE)
            return
        summary = self.failure_summary(code)
        curable = not any(e.kind in NO_RESTART_KINDS for e in self.rank_errors.values())
        if self.restarts_left > 0 and curable:
            self.restarts_left -= 1
            self._set_status(
                RunStatus.RESTARTING,
                f"{summary}; restarting from the last checkpoint ({self.restarts_left} restarts left)",
            )
            self.spawn(resume=str(self.run_dir) if has_checkpoint(self.run_dir) else None)
            return
        self._set_status(RunStatus.FAILED, summary)
        self._finish(EXIT_FAILED)

    def _stopped(self, code: int) -> None:
        """The user asked for the stop (q, Ctrl-C, SIGTERM to gptop): "stopped" and exit 130 at any moment,
        also while the trainer was still starting and died of the signal. Only an error the trainer itself
        reported (a checkpoint it could not write while stopping) is shown as a failure."""
        if code != 0 and self.rank_errors:
            self._set_status(RunStatus.FAILED, f"stopped: {self.failure_summary(code)}")
        elif code == 0:
            self._set_status(RunStatus.STOPPED)
        else:
            self._set_status(RunStatus.STOPPED, self.cut_short(code))
        self._record_stop_between_processes(StoppedBy.USER)
        self._finish(EXIT_INTERRUPTED)

    def _record_stop_between_processes(self, by: StoppedBy) -> None:
        """A stop that ends the run after the tuner's restart ended its process and before the next one started: a
        `status` record after that `exit` says whose stop it was (docs/run-directory.md); the views have the status."""
        last = self.state.exit
        if last is not None and last.stopped_by is StoppedBy.TUNER:
            try:
                self.append_event(ev.StatusEvent(status=RunStatus.STOPPED, stopped_by=by, message="during a restart"))
            except OSError as e:
                self.log(f"the stop is not recorded in events.jsonl: {e}")

    def cut_short(self, code: int) -> str:
        """What a stop that ended the trainer before its own clean exit kept and lost, from the checkpoints on
        disk (an atomic write is there or not, whether or not its event arrived) against the last step done."""
        how = f"exit code {code}" if code >= 0 else f"signal {-code}"
        who = (
            f"a second stop (Ctrl-C or q twice) ended {self.process_name} ({how})"
            if self.forced
            else f"{self.process_name} ended ({how})"
        )
        reached = self.state.step
        if self.command:  # a user's program keeps its checkpoints where it chooses (and says its steps, or not)
            if not self.state.reported:
                return who
            return f"{who} " + ("before its first step" if reached is None else f"at step {reached}")
        kept = list_checkpoints(self.run_dir)
        newest = kept[-1].step if kept else None
        if reached is None:
            return f"{who} before its first step: there was nothing to checkpoint"
        if newest is not None and newest >= reached:
            return f"{who} after its checkpoint of step {newest}: nothing is lost"
        first = 1 if newest is None else newest + 1
        lost = f"step {reached} is lost" if first == reached else f"steps {first}-{reached} are lost"
        if newest is not None:
            return f"{who} before it checkpointed step {reached}: {lost}, --resume continues from step {newest}"
        return f"{who} before its first checkpoint: {lost}"

    def refusal(self) -> str | None:
        """The trainer's refusal of the configuration ("--lora-targets: ..."), when that is how the run ended:
        a config error before any step, nothing checkpointed. None for any other end."""
        err = self.state.last_error()
        if (
            self._exit_code != EXIT_FAILED
            or err is None
            or err.kind != "config"
            or self.state.step is not None
            or has_checkpoint(self.run_dir)
        ):
            return None
        return err.message

    def failure_summary(self, code: int) -> str:
        if self.options.launcher is not None:
            ranks = self.rank_failure()
            if ranks:
                return ranks
        err = self.state.last_error()
        how = f"exit code {code}" if code >= 0 else f"killed by signal {-code}"
        if err:
            return f"trainer failed ({how}): {err.kind}: {err.message}"
        return f"trainer died ({how}) without reporting an error; see {self.layout.trainer_stderr}"

    def rank_failure(self) -> str | None:
        """Which rank failed and why, for a launched (torchrun) run.

        The root cause is a rank's own error event if one reported an error that is not a
        lost connection; else a rank that torchrun saw die (a signal, a silent exit); else
        the first lost-connection error. torchrun's own "first observed failure" is only
        known to the second, so it is the last resort."""
        sup = self.supervisor
        failures = torchrun_failures(sup.stderr_text()) if sup is not None else []
        errors = dict(self.rank_errors)
        lost = sorted(r for r, e in errors.items() if e.lost_peer)

        def how(code: int) -> str:
            if code < 0:
                try:
                    import signal

                    return f"killed by signal {-code} ({signal.Signals(-code).name})"
                except ValueError:
                    return f"killed by signal {-code}"
            return f"exit code {code}"

        def tail(root: int) -> str:
            others = [r for r in lost if r != root]
            if not others:
                return ""
            names = ", ".join(str(r) for r in others)
            return f"; rank{'s' if len(others) > 1 else ''} {names} stopped after losing contact with it"

        own = sorted((e for e in errors.values() if not e.lost_peer), key=lambda e: e.time)
        if own:
            e = own[0]
            return f"rank {e.rank} failed: {e.kind}: {e.message}{tail(e.rank)}"
        silent = [f for f in failures if f["rank"] not in errors]
        if silent:
            f = min(silent, key=lambda f: (f["exitcode"] >= 0, not f["root"], f["rank"]))
            return (
                f"rank {f['rank']} died ({how(f['exitcode'])}) without reporting an error{tail(f['rank'])}; "
                f"see {self.layout.trainer_stderr}"
            )
        if errors:
            e = min(errors.values(), key=lambda e: e.time)
            return f"rank {e.rank} failed: {e.kind}: {e.message}{tail(e.rank)}"
        root = [f for f in failures if f["root"]] or failures
        if root:
            f = root[0]
            return f"rank {f['rank']} failed ({how(f['exitcode'])}): {f['traceback']}; see {self.layout.trainer_stderr}"
        return None
