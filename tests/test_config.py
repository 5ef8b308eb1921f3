import argparse
import dataclasses

import pytest

from trainer.contract import capabilities
from trainer.contract.config import (
    ConfigError,
    Toggles,
    TrainConfig,
    add_arguments,
    cli_args,
    config_from_args,
    config_from_toml,
)
from trainer.contract.device import DeviceInfo
from trainer.contract.states import TrialStatus

CPU = DeviceInfo(type="cpu", name="Test CPU", cpu_count=2)
H100 = DeviceInfo(type="cuda", index=0, name="NVIDIA H100 80GB HBM3", capability=(9, 0), total_memory=80 * 2**30)
T4 = DeviceInfo(type="cuda", index=0, name="Tesla T4", capability=(7, 5), total_memory=16 * 2**30)


def parse(argv, base=None):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(argv), base)


def test_defaults_and_flags():
    cfg = parse(["--model", "deepseek", "--size", "tiny", "--micro-batch", "4", "--no-timing", "--no-fused-adamw"])
    assert cfg.model.model == "deepseek" and cfg.model.size == "tiny"
    assert cfg.toggles.micro_batch == 4 and cfg.toggles.fused_adamw is False
    assert cfg.log.timing is False
    assert cfg.optim.global_batch == TrainConfig().optim.global_batch


def test_toml_then_flags_override(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[toggles]\nprecision = "bf16"\nprefetch = 4\n[optim]\nlr = 0.01\n')
    cfg = parse(["--config", str(toml), "--prefetch", "1"])
    assert cfg.toggles.precision == "bf16"
    assert cfg.toggles.prefetch == 1  # the flag wins
    assert cfg.optim.lr == 0.01


def test_toml_round_trip():
    cfg = TrainConfig()
    cfg.toggles.compile = "default"
    cfg.optim.max_steps = 7
    again = TrainConfig.from_dict(__import__("tomllib").loads(cfg.to_toml()))
    assert again == cfg


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--micro-batch", "zero"], "--micro-batch"),
        (["--micro-batch", "0"], "--micro-batch"),
        (["--seq-len", "abc"], "--seq-len"),
        (["--lr", "-1"], "--lr"),
        (["--max-steps", "0"], "--max-steps"),
        (["--profile-steps", "5"], "--profile-steps"),
        (["--fault", "boom"], None),
    ],
)
def test_bad_values_name_the_flag(argv, flag):
    if flag is None:
        from trainer.faults import Faults

        with pytest.raises(ConfigError) as e:
            Faults("boom")
        assert e.value.option == "--fault"
        return
    with pytest.raises(ConfigError) as e:
        parse(argv)
    assert e.value.option == flag


