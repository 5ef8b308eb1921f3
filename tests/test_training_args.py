"""The toggles <-> TrainingArguments mapping of `gptop tune -- CMD` (trainer.contract.training_args)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from trainer.contract.client import TOGGLES_ENV, ClientEnv, parse_toggles
from trainer.contract.config import ConfigError, Toggles
from trainer.contract.device import DeviceInfo
from trainer.contract.training_args import (
    COMMAND_PREFETCH,
    FROZEN,
    TUNED,
    args_fields,
    fields_in_words,
    per_device_batch,
    read_fields,
    start_fields,
    start_toggles,
    tunable,
)
from tuner.command_space import command_space
from tuner.space import SearchSpace, micro_batch_choices


def fields(**kw):
    base = {
        "bf16": False,
        "fp16": False,
        "tf32": None,
        "torch_compile": False,
        "torch_compile_mode": None,
        "torch_compile_backend": None,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 4,
        "dataloader_num_workers": 0,
        "dataloader_prefetch_factor": None,
        "optim": "adamw_torch_fused",
        "gradient_checkpointing": False,
    }
    base.update(kw)
    return base


def apply(f, change):
    return {**f, **change}


CPU = DeviceInfo(type="cpu", name="test CPU", has_compiler=True)
GPU = DeviceInfo(type="cuda", name="NVIDIA H100", capability=(9, 0), has_compiler=True)
OLD_GPU = DeviceInfo(type="cuda", name="Tesla V100", capability=(7, 0), has_compiler=True)


@pytest.mark.parametrize("per_device,accum", [(4, 4), (16, 1), (1, 16), (6, 2), (3, 1)])
def test_every_micro_batch_keeps_the_global_batch(per_device, accum):
    f = fields(per_device_train_batch_size=per_device, gradient_accumulation_steps=accum)
    batch = per_device * accum
    for mb in micro_batch_choices(batch) + (per_device,):
        t = dataclasses.replace(start_toggles(f), micro_batch=mb)
        got = apply(f, args_fields(t, f))
        assert got["per_device_train_batch_size"] == mb
        assert got["per_device_train_batch_size"] * got["gradient_accumulation_steps"] == batch
        assert per_device_batch(got) == batch
    with pytest.raises(ValueError, match="does not divide"):
        args_fields(dataclasses.replace(start_toggles(f), micro_batch=batch * 2 + 1), f)


def test_the_start_maps_to_no_change_and_back():
    for f in (
        fields(),
        fields(
            bf16=True,
            torch_compile=True,
            torch_compile_mode="max-autotune",
            dataloader_num_workers=2,
            dataloader_prefetch_factor=4,
            optim="adamw_torch",
            gradient_checkpointing=True,
        ),
        fields(tf32=True),
        fields(fp16=True),
    ):
        t = start_toggles(f)
        assert args_fields(t, f) == {}
        for name in TUNED:
            assert getattr(start_toggles(apply(f, args_fields(t, f))), name) == getattr(t, name)


SCRIPTS = (
    fields(),
    fields(
        bf16=True,
        torch_compile=True,
        torch_compile_mode="max-autotune",
        dataloader_num_workers=2,
        dataloader_prefetch_factor=4,
        optim="adamw_torch",
        gradient_checkpointing=True,
    ),
    fields(fp16=True, per_device_train_batch_size=1, gradient_accumulation_steps=16),
)


@pytest.mark.parametrize("f", SCRIPTS)
def test_a_scripts_fields_from_its_hello_say_the_same_changes(f):
    """best.toml of `gptop tune -- CMD` names the TrainingArguments to set from what the script's hello said (its
    start as toggles and its per-device batch): the fields rebuilt from those give the same changes, in words,
    as the script's own arguments would."""
    start, batch = start_toggles(f), per_device_batch(f)
    assert start_toggles(start_fields(start, batch)) == start
    assert fields_in_words(start, start, batch) == ""
    for best in (
        dataclasses.replace(start, precision="bf16", micro_batch=batch, workers=1),
        dataclasses.replace(start, compile="default", fused_adamw=not start.fused_adamw),
        dataclasses.replace(start, activation_checkpointing=not start.activation_checkpointing, prefetch=1, workers=2),
    ):
        words = ", ".join(f"{k}={v!r}" for k, v in args_fields(best, f).items())
        assert fields_in_words(best, start, batch) == words and words
    assert fields_in_words(dataclasses.replace(start, micro_batch=batch * 2 + 1), start, batch) is None


