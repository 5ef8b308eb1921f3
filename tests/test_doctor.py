"""`gptop doctor` (issue 27): the list of device paths, each path's check against the fakes its path is tested
with (a failing fake fails the check with its reason: the doctor cannot pass vacuously), the record's
schema, the child processes, and the command on this CPU."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pynvml
import pytest
import torch

from helpers import ROOT
from test_data import FakeCuda
from test_telemetry import fake_pynvml
from trainer.contract import capabilities
from trainer.contract.device import DeviceInfo
from trainer.contract.doctor import (
    PATHS,
    REPORT_SCHEMA,
    CheckResult,
    DoctorReport,
    Outcome,
    Status,
    Where,
    exit_code,
    path,
    validate_report,
)

CPU = DeviceInfo(type="cpu", name="Test CPU", cpu_count=2, total_memory=8 << 30)
H100 = DeviceInfo(type="cuda", index=0, name="NVIDIA H100 80GB HBM3", capability=(9, 0), total_memory=80 << 30)
A100 = dataclasses.replace(H100, name="NVIDIA A100", capability=(8, 0))
T4 = dataclasses.replace(H100, name="Tesla T4", capability=(7, 5))


def owner(p):
    module, _, fn = p.owner.partition(":")
    return getattr(importlib.import_module(module), fn)


# --- the list of paths ------------------------------------------------------------------------------------


def test_every_path_names_a_check_in_the_module_that_owns_it():
    assert len({p.name for p in PATHS}) == len(PATHS)
    for p in PATHS:
        fn = owner(p)
        assert callable(fn) and fn.__module__ == p.owner.partition(":")[0], p.name
        params = inspect.signature(fn).parameters
        if p.in_gptop:
            continue  # gptop's own: called by gptop.doctor with what they need
        assert list(params)[:2] == ["dev", "quick"], p.name
        for key, _ in p.args:
            assert key in params, f"{p.name}: {p.owner} takes no {key!r}"
    # every compile mode and fp8 recipe the config offers has its path
    assert {p.name for p in PATHS if p.name.startswith("compile.")} == {
        f"compile.{m}" for m in capabilities.CHOICES["compile"] if m != "off"
    }
    assert {p.name for p in PATHS if p.name.startswith("fp8.")} == {
        f"fp8.{m.split('-', 1)[1]}" for m in capabilities.CHOICES["precision"] if m.startswith("fp8")
    }


# --- the record -------------------------------------------------------------------------------------------


def report(*statuses: Status) -> DoctorReport:
    checks = [
        CheckResult.of(p, Outcome(s, "seen", None if s is Status.PASS else "why", {"n": 1}), 0.5)
        for p, s in zip(PATHS, statuses)
    ]
    return DoctorReport(
        requested="cpu",
        time=time.time(),
        machine={"torch": torch.__version__},
        device=CPU.to_dict(),
        precision_auto="fp32",
        capabilities={"precision": {"fp32": {"unsupported": None, "slow": None}}},
        checks=checks,
    )


def test_the_record_validates_against_its_schema_and_broken_ones_do_not():
    good = report(Status.PASS, Status.SKIP, Status.PASS).to_dict()
    assert validate_report(good) == [] and validate_report(json.loads(json.dumps(good))) == []
    assert good["counts"] == {"pass": 2, "fail": 0, "skip": 1} and good["ok"] is True
    assert REPORT_SCHEMA["properties"]["checks"]["items"]["properties"]["name"]["enum"] == [p.name for p in PATHS]
    broken = [
        ({**good, "checks": [{**good["checks"][0], "status": "maybe"}]}, "is not one of"),
        ({k: v for k, v in good.items() if k != "checks"}, "missing 'checks'"),
        ({**good, "checks": [{**good["checks"][0], "colour": "red"}]}, "unexpected 'colour'"),
        ({**good, "checks": [{**good["checks"][0], "seconds": -1}]}, "below 0"),
        ({**good, "ok": "yes"}, "expected boolean"),
        ({**good, "device": {"type": "tpu", "name": "x", "total_memory": 1}}, "is not one of"),
        ({**good, "schema": "other/1"}, "expected 'gptop-doctor/1'"),
    ]
    for record, message in broken:
        errors = validate_report(record)
        assert errors and any(message in e for e in errors), (message, errors)


def test_the_exit_code_is_0_only_when_no_path_that_applies_failed():
    assert exit_code(report(Status.PASS, Status.SKIP).checks) == 0
    assert exit_code(report(Status.SKIP, Status.SKIP).checks) == 0
    failed = report(Status.PASS, Status.FAIL)
    assert exit_code(failed.checks) == 1 and not failed.ok
    (row,) = [c for c in failed.checks if c.status is Status.FAIL]
    assert row.reason.startswith("why. ") and path(row.name).on_fail in row.reason  # says what it means


# --- timing: CudaTimer(make_event=...) ----------------------------------------------------------------------


class SyncEvent:
    """A CUDA event on a GPU that runs synchronously: record() stamps the host clock."""

    def __init__(self):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


class IdleStreamEvent(SyncEvent):
    """Recorded on another device's idle stream (the cuda:N bug): it completes at once, whatever the work."""

    clock = 0.0

    def record(self, stream=None):
        IdleStreamEvent.clock += 1e-6
        self.t = IdleStreamEvent.clock


