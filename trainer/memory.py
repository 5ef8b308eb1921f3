"""Memory figures per device, behind one small interface.

CUDA: the caching allocator's peak allocated/reserved bytes. CPU: the process's
resident set; its peak (VmHWM) can be reset on Linux through
`/proc/self/clear_refs`, which gives a real per-probe peak for `--micro-batch auto`.
"""

from __future__ import annotations

import os
from typing import Any, MutableMapping, Protocol

import psutil
import torch


class MemoryMeter(Protocol):
    def reset_peak(self) -> None: ...
    def peak(self) -> int: ...
    def current(self) -> int: ...
    def capacity(self) -> int: ...
    def figures(self) -> dict[str, int | None]: ...


class CudaMemory:
    """`cuda` is torch.cuda, or a fake of its memory functions (tests)."""

    def __init__(self, device: torch.device, cuda: Any = None):
        self.device = device
        self.cuda = cuda if cuda is not None else torch.cuda

    def reset_peak(self) -> None:
        self.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return self.cuda.max_memory_allocated(self.device)

    def current(self) -> int:
        return self.cuda.memory_allocated(self.device)

    def capacity(self) -> int:
        """What this process may grow its allocations into: the device's free memory (the CUDA context, other
        processes and other libraries already taken out) plus what its caching allocator holds (counted in
        `peak`, so it must be counted here too). The device's total would plan with memory that is not there."""
        free, _ = self.cuda.mem_get_info(self.device)
        return int(free) + int(self.cuda.memory_reserved(self.device))

    def figures(self) -> dict[str, int | None]:
        _, total = self.cuda.mem_get_info(self.device)
        return {
            "allocated_peak": self.peak(),
            "reserved_peak": self.cuda.max_memory_reserved(self.device),
            "total": int(total),
            "capacity": self.capacity(),
        }


class CpuMemory:
    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._can_reset = os.access("/proc/self/clear_refs", os.W_OK)

    def reset_peak(self) -> None:
        if self._can_reset:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                self._can_reset = False

    def peak(self) -> int:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return self.current()

    def current(self) -> int:
        return self._proc.memory_info().rss

    def capacity(self) -> int:
        """What this process may still grow into: its RSS plus the memory the system has available."""
        return self.current() + psutil.virtual_memory().available

    def figures(self) -> dict[str, int | None]:
        return {"rss": self.current(), "rss_peak": self.peak(), "total": psutil.virtual_memory().total}


# The allocator's configuration variables, in the order torch reads them (PYTORCH_ALLOC_CONF since torch
# 2.9; the CUDA-specific name before it, and still honoured after).
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def enable_expandable_segments(environ: MutableMapping[str, str]) -> str | None:
    """Turn on the CUDA caching allocator's expandable segments in `environ` (before CUDA initializes), keeping
    every other option the user set; returns a warning when the user's own setting was changed.

    The allocator reads one comma-separated `option:value` string; setting the variable only when it is
    unset (as gptop once did) silently ignored `--cuda-allocator expandable_segments` for anyone who had
    set e.g. max_split_size_mb."""
    var = next((v for v in ALLOC_CONF_VARS if environ.get(v, "").strip()), "PYTORCH_CUDA_ALLOC_CONF")
    conf = environ.get(var, "").strip()
    items = [i.strip() for i in conf.split(",") if i.strip()]
    keys = [i.split(":", 1)[0].strip() for i in items]
    if "expandable_segments" in keys:
        old = items[keys.index("expandable_segments")]
        if old.split(":", 1)[-1].strip().lower() == "true":
            return None
        items[keys.index("expandable_segments")] = "expandable_segments:True"
        environ[var] = ",".join(items)
        return f"--cuda-allocator expandable_segments overrides {old} in {var} (now {environ[var]!r})"
    items.append("expandable_segments:True")
    environ[var] = ",".join(items)
    if conf:
        return f"--cuda-allocator expandable_segments: added to {var}, which now reads {environ[var]!r}"
    return None


def make_meter(device: torch.device) -> MemoryMeter:
    return CudaMemory(device) if device.type == "cuda" else CpuMemory()


def check_expandable_segments(
    dev: Any, quick: bool, *, cuda: Any = None, environ: MutableMapping[str, str] | None = None
) -> Any:
    """gptop doctor's `expandable_segments` path: in a fresh process, `--cuda-allocator expandable_segments`
    (enable_expandable_segments, as trainer.runner.main_run calls it, here over a PYTORCH_CUDA_ALLOC_CONF the
    user set) must leave the allocator's segments expandable."""
    import os

    from .contract.capabilities import support
    from .contract.doctor import Outcome

    reason = support("cuda_allocator", "expandable_segments", dev)
    if reason:
        return Outcome.skip(reason)
    real = cuda is None
    cuda = torch.cuda if real else cuda  # tests: a fake of the calls below
    env = os.environ if environ is None else environ
    if cuda.is_initialized():
        return Outcome.verdict(False, "CUDA was initialized before the setting", "the check needs a fresh process")
    env.pop("PYTORCH_ALLOC_CONF", None)
    env["PYTORCH_CUDA_ALLOC_CONF"] = "garbage_collection_threshold:0.9"  # a user's own setting
    note = enable_expandable_segments(env)
    device = dev.torch_device
    cuda.set_device(device)
    x = torch.empty(64 << 20, dtype=torch.uint8, device=device) if real else None
    segments = [s for s in cuda.memory_snapshot() if s.get("device", device.index) == device.index]
    expandable = [s for s in segments if s.get("is_expandable")]
    del x
    ok = bool(expandable) and len(expandable) == len(segments)
    observed = (
        f"{len(expandable)} of {len(segments)} segments expandable with "
        f"PYTORCH_CUDA_ALLOC_CONF={env['PYTORCH_CUDA_ALLOC_CONF']!r}"
    )
    return Outcome.verdict(ok, observed, "the allocator did not take the setting", merged_warning=note)
