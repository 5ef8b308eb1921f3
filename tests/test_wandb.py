"""`--wandb`: the W&B run a session's events become.

A fake `wandb` module checks the mapping (the training step as the `step` metric, config, summary,
finish); a real offline run (WANDB_MODE=offline, no network) checks W&B writes its run directory;
and gptop refuses `--wandb` without the package before anything starts.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from typing import Any

import pytest

from helpers import ROOT, TINY, gptop_cmd, gptop_env
from fixtures.streams import cpu_run, step_event
from gptop.run_metrics import FINAL_METRICS
from gptop.wandb_writer import WandbWriter
from trainer.contract import events as ev
from trainer.contract.device import DeviceInfo

CONFIG = {"model": {"model": "llama", "size": "tiny"}, "optim": {"lr": 3e-4, "max_steps": 20}, "run": {"device": "cpu"}}


class FakeConfig(dict):
    def update(self, values: dict, allow_val_change: bool = False) -> None:
        assert allow_val_change
        super().update(values)


class FakeRun:
    def __init__(self, **kwargs: Any):
        self.init = kwargs
        self.config = FakeConfig(kwargs["config"])
        self.summary: dict[str, Any] = {}
        self.logged: list[dict[str, float]] = []
        self.metrics: list[tuple[str, str | None]] = []
        self.exit_code: int | None = None

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.metrics.append((name, step_metric))

    def log(self, data: dict[str, float]) -> None:
        assert self.exit_code is None, "logged after finish"
        self.logged.append(dict(data))

    def finish(self, exit_code: int | None = None) -> None:
        self.exit_code = exit_code


@pytest.fixture
def fake_wandb(monkeypatch) -> list[FakeRun]:
    runs: list[FakeRun] = []
    module = types.ModuleType("wandb")
    module.Settings = lambda **kw: kw
    module.init = lambda **kw: runs.append(FakeRun(**kw)) or runs[-1]

    def teardown(exit_code: int | None = None) -> None:  # after finish: the record file is complete
        assert runs and all(r.exit_code is not None for r in runs), "teardown before finish"
        module.torn_down = True

    module.teardown = teardown
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


def step(n: int, rank: int = 0, loss: float = 3.0) -> ev.StepEvent:
    return step_event(
        n,
        rank=rank,
        step_ms=10.0,
        phases={"forward": 4.0},
        tokens_per_step=256,
        mfu=0.25,
        mem=1 << 20,
        loss=loss,
        lr=1e-3,
        grad_norm=1.0,
        tokens_per_s=1000.0 + n,
    )


def device(util: float) -> ev.DeviceEvent:
    return ev.DeviceEvent(mode="gpu", devices=[ev.GpuReading(index=0, util_pct=util, mem_used=10)])


def test_events_become_step_keyed_logs_config_and_summary(tmp_path, fake_wandb):
    run_dir = tmp_path / "runs" / "exp1"
    w = WandbWriter(run_dir, CONFIG)
    (run,) = fake_wandb
    assert run.init["name"] == "exp1" and run.init["dir"] == str(run_dir) and run.init["config"] == CONFIG
    assert run.init["settings"]["console"] == "off"  # never wraps stdout/stderr under the TUI
    assert ("*", "step") in run.metrics  # every chart on the training step
    newer = {**CONFIG, "optim": {"lr": 1e-3, "max_steps": 20}, "run": {"device": "cpu", "channel": "unix:/tmp/c.sock"}}
    w.on_event(ev.HelloEvent(rank=0, config=newer, device=DeviceInfo(type="cpu", name="cpu"), model=ev.ModelInfo()))
    w.on_event(device(10.0))
    w.on_event(device(30.0))
    w.on_event(step(5))
    w.on_event(step(5, rank=1, loss=9.0))  # other ranks' step events: not logged
    w.on_event(ev.EvalEvent(step=5, loss=2.5))
    w.on_event(device(50.0))
    w.on_event(step(2, loss=2.0))  # a restart: the step axis goes back, still logged
    w.close()
    assert [row["step"] for row in run.logged] == [5, 5, 2]
    first = run.logged[0]
    assert first["train/loss"] == 3.0 and first["phases_ms/forward"] == 4.0
    assert first["gpu0/util_pct"] == 20.0  # the interval's mean, at the step that ends it
    assert run.logged[1] == {"step": 5, "eval/loss": 2.5}
    assert run.logged[2]["gpu0/util_pct"] == 50.0 and run.logged[2]["train/loss"] == 2.0
    assert run.config["optim"]["lr"] == 1e-3  # the newest trainer start's config
    assert run.config["run"] == {"device": "cpu"}  # without the event socket's path (plumbing)
    assert set(run.summary) == set(FINAL_METRICS) | {"status"}
    assert run.summary["final/loss"] == 2.0 and run.summary["final/eval_loss"] == 2.5
    assert run.summary["status"] == "running" and run.exit_code == 0
    assert sys.modules["wandb"].torn_down  # W&B's service has written everything
    w.on_event(step(6))  # after close: ignored, not an error
    w.close()
    assert len(run.logged) == 3


def test_a_failed_run_finishes_with_a_failure(tmp_path, fake_wandb):
    w = WandbWriter(tmp_path / "r", CONFIG)
    w.on_event(step(1))
    w.on_event(ev.ErrorEvent(kind="oom", message="boom"))
    w.close()
    assert fake_wandb[0].summary["status"] == "failure" and fake_wandb[0].exit_code == 1


def test_a_refused_wandb_init_is_a_usage_error_naming_the_way_out(tmp_path, fake_wandb, monkeypatch):
    from trainer.contract.config import ConfigError

    def refuse(**kw):
        raise RuntimeError("No API key configured")

    monkeypatch.setattr(sys.modules["wandb"], "init", refuse)
    with pytest.raises(ConfigError) as e:
        WandbWriter(tmp_path / "r", CONFIG)
    assert e.value.option == "--wandb" and "No API key" in e.value.message and "WANDB_MODE=offline" in e.value.message


def test_gptop_refuses_wandb_without_the_package_before_starting(tmp_path, monkeypatch, capsys):
    from gptop import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    monkeypatch.setitem(sys.modules, "wandb", None)  # and an import fails too
    monkeypatch.setattr(cli, "Session", None)  # nothing may be started
    run_dir = tmp_path / "run"
    code = cli.main(["--no-ui", "train", "--size", "tiny", "--wandb", "--run-dir", str(run_dir)])
    assert code == 2
    err = capsys.readouterr().err
    assert "--wandb" in err and "pip install -e '.[wandb]'" in err
    assert not run_dir.exists()


@pytest.mark.slow
@pytest.mark.process  # wandb.init starts W&B's service process
def test_offline_run_writes_its_run_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run_dir = tmp_path / "cpu-run"
    run_dir.mkdir()
    events = cpu_run(40)
    w = WandbWriter(run_dir, events[0].config)
    for event in events:
        w.on_event(event)
    w.close()
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (log,) = offline.glob("run-*.wandb")  # offline, W&B keeps the run in one record file for `wandb sync`
    data = log.read_bytes()
    assert b"cpu-run" in data and b"max_steps" in data  # the run's name and config
    assert b"train/loss" in data and b"cpu/util_pct" in data  # history rows
    assert b"final/step" in data and b"status" in data  # the summary, written at close
    assert (offline / "files").is_dir() and (offline / "logs").is_dir()


@pytest.mark.slow
@pytest.mark.process
def test_gptop_train_wandb_offline(tmp_path):
    pytest.importorskip("wandb")
    run_dir = tmp_path / "r"
    env = gptop_env(WANDB_MODE="offline", WANDB_DIR=str(tmp_path))
    env.pop("WANDB_API_KEY", None)
    r = subprocess.run(
        gptop_cmd(
            "--no-ui",
            "--interval",
            "0.1",
            "train",
            *TINY,
            "--max-steps",
            "4",
            "--eval-every",
            "2",
            "--wandb",
            "--run-dir",
            str(run_dir),
        ),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (log,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = log.read_bytes()
    assert b"train/loss" in data and b"eval/loss" in data and b"final/eval_loss" in data
    assert b'"success"' in data  # the summary's status, at close
