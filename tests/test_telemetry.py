"""Device telemetry without a GPU: NVML through a fake `pynvml`, the CPU side with real psutil, RAPL in tmp_path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from collections import Counter

import psutil
import pynvml
import pytest

from gptop.nvml import Nvml, na
from gptop.energy import Rapl, energy_between
from gptop.telemetry import DeviceSampler
from trainer.contract.events import CpuReading, DeviceEvent, GpuReading, MalformedEvent, dumps, parse

NOT_SUPPORTED = pynvml.NVMLError_NotSupported
NO_PERMISSION = pynvml.NVMLError_NoPermission
UNKNOWN = pynvml.NVMLError_Unknown


class FakeClock:
    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def fake_pynvml(*, init_error=None, count=2, errors=None, procs=None, power_mw=250_000, energy_mj=None):
    """A module shaped like pynvml, raising the real NVMLError_* classes where `errors` says.

    errors: {(device_index, function_name): exception class}. Calls are counted in `mod.calls`.
    """
    errors = errors or {}
    calls: Counter = Counter()
    energy = {i: (energy_mj or 1_000_000) for i in range(count)}
    mod = types.SimpleNamespace(calls=calls, energy=energy)
    for name in dir(pynvml):
        if name.startswith(("NVMLError", "NVML_ERROR_")) or name in ("NVML_TEMPERATURE_GPU", "NVML_CLOCK_SM"):
            setattr(mod, name, getattr(pynvml, name))
    mod.NVMLLibraryMismatchError = pynvml.NVMLLibraryMismatchError

    def init():
        calls["nvmlInit"] += 1
        if init_error is not None:
            raise init_error()

    def device_fn(name, result):
        def fn(handle, *args):
            calls[(handle, name)] += 1
            err = errors.get((handle, name))
            if err is not None:
                raise err()
            return result(handle, *args)

        fn.__name__ = name
        return fn

    mod.nvmlInit = init
    mod.nvmlShutdown = lambda: calls.__setitem__("nvmlShutdown", calls["nvmlShutdown"] + 1)
    mod.nvmlDeviceGetCount = lambda: count
    mod.nvmlDeviceGetHandleByIndex = lambda i: i  # the handle is the index: easy to key errors on
    ns = types.SimpleNamespace
    mod.nvmlDeviceGetName = device_fn("nvmlDeviceGetName", lambda h: b"NVIDIA H100 80GB HBM3")
    mod.nvmlDeviceGetUtilizationRates = device_fn("nvmlDeviceGetUtilizationRates", lambda h: ns(gpu=87, memory=40))
    mod.nvmlDeviceGetMemoryInfo = device_fn(
        "nvmlDeviceGetMemoryInfo", lambda h: ns(used=10 * 2**30, total=80 * 2**30, free=70 * 2**30)
    )
    mod.nvmlDeviceGetPowerUsage = device_fn("nvmlDeviceGetPowerUsage", lambda h: power_mw)
    mod.nvmlDeviceGetEnforcedPowerLimit = device_fn("nvmlDeviceGetEnforcedPowerLimit", lambda h: 700_000)
    mod.nvmlDeviceGetPowerManagementLimit = device_fn("nvmlDeviceGetPowerManagementLimit", lambda h: 650_000)
    mod.nvmlDeviceGetTotalEnergyConsumption = device_fn("nvmlDeviceGetTotalEnergyConsumption", lambda h: energy[h])
    mod.nvmlDeviceGetTemperatureV = device_fn("nvmlDeviceGetTemperatureV", lambda h, s: 61)
    mod.nvmlDeviceGetTemperature = device_fn("nvmlDeviceGetTemperature", lambda h, s: 60)
    mod.nvmlDeviceGetClockInfo = device_fn("nvmlDeviceGetClockInfo", lambda h, c: 1980)
    mod.nvmlDeviceGetComputeRunningProcesses = device_fn(
        "nvmlDeviceGetComputeRunningProcesses", lambda h: list(procs or [])
    )
    # identity: UUID and PCI address per GPU (GPU h sits on bus 0x17 + h), as NVML spells them
    mod.uuids = {i: f"GPU-{i:08x}-1111-2222-3333-44445555666{i}" for i in range(count)}
    mod.nvmlDeviceGetUUID = device_fn("nvmlDeviceGetUUID", lambda h: mod.uuids[h])
    mod.nvmlDeviceGetPciInfo = device_fn(
        "nvmlDeviceGetPciInfo", lambda h: ns(busId=f"00000000:{0x17 + h:02X}:00.0".encode())
    )
    mod.nvmlDeviceGetIndex = device_fn("nvmlDeviceGetIndex", lambda h: h)

    def by_uuid(uuid):
        calls["nvmlDeviceGetHandleByUUID"] += 1
        for i, u in mod.uuids.items():
            if u == uuid:
                return i
        raise pynvml.NVMLError_NotFound()

    mod.nvmlDeviceGetHandleByUUID = by_uuid
    return mod


def make_sampler(mod, tmp_path, **kw) -> DeviceSampler:
    return DeviceSampler(nvml=mod, rapl_root=str(tmp_path / "no-powercap"), **kw)


# --------------------------------------------------------------------------- NVML wrapper


def test_nvml_errors_become_na_and_permanent_ones_are_not_retried(tmp_path):
    errors = {
        (0, "nvmlDeviceGetPowerUsage"): NOT_SUPPORTED,
        (0, "nvmlDeviceGetTotalEnergyConsumption"): NO_PERMISSION,
        (0, "nvmlDeviceGetTemperatureV"): pynvml.NVMLError_FunctionNotFound,  # old driver: falls back
        (1, "nvmlDeviceGetClockInfo"): UNKNOWN,  # transient: asked again
        (1, "nvmlDeviceGetEnforcedPowerLimit"): NOT_SUPPORTED,  # falls back to the other limit
    }
    mod = fake_pynvml(errors=errors)
    s = make_sampler(mod, tmp_path)
    assert s.mode == "gpu"
    first = s.sample_once()
    g0, g1 = first.devices
    assert g0.name == "NVIDIA H100 80GB HBM3"  # bytes decoded
    assert g0.power_w is None and g0.energy_j is None
    assert g0.temp_c == 60.0  # deprecated call used when the V call is missing
    assert g0.util_pct == 87.0 and g0.mem_used == 10 * 2**30 and g0.mem_total == 80 * 2**30
    assert g0.power_limit_w == 700.0 and g0.sm_clock_mhz == 1980.0
    assert g1.sm_clock_mhz is None and g1.power_w == 250.0 and g1.energy_j == 1000.0
    assert g1.power_limit_w == 650.0 and g1.temp_c == 60.0  # the missing function is known for GPU 1 too
    assert na(g0.power_w, ".0f", " W") == "n/a" and na(g1.power_w, ".0f", " W") == "250 W"
    assert g0.power_note == "the driver reports no power for this GPU" and g1.power_note is None

    before = Counter(mod.calls)
    for _ in range(3):
        s.sample_once()
    c = mod.calls
    assert c[(0, "nvmlDeviceGetPowerUsage")] == before[(0, "nvmlDeviceGetPowerUsage")] == 1
    assert c[(0, "nvmlDeviceGetTotalEnergyConsumption")] == 1
    assert c[(0, "nvmlDeviceGetTemperatureV")] == 1
    assert c[(1, "nvmlDeviceGetTemperatureV")] == 0  # FunctionNotFound is remembered for every device
    assert c[(1, "nvmlDeviceGetEnforcedPowerLimit")] == 1
    assert c[(1, "nvmlDeviceGetClockInfo")] == 4  # Unknown is retried each sample
    assert c[(1, "nvmlDeviceGetPowerUsage")] == 4
    assert c[(0, "nvmlDeviceGetName")] == 1  # static, cached
    assert c["nvmlInit"] == 1
    s.stop()
    s.stop()
    assert c["nvmlShutdown"] == 1


def test_queries_whose_arguments_are_ctypes_pointers_are_answered_and_remembered():
    """pynvml's handles, event sets and GPM samples are ctypes pointers, which are unhashable; a query that
    takes one (registering a GPU for Xid events) is asked, and a permanent error on it is remembered like any
    other (seen on an H100: the first sample of every run raised TypeError there)."""
    mod = fake_pynvml(count=1)
    registered = []

    def register(handle, kinds, event_set):
        registered.append(event_set)
        if len(registered) > 1:
            raise NOT_SUPPORTED()

    mod.nvmlDeviceRegisterEvents = register
    event_set = pynvml.c_nvmlEventSet_t()
    with pytest.raises(TypeError):
        hash(event_set)
    nv = Nvml(mod)
    assert nv.open()
    assert nv.device_query(0, "nvmlDeviceRegisterEvents", 8, event_set) is None  # answered (None), no TypeError
    assert registered == [event_set]
    assert nv.device_query(0, "nvmlDeviceRegisterEvents", 8, pynvml.c_nvmlEventSet_t()) is None  # NotSupported
    assert nv.is_unsupported(0, "nvmlDeviceRegisterEvents", 8, event_set)
    assert nv.device_query(0, "nvmlDeviceRegisterEvents", 8, event_set) is None
    assert len(registered) == 2  # remembered: not asked a third time
    assert not nv.is_unsupported(0, "nvmlDeviceRegisterEvents", 9, event_set)  # another kind of event


def test_gpu_is_lost_makes_device_na_without_hammering(tmp_path):
    mod = fake_pynvml(count=1, errors={(0, "nvmlDeviceGetUtilizationRates"): pynvml.NVMLError_GpuIsLost})
    s = make_sampler(mod, tmp_path)
    s.sample_once()
    g = s.sample_once().devices[0]
    assert g.util_pct is None and g.power_w is None and g.mem_used is None
    assert mod.calls[(0, "nvmlDeviceGetUtilizationRates")] == 1
    assert mod.calls[(0, "nvmlDeviceGetPowerUsage")] == 0  # nothing more is asked of a lost GPU
    s.stop()


@pytest.mark.parametrize("error", [pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded])
def test_no_nvml_library_is_cpu_mode(tmp_path, error):
    mod = fake_pynvml(init_error=error)
    s = make_sampler(mod, tmp_path)
    assert s.mode == "cpu"
    assert "no NVIDIA GPU" in s.reason
    sample = s.sample_once()
    assert sample.devices == [] and sample.mode == "cpu"
    assert mod.calls["nvmlInit"] == 1
    s.stop()
    assert mod.calls["nvmlShutdown"] == 0  # never initialized, never shut down


def test_pynvml_import_failure_and_zero_gpus_are_cpu_mode(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    nv = Nvml()
    assert nv.open() is False and "not importable" in nv.reason
    s = make_sampler(fake_pynvml(count=0), tmp_path)
    assert s.mode == "cpu"
    s.stop()


def test_real_pynvml_on_this_machine_does_not_raise(tmp_path):
    """On a machine without the driver the real bindings must land in CPU mode; with one, in GPU mode."""
    s = DeviceSampler(rapl_root=str(tmp_path))
    sample = s.sample_once()
    assert s.mode in ("gpu", "cpu")
    assert (s.mode == "gpu") == bool(sample.devices)
    s.stop()


@pytest.mark.process
def test_proc_mem_counts_trainer_pids_and_children(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        procs = [
            types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=3 * 2**30),
            types.SimpleNamespace(pid=child.pid, usedGpuMemory=2**30),
            types.SimpleNamespace(pid=1, usedGpuMemory=7 * 2**30),  # not ours
            types.SimpleNamespace(pid=child.pid + 10**6, usedGpuMemory=None),
        ]
        mod = fake_pynvml(count=1, procs=procs)
        s = make_sampler(mod, tmp_path, pids=lambda: [os.getpid()])
        assert s.sample_once().devices[0].proc_mem == 4 * 2**30
        s._pids = lambda: []
        assert s.sample_once().devices[0].proc_mem is None  # no trainer yet: n/a, not 0
        s.stop()
    finally:
        child.kill()
        child.wait()


def test_the_process_tree_is_walked_only_now_and_then(tmp_path, monkeypatch):
    """A walk of the trainer's process tree reads all of /proc (issue 13: most of the dashboard's CPU on a busy
    machine at every 0.5 s sample); it is walked again only after TREE_REFRESH_S or when the roots change."""
    walks = []
    real = psutil.Process.children

    def children(self, recursive=False):
        walks.append(self.pid)
        return real(self, recursive=recursive)

    monkeypatch.setattr(psutil.Process, "children", children)
    roots = [os.getpid()]
    s = make_sampler(fake_pynvml(init_error=pynvml.NVMLError_LibraryNotFound), tmp_path, pids=lambda: roots)
    for _ in range(5):
        assert s.sample_once().cpu.proc_rss > 0
    assert walks == [os.getpid()]
    roots = [os.getpid(), os.getppid()]  # a restarted trainer, a new rank: walked at once
    s.sample_once()
    assert sorted(walks[1:]) == sorted(roots)
    s.stop()


# --------------------------------------------------------------------------- CPU mode, real psutil


def test_cpu_mode_values_are_sane(tmp_path):
    s = make_sampler(fake_pynvml(init_error=pynvml.NVMLError_LibraryNotFound), tmp_path, pids=lambda: [os.getpid()])
    first = s.sample_once()
    assert first.cpu.proc_cpu_pct is None  # no baseline yet
    deadline = time.perf_counter() + 0.15
    while time.perf_counter() < deadline:
        pass
    c = s.sample_once().cpu
    assert 0.0 <= c.util_pct <= 100.0
    assert len(c.per_core) == psutil.cpu_count()
    assert all(0.0 <= x <= 100.0 for x in c.per_core)
    assert 0 < c.mem_used <= c.mem_total == psutil.virtual_memory().total
    own = psutil.Process().memory_info().rss
    assert 0.5 * own < c.proc_rss < 2 * own
    assert c.proc_cpu_pct is not None and 0.0 < c.proc_cpu_pct <= 100.0
    assert c.power_w is None and c.energy_j is None  # no RAPL under tmp_path
    assert c.name
    s.stop()


@pytest.mark.process
def test_dead_or_missing_trainer_pid_is_na(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    s = make_sampler(fake_pynvml(init_error=pynvml.NVMLError_LibraryNotFound), tmp_path, pids=lambda: [child.pid])
    c = s.sample_once().cpu
    assert c.proc_rss is None and c.proc_cpu_pct is None
    s._pids = lambda: 1 / 0  # a broken pids() callable must not break sampling
    assert s.sample_once().cpu.proc_rss is None
    s.stop()


# --------------------------------------------------------------------------- RAPL


def rapl_tree(root, domains):
    """domains: {dirname: (name, energy_uj, max_range)}."""
    for d, (name, energy, max_range) in domains.items():
        p = root / d
        p.mkdir(parents=True)
        (p / "name").write_text(name + "\n")
        (p / "energy_uj").write_text(f"{energy}\n")
        (p / "max_energy_range_uj").write_text(f"{max_range}\n")


def set_energy(root, d, value):
    (root / d / "energy_uj").write_text(f"{value}\n")


def test_rapl_sums_packages_and_undoes_wraparound(tmp_path):
    root = tmp_path / "powercap"
    rapl_tree(
        root,
        {
            "intel-rapl:0": ("package-0", 900_000, 1_000_000),
            "intel-rapl:0:0": ("core", 1, 1_000_000),  # inside the package: ignored
            "intel-rapl:1": ("package-1", 10_000_000, 2**32),
            "intel-rapl:2": ("psys", 5, 2**32),  # platform total: would double count
        },
    )
    (root / "intel-rapl").mkdir()  # the control-type dir, no counters
    clock = FakeClock()
    s = DeviceSampler(nvml=fake_pynvml(init_error=pynvml.NVMLError_LibraryNotFound), rapl_root=str(root), clock=clock)
    first = s.sample_once().cpu
    assert first.energy_j == 0.0 and first.power_w is None
    set_energy(root, "intel-rapl:0", 100_000)  # wrapped: +200_000 uJ
    set_energy(root, "intel-rapl:1", 10_300_000)  # +300_000 uJ
    clock.t += 0.5
    c = s.sample_once().cpu
    assert c.energy_j == pytest.approx(0.5)
    assert c.power_w == pytest.approx(1.0)
    # one missed read of a domain: its next delta covers the gap
    (root / "intel-rapl:1" / "energy_uj").unlink()
    set_energy(root, "intel-rapl:0", 200_000)
    clock.t += 0.5
    assert s.sample_once().cpu.energy_j == pytest.approx(0.6)
    set_energy(root, "intel-rapl:1", 10_700_000)
    clock.t += 0.5
    c = s.sample_once().cpu
    assert c.energy_j == pytest.approx(1.0)
    assert energy_between(s.history(), 1_000.0, clock.t) == pytest.approx(1.0)
    assert energy_between(s.history(), 1_000.25, 1_000.5) == pytest.approx(0.25)
    s.stop()


def test_rapl_unreadable_is_none(tmp_path):
    root = tmp_path / "powercap"
    rapl_tree(root, {"intel-rapl:0": ("package-0", 1, 100)})
    (root / "intel-rapl:0" / "energy_uj").unlink()
    (root / "intel-rapl:0" / "energy_uj").mkdir()  # reading raises, as root-only files do for users
    r = Rapl(str(root))
    assert not r.available and r.read(1.0) == (None, None)


# --------------------------------------------------------------------------- history


def test_history_is_bounded_and_windowed(tmp_path):
    assert DeviceSampler().history_seconds == 600
    assert DeviceSampler()._history.maxlen >= 600 / 0.5
    clock = FakeClock()
    s = make_sampler(fake_pynvml(count=1), tmp_path, interval=0.5, history_seconds=5, clock=clock)
    for _ in range(100):
        s.sample_once()
        clock.t += 0.5
    h = s.history()
    assert 10 <= len(h) == s._history.maxlen <= 40
    assert [x.time for x in h] == sorted(x.time for x in h)
    assert h[-1] is s.latest()
    clock.t = h[-1].time
    assert [x.time for x in s.history(2.0)] == [h[-1].time - 2.0 + 0.5 * i for i in range(5)]
    s.stop()


# --------------------------------------------------------------------------- energy_between


def gpu(index, energy=None, power=None):
    return GpuReading(
        index=index,
        name="g",
        util_pct=None,
        mem_used=None,
        mem_total=None,
        power_w=power,
        power_limit_w=None,
        energy_j=energy,
        temp_c=None,
        sm_clock_mhz=None,
        proc_mem=None,
    )


def cpu(energy=None, power=None):
    return CpuReading(
        util_pct=0.0,
        per_core=[0.0],
        mem_used=1,
        mem_total=2,
        proc_rss=None,
        proc_cpu_pct=None,
        power_w=power,
        energy_j=energy,
    )


def DeviceSample(t, gpus, cpu):  # noqa: N802 - a sample at time t, as the sampler makes them
    return DeviceEvent(time=t, devices=gpus, cpu=cpu, mode="gpu" if gpus else "cpu")


def test_energy_between_gpu_counters_interpolate_and_skip_missing():
    # GPU 0 at 100 W by counter, one sample missing its counter; GPU 1 with no counter at 50 W.
    samples = [
        DeviceSample(t, [gpu(0, None if t == 2 else 1000 + 100 * t, 100.0), gpu(1, None, 50.0)], cpu())
        for t in range(0, 6)
    ]
    assert energy_between(samples, 1.0, 4.0) == pytest.approx(300 + 150)
    assert energy_between(samples, 1.25, 1.75) == pytest.approx(75)
    assert energy_between(samples, 2.0, 2.0) == 0.0
    assert energy_between(samples, 1.0, 4.0, devices=[0]) == pytest.approx(300)
    assert energy_between(samples, 4.5, 5.5) == pytest.approx(150)  # a little past the last sample
    assert energy_between(samples, 50.0, 60.0) is None  # not sampled: not invented
    assert energy_between(samples, 1.0, 4.0, devices=[7]) is None
    assert energy_between([], 0, 1) is None
    with pytest.raises(ValueError):
        energy_between(samples, 2.0, 1.0)


def test_energy_between_power_fallback_and_counter_reset():
    samples = [
        DeviceSample(0.0, [gpu(0, 5000.0, 200.0)], cpu()),
        DeviceSample(1.0, [gpu(0, 5200.0, 200.0)], cpu()),
        DeviceSample(2.0, [gpu(0, 10.0, 100.0)], cpu()),  # driver reload: counter restarted
        DeviceSample(3.0, [gpu(0, 110.0, 100.0)], cpu()),
    ]
    assert energy_between(samples, 0.0, 3.0) == pytest.approx(200 + 150 + 100)
    trapezoid = [DeviceSample(float(t), [gpu(0, None, p)], cpu()) for t, p in enumerate([100.0, 300.0, None, 300.0])]
    assert energy_between(trapezoid, 0.0, 1.0) == pytest.approx(200)
    assert energy_between(trapezoid, 1.0, 3.0) == pytest.approx(600)  # gap bridged
    nothing = [DeviceSample(float(t), [gpu(0)], cpu()) for t in range(3)]
    assert energy_between(nothing, 0.0, 2.0) is None


def test_energy_between_cpu_mode_uses_rapl_then_power():
    samples = [DeviceSample(float(t), [], cpu(energy=10.0 * t, power=99.0)) for t in range(4)]
    assert energy_between(samples, 0.5, 2.5) == pytest.approx(20.0)
    samples = [DeviceSample(float(t), [], cpu(power=30.0)) for t in range(4)]
    assert energy_between(samples, 0.0, 3.0) == pytest.approx(90.0)
    assert energy_between([DeviceSample(0.0, [], cpu())], 0.0, 0.0) is None


# --------------------------------------------------------------------------- thread


def test_thread_starts_stops_promptly_and_notifies(tmp_path):
    mod = fake_pynvml(count=1)
    s = make_sampler(mod, tmp_path, interval=0.02)
    seen = []
    unsubscribe = s.subscribe(seen.append)
    s.subscribe(lambda sample: 1 / 0)  # a failing subscriber must not stop the others or the thread
    t0 = time.monotonic()
    with s:
        s.start()  # idempotent
        while len(seen) < 3 and time.monotonic() - t0 < 1.0:
            time.sleep(0.01)
        t_stop = time.monotonic()
    assert time.monotonic() - t_stop < 1.0  # prompt: one 0.02 s interval, with slack for a busy CI
    assert len(seen) >= 3 and seen[-1] is s.latest()
    assert mod.calls["nvmlInit"] == 1 and mod.calls["nvmlShutdown"] == 1
    unsubscribe()
    n = len(seen)
    s.sample_once()
    assert len(seen) == n
    s.stop()
    assert not any(t.name == "gptop-device-sampler" and t.is_alive() for t in __import__("threading").enumerate())


def test_stop_without_start_is_fine(tmp_path):
    s = make_sampler(fake_pynvml(), tmp_path)
    s.stop()
    assert s.latest() is None and s.history() == []


# --------------------------------------------------------------------------- events


@pytest.mark.parametrize("gpu_mode", [True, False])
def test_samples_are_device_events_that_round_trip_through_the_schema(tmp_path, gpu_mode):
    mod = (
        fake_pynvml(errors={(0, "nvmlDeviceGetPowerUsage"): NOT_SUPPORTED})
        if gpu_mode
        else fake_pynvml(init_error=pynvml.NVMLError_LibraryNotFound)
    )
    s = make_sampler(mod, tmp_path, pids=lambda: [os.getpid()])
    sample = s.sample_once()
    assert isinstance(sample, DeviceEvent)
    wire = json.loads(dumps(sample))
    assert wire["type"] == "device" and wire["time"] == sample.time
    assert wire["mode"] == ("gpu" if gpu_mode else "cpu")
    assert len(wire["devices"]) == (2 if gpu_mode else 0)
    if gpu_mode:
        assert wire["devices"][0]["power_w"] is None and wire["devices"][1]["power_w"] == 250.0
    assert wire["cpu"]["mem_total"] == psutil.virtual_memory().total
    back = parse(dumps(sample))
    assert back == sample
    assert back.devices == sample.devices
    assert back.cpu.mem_used == sample.cpu.mem_used and back.cpu.proc_rss == sample.cpu.proc_rss
    s.stop()


@pytest.mark.parametrize(
    "line",
    [
        '{"v":1,"type":"device","time":1.0,"rank":0,"devices":5}',
        '{"v":1,"type":"device","time":1.0,"rank":0,"devices":[5]}',
        '{"v":1,"type":"device","time":1.0,"rank":0,"devices":[{"index":"0"}]}',
        '{"v":1,"type":"device","time":1.0,"rank":0,"devices":[],"cpu":{"per_core":"x"}}',
        '{"v":1,"type":"device","time":1.0,"rank":0,"devices":[],"cpu":{"per_core":[1, null]}}',
        '{"v":1,"type":"device","time":1.0,"rank":0,"devices":[],"cpu":[]}',
    ],
)
def test_a_wrongly_typed_device_record_is_malformed_not_a_crash_later(line):
    with pytest.raises(MalformedEvent):
        parse(line)


def test_a_cpu_reading_says_why_there_is_no_power(tmp_path, monkeypatch):
    """The CPU panel says why power is n/a: the sample carries the RAPL reader's reason (gptop.energy.Rapl)."""
    import gptop.energy

    monkeypatch.setattr(gptop.energy.os, "geteuid", lambda: 1000)  # a user, for whom the files are root-only
    root = tmp_path / "powercap"
    rapl_tree(root, {"intel-rapl:0": ("package-0", 1, 2**32)})
    (root / "intel-rapl:0" / "energy_uj").unlink()  # unreadable (Linux 5.10+ as a user): absent here
    s = DeviceSampler(
        nvml=fake_pynvml(init_error=pynvml.NVMLError_LibraryNotFound), rapl_root=str(root), clock=FakeClock()
    )
    c = s.sample_once().cpu
    assert c.power_w is None and c.power_note == Rapl(str(root)).reason and "root-only" in c.power_note
    s.stop()
    s = DeviceSampler(
        nvml=fake_pynvml(init_error=pynvml.NVMLError_LibraryNotFound),
        rapl_root=str(tmp_path / "absent"),
        clock=FakeClock(),
    )
    assert "no RAPL package domain" in s.sample_once().cpu.power_note
    s.stop()