@pytest.mark.parametrize("event, status", [(SyncEvent, Status.PASS), (IdleStreamEvent, Status.FAIL)])
def test_the_timing_check_fails_a_timer_whose_events_do_not_see_the_work(event, status):
    from trainer.timing import CudaTimer, check

    got = check(
        H100,
        True,
        timer_factory=lambda: CudaTimer(make_event=event, stream=lambda: "compute"),
        device=torch.device("cpu"),
    )
    assert got.status is status, got.observed
    if status is Status.FAIL:
        assert got.reason == "the timer's steps or phases disagree with the synchronized clock"
        assert "of the wall clock" in got.observed and got.data["attempts"] == 3


# --- prefetch: CudaCopier(ops=...) ------------------------------------------------------------------------------


class StaleCopies(FakeCuda):
    """Hands out the previous copy's memory (an allocator reusing a buffer too early): stale data."""

    def __init__(self):
        super().__init__()
        self.last = None

    def copy(self, t):
        out, self.last = (self.last if self.last is not None and self.last.shape == t.shape else t.clone()), t.clone()
        return out


@pytest.mark.parametrize("ops, status", [(FakeCuda, Status.PASS), (StaleCopies, Status.FAIL)])
def test_the_prefetch_check_fails_a_copier_that_hands_over_the_wrong_memory(ops, status):
    from trainer.prefetch import CudaCopier, check

    got = check(H100, True, copier_factory=lambda: CudaCopier("cuda:0", ops=ops()), device="cpu")
    assert got.status is status, got.observed
    assert got.data["copier"] == "CudaCopier"
    if status is Status.FAIL:
        assert got.reason == "prefetched data differs from the synchronous path"
        assert "differs from the synchronous path" in got.observed


# --- NVML: Nvml(module=...) ---------------------------------------------------------------------------------------


def nvml_with(module):
    from gptop.nvml import Nvml

    nv = Nvml(module)
    assert nv.open()
    return nv