def test_unknown_toml_key_is_an_error(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[toggles]\nprecison = 'bf16'\n")
    with pytest.raises(ConfigError) as e:
        parse(["--config", str(toml)])
    assert "toggles.precison" in str(e.value) and "precision" in str(e.value)


def test_cli_args_round_trip():
    cfg = parse(["--model", "llada", "--no-timing", "--compile", "default", "--lr", "0.002"])
    assert parse(cli_args(cfg)) == cfg


@pytest.mark.parametrize(
    "dev,name,value,ok",
    [
        (CPU, "precision", "fp32", True),
        (CPU, "precision", "bf16", True),
        (CPU, "precision", "fp16", False),
        (CPU, "precision", "fp8-rowwise", False),
        (CPU, "precision", "tf32", False),
        (CPU, "compile", "default", True),
        (CPU, "compile", "reduce-overhead", False),
        (CPU, "compile", "max-autotune-no-cudagraphs", True),
        (CPU, "cuda_allocator", "expandable_segments", False),
        (H100, "precision", "fp8-tensorwise", True),
        (H100, "precision", "tf32", True),
        (H100, "compile", "max-autotune", True),
        (H100, "cuda_allocator", "expandable_segments", True),
        (T4, "precision", "fp8-rowwise", False),
        (T4, "precision", "bf16", False),
        (T4, "precision", "fp16", True),
    ],
)
def test_capability_gating(dev, name, value, ok):
    reason = capabilities.support(name, value, dev)
    assert (reason is None) == ok
    if not ok:
        assert len(reason) > 10


@pytest.mark.parametrize(
    "capability, torch_version, ok",
    [
        ((8, 9), "2.6.0+cu126", False),  # Ada before its rowwise kernel
        ((8, 9), "2.7.0+cu128", True),
        ((8, 9), None, False),  # a torch not said: not known to have it
        ((9, 0), "2.5.1+cu124", True),  # Hopper: every torch gptop allows
        ((9, 0), None, True),
        ((10, 0), "2.7.1+cu128", False),  # B200 before its kernel is confirmed
        ((10, 0), "2.8.0+cu128", True),
        ((12, 0), "2.13.0+cu130", False),  # consumer Blackwell: no rowwise kernel
        ((10, 3), "2.13.0+cu130", False),  # an architecture the table does not know
    ],
)
def test_fp8_rowwise_needs_the_torch_release_that_has_its_kernel_for_the_architecture(
    monkeypatch, capability, torch_version, ok
):
    """fp8-rowwise calls torch._scaled_mm with per-row scales, which has a kernel per architecture that came with
    a torch release: gated by capability and torch version (the trainer's, carried in DeviceInfo), for the
    trainer's check, the tuner's space and the doctor's table alike; tensorwise runs on all of them."""
    from tuner.space import SearchSpace

    monkeypatch.setattr(capabilities, "_torchao_float8", lambda: True)
    dev = DeviceInfo(type="cuda", index=0, name="GPU", capability=capability, torch_version=torch_version)
    why = capabilities.support("precision", "fp8-rowwise", dev)
    assert (why is None) == ok, why
    if not ok:
        assert "fp8-tensorwise" in why and ".".join(map(str, capability)) in why
    assert capabilities.support("precision", "fp8-tensorwise", dev) is None
    assert ("fp8-rowwise" in SearchSpace.for_device(Toggles(), dev, 8).choices["precision"]) == ok
    cfg = parse(["--precision", "fp8-rowwise"])
    if ok:
        capabilities.check(cfg.toggles, dev)
    else:
        with pytest.raises(ConfigError, match="--precision"):
            capabilities.check(cfg.toggles, dev)


def test_unsupported_toggle_rejected_with_reason():
    cfg = parse(["--precision", "fp8-rowwise"])
    with pytest.raises(ConfigError) as e:
        capabilities.check(cfg.toggles, CPU)
    assert e.value.option == "--precision" and "8.9" in str(e.value)
    capabilities.check(cfg.toggles, H100)


def test_emulated_bf16_runs_but_is_flagged_slow():
    old_cpu = DeviceInfo(type="cpu", name="AVX2-only CPU", cpu_bf16=False)
    assert capabilities.support("precision", "bf16", old_cpu) is None  # it runs: asked for, it is allowed
    assert "emulated" in capabilities.slow("precision", "bf16", old_cpu)
    assert capabilities.default_values("precision", old_cpu) == ["fp32"]  # but is not worth a tuning trial
    assert capabilities.slow("precision", "bf16", CPU) is None  # oneDNN has bf16 kernels
    assert capabilities.slow("precision", "bf16", H100) is None
    (line,) = capabilities.slow_choices(parse(["--precision", "bf16"]).toggles, old_cpu)
    assert line.startswith("--precision bf16: ")
    assert capabilities.slow_choices(parse([]).toggles, old_cpu) == []


def test_no_compiler_means_no_compile():
    dev = DeviceInfo(type="cpu", name="x", has_compiler=False)
    assert capabilities.support("compile", "default", dev)
    assert capabilities.supported_values("compile", dev) == ["off"]


def test_cuda_graph_compile_modes_refuse_gradient_accumulation():
    """reduce-overhead and max-autotune capture CUDA graphs, whose replays overwrite the gradients that
    accumulation keeps between backwards (pytorch#169545): refused where the run accumulates, with the
    reason and what to use instead; allowed without accumulation and while it is not known yet."""
    for mode in capabilities.CUDA_GRAPH_MODES:
        why = capabilities.support("compile", mode, H100, accumulation=4)
        assert "CUDA graphs" in why and "accumulation over 4" in why and "--compile default" in why
        assert capabilities.support("compile", mode, H100, accumulation=1) is None
        assert capabilities.support("compile", mode, H100) is None  # micro-batch auto: not known yet
    assert capabilities.support("compile", "max-autotune-no-cudagraphs", H100, accumulation=4) is None
    assert capabilities.supported_values("compile", H100, accumulation=2) == [
        "off",
        "default",
        "max-autotune-no-cudagraphs",
    ]
    cfg = parse(["--compile", "reduce-overhead", "--micro-batch", "2", "--global-batch", "8"])
    with pytest.raises(ConfigError) as e:
        capabilities.check_config(cfg, H100)
    assert e.value.option == "--compile" and "accumulation over 4" in str(e.value)
    capabilities.check(cfg.toggles, H100, per_rank_batch=2)  # 2 sequences a rank: no accumulation
    assert capabilities.unsupported(cfg.toggles, H100, 8) == (
        "compile",
        capabilities.support("compile", "reduce-overhead", H100, accumulation=4),
    )
    assert capabilities.accumulation_of(parse(["--micro-batch", "auto"]).toggles, 8) is None
    capabilities.check_config(parse(["--compile", "reduce-overhead", "--global-batch", "8"]), H100)  # auto


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_cuda_graph_compile_modes_are_refused_with_several_ranks(parallel):
    """Inductor's CUDA graphs do not capture the NCCL collectives DDP (its gradient all-reduce hooks) and FSDP2
    (its all-gathers and reduce-scatters) run inside each step: reduce-overhead and max-autotune are refused
    with several ranks, by the trainer's check, the tuner's space and screen, and the hints, and allowed to one
    process, which ignores --parallel."""
    from gptop.tuning_space import tuning_space
    from tuner.proposals import screen
    from tuner.space import SearchSpace

    for mode in capabilities.CUDA_GRAPH_MODES:
        why = capabilities.support("compile", mode, H100, accumulation=1, parallel=parallel)
        assert "CUDA graphs" in why and f"--parallel {parallel}" in why and "--compile default" in why
        assert capabilities.support("compile", mode, H100, accumulation=1) is None
        assert not capabilities.worth_trying("compile", mode, H100, accumulation=1, parallel=parallel)
        cfg = parse(["--compile", mode, "--parallel", parallel, "--global-batch", "8", "--micro-batch", "4"])
        with pytest.raises(ConfigError) as e:
            capabilities.check_config(cfg, H100, world_size=2)  # 4 sequences a rank: no accumulation
        assert e.value.option == "--compile" and f"--parallel {parallel}" in str(e.value)
        capabilities.check_config(parse(["--compile", mode, "--parallel", parallel, "--global-batch", "4"]), H100)
    assert capabilities.support("compile", "max-autotune-no-cudagraphs", H100, parallel=parallel) is None
    cfg = parse(["--parallel", parallel, "--global-batch", "8"])
    one, _ = tuning_space(cfg, H100, None, 1, None, 600.0)
    two, _ = tuning_space(cfg, H100, None, 2, None, 600.0)
    assert set(capabilities.CUDA_GRAPH_MODES) <= set(one.choices["compile"])
    assert not set(capabilities.CUDA_GRAPH_MODES) & set(two.choices["compile"])
    assert "default" in two.choices["compile"] and "max-autotune-no-cudagraphs" in two.choices["compile"]
    with pytest.raises(ConfigError, match="--parallel"):
        tuning_space(cfg, H100, None, 2, "compile=default,reduce-overhead", 600.0)
    space = SearchSpace.for_device(cfg.toggles, H100, 8, world_size=2, spec="compile+=reduce-overhead", parallel=None)
    space = dataclasses.replace(space, parallel=parallel)  # a space widened before it knew: still screened
    kw = dict(start=cfg.toggles, max_mb=None, dev=H100, space=space, slow_compile=set(), trial_timeout_s=60.0)
    got = screen(dataclasses.replace(cfg.toggles, compile="reduce-overhead", micro_batch=4), **kw)
    assert got is not None and got.status == TrialStatus.INFEASIBLE and f"--parallel {parallel}" in got.reason


def test_the_compiler_toolchain_is_checked_per_device(monkeypatch):
    """torch.compile needs a C++ compiler on the CPU; on CUDA, triton and a C compiler for its launchers
    (it was taken for granted there): each missing piece is named, and the capability says what to install."""
    import importlib.util
    import shutil

    from trainer import device_probe as device

    have = {"c++", "cc"}
    triton = [True]
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}" if name in have else None)
    real_find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (object() if triton[0] else None) if name == "triton" else real_find(name, *a),
    )
    assert device.compiler_missing("cpu") is None and device.compiler_missing("cuda") is None
    triton[0] = False
    assert "triton" in device.compiler_missing("cuda") and device.compiler_missing("cpu") is None
    triton[0] = True
    have.discard("cc")
    assert "C compiler" in device.compiler_missing("cuda")
    monkeypatch.setenv("CC", "clang")
    have.add("clang")
    assert device.compiler_missing("cuda") is None
    have.discard("c++")
    assert "g++" in device.compiler_missing("cpu")
    no_triton = DeviceInfo(type="cuda", index=0, name="H100", capability=(9, 0), has_compiler=False)
    assert "triton" in capabilities.support("compile", "default", no_triton)
    assert capabilities.supported_values("compile", no_triton) == ["off"]