# --------------------------------------------------------------------------- the training device, without torch


def test_training_device_from_nvml_and_the_environment(monkeypatch):
    """What `--size auto` resolves on, guessed before the trainer starts (gptop names the run directory by it)."""
    from gptop.nvml import Nvml
    from gptop.telemetry import training_device

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    dev = training_device("auto", Nvml(fake_pynvml(count=2)))
    assert dev.is_cuda and dev.index == 0 and dev.total_memory == 80 * 2**30 and dev.name == "NVIDIA H100 80GB HBM3"
    assert training_device("cuda:1", Nvml(fake_pynvml(count=2))).index == 1
    assert not training_device("cpu", Nvml(fake_pynvml(count=2))).is_cuda
    no_gpu = training_device("auto", Nvml(fake_pynvml(init_error=pynvml.NVMLError_LibraryNotFound)))
    assert no_gpu.type == "cpu" and no_gpu.cpu_count >= 1 and no_gpu.total_memory > 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert training_device("auto", Nvml(fake_pynvml(count=2))).index == 1  # CUDA's 0 is NVML's 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not training_device("auto", Nvml(fake_pynvml(count=2))).is_cuda  # no GPU visible to torch
    mod = fake_pynvml(count=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mod.uuids[1])  # UUIDs, as schedulers set them
    dev = training_device("auto", Nvml(mod))
    assert dev.is_cuda and dev.index == 1 and dev.uuid == mod.uuids[1] and dev.total_memory == 80 * 2**30
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-not-here")
    assert not training_device("auto", Nvml(fake_pynvml(count=2))).is_cuda
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert not training_device("cuda:1", Nvml(fake_pynvml(count=2))).is_cuda  # cuda:1 is not visible


