"""`--tensorboard`: step metrics and device samples as TensorBoard scalars in the run directory.

Written with TensorBoard's own event-file writer and protobufs (no torch in
gptop's process, no TensorFlow): what `torch.utils.tensorboard` writes, minus
the torch import.
"""

from __future__ import annotations

import time
from pathlib import Path

from trainer.contract.events import DeviceEvent, EvalEvent, Event, StepEvent

STEP_SCALARS = ("loss", "lr", "grad_norm", "step_ms", "tokens_per_s", "mfu", "mem_bytes")
GPU_SCALARS = ("util_pct", "mem_used", "power_w", "temp_c", "sm_clock_mhz", "sm_active_pct", "tensor_active_pct")
CPU_SCALARS = ("util_pct", "mem_used", "proc_rss", "power_w")


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

    def on_event(self, event: Event) -> None:
        if isinstance(event, StepEvent):
            for key in STEP_SCALARS:
                value = getattr(event, key)
                if value is not None:
                    self.add_scalar(f"train/{key}", value, event.step, event.time)
            for phase, ms in (event.phases_ms or {}).items():
                if ms is not None:
                    self.add_scalar(f"phases_ms/{phase}", ms, event.step, event.time)
        elif isinstance(event, EvalEvent):
            if event.loss is not None:
                self.add_scalar("eval/loss", event.loss, event.step, event.time)
        elif isinstance(event, DeviceEvent):
            if self._t0 is None:
                self._t0 = event.time
            ms = int((event.time - self._t0) * 1000)
            for gpu in event.devices:
                for key in GPU_SCALARS:
                    value = getattr(gpu, key)
                    if value is not None:
                        self.add_scalar(f"gpu{gpu.index}/{key}", value, ms, event.time)
            if event.cpu is not None:
                for key in CPU_SCALARS:
                    value = getattr(event.cpu, key)
                    if value is not None:
                        self.add_scalar(f"cpu/{key}", value, ms, event.time)

    def close(self) -> None:
        self._w.close()
