"""Keep freed host memory for reuse when training on the CPU.

On the CPU every tensor comes from malloc. glibc serves blocks above its mmap
threshold (which can never exceed 32 MiB) with a fresh `mmap` and gives them back
with `munmap` when freed, so the logits, their log-softmax and their gradients
(67 MB each for llama tiny at 16 x 128 tokens) are page-faulted and zeroed by the
kernel again at every step: tens of thousands of minor page faults and a large share
of the step's CPU time in the kernel (BENCHMARKS.md has the figures).

`keep_freed_memory()` turns glibc's mmap path off and raises its trim threshold, so
freed blocks stay in the heap and the next step reuses them: almost no page faults,
and less CPU time per step. This is what preloading jemalloc or
tcmalloc does for PyTorch CPU training, done in-process with `mallopt(3)`, no preload.
The price: the process keeps its peak heap (RSS does not shrink after a peak), which
a training loop reaches again every step anyway.

Only glibc is touched (other C libraries are left alone); `GPTOP_HOST_MALLOC=0` opts out.
"""

from __future__ import annotations

import ctypes
import os
import sys

ENV = "GPTOP_HOST_MALLOC"

# mallopt(3) parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4

TRIM_THRESHOLD = 2**31 - 1  # bytes of free heap top kept before trimming (the int maximum)
TOP_PAD = 64 << 20  # extra bytes per heap growth: fewer brk calls while the heap grows

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Configure glibc malloc to keep and reuse freed memory; True if it is now so configured."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return False
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError, ValueError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _applied = (
        mallopt(M_MMAP_MAX, 0) == 1
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        and mallopt(M_TOP_PAD, TOP_PAD) == 1
    )
    return _applied
