"""`--tensorboard`: step metrics and device samples as TensorBoard scalars in the run directory.

Written with TensorBoard's own event-file writer and protobufs (no torch in
gptop's process, no TensorFlow): what `torch.utils.tensorboard` writes, minus
the torch import.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


class TensorBoardWriter:
    def __init__(self, log_dir: Path):
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as e:  # tensorboard is an optional extra
            from trainer.contract.config import ConfigError

            raise ConfigError("--tensorboard", f"needs the tensorboard package: pip install 'gptop[tensorboard]' ({e})")
        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self._w = EventFileWriter(str(log_dir))
        self._t0: float | None = None

    def add_scalar(self, tag: str, value: float, step: int, wall_time: float | None = None) -> None:
        summary = self._summary_pb2.Summary(value=[self._summary_pb2.Summary.Value(tag=tag, simple_value=float(value))])
        self._w.add_event(self._event_pb2.Event(wall_time=wall_time or time.time(), step=int(step), summary=summary))

    def on_event(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "step":
            step = event["step"]
            for key in ("loss", "lr", "grad_norm", "step_ms", "tokens_per_s", "mfu", "mem_bytes"):
                if event.get(key) is not None:
                    self.add_scalar(f"train/{key}", event[key], step, event.get("time"))
            for phase, ms in (event.get("phases_ms") or {}).items():
                if ms is not None:
                    self.add_scalar(f"phases_ms/{phase}", ms, step, event.get("time"))
        elif kind == "eval":
            if event.get("loss") is not None:
                self.add_scalar("eval/loss", event["loss"], event["step"], event.get("time"))
        elif kind == "device":
            if self._t0 is None:
                self._t0 = event["time"]
            t = event["time"] - self._t0
            for gpu in event.get("devices") or []:
                for key in ("util_pct", "mem_used", "power_w", "temp_c", "sm_clock_mhz"):
                    if gpu.get(key) is not None:
                        self.add_scalar(f"gpu{gpu['index']}/{key}", gpu[key], int(t * 1000), event["time"])
            cpu = event.get("cpu") or {}
            for key in ("util_pct", "mem_used", "proc_rss", "power_w"):
                if cpu.get(key) is not None:
                    self.add_scalar(f"cpu/{key}", cpu[key], int(t * 1000), event["time"])

    def close(self) -> None:
        self._w.close()
