"""How a session runs (gptop.session): the options the command line resolves to, and what the `t` key starts."""

from __future__ import annotations

import dataclasses
from typing import Callable

from trainer.contract.runlock import RunLock
from tuner.settings import MAX_TRIALS, STABLE_WITHIN

from .alert_options import AlertOptions

DEFAULT_T_BUDGET_S = 600.0  # the `t` key in a plain `gptop train`


@dataclasses.dataclass
class TuningOptions:
    """How a tuning started in this session runs (`gptop tune`, `--tune`, the `t` key)."""

    budget_s: float = DEFAULT_T_BUDGET_S
    space_spec: str | None = None  # --tune-space
    storage: str | None = None  # --storage: the Optuna storage URL
    tune_only: bool = False  # --tune-only: stop after writing best.toml
    stable_within: float = STABLE_WITHIN  # --stable-within: a measurement's precision target
    max_trials: int = MAX_TRIALS  # --max-trials: the most trials the tuning runs


@dataclasses.dataclass
class SessionOptions:
    interval: float = 0.5  # device sampling period (s)
    restart_on_failure: int = 0  # automatic restarts from the last checkpoint
    tensorboard: bool = False
    wandb: bool = False  # --wandb: a Weights & Biases run (gptop.wandb_writer)
    launcher: Callable[[list[str]], list[str]] | None = None  # argv builder (torchrun for --nproc)
    tuning: TuningOptions | None = None  # what the `t` key starts (None: `t` is not offered)
    run_lock: RunLock | None = None  # the run directory's lock, held by the caller for the session's life
    alerts: AlertOptions = dataclasses.field(default_factory=AlertOptions)  # gptop.alerts; enabled=False: none
    notify: list[str] = dataclasses.field(default_factory=list)  # --notify URLs (gptop.notify)
    notify_cmd: list[str] = dataclasses.field(default_factory=list)  # --notify-cmd commands
