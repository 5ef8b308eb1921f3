"""trainer.contract.estimate: what a run will cost before it is built (issue 11 §2), and the refusals.

The analytic parameter counts and FLOPs are checked against the real models (built on the meta device, so
no memory is spent) for every family and size; the memory refusal is checked where it happens: in gptop
before a trainer starts, and in the trainer (`python -m trainer`) before anything is built."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from trainer.contract import estimate as E
from trainer.contract.device import DeviceInfo

GiB = 1 << 30


@pytest.mark.parametrize("family", E.FAMILIES)
@pytest.mark.parametrize("size", E.SIZE_ORDER)
def test_params_and_flops_match_the_real_model(family, size):
    import torch

    from trainer.models import _model_class, count_params, hf_config, training_flops_per_token, vocab_and_mask

    vocab, _ = vocab_and_mask(family, E.DEFAULT_VOCAB, None)
    cfg = hf_config(family, size, vocab_size=vocab, seq_len=512)
    with torch.device("meta"):
        model = _model_class(family)(cfg)
    real = count_params(model, cfg)
    est = E.param_counts(family, size)
    assert (est.total, est.active, est.embedding) == (real["total"], real["active"], real["embedding"])
    assert E.flops_per_token(family, size, 512) == training_flops_per_token(model, cfg, 512)
    assert E.padded_vocab(family) == vocab


def test_the_sizes_are_the_models_sizes():
    from trainer import models

    assert models.SIZES is E.SIZES and models.SIZE_ORDER == E.SIZE_ORDER


def test_memory_is_state_plus_activations_plus_runtime():
    est = E.estimate("llama", "small", seq_len=256, global_batch=16, micro_batch=None, capacity=None)
    assert est.state_bytes == 16 * est.total_params
    assert est.micro_batch == 1                      # auto: the first probe's
    eight = E.estimate("llama", "small", seq_len=256, global_batch=16, micro_batch=8, capacity=None)
    assert eight.activation_bytes == 8 * est.activation_bytes
    assert est.total_bytes == est.state_bytes + est.activation_bytes + E.RUNTIME_BYTES["cpu"]
    assert est.fits and est.step_s is None          # no capacity: nothing to refuse; no peak: no time
    bf16 = E.estimate("llama", "small", seq_len=256, global_batch=16, micro_batch=8, precision="bf16")
    assert bf16.activation_bytes < eight.activation_bytes
    ckpt = E.estimate("llama", "small", seq_len=256, global_batch=16, micro_batch=8, checkpointing=True)
    assert ckpt.activation_bytes < eight.activation_bytes / 4
    fsdp = E.estimate("llama", "small", seq_len=256, global_batch=16, micro_batch=8, world_size=4, fsdp=True)
    assert fsdp.state_bytes == est.state_bytes // 4


def test_activation_estimate_is_within_a_factor_of_the_measured_peak_of_a_tiny_run():
    # Measured on this project's CPU (BENCHMARKS.md): llama tiny, micro-batch 16, seq 256: peak RSS 1.6 GB,
    # of which about 0.75 GiB is the runtime (torch, the data).
    est = E.estimate("llama", "tiny", seq_len=256, global_batch=16, micro_batch=16)
    assert 0.6 < est.total_bytes / (1.6 * 1e9) < 1.5


def test_step_time_from_the_peak_and_the_assumed_mfu():
    est = E.estimate("llama", "tiny", seq_len=256, global_batch=16, micro_batch=16, peak_flops=1e11)
    assert est.step_s == pytest.approx(est.flops_per_token * 16 * 256 / (1e11 * E.ASSUMED_MFU))
    assert not est.slow
    big = E.estimate("deepseek", "medium", seq_len=256, global_batch=16, micro_batch=None, peak_flops=2e11,
                     capacity=24 * GiB)
    assert big.slow and big.fits
    assert big.summary("this CPU").startswith("deepseek medium on this CPU: ~14.")
    assert "min per step" in big.summary("this CPU")
    two = E.estimate("deepseek", "medium", seq_len=256, global_batch=16, micro_batch=None, peak_flops=2e11,
                     world_size=2)
    assert two.step_s == pytest.approx(big.step_s / 2)


def test_refusal_names_the_estimate_and_the_largest_size_that_fits():
    kw = dict(seq_len=256, global_batch=16, micro_batch=None, capacity=24 * GiB)
    est = E.estimate("deepseek", "large", **kw)
    assert not est.fits and est.capacity == int(24 * GiB * E.USABLE_SHARE)
    assert E.largest_fitting("deepseek", **kw) == "medium"
    line = E.refusal(est, "this CPU", "medium")
    assert "deepseek large on this CPU: ~43" in line and "does not fit in 21.6 GiB usable" in line
    assert "--size medium" in line and "weights, gradients and AdamW state" in line
    assert E.largest_fitting("deepseek", **dict(kw, capacity=GiB // 2)) is None
    assert "no deepseek size fits" in E.refusal(est, "x", None)


def test_fmt_seconds():
    assert [E.fmt_seconds(x) for x in (0.25, 12.3, 250, 9000)] == ["250 ms", "12 s", "4.2 min", "2.5 h"]


@pytest.mark.process
def test_estimate_is_torch_free():
    code = ("import sys, trainer.contract.estimate as E; E.estimate('deepseek', 'large', seq_len=256, "
            "global_batch=16, micro_batch=None); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- where the refusal happens ---------------------------------------------------------------------------

def test_gptop_refuses_what_cannot_fit_before_starting_a_trainer(tmp_path, monkeypatch, capsys):
    from gptop import cli

    monkeypatch.setattr(cli, "device_memory", lambda cfg: ("cpu", "this CPU", 6 * GiB))
    monkeypatch.setattr(cli, "Session", None)        # nothing may be started
    run_dir = tmp_path / "run"
    code = cli.main(["--no-ui", "train", "--model", "llama", "--size", "medium", "--run-dir", str(run_dir)])
    assert code == 2
    err = capsys.readouterr().err
    assert "--size: llama medium on this CPU: ~6." in err and "--size small" in err
    assert not run_dir.exists()


def test_gptop_leaves_auto_sizes_and_model_directories_to_the_trainer(monkeypatch):
    from gptop import cli
    from trainer.contract.config import TrainConfig

    asked = []
    monkeypatch.setattr(cli, "device_memory", lambda cfg: asked.append(cfg) or ("cpu", "this CPU", GiB))
    ns = argparse.Namespace(nproc=1, nnodes="1", node_rank=None, rdzv_endpoint=None, rdzv_backend=None,
                            rdzv_id=None)
    cfg = TrainConfig()
    cfg.model.size = "auto"
    cli.check_fits(ns, cfg)
    cfg.model.size, cfg.model.model = "large", "./my-model"
    cli.check_fits(ns, cfg)
    assert asked == []
    cfg.model.model = "llama"
    with pytest.raises(cli.ConfigError, match="does not fit"):
        cli.check_fits(ns, cfg)


def test_the_trainer_refuses_before_building_and_says_the_early_hello_first(tmp_path):
    from trainer.contract.config import ConfigError, TrainConfig
    from trainer.contract.events import read_events
    from trainer.train import Trainer

    cfg = TrainConfig()
    cfg.model.model, cfg.model.size = "deepseek", "small"
    cfg.run.run_dir = str(tmp_path)
    small_machine = DeviceInfo(type="cpu", name="tiny box", total_memory=4 * GiB, cpu_count=2)
    trainer = Trainer(cfg, dev=small_machine)
    with pytest.raises(ConfigError, match="deepseek small on this CPU.*does not fit.*--size tiny"):
        trainer.setup()
    assert not hasattr(trainer, "bundle")            # nothing was built
    trainer.channel.close()
    (hello,) = list(read_events(tmp_path / "events.jsonl"))
    assert hello.type == "hello" and hello.early and hello.estimate["total_bytes"] > 4 * GiB
    assert hello.model.family == "deepseek" and hello.model.total_params == E.param_counts("deepseek", "small").total
