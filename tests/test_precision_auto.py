"""`--precision auto`, the default: bf16 autocast where the device multiplies bf16 natively, else fp32; the run
records the resolved value (config.toml, hello), resumes with it, and the views say what auto became."""

import dataclasses

import pytest

from helpers import train_in_process
from fixtures.streams import config, ev, step_event
from trainer.contract import capabilities
from trainer.contract.config import PRECISIONS, TrainConfig
from trainer.contract.device import DeviceInfo, cpu_has_native_bf16

H100 = DeviceInfo(type="cuda", name="NVIDIA H100 80GB HBM3", capability=(9, 0), total_memory=int(80e9))
A100 = DeviceInfo(type="cuda", name="NVIDIA A100-SXM4-80GB", capability=(8, 0), total_memory=int(80e9))
T4 = DeviceInfo(type="cuda", name="Tesla T4", capability=(7, 5), total_memory=int(16e9))
V100 = DeviceInfo(type="cuda", name="Tesla V100", capability=(7, 0), total_memory=int(16e9))
SAPPHIRE_RAPIDS = DeviceInfo(type="cpu", name="Xeon 8480", cpu_bf16=True, cpu_bf16_native=True)
SKYLAKE_AVX512 = DeviceInfo(type="cpu", name="Xeon 6148", cpu_bf16=True, cpu_bf16_native=False)
AVX2 = DeviceInfo(type="cpu", name="EPYC", cpu_bf16=False, cpu_bf16_native=False)


@pytest.mark.parametrize(
    "dev, expected",
    [
        (H100, "bf16"),
        (A100, "bf16"),
        (T4, "fp32"),
        (V100, "fp32"),
        (SAPPHIRE_RAPIDS, "bf16"),
        (SKYLAKE_AVX512, "fp32"),  # oneDNN runs bf16 there, but without bf16 instructions it does not beat fp32
        (AVX2, "fp32"),
    ],
)
def test_auto_resolves_by_the_device(dev, expected):
    assert capabilities.auto_precision(dev) == expected
    assert capabilities.resolve_precision("auto", dev) == expected
    for p in PRECISIONS:  # anything else is kept as given
        assert capabilities.resolve_precision(p, dev) == p
    # what auto picks is always supported and never marked slow there
    assert capabilities.support("precision", expected, dev) is None
    assert capabilities.slow("precision", expected, dev) is None


@pytest.mark.parametrize(
    "flags, native",
    [
        ({"avx2", "fma"}, False),
        ({"avx512f", "avx512bw", "avx512vl"}, False),
        ({"avx512f", "avx512_bf16"}, True),
        ({"amx_tile", "amx_bf16"}, True),
        ({"fp", "asimd", "bf16"}, True),  # Arm's Features line
        (set(), False),
    ],
)
def test_native_bf16_from_the_cpu_flags(flags, native):
    assert cpu_has_native_bf16(frozenset(flags)) is native


def test_auto_is_the_default_and_accepted_everywhere_a_precision_is():
    assert TrainConfig().toggles.precision == "auto"
    assert capabilities.support("precision", "auto", AVX2) is None
    # the tuner's values are concrete precisions: auto is a request, never a trial
    assert "auto" not in capabilities.CHOICES["precision"]
    assert "auto" not in capabilities.supported_values("precision", H100)


def test_the_cpu_recipe_takes_native_bf16():
    base = TrainConfig().toggles
    assert capabilities.recipe(base, SAPPHIRE_RAPIDS, PRECISIONS).precision == "bf16"
    assert capabilities.recipe(base, AVX2, PRECISIONS).precision == "fp32"
    assert capabilities.recipe(base, SAPPHIRE_RAPIDS, ("fp32",)).precision == "fp32"


def _run(tmp_path, monkeypatch, *args, native: bool, name: str = "run"):
    """The trainer in this process on this CPU, with bf16 instructions faked present or absent at the one
    boundary that asks (trainer.device_probe.detect)."""
    from trainer import train

    real = train.detect
    monkeypatch.setattr(
        train,
        "detect",
        lambda requested="auto": dataclasses.replace(real(requested), cpu_bf16=native, cpu_bf16_native=native),
    )
    return train_in_process(tmp_path / name, "--micro-batch", "4", *args)


