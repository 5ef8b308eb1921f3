"""FLOPs per token and MFU (model FLOPs utilization).

MFU = achieved model FLOPs per second / the device's peak. Both halves are
documented here so the number on the dashboard can be checked by hand.

**FLOPs per token** (training: forward + backward) follows torchtitan's
``get_num_flop_per_token``::

    6 * N + 12 * L * H * Q * T

N: active non-embedding parameters per token (6 = 2 for the forward
multiply-add, 4 for the two backward matmuls per weight); L layers, H heads,
Q head dim, T sequence length: the attention score and value matmuls, 2 in the
forward and 4 in the backward, 2 FLOPs per multiply-add. As in torchtitan,
causal sparsity is not subtracted and activation recomputation is not added:
MFU counts the model's FLOPs, not the hardware's.

**Frozen weights** (a LoRA run's base, trainer.lora) are counted at 4 FLOPs per
parameter and token instead of 6: the backward pass of a linear layer is two
matmuls of the forward's size, one for the gradient of its input (needed to
reach earlier layers and the adapters) and one for the gradient of its weight
(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", arXiv:2104.04473, section 5.1: backward = 2x
forward for exactly these two). A frozen weight needs no weight gradient, so
its cost is 2 (forward) + 2 (input gradient) = 4; the adapters train and cost
6. So a LoRA run's FLOPs per token are ``6 * N_adapters + 4 * N_frozen +
attention``: its MFU counts the work the run must do, not a full fine-tune's.
(The input gradient of the lowest frozen layers is still counted although
nothing below them trains; that is at most the first layer's share.)

For DeepSeek's multi-head latent attention the score matmul runs over the
query/key head dim (nope + rope) and the value matmul over the value head dim,
so the attention term is ``6 * L * H * (Q_qk + Q_v) * T`` (torchtitan's
deepseek_v3 does the same); with Q_qk = Q_v = Q this is the formula above.

**Peak FLOPs** of a GPU come from a table of NVIDIA datasheet numbers, dense
(the datasheets' headline tensor numbers assume 2:4 sparsity; those are
halved), matched on the torch device name. A MIG instance (its name says
``MIG 2g.20gb``) gets its compute slices' share of its GPU's peak, 2/7 there.
An unknown GPU has no peak and therefore no MFU (``None``), never a guessed one. On the CPU there is no
datasheet to trust, so the peak is *measured* once: the best rate of a large
matmul in the run's dtype (for bf16 never below the fp32 rate: a CPU without
native bf16 emulates it), cached per CPU name, thread count, number of
processes training at once on the node (the ranks of a run share its cores),
torch version and dtype in ``$GPTOP_CACHE`` (default ``~/.cache/gptop``).

A measured peak must not depend on how busy the machine was: it is one
core's matmul rate timed in that thread's busy CPU seconds (not wall seconds,
which grow when another process holds the core), best of several short
repetitions, times the cores the process may use. The cache keeps the best
measurement per key ({"best", "n"}); a run whose MFU comes within reach of the
peak (above ``REMEASURE_MFU``) measures again once and keeps the better one.
An MFU above 1 is still never reported: the trainer drops that cached peak
(``forget_cpu_peak``) so that the next run measures again, and reports null
for the rest of the run, with a warning event that says why. Where the peak
came from is the hello event's ``peak_source``; views mark a measured peak's
MFU as approximate ("~").
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .contract.atomic import atomic_write
from .contract.device import DeviceInfo
from .contract.device import cpu_name as default_cpu_name

T = 1e12

REMEASURE_MFU = 0.8  # a measured peak the run's MFU comes this close to is measured again (once per run)

# Which table column a run's --precision uses. fp32 means plain fp32 matmuls
# (CUDA cores; torch does not use TF32 unless asked). fp8 runs keep attention,
# norms and the head in bf16 and only convert Linear layers, and torchtitan
# reports float8 MFU against the bf16 peak; we do the same, so fp8 MFU is
# comparable with bf16 MFU (the fp8 column is there for reference).
PRECISION_COLUMN = {
    "fp32": "fp32",
    "tf32": "tf32",
    "bf16": "bf16",
    "fp16": "fp16",
    "fp8-tensorwise": "bf16",
    "fp8-rowwise": "bf16",
}

# name, regex on the lowercased torch device name, dense peak FLOPs per column
# (None: the GPU has no such tensor-core path), source. First match wins, so
# more specific names come first.
_NVIDIA = "https://www.nvidia.com/en-us/data-center/"
PEAK_TABLE: list[tuple[str, str, dict[str, float | None], str]] = [
    (
        "GB200",
        r"gb200",
        dict(fp32=80 * T, tf32=1250 * T, bf16=2500 * T, fp16=2500 * T, fp8=5000 * T),
        _NVIDIA + "gb200-nvl72/ (datasheet, GB200 superchip column per GPU: halved, sparse figures halved)",
    ),
    (
        "B200",
        r"\bb200\b",
        dict(fp32=75 * T, tf32=1125 * T, bf16=2250 * T, fp16=2250 * T, fp8=4500 * T),
        _NVIDIA + "hgx/ (HGX B200 datasheet per GPU: eighths, sparse figures halved)",
    ),
    (
        "H800 PCIe",
        r"h800.*pcie",
        dict(fp32=51 * T, tf32=378 * T, bf16=756.5 * T, fp16=756.5 * T, fp8=1513 * T),
        "NVIDIA H800 Tensor Core GPU datasheet, PCIe column (sparse figures halved)",
    ),
    (
        "H800 SXM",
        r"h800",
        dict(fp32=67 * T, tf32=494.5 * T, bf16=989.5 * T, fp16=989.5 * T, fp8=1979 * T),
        "NVIDIA H800 Tensor Core GPU datasheet, SXM column (sparse figures halved)",
    ),
    (
        "H100 NVL",
        r"h100.*nvl",
        dict(fp32=60 * T, tf32=417.5 * T, bf16=835.5 * T, fp16=835.5 * T, fp8=1670.5 * T),
        _NVIDIA + "h100/ (datasheet, sparse figures halved)",
    ),
    (
        "H100 PCIe",
        r"h100.*pcie",
        dict(fp32=51 * T, tf32=378 * T, bf16=756 * T, fp16=756 * T, fp8=1513 * T),
        _NVIDIA + "h100/ (datasheet, sparse figures halved)",
    ),
    (
        "H100 SXM",
        r"h100",
        dict(fp32=67 * T, tf32=494.5 * T, bf16=989.5 * T, fp16=989.5 * T, fp8=1979 * T),
        _NVIDIA + "h100/ (datasheet, sparse figures halved)",
    ),
    (
        "H200 NVL",
        r"h200.*nvl",
        dict(fp32=60 * T, tf32=417.5 * T, bf16=835.5 * T, fp16=835.5 * T, fp8=1670.5 * T),
        _NVIDIA + "h200/ (datasheet, sparse figures halved)",
    ),
    (
        "H200 SXM",
        r"h200",
        dict(fp32=67 * T, tf32=494.5 * T, bf16=989.5 * T, fp16=989.5 * T, fp8=1979 * T),
        _NVIDIA + "h200/ (datasheet, sparse figures halved)",
    ),
    (
        "A100",
        r"a100",
        dict(fp32=19.5 * T, tf32=156 * T, bf16=312 * T, fp16=312 * T, fp8=None),
        _NVIDIA + "a100/ (datasheet; 40GB and 80GB, SXM and PCIe have the same peaks)",
    ),
    (
        "L40S",
        r"l40s|l40-s|l40 s",
        dict(fp32=91.6 * T, tf32=183 * T, bf16=362.05 * T, fp16=362.05 * T, fp8=733 * T),
        _NVIDIA + "l40s/ (datasheet, dense figures)",
    ),
    (
        "L40",
        r"\bl40\b",
        dict(fp32=90.5 * T, tf32=90.5 * T, bf16=181.05 * T, fp16=181.05 * T, fp8=362 * T),
        _NVIDIA + "l40/ (datasheet, dense figures)",
    ),
    (
        "L4",
        r"\bl4\b",
        dict(fp32=30.3 * T, tf32=60 * T, bf16=121 * T, fp16=121 * T, fp8=242.5 * T),
        _NVIDIA + "l4/ (datasheet, sparse figures halved)",
    ),
    (
        "A40",
        r"\ba40\b",
        dict(fp32=37.4 * T, tf32=74.8 * T, bf16=149.7 * T, fp16=149.7 * T, fp8=None),
        _NVIDIA + "a40/ (datasheet, dense figures)",
    ),
    (
        "A10G",
        r"a10g",
        dict(fp32=35 * T, tf32=35 * T, bf16=70 * T, fp16=70 * T, fp8=None),
        "https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/ (AWS publishes no datasheet)",
    ),
    (
        "A10",
        r"\ba10\b",
        dict(fp32=31.2 * T, tf32=62.5 * T, bf16=125 * T, fp16=125 * T, fp8=None),
        _NVIDIA + "products/a10-gpu/ (datasheet, dense figures)",
    ),
    (
        "RTX 4090",
        r"4090(?!\s*d\b)",
        dict(fp32=82.6 * T, tf32=82.6 * T, bf16=165.2 * T, fp16=165.2 * T, fp8=330.3 * T),
        "NVIDIA Ada Lovelace architecture whitepaper, Appendix A (dense, FP32 accumulate)",
    ),
    (
        "RTX 3090",
        r"3090(?!\s*ti)",
        dict(fp32=35.6 * T, tf32=35.6 * T, bf16=71 * T, fp16=71 * T, fp8=None),
        "NVIDIA Ampere GA102 GPU architecture whitepaper, Appendix A (dense, FP32 accumulate)",
    ),
    (
        "V100S",
        r"v100s",
        dict(fp32=16.4 * T, tf32=None, bf16=None, fp16=130 * T, fp8=None),
        _NVIDIA + "v100/ (datasheet, PCIe V100S)",
    ),
    (
        "V100 PCIe",
        r"v100.*pcie",
        dict(fp32=14 * T, tf32=None, bf16=None, fp16=112 * T, fp8=None),
        _NVIDIA + "v100/ (datasheet)",
    ),
    (
        "V100 SXM2",
        r"v100",
        dict(fp32=15.7 * T, tf32=None, bf16=None, fp16=125 * T, fp8=None),
        _NVIDIA + "v100/ (datasheet)",
    ),
    (
        "T4",
        r"\bt4\b",
        dict(fp32=8.1 * T, tf32=None, bf16=None, fp16=65 * T, fp8=None),
        _NVIDIA + "tesla-t4/ (datasheet)",
    ),
]


def flops_per_token(
    active_nonembed_params: int,
    n_layers: int,
    n_heads: int,
    head_dim: int,
    seq_len: int,
    *,
    v_head_dim: int | None = None,
    frozen_params: int = 0,
) -> int:
    """Training FLOPs per token: ``6*N + 4*F + 12*L*H*Q*T`` (torchtitan, plus frozen weights).

    N: the active non-embedding parameters that train; F: those that are frozen (a LoRA base), which
    need the forward (2) and the activation gradient (2) but no weight gradient. With `v_head_dim`
    (MLA, where query/key and value heads differ) the attention term is ``6*L*H*(head_dim + v_head_dim)*T``.
    """
    v = head_dim if v_head_dim is None else v_head_dim
    return int(6 * active_nonembed_params + 4 * frozen_params + 6 * n_layers * n_heads * (head_dim + v) * seq_len)


def gpu_entry(device_name: str) -> tuple[str, dict[str, float | None], str] | None:
    """(table name, peaks per column, source) for a torch CUDA device name, or None if unknown."""
    name = device_name.lower()
    for label, pattern, peaks, source in PEAK_TABLE:
        if re.search(pattern, name):
            return label, peaks, source
    return None


# A MIG instance's name: "NVIDIA H100 80GB HBM3 MIG 1g.10gb" (a GPU instance of 1 compute slice), or with a
# compute instance inside a larger GPU instance "MIG 1c.3g.40gb" (1 of its 3 slices), "+me" and the like after.
MIG_RE = re.compile(r"\bmig\s+(?:(\d+)c\.)?(\d+)g\.")
# The GPUs of the table that MIG partitions (A100, H100, H200, H800, B200, GB200) split their SMs into 7 compute
# slices: an instance of N slices has N/7 of the GPU's peak (up to the few SMs the whole GPU has beyond them).
MIG_COMPUTE_SLICES = 7


def mig_slices(device_name: str) -> int | None:
    """The compute slices of a MIG instance's name (of MIG_COMPUTE_SLICES), 0 when the name is not a MIG
    instance's, None when it is one of a form not understood."""
    name = device_name.lower()
    if not re.search(r"\bmig\b", name):
        return 0
    m = MIG_RE.search(name)
    if m is None:
        return None
    slices = int(m.group(1) or m.group(2))
    return slices if 0 < slices <= MIG_COMPUTE_SLICES else None


