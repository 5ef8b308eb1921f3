"""The machine's background load as the tuner takes it: gptop's device samples turned into `tuner.load`
points (the tuner never reads the machine itself).

Each device sample covers the interval since the one before it: the CPU share busy with processes other than
the trainer's and gptop's (in cores), the steal, the 1-minute load average, and the compute processes on the
run's GPUs (gptop.energy's choice of them) that are not the trainer's.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from trainer.contract.events import DeviceEvent
from tuner.load import LoadPoint

from .energy import run_gpu_indices


def load_points(
    samples: Sequence[DeviceEvent], t0: float, t1: float, run_gpus: Iterable[str] | None = None
) -> list[LoadPoint]:
    """The load points whose intervals overlap [t0, t1] (unix time), oldest first."""
    samples = sorted(samples, key=lambda s: s.time)
    if len(samples) < 2:
        return []
    gpus = run_gpu_indices(samples, t0, t1, run_gpus) if any(s.devices for s in samples) else set()
    out = []
    for before, s in zip(samples, samples[1:]):
        if s.time <= t0 or before.time >= t1 or s.cpu is None:
            continue
        cores = len(s.cpu.per_core) or 1
        others = s.cpu.others_cpu_pct
        counts = [g.other_procs for g in s.devices if g.index in gpus]
        out.append(
            LoadPoint(
                time=s.time,
                span_s=s.time - before.time,
                others_cpu=others / 100.0 * cores if others is not None else None,
                steal_pct=s.cpu.steal_pct,
                gpu_others=None if not counts or None in counts else sum(c for c in counts if c is not None),
                load_avg=s.cpu.load_avg,
                cores=cores,
            )
        )
    return out


def other_processes(procs: Any, pids: set[int]) -> int | None:
    """How many compute processes on a GPU are not the trainer's (`pids`); None when NVML gave no list, or
    when the trainer runs but none of NVML's PIDs is one of its (a container's PID namespace: ours cannot be
    told from the others)."""
    if procs is None:
        return None
    seen = [getattr(p, "pid", None) for p in procs]
    if pids and seen and not any(pid in pids for pid in seen):
        return None
    return sum(1 for pid in seen if pid not in pids)
