"""Probing the training device: the one boundary where CUDA is asked.

`detect()` fills a `DeviceInfo` (trainer.contract.device, plain data): everything
that depends on the hardware (capability gating, MFU peaks, the choice of timer
and prefetcher) takes one, so tests can pass a fake one describing an H100
without having it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from typing import TYPE_CHECKING, Any

import torch

from .contract.device import DeviceInfo, cpu_has_native_bf16, cpu_name

if TYPE_CHECKING:
    from .contract.doctor import Outcome


def detect(requested: str = "auto") -> DeviceInfo:
    """Describe the device a run will use. `requested`: auto, cpu, cuda, cuda:N."""
    from .contract.config import ConfigError

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cpu":
        import psutil

        return DeviceInfo(
            type="cpu",
            name=cpu_name(),
            total_memory=psutil.virtual_memory().total,
            cpu_count=cpus,
            has_compiler=compiler_missing("cpu") is None,
            cpu_bf16=_cpu_has_bf16_kernels(),
            cpu_bf16_native=cpu_has_native_bf16(),
            torch_version=torch.__version__,
        )
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                "--device",
                f"{requested} asked for but torch sees no CUDA device "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})",
            )
        index = int(requested.split(":")[1]) if ":" in requested else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ConfigError("--device", f"{requested}: only {torch.cuda.device_count()} CUDA devices")
        props = torch.cuda.get_device_properties(index)
        uuid, pci = gpu_identity(index)
        return DeviceInfo(
            type="cuda",
            index=index,
            name=props.name,
            capability=(props.major, props.minor),
            total_memory=props.total_memory,
            cpu_count=cpus,
            has_compiler=compiler_missing("cuda") is None,
            uuid=uuid,
            pci_bus_id=pci,
            torch_version=torch.__version__,
        )
    raise ConfigError("--device", f"{requested!r} is not auto, cpu, cuda or cuda:N")


def gpu_identity(index: int) -> tuple[str | None, str | None]:
    """(UUID, PCI address DOMAIN:BUS:DEVICE) of CUDA device `index`, as far as this torch's device properties
    tell (contract.device.gpu_key spells them as NVML does). Reading properties creates no CUDA context."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    uuid = str(uuid) if uuid is not None and str(uuid) else None
    parts = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
    pci = f"{parts[0]:04x}:{parts[1]:02x}:{parts[2]:02x}" if all(isinstance(p, int) for p in parts) else None
    return uuid, pci


def _which(*names: str | None) -> str | None:
    for name in names:
        if name and shutil.which(name):
            return name
    return None


def compiler_missing(device_type: str) -> str | None:
    """What torch.compile's backend lacks on `device_type`, None when it has everything: on the CPU inductor
    builds C++ (a C++ compiler); on CUDA it generates Triton kernels (triton importable) whose launchers
    Triton builds with a C compiler (`CC`, else cc, gcc or clang on the PATH)."""
    if device_type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install triton; CUDA builds of torch bring it)"
        if _which(os.environ.get("CC"), "cc", "gcc", "clang") is None:
            return "no C compiler for Triton's kernel launchers (install gcc, or set CC)"
        return None
    if _which(os.environ.get("CXX"), "c++", "g++", "clang++") is None:
        return "no C++ compiler for inductor's CPU kernels (install g++, or set CXX)"
    return None


def _cpu_has_bf16_kernels() -> bool:
    """Whether oneDNN runs bf16 matmuls natively here. On an AVX2-only CPU it does not, and a bf16
    matmul falls back to a path about 100x slower than fp32 (measured: 1.4 vs 160 GFLOP/s)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def _matmul_rate(a: torch.Tensor, reps: int, sync) -> float:
    """Matmuls of `a` by itself per second (after one warm-up)."""
    import time

    a @ a
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        a @ a
    sync()
    return reps / max(time.perf_counter() - t, 1e-9)


def check_bf16(dev: DeviceInfo, quick: bool) -> "Outcome":
    """gptop doctor's `bf16` path: a matmul under bf16 autocast (as the trainer runs `--precision bf16`)
    computes in bf16, within 2% of fp32, and how fast bf16 is against fp32 here (native or emulated)."""
    from .contract.capabilities import slow, support
    from .contract.doctor import Outcome

    reason = support("precision", "bf16", dev)
    if reason:
        return Outcome.skip(reason)
    device = dev.torch_device
    if dev.is_cuda:
        torch.cuda.set_device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if dev.is_cuda else (lambda: None)
    g = torch.Generator(device="cpu").manual_seed(0)
    n = 4096 if dev.is_cuda else 256
    a = torch.randn(n, n, generator=g).to(device)
    b = torch.randn(n, n, generator=g).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = a @ b
    ref = a @ b
    err = float((out.float() - ref).norm() / ref.norm())
    fp32 = _matmul_rate(a, 10 if dev.is_cuda else 3, sync)
    bf = _matmul_rate(a.to(torch.bfloat16), 10 if dev.is_cuda else 3, sync)
    speed = bf / fp32
    why_slow = slow("precision", "bf16", dev)
    kind = "emulated" if why_slow else "native"
    ok = out.dtype == torch.bfloat16 and err < 2e-2
    observed = f"{out.dtype}, error {err:.1e} vs fp32; {kind}: a bf16 matmul at {speed:.2f}x fp32's rate"
    if why_slow:
        observed += " (--precision bf16 runs with a warning; the tuner leaves it out)"
    return Outcome.verdict(
        ok,
        observed,
        f"bf16 autocast gave {out.dtype} with error {err:.1e}",
        relative_error=err,
        bf16_over_fp32=speed,
        native=not why_slow,
    )


def check_tf32(dev: DeviceInfo, quick: bool, *, device: Any = None) -> "Outcome":
    """gptop doctor's `tf32` path: with TF32 allowed (as the trainer sets it), an fp32 matmul rounds its
    inputs to TF32's 10-bit mantissa, an error far above fp32's; with it off, the result is plain fp32."""
    from .contract.capabilities import support
    from .contract.doctor import Outcome
    from .tf32 import allow_matmul_tf32, matmul_tf32

    reason = support("precision", "tf32", dev)
    if reason and device is None:
        return Outcome.skip(reason)
    device = torch.device(device) if device is not None else dev.torch_device  # tests: the CPU ignores the flag
    if device.type == "cuda":
        torch.cuda.set_device(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    a64, b64 = (
        torch.randn(2048, 2048, generator=g, dtype=torch.float64),
        torch.randn(2048, 2048, generator=g, dtype=torch.float64),
    )
    ref = a64.to(device) @ b64.to(device)
    a, b = a64.float().to(device), b64.float().to(device)
    before = matmul_tf32()
    try:
        allow_matmul_tf32(False)
        off = float(((a @ b).double() - ref).norm() / ref.norm())
        allow_matmul_tf32(True)
        on = float(((a @ b).double() - ref).norm() / ref.norm())
    finally:
        allow_matmul_tf32(before)
    ok = on > 4 * off and on < 1e-2
    return Outcome.verdict(
        ok,
        f"error vs fp64: {on:.1e} with TF32, {off:.1e} without",
        "allowing TF32 did not change the rounding (it does not take effect)",
        error_tf32=on,
        error_fp32=off,
    )
