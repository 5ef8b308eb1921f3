"""`--tensorboard`: a run's metrics as TensorBoard event files in `RUN_DIR/tensorboard/`.

Everything is written against the training step, so the device readings sit on the loss's axis:

- `train/*` and `phases_ms/*` from each step event of rank 0 (every rank reports its own step events;
  the loss is already the mean over ranks), `eval/loss` from each validation;
- `gpuN/*` and `cpu/*`: the mean of the device readings taken during a log interval, at the step that
  ends it (readings after the last step event are not written);
- hparams (TensorBoard's HPARAMS tab): the resolved configuration of the newest trainer start (after
  tuning: the setting that trained last) as `section.field` hyperparameters, with the final metrics
  `final/*` and the session's status, written when the session closes.

Written with TensorBoard's own event-file writer and protobufs (no torch in gptop's process, no
TensorFlow), in the layout `torch.utils.tensorboard.SummaryWriter.add_hparams` writes and TensorBoard's
hparams plugin reads (its `plugin_data.proto`: an Experiment, a SessionStartInfo, a SessionEndInfo).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from trainer.contract.events import DeviceEvent, DoneEvent, ErrorEvent, EvalEvent, Event, HelloEvent, StepEvent

STEP_SCALARS = ("loss", "lr", "grad_norm", "step_ms", "tokens_per_s", "mfu", "mem_bytes")
GPU_SCALARS = ("util_pct", "mem_used", "power_w", "temp_c", "sm_clock_mhz", "sm_active_pct", "tensor_active_pct")
CPU_SCALARS = ("util_pct", "mem_used", "proc_rss", "power_w")
# The hparams table's metric columns: what the run ended with.
FINAL_METRICS = ("final/loss", "final/eval_loss", "final/tokens_per_s", "final/mfu", "final/step")
NOT_HPARAMS = {"run.channel"}     # the event socket of one trainer start: plumbing, not a setting


def flat_hparams(config: dict[str, dict[str, Any]]) -> dict[str, bool | float | str]:
    """`TrainConfig.to_dict()` as `section.field` hparams: numbers, booleans and strings; None left out
    (TensorBoard has no null), anything else (a list) as its text."""
    out: dict[str, bool | float | str] = {}
    for section, values in config.items():
        if not isinstance(values, dict):
            continue
        for name, value in values.items():
            if value is None:
                continue
            key = f"{section}.{name}"
            if key in NOT_HPARAMS:
                continue
            out[key] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return out


class TensorBoardWriter:
    def __init__(self, log_dir: Path):
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as e:  # tensorboard is an optional extra
            from trainer.contract.config import ConfigError

            raise ConfigError("--tensorboard", f"needs the tensorboard package: pip install 'gptop[tensorboard]' ({e})")
        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self._api_pb2, self._hp_meta, self._hp_data = api_pb2, metadata, plugin_data_pb2
        self._w = EventFileWriter(str(log_dir))
        self._lock = threading.Lock()
        self._step: int | None = None                         # the newest step of rank 0
        self._device: dict[str, list[float]] = {}             # readings since the last step event, per tag
        self._config: dict[str, dict[str, Any]] | None = None
        self._final: dict[str, float] = {}
        self._status = "STATUS_RUNNING"
        self._closed = False

    # ----------------------------------------------------------------- writing
    def add_scalar(self, tag: str, value: float, step: int, wall_time: float | None = None) -> None:
        summary = self._summary_pb2.Summary(value=[self._summary_pb2.Summary.Value(tag=tag, simple_value=float(value))])
        self._add(summary, step, wall_time)

    def _add(self, summary: Any, step: int, wall_time: float | None = None) -> None:
        self._w.add_event(self._event_pb2.Event(wall_time=wall_time or time.time(), step=int(step), summary=summary))

    def _plugin_summary(self, tag: str, **data: Any) -> Any:
        """One hparams-plugin record (experiment, session start or end) as a Summary with its metadata."""
        content = self._hp_data.HParamsPluginData(version=self._hp_meta.PLUGIN_DATA_VERSION, **data)
        meta = self._summary_pb2.SummaryMetadata(plugin_data=self._summary_pb2.SummaryMetadata.PluginData(
            plugin_name=self._hp_meta.PLUGIN_NAME, content=content.SerializeToString()))
        return self._summary_pb2.Summary(value=[self._summary_pb2.Summary.Value(tag=tag, metadata=meta)])

    def _write_hparams(self) -> None:
        api, data = self._api_pb2, self._hp_data
        hparams = flat_hparams(self._config or {})
        start = data.SessionStartInfo(start_time_secs=time.time())
        infos = []
        for key, value in hparams.items():
            if isinstance(value, bool):
                start.hparams[key].bool_value, kind = value, "DATA_TYPE_BOOL"
            elif isinstance(value, (int, float)):
                start.hparams[key].number_value, kind = float(value), "DATA_TYPE_FLOAT64"
            else:
                start.hparams[key].string_value, kind = value, "DATA_TYPE_STRING"
            infos.append(api.HParamInfo(name=key, type=api.DataType.Value(kind)))
        experiment = api.Experiment(hparam_infos=infos,
                                    metric_infos=[api.MetricInfo(name=api.MetricName(tag=t)) for t in FINAL_METRICS])
        step = self._step or 0
        self._add(self._plugin_summary(self._hp_meta.EXPERIMENT_TAG, experiment=experiment), step)
        self._add(self._plugin_summary(self._hp_meta.SESSION_START_INFO_TAG, session_start_info=start), step)
        for tag, value in self._final.items():
            self.add_scalar(tag, value, step)
        status = "STATUS_UNKNOWN" if self._status == "STATUS_RUNNING" else self._status   # ended without a word
        end = data.SessionEndInfo(status=api.Status.Value(status), end_time_secs=time.time())
        self._add(self._plugin_summary(self._hp_meta.SESSION_END_INFO_TAG, session_end_info=end), step)

    # ------------------------------------------------------------------ events
    def on_event(self, event: Event) -> None:
        with self._lock:
            if not self._closed:
                self._on_event(event)

    def _on_event(self, event: Event) -> None:
        if isinstance(event, StepEvent):
            if event.rank != 0:
                return
            for key in STEP_SCALARS:
                value = getattr(event, key)
                if value is not None:
                    self.add_scalar(f"train/{key}", value, event.step, event.time)
            for phase, ms in (event.phases_ms or {}).items():
                if ms is not None:
                    self.add_scalar(f"phases_ms/{phase}", ms, event.step, event.time)
            for tag, values in self._device.items():
                self.add_scalar(tag, sum(values) / len(values), event.step, event.time)
            self._device = {}
            self._step = event.step
            self._final["final/step"] = event.step
            for key, tag in (("loss", "final/loss"), ("tokens_per_s", "final/tokens_per_s"), ("mfu", "final/mfu")):
                value = getattr(event, key)
                if value is not None:
                    self._final[tag] = value
        elif isinstance(event, EvalEvent):
            if event.loss is not None:
                self.add_scalar("eval/loss", event.loss, event.step, event.time)
                self._final["final/eval_loss"] = event.loss
        elif isinstance(event, DeviceEvent):
            readings = [(f"gpu{gpu.index}", gpu, GPU_SCALARS) for gpu in event.devices]
            if event.cpu is not None:
                readings.append(("cpu", event.cpu, CPU_SCALARS))
            for prefix, reading, keys in readings:
                for key in keys:
                    value = getattr(reading, key)
                    if value is not None:
                        self._device.setdefault(f"{prefix}/{key}", []).append(float(value))
        elif isinstance(event, HelloEvent):
            if event.rank == 0:
                self._config = event.config
                self._status = "STATUS_RUNNING"
        elif isinstance(event, DoneEvent):
            self._status = "STATUS_SUCCESS"
            self._final["final/step"] = event.step
        elif isinstance(event, ErrorEvent):
            self._status = "STATUS_FAILURE"

    def close(self) -> None:
        """Write the hparams with the final metrics (when a trainer said hello) and close the file."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._config is not None:
                self._write_hparams()
            self._w.close()
