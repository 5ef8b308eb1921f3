"""The training device as data: what gptop, the tuner and capability gating need to know.

Probing a real device needs torch and lives in `trainer.device_probe.detect`; this
module stays torch-free so gptop and the tuner can describe a device (from a
hello event, or a fake H100 in tests) without importing torch.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "cpu" or "cuda"
    index: int | None = None
    name: str = "cpu"
    capability: tuple[int, int] | None = None  # CUDA compute capability
    total_memory: int = 0  # bytes
    cpu_count: int = 1
    has_compiler: bool = True  # a C++ compiler for inductor on CPU / triton on GPU
    cpu_bf16: bool = True  # CPU: oneDNN has bf16 kernels (AVX-512 and newer); without them bf16 is emulated
    # CPU: bf16 instructions (AVX512_BF16, AMX, Arm BF16), where bf16 matmuls beat fp32; None: not known
    cpu_bf16_native: bool | None = None
    uuid: str | None = None  # CUDA: the GPU's UUID, which NVML reports too (`gpu_key`)
    pci_bus_id: str | None = None  # CUDA: its PCI address, DOMAIN:BUS:DEVICE in hex
    torch_version: str | None = None  # the trainer's torch, whose kernels some values need (None: not said)

    @property
    def key(self) -> str | None:
        """The GPU's identity as NVML also spells it (`gpu_key`); None on the CPU or when torch did not say."""
        return gpu_key(self.uuid, self.pci_bus_id) if self.is_cuda else None

    @property
    def keys(self) -> list[str]:
        """Both spellings torch gave of the GPU's identity (UUID, PCI address): either matches NVML's."""
        if not self.is_cuda:
            return []
        return [k for k in (gpu_key(self.uuid), gpu_key(None, self.pci_bus_id)) if k]

    @property
    def torch_device(self) -> "torch.device":
        import torch  # the trainer's side only: gptop and the tuner never ask for it

        return torch.device(self.type if self.index is None else f"{self.type}:{self.index}")

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"

    def at_least(self, major: int, minor: int) -> bool:
        return self.capability is not None and tuple(self.capability) >= (major, minor)

    def torch_at_least(self, major: int, minor: int) -> bool:
        """Whether the trainer's torch is release `major.minor` or newer (False when not known)."""
        return torch_release(self.torch_version) >= (major, minor)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["capability"] = list(self.capability) if self.capability else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeviceInfo":
        """The inverse of `to_dict` (a hello event's `device`); unknown keys from newer trainers are ignored."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if kw.get("capability"):
            kw["capability"] = tuple(kw["capability"])
        return cls(**kw)


def torch_release(version: str | None) -> tuple[int, int]:
    """(major, minor) of a torch version string ("2.13.0+cu130", "2.12.0a0+git..."); (0, 0) when not known."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


# /proc/cpuinfo flags of CPUs that multiply bf16 in hardware (x86 AVX512_BF16 and AMX; Arm's "bf16" feature).
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (x86 "flags", Arm "Features"); empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU has bf16 arithmetic in hardware, so bf16 autocast is faster than fp32 there."""
    return bool((cpu_flags() if flags is None else flags) & BF16_CPU_FLAGS)


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it (x86 "model name", Arm "Model" / "cpu model"): the
    header line's device name and the key of measured CPU peaks."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def gpu_key(uuid: str | None = None, pci_bus_id: str | None = None) -> str | None:
    """One spelling of a GPU's identity that torch and NVML agree on, so gptop can tell which NVML device a
    CUDA device is (CUDA's indices are renumbered by CUDA_VISIBLE_DEVICES and ordered fastest-first, NVML's
    by PCI bus; a container hides the host PIDs that would tell): the UUID without NVML's GPU-/MIG- prefix,
    lowercased; else the PCI address as pci:DOMAIN:BUS:DEVICE (hex, the function dropped). None: neither."""
    if uuid:
        u = str(uuid).strip().lower()
        for prefix in ("gpu-", "mig-"):
            if u.startswith(prefix):
                u = u[len(prefix) :]
        if u:
            return u
    if pci_bus_id:
        parts = str(pci_bus_id).strip().lower().split(":")
        try:
            if len(parts) == 3:
                domain, bus, rest = parts
            elif len(parts) == 2:
                domain, (bus, rest) = "0", parts
            else:
                return None
            return f"pci:{int(domain, 16):04x}:{int(bus, 16):02x}:{int(rest.split('.')[0], 16):02x}"
        except ValueError:
            return None
    return None


def has_compiler() -> bool:
    """Whether a C++ compiler is on the PATH (what torch.compile's inductor needs on the CPU)."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None or shutil.which("g++") is not None
