"""Energy, computed once (gptop.energy): NVML's counter, RAPL's counter, integrated power, or a reason.

The readings come from the sampler with a fake `pynvml` and fake powercap files; every consumer (the
dashboard's J/token, the tuner's trials, `gptop report`) goes through the same `measure`.
"""

from __future__ import annotations

import os
import types

import pynvml
import pytest

from gptop import energy as E
from gptop.report import format_report, summarize
from gptop.state import RunState
from test_telemetry import FakeClock, fake_pynvml, make_sampler, rapl_tree, set_energy
from fixtures.streams import step_event
from trainer.contract.events import StepEvent, dumps, make


def step(n: int, t: float, tokens_per_step: int = 1000) -> StepEvent:
    return step_event(
        n, time=t, step_ms=100.0, tokens_per_step=tokens_per_step, loss=1.0, lr=1e-3, grad_norm=1.0, tokens_per_s=None
    )


def gpu_samples(mod, tmp_path, watts: list[float], clock: FakeClock, **kw):
    """Samples 1 s apart; between them each GPU's energy counter moves by `watts[i]` joules."""
    s = make_sampler(mod, tmp_path, clock=clock, **kw)
    out = [s.sample_once()]
    for w in watts:
        clock.t += 1.0
        for i in mod.energy:
            mod.energy[i] += int(w * 1000)  # mJ
        out.append(s.sample_once())
    s.stop()
    return out


def test_nvml_counter_is_the_reading_and_the_dashboard_uses_it(tmp_path):
    clock = FakeClock(1_000.0)
    mod = fake_pynvml(count=2, power_mw=1_000)  # sampled power (1 W) disagrees: the counter wins
    samples = gpu_samples(mod, tmp_path, [200.0, 400.0, 400.0], clock)
    e = E.measure(samples, 1_000.0, 1_003.0)
    assert e == E.Energy(2 * 1000.0, E.EnergySource.COUNTER_GPU)
    assert E.measure(samples, 1_001.5, 1_002.5).joules == pytest.approx(2 * 400.0)

    state = RunState()  # the dashboard: same samples, same computation
    for x in samples:
        state.apply(x)
    state.apply(step(10, 1_001.0))
    state.apply(step(20, 1_003.0))
    got, tokens = state.energy()
    assert tokens == 10_000 and got == E.measure(samples, 1_001.0, 1_003.0)
    assert state.joules_per_token() == pytest.approx(2 * 800.0 / 10_000)


def test_only_the_trainers_gpus_count_when_nvml_says_which(tmp_path):
    clock = FakeClock(1_000.0)
    mod = fake_pynvml(count=2)
    ours = [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=2**30)]
    mod.nvmlDeviceGetComputeRunningProcesses = lambda h: ours if h == 1 else []
    samples = gpu_samples(mod, tmp_path, [100.0, 100.0], clock, pids=lambda: [os.getpid()])
    assert [g.proc_mem for g in samples[-1].devices] == [None, 2**30]
    assert E.energy_between(samples, 1_000.0, 1_002.0) == pytest.approx(200.0)  # GPU 1 only
    assert E.energy_between(samples, 1_000.0, 1_002.0, devices=[0, 1]) == pytest.approx(400.0)


def test_the_runs_gpus_count_by_identity_when_the_pids_do_not_match(tmp_path):
    """In a container NVML reports host PIDs, so no GPU shows the trainer's memory: the run's GPUs are then
    the ones its hello names (by UUID, or PCI address), not every GPU of the machine with its idle draw."""
    from trainer.contract.device import gpu_key

    clock = FakeClock(1_000.0)
    mod = fake_pynvml(count=3)
    stranger = [types.SimpleNamespace(pid=1, usedGpuMemory=2**30)]  # a PID from another namespace
    mod.nvmlDeviceGetComputeRunningProcesses = lambda h: stranger
    samples = gpu_samples(mod, tmp_path, [100.0, 100.0], clock, pids=lambda: [os.getpid()])
    assert all(g.proc_mem is None for g in samples[-1].devices)
    assert E.energy_between(samples, 1_000.0, 1_002.0) == pytest.approx(600.0)  # all three
    run = [gpu_key(mod.uuids[2].lower().removeprefix("gpu-"))]  # torch's spelling
    assert E.energy_between(samples, 1_000.0, 1_002.0, run_gpus=run) == pytest.approx(200.0)
    by_pci = [gpu_key(None, "0000:17:00"), gpu_key(None, "0000:18:00")]
    assert E.energy_between(samples, 1_000.0, 1_002.0, run_gpus=by_pci) == pytest.approx(400.0)
    assert E.energy_between(samples, 1_000.0, 1_002.0, run_gpus=["not-a-gpu-here"]) == pytest.approx(600.0)

    state = RunState()  # the dashboard reads the hello's list
    hello = make(
        "hello",
        config={},
        device={"type": "cuda", "index": 0, "name": "H100"},
        model={"family": "llama", "size": "tiny"},
        gpus=run,
        time=999.0,
    )
    for x in [hello, *samples]:
        state.apply(x)
    state.apply(step(10, 1_000.0))
    state.apply(step(20, 1_002.0))
    got, tokens = state.energy()
    assert got.joules == pytest.approx(200.0) and tokens == 10_000


