"""`gptop run -- CMD`: the user's own training command as the trainer of a session.

CMD runs as gptop's trainer does (gptop.supervisor, `command=True`): in a run directory that gptop locks, in
a process group of its own, its stdout and stderr in `trainer.log` and `trainer.stderr.log` and the log panel,
its process tree in the device samples (`device.jsonl`), with a warden that ends it if gptop is killed. Its
environment carries the channel (trainer.contract.client.ClientEnv): a client inside it (gptop.integrations)
reports steps, phases, loss, checkpoints and errors, and takes gptop's commands. Without one, gptop shows the
devices, the logs and the exit.

Exit codes as for the trainer: 0 when CMD exits 0, 130 when you stopped it (whatever it exited with), 1 when
it failed (the last lines of its stderr in the summary), 2 when CMD is not found or not executable (nothing
is started or created).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import time
from pathlib import Path
from typing import Any

from trainer.contract import events as ev
from trainer.contract.states import RunStatus
from trainer.contract.client import ClientEnv
from trainer.contract.config import ConfigError, TrainConfig

from . import held_checkpoints as held
from .controls import StopSignals
from .session import Session, SessionOptions
from .supervisor import Supervisor
from .trial_processes import COMMAND_FAULT_ENV

OPTION = "CMD"  # how errors name the command
PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")


def check_command(words: list[str]) -> list[str]:
    """The command after `--`, checked before anything is started or created: its program exists and is
    executable (ConfigError naming it: exit 2), and so is the script a Python interpreter is given."""
    argv = words[1:] if words and words[0] == "--" else list(words)
    if not argv:
        raise ConfigError(OPTION, "no command given: gptop run [options] -- CMD [ARGS...]")
    prog = argv[0]
    if os.sep in prog:
        p = Path(prog)
        if not p.exists():
            raise ConfigError(OPTION, f"{prog}: no such file")
        if p.is_dir():
            raise ConfigError(OPTION, f"{prog} is a directory, not a program")
        if not os.access(p, os.X_OK):
            raise ConfigError(
                OPTION, f"{prog} is not executable (chmod +x it, or give its interpreter: gptop run -- python {prog})"
            )
    elif shutil.which(prog) is None:
        if shutil.which(prog, mode=os.F_OK) is not None:
            raise ConfigError(OPTION, f"{prog} is on PATH but not executable")
        raise ConfigError(OPTION, f"{prog}: command not found (not on PATH)")
    if PYTHON.match(Path(prog).name) and len(argv) > 1 and argv[1].endswith(".py") and not argv[1].startswith("-"):
        script = Path(argv[1])
        if not script.is_file():
            raise ConfigError(OPTION, f"{argv[1]}: no such Python script")
        if not os.access(script, os.R_OK):
            raise ConfigError(OPTION, f"{argv[1]} is not readable")
    return argv


def program_name(argv: list[str]) -> str:
    """What names a run of `argv`: the script a Python interpreter or a launcher runs, else the program."""
    script = next((a for a in argv[1:] if a.endswith(".py") and not a.startswith("-")), None)
    name = Path(script or argv[0]).stem or "command"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def default_run_dir(argv: list[str], when: float | None = None) -> str:
    """`runs/<time>-<name>`, as `gptop train` names its runs `runs/<time>-<model>-<size>`."""
    return os.path.join("runs", f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(when))}-{program_name(argv)}")


class ProgramSession(Session):
    """A Session whose trainer is the user's command. The TrainConfig it keeps carries only the run directory;
    what CMD trains is CMD's business (the hello of its client says)."""

    process_name = "the command"
    command: list[str]  # always a program here (Session's may be None: gptop's own trainer)
    run_dir: Path  # always given (SessionBase's may be None: a monitor without a run)

    def __init__(
        self,
        command: list[str],
        run_dir: Path,
        options: SessionOptions | None = None,
        *,
        log_every: int | None = None,
        grace_s: float = 30.0,
        signals: StopSignals | None = None,
        sampler: Any = None,
        tune: bool = False,
    ):
        """`tune`: `gptop tune -- CMD`: CMD's client is told so (it refuses when the script cannot take
        toggles), and each start after the first carries the toggles, checkpoint and log interval of the
        tuning driver's config (see `spawn`)."""
        cfg = TrainConfig()
        cfg.run.run_dir = str(run_dir)
        if log_every is not None:
            cfg.log.log_every = log_every
        super().__init__(cfg, options, sampler=sampler)
        self.command = list(command)
        self.log_every = log_every
        self.grace_s = grace_s
        self.signals = signals
        self.tune = tune
        self.newest: tuple[int, str] | None = None  # CMD's newest checkpoint (step, path) reported so far

    @property
    def command_line(self) -> str:
        return shlex.join(self.command)

    def run_config(self) -> dict[str, dict[str, Any]]:
        return {"command": {"argv": self.command, "log_every": self.log_every}}

    def stop_signal(self) -> int:
        """What a graceful stop sends CMD: SIGTERM when gptop got SIGTERM or SIGHUP, else SIGINT (as Ctrl-C
        in CMD's own terminal would)."""
        import signal

        last = self.signals.last_signal if self.signals is not None else None
        return signal.SIGTERM if last in (signal.SIGTERM, signal.SIGHUP) else signal.SIGINT

    def spawn(self, cfg: TrainConfig | None = None, resume: str | None = None, start_step: int | None = None) -> None:
        """Start (or start again) CMD. Under `gptop run`, `resume` is CMD's own business and not passed. Under
        `gptop tune` the tuning driver starts each trial and the decision with `cfg` (its toggles, the log
        interval) and `resume`, the checkpoint CMD saved on gptop's command; they reach CMD through its
        client (GPTOP_TOGGLES, GPTOP_LOG_EVERY, GPTOP_RESUME: `tuned_args`, `resume_checkpoint`), and its hello
        must start at `start_step` (`Session.check_start`). The first start runs CMD's own settings, logging at
        the session's interval (the driver's baseline)."""
        from .telemetry import training_device

        with self._lock:
            if self.finished:
                return
            self.expect_start = None if start_step is None else (start_step, resume)
            lock = self.options.run_lock
            sup = Supervisor(
                list(self.command),
                self.run_dir,
                on_event=self._on_event,
                on_log=self._on_log,
                on_exit=self._on_exit,
                on_malformed=self._on_malformed,
                pass_fds=lock.fds if lock is not None else (),
                node=self.layout.node,
                command=True,
                grace_s=self.grace_s,
                stop_signal=self.stop_signal,
            )
            if self.tune:
                client = ClientEnv(
                    channel=sup.channel_uri,
                    run_dir=self.run_dir.resolve(),
                    log_every=(cfg or self.cfg).log.log_every,
                    tune=True,
                    toggles=cfg.toggles if cfg is not None else None,
                    resume=resume if cfg is not None else None,
                )
            else:
                client = ClientEnv(channel=sup.channel_uri, run_dir=self.run_dir.resolve(), log_every=self.log_every)
            sup.env = {**os.environ, **(lock.env() if lock is not None else {}), **client.to_environ()}
            if self.tune and cfg is not None and cfg.run.fault:  # tests: a trial's faults, for the script
                sup.env[COMMAND_FAULT_ENV] = cfg.run.fault
            self.rank_errors = {}
            self.hello = None
            self.spawns += 1
            self.supervisor = sup
            self.stopping = False
            device = training_device()  # asked before the start, so the record follows it at once
            sup.start()
            # gptop's record of the start: what runs, on which device it most likely runs; a client's hello
            # follows with the model
            self.publish(
                ev.HelloEvent(
                    early=True, pid=sup.pid, config={}, device=device, model=ev.ModelInfo(), command=self.command
                )
            )
            self._set_status(RunStatus.RUNNING)

    def _on_event(self, event: ev.Event) -> None:
        super()._on_event(event)
        if isinstance(event, ev.CheckpointEvent) and event.rank == 0 and not held.is_held(self.run_dir, event.path):
            self.newest = (event.step, event.path)
            if self.controller is None:  # tuning is over: the run's own checkpoints go on from here
                self.release_held()

    def handle_exit(self, code: int) -> None:
        super().handle_exit(code)
        self.release_held(ended=True)

    def release_held(self, ended: bool = False) -> None:
        """Delete the checkpoint gptop held for a tuning's restarts (gptop.held_checkpoints) once the run needs it
        no more: CMD saved a newer one of its own that is still there, or (`ended`) the run ended at its last
        step. A run that ended otherwise keeps it: it may be the newest state there is."""
        step = held.held_step(self.run_dir) if self.tune else None
        if step is None:
            return
        newer = self.newest is not None and self.newest[0] > step and os.path.exists(self.newest[1])
        if newer or (ended and self.state.status is RunStatus.DONE):
            held.release(self.run_dir)
            self.log(f"deleted the checkpoint of step {step} held for the tuner's restarts: no longer needed")

    def failure_summary(self, code: int) -> str:
        err = self.state.last_error()
        how = f"exit code {code}" if code >= 0 else f"killed by signal {-code}"
        if err is not None:
            return f"{self.command_line} failed ({how}): {err.kind}: {err.message}"
        return f"{self.command_line} failed ({how}); see {self.layout.trainer_stderr}"
