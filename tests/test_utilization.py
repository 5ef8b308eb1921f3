"""Utilization that tells the truth: GPM SM/tensor activity, clocks and their reasons, and the verdict
"busy but slow". Against a fake `pynvml` only (no GPU here): the GPM request is the real pynvml ctypes
structure, so its field names are the bindings' own."""

from __future__ import annotations

import io

import pynvml
import pytest
from rich.console import Console

from gptop.headless import HeadlessView
from gptop.nvml import Nvml, throttle_reasons
from gptop.state import RunState, gpu_verdict
from gptop.ui.render import devices
from test_telemetry import FakeClock, fake_pynvml, make_sampler
from trainer.contract.events import DeviceEvent, GpuReading


def with_gpm(mod, *, supported=True, sm=42.0, tensor=30.0, reasons=0x0, max_clock=1980, sm_clock=None):
    """Add GPM, max clocks and clock-event reasons to a fake pynvml."""
    held = []
    mod.gpm = {"alloc": 0, "free": 0, "get": 0, "held": held}
    mod.c_nvmlGpmMetricsGet_t = pynvml.c_nvmlGpmMetricsGet_t
    mod.NVML_GPM_METRICS_GET_VERSION = pynvml.NVML_GPM_METRICS_GET_VERSION

    def support(handle):
        return pynvml.c_nvmlGpmSupport_t(version=1, isSupportedDevice=1 if supported else 0)

    def alloc():
        mod.gpm["alloc"] += 1
        return pynvml.c_nvmlGpmSample_t()

    def free(sample):
        mod.gpm["free"] += 1

    def get(handle, sample):
        mod.gpm["get"] += 1
        return sample

    def metrics(request):
        assert request.version == pynvml.NVML_GPM_METRICS_GET_VERSION and request.numMetrics == 2
        values = {pynvml.NVML_GPM_METRIC_SM_UTIL: sm, pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: tensor}
        for i in range(request.numMetrics):
            m = request.metrics[i]
            m.value, m.nvmlReturn = values[m.metricId], 0
        return request

    mod.nvmlGpmQueryDeviceSupport = support
    mod.nvmlGpmSampleAlloc = alloc
    mod.nvmlGpmSampleFree = free
    mod.nvmlGpmSampleGet = get
    mod.nvmlGpmMetricsGet = metrics
    mod.nvmlDeviceGetMaxClockInfo = lambda h, c: max_clock
    mod.nvmlDeviceGetCurrentClocksEventReasons = lambda h: reasons
    if sm_clock is not None:
        mod.nvmlDeviceGetClockInfo = lambda h, c: sm_clock
    return mod


def test_gpm_activity_clocks_and_reasons_are_sampled(tmp_path):
    mod = with_gpm(fake_pynvml(count=2), reasons=0x4 | 0x1)
    s = make_sampler(mod, tmp_path, clock=FakeClock())
    first = s.sample_once().devices[0]
    assert first.sm_active_pct is None and first.tensor_active_pct is None  # one sample is no interval
    assert first.sm_clock_mhz == 1980 and first.sm_clock_max_mhz == 1980
    assert first.clock_reasons == ["idle", "power cap"]
    g = s.sample_once().devices[1]
    assert (g.sm_active_pct, g.tensor_active_pct) == (42.0, 30.0)
    assert mod.gpm["alloc"] - mod.gpm["free"] == 2  # one kept per GPU
    s.stop()
    assert mod.gpm["alloc"] == mod.gpm["free"]  # and freed on close