def gpu_peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of a GPU (a MIG instance: its share of it) for a run's precision; None when unknown or
    unsupported."""
    entry = gpu_entry(device_name)
    slices = mig_slices(device_name)
    if entry is None or slices is None:
        return None
    column = PRECISION_COLUMN.get(precision, precision)
    value = entry[1].get(column)
    return value * slices / MIG_COMPUTE_SLICES if value is not None and slices else value


def cpu_dtype(precision: str) -> torch.dtype:
    """The matmul dtype whose CPU peak is a run's MFU denominator."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


@dataclass(frozen=True)
class Peak:
    """The MFU denominator of one process and where it came from (the hello event's `peak_source`)."""

    flops: float | None
    source: str | None  # "datasheet: <GPU> (<url>)", "measured: ..." or None (unknown GPU)

    @property
    def measured(self) -> bool:
        return bool(self.source) and self.source.startswith("measured")  # type: ignore[union-attr]


def peak(
    dev: DeviceInfo, precision: str, *, procs: int = 1, cache_dir: str | Path | None = None, remeasure: bool = False
) -> Peak:
    """The MFU denominator for one process: the GPU table, or the measured CPU matmul rate.

    `procs` is how many processes of the run share this node's CPU (its local
    ranks); each gets its share of the cores. `remeasure` measures the CPU
    again even when a cached figure exists (the best of all measurements is kept).
    """
    if dev.is_cuda:
        entry = gpu_entry(dev.name)
        value = gpu_peak_flops(dev.name, precision)
        if entry is None or value is None:
            return Peak(None, None)
        slices = mig_slices(dev.name)
        share = f", MIG: {slices} of {MIG_COMPUTE_SLICES} compute slices" if slices else ""
        column = PRECISION_COLUMN.get(precision, precision)
        return Peak(value, f"datasheet: {entry[0]} {column}{share} ({entry[2]})")
    dtypes = [cpu_dtype(precision)]
    if dtypes[0] != torch.float32:
        # A CPU without native bf16 emulates it far below its fp32 rate, and autocast keeps part of the
        # work in fp32: the machine's peak is then its fp32 one (on GPUs the bf16 column is always higher).
        dtypes.append(torch.float32)
    best: tuple[float, dict[str, Any], torch.dtype] | None = None
    for dt in dtypes:
        entry = cpu_peak_entry(dt, cpu_name=dev.name, procs=procs, cache_dir=cache_dir, remeasure=remeasure)
        if best is None or entry["best"] > best[0]:
            best = (entry["best"], entry, dt)
    assert best is not None
    value, entry, dt = best
    n = int(entry.get("n", 1))
    cores = usable_cores(int(entry.get("threads") or 1), procs)
    return Peak(
        value,
        f"measured: best of {n} CPU matmul measurement{'s' if n != 1 else ''} "
        f"({str(dt).removeprefix('torch.')}; one core's rate in busy CPU time x {cores} "
        f"core{'s' if cores != 1 else ''})",
    )


