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
halved), matched on the torch device name. An unknown GPU has no peak and
therefore no MFU (``None``), never a guessed one. On the CPU there is no
datasheet to trust, so the peak is *measured* once: the best rate of a large
matmul in the run's dtype (for bf16 never below the fp32 rate: a CPU without
native bf16 emulates it), cached per CPU name, thread count, number of
processes training at once on the node (the ranks of a run share its cores),
torch version and dtype in ``$GPTOP_CACHE`` (default ``~/.cache/gptop``).

A measured peak can be wrong: taken while another process held the cores, it
is too low, and every later run would then report an MFU above 1. An MFU
above 1 is therefore never reported: the trainer drops that cached peak
(``forget_cpu_peak``) so that the next run measures again, and reports null
for the rest of the run, with a warning event that says why.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import torch

from .contract.atomic import atomic_write
from .contract.device import DeviceInfo
from .contract.device import cpu_name as default_cpu_name

T = 1e12

# Which table column a run's --precision uses. fp32 means plain fp32 matmuls
# (CUDA cores; torch does not use TF32 unless asked). fp8 runs keep attention,
# norms and the head in bf16 and only convert Linear layers, and torchtitan
# reports float8 MFU against the bf16 peak; we do the same, so fp8 MFU is
# comparable with bf16 MFU (the fp8 column is there for reference).
PRECISION_COLUMN = {
    "fp32": "fp32", "tf32": "tf32", "bf16": "bf16", "fp16": "fp16",
    "fp8-tensorwise": "bf16", "fp8-rowwise": "bf16",
}

# name, regex on the lowercased torch device name, dense peak FLOPs per column
# (None: the GPU has no such tensor-core path), source. First match wins, so
# more specific names come first.
_NVIDIA = "https://www.nvidia.com/en-us/data-center/"
PEAK_TABLE: list[tuple[str, str, dict[str, float | None], str]] = [
    ("H100 NVL", r"h100.*nvl", dict(fp32=60 * T, tf32=417.5 * T, bf16=835.5 * T, fp16=835.5 * T, fp8=1670.5 * T),
     _NVIDIA + "h100/ (datasheet, sparse figures halved)"),
    ("H100 PCIe", r"h100.*pcie", dict(fp32=51 * T, tf32=378 * T, bf16=756 * T, fp16=756 * T, fp8=1513 * T),
     _NVIDIA + "h100/ (datasheet, sparse figures halved)"),
    ("H100 SXM", r"h100", dict(fp32=67 * T, tf32=494.5 * T, bf16=989.5 * T, fp16=989.5 * T, fp8=1979 * T),
     _NVIDIA + "h100/ (datasheet, sparse figures halved)"),
    ("H200 NVL", r"h200.*nvl", dict(fp32=60 * T, tf32=417.5 * T, bf16=835.5 * T, fp16=835.5 * T, fp8=1670.5 * T),
     _NVIDIA + "h200/ (datasheet, sparse figures halved)"),
    ("H200 SXM", r"h200", dict(fp32=67 * T, tf32=494.5 * T, bf16=989.5 * T, fp16=989.5 * T, fp8=1979 * T),
     _NVIDIA + "h200/ (datasheet, sparse figures halved)"),
    ("A100", r"a100", dict(fp32=19.5 * T, tf32=156 * T, bf16=312 * T, fp16=312 * T, fp8=None),
     _NVIDIA + "a100/ (datasheet; 40GB and 80GB, SXM and PCIe have the same peaks)"),
    ("L40S", r"l40s|l40-s|l40 s", dict(fp32=91.6 * T, tf32=183 * T, bf16=362.05 * T, fp16=362.05 * T, fp8=733 * T),
     _NVIDIA + "l40s/ (datasheet, dense figures)"),
    ("L40", r"\bl40\b", dict(fp32=90.5 * T, tf32=90.5 * T, bf16=181.05 * T, fp16=181.05 * T, fp8=362 * T),
     _NVIDIA + "l40/ (datasheet, dense figures)"),
    ("L4", r"\bl4\b", dict(fp32=30.3 * T, tf32=60 * T, bf16=121 * T, fp16=121 * T, fp8=242.5 * T),
     _NVIDIA + "l4/ (datasheet, sparse figures halved)"),
    ("A40", r"\ba40\b", dict(fp32=37.4 * T, tf32=74.8 * T, bf16=149.7 * T, fp16=149.7 * T, fp8=None),
     _NVIDIA + "a40/ (datasheet, dense figures)"),
    ("A10G", r"a10g", dict(fp32=35 * T, tf32=35 * T, bf16=70 * T, fp16=70 * T, fp8=None),
     "https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/ (AWS publishes no datasheet)"),
    ("A10", r"\ba10\b", dict(fp32=31.2 * T, tf32=62.5 * T, bf16=125 * T, fp16=125 * T, fp8=None),
     _NVIDIA + "products/a10-gpu/ (datasheet, dense figures)"),
    ("RTX 4090", r"4090(?!\s*d\b)", dict(fp32=82.6 * T, tf32=82.6 * T, bf16=165.2 * T, fp16=165.2 * T, fp8=330.3 * T),
     "NVIDIA Ada Lovelace architecture whitepaper, Appendix A (dense, FP32 accumulate)"),
    ("RTX 3090", r"3090(?!\s*ti)", dict(fp32=35.6 * T, tf32=35.6 * T, bf16=71 * T, fp16=71 * T, fp8=None),
     "NVIDIA Ampere GA102 GPU architecture whitepaper, Appendix A (dense, FP32 accumulate)"),
    ("V100S", r"v100s", dict(fp32=16.4 * T, tf32=None, bf16=None, fp16=130 * T, fp8=None),
     _NVIDIA + "v100/ (datasheet, PCIe V100S)"),
    ("V100 PCIe", r"v100.*pcie", dict(fp32=14 * T, tf32=None, bf16=None, fp16=112 * T, fp8=None),
     _NVIDIA + "v100/ (datasheet)"),
    ("V100 SXM2", r"v100", dict(fp32=15.7 * T, tf32=None, bf16=None, fp16=125 * T, fp8=None),
     _NVIDIA + "v100/ (datasheet)"),
    ("T4", r"\bt4\b", dict(fp32=8.1 * T, tf32=None, bf16=None, fp16=65 * T, fp8=None),
     _NVIDIA + "tesla-t4/ (datasheet)"),
]