def test_torch_and_nvml_spell_a_gpus_identity_the_same():
    """CUDA's indices are renumbered by CUDA_VISIBLE_DEVICES and ordered fastest-first, NVML's by PCI bus:
    gptop matches a CUDA device to an NVML one by UUID (or PCI address), spelled one way for both."""
    from trainer.contract.device import DeviceInfo, gpu_key

    nvml_uuid, torch_uuid = "GPU-58D1B8B4-E1C8-11EE-0000-0123456789AB", "58d1b8b4-e1c8-11ee-0000-0123456789ab"
    assert gpu_key(nvml_uuid) == gpu_key(torch_uuid) == torch_uuid
    assert gpu_key("MIG-58d1b8b4-e1c8-11ee-0000-0123456789ab") == torch_uuid
    assert gpu_key(None, "00000000:17:00.0") == gpu_key(None, "0000:17:00") == "pci:0000:17:00"
    assert gpu_key(torch_uuid, "0000:17:00") == torch_uuid  # the UUID first
    assert gpu_key(None, "garbage") is None and gpu_key() is None
    dev = DeviceInfo(type="cuda", index=0, name="H100", uuid=torch_uuid, pci_bus_id="0000:17:00")
    assert dev.key == torch_uuid and DeviceInfo.from_dict(dev.to_dict()) == dev
    assert DeviceInfo(type="cpu").key is None


