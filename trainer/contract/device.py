"""The training device as data: what gptop, the tuner and capability gating need to know.

Probing a real device needs torch and lives in `trainer.device.detect`; this
module stays torch-free so gptop and the tuner can describe a device (from a
hello event, or a fake H100 in tests) without importing torch.
"""

from __future__ import annotations

import os
import platform
import shutil
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DeviceInfo:
    type: str                      # "cpu" or "cuda"
    index: int | None = None
    name: str = "cpu"
    capability: tuple[int, int] | None = None   # CUDA compute capability
    total_memory: int = 0          # bytes
    cpu_count: int = 1
    has_compiler: bool = True      # a C++ compiler for inductor on CPU / triton on GPU
    cpu_bf16: bool = True          # CPU: oneDNN has bf16 kernels (AVX-512 and newer); without them bf16 is emulated

    @property
    def torch_device(self) -> "torch.device":
        import torch        # the trainer's side only: gptop and the tuner never ask for it

        return torch.device(self.type if self.index is None else f"{self.type}:{self.index}")

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"

    def at_least(self, major: int, minor: int) -> bool:
        return self.capability is not None and tuple(self.capability) >= (major, minor)

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


def has_compiler() -> bool:
    """Whether a C++ compiler is on the PATH (what torch.compile's inductor needs on the CPU)."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None or shutil.which("g++") is not None