def test_each_toggle_sets_its_fields():
    f = fields(tf32=True)
    t = start_toggles(f)
    assert t.precision == "tf32"
    assert args_fields(dataclasses.replace(t, precision="bf16"), f) == {"bf16": True}  # tf32 kept for fp32 matmuls
    assert args_fields(dataclasses.replace(t, precision="fp32"), f) == {"tf32": False}
    assert args_fields(dataclasses.replace(t, precision="fp16"), f) == {"fp16": True}
    assert args_fields(dataclasses.replace(t, compile="default"), f) == {"torch_compile": True}
    assert args_fields(dataclasses.replace(t, compile="reduce-overhead"), f) == {
        "torch_compile": True,
        "torch_compile_mode": "reduce-overhead",
    }
    compiled = fields(torch_compile=True, torch_compile_backend="inductor", torch_compile_mode="default")
    assert start_toggles(compiled).compile == "default"
    assert args_fields(dataclasses.replace(start_toggles(compiled), compile="off"), compiled) == {
        "torch_compile": False,
        "torch_compile_mode": None,
        "torch_compile_backend": None,
    }
    assert args_fields(dataclasses.replace(t, workers=2, prefetch=4), f) == {
        "dataloader_num_workers": 2,
        "dataloader_prefetch_factor": 4,
    }
    # no workers: no prefetch factor (a DataLoader refuses one)
    w = fields(dataloader_num_workers=2, dataloader_prefetch_factor=4)
    assert args_fields(dataclasses.replace(start_toggles(w), workers=0), w) == {
        "dataloader_num_workers": 0,
        "dataloader_prefetch_factor": None,
    }
    assert args_fields(dataclasses.replace(t, fused_adamw=False), f) == {"optim": "adamw_torch"}
    assert args_fields(dataclasses.replace(t, activation_checkpointing=True), f) == {"gradient_checkpointing": True}


def test_what_no_field_holds_is_refused():
    f = fields()
    t = start_toggles(f)
    with pytest.raises(ValueError, match="precision=fp8-rowwise"):
        args_fields(dataclasses.replace(t, precision="fp8-rowwise"), f)
    for name, value in (("attention", "eager"), ("cuda_allocator", "expandable_segments"), ("optimizer", "adafactor")):
        with pytest.raises(ValueError, match=name):
            args_fields(dataclasses.replace(t, **{name: value}), f)
    other = fields(optim="adafactor")
    assert "fused_adamw" not in tunable(other) and "fused_adamw" in tunable(f)
    assert start_toggles(other).optimizer == "adafactor"
    with pytest.raises(ValueError, match="adafactor"):
        args_fields(dataclasses.replace(start_toggles(other), fused_adamw=not start_toggles(other).fused_adamw), other)


def test_read_fields_of_real_training_arguments(tmp_path):
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=8,
        use_cpu=True,
        report_to="none",
        optim="adamw_torch",
    )
    f = read_fields(args)
    assert f["optim"] == "adamw_torch" and per_device_batch(f) == 16
    t = dataclasses.replace(start_toggles(f), micro_batch=8, fused_adamw=True, workers=1, prefetch=2)
    tuned = dataclasses.replace(args, **args_fields(t, f))
    assert (tuned.per_device_train_batch_size, tuned.gradient_accumulation_steps) == (8, 2)
    assert tuned.optim.value == "adamw_torch_fused" and tuned.dataloader_num_workers == 1
    assert start_toggles(read_fields(tuned)) == t


def space_for(f, dev, spec=None, tunable_names=None):
    start = start_toggles(f)
    space = SearchSpace.for_device(start, dev, per_device_batch(f))
    return command_space(space, dev, tunable_names if tunable_names is not None else tunable(f), spec)