def test_the_nvml_check_reads_every_metric_and_fails_what_does_not_read():
    from gptop.nvml import check

    no_sleep = lambda s: None  # noqa: E731
    mod = fake_pynvml(count=2)
    mod.nvmlDeviceGetMaxClockInfo = lambda h, c: 1980
    mod.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0x1
    got = check(nvml_with(mod), 1, sleep=no_sleep)
    assert got.status is Status.PASS, got.reason
    assert "util 87%" in got.observed and "power 250 W" in got.observed and "GPM n/a" in got.observed
    # power not supported, utilization idle: each named
    errors = {(1, "nvmlDeviceGetPowerUsage"): pynvml.NVMLError_NotSupported}
    mod = fake_pynvml(count=2, errors=errors)
    mod.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=0, memory=0)
    got = check(nvml_with(mod), 1, sleep=no_sleep)
    assert got.status is Status.FAIL
    assert "power" in got.reason and "did not read" in got.reason and "utilization stayed 0" in got.reason
    # a Hopper GPU whose GPM does not read
    mod = fake_pynvml(count=1)
    mod.nvmlGpmQueryDeviceSupport = lambda h: types.SimpleNamespace(isSupportedDevice=1)
    mod.c_nvmlGpmMetricsGet_t = object  # the bindings have GPM ...
    mod.nvmlGpmSampleAlloc = lambda: object()
    mod.nvmlGpmSampleFree = lambda s: None

    def no_sample(handle, sample):  # ... but no sample reads
        raise pynvml.NVMLError_Unknown()

    mod.nvmlGpmSampleGet = no_sample
    got = check(nvml_with(mod), 0, sleep=no_sleep)
    assert got.status is Status.FAIL and "GPM metrics did not read although NVML says" in got.reason
    hidden = fake_pynvml(count=1)
    hidden.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)  # Hopper, GPM not offered (a VM): reported
    hidden.nvmlDeviceGetMaxClockInfo = lambda h, c: 1980
    hidden.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0
    got = check(nvml_with(hidden), 0, sleep=no_sleep)
    assert got.status is Status.PASS and "NVML hides it on this Hopper-or-later GPU" in got.observed


def test_the_energy_check_needs_a_counter_that_moves_with_the_power():
    from gptop.nvml import check_energy

    fake = fake_pynvml(count=2, power_mw=300_000)
    nv = nvml_with(fake)
    t = [0.0]

    def working(s):  # 300 W for s seconds, as the counter sees it
        t[0] += s
        fake.energy[0] += int(300 * s * 1000)

    got = check_energy(nv, 0, sleep=working, clock=lambda: t[0])
    assert got.status is Status.PASS and got.data["counter_w"] == pytest.approx(300.0)
    t[0] = 0.0
    got = check_energy(nv, 0, sleep=lambda s: t.__setitem__(0, t[0] + s), clock=lambda: t[0])  # never moves
    assert got.status is Status.FAIL and "did not move" in got.reason
    errors = {(0, "nvmlDeviceGetTotalEnergyConsumption"): pynvml.NVMLError_NotSupported}
    got = check_energy(nvml_with(fake_pynvml(count=1, errors=errors)), 0, sleep=lambda s: None)
    assert got.status is Status.FAIL and "no total-energy counter" in got.reason


def test_the_run_gpu_is_found_in_nvml_by_identity():
    from gptop.nvml import index_of

    fake = fake_pynvml(count=3)
    nv = nvml_with(fake)
    assert index_of(nv, [fake.uuids[2].lower().removeprefix("gpu-")]) == 2
    assert index_of(nv, ["pci:0000:18:00"]) == 1 and index_of(nv, ["nothing"]) is None and index_of(nv, []) is None
    dev = dataclasses.replace(H100, uuid="not-what-nvml-says", pci_bus_id="0000:19:00")  # the PCI address decides
    assert dev.keys == ["not-what-nvml-says", "pci:0000:19:00"] and index_of(nv, dev.keys) == 2


# --- the allocator, GradScaler, TF32: their calls faked or run on the CPU ----------------------------------------------


class FakeAllocator:
    def __init__(self, expandable):
        self.expandable, self.device = expandable, None

    def is_initialized(self):
        return False

    def set_device(self, d):
        self.device = d

    def memory_snapshot(self):
        return [{"device": 0, "is_expandable": self.expandable}, {"device": 0, "is_expandable": self.expandable}]


@pytest.mark.parametrize("expandable, status", [(True, Status.PASS), (False, Status.FAIL)])
def test_the_expandable_segments_check_reads_what_the_allocator_made(expandable, status):
    from trainer.memory import check_expandable_segments

    env = {"PYTORCH_ALLOC_CONF": ""}
    got = check_expandable_segments(H100, True, cuda=FakeAllocator(expandable), environ=env)
    assert got.status is status
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "garbage_collection_threshold:0.9,expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" in got.data["merged_warning"]
    if status is Status.FAIL:
        assert got.reason == "the allocator did not take the setting" and "0 of 2" in got.observed


