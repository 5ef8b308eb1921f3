"""Device telemetry: what the GPU (or, without one, the CPU) is doing while the trainer runs.

`DeviceSampler` samples in its own thread every `interval` seconds, keeps at
least `history_seconds` of samples in a ring buffer, and tells subscribers of
each new sample. A sample is a `device` event (trainer.contract.events.DeviceEvent,
the one definition of its shape). It knows nothing of rendering: the session
forwards samples to the views and to device.jsonl, so the TUI, `--no-ui` and a
replay all see the same numbers.

Values a device cannot give are `None` (rendered "n/a"), never 0, so an
unsupported power sensor is not mistaken for an idle GPU.

Energy: the samples carry the readings (NVML's energy counter and power per
GPU, RAPL's package counter for the CPU); gptop.energy is the one place that
turns them into joules.
"""

from __future__ import annotations

import logging
import os
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal

import psutil

from gptop.energy import Rapl
from gptop.nvml import Nvml, sample_gpu
from trainer.contract.device import DeviceInfo, cpu_has_native_bf16, cpu_name, has_compiler
from trainer.contract.events import CpuReading, DeviceEvent

if TYPE_CHECKING:
    from trainer.contract.config import TrainConfig

log = logging.getLogger(__name__)

HISTORY_SLACK = 16  # extra ring slots beyond history_seconds / interval


# --------------------------------------------------------------------------- CPU side


class _CoreLoad:
    """Per-core utilization from our own cpu_times deltas.

    psutil.cpu_percent(interval=None) keeps one module-global "last call", so
    any other caller in the process would corrupt our numbers; we keep ours.
    """

    def __init__(self) -> None:
        self._last = psutil.cpu_times(percpu=True)
        self.steal_pct: float | None = None  # of the last sample's interval, the whole machine (None: not Linux)

    def sample(self) -> list[float]:
        now = psutil.cpu_times(percpu=True)
        out = []
        stolen = whole = 0.0
        for a, b in zip(self._last, now):
            total = _busy_total(b) - _busy_total(a)
            idle = _idle(b) - _idle(a)
            out.append(0.0 if total <= 0 else min(100.0, max(0.0, 100.0 * (total - idle) / total)))
            stolen += getattr(b, "steal", 0.0) - getattr(a, "steal", 0.0)
            whole += max(0.0, total)
        steal = hasattr(now[0], "steal") if now else False
        self.steal_pct = min(100.0, max(0.0, 100.0 * stolen / whole)) if steal and whole > 0 else None
        self._last = now
        return out


def others_share(per_core: list[float], trainer_pct: float | None, own_pct: float | None) -> float | None:
    """The machine's CPU share (0..100) busy with processes that are neither the trainer's nor gptop's: the
    background load a tuning's measurements must share to be compared (tuner.load)."""
    if not per_core:
        return None
    busy = sum(per_core) / len(per_core)
    return max(0.0, busy - (trainer_pct or 0.0) - (own_pct or 0.0))


def _load_avg() -> float | None:
    try:
        return float(psutil.getloadavg()[0])
    except (OSError, AttributeError):
        return None


def _busy_total(t: Any) -> float:
    # guest time is already counted in user/nice on Linux
    return sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def _idle(t: Any) -> float:
    return t.idle + getattr(t, "iowait", 0.0)


@dataclass
class _ProcStats:
    pids: set[int]
    rss: int | None
    cpu_pct: float | None


# How often the trainer's process tree is walked again (new children: data workers, torchrun ranks). A walk
# reads every process's /proc/PID/stat (psutil's children()), so its cost grows with the machine's process
# count; between walks the known processes are read directly, and a change of the roots (a restarted
# trainer) walks at once.
TREE_REFRESH_S = 5.0