@pytest.mark.parametrize("dev", [CPU, GPU, OLD_GPU], ids=["cpu", "h100", "v100"])
def test_the_command_space_respects_the_device_and_the_fields(dev):
    f = fields()
    space = space_for(f, dev)
    for name in FROZEN:
        assert name not in space.params
    assert set(space.choices["precision"]) <= {"fp32", "tf32", "bf16", "fp16"}
    if dev is CPU:
        assert "fp16" not in space.choices["precision"] and "tf32" not in space.choices["precision"]
    if dev is OLD_GPU:
        assert "bf16" not in space.choices["precision"] and "tf32" not in space.choices["precision"]
    if dev is GPU:
        assert {"bf16", "tf32", "fp16"} <= set(space.choices["precision"])
    assert 0 not in space.choices["prefetch"] and set(COMMAND_PREFETCH) <= set(space.choices["prefetch"])
    # every point of the space maps to fields the script can take, with its batch
    for params in space.all_params():
        t = space.to_toggles(params)
        got = apply(f, args_fields(t, f))
        assert per_device_batch(got) == per_device_batch(f)


def test_tune_space_pins_and_refuses_what_a_command_cannot_change():
    f = fields()
    space = space_for(f, CPU, "-all micro_batch=2,4 workers=0,1")
    assert space.params == ("micro_batch", "workers")
    assert space_for(f, CPU, "micro_batch=8").choices["micro_batch"] == (8,)
    assert "fused_adamw" not in space_for(fields(optim="adafactor"), CPU).params
    for spec, what in (
        ("attention=eager", "attention"),
        ("-cuda_allocator", "cuda_allocator"),
        ("prefetch=0,2", "prefetch"),
    ):
        with pytest.raises(ConfigError, match=what):
            space_for(f, CPU, spec)
    with pytest.raises(ConfigError, match="does not divide"):
        space_for(f, CPU, "micro_batch=3")


def test_toggles_travel_in_the_environment(tmp_path: Path):
    t = Toggles(precision="bf16", micro_batch=4, workers=2)
    env = ClientEnv(channel="unix:/x", run_dir=tmp_path, tune=True, toggles=t, resume="/ck/checkpoint-7")
    back = ClientEnv.from_environ(env.to_environ())
    assert back == env
    assert ClientEnv.from_environ({**env.to_environ(), TOGGLES_ENV: ""}).toggles is None
    for bad in ("{", "[1]", json.dumps({"micro_batch": 0}), json.dumps({"nope": 1})):
        with pytest.raises(ConfigError, match=TOGGLES_ENV):
            parse_toggles(bad)
    with pytest.raises(ConfigError, match="GPTOP_TUNE"):
        ClientEnv.from_environ({**env.to_environ(), "GPTOP_TUNE": "yes"})


def test_a_prefetch_factor_without_workers_is_one_configuration(tmp_path):
    """dataloader_prefetch_factor acts only with workers: with workers=0 every prefetch value runs the same
    TrainingArguments, so the space counts them once and the study never runs a second of them."""
    from trainer.contract.config import TrainConfig
    from tuner.study import TuneStudy

    f = fields()
    space = space_for(f, CPU, "-all workers=0,1 prefetch=1,2,4")
    assert space.params == ("prefetch", "workers") and space.size() == 1 + 3  # workers=0 once, 1 x 3
    idle = [space.to_params(dataclasses.replace(space.base, workers=0, prefetch=p)) for p in (1, 2, 4)]
    assert len({space.config_key(p) for p in idle}) == 1
    assert {json.dumps(args_fields(space.to_toggles(p), f), sort_keys=True) for p in idle} == {"{}"}
    busy = [space.to_params(dataclasses.replace(space.base, workers=1, prefetch=p)) for p in (1, 2, 4)]
    assert len({space.config_key(p) for p in busy}) == 3

    study = TuneStudy.open(TrainConfig(), CPU, space, storage=f"journal:{tmp_path}/tuning.log", seed=0)
    seen = []
    while (p := study.ask()) is not None:
        seen.append(p.toggles)
        study.tell_ok(
            p, {"tokens_per_s": 100.0 + len(seen), "spread": 1.0, "samples": [100.0] * 3, "peak_mem": 1, "steps": 10}
        )
    assert len(seen) == 4 and sum(t.workers == 0 for t in seen) == 1
    assert study.warm_start([(dataclasses.replace(space.base, workers=0, prefetch=4), "recipe")]) == []