def test_the_expandable_segments_check_probes_the_real_device_in_a_fresh_interpreter(monkeypatch):
    """Seen on an H100: in the doctor's child CUDA was already initialized (detecting the device does that),
    and the allocator takes its settings once, so the real check runs its probe in a fresh interpreter that
    imports the trainer first, without the user's allocator variables in its environment; what that process
    prints decides, and a failed process is a failure that says why."""
    import subprocess as sp

    from trainer import memory

    seen = {}

    def run(cmd, **kw):
        seen.update(cmd=cmd, env=kw["env"])
        return sp.CompletedProcess(cmd, answer[0], answer[1], answer[2])

    monkeypatch.setattr(sp, "run", run)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    report = {"initialized": False, "note": "merged", "conf": "a,expandable_segments:True", "segments": 2}
    answer = (0, json.dumps(dict(report, expandable=2)) + "\n", "")
    got = memory.check_expandable_segments(H100, True)
    assert got.status is Status.PASS and "2 of 2 segments expandable" in got.observed
    assert seen["cmd"][-1] == "cuda:0" and "import trainer.runner" in seen["cmd"][2]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in seen["env"]
    answer = (0, json.dumps(dict(report, expandable=0)), "")
    assert memory.check_expandable_segments(H100, True).reason == "the allocator did not take the setting"
    answer = (0, json.dumps(dict(report, initialized=True, expandable=0)), "")
    assert memory.check_expandable_segments(H100, True).reason == "the setting came too late"
    answer = (1, "", "Traceback...\nRuntimeError: CUDA error: no kernel image\n")
    got = memory.check_expandable_segments(H100, True)
    assert got.status is Status.FAIL and "exit code 1" in got.observed and "no kernel image" in got.reason


def test_the_grad_scaler_check_fails_a_scaler_that_does_not_back_off(monkeypatch):
    from trainer.optim import check_grad_scaler

    got = check_grad_scaler(H100, True, device="cpu")  # fp16 autocast and GradScaler on the CPU
    assert got.status is Status.PASS and "skipped; scale 4096 -> 2048" in got.observed
    real = torch.amp.GradScaler.update
    monkeypatch.setattr(
        torch.amp.GradScaler,
        "update",  # a scaler that never backs off
        lambda self, new_scale=None: real(self, new_scale=self.get_scale()),
    )
    got = check_grad_scaler(H100, True, device="cpu")
    assert got.status is Status.FAIL and "scale 4096 -> 4096" in got.observed
    assert got.reason == "GradScaler did not skip the overflow or lower its scale"


@pytest.mark.slow
def test_the_tf32_check_fails_where_the_flag_has_no_effect():
    """On the CPU the TF32 flag changes nothing: exactly what the check exists to catch on a GPU."""
    from trainer.device_probe import check_tf32

    got = check_tf32(H100, True, device="cpu")
    assert got.status is Status.FAIL and "does not take effect" in got.reason


# --- where a path does not apply, it says why (the capability rules, one source) -----------------------------------------


@pytest.mark.parametrize(
    "name, dev, reason",
    [
        ("tf32", T4, "compute capability 8.0"),
        ("fp16", CPU, "fp16 autocast is for CUDA"),
        ("bf16", T4, "compute capability 8.0"),
        ("fp8.tensorwise", A100, "8.9 or newer"),
        ("fp8.rowwise", CPU, "8.9 or newer"),
        ("compile.reduce-overhead", CPU, "uses CUDA graphs"),
        ("compile.max-autotune", CPU, "uses CUDA graphs"),
        ("compile.default", dataclasses.replace(H100, has_compiler=False), "triton"),
        ("expandable_segments", CPU, "CUDA allocator setting"),
        ("qlora", CPU, "bitsandbytes' CUDA kernels"),
        ("nccl", CPU, "NCCL is for CUDA devices"),
    ],
)
def test_a_path_the_device_rules_out_is_skipped_with_the_capabilitys_reason(name, dev, reason):
    p = path(name)
    got = owner(p)(dev, True, **dict(p.args))
    assert got.status is Status.SKIP and reason in got.reason