@pytest.mark.parametrize(
    "section, key, value, words",
    [
        ("optim", "optimizer", '"sgd"', "'sgd' is not one of"),
        ("optim", "optimizer", "3", "is not a string"),
        ("finetune", "quantize_base", '"nf2"', "'nf2' is not one of"),
        ("finetune", "quantize_base", "true", "is not a string"),
    ],
)
def test_an_option_in_its_old_table_is_named_as_the_file_has_it(tmp_path, section, key, value, words):
    """`[optim] optimizer = "sgd"` (the layout before the option moved to [toggles]) is refused naming
    `[optim] optimizer`, what the user wrote, and where it lives now; its good values still read."""
    from trainer.contract.config import MOVED

    home = MOVED[(section, key)]
    p = tmp_path / "old.toml"
    p.write_text(f"[{section}]\n{key} = {value}\n")
    with pytest.raises(ConfigError) as e:
        config_from_toml(p)
    assert e.value.message.startswith(f"[{section}] {key}: ") and words in e.value.message, e.value.message
    assert f"lives in [{home}] now" in e.value.message and f"{home}.{key}" not in e.value.message
    good = {"optimizer": '"adafactor"', "quantize_base": '"none"'}[key]
    p.write_text(f"[{section}]\n{key} = {good}\n")
    assert getattr(getattr(config_from_toml(p), home), key) == good.strip('"')
