"""The event -> scalars mapping that `--tensorboard` and `--wandb` both write (one place, no torch).

Everything is keyed by the training step, so the device readings sit on the loss's axis:

- `train/*` and `phases_ms/*` from each step event of rank 0 (every rank reports its own step events;
  the loss is already the mean over ranks), `eval/loss` from each validation;
- `gpuN/*` and `cpu/*`: the mean of the device readings taken during a log interval, at the step that
  ends it (readings after the last step event are not written);
- the resolved configuration of the newest trainer start (after tuning: the setting that trained last),
  the final metrics `final/*` and the session's status, for the writer to record when the session closes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainer.contract.events import (
    CpuReading,
    DeviceEvent,
    DoneEvent,
    ErrorEvent,
    EvalEvent,
    Event,
    GpuReading,
    HelloEvent,
    StepEvent,
)

STEP_SCALARS = ("loss", "lr", "grad_norm", "step_ms", "tokens_per_s", "mfu", "mem_bytes")
GPU_SCALARS = ("util_pct", "mem_used", "power_w", "temp_c", "sm_clock_mhz", "sm_active_pct", "tensor_active_pct")
CPU_SCALARS = ("util_pct", "mem_used", "proc_rss", "power_w")
# What the run ended with (TensorBoard's hparams metric columns, W&B's run summary).
FINAL_METRICS = ("final/loss", "final/eval_loss", "final/tokens_per_s", "final/mfu", "final/step")
PLUMBING = {"run.channel"}  # the event socket of one trainer start: plumbing, not a setting


def settings(config: dict[str, Any]) -> dict[str, Any]:
    """A resolved config (`TrainConfig.to_dict()`, a hello's `config`) without its plumbing fields."""
    return {
        section: {k: v for k, v in values.items() if f"{section}.{k}" not in PLUMBING}
        if isinstance(values, dict)
        else values
        for section, values in config.items()
    }


@dataclasses.dataclass
class Scalars:
    """The scalars one event yields, all at one training step."""

    step: int
    time: float
    values: dict[str, float]


class RunMetrics:
    """Turns a session's events into step-keyed scalars and keeps what a writer records at the end.

    `status` is "running" until a trainer says done ("success") or fails ("failure")."""

    def __init__(self) -> None:
        self.step: int | None = None  # the newest step of rank 0
        self.config: dict[str, dict[str, Any]] | None = None  # the newest rank-0 hello's resolved config
        self.final: dict[str, float] = {}
        self.status = "running"
        self._device: dict[str, list[float]] = {}  # readings since the last step event, per tag

    def feed(self, event: Event) -> Scalars | None:
        """Update from one event; the scalars to write now, if it yields any."""
        if isinstance(event, StepEvent):
            if event.rank != 0:
                return None
            values = {
                f"train/{key}": float(getattr(event, key)) for key in STEP_SCALARS if getattr(event, key) is not None
            }
            values.update(
                {f"phases_ms/{phase}": float(ms) for phase, ms in (event.phases_ms or {}).items() if ms is not None}
            )
            values.update({tag: sum(v) / len(v) for tag, v in self._device.items()})
            self._device = {}
            self.step = event.step
            self.final["final/step"] = event.step
            for key in ("loss", "tokens_per_s", "mfu"):
                value = getattr(event, key)
                if value is not None:
                    self.final[f"final/{key}"] = value
            return Scalars(event.step, event.time, values)
        if isinstance(event, EvalEvent):
            if event.loss is None:
                return None
            self.final["final/eval_loss"] = event.loss
            return Scalars(event.step, event.time, {"eval/loss": float(event.loss)})
        if isinstance(event, DeviceEvent):
            readings: list[tuple[str, GpuReading | CpuReading, tuple[str, ...]]] = [
                (f"gpu{gpu.index}", gpu, GPU_SCALARS) for gpu in event.devices
            ]
            if event.cpu is not None:
                readings.append(("cpu", event.cpu, CPU_SCALARS))
            for prefix, reading, keys in readings:
                for key in keys:
                    value = getattr(reading, key)
                    if value is not None:
                        self._device.setdefault(f"{prefix}/{key}", []).append(float(value))
        elif isinstance(event, HelloEvent):
            if event.rank == 0:
                self.config = event.config
                self.status = "running"
        elif isinstance(event, DoneEvent):
            self.status = "success"
            self.final["final/step"] = event.step
        elif isinstance(event, ErrorEvent):
            self.status = "failure"
        return None