def test_qlora_without_bitsandbytes_and_nccl_on_one_gpu_are_skipped(monkeypatch):
    from trainer.dist import check_nccl
    from trainer.models import check_qlora

    monkeypatch.setattr(capabilities, "_installed", lambda m: m != "bitsandbytes")
    assert "pip install 'gptop[qlora]'" in check_qlora(H100, True).reason
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    got = check_nccl(H100, True)
    assert got.status is Status.SKIP and "two NCCL ranks need two GPUs" in got.reason


def test_a_capability_table_entry_for_every_toggle_value():
    from gptop.doctor import capability_table

    table = capability_table(H100)
    assert set(table) == set(capabilities.CHOICES)
    assert all(set(table[n]) == {str(v).lower() for v in vals} for n, vals in capabilities.CHOICES.items())
    assert table["compile"]["reduce-overhead"] == {"unsupported": None, "slow": None}
    assert table["precision"]["fp16"]["unsupported"] is None
    assert "fp16 autocast is for CUDA" in capability_table(CPU)["precision"]["fp16"]["unsupported"]


# --- the child processes -------------------------------------------------------------------------------------------------


@pytest.mark.process
def test_each_check_runs_in_a_child_that_a_hang_or_a_crash_cannot_take_down(monkeypatch):
    import trainer.doctor as runner

    def hang(dev, quick, **kw):
        time.sleep(60)

    def crash(dev, quick, **kw):
        os._exit(3)

    def boom(dev, quick, **kw):
        raise ValueError("boom")

    def fine(dev, quick, **kw):
        return Outcome(Status.PASS, "fine", None, {"x": 1})

    for fn, want in (
        (hang, ("timeout", "did not finish within 2 s (killed)")),
        (crash, ("died", "the check's process died (exit code 3) before it reported")),
        (boom, ("error", "ValueError: boom")),
        (fine, ("ok", {"status": "pass", "observed": "fine", "reason": None, "data": {"x": 1}})),
    ):
        monkeypatch.setattr(runner, "_owner", lambda p, fn=fn: fn)
        assert runner.run_in_child("timing", "cpu", True, 2.0) == want


@pytest.mark.process
def test_a_runner_whose_checks_may_start_cuda_spawns_them_instead_of_forking(monkeypatch):
    """Seen twice on an H100: every forked check failed with "Cannot re-initialize CUDA in forked subprocess",
    the second time with `torch.cuda.is_initialized()` False in the runner (an import had only asked CUDA about
    its devices, which is enough to spoil a fork). So a runner whose checks may use a GPU spawns them; a CPU
    run, or a machine without CUDA, forks (fast); and a spawned child runs a real check."""
    import torch

    import trainer.doctor as runner

    for requested in ("cpu", "cuda", "auto"):  # this CPU machine: no CUDA, CUDA never initialized
        assert runner.start_method(requested) == "fork"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, CUDA not initialized
    assert runner.start_method("cpu") == "fork"
    assert runner.start_method("cuda") == "spawn"
    assert runner.start_method("cuda:1") == "spawn"
    assert runner.start_method("auto") == "spawn"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert runner.start_method("cpu") == "spawn"
    kind, payload = runner.run_in_child("detect", "cpu", True, 120.0)
    assert kind == "ok" and payload["device"]["type"] == "cpu"


