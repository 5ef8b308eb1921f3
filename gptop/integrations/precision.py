"""The precision a user's training runs in, as the clients report it: the MFU peak's column (trainer.flops).

A program may state it (the Probe's `precision=`, a Trainer's bf16/fp16/tf32 arguments); otherwise it is read
from torch where the model runs: the active autocast, else the parameters' dtype, with TF32 matmuls on CUDA
making fp32 tf32 (read through trainer.tf32: the old flag raises once torch's new API set it).
"""

from __future__ import annotations

import torch

from trainer.tf32 import matmul_tf32


def autocast_precision(device: torch.device) -> str | None:
    """bf16 or fp16 while an autocast to that dtype is active on `device`'s type here, else None."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(torch.get_autocast_dtype(device.type))


def model_precision(model: torch.nn.Module | None, device: torch.device) -> str:
    """The MFU column of a run whose precision the program did not state: the autocast active now, else its
    parameters' dtype (fp32 on CUDA with TF32 matmuls allowed is tf32). Under autocast the parameters stay
    fp32: read where the model runs (the Probe reads it in its model's first forward)."""
    under = autocast_precision(device)
    if under is not None:
        return under
    p = next(iter(model.parameters()), None) if model is not None else None
    dtype = p.dtype if p is not None else torch.float32
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if device.type == "cuda":
        return "tf32" if matmul_tf32() else "fp32"
    return "fp32"
