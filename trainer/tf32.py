"""Whether fp32 matmuls and convolutions on CUDA use TF32: read and set the way the installed torch allows.

torch 2.9 and newer hold `fp32_precision` settings in a tree (`torch.backends.fp32_precision` the root,
`torch.backends.cuda.matmul.fp32_precision`, `torch.backends.cudnn.conv.fp32_precision`, ...), each "ieee",
"tf32" or "none" (inherit the parent's); the getters resolve the inheritance. The old flags
(`torch.backends.cuda.matmul.allow_tf32`, `torch.backends.cudnn.allow_tf32`) still exist, but *reading* one
raises RuntimeError once the new API has set a state the old flag cannot express, and transformers'
TrainingArguments sets `torch.backends.fp32_precision = "tf32"` for tf32=True, bf16, and torch_compile with
fp32 weights. So every read here goes through the new getters where torch has them: torch's old setters
update the new settings too, so the new getters see a state set through either API.

Writes (gptop's own trainer and doctor only, processes where nothing else sets the precision) use the old
setters, which keep both APIs in step, so that code still reading the old state
(`torch.get_float32_matmul_precision()`, which inductor's autotuning reads) keeps working; a write through the
new API alone would make those reads raise.
"""

from __future__ import annotations

import torch


def new_api() -> bool:
    """Whether this torch has the `fp32_precision` settings (2.9 and newer)."""
    return hasattr(torch.backends, "fp32_precision")


def matmul_tf32() -> bool:
    """Whether fp32 matmuls on CUDA may use TF32 now (whichever API set it)."""
    if new_api():
        return torch.backends.cuda.matmul.fp32_precision == "tf32"
    return bool(torch.backends.cuda.matmul.allow_tf32)


def conv_tf32() -> bool:
    """Whether fp32 convolutions through cuDNN may use TF32 now."""
    if new_api():
        return torch.backends.cudnn.conv.fp32_precision == "tf32"
    return bool(torch.backends.cudnn.allow_tf32)


def allow_matmul_tf32(on: bool) -> None:
    """TF32 for fp32 matmuls on CUDA on or off (the old setter: both APIs agree afterwards)."""
    torch.backends.cuda.matmul.allow_tf32 = on


def allow_tf32(on: bool) -> None:
    """TF32 for fp32 matmuls and cuDNN's convolutions on CUDA on or off."""
    allow_matmul_tf32(on)
    torch.backends.cudnn.allow_tf32 = on