@pytest.mark.parametrize("how", ["unsupported device", "NotSupported", "old bindings"])
def test_no_gpm_is_none_and_not_asked_again(tmp_path, how):
    mod = with_gpm(fake_pynvml(count=1), supported=how != "unsupported device")
    if how == "NotSupported":

        def get(handle, sample):
            mod.gpm["get"] += 1
            raise pynvml.NVMLError_NotSupported()

        mod.nvmlGpmSampleGet = get
    elif how == "old bindings":
        del mod.nvmlGpmQueryDeviceSupport
    s = make_sampler(mod, tmp_path, clock=FakeClock())
    for _ in range(4):
        g = s.sample_once().devices[0]
        assert g.sm_active_pct is None and g.tensor_active_pct is None
        assert g.util_pct == 87  # the rest of the sample is there
    assert mod.gpm["get"] <= 1 and mod.gpm["alloc"] <= 1
    s.stop()
    assert mod.gpm["alloc"] == mod.gpm["free"]


def test_clock_reasons_fall_back_to_the_deprecated_call_or_are_none(tmp_path):
    mod = with_gpm(fake_pynvml(count=1))
    del mod.nvmlDeviceGetCurrentClocksEventReasons
    mod.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: 0x40
    nv = Nvml(mod)
    assert nv.open() and nv.clock_reasons(0) == ["hw thermal"]
    del mod.nvmlDeviceGetCurrentClocksThrottleReasons
    assert Nvml(mod).open() and Nvml(mod).clock_reasons(0) is None
    assert throttle_reasons(0) == [] and throttle_reasons(None) is None
    assert throttle_reasons(0x8 | 0x80) == ["hw slowdown", "power brake"]


def reading(**kw) -> GpuReading:
    base = dict(
        index=0,
        name="NVIDIA H100 80GB HBM3",
        util_pct=97.0,
        sm_clock_mhz=1980.0,
        sm_clock_max_mhz=1980.0,
        clock_reasons=[],
        sm_active_pct=85.0,
        tensor_active_pct=60.0,
    )
    return GpuReading(**{**base, **kw})


def test_the_verdict_says_when_a_busy_gpu_is_slow():
    assert gpu_verdict(reading()) is None  # busy and working
    assert gpu_verdict(reading(util_pct=10.0, sm_active_pct=1.0)) is None  # idle: nothing to judge
    assert (
        gpu_verdict(reading(clock_reasons=["power cap"], sm_clock_mhz=1410.0))
        == "busy but power-capped (SM clock 1410 of 1980 MHz)"
    )
    assert gpu_verdict(reading(clock_reasons=["idle", "sw thermal", "hw thermal"])).startswith(
        "busy but thermally throttled and thermally throttled (HW)"
    )
    low = gpu_verdict(reading(sm_active_pct=20.0, tensor_active_pct=5.0))
    assert low.startswith("util 97% but SMs only 20% active, tensor pipes 5%")
    assert gpu_verdict(reading(sm_clock_mhz=900.0)) == "busy but slow clocks (SM clock 900 of 1980 MHz)"
    assert gpu_verdict(reading(sm_active_pct=None, sm_clock_max_mhz=None, clock_reasons=None)) is None


def test_views_show_activity_next_to_utilization_and_the_verdict():
    state = RunState()
    slow = reading(clock_reasons=["power cap"], sm_clock_mhz=1410.0, sm_active_pct=42.0, tensor_active_pct=30.0)
    state.apply(DeviceEvent(time=1.0, devices=[slow]))
    console = Console(width=100, record=True, file=io.StringIO())
    console.print(devices(state, 100, 12, 60.0))
    text = console.export_text()
    assert "97% · SM 42% · tensor 30%" in text
    assert "1410/1980 MHz power cap" in text and "⚠ busy but power-capped" in text
    assert state.gpu_verdicts() == {"gpu0": "busy but power-capped (SM clock 1410 of 1980 MHz)"}

    out = io.StringIO()
    view = HeadlessView(state, json=False, stream=out, err=io.StringIO(), progress=False)
    for t, r in ((2.0, slow), (2.5, slow), (3.0, reading())):
        e = DeviceEvent(time=t, devices=[r])
        state.apply(e)
        view.on_event(e)
    assert out.getvalue().splitlines() == [
        "gpu0: busy but power-capped (SM clock 1410 of 1980 MHz)",
        "gpu0: no longer slowed",
    ]
