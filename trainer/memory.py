"""Memory figures per device, behind one small interface.

CUDA: the caching allocator's peak allocated/reserved bytes. CPU: the process's
resident set; its peak (VmHWM) can be reset on Linux through
`/proc/self/clear_refs`, which gives a real per-probe peak for `--micro-batch auto`.

Both peaks are the process's: resetting them changes what anything else in the process reads
(torch.cuda.max_memory_allocated, VmHWM). gptop's own trainer resets them per log interval and per probe; a
client in a user's program (gptop.integrations) must not (`reset_process_peak=False`), and reports the peak
the program's own reading gives: since it started, or since it reset it.
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
    """`cuda` is torch.cuda, or a fake of its memory functions (tests); `reset_process_peak`: whether
    `reset_peak` may reset the allocator's peak statistics (the module doc says when not)."""

    def __init__(self, device: torch.device, cuda: Any = None, reset_process_peak: bool = True):
        self.device = device
        self.cuda = cuda if cuda is not None else torch.cuda
        self.resets = reset_process_peak

    def reset_peak(self) -> None:
        if self.resets:
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
    def __init__(self, reset_process_peak: bool = True) -> None:
        self._proc = psutil.Process()
        self._can_reset = reset_process_peak and os.access("/proc/self/clear_refs", os.W_OK)

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


def make_meter(device: torch.device, reset_process_peak: bool = True) -> MemoryMeter:
    """The device's meter; `reset_process_peak=False`: one that never resets the process's peak (a client's)."""
    if device.type == "cuda":
        return CudaMemory(device, reset_process_peak=reset_process_peak)
    return CpuMemory(reset_process_peak)


def expandable_segments_probe(device: str, cuda: Any = None, environ: MutableMapping[str, str] | None = None) -> dict:
    """Set `--cuda-allocator expandable_segments` over a user's own allocator setting, as
    trainer.runner.main_run does, allocate on `device` and report what the allocator made: {"initialized":
    CUDA was initialized before the setting, "conf", "note" (the merge warning), "segments", "expandable"}.
    `cuda` and `environ`: torch.cuda and os.environ, or fakes (tests)."""
    real = cuda is None
    cuda = torch.cuda if real else cuda
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {"initialized": bool(cuda.is_initialized())}
    env.pop("PYTORCH_ALLOC_CONF", None)
    env["PYTORCH_CUDA_ALLOC_CONF"] = "garbage_collection_threshold:0.9"  # a user's own setting
    out["note"] = enable_expandable_segments(env)
    out["conf"] = env["PYTORCH_CUDA_ALLOC_CONF"]
    dev = torch.device(device)
    cuda.set_device(dev)
    x = torch.empty(64 << 20, dtype=torch.uint8, device=dev) if real else None
    segments = [s for s in cuda.memory_snapshot() if s.get("device", dev.index) == dev.index]
    del x
    out["segments"] = len(segments)
    out["expandable"] = sum(1 for s in segments if s.get("is_expandable"))
    return out


_PROBE_MAIN = (
    "import json, sys\n"
    "import trainer.runner  # everything `python -m trainer` imports before main_run sets the allocator\n"
    "from trainer.memory import expandable_segments_probe\n"
    "print(json.dumps(expandable_segments_probe(sys.argv[1])))\n"
)


def check_expandable_segments(
    dev: Any, quick: bool, *, cuda: Any = None, environ: MutableMapping[str, str] | None = None
) -> Any:
    """gptop doctor's `expandable_segments` path: `--cuda-allocator expandable_segments` (over a
    PYTORCH_CUDA_ALLOC_CONF the user set) must leave the allocator's segments expandable. On the real device
    the probe runs in a fresh interpreter that has imported what the trainer imports, since the allocator
    takes its settings once, and the doctor's own process has initialized CUDA by now."""
    import json
    import subprocess
    import sys

    from .contract.capabilities import support
    from .contract.doctor import Outcome

    reason = support("cuda_allocator", "expandable_segments", dev)
    if reason:
        return Outcome.skip(reason)
    device = str(dev.torch_device)
    if cuda is not None:
        got = expandable_segments_probe(device, cuda, environ)
    else:
        env = {k: v for k, v in os.environ.items() if k not in ALLOC_CONF_VARS}
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE_MAIN, device], capture_output=True, text=True, env=env, timeout=100
        )
        if proc.returncode != 0 or not proc.stdout.strip():
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return Outcome.verdict(False, f"the probe's process failed (exit code {proc.returncode})", tail[:300])
        got = json.loads(proc.stdout.strip().splitlines()[-1])
    if got["initialized"]:
        return Outcome.verdict(False, "CUDA was initialized before the setting", "the setting came too late")
    ok = got["segments"] > 0 and got["expandable"] == got["segments"]
    observed = (
        f"{got['expandable']} of {got['segments']} segments expandable with PYTORCH_CUDA_ALLOC_CONF={got['conf']!r}"
    )
    return Outcome.verdict(ok, observed, "the allocator did not take the setting", merged_warning=got["note"])