def flops_per_token(active_nonembed_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int,
                    *, v_head_dim: int | None = None, frozen_params: int = 0) -> int:
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


def gpu_peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of a GPU for a run's precision; None when unknown or unsupported."""
    entry = gpu_entry(device_name)
    if entry is None:
        return None
    column = PRECISION_COLUMN.get(precision, precision)
    return entry[1].get(column)


def cpu_dtype(precision: str) -> torch.dtype:
    """The matmul dtype whose CPU peak is a run's MFU denominator."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def peak_flops(dev: DeviceInfo, precision: str, *, procs: int = 1,
               cache_dir: str | Path | None = None) -> float | None:
    """The MFU denominator for one process: the GPU table, or the measured CPU matmul rate.

    `procs` is how many processes of the run share this node's CPU (its local
    ranks); on the CPU they measure at the same time, so each gets its share.
    """
    if dev.is_cuda:
        return gpu_peak_flops(dev.name, precision)
    peak = cpu_peak_flops(cpu_dtype(precision), cpu_name=dev.name, procs=procs, cache_dir=cache_dir)
    if cpu_dtype(precision) != torch.float32:
        # A CPU without native bf16 emulates it far below its fp32 rate, and autocast keeps part of the
        # work in fp32: the machine's peak is then its fp32 one (on GPUs the bf16 column is always higher).
        peak = max(peak, cpu_peak_flops(torch.float32, cpu_name=dev.name, procs=procs, cache_dir=cache_dir))
    return peak


def mfu(tokens_per_s: float | None, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilization as a fraction (0.42 = 42%), or None when the peak is unknown."""
    if peak is None or peak <= 0 or tokens_per_s is None:
        return None
    return float(tokens_per_s) * float(flops_per_token) / float(peak)


# --- CPU peak, measured -------------------------------------------------------------------

def _cpu_key(cpu_name: str, threads: int, procs: int, dtype: torch.dtype) -> str:
    return (f"{cpu_name}|threads={threads}|procs={procs}|torch={torch.__version__}|"
            f"{str(dtype).removeprefix('torch.')}")


def _cache_file(cache_dir: str | Path | None) -> Path:
    from .data import default_cache_dir              # one cache folder for tokens, tokenizers and machine facts

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
        pass                                         # a read-only home still gets an MFU, just not cached


def measure_cpu_matmul_flops(dtype: torch.dtype = torch.float32, *, budget_s: float = 0.6) -> float:
    """Best FLOP/s of a square matmul on this CPU with the current torch thread count (< ~1 s)."""
    n = 1024
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    t0 = time.perf_counter()
    torch.mm(a, b)                                  # warm-up (and a size probe)
    first = time.perf_counter() - t0
    if first > budget_s / 4:                        # slow dtype on this CPU (e.g. bf16 without AMX)
        n = 512
        a, b = a[:n, :n].contiguous(), b[:n, :n].contiguous()
    best = 0.0
    deadline = time.perf_counter() + budget_s
    reps = 0
    while reps < 3 or time.perf_counter() < deadline:
        t = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t
        if dt > 0:
            best = max(best, 2 * n ** 3 / dt)
        reps += 1
    return best


def cpu_peak_flops(dtype: torch.dtype = torch.float32, *, cpu_name: str | None = None,
                   threads: int | None = None, procs: int = 1, cache_dir: str | Path | None = None) -> float:
    """Measured CPU matmul peak, cached per CPU name, threads, processes, torch version and dtype."""
    threads = threads or torch.get_num_threads()
    key = _cpu_key(cpu_name or default_cpu_name(), threads, procs, dtype)
    path = _cache_file(cache_dir)
    cached = _read_table(path).get(key)
    if isinstance(cached, (int, float)) and cached > 0:
        return float(cached)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        peak = measure_cpu_matmul_flops(dtype)
    finally:
        torch.set_num_threads(previous)
    table = _read_table(path)                        # re-read: another rank may have written meanwhile
    table[key] = peak
    _write_table(path, table)
    return peak


def forget_cpu_peak(dtype: torch.dtype = torch.float32, *, cpu_name: str | None = None,
                    threads: int | None = None, procs: int = 1, cache_dir: str | Path | None = None) -> bool:
    """Drop a cached CPU peak that proved too low, so the next run measures again. True if one was dropped."""
    key = _cpu_key(cpu_name or default_cpu_name(), threads or torch.get_num_threads(), procs, dtype)
    path = _cache_file(cache_dir)
    table = _read_table(path)
    if table.pop(key, None) is None:
        return False
    _write_table(path, table)
    return True