@pytest.mark.process
def test_gptop_doctor_quick_on_this_cpu(tmp_path, monkeypatch):
    """The command as a user types it: every CPU path passes or says why it cannot run here (each quick ANY path,
    timing, prefetch, checkpoint, bf16, fused_adamw and autobatch, in a child of the doctor's fresh process), every
    CUDA path is skipped with its reason, the record validates, exit 0; and the text it prints without --json."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-m", "gptop", "doctor", "--quick", "--device", "cpu", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(r.stdout.splitlines()) == 1, r.stdout[-3000:]  # --json: one JSON line, as everywhere
    record = json.loads(r.stdout)
    assert validate_report(record) == []
    assert record["ok"] and record["device"]["type"] == "cpu" and record["precision_auto"] in ("fp32", "bf16")
    rows = {c["name"]: c for c in record["checks"]}
    assert list(rows) == [p.name for p in PATHS]
    for p in PATHS:
        row = rows[p.name]
        if p.where is Where.CUDA:
            assert row["status"] == "skip" and "a CUDA path" in row["reason"], row
        elif not p.quick:
            assert row["status"] == "skip" and row["reason"] == "left out by --quick"
        elif row["status"] == "skip":
            assert p.name == "rapl" and "RAPL" in row["reason"]  # absent or unreadable here; says which
        else:
            assert row["status"] == "pass", row
    assert set(record["capabilities"]) == set(capabilities.CHOICES)
    # The same record as the command writes it without --json (one doctor run serves both: the checks are the
    # slow part, and the text is what cmd_doctor formats from the report they make).
    import io

    import gptop.doctor as doctor
    from gptop.cli import build_parser

    report = DoctorReport(
        requested=record["requested"],
        time=record["time"],
        machine=record["machine"],
        device=record["device"],
        precision_auto=record["precision_auto"],
        capabilities=record["capabilities"],
        checks=[CheckResult.from_dict(c) for c in record["checks"]],
        quick=record["quick"],
    )
    assert report.to_dict() == record
    monkeypatch.setattr(doctor, "run_doctor", lambda *a, **kw: (report, str(tmp_path / "checks.log"), None))
    text = io.StringIO()
    assert doctor.cmd_doctor(build_parser().parse_args(["doctor", "--quick", "--device", "cpu"]), out=text) == 0
    assert "every path that applies passed" in text.getvalue()
    assert "--precision auto ->" in text.getvalue() and "toggle values on this device" in text.getvalue()


@pytest.mark.process
@pytest.mark.parametrize(
    "argv, option", [(["--device", "tpu"], "--device"), (["--timeout-scale", "0"], "--timeout-scale")]
)
def test_bad_doctor_options_exit_2_naming_the_option(argv, option):
    r = subprocess.run(
        [sys.executable, "-m", "gptop", "doctor", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert r.returncode == 2 and option in r.stderr


@pytest.mark.process
# each device and each output form once (the refusal comes before the form matters): a process each
@pytest.mark.parametrize("device, json_flag", [("cuda", []), ("cuda:99", ["--json"])], ids=["cuda", "cuda:99-json"])
def test_a_device_this_machine_lacks_is_one_line_exit_2_and_leaves_no_log(tmp_path, device, json_flag):
    """`gptop doctor --device cuda` without CUDA printed a FAIL line with consequences for every path, "on ?",
    exit 1, and left its log in /tmp: a device the machine lacks is bad input, as elsewhere (one line naming
    --device, exit 2), and a doctor run leaves nothing it made behind."""
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = subprocess.run(
        [sys.executable, "-m", "gptop", "doctor", "--quick", "--device", device, *json_flag],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path)),
    )
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1 and "--device" in r.stderr, r.stderr
    assert device in r.stderr and "FAIL" not in r.stderr
    assert not list(tmp_path.glob("gptop-doctor-*")), list(tmp_path.iterdir())


def test_the_checks_log_is_removed_unless_asked_for_and_its_end_shown_on_failure(tmp_path, monkeypatch, capsys):
    """The log of the checks' processes (their tracebacks) was left in /tmp after every doctor that failed a path:
    it is removed at the end, its end shown on stderr when a path failed, and kept where `--log FILE` says."""
    import io

    import gptop.doctor as doctor
    from gptop.cli import build_parser

    failed = DoctorReport(
        requested="cpu",
        time=0.0,
        machine={},
        device=None,
        precision_auto=None,
        capabilities={},
        checks=[CheckResult.of(p, Outcome.verdict(False, "x", "why"), None) for p in PATHS],
        quick=True,
    )
    asked: list[str | None] = []

    def run_doctor(requested, quick, timeout_scale, *, progress, log_path=None):
        path = log_path or str(tmp_path / "gptop-doctor-made.log")
        Path(path).write_text("Traceback (most recent call last):\nRuntimeError: the check's own words\n")
        asked.append(log_path)
        return failed, path, None

    monkeypatch.setattr(doctor, "run_doctor", run_doctor)
    text = io.StringIO()
    assert doctor.cmd_doctor(build_parser().parse_args(["doctor", "--device", "cpu"]), out=text) == 1
    assert asked == [None] and not (tmp_path / "gptop-doctor-made.log").exists()
    assert "RuntimeError: the check's own words" in capsys.readouterr().err and "--log FILE" in text.getvalue()
    kept = tmp_path / "doctor.log"
    text = io.StringIO()
    assert doctor.cmd_doctor(build_parser().parse_args(["doctor", "--log", str(kept)]), out=text) == 1
    assert asked[-1] == str(kept) and kept.exists() and str(kept) in text.getvalue()
    assert "RuntimeError" not in capsys.readouterr().err  # kept whole: no need to show its end


# --- docs/verified.md ------------------------------------------------------------------------------------------------


def test_the_docs_say_what_was_verified_where_from_the_doctors_records():
    """docs/verified.md's "What was verified where" table is `python -m gptop.doctor --readme`: every path, and
    what each record committed under docs/doctor/ says of it, its links resolving from docs/."""
    from gptop.doctor import load_records, readme_table

    records = load_records()
    assert records, "no doctor record under docs/doctor/"
    table = readme_table(records)
    assert table in (ROOT / "docs" / "verified.md").read_text(), (
        "docs/verified.md's table is stale: python -m gptop.doctor --readme"
    )
    for name, _ in records:
        assert f"](doctor/{name})" in table and (ROOT / "docs" / "doctor" / name).is_file()
    for p in PATHS:
        assert f"(`{p.name}`)" in table


@pytest.mark.process
def test_a_stopped_doctor_leaves_no_process_behind_and_writes_what_finished(tmp_path):
    """SIGTERM to gptop doctor (a timeout, a scheduler) while a check runs: its trainer-side process and the
    check's child go with it, and --json still writes a record that validates, in which the paths that did not
    finish are skipped saying the doctor was stopped (a long GPU run is not lost to a timeout)."""
    import signal

    import psutil

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gptop", "doctor", "--device", "cpu", "--json"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    me = psutil.Process(proc.pid)
    family: set = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(family) < 2:  # the runner, and a check's child under it
        family |= {p.pid for p in me.children(recursive=True)}
        time.sleep(0.2)
    assert len(family) >= 2, "the doctor never started its processes"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped" in err
    record = json.loads(out)
    assert validate_report(record) == []
    assert len(record["checks"]) == len(PATHS)
    stopped = [c for c in record["checks"] if "the doctor was stopped (exit code 143)" in (c["reason"] or "")]
    assert stopped, "no path says the doctor was stopped"
    assert all(c["status"] == "skip" for c in stopped)
    gone_by = time.monotonic() + 30
    while time.monotonic() < gone_by and any(
        psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in family
    ):
        time.sleep(0.2)
    left = [p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not left, f"left behind: {left}"


@pytest.mark.process
def test_the_workload_says_it_is_busy_and_stops_when_its_stdin_closes(tmp_path):
    """`python -m trainer.doctor --load` (what the energy check samples a GPU under) on the CPU: its first line
    is the `busy` line, and closing its stdin ends it long before its seconds are up."""
    from gptop.doctor import gpu_workload

    with open(tmp_path / "log", "w") as log:
        t0 = time.monotonic()
        with gpu_workload("cpu", log, seconds=120.0, start_timeout=120.0) as problem:
            assert problem is None, (tmp_path / "log").read_text()
        assert time.monotonic() - t0 < 60.0  # stopped by the closed stdin, not by its 120 s
