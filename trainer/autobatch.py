"""`--micro-batch auto`: the largest micro-batch that fits, with a safety margin.

Candidates are the powers of two (and the full per-rank batch) that divide the
per-rank batch, so gradient accumulation stays exact. Each is probed with one
forward and backward; the peak memory is measured, out-of-memory is caught,
and sizes whose predicted peak (linear in the micro-batch) would pass the
margin are not even tried.
"""

from __future__ import annotations

from typing import Callable

import torch


def candidates(local_batch: int) -> list[int]:
    out = [m for m in (1 << i for i in range(20)) if m <= local_batch and local_batch % m == 0]
    if local_batch not in out:
        out.append(local_batch)
    return sorted(out)


def find_micro_batch(probe: Callable[[int], int], local_batch: int, capacity: int, margin: float = 0.1,
                     log: Callable[[str], None] = lambda s: None) -> int:
    """`probe(mb)` runs one forward+backward and returns peak bytes, or raises torch.OutOfMemoryError."""
    limit = capacity * (1.0 - margin)
    best, history = None, []
    for mb in candidates(local_batch):
        if len(history) >= 2:
            (m0, p0), (m1, p1) = history[-2], history[-1]
            slope = (p1 - p0) / (m1 - m0) if m1 != m0 else 0.0
            predicted = p1 + slope * (mb - m1)
            if predicted > limit:
                log(f"micro-batch {mb}: predicted peak {predicted / 2**30:.2f} GiB exceeds "
                    f"{limit / 2**30:.2f} GiB, stopping")
                break
        try:
            peak = probe(mb)
        except torch.OutOfMemoryError:
            log(f"micro-batch {mb}: out of memory")
            break
        log(f"micro-batch {mb}: peak {peak / 2**30:.2f} GiB")
        if peak > limit:
            break
        best = mb
        history.append((mb, peak))
    if best is None:
        raise torch.OutOfMemoryError("even micro-batch 1 does not fit with the safety margin")
    return best