def test_every_toggle_reaches_real_training_arguments_through_tuned_args(tmp_path, monkeypatch):
    """Through the installed transformers' own TrainingArguments (its `__post_init__` resolves aliases on a
    copy: transformers 5 made `gradient_checkpointing` a mirror of `activation_checkpointing`), each toggle
    gptop hands over is what the Trainer gets, and the run-time check agrees; arguments changed after
    tuned_args are refused naming the field."""
    pytest.importorskip("transformers")
    from transformers import TrainerState, TrainingArguments

    from gptop.integrations import transformers as gi

    base = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=8,
        use_cpu=True,
        report_to="none",
        optim="adamw_torch",
    )
    start = start_toggles(read_fields(base))
    changes = [
        dict(micro_batch=8),
        dict(micro_batch=1),
        dict(workers=1, prefetch=4),
        dict(workers=2),
        dict(prefetch=4),
        dict(fused_adamw=True),
        dict(activation_checkpointing=True),
        dict(compile="default"),
        dict(compile="max-autotune-no-cudagraphs"),
        dict(micro_batch=4, workers=1, prefetch=1, fused_adamw=True, activation_checkpointing=True),
    ]
    for change in changes:
        t = dataclasses.replace(start, **change)
        env = ClientEnv(channel=f"unix:{tmp_path / 'gptop.sock'}", run_dir=tmp_path, tune=True, toggles=t)
        for k, v in env.to_environ().items():
            monkeypatch.setenv(k, v)
        args = gi.tuned_args(base)
        assert gi.resume_checkpoint(args) is None
        assert args_fields(t, read_fields(args)) == {}, change
        got = start_toggles(read_fields(args))
        for name, value in change.items():
            if name != "prefetch" or t.workers:  # a prefetch factor without workers is idle
                assert getattr(got, name) == value, (change, name)
        if t.activation_checkpointing:
            assert args.activation_checkpointing is True and args.gradient_checkpointing is True
        assert gi.tuning_refusal(ClientEnv.from_environ(), args, TrainerState()) is None, change
    env = ClientEnv(
        channel=f"unix:{tmp_path / 'gptop.sock'}",
        run_dir=tmp_path,
        tune=True,
        toggles=dataclasses.replace(start, workers=1, activation_checkpointing=True),
    )
    why = gi.tuning_refusal(env, base, TrainerState())
    assert why and "dataloader_num_workers" in why and "activation_checkpointing" in why


def test_an_fp32_trial_of_a_compiled_script_is_fp32_and_a_tf32_start_says_tf32():
    """TrainingArguments turns TF32 on for a compiled fp32 model where the GPU has it (tf32 left None): a trial
    labelled fp32 would then run TF32. So fp32 with compile asks tf32=False, and a start whose fp32 matmuls
    use TF32 (the client reads it from torch) is tf32, for the numerics check and the MFU column alike."""
    f = fields()  # fp32, compile off, tf32 not set
    t = start_toggles(f)
    assert t.precision == "fp32" and args_fields(t, f) == {}
    assert args_fields(dataclasses.replace(t, compile="default"), f) == {"torch_compile": True, "tf32": False}
    compiled = fields(torch_compile=True)
    assert start_toggles(compiled).precision == "fp32"  # a CPU: no TF32 there
    on_gpu = start_toggles(compiled, tf32_on=True)
    assert on_gpu.precision == "tf32"
    assert args_fields(on_gpu, compiled) == {"tf32": True}  # what TrainingArguments did anyway, now said
    assert args_fields(dataclasses.replace(on_gpu, precision="fp32"), compiled) == {"tf32": False}
    assert args_fields(dataclasses.replace(on_gpu, precision="bf16"), compiled) == {"bf16": True}
    after = apply(compiled, {"tf32": False})
    assert args_fields(dataclasses.replace(on_gpu, precision="fp32"), after) == {}  # tuned_args's result agrees