def test_power_is_integrated_without_a_counter(tmp_path):
    clock = FakeClock(1_000.0)
    errors = {(0, "nvmlDeviceGetTotalEnergyConsumption"): pynvml.NVMLError_NotSupported}
    mod = fake_pynvml(count=1, power_mw=300_000, errors=errors)  # pre-Volta: no counter
    samples = gpu_samples(mod, tmp_path, [0.0, 0.0, 0.0], clock)
    assert all(x.devices[0].energy_j is None for x in samples)
    assert E.measure(samples, 1_000.0, 1_003.0) == E.Energy(pytest.approx(900.0), E.EnergySource.INTEGRATED)


def test_rapl_counter_on_a_cpu_run(tmp_path):
    root = tmp_path / "powercap"
    rapl_tree(root, {"intel-rapl:0": ("package-0", 0, 2**32)})
    clock = FakeClock(1_000.0)
    s = make_sampler(fake_pynvml(init_error=pynvml.NVMLError_LibraryNotFound), tmp_path, clock=clock)
    s._rapl_root = str(root)
    samples = [s.sample_once()]
    for uj in (30_000_000, 60_000_000, 90_000_000):  # 30 J per second: 30 W
        clock.t += 1.0
        set_energy(root, "intel-rapl:0", uj)
        samples.append(s.sample_once())
    s.stop()
    assert samples[0].mode == "cpu"
    assert E.measure(samples, 1_000.0, 1_003.0) == E.Energy(pytest.approx(90.0), E.EnergySource.COUNTER_CPU)
    assert E.Rapl(str(root)).reason is None


def test_no_reading_is_none_with_a_reason(tmp_path):
    root = tmp_path / "powercap"
    rapl_tree(root, {"intel-rapl:0": ("package-0", 1, 100)})
    (root / "intel-rapl:0" / "energy_uj").unlink()
    (root / "intel-rapl:0" / "energy_uj").mkdir()  # unreadable, as for a non-root user
    assert "not readable" in E.Rapl(str(root)).reason
    assert "no RAPL package domain" in E.Rapl(str(tmp_path / "absent")).reason

    clock = FakeClock(1_000.0)
    s = make_sampler(fake_pynvml(init_error=pynvml.NVMLError_LibraryNotFound), tmp_path, clock=clock)
    samples = [s.sample_once()]
    clock.t += 1.0
    samples.append(s.sample_once())
    s.stop()
    assert E.measure(samples, 1_000.0, 1_001.0) is None
    assert "RAPL" in E.unavailable_reason(samples)

    errors = {
        (0, f): pynvml.NVMLError_NotSupported
        for f in ("nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetPowerUsage")
    }
    gpu = gpu_samples(fake_pynvml(count=1, errors=errors), tmp_path, [0.0], FakeClock(1_000.0))
    assert E.measure(gpu, 1_000.0, 1_001.0) is None
    assert "neither an energy counter nor a power reading for GPU 0" in E.unavailable_reason(gpu)
    assert E.unavailable_reason(gpu[:1]) == "not enough device samples yet"


def test_gptop_report_shows_energy_per_token_and_its_source_or_why_not(tmp_path):
    clock = FakeClock(1_000.0)
    samples = gpu_samples(fake_pynvml(count=1), tmp_path, [250.0] * 4, clock)
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text("".join(dumps(step(n, 1_000.0 + n)) + "\n" for n in (1, 2, 3, 4)))
    (run / "device.jsonl").write_text("".join(dumps(x) + "\n" for x in samples))
    s = summarize(run)
    assert s["energy_j"] == pytest.approx(750.0) and s["energy_source"] == E.EnergySource.COUNTER_GPU
    assert s["energy_j_per_token"] == pytest.approx(750.0 / 3000)
    assert "mJ/token processed (NVML energy counter)" in format_report(s)

    (run / "device.jsonl").unlink()
    s = summarize(run)
    assert "energy_j" not in s and "no device.jsonl" in format_report(s)


def test_the_headless_done_line_gives_energy_per_token_or_why_not(tmp_path):
    from gptop.headless import event_line

    clock = FakeClock(1_000.0)
    samples = gpu_samples(fake_pynvml(count=1), tmp_path, [100.0] * 3, clock)
    state = RunState()
    for e in [*samples, step(10, 1_001.0), step(20, 1_003.0)]:
        state.apply(e)
    done = make("done", step=20, tokens=20_000, time=1_003.0)
    assert event_line(done, state).endswith("; energy 20 mJ/token over the last steps (NVML energy counter)")
    bare = RunState()
    bare.apply(step(10, 1.0))
    assert event_line(done, bare).endswith("; energy n/a: not enough step events yet")


@pytest.mark.parametrize(
    "euid, layout, says, never",
    [
        (1000, "unreadable", "run as root", None),
        (0, "unreadable", "not readable even by root", "run as root"),
        (0, "absent", "exposes no RAPL", "as root"),
        (1000, "absent", "exposes no RAPL", "as root"),
    ],
)
def test_the_rapl_check_says_what_is_actually_wrong(tmp_path, monkeypatch, euid, layout, says, never):
    """The doctor's RAPL check told root to run as root, and a machine without RAPL to run as root: it says
    what is wrong there (no RAPL at all; root-only files for a user; unreadable even for root)."""
    from trainer.contract.doctor import Status

    monkeypatch.setattr(E.os, "geteuid", lambda: euid)
    root = tmp_path / "powercap"
    if layout == "unreadable":
        rapl_tree(root, {"intel-rapl:0": ("package-0", 1, 100)})
        (root / "intel-rapl:0" / "energy_uj").unlink()
        (root / "intel-rapl:0" / "energy_uj").mkdir()  # a read that fails, whoever reads
    got = E.check_rapl(str(root))
    assert got.status is Status.SKIP and says in got.reason, got.reason
    assert never is None or never not in got.reason, got.reason
