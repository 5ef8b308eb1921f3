"""`--tensorboard`: a run's metrics as TensorBoard event files in `RUN_DIR/tensorboard/`.

The scalars, the final metrics and the status come from gptop.run_metrics (shared with `--wandb`);
hparams (TensorBoard's HPARAMS tab): the resolved configuration of the newest trainer start as
`section.field` hyperparameters, with the final metrics `final/*` and the session's status, written when
the session closes.

Written with TensorBoard's own event-file writer and protobufs (no torch in gptop's process, no
TensorFlow), in the layout `torch.utils.tensorboard.SummaryWriter.add_hparams` writes and TensorBoard's
hparams plugin reads (its `plugin_data.proto`: an Experiment, a SessionStartInfo, a SessionEndInfo).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from trainer.contract.events import Event

from .run_metrics import FINAL_METRICS, RunMetrics, settings

STATUS = {"running": "STATUS_UNKNOWN", "success": "STATUS_SUCCESS", "failure": "STATUS_FAILURE"}  # hparams plugin


def flat_hparams(config: dict[str, dict[str, Any]]) -> dict[str, bool | float | str]:
    """`TrainConfig.to_dict()` as `section.field` hparams: numbers, booleans and strings; None left out
    (TensorBoard has no null), anything else (a list) as its text."""
    out: dict[str, bool | float | str] = {}
    for section, values in settings(config).items():
        if not isinstance(values, dict):
            continue
        for name, value in values.items():
            if value is None:
                continue
            out[f"{section}.{name}"] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return out


class TensorBoardWriter:
    def __init__(self, log_dir: Path):
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as e:  # tensorboard is an optional extra
            from trainer.contract.config import ConfigError

            raise ConfigError(
                "--tensorboard", f"needs the tensorboard package: pip install 'gptop[tensorboard]' ({e})"
            ) from None
        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self._api_pb2, self._hp_meta, self._hp_data = api_pb2, metadata, plugin_data_pb2
        self._w = EventFileWriter(str(log_dir))
        self._lock = threading.Lock()
        self._metrics = RunMetrics()
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
        meta = self._summary_pb2.SummaryMetadata(
            plugin_data=self._summary_pb2.SummaryMetadata.PluginData(
                plugin_name=self._hp_meta.PLUGIN_NAME, content=content.SerializeToString()
            )
        )
        return self._summary_pb2.Summary(value=[self._summary_pb2.Summary.Value(tag=tag, metadata=meta)])

    def _write_hparams(self) -> None:
        api, data = self._api_pb2, self._hp_data
        hparams = flat_hparams(self._metrics.config or {})
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
        experiment = api.Experiment(
            hparam_infos=infos, metric_infos=[api.MetricInfo(name=api.MetricName(tag=t)) for t in FINAL_METRICS]
        )
        step = self._metrics.step or 0
        self._add(self._plugin_summary(self._hp_meta.EXPERIMENT_TAG, experiment=experiment), step)
        self._add(self._plugin_summary(self._hp_meta.SESSION_START_INFO_TAG, session_start_info=start), step)
        for tag, value in self._metrics.final.items():
            self.add_scalar(tag, value, step)
        status = STATUS[self._metrics.status]  # still "running" at close: ended without a word
        end = data.SessionEndInfo(status=api.Status.Value(status), end_time_secs=time.time())
        self._add(self._plugin_summary(self._hp_meta.SESSION_END_INFO_TAG, session_end_info=end), step)

    # ------------------------------------------------------------------ events
    def on_event(self, event: Event) -> None:
        with self._lock:
            if not self._closed:
                self._on_event(event)

    def _on_event(self, event: Event) -> None:
        scalars = self._metrics.feed(event)
        if scalars is not None:
            for tag, value in scalars.values.items():
                self.add_scalar(tag, value, scalars.step, scalars.time)

    def close(self) -> None:
        """Write the hparams with the final metrics (when a trainer said hello) and close the file."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._metrics.config is not None:
                self._write_hparams()
            self._w.close()
