"""`--tensorboard`: step metrics and device samples as TensorBoard scalars in the run directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TensorBoardWriter:
    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # tensorboard is an optional extra
            from trainer.config import ConfigError

            raise ConfigError("--tensorboard", f"needs the tensorboard package: pip install 'gptop[tensorboard]' ({e})")
        self._w = SummaryWriter(str(log_dir))
        self._t0: float | None = None

    def on_event(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "step":
            step = event["step"]
            for key in ("loss", "lr", "grad_norm", "step_ms", "tokens_per_s", "mfu", "mem_bytes"):
                if event.get(key) is not None:
                    self._w.add_scalar(f"train/{key}", event[key], step)
            for phase, ms in (event.get("phases_ms") or {}).items():
                self._w.add_scalar(f"phases_ms/{phase}", ms, step)
        elif kind == "eval":
            self._w.add_scalar("eval/loss", event["loss"], event["step"])
        elif kind == "device":
            if self._t0 is None:
                self._t0 = event["time"]
            t = event["time"] - self._t0
            for gpu in event.get("devices") or []:
                for key in ("util_pct", "mem_used", "power_w", "temp_c", "sm_clock_mhz"):
                    if gpu.get(key) is not None:
                        self._w.add_scalar(f"gpu{gpu['index']}/{key}", gpu[key], walltime=event["time"],
                                           global_step=int(t * 1000))
            cpu = event.get("cpu") or {}
            for key in ("util_pct", "mem_used", "proc_rss", "power_w"):
                if cpu.get(key) is not None:
                    self._w.add_scalar(f"cpu/{key}", cpu[key], walltime=event["time"], global_step=int(t * 1000))

    def close(self) -> None:
        self._w.close()
