"""`--wandb`: a run's metrics as a Weights & Biases run, beside (or instead of) `--tensorboard`.

The same scalars as TensorBoard (gptop.run_metrics), logged against a `step` metric that is the training
step (W&B's own row counter only grows, while the training step starts again after a restart or a tuning
trial). The run is named after the run directory and keeps its files in `RUN_DIR/wandb/`; its config is the
resolved configuration (updated to the newest trainer start's, as after tuning), its summary the final
metrics `final/*` and `status`, written when the session closes. `WANDB_MODE=offline` needs no account and
no network (`wandb sync RUN_DIR/wandb/offline-run-*` uploads it later). wandb does not import torch.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import Any

from trainer.contract.config import ConfigError
from trainer.contract.events import Event, HelloEvent

from .run_metrics import RunMetrics, settings

INSTALL = "pip install -e '.[wandb]' (in a gptop checkout) or pip install wandb"


def require_wandb() -> None:
    """Refuse `--wandb` (exit 2) before anything starts when the package is missing or does not import."""
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb", f"needs the wandb package, which is not installed: {INSTALL}")
    import_wandb()


def import_wandb() -> Any:
    """The wandb module; a package that fails to import, whatever it raises, is a ConfigError naming --wandb."""
    try:
        import wandb
    except Exception as e:  # a broken install raises anything at import: a refusal, not a traceback
        raise ConfigError(
            "--wandb",
            f"the wandb package does not import ({type(e).__name__}: {e}); reinstall it ({INSTALL}) or drop --wandb",
        ) from None
    return wandb


class WandbWriter:
    """Feeds a session's events to one W&B run; thread-safe, closed once."""

    def __init__(self, run_dir: Path, config: dict[str, Any]):
        wandb = import_wandb()
        try:
            # console="off": W&B must not wrap stdout/stderr under the TUI; silent: no banner over it.
            self._run = wandb.init(
                dir=str(run_dir),
                name=run_dir.name,
                config=settings(config),
                settings=wandb.Settings(console="off", silent=True),
            )
        except Exception as e:  # no account, no network, a bad WANDB_* setting: say so, as a usage error
            raise ConfigError(
                "--wandb",
                f"wandb.init failed ({e}); run `wandb login`, or set "
                "WANDB_MODE=offline to log without an account or network",
            ) from None
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        self._metrics = RunMetrics()
        self._lock = threading.Lock()
        self._closed = False

    def on_event(self, event: Event) -> None:
        with self._lock:
            if self._closed:
                return
            scalars = self._metrics.feed(event)
            if scalars is not None:
                self._run.log({"step": scalars.step, **scalars.values})
            elif isinstance(event, HelloEvent) and event.rank == 0:
                self._run.config.update(settings(event.config), allow_val_change=True)

    def close(self) -> None:
        """Write the final metrics and status to the run's summary and finish the run."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._run.summary.update({**self._metrics.final, "status": self._metrics.status})
            self._run.finish(exit_code=1 if self._metrics.status == "failure" else 0)
            # finish() can return while W&B's service process still buffers the run's record file; teardown
            # waits for it (W&B's atexit hook would too, but only when the process exits, and not at all
            # after os._exit), so a closed writer means a complete run directory.
            import wandb

            wandb.teardown()