def _hello(events):
    return [e for e in events if e.type == "hello" and not e.early][-1]


@pytest.mark.parametrize("native, expected", [pytest.param(True, "bf16", marks=pytest.mark.slow), (False, "fp32")])
def test_an_auto_run_records_what_it_resolved_to(tmp_path, monkeypatch, native, expected):
    code, events, run_dir = _run(tmp_path, monkeypatch, "--max-steps", "1", native=native)
    assert code == 0
    hello = _hello(events)
    assert hello.toggles.precision == expected and "precision" in hello.auto
    early = [e for e in events if e.type == "hello" and e.early][0]
    assert early.toggles.precision == expected  # the estimate is made for the resolved precision too
    assert f'precision = "{expected}"' in (run_dir / "config.toml").read_text()


@pytest.mark.slow
def test_a_resume_keeps_the_resolved_precision_on_another_device(tmp_path, monkeypatch):
    code, _, run_dir = _run(tmp_path, monkeypatch, "--max-steps", "1", "--checkpoint-every", "1", native=True)
    assert code == 0
    code, events, _ = _run(
        tmp_path, monkeypatch, "--max-steps", "2", "--resume", str(run_dir), native=False, name="resumed"
    )
    assert code == 0
    hello = _hello(events)
    assert hello.toggles.precision == "bf16" and hello.auto == []  # resolved once, kept by the run


def test_an_explicit_precision_is_not_called_auto(tmp_path, monkeypatch):
    code, events, _ = _run(tmp_path, monkeypatch, "--max-steps", "1", "--precision", "fp32", native=True)
    assert code == 0
    hello = _hello(events)
    assert hello.toggles.precision == "fp32" and "precision" not in hello.auto


def _hello_ev(precision, auto=()):
    return ev(
        "hello",
        0.0,
        config=config("llama", "tiny", "cpu", precision=precision),
        auto=list(auto),
        device={"type": "cpu", "name": "cpu"},
        model={"family": "llama", "size": "tiny"},
    )


def test_the_views_say_what_auto_became():
    from gptop.state import RunState

    state = RunState()
    assert state.precision_label() is None
    state.apply(_hello_ev("bf16", auto=["precision"]))
    assert state.precision_label() == "auto -> bf16"
    state = RunState()
    state.apply(_hello_ev("fp16"))
    assert state.precision_label() == "fp16"


def _step(step, t):
    phases = {"data": 1.0, "forward": 3.0, "backward": 5.0, "optimizer": 1.0, "other": 0.0}
    return step_event(step, t, step_ms=10.0, phases=phases, tokens_per_step=256, mfu=None, mem=1 << 20)


def test_a_summary_names_the_precision_its_steps_ran_in():
    """Seen on an H100: `gptop tune --tune-only` ended while a trial's trainer (fp8) was still compiling, and
    the run's summary said "precision fp8-tensorwise" under the speed of steps that all ran in bf16. The
    summary names the precision of the last process that made steps; the dashboard, the current process's."""
    from gptop.state import RunState
    from gptop.summary import summary_lines

    state = RunState()
    state.apply(_hello_ev("bf16", auto=["precision"]))
    state.apply(_step(1, 1.0))
    assert state.precision_label(of_steps=True) == state.precision_label() == "auto -> bf16"
    trial = dataclasses.replace(_hello_ev("fp8-tensorwise"), start_step=1)  # from the checkpoint of step 1
    state.apply(dataclasses.replace(trial, early=True))  # a trial's process starts ...
    state.apply(trial)  # ... and is built, and the run ends before its first step
    assert state.precision_label() == "fp8-tensorwise"
    assert state.precision_label(of_steps=True) == "auto -> bf16"
    assert any("precision auto -> bf16" in line for line in summary_lines(state))
    state.apply(_step(2, 3.0))  # the trial's process steps: its precision
    assert state.precision_label(of_steps=True) == "fp8-tensorwise"
