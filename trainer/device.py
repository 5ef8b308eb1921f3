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

import torch

from .contract.device import DeviceInfo, cpu_has_native_bf16, cpu_name


def detect(requested: str = "auto") -> DeviceInfo:
    """Describe the device a run will use. `requested`: auto, cpu, cuda, cuda:N."""
    from .contract.config import ConfigError

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cpu":
        import psutil

        return DeviceInfo(type="cpu", name=cpu_name(), total_memory=psutil.virtual_memory().total,
                          cpu_count=cpus, has_compiler=compiler_missing("cpu") is None,
                          cpu_bf16=_cpu_has_bf16_kernels(), cpu_bf16_native=cpu_has_native_bf16())
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("--device", f"{requested} asked for but torch sees no CUDA device "
                              f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
        index = int(requested.split(":")[1]) if ":" in requested else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ConfigError("--device", f"{requested}: only {torch.cuda.device_count()} CUDA devices")
        props = torch.cuda.get_device_properties(index)
        uuid, pci = gpu_identity(index)
        return DeviceInfo(type="cuda", index=index, name=props.name, capability=(props.major, props.minor),
                          total_memory=props.total_memory, cpu_count=cpus,
                          has_compiler=compiler_missing("cuda") is None, uuid=uuid, pci_bus_id=pci)
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
    except (AttributeError, RuntimeError):       # a torch built without oneDNN
        return False