def peak_flops(dev: DeviceInfo, precision: str, *, procs: int = 1, cache_dir: str | Path | None = None) -> float | None:
    """`peak(...).flops`: the MFU denominator for one process."""
    return peak(dev, precision, procs=procs, cache_dir=cache_dir).flops


def mfu(tokens_per_s: float | None, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilization as a fraction (0.42 = 42%), or None when the peak is unknown."""
    if peak is None or peak <= 0 or tokens_per_s is None:
        return None
    return float(tokens_per_s) * float(flops_per_token) / float(peak)


# --- CPU peak, measured -------------------------------------------------------------------


def _cpu_key(cpu_name: str, threads: int, procs: int, dtype: torch.dtype) -> str:
    return f"{cpu_name}|threads={threads}|procs={procs}|torch={torch.__version__}|{str(dtype).removeprefix('torch.')}"


def _cache_file(cache_dir: str | Path | None) -> Path:
    from .data import default_cache_dir  # one cache folder for tokens, tokenizers and machine facts

    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "cpu_peak.json"


def _read_table(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _write_table(path: Path, table: dict[str, Any]) -> None:
    try:
        atomic_write(path, json.dumps(table, indent=1, sort_keys=True))
    except OSError:
        pass  # a read-only home still gets an MFU, just not cached


def usable_cores(threads: int, procs: int = 1) -> int:
    """Cores one of `procs` processes with `threads` threads can have to itself on this node."""
    try:
        ncpu = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        ncpu = os.cpu_count() or 1
    return max(1, min(threads, ncpu // max(1, procs)))


def measure_cpu_matmul_flops(
    dtype: torch.dtype = torch.float32,
    *,
    budget_s: float = 0.6,
    procs: int = 1,
    threads: int | None = None,
    cpu_time: Callable[[], float] = time.thread_time,
    wall: Callable[[], float] = time.perf_counter,
) -> float:
    """Peak FLOP/s of one process on this CPU: one core's square-matmul rate times the cores the process
    may use (`usable_cores` of its `threads`, default torch's, and the `procs` sharing the node).

    One core's rate is measured on one thread in that thread's busy CPU seconds, not wall seconds: FLOPs
    per CPU second is what the core does while it runs us, and does not fall when another process takes
    the core half the time (wall time would: a peak taken on a busy machine was half the real one, and
    MFU read 97%). One thread, because several threads stall at each parallel region's barrier while
    another process holds one of their cores, spinning CPU time away. The best of several short
    repetitions is kept. Like a datasheet's figure it assumes the cores scale perfectly (and single-core
    clocks, a little above all-core ones), so it is an upper bound. Takes < ~1 s."""
    cores = usable_cores(threads or torch.get_num_threads(), procs)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = 512
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        t0 = wall()
        torch.mm(a, b)  # warm-up (and a size probe)
        if wall() - t0 > budget_s / 8:  # slow dtype on this CPU (e.g. bf16 without AMX)
            n = 256
            a, b = a[:n, :n].contiguous(), b[:n, :n].contiguous()
        best = 0.0
        deadline = wall() + budget_s
        reps = 0
        while reps < 5 or wall() < deadline:
            c = cpu_time()
            torch.mm(a, b)
            busy = cpu_time() - c
            if busy > 0:
                best = max(best, 2 * n**3 / busy)
            reps += 1
    finally:
        torch.set_num_threads(previous)
    return best * cores


def cpu_peak_entry(
    dtype: torch.dtype = torch.float32,
    *,
    cpu_name: str | None = None,
    threads: int | None = None,
    procs: int = 1,
    cache_dir: str | Path | None = None,
    remeasure: bool = False,
) -> dict[str, Any]:
    """The cached CPU peak of a key ({"best": FLOP/s, "n": measurements, "threads": ...}), measuring
    when there is none or when `remeasure`; the best measurement per key is kept, so one taken on a busy
    machine never lowers it. Keyed by CPU name, threads, processes, torch version and dtype."""
    threads = threads or torch.get_num_threads()
    key = _cpu_key(cpu_name or default_cpu_name(), threads, procs, dtype)
    path = _cache_file(cache_dir)
    cached = _entry(_read_table(path).get(key))
    if cached is not None and not remeasure:
        return {**cached, "threads": threads}
    value = measure_cpu_matmul_flops(dtype, procs=procs, threads=threads)
    table = _read_table(path)  # re-read: another rank may have written meanwhile
    old = _entry(table.get(key)) or {"best": 0.0, "n": 0}
    entry = {"best": max(old["best"], value), "n": old["n"] + 1, "last": value}
    table[key] = entry
    _write_table(path, table)
    return {**entry, "threads": threads}


def _entry(v: Any) -> dict[str, Any] | None:
    """A cache entry as {"best", "n"}: a bare number (the cache of earlier versions) is one measurement."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
        return {"best": float(v), "n": 1}
    if isinstance(v, dict):
        best, n = v.get("best"), v.get("n", 1)
        if isinstance(best, (int, float)) and not isinstance(best, bool) and best > 0 and math.isfinite(best):
            return {"best": float(best), "n": int(n) if isinstance(n, int) and n > 0 else 1}
    return None


def cpu_peak_flops(
    dtype: torch.dtype = torch.float32,
    *,
    cpu_name: str | None = None,
    threads: int | None = None,
    procs: int = 1,
    cache_dir: str | Path | None = None,
) -> float:
    """Measured CPU matmul peak (the best kept per key; see `cpu_peak_entry`)."""
    return cpu_peak_entry(dtype, cpu_name=cpu_name, threads=threads, procs=procs, cache_dir=cache_dir)["best"]


def forget_cpu_peak(
    dtype: torch.dtype = torch.float32,
    *,
    cpu_name: str | None = None,
    threads: int | None = None,
    procs: int = 1,
    cache_dir: str | Path | None = None,
) -> bool:
    """Drop a cached CPU peak that proved too low, so the next run measures again. True if one was dropped."""
    key = _cpu_key(cpu_name or default_cpu_name(), threads or torch.get_num_threads(), procs, dtype)
    path = _cache_file(cache_dir)
    table = _read_table(path)
    if table.pop(key, None) is None:
        return False
    _write_table(path, table)
    return True
