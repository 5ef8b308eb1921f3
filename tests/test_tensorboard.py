"""`--tensorboard`: the event files, read back with TensorBoard's own EventAccumulator.

Checks the step axis (device readings on the training step, rank 0's step events only), the
hparams (the resolved configuration, the final metrics, the session's status) and, in the slow
test, a real `gptop --no-ui train --tensorboard` whose scalars match its events.jsonl.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.plugins.hparams import metadata as hp_metadata  # noqa: E402
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2  # noqa: E402

from helpers import ROOT, TINY, gptop_cmd, gptop_env  # noqa: E402
from fixtures.streams import step_event  # noqa: E402
from gptop.tensorboard import FINAL_METRICS, TensorBoardWriter, flat_hparams  # noqa: E402
from trainer.contract import events as ev  # noqa: E402
from trainer.contract.device import DeviceInfo  # noqa: E402

CONFIG = {
    "model": {"model": "llama", "size": "tiny", "dropout": None},
    "toggles": {"precision": "bf16", "compile": "off", "fused_adamw": True, "micro_batch": 4},
    "optim": {"lr": 3e-4, "max_steps": 20},
    "run": {"channel": "unix:/tmp/x/channel.sock", "device": "cpu"},
}


def read(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def series(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(s.step, s.value) for s in acc.Scalars(tag)]


def hparams_records(acc: EventAccumulator) -> dict[str, plugin_data_pb2.HParamsPluginData]:
    try:
        content = acc.PluginTagToContent(hp_metadata.PLUGIN_NAME)
    except KeyError:  # no record of that plugin in the files
        return {}
    return {tag: plugin_data_pb2.HParamsPluginData.FromString(data) for tag, data in content.items()}


def hello(rank: int = 0) -> ev.HelloEvent:
    return ev.HelloEvent(rank=rank, config=CONFIG, device=DeviceInfo(type="cpu", name="cpu"), model=ev.ModelInfo())


def step(n: int, rank: int = 0, loss: float = 3.0) -> ev.StepEvent:
    return step_event(
        n,
        rank=rank,
        step_ms=10.0,
        phases={p: 2.0 for p in ev.PHASES},
        tokens_per_step=256,
        mfu=0.25,
        mem=1 << 20,
        loss=loss,
        lr=1e-3,
        grad_norm=1.0,
        tokens_per_s=1000.0 + n,
    )


def device(util: float, power: float | None = 300.0) -> ev.DeviceEvent:
    return ev.DeviceEvent(
        mode="gpu",
        devices=[ev.GpuReading(index=0, util_pct=util, power_w=power, mem_used=10)],
        cpu=ev.CpuReading(util_pct=util / 2, mem_used=5),
    )


def test_device_scalars_are_interval_means_on_the_step_axis(tmp_path):
    w = TensorBoardWriter(tmp_path)
    w.on_event(hello())
    w.on_event(device(10.0))  # before the first step: belongs to the interval ending at 10
    w.on_event(device(30.0, power=None))  # a missing reading is left out of the mean, not counted as 0
    w.on_event(step(10))
    w.on_event(step(10, rank=1, loss=99.0))  # another rank's step event: not written
    w.on_event(device(50.0))
    w.on_event(device(70.0))
    w.on_event(device(90.0))
    w.on_event(step(20, loss=2.0))
    w.on_event(device(0.0))  # after the last step: no step to put it on
    w.close()
    acc = read(tmp_path)
    assert series(acc, "gpu0/util_pct") == [(10, 20.0), (20, 70.0)]
    assert series(acc, "gpu0/power_w") == [(10, 300.0), (20, 300.0)]
    assert series(acc, "cpu/util_pct") == [(10, 10.0), (20, 35.0)]
    assert series(acc, "train/loss") == [(10, 3.0), (20, 2.0)]
    assert [s for s, _ in series(acc, "phases_ms/forward")] == [10, 20]
    # every scalar but the final metrics shares the training step axis
    tags = acc.Tags()["scalars"]
    assert {s for t in tags if not t.startswith("final/") for s, _ in series(acc, t)} == {10, 20}


def test_hparams_hold_the_configuration_and_the_final_metrics(tmp_path):
    w = TensorBoardWriter(tmp_path)
    w.on_event(hello(rank=1))  # only rank 0's configuration counts
    w.on_event(hello())
    w.on_event(step(10))
    w.on_event(ev.EvalEvent(step=10, loss=2.75))
    w.on_event(step(20, loss=2.5))
    w.on_event(ev.DoneEvent(step=20, tokens=5120, reason="max_steps"))
    w.close()
    w.close()  # idempotent
    acc = read(tmp_path)
    records = hparams_records(acc)
    experiment = records[hp_metadata.EXPERIMENT_TAG].experiment
    start = records[hp_metadata.SESSION_START_INFO_TAG].session_start_info
    end = records[hp_metadata.SESSION_END_INFO_TAG].session_end_info
    assert [m.name.tag for m in experiment.metric_infos] == list(FINAL_METRICS)
    assert {h.name for h in experiment.hparam_infos} == set(start.hparams) == set(flat_hparams(CONFIG))
    assert "model.dropout" not in start.hparams  # None: no such value in TensorBoard
    assert "run.channel" not in start.hparams and start.hparams["run.device"].string_value == "cpu"
    assert start.hparams["toggles.precision"].string_value == "bf16"
    assert start.hparams["toggles.fused_adamw"].bool_value is True
    assert start.hparams["optim.lr"].number_value == pytest.approx(3e-4)
    assert start.hparams["toggles.micro_batch"].number_value == 4
    assert end.status == api_pb2.Status.Value("STATUS_SUCCESS")
    final = {t: series(acc, t) for t in FINAL_METRICS}
    assert final["final/loss"] == [(20, 2.5)] and final["final/eval_loss"] == [(20, 2.75)]
    assert final["final/step"] == [(20, 20.0)] and final["final/tokens_per_s"] == [(20, 1020.0)]
    assert final["final/mfu"][0][1] == pytest.approx(0.25)


def test_a_failed_run_ends_as_failure_and_no_hello_writes_no_hparams(tmp_path):
    w = TensorBoardWriter(tmp_path / "a")
    w.on_event(hello())
    w.on_event(ev.ErrorEvent(kind="oom", message="out of memory"))
    w.close()
    end = hparams_records(read(tmp_path / "a"))[hp_metadata.SESSION_END_INFO_TAG].session_end_info
    assert end.status == api_pb2.Status.Value("STATUS_FAILURE")
    w = TensorBoardWriter(tmp_path / "b")  # the trainer never started: nothing to describe
    w.close()
    assert hparams_records(read(tmp_path / "b")) == {}


@pytest.mark.slow
@pytest.mark.process
def test_gptop_train_tensorboard_matches_events(tmp_path):
    run_dir = tmp_path / "r"
    r = subprocess.run(
        gptop_cmd(
            "--no-ui",
            "--interval",
            "0.1",
            "train",
            *TINY,
            "--max-steps",
            "6",
            "--eval-every",
            "3",
            "--tensorboard",
            "--run-dir",
            str(run_dir),
        ),
        cwd=ROOT,
        env=gptop_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["type"] == "step"]
    acc = read(run_dir / "tensorboard")
    loss = series(acc, "train/loss")
    assert [s for s, _ in loss] == [e["step"] for e in steps] == list(range(1, 7))
    assert [v for _, v in loss] == pytest.approx([e["loss"] for e in steps])
    cpu = series(acc, "cpu/util_pct")
    assert cpu and {s for s, _ in cpu} <= set(range(1, 7))  # on the step axis, not milliseconds
    start = hparams_records(acc)[hp_metadata.SESSION_START_INFO_TAG].session_start_info
    assert start.hparams["optim.max_steps"].number_value == 6 and start.hparams["model.size"].string_value == "tiny"
    assert series(acc, "final/step") == [(6, 6.0)]
    assert series(acc, "final/eval_loss")[0][1] == pytest.approx([e for e in events if e["type"] == "eval"][-1]["loss"])
