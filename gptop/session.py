"""The run session: the logic that both views (TUI, headless) share.

A Session owns the trainer supervisor, the device sampler and the RunState.
Views subscribe to it and render; they call the Commands methods (stop,
checkpoint, profile, toggle_tuning, restart) and never decide anything
themselves. Restart-on-failure, graceful stop, the exit code and the device
telemetry file all live here, so `--no-ui` behaves exactly like the TUI.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Callable, Protocol

from trainer.contract import events as ev
from trainer.contract.config import TrainConfig, cli_args
from trainer.contract.rundir import has_checkpoint

from .state import RunState
from .supervisor import Supervisor, torchrun_failures, trainer_argv

EXIT_DONE, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_PIPE = 141     # stdout's reader went away (`gptop --no-ui ... | head`): what a shell shows for SIGPIPE


class View(Protocol):
    def on_event(self, event: ev.Event) -> None: ...
    def on_log(self, line: str, stream: str) -> None: ...
    def on_status(self, status: str, message: str | None) -> None: ...


@dataclasses.dataclass
class SessionOptions:
    interval: float = 0.5              # device sampling period (s)
    restart_on_failure: int = 0        # automatic restarts from the last checkpoint
    tensorboard: bool = False
    extra_argv: list[str] = dataclasses.field(default_factory=list)   # e.g. torchrun launcher prefix
    launcher: Callable[[list[str]], list[str]] | None = None           # argv builder (torchrun for --nproc)


class Session:
    def __init__(self, cfg: TrainConfig, options: SessionOptions | None = None, *, sampler=None):
        self.cfg = cfg
        self.options = options or SessionOptions()
        self.run_dir = Path(cfg.run.run_dir)
        self.state = RunState(run_dir=str(self.run_dir))
        self.views: list[View] = []
        self.supervisor: Supervisor | None = None
        self.restarts_left = self.options.restart_on_failure
        self.interrupted = False
        self.stopping = False
        self._finished = threading.Event()
        self._lock = threading.RLock()
        self._exit_code: int | None = None
        self._device_file = None
        self._tb = None
        self.sampler = sampler
        self.spawns = 0
        self.rank_errors: dict[int, ev.ErrorEvent] = {}           # this spawn's first error event per rank
        self.hooks: list[Callable[[ev.Event], None]] = []         # e.g. the tuner driver
        self.on_trainer_exit: Callable[[int], bool] | None = None  # returns True if it handled the exit
        self.tuning_toggler: Callable[[], None] | None = None     # `t`: gptop.tuning.install_toggler sets it

    # ------------------------------------------------------------- lifecycle
    def start(self, resume: str | None = None) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._device_file = open(self.run_dir / "device.jsonl", "a", buffering=1)
        if self.options.tensorboard:
            from .tensorboard import TensorBoardWriter

            self._tb = TensorBoardWriter(self.run_dir / "tensorboard")
        if self.sampler is None:
            from .telemetry import DeviceSampler

            self.sampler = DeviceSampler(interval=self.options.interval, pids=self.pids)
        self.sampler.subscribe(self._on_device_sample)
        self.sampler.start()
        self.spawn(resume=resume)

    def spawn(self, cfg: TrainConfig | None = None, resume: str | None = None) -> None:
        """Start (or restart) the trainer process with `cfg` (default: the session's)."""
        with self._lock:
            if cfg is not None:
                self.cfg = cfg
            run_cfg = dataclasses.replace(self.cfg)
            run_cfg.checkpoint = dataclasses.replace(self.cfg.checkpoint, resume=resume)
            sup = Supervisor([], self.run_dir, on_event=self._on_event, on_log=self._on_log,
                             on_exit=self._on_exit, on_malformed=self._on_malformed,
                             launcher=self.options.launcher is not None)
            self.rank_errors = {}
            run_cfg.run = dataclasses.replace(self.cfg.run, run_dir=str(self.run_dir), channel=sup.channel_uri)
            if cfg is None and self.spawns > 0:
                run_cfg.run.fault = None     # a restart after a failure does not re-inject a test fault
            self.spawns += 1
            args = cli_args(run_cfg, full=True)
            sup.argv = self.options.launcher(args) if self.options.launcher else trainer_argv(args)
            self.supervisor = sup
            self.stopping = False
            self._set_status("starting" if resume is None else "restarting")
            sup.start()

    def pids(self) -> list[int]:
        sup = self.supervisor
        return sup.pids() if sup else []

    def wait(self, timeout: float | None = None) -> int | None:
        self._finished.wait(timeout)
        return self._exit_code

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def close(self) -> None:
        """Stop everything; never leaves a trainer process behind."""
        if self.supervisor is not None:
            self.supervisor.close()
        if self.sampler is not None:
            self.sampler.stop()
        if self._device_file:
            self._device_file.close()
            self._device_file = None
        if self._tb is not None:
            self._tb.close()

    # --------------------------------------------------------------- commands
    def stop(self, force: bool = False, *, interrupted: bool = True) -> None:
        """Graceful stop (the trainer checkpoints); `force` or a second call kills it at once.

        `interrupted=False` is a planned end (e.g. --tune-only): the exit code stays 0."""
        sup = self.supervisor
        self.interrupted = self.interrupted or interrupted
        if sup is None or not sup.alive():
            self._finish(EXIT_INTERRUPTED if self._exit_code is None else self._exit_code)
            return
        if force or self.stopping:
            self._set_status("stopping", "killed")
            sup.kill()
        else:
            self.stopping = True
            self._set_status("stopping", "finishing the step and checkpointing")
            sup.request_stop()

    def checkpoint(self) -> None:
        if self.supervisor:
            self.supervisor.send({"cmd": "checkpoint"})

    def profile(self, steps: int = 3) -> None:
        if self.supervisor:
            self.supervisor.send({"cmd": "profile", "steps": steps})

    @property
    def can_start_tuning(self) -> bool:
        return self.tuning_toggler is not None

    def toggle_tuning(self) -> None:
        toggler = self.tuning_toggler
        if toggler is not None:
            toggler()
        else:
            self._broadcast_log("tuning is not available in this session (start with gptop tune or --tune)")

    def restart(self) -> None:
        """Restart from the newest valid checkpoint after a failure."""
        if self.supervisor is not None and self.supervisor.alive():
            return
        self._finished.clear()
        self._exit_code = None
        self.spawn(resume=str(self.run_dir) if has_checkpoint(self.run_dir) else None)

    # --------------------------------------------------------------- plumbing
    def add_view(self, view: View) -> None:
        self.views.append(view)

    def _emit(self, event: ev.Event) -> None:
        """Apply one event to the state, then the views and hooks (also used for gptop's own events)."""
        with self._lock:
            self.state.apply(event)
        for view in self.views:
            view.on_event(event)
        if self._tb is not None:
            self._tb.on_event(event)
        for hook in self.hooks:
            hook(event)

    def _on_event(self, event: ev.Event) -> None:
        if isinstance(event, (ev.StepEvent, ev.HelloEvent)) and self.state.status in ("starting", "restarting"):
            self._set_status("running")
        if isinstance(event, ev.ErrorEvent):
            self.rank_errors.setdefault(event.rank, event)
        self._emit(event)

    def _on_device_sample(self, sample: ev.DeviceEvent) -> None:
        if self._device_file:
            try:
                self._device_file.write(ev.dumps(sample) + "\n")
            except ValueError:
                return
        self._emit(sample)

    def _on_log(self, line: str, stream: str) -> None:
        with self._lock:
            self.state.add_log(line, stream)
        for view in self.views:
            view.on_log(line, stream)

    def _on_malformed(self, line: bytes, why: str) -> None:
        with self._lock:
            self.state.count_malformed(line.decode("utf-8", "replace"))
        self._on_log(f"[gptop] malformed event ignored ({why}): {line[:200]!r}", "gptop")

    def _broadcast_log(self, message: str) -> None:
        self._on_log(f"[gptop] {message}", "gptop")

    def _set_status(self, status: str, message: str | None = None) -> None:
        with self._lock:
            self.state.set_status(status, message)
        for view in self.views:
            view.on_status(status, message)

    def _on_exit(self, code: int) -> None:
        if self.on_trainer_exit is not None and self.on_trainer_exit(code):
            return
        if code == 0:
            self._set_status("done", "stopped" if self.interrupted else None)
            self._finish(EXIT_INTERRUPTED if self.interrupted else EXIT_DONE)
            return
        summary = self.failure_summary(code)
        if self.interrupted:
            self._set_status("failed", f"stopped: {summary}")
            self._finish(EXIT_INTERRUPTED)
            return
        if self.restarts_left > 0:
            self.restarts_left -= 1
            self._set_status("restarting", f"{summary}; restarting from the last checkpoint "
                                           f"({self.restarts_left} restarts left)")
            self.spawn(resume=str(self.run_dir) if has_checkpoint(self.run_dir) else None)
            return
        self._set_status("failed", summary)
        self._finish(EXIT_FAILED)

    def failure_summary(self, code: int) -> str:
        if self.options.launcher is not None:
            ranks = self.rank_failure()
            if ranks:
                return ranks
        err = self.state.last_error() if hasattr(self.state, "last_error") else None
        how = f"exit code {code}" if code >= 0 else f"killed by signal {-code}"
        if err:
            return f"trainer failed ({how}): {err.kind}: {err.message}"
        return f"trainer died ({how}) without reporting an error; see {self.run_dir / 'trainer.stderr.log'}"

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
            return (f"rank {f['rank']} died ({how(f['exitcode'])}) without reporting an error{tail(f['rank'])}; "
                    f"see {self.run_dir / 'trainer.stderr.log'}")
        if errors:
            e = min(errors.values(), key=lambda e: e.time)
            return f"rank {e.rank} failed: {e.kind}: {e.message}{tail(e.rank)}"
        root = [f for f in failures if f["root"]] or failures
        if root:
            f = root[0]
            return (f"rank {f['rank']} failed ({how(f['exitcode'])}): {f['traceback']}; "
                    f"see {self.run_dir / 'trainer.stderr.log'}")
        return None

    def _finish(self, code: int) -> None:
        self._exit_code = code
        self._finished.set()