class _ProcTracker:
    """The trainer's processes and their children, with Process objects kept so cpu_percent has a baseline."""

    def __init__(self, tree_refresh_s: float = TREE_REFRESH_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._procs: dict[int, psutil.Process] = {}
        self._ncpu = psutil.cpu_count() or 1
        self._tree_refresh_s = tree_refresh_s
        self._clock = clock
        self._roots: tuple[int, ...] | None = None
        self._tree_at = 0.0
        self._tree: list[int] = []
        self._own: psutil.Process | None = None  # gptop itself: its CPU is the run's, not the machine's others'
        try:
            self._own = psutil.Process()
            self._own.cpu_percent(interval=None)
        except psutil.Error:
            pass
        self.own_pct: float | None = None

    def update(self, roots: Iterable[int]) -> _ProcStats:
        roots = tuple(sorted({int(r) for r in roots}))
        now = self._clock()
        walk = roots != self._roots or now - self._tree_at >= self._tree_refresh_s
        current: dict[int, psutil.Process] = {}
        for pid in roots if walk else self._tree:
            p = self._get(pid)
            if p is None:
                continue
            current[p.pid] = p
            if not walk:
                continue
            try:
                for c in p.children(recursive=True):
                    cached = self._procs.get(c.pid)
                    current.setdefault(c.pid, cached if cached is not None and cached == c else c)
            except psutil.Error:
                pass
        if walk:
            self._roots, self._tree_at, self._tree = roots, now, list(current)
        rss = 0
        cpu = 0.0
        have_rss = have_cpu = False
        alive: dict[int, psutil.Process] = {}
        for pid, p in current.items():
            seen_before = pid in self._procs and self._procs[pid] is p
            try:
                with p.oneshot():
                    rss += p.memory_info().rss
                    pct = p.cpu_percent(interval=None)  # first call per object only sets the baseline
            except psutil.Error:
                continue
            alive[pid] = p
            have_rss = True
            if seen_before:
                cpu += pct
                have_cpu = True
        self._procs = alive
        self.own_pct = self._own_share(set(current))
        return _ProcStats(
            pids=set(current),
            rss=rss if have_rss else None,
            cpu_pct=min(100.0, cpu / self._ncpu) if have_cpu else None,
        )

    def _own_share(self, trainer: set[int]) -> float | None:
        """This process's share of the machine since the last sample (0..100), unless it is the trainer's."""
        if self._own is None or self._own.pid in trainer:
            return 0.0 if self._own is not None else None
        try:
            return min(100.0, self._own.cpu_percent(interval=None) / self._ncpu)
        except psutil.Error:
            return None

    def _get(self, pid: int) -> psutil.Process | None:
        p = self._procs.get(pid)
        if p is not None:
            try:
                if p.is_running():  # also catches pid reuse
                    return p
            except psutil.Error:
                pass
        try:
            return psutil.Process(pid)
        except psutil.Error:
            return None


# --------------------------------------------------------------------------- GPU side


def gpu_identity(nv: Nvml, index: int) -> tuple[str | None, str | None]:
    """(UUID, PCI bus id) of NVML device `index`, None where NVML cannot tell: how gptop matches it to a
    CUDA device (trainer.contract.device.gpu_key)."""
    uuid = nv.device_query(index, "nvmlDeviceGetUUID")
    pci = nv.device_query(index, "nvmlDeviceGetPciInfo")
    bus = getattr(pci, "busId", None)
    if isinstance(bus, bytes):
        bus = bus.decode("ascii", errors="replace")
    return (str(uuid) if uuid else None), (str(bus) if bus else None)


# --------------------------------------------------------------------------- sampler


class DeviceSampler:
    """Samples GPUs (via NVML) or, without an NVIDIA GPU, the CPU, in a background thread.

    Thread-safe reads (`latest`, `history`) and push (`subscribe`) so views and
    the session never block on a driver call. `sample_once` works without the
    thread (tests, one-shot `gptop --no-ui` lines).

    `pids` returns the trainer's process ids (children are followed), used for
    per-process GPU memory, RSS and CPU share. `nvml` is a `pynvml`-shaped
    module or an `Nvml`; `rapl_root` and `clock` exist for tests.
    """

    def __init__(
        self,
        interval: float = 0.5,
        pids: Callable[[], Iterable[int]] = lambda: (),
        history_seconds: float = 600,
        nvml: Any = None,
        rapl_root: str = "/sys/class/powercap",
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0, got {interval!r}")
        self.interval = float(interval)
        self.history_seconds = float(history_seconds)
        self._pids = pids
        self._clock = clock
        self._nvml = nvml if isinstance(nvml, Nvml) else Nvml(nvml)
        self._rapl_root = rapl_root
        self._history: deque[DeviceEvent] = deque(
            maxlen=math.ceil(self.history_seconds / self.interval) + HISTORY_SLACK
        )
        self._lock = threading.Lock()  # guards _history and _subscribers
        self._sample_lock = threading.Lock()  # one sample at a time: the trackers are stateful
        self._subscribers: list[Callable[[DeviceEvent], None]] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = False
        self._gpu_names: dict[int, str] = {}
        self._gpu_ids: dict[int, tuple[str | None, str | None]] = {}  # NVML index -> (UUID, PCI bus id)
        self._cpu_name = ""
        self._cores: _CoreLoad | None = None
        self._procs = _ProcTracker()
        self._rapl: Rapl | None = None
        self._errors_logged = 0

    # -- lifecycle ---------------------------------------------------------

    def _ensure_ready(self) -> None:
        if self._ready:
            return
        self._nvml.open()
        if self._cores is None:
            self._cores = _CoreLoad()
            self._cpu_name = cpu_name()
            self._rapl = Rapl(self._rapl_root)
        self._ready = True

    @property
    def mode(self) -> Literal["gpu", "cpu"]:
        """Which telemetry this machine gives: "gpu" when NVML sees an NVIDIA GPU, else "cpu"."""
        with self._sample_lock:
            self._ensure_ready()
        return "gpu" if self._nvml.available else "cpu"

    @property
    def reason(self) -> str | None:
        """Why there is no GPU telemetry (for a one-line notice), None in GPU mode."""
        return self._nvml.reason

    def start(self) -> None:
        """Start the sampling thread; a no-op when it is running."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gptop-device-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and release NVML. Returns within about one NVML call; idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(2.0, 2 * self.interval))
            if thread.is_alive():  # stuck in a driver call: shutting NVML down under it could crash
                log.warning("device sampler did not stop in time; leaving NVML open")
                return
        with self._sample_lock:
            self._nvml.close()
            self._ready = False

    close = stop

    def __enter__(self) -> "DeviceSampler":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception:  # the thread must outlive a bad sample
                self._errors_logged += 1
                if self._errors_logged <= 3:
                    log.exception("device sample failed")
            next_t += self.interval
            delay = next_t - time.monotonic()
            if delay < 0:  # fell behind (slow driver call): do not burst to catch up
                next_t = time.monotonic()
                delay = 0.0
            if self._stop.wait(delay):
                break

    # -- sampling ----------------------------------------------------------

    def sample_once(self) -> DeviceEvent:
        """Take one sample now, add it to the history and notify subscribers."""
        with self._sample_lock:
            self._ensure_ready()
            now = self._clock()
            procs = self._procs.update(self._trainer_pids())
            gpus = []
            if self._nvml.available:
                xids = self._nvml.xid_errors()
                for i in range(self._nvml.device_count):
                    if i not in self._gpu_names:
                        name = self._nvml.device_query(i, "nvmlDeviceGetName")
                        if name is not None:
                            self._gpu_names[i] = str(name)
                    if i not in self._gpu_ids:
                        self._gpu_ids[i] = gpu_identity(self._nvml, i)
                    gpus.append(
                        sample_gpu(
                            self._nvml, i, self._gpu_names.get(i, f"GPU {i}"), procs.pids, self._gpu_ids[i], xids.get(i)
                        )
                    )
            cpu = self._sample_cpu(now, procs)
            sample = DeviceEvent(time=now, devices=gpus, cpu=cpu, mode="gpu" if gpus else "cpu")
        self._record(sample)
        return sample

    def _trainer_pids(self) -> list[int]:
        try:
            return [int(p) for p in self._pids()]
        except Exception:
            log.debug("pids() failed", exc_info=True)
            return []

    def _sample_cpu(self, now: float, procs: _ProcStats) -> CpuReading:
        assert self._cores is not None and self._rapl is not None
        per_core = self._cores.sample()
        vm = psutil.virtual_memory()
        power, energy = self._rapl.read(now)
        return CpuReading(
            util_pct=sum(per_core) / len(per_core) if per_core else 0.0,
            per_core=[round(x, 1) for x in per_core],  # many cores x 2 Hz: keep the event lines short
            mem_used=int(vm.total - vm.available),
            mem_total=int(vm.total),
            proc_rss=procs.rss,
            proc_cpu_pct=procs.cpu_pct,
            others_cpu_pct=others_share(per_core, procs.cpu_pct, self._procs.own_pct),
            steal_pct=self._cores.steal_pct,
            load_avg=_load_avg(),
            power_w=power,
            energy_j=energy,
            name=self._cpu_name,
            power_note=self._rapl.reason,
        )

    def _record(self, sample: DeviceEvent) -> None:
        with self._lock:
            self._history.append(sample)
            subscribers = list(self._subscribers)
        for callback in subscribers:
            try:
                callback(sample)
            except Exception:
                log.exception("device sample subscriber failed")

    # -- reading -----------------------------------------------------------

    def latest(self) -> DeviceEvent | None:
        """The newest sample, or None before the first."""
        with self._lock:
            return self._history[-1] if self._history else None

    def history(self, seconds: float | None = None) -> list[DeviceEvent]:
        """Samples, oldest first; with `seconds`, only those newer than now - seconds."""
        with self._lock:
            samples = list(self._history)
        if seconds is None:
            return samples
        cutoff = self._clock() - seconds
        return [s for s in samples if s.time >= cutoff]

    def subscribe(self, callback: Callable[[DeviceEvent], None]) -> Callable[[], None]:
        """Call `callback(sample)` after each sample (from the sampler thread; keep it short).

        Returns a function that unsubscribes.
        """
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe


# --------------------------------------------------------------------------- the training device, without torch


def training_device(requested: str = "auto", nvml: Nvml | None = None) -> DeviceInfo:
    """The device a trainer given `--device requested` will use, as far as NVML and the OS tell without torch
    (trainer.device_probe.detect asks torch): enough to name a `--size auto` run directory by the size that
    trainer.contract.capabilities.auto_size picks. CUDA_VISIBLE_DEVICES is honoured whether it lists indices
    or UUIDs (GPU-..., and MIG-... for a MIG instance, sized by its own memory); its indices are taken as
    NVML's, which CUDA's match when CUDA_DEVICE_ORDER=PCI_BUS_ID or the GPUs are alike (the trainer's hello
    then names its GPU by UUID: trainer.contract.device.gpu_key)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    native = cpu_has_native_bf16()
    cpu = DeviceInfo(
        type="cpu",
        name=cpu_name(),
        total_memory=psutil.virtual_memory().total,
        cpu_count=cpus,
        cpu_bf16=native,
        cpu_bf16_native=native,
    )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if requested == "cpu" or (visible is not None and visible.strip() in ("", "-1")):
        return cpu
    index = int(requested.split(":", 1)[1]) if requested.startswith("cuda:") and requested[5:].isdigit() else 0
    entry: str = str(index)
    if visible:
        ids = [x.strip() for x in visible.split(",")]
        if index >= len(ids):
            return cpu
        entry = ids[index]
    nv = nvml or Nvml()
    try:
        if not nv.open():
            return cpu
        nvml_index: int | None
        if entry.isdigit():
            nvml_index = int(entry)
            if nvml_index >= nv.device_count:
                return cpu
            handle = nv.handle(nvml_index)
        else:  # a UUID: NVML finds GPUs and MIG instances by it
            handle = nv.query("nvmlDeviceGetHandleByUUID", entry)
            nvml_index = nv.query("nvmlDeviceGetIndex", handle) if handle is not None else None
        if handle is None:
            return cpu
        total = getattr(nv.query("nvmlDeviceGetMemoryInfo", handle), "total", None)
        if total is None:
            return cpu
        name = nv.query("nvmlDeviceGetName", handle)
        uuid = nv.query("nvmlDeviceGetUUID", handle)
        cc = nv.query("nvmlDeviceGetCudaComputeCapability", handle)
        return DeviceInfo(
            type="cuda",
            index=nvml_index if nvml_index is not None else index,
            name=str(name or ""),
            capability=(int(cc[0]), int(cc[1])) if isinstance(cc, tuple) and len(cc) == 2 else None,
            total_memory=int(total),
            cpu_count=cpus,
            uuid=str(uuid) if uuid else None,
        )
    finally:
        if nvml is None:
            nv.close()


def certain_cpu(requested: str = "auto") -> DeviceInfo | None:
    """The CPU as a trainer given `--device requested` will describe it, when it will certainly train there
    (`cpu`, CUDA hidden, or `auto` on a machine without an NVIDIA driver); None when a GPU may be used. What
    the CPU cannot run (`--quantize-base`, fp16, CUDA-graph compile modes) is then refused before anything starts."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = visible is not None and visible.strip() in ("", "-1")
    if not (requested == "cpu" or hidden or (requested == "auto" and not os.path.exists(NVIDIA_DRIVER))):
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return DeviceInfo(
        type="cpu",
        name=cpu_name(),
        total_memory=psutil.virtual_memory().total,
        cpu_count=cpus,
        has_compiler=has_compiler(),
    )


NVIDIA_DRIVER = "/proc/driver/nvidia/version"  # present wherever the NVIDIA kernel driver is loaded


def resolved_size(cfg: "TrainConfig") -> str | None:
    """What `--size auto` will resolve to on the device the trainer will use (None: a size was given, or the
    model is a path), so the run directory is named by it (trainer.contract.capabilities.auto_size)."""
    from trainer.contract.capabilities import auto_size
    from trainer.contract.common import FAMILIES
    from trainer.contract.estimate import run_options

    if cfg.model.size != "auto" or cfg.model.model not in FAMILIES:
        return None
    return auto_size(cfg.model.model, training_device(cfg.run.device), **run_options(cfg))
