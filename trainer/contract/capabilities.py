"""Which toggle values the device supports, and why not when it does not.

The trainer refuses an unsupported value asked for explicitly (never a silent
fallback), and the tuner offers only supported values. Both ask here.

`--optimizer` (torchao's low-bit AdamW compiles its update with torch.compile) and `--quantize-base`
(bitsandbytes' 4-bit and 8-bit layers, CUDA only here) are toggles gated the same way: whether they run
depends on the device and the installed libraries.

A value can also be supported but *slow* on a device: it runs correctly, yet
is known to lose against the default by a wide margin (bf16 on a CPU whose
oneDNN has no bf16 kernels is 30-100x slower at matmuls than fp32: bench/bf16_matmul.py). Asked for
explicitly it runs, with a warning; the tuner leaves it out of its default
space (a trial would spend the budget on one step) unless `--tune-space`
names it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Sequence

from .common import ConfigError, flag_of
from .config_schema import (
    ATTENTIONS,
    ALLOCATORS,
    AUTO,
    COMPILE_MODES,
    OPTIMIZERS,
    PRECISIONS,
    QUANTIZE_BASE,
    Toggles,
    TrainConfig,
)
from .device import DeviceInfo
from .common import FAMILIES as SIZED_FAMILIES
from .estimate import state_bytes
from .model_shapes import SIZE_ORDER

# Enumerated toggles and their values; numeric ones (micro_batch, prefetch, workers) are always supported.
CHOICES: dict[str, tuple] = {
    "precision": PRECISIONS,
    "compile": COMPILE_MODES,
    "attention": ATTENTIONS,
    "cuda_allocator": ALLOCATORS,
    "fused_adamw": (False, True),
    "activation_checkpointing": (False, True),
    "optimizer": OPTIMIZERS,
    "quantize_base": QUANTIZE_BASE,
}


# Bytes per activation element under each precision (the fp8 recipes keep bf16 activations between matmuls):
# a narrower precision fits about twice the micro-batch in the same memory.
ACTIVATION_BYTES: dict[str, int] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8-tensorwise": 2, "fp8-rowwise": 2}


def activation_bytes(precision: str) -> int:
    return ACTIVATION_BYTES.get(precision, 4)


def auto_precision(dev: DeviceInfo) -> str:
    """What `--precision auto` (the default) runs with on `dev`: bf16 autocast where the device multiplies bf16
    natively (CUDA compute capability 8.0+, where the fp32 matmuls left outside autocast also use TF32; a CPU
    with AVX512_BF16, AMX or Arm BF16, whose oneDNN has bf16 kernels), else fp32 (a V100's bf16 is emulated and
    fp16 needs a loss scaler; an AVX2 CPU emulates bf16 30-100x slower than fp32)."""
    if dev.is_cuda:
        return "bf16" if dev.at_least(8, 0) else "fp32"
    return "bf16" if dev.cpu_bf16 and dev.cpu_bf16_native is True else "fp32"


def resolve_precision(value: str, dev: DeviceInfo) -> str:
    """`value` with auto resolved for `dev` (any other value is kept as given)."""
    return auto_precision(dev) if value == AUTO else value


def recipe(base: Toggles, dev: DeviceInfo, precisions: Sequence[str]) -> Toggles:
    """A known-good starting point on `dev` (the tuner's first guess after the baseline), from `base` with
    the precision chosen among `precisions` (the ones a search may use). The caller sets the micro-batch."""
    t = dataclasses.replace(base)
    if dev.is_cuda:
        t.precision = "bf16" if dev.at_least(8, 0) else ("fp16" if "fp16" in precisions else "fp32")
        t.compile = "default"
    else:
        t.precision = auto_precision(dev) if auto_precision(dev) in precisions else "fp32"
        # and no compile: on a CPU inductor's C++ build takes minutes for a gain the sampler can still find
    t.fused_adamw = True
    t.activation_checkpointing = False
    t.attention = "sdpa"
    t.prefetch = 2
    return t


def _torchao_float8() -> bool:
    return importlib.util.find_spec("torchao") is not None


def _installed(module: str) -> bool:
    """Importable, without importing it (this module stays torch-free and fast)."""
    return importlib.util.find_spec(module) is not None


# The first torch release whose rowwise-scaled fp8 matmul (torch._scaled_mm with a scale per row, what torchao's
# fp8-rowwise recipe calls) has a kernel for each compute capability. Hopper's CUTLASS kernel came first (every
# torch pyproject.toml allows); Ada's (sm89) was added in January 2025 (pytorch#144348, #145676), for 2.7;
# datacenter Blackwell's (sm100) in March 2025 (pytorch#148421), in 2.8 (2.7 not confirmed). Other capabilities
# have none (consumer Blackwell, sm120: cuBLASLt refuses per-row scales there, pytorch#192707).
ROWWISE_FP8_TORCH: dict[tuple[int, int], tuple[int, int]] = {(8, 9): (2, 7), (9, 0): (2, 5), (10, 0): (2, 8)}
TORCH_MIN = (2, 5)  # pyproject.toml's torch>=2.5: a device whose torch is not said has at least this


def _rowwise_fp8(dev: DeviceInfo) -> str | None:
    """Why fp8-rowwise cannot run on `dev` with the trainer's torch, or None (see ROWWISE_FP8_TORCH)."""
    cc = dev.capability or (0, 0)
    need = ROWWISE_FP8_TORCH.get((cc[0], cc[1]))
    arch = ".".join(map(str, cc))
    if need is None:
        return (
            f"no torch release has a rowwise-scaled fp8 matmul for compute capability {arch}; use --precision "
            f"fp8-tensorwise"
        )
    if not dev.torch_at_least(*need) and not (need <= TORCH_MIN and dev.torch_version is None):
        have = f"torch {dev.torch_version}" if dev.torch_version else "a torch whose version is not known"
        return (
            f"the rowwise-scaled fp8 matmul for compute capability {arch} came with torch {need[0]}.{need[1]}; "
            f"this is {have} (upgrade torch, or use --precision fp8-tensorwise)"
        )
    return None


# torch.compile modes that capture CUDA graphs (inductor's cudagraph trees).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def accumulation_of(toggles: Toggles, per_rank_batch: int | None) -> int | None:
    """Micro-batches per optimizer step for `toggles` on a rank that trains `per_rank_batch` sequences a step;
    None while the micro-batch is `auto` (known once the trainer's probe chose it) or the batch is unknown."""
    mb = toggles.micro_batch_int()
    if mb is None or not per_rank_batch:
        return None
    return max(1, per_rank_batch // mb)


def support(
    name: str, value, dev: DeviceInfo, *, accumulation: int | None = None, parallel: str | None = None
) -> str | None:
    """None if `dev` supports toggle `name` = `value`, else the reason it does not.

    `accumulation`: the run's micro-batches per optimizer step, where known (None: not known yet, e.g. a
    `--micro-batch auto` run before its probe); `parallel`: how several ranks share the model (ddp, fsdp;
    None: one process). Some values depend on them."""
    if name == "precision":
        if value in ("fp32", AUTO):
            return None
        if value == "tf32":
            return None if dev.at_least(8, 0) else "tf32 needs an NVIDIA GPU with compute capability 8.0 or newer"
        if value == "bf16":
            if dev.is_cuda and not dev.at_least(8, 0):
                return "bf16 needs compute capability 8.0 or newer"
            return None
        if value == "fp16":
            return None if dev.is_cuda else "fp16 autocast is for CUDA; on the CPU use bf16"
        if value.startswith("fp8"):
            if not dev.is_cuda or not dev.at_least(8, 9):
                return "fp8 needs an NVIDIA GPU with compute capability 8.9 or newer (Ada, Hopper)"
            if not _torchao_float8():
                return "fp8 needs torchao (pip install torchao)"
            return _rowwise_fp8(dev) if value == "fp8-rowwise" else None
    if name == "compile":
        return _compile_support(value, dev, accumulation, parallel)
    if name == "cuda_allocator":
        if value == "expandable_segments" and not dev.is_cuda:
            return "expandable_segments is a CUDA allocator setting"
        return None
    if name == "optimizer":
        if value in ("adamw-8bit", "adamw-4bit"):
            if not _installed("torchao"):
                return f"{value} is torchao's AdamW8bit/AdamW4bit: pip install torchao"
            if not dev.has_compiler:
                what = "a C++ compiler on the CPU (install g++)" if not dev.is_cuda else "triton"
                return f"torchao's {value} runs its update through torch.compile, which needs {what}"
        if value not in OPTIMIZERS:
            return f"{value!r} is not one of {OPTIMIZERS}"
        return None
    if name == "quantize_base":
        if value == "none":
            return None
        if not dev.is_cuda:
            return (
                f"a {value} base runs on bitsandbytes' CUDA kernels; on the CPU fine-tune with --lora and an "
                f"unquantized base"
            )
        if not _installed("bitsandbytes"):
            return f"a {value} base needs bitsandbytes: pip install 'gptop[qlora]'"
        if value == "nf4" and not dev.at_least(7, 5):
            return "bitsandbytes' 4-bit kernels need compute capability 7.5 or newer"
        return None
    if name in CHOICES:
        return None if value in CHOICES[name] else f"{value!r} is not one of {CHOICES[name]}"
    return None


def _compile_support(value: str, dev: DeviceInfo, accumulation: int | None, parallel: str | None) -> str | None:
    """`support` of compile mode `value` (see there)."""
    if value == "off":
        return None
    if not dev.has_compiler:
        if dev.is_cuda:
            return "torch.compile on CUDA needs triton (pip install triton) and a C compiler (install gcc)"
        return "torch.compile needs a C++ compiler on the CPU (install g++)"
    if value in CUDA_GRAPH_MODES and not dev.is_cuda:
        return f"compile mode {value} uses CUDA graphs; on the CPU use default or max-autotune-no-cudagraphs"
    if value in CUDA_GRAPH_MODES and parallel is not None:
        # Inductor's CUDA graphs do not capture NCCL collectives: DDP's gradient all-reduce hooks and FSDP2's
        # all-gathers and reduce-scatters run inside the step, between and during the compiled graphs.
        return (
            f"compile mode {value} uses CUDA graphs, which do not capture the collectives that "
            f"--parallel {parallel} runs inside each step (not verified on several GPUs): use --compile "
            f"default or max-autotune-no-cudagraphs"
        )
    if value in CUDA_GRAPH_MODES and accumulation is not None and accumulation > 1:
        # The compiled backward hands a fresh .grad the graph's own output memory, which the next
        # micro-batch's replay overwrites before it is accumulated into (pytorch#169545; older torch
        # accumulated wrong gradients silently).
        return (
            f"compile mode {value} uses CUDA graphs, which overwrite the gradients that accumulation "
            f"over {accumulation} micro-batches keeps between backwards (pytorch#169545): use "
            f"--micro-batch equal to the per-rank batch (no accumulation), or --compile default / "
            f"max-autotune-no-cudagraphs"
        )
    return None


ADAM_FAMILY = ("adamw", "adamw-8bit", "adamw-4bit")


def optimizer_switch(old: str, new: str) -> str | None:
    """What a run resumed with optimizer `new` from a checkpoint of `old` keeps of the optimizer state, in
    words (None when they are the same).

    The AdamW variants hold the same state (a step count and two moments per tensor), only stored
    differently: the moments are dequantized to fp32 and stored as the new optimizer stores them (quantized
    block-wise for torchao's 8-bit / 4-bit ones), so the switch loses only the rounding of the narrower
    format. Adafactor keeps no first moment and a second moment factored into row and column means of
    differently decayed squared gradients (and a relative step size): nothing of it means the same to AdamW
    or back, so the new optimizer starts with fresh state, the one switch that loses optimizer state. Every
    switch changes the numbers computed, so the tuner checks the loss of such a trial
    (tuner.space.NUMERICS_CHANGING)."""
    if old == new:
        return None
    if old in ADAM_FAMILY and new in ADAM_FAMILY:
        return f"the AdamW moments carry over from {old} to {new} (converted, rounded to {new}'s storage)"
    return (
        f"{old} -> {new}: the optimizer state cannot be converted (Adafactor keeps a factored second moment "
        f"and no first moment), so {new} starts with fresh state"
    )


# Optimizer state per trained parameter, about (trainer.contract.estimate counts it exactly): the order in
# which the choices save memory.
OPTIMIZER_STATE_BYTES = {"adamw": 8.0, "adamw-8bit": 2.03, "adamw-4bit": 1.06, "adafactor": 0.05}
# A frozen base's linear weights per parameter (fp32, 8-bit codes + a scale per row, nf4 codes + scales).
BASE_BYTES = {"none": 4.0, "int8": 1.0, "nf4": 0.52}


def memory_saving(name: str, value) -> list:
    """The values of toggle `name` that take less memory than `value` (what a memory-constrained tuner adds to
    its space), whether or not a device supports them."""
    if name == "activation_checkpointing":
        return [] if value else [True]
    if name == "optimizer":
        return [v for v in OPTIMIZERS if OPTIMIZER_STATE_BYTES[v] < OPTIMIZER_STATE_BYTES.get(value, 8.0)]
    if name == "quantize_base":
        return [v for v in QUANTIZE_BASE if BASE_BYTES[v] < BASE_BYTES.get(value, 4.0)]
    return []


def saves_memory(toggles: Toggles, base: Toggles) -> bool:
    """Whether `toggles` hold less state than `base` (a smaller optimizer state or a more quantized base), so a
    micro-batch that did not fit with `base` may fit."""
    return toggles.optimizer in memory_saving("optimizer", base.optimizer) or toggles.quantize_base in memory_saving(
        "quantize_base", base.quantize_base
    )


def optimizer_state_carries(old: str, new: str) -> bool:
    """Whether switching `old` -> `new` keeps the optimizer's moments (see `optimizer_switch`)."""
    return old in ADAM_FAMILY and new in ADAM_FAMILY


def slow(name: str, value, dev: DeviceInfo) -> str | None:
    """None unless `value` is supported on `dev` but known to be far slower than the default; then why."""
    if name == "precision" and value == "bf16" and not dev.is_cuda and not dev.cpu_bf16:
        return (
            "this CPU has no native bf16 (oneDNN needs AVX-512 or newer), so bf16 matmuls are emulated, "
            "30-100x slower than fp32"
        )
    if name == "optimizer" and value in ("adamw-8bit", "adamw-4bit") and not dev.is_cuda:
        return (
            f"torchao's {value} is made for GPUs: on the CPU its compiled per-tensor update made whole steps "
            f"7-12x slower than adamw (bench/finetune.py); it saves memory, not time"
        )
    return None


def worth_trying(
    name: str, value, dev: DeviceInfo | None, *, accumulation: int | None = None, parallel: str | None = None
) -> bool:
    """May a hint suggest `value`? Only on a known device that supports it (with the run's `accumulation` and
    `parallel` mode) and runs it at full speed (a gptop that has not had the trainer's hello yet suggests
    nothing device-specific)."""
    return (
        dev is not None
        and support(name, value, dev, accumulation=accumulation, parallel=parallel) is None
        and slow(name, value, dev) is None
    )


def supported_values(
    name: str, dev: DeviceInfo, *, accumulation: int | None = None, parallel: str | None = None
) -> list:
    return [v for v in CHOICES[name] if support(name, v, dev, accumulation=accumulation, parallel=parallel) is None]


def default_values(name: str, dev: DeviceInfo, parallel: str | None = None) -> list:
    """The values worth trying on `dev` (with `parallel`, support's): supported and not known to be slow."""
    return [v for v in supported_values(name, dev, parallel=parallel) if slow(name, v, dev) is None]


def slow_choices(toggles: Toggles, dev: DeviceInfo) -> list[str]:
    """'--flag value: reason' for each chosen value that runs but is known to be slow on `dev`."""
    out = []
    for f in dataclasses.fields(toggles):
        value = getattr(toggles, f.name)
        reason = slow(f.name, value, dev)
        if reason:
            out.append(f"{flag_of(f)} {value}: {reason}")
    return out


def slow_config(cfg: TrainConfig, dev: DeviceInfo) -> list[str]:
    """`slow_choices` of a run's config (every gated option is a toggle)."""
    return slow_choices(cfg.toggles, dev)


def unsupported(
    toggles: Toggles, dev: DeviceInfo, per_rank_batch: int | None = None, parallel: str | None = None
) -> tuple[str, str] | None:
    """(toggle name, reason) of the first value of `toggles` that `dev` does not support, None when all are
    (`per_rank_batch`: the sequences a rank trains per step, so the values that depend on the accumulation
    are checked where it is known; `parallel`: support's)."""
    accumulation = accumulation_of(toggles, per_rank_batch)
    for f in dataclasses.fields(toggles):
        reason = support(f.name, getattr(toggles, f.name), dev, accumulation=accumulation, parallel=parallel)
        if reason:
            return f.name, reason
    return None


def check(toggles: Toggles, dev: DeviceInfo, per_rank_batch: int | None = None, parallel: str | None = None) -> None:
    """Raise ConfigError naming the flag for the first unsupported value (see `unsupported`)."""
    found = unsupported(toggles, dev, per_rank_batch, parallel)
    if found:
        f = next(f for f in dataclasses.fields(toggles) if f.name == found[0])
        raise ConfigError(flag_of(f), f"{getattr(toggles, f.name)} is not supported on {dev.name}: {found[1]}")


def check_config(cfg: TrainConfig, dev: DeviceInfo, world_size: int = 1) -> None:
    """`check` of a run's config (every gated option is a toggle) on `world_size` ranks."""
    per_rank = cfg.optim.global_batch // world_size if world_size >= 1 else None
    check(cfg.toggles, dev, per_rank, parallel_mode(cfg, world_size))


def parallel_mode(cfg: TrainConfig, world_size: int) -> str | None:
    """How the run's ranks share the model (`--parallel`), None for one process (which ignores it)."""
    return cfg.run.parallel if world_size > 1 else None


# --- which model size `--size auto` picks ---------------------------------------------------------

# The persistent training state (weights, gradients, optimizer state) comes from trainer.contract.estimate (counted from the dimensions, no model built): the rule
# runs where torch is not imported (gptop names a run directory by the size before the trainer starts).
# `auto` keeps that state under STATE_MEMORY_SHARE of device memory (the rest is for activations, the logits,
# allocator slack and the CUDA context).
STATE_MEMORY_SHARE = 0.6
_GiB = 1 << 30


def auto_size(family: str, dev: DeviceInfo, **state_options: Any) -> str:
    """The size `--size auto` picks: the largest that fits and makes progress.

    - CPU: ``tiny``, or ``small`` on a big CPU (32+ cores and 64+ GiB RAM); anything larger makes too
      little progress per minute to watch.
    - CUDA, by total device memory: under 12 GiB ``small``, under 40 GiB ``medium``, else ``large``. Then
      step down while the persistent training state of the family's *total* parameters would exceed 60%
      of the memory, which keeps the MoE family (2.5-3.5x more total than active parameters) one size
      smaller on mid-size GPUs. The state is the run's own (`state_options`: optimizer, lora,
      lora_targets, quantize_base as `estimate.run_options` reads them from the config): a low-bit
      optimizer or LoRA keeps a size that full AdamW training would step down from.
    """
    family = family if family in SIZED_FAMILIES else "llama"
    if not dev.is_cuda:
        return "small" if dev.cpu_count >= 32 and dev.total_memory >= 64 * _GiB else "tiny"
    mem = dev.total_memory
    choice = "small" if mem < 12 * _GiB else "medium" if mem < 40 * _GiB else "large"
    i = SIZE_ORDER.index(choice)
    while i > 0 and state_bytes(family, SIZE_ORDER[i], **state_options) > STATE_MEMORY_SHARE * mem:
        i -= 1
    return SIZE_ORDER[i]