def test_samples_carry_each_gpus_identity(tmp_path):
    mod = fake_pynvml(count=2)
    s = make_sampler(mod, tmp_path)
    s.sample_once()
    second = s.sample_once()
    s.stop()
    assert [g.uuid for g in second.devices] == [mod.uuids[0], mod.uuids[1]]
    assert [g.pci_bus_id for g in second.devices] == ["00000000:17:00.0", "00000000:18:00.0"]
    assert mod.calls[(0, "nvmlDeviceGetUUID")] == 1  # asked once per GPU, not per sample


def test_a_size_auto_run_directory_is_named_by_the_size_it_resolves_to(monkeypatch, tmp_path):
    import gptop.telemetry
    from gptop.cli import build_parser
    from gptop.preflight import resolve_config
    from trainer.contract.device import DeviceInfo

    monkeypatch.chdir(tmp_path)
    gpu = DeviceInfo(type="cuda", index=0, name="Tesla V100-SXM2-16GB", total_memory=16 << 30)
    monkeypatch.setattr(gptop.telemetry, "training_device", lambda requested: gpu)
    name = lambda *argv: resolve_config(build_parser().parse_args(["train", *argv])).run.run_dir
    assert name().endswith("-llama-medium") and name("--model", "deepseek").endswith("-deepseek-small")
    assert name("--size", "tiny").endswith("-llama-tiny")
    cpu = DeviceInfo(type="cpu", cpu_count=2, total_memory=24 << 30)
    monkeypatch.setattr(gptop.telemetry, "training_device", lambda requested: cpu)
    assert name().endswith("-llama-tiny")
