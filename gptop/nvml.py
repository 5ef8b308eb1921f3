"""The one place gptop talks to NVML (through nvidia-ml-py's `pynvml`).

Why one place: NVML answers many questions with an error rather than a value
(NotSupported on consumer boards, NoPermission in containers, GPUIsLost after
an Xid, FunctionNotFound when the driver is older than the bindings). Every
call goes through `Nvml._query`, which turns those errors into `None` ("n/a"
in views), so no caller needs its own try/except and a missing metric never
takes the dashboard down. The model is nvitop's `libnvml.nvmlQuery`.

Two things nvitop's helper does not do and a 2 Hz sampler needs:
- a query that failed with NotSupported/NoPermission for a device is
  remembered and answered with `None` from then on, instead of paying for the
  failing driver call every half second;
- a function the driver lacks (FunctionNotFound) is remembered for all devices.

Beyond "utilization" (the share of time any kernel ran, which a single
tiny kernel keeps at 100%), the wrapper samples what says how hard the GPU
works: GPM metrics on Hopper and later (`gpm`: SM activity and tensor-pipe
activity over the interval between two samples, as DCGM reports them), and
everywhere the clock-event ("throttle") reasons (`throttle_reasons`) next to
the SM clock and its maximum. These paths are written against nvidia-ml-py's
documentation and tested with a fake module only (no GPU here).

No NVML at all (the `pynvml` import fails, libnvidia-ml.so is missing, the
driver is not loaded, or there are zero GPUs) is not an error: `available` is
False and `reason` says why, and the sampler falls back to CPU mode.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Iterable

from trainer.contract.events import GpuReading, finite_or_none

from .load import other_processes

log = logging.getLogger(__name__)

NA = None
"""The value of a metric NVML could not give us. Views render it as "n/a"."""

# Clock-event (throttle) reason bits, from nvml.h (nvmlClocksEventReason*): stable across drivers.
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x1, "idle"),
    (0x2, "application clocks"),
    (0x4, "power cap"),
    (0x8, "hw slowdown"),
    (0x10, "sync boost"),
    (0x20, "sw thermal"),
    (0x40, "hw thermal"),
    (0x80, "power brake"),
    (0x100, "display clocks"),
)

# GPM metric ids (nvmlGpmMetricId_t) gptop samples, by the name it gives them.
GPM_METRICS: dict[str, int] = {"sm_active": 2, "tensor_active": 5}


def throttle_reasons(mask: Any) -> list[str] | None:
    """The names of the reasons set in a clock-event bitmask; None when NVML gave no mask."""
    if mask is None or isinstance(mask, bool):
        return None
    try:
        m = int(mask)
    except (TypeError, ValueError):
        return None
    return [name for bit, name in THROTTLE_REASONS if m & bit]


# Error codes from nvml.h; stable across driver versions. Read from the module
# when it has them, so a fake module with its own numbering also works.
_CODES = {
    "UNINITIALIZED": 1,
    "NOT_SUPPORTED": 3,
    "NO_PERMISSION": 4,
    "DRIVER_NOT_LOADED": 9,
    "LIBRARY_NOT_FOUND": 12,
    "FUNCTION_NOT_FOUND": 13,
    "GPU_IS_LOST": 15,
}


def na(value: Any, spec: str = "", suffix: str = "") -> str:
    """Render a telemetry value, `None` as "n/a": one spelling of "unknown" in every view."""
    if value is None:
        return "n/a"
    return f"{value:{spec}}{suffix}"


def _query_key(device: int, function: str, extra: tuple) -> tuple[int, str, tuple]:
    """The key under which a permanent failure of a device query is remembered. pynvml's handles, event sets
    and samples are ctypes pointers, which are unhashable: such an argument counts by its type."""
    parts = []
    for arg in extra:
        try:
            hash(arg)
        except TypeError:
            arg = type(arg).__name__
        parts.append(arg)
    return device, function, tuple(parts)


class Nvml:
    """One NVML session: `nvmlInit` once on `open`, `nvmlShutdown` on `close`, queries that never raise NVMLError.

    `module` is the `pynvml` module, or anything shaped like it (tests pass a
    fake); `None` imports the real one when opened.
    """

    def __init__(self, module: Any = None) -> None:
        self._module_arg = module
        self._mod: Any = None
        self._lock = threading.RLock()
        self._opened = False
        self._initialized = False
        self.available = False
        self.reason: str | None = None
        self.device_count = 0
        self._handles: dict[int, Any] = {}
        self._unsupported: set[tuple[int, str, tuple]] = set()  # (device, function, extra args)
        self._missing_functions: set[str] = set()
        self._lost: set[int] = set()
        self._gpm_prev: dict[int, Any] = {}  # device -> its previous GPM sample (freed on close)
        self._gpm_ok: dict[int, bool] = {}  # device -> GPM supported
        self._event_set: Any = None  # Xid events (nvmlEventSetCreate), registered per device
        self._xid_registered: set[int] = set()

    # -- lifecycle ---------------------------------------------------------

    def open(self) -> bool:
        """Initialize NVML once; True when at least one GPU can be queried."""
        with self._lock:
            if self._opened:
                return self.available
            self._opened = True
            mod = self._module_arg
            if mod is None:
                try:
                    import pynvml as mod  # type: ignore[no-redef]
                except Exception as e:  # ImportError, or a broken install raising anything
                    self.reason = f"no NVIDIA GPU (nvidia-ml-py not importable: {e})"
                    return False
            self._mod = mod
            try:
                mod.nvmlInit()
            except Exception as e:
                code = getattr(e, "value", None)
                if code in (self._code("LIBRARY_NOT_FOUND"), self._code("DRIVER_NOT_LOADED")) or isinstance(e, OSError):
                    self.reason = f"no NVIDIA GPU ({e})"
                    log.debug("NVML unavailable: %s", e)
                else:  # e.g. LibRmVersionMismatch after a driver upgrade: worth telling the user
                    self.reason = f"NVML failed to initialize ({type(e).__name__}: {e})"
                    log.warning("%s; showing CPU telemetry only", self.reason)
                return False
            self._initialized = True
            count = self.query("nvmlDeviceGetCount")
            if not count:
                self.reason = "no NVIDIA GPU (NVML reports no devices)"
                self._shutdown()
                return False
            self.device_count = int(count)
            self.available = True
            self.reason = None
            return True

    def close(self) -> None:
        """nvmlShutdown if we initialized; idempotent. A later `open` starts a new session."""
        with self._lock:
            self._shutdown()
            self._opened = False
            self.available = False

    def _shutdown(self) -> None:
        if self._initialized:
            if self._event_set is not None:
                self.query("nvmlEventSetFree", self._event_set)
            self._event_set = None
            self._xid_registered.clear()
            for sample in self._gpm_prev.values():
                self.query("nvmlGpmSampleFree", sample)
            self._gpm_prev.clear()
            self._gpm_ok.clear()
            self._initialized = False
            self._handles.clear()
            try:
                self._mod.nvmlShutdown()
            except Exception as e:  # shutting down must not fail the caller
                log.debug("nvmlShutdown: %s", e)

    def __enter__(self) -> "Nvml":
        self.open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- queries -----------------------------------------------------------

    def query(self, function: str, *args: Any) -> Any:
        """`pynvml.<function>(*args)` for calls not tied to a device; None on any NVML error."""
        return self._query(function, args, device=None, extra=())

    def device_query(self, index: int, function: str, *args: Any) -> Any:
        """`pynvml.<function>(handle(index), *args)`; None on any NVML error, remembered when permanent."""
        handle = self.handle(index)
        if handle is None:
            return NA
        return self._query(function, (handle, *args), device=index, extra=args)

    def device_query_first(self, index: int, calls: Iterable[tuple[str, tuple]]) -> Any:
        """The first non-None answer among alternative calls (new API first, deprecated fallback after)."""
        for function, args in calls:
            value = self.device_query(index, function, *args)
            if value is not None:
                return value
        return NA

    def handle(self, index: int) -> Any:
        """The cached device handle, or None when the device cannot be reached."""
        h = self._handles.get(index)
        if h is None:
            h = self._query("nvmlDeviceGetHandleByIndex", (index,), device=index, extra=())
            if h is not None:
                self._handles[index] = h
        return h

    def clock_reasons(self, index: int) -> list[str] | None:
        """Why the clocks are below their maximum now (THROTTLE_REASONS names), [] when nothing holds
        them; None when NVML cannot tell."""
        mask = self.device_query_first(
            index, [("nvmlDeviceGetCurrentClocksEventReasons", ()), ("nvmlDeviceGetCurrentClocksThrottleReasons", ())]
        )
        return throttle_reasons(mask)

    def ecc_uncorrected(self, index: int) -> int | None:
        """Uncorrected ECC memory errors since the driver loaded (volatile count); None without ECC."""
        value = self.device_query(
            index,
            "nvmlDeviceGetTotalEccErrors",
            self.constant("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
            self.constant("NVML_VOLATILE_ECC", 0),
        )
        return None if value is None else int(value)

    def is_lost(self, index: int) -> bool:
        """NVML answered GPUIsLost for this device (it fell off the bus): nothing more is asked of it."""
        return index in self._lost

    MAX_XIDS_PER_CALL = 64

    def xid_errors(self) -> dict[int, list[int]]:
        """Critical Xid errors reported since the previous call: NVML index -> the Xid codes. Registers every
        device for them on the first call (where the driver allows: not in every container); never waits."""
        with self._lock:
            if not self._initialized:
                return {}
            if self._event_set is None:
                self._event_set = self.query("nvmlEventSetCreate")
                if self._event_set is None:
                    return {}
            kind = self.constant("nvmlEventTypeXidCriticalError", 0x8)
            for i in range(self.device_count):
                if i not in self._xid_registered:
                    self._xid_registered.add(i)  # asked once: NotSupported is remembered by device_query anyway
                    self.device_query(i, "nvmlDeviceRegisterEvents", kind, self._event_set)
            out: dict[int, list[int]] = {}
            for _ in range(self.MAX_XIDS_PER_CALL):
                data = self.query("nvmlEventSetWait_v2", self._event_set, 0)  # Timeout (none waiting): None
                if data is None:
                    break
                if not int(getattr(data, "eventType", 0) or 0) & kind:
                    continue
                index = self.query("nvmlDeviceGetIndex", getattr(data, "device", None))
                if index is None:
                    continue
                out.setdefault(int(index), []).append(int(getattr(data, "eventData", 0) or 0))
            return out

    def gpm(self, index: int) -> dict[str, float | None] | None:
        """GPM metrics (GPM_METRICS, percent) over the interval since this device's previous call;
        None where GPM is unsupported (before Hopper, or in a VM/container that hides it) and on the
        first call (one sample is no interval). Each call takes one GPM sample and keeps it."""
        with self._lock:
            supported = self._gpm_ok.get(index)
            if supported is None:
                handle = self.handle(index)
                support = (
                    self._query("nvmlGpmQueryDeviceSupport", (handle,), device=index, extra=())
                    if handle is not None
                    else None
                )
                supported = (
                    bool(getattr(support, "isSupportedDevice", 0))
                    and getattr(self._mod, "c_nvmlGpmMetricsGet_t", None) is not None
                )
                self._gpm_ok[index] = supported
            if not supported:
                return None
            handle = self.handle(index)
            sample = self.query("nvmlGpmSampleAlloc")
            if handle is None or sample is None:
                return None
            if self._query("nvmlGpmSampleGet", (handle, sample), device=index, extra=()) is None:
                self.query("nvmlGpmSampleFree", sample)
                if self.is_unsupported(index, "nvmlGpmSampleGet"):
                    self._gpm_ok[index] = False  # NotSupported / NoPermission: not asked again
                return None
            prev, self._gpm_prev[index] = self._gpm_prev.get(index), sample
            if prev is None:
                return None
            try:
                return self._gpm_metrics(prev, sample)
            finally:
                self.query("nvmlGpmSampleFree", prev)

    def _gpm_metrics(self, first: Any, second: Any) -> dict[str, float | None] | None:
        mod = self._mod
        request = mod.c_nvmlGpmMetricsGet_t()
        request.version = getattr(mod, "NVML_GPM_METRICS_GET_VERSION", 1)
        request.numMetrics = len(GPM_METRICS)
        request.sample1, request.sample2 = first, second
        for i, metric in enumerate(GPM_METRICS.values()):
            request.metrics[i].metricId = metric
        got = self.query("nvmlGpmMetricsGet", request)
        if got is None:
            return None
        out: dict[str, float | None] = {}
        for i, name in enumerate(GPM_METRICS):
            m = got.metrics[i]
            value = float(m.value) if getattr(m, "nvmlReturn", 1) == 0 else None
            out[name] = value if value is not None and 0.0 <= value <= 100.0 else None
        return out

    def constant(self, name: str, default: int) -> int:
        """An NVML_* constant from the module (a fake module may omit it)."""
        return getattr(self._mod, name, default)

    def is_unsupported(self, index: int, function: str, *args: Any) -> bool:
        """Whether this query was remembered as permanently unavailable for the device."""
        return _query_key(index, function, args) in self._unsupported or function in self._missing_functions

    def _code(self, name: str) -> int:
        return getattr(self._mod, "NVML_ERROR_" + name, _CODES[name]) if self._mod is not None else _CODES[name]

    def _query(self, function: str, args: tuple, device: int | None, extra: tuple) -> Any:
        """Every NVML call gptop makes passes here: NVML errors become None, permanent ones are remembered."""
        with self._lock:
            if not self._initialized or function in self._missing_functions:
                return NA
            key = None
            if device is not None:
                if device in self._lost:
                    return NA
                key = _query_key(device, function, extra)
                if key in self._unsupported:
                    return NA
            fn = getattr(self._mod, function, None)
            if fn is None:  # bindings older than the function we ask for
                self._missing_functions.add(function)
                return NA
            error_types = self._error_types()
            try:
                value = fn(*args)
            except error_types as e:
                self._remember(e, function, key, device)
                return NA
            except UnicodeDecodeError:  # garbage strings from a broken driver: treat as Unknown
                return NA
            if isinstance(value, bytes):
                value = value.decode("utf-8", errors="replace")
            return value

    def _error_types(self) -> tuple[type[BaseException], ...]:
        types: list[type[BaseException]] = []
        for name in ("NVMLError", "NVMLLibraryMismatchError"):
            t = getattr(self._mod, name, None)
            if isinstance(t, type) and issubclass(t, BaseException):
                types.append(t)
        return tuple(types) or (Exception,)

    def _remember(self, error: BaseException, function: str, key: tuple | None, device: int | None) -> None:
        code = getattr(error, "value", None)
        mismatch = getattr(self._mod, "NVMLLibraryMismatchError", None)
        if code == self._code("FUNCTION_NOT_FOUND") or (isinstance(mismatch, type) and isinstance(error, mismatch)):
            if function not in self._missing_functions:
                log.debug("NVML function %s not found in this driver", function)
            self._missing_functions.add(function)
        elif code in (self._code("NOT_SUPPORTED"), self._code("NO_PERMISSION")) and key is not None:
            log.debug("NVML %s on GPU %s: %s (not asked again)", function, device, error)
            self._unsupported.add(key)
        elif code == self._code("GPU_IS_LOST") and device is not None:
            if device not in self._lost:
                log.warning("GPU %d is lost (NVML GPUIsLost); its telemetry is n/a from now on", device)
            self._lost.add(device)
        elif code == self._code("UNINITIALIZED"):
            self._initialized = False
        # Unknown, Timeout, ...: transient, asked again next sample.


# --- gptop doctor: NVML's paths, exercised against the GPU under a workload ------------------------------


def index_of(nv: Nvml, keys: Iterable[str | None]) -> int | None:
    """The NVML index of the GPU with one of these identities (trainer.contract.device.gpu_key: its UUID or
    its PCI address, as DeviceInfo.keys gives them)."""
    from trainer.contract.device import gpu_key

    wanted = {k for k in keys if k}
    for i in range(nv.device_count if wanted else 0):
        uuid = nv.device_query(i, "nvmlDeviceGetUUID")
        pci = nv.device_query(i, "nvmlDeviceGetPciInfo")
        bus = getattr(pci, "busId", None)
        bus = bus.decode("ascii", "replace") if isinstance(bus, bytes) else bus
        if wanted & {gpu_key(uuid), gpu_key(None, bus)}:
            return i
    return None


def sample_gpu(
    nv: Nvml,
    index: int,
    name: str,
    pids: set[int],
    identity: tuple[str | None, str | None] = (None, None),
    xids: list[int] | None = None,
) -> GpuReading:
    """One GPU's reading, as the sampler (and gptop doctor's NVML check) takes it; `xids`: the critical Xid errors
    the driver reported for it since the previous sample (Nvml.xid_errors, read once for every GPU)."""
    q = nv.device_query
    util = q(index, "nvmlDeviceGetUtilizationRates")
    mem = q(index, "nvmlDeviceGetMemoryInfo")
    power_mw = q(index, "nvmlDeviceGetPowerUsage")
    limit_mw = nv.device_query_first(
        index, [("nvmlDeviceGetEnforcedPowerLimit", ()), ("nvmlDeviceGetPowerManagementLimit", ())]
    )
    energy_mj = q(index, "nvmlDeviceGetTotalEnergyConsumption")
    sensor = nv.constant("NVML_TEMPERATURE_GPU", 0)
    temp = nv.device_query_first(
        index, [("nvmlDeviceGetTemperatureV", (sensor,)), ("nvmlDeviceGetTemperature", (sensor,))]
    )
    sm = q(index, "nvmlDeviceGetClockInfo", nv.constant("NVML_CLOCK_SM", 1))
    sm_max = q(index, "nvmlDeviceGetMaxClockInfo", nv.constant("NVML_CLOCK_SM", 1))
    gpm = nv.gpm(index) or {}
    proc_mem = None
    procs = nv.device_query_first(
        index, [("nvmlDeviceGetComputeRunningProcesses", ()), ("nvmlDeviceGetComputeRunningProcesses_v2", ())]
    )
    if pids:
        # NVML reports host PIDs: inside a PID namespace (container) ours may not match; then n/a, not 0.
        used = [getattr(p, "usedGpuMemory", None) for p in procs or () if getattr(p, "pid", None) in pids]
        known = [u for u in used if u is not None]
        proc_mem = sum(known) if known else None
    others = other_processes(procs, pids)
    return GpuReading(
        index=index,
        name=name,
        util_pct=finite_or_none(getattr(util, "gpu", None)),
        mem_used=_int(getattr(mem, "used", None)),
        mem_total=_int(getattr(mem, "total", None)),
        power_w=finite_or_none(power_mw, 1e-3),
        power_limit_w=finite_or_none(limit_mw, 1e-3),
        energy_j=finite_or_none(energy_mj, 1e-3),
        temp_c=finite_or_none(temp),
        sm_clock_mhz=finite_or_none(sm),
        proc_mem=proc_mem,
        other_procs=others,
        sm_clock_max_mhz=finite_or_none(sm_max),
        clock_reasons=nv.clock_reasons(index),
        sm_active_pct=finite_or_none(gpm.get("sm_active")),
        tensor_active_pct=finite_or_none(gpm.get("tensor_active")),
        power_note=None if power_mw is not None else "the driver reports no power for this GPU",
        uuid=identity[0],
        pci_bus_id=identity[1],
        ecc_uncorrected=nv.ecc_uncorrected(index),
        xids=xids or None,
        lost=True if nv.is_lost(index) else None,
    )


def _int(v: Any) -> int | None:
    return None if v is None else int(v)


def check(nv: Nvml, index: int, sleep: Any = None) -> Any:
    """gptop doctor's `nvml` path (the GPU is kept busy meanwhile): what the sampler reads for the run's GPU
    (gptop.telemetry's reading: utilization, memory, power, SM clock and its maximum, clock-event reasons;
    GPM SM and tensor activity where the GPU has GPM) reads, and utilization is above 0 under the workload."""
    import time

    from trainer.contract.doctor import Outcome

    sleep = sleep or time.sleep
    nv.gpm(index)  # GPM's first sample: an interval needs two
    readings = []
    for _ in range(4):
        sleep(0.5)
        readings.append(sample_gpu(nv, index, "GPU", set()))
    last = readings[-1]
    utils = [r.util_pct for r in readings if r.util_pct is not None]
    util = max(utils) if utils else None
    fields = {
        "utilization": util,
        "memory": last.mem_used,
        "power": last.power_w,
        "sm clock": last.sm_clock_mhz,
        "max sm clock": last.sm_clock_max_mhz,
        "clock reasons": last.clock_reasons,
    }
    missing = [k for k, v in fields.items() if v is None]
    gpm_supported = bool(getattr(nv.device_query(index, "nvmlGpmQueryDeviceSupport"), "isSupportedDevice", 0))
    gpm = [r for r in readings if r.sm_active_pct is not None]
    problems = list(missing and [f"{', '.join(missing)} did not read"])
    if util is not None and util <= 0:
        problems.append("utilization stayed 0 under a workload")
    if gpm_supported and not gpm:
        problems.append("GPM metrics did not read although NVML says the GPU supports them")
    observed = (
        f"util {_num(util, '%')}, mem {_gib(last.mem_used)}, power "
        f"{_num(last.power_w, 'W')}, SM clock {_num(last.sm_clock_mhz, 'MHz')} of "
        f"{_num(last.sm_clock_max_mhz, 'MHz')}, reasons {last.clock_reasons}, GPM "
        + (
            f"SM {_num(gpm[-1].sm_active_pct, '%')} tensor {_num(gpm[-1].tensor_active_pct, '%')}"
            if gpm
            else "n/a ("
            + (
                "not supported here"
                + (": NVML hides it on this Hopper-or-later GPU" if _capability(nv, index) >= (9, 0) else "")
                + ")"
                if not gpm_supported
                else "no reading)"
            )
        )
    )
    return Outcome.verdict(
        not problems,
        observed,
        "; ".join(problems),
        utilization_pct=util,
        gpm=bool(gpm),
        gpm_supported=gpm_supported,
        driver=nv.query("nvmlSystemGetDriverVersion"),
    )


def check_energy(nv: Nvml, index: int, sleep: Any = None, clock: Any = None) -> Any:
    """gptop doctor's `energy` path (the GPU is kept busy meanwhile): NVML's total-energy counter moves
    across the workload, and its average power agrees with the sampled power readings within a factor 2."""
    import time

    from trainer.contract.doctor import Outcome

    sleep, clock = sleep or time.sleep, clock or time.monotonic
    e0, t0 = nv.device_query(index, "nvmlDeviceGetTotalEnergyConsumption"), clock()
    powers = []
    for _ in range(6):
        sleep(0.5)
        p = nv.device_query(index, "nvmlDeviceGetPowerUsage")
        if p is not None:
            powers.append(p / 1000.0)
    e1, t1 = nv.device_query(index, "nvmlDeviceGetTotalEnergyConsumption"), clock()
    if e0 is None or e1 is None:
        return Outcome.verdict(
            False, "the energy counter does not read", "NVML gives no total-energy counter for this GPU"
        )
    joules = (e1 - e0) / 1000.0
    counter_w = joules / (t1 - t0) if t1 > t0 else 0.0
    sampled_w = sum(powers) / len(powers) if powers else None
    agrees = sampled_w is None or (sampled_w / 2 <= counter_w <= sampled_w * 2)
    ok = joules > 0 and agrees
    observed = (
        f"{joules:.1f} J over {t1 - t0:.1f} s ({counter_w:.0f} W from the counter; sampled power "
        f"{_num(sampled_w, 'W')})"
    )
    return Outcome.verdict(
        ok,
        observed,
        "the energy counter did not move with the workload, or disagrees with the power readings",
        joules=joules,
        counter_w=counter_w,
        sampled_w=sampled_w,
    )


def _capability(nv: Nvml, index: int) -> tuple[int, int]:
    cc = nv.device_query(index, "nvmlDeviceGetCudaComputeCapability")
    return (int(cc[0]), int(cc[1])) if isinstance(cc, tuple) and len(cc) == 2 else (0, 0)


def _gib(b: Any) -> str:
    return "n/a" if b is None else f"{b / 2**30:.1f} GiB"


def _num(v: Any, unit: str) -> str:
    return "n/a" if v is None else f"{v:.0f} {unit}".replace(" %", "%")
