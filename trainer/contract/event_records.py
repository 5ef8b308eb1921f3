"""The records nested inside events (a device's readings, the model, the estimate, the tuner's measurement and
best, a profile's phases): validated like events, their unknown keys kept in `extra`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config_schema import Toggles
from .event_codec import CODEC
from .states import TrialKind


@dataclass(frozen=True, kw_only=True)
class Record:
    """A nested part of an event (a device reading, the model description): validated like an event,
    with its unknown keys kept in `extra`."""

    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        CODEC.validate(self)


# a record writes every field, null for what the device cannot tell
CODEC.struct(Record)


@dataclass(frozen=True, kw_only=True)
class GpuReading(Record):
    """One GPU at one instant. None: the device or driver cannot tell (rendered "n/a")."""

    index: int  # NVML index (not CUDA's, which CUDA_VISIBLE_DEVICES renumbers)
    name: str | None = None
    util_pct: float | None = None  # % of the last sample period with a kernel running
    mem_used: int | None = None  # bytes, whole device
    mem_total: int | None = None  # bytes
    power_w: float | None = None
    power_limit_w: float | None = None  # enforced limit
    energy_j: float | None = None  # NVML total energy counter (since driver load); only differences mean anything
    temp_c: float | None = None
    sm_clock_mhz: float | None = None
    proc_mem: int | None = None  # bytes used on this GPU by the trainer's processes; None when none are seen
    # compute processes on this GPU that are not the trainer's; None when NVML's PIDs cannot be told apart
    # from the trainer's (a container's PID namespace)
    other_procs: int | None = None
    sm_clock_max_mhz: float | None = None
    clock_reasons: list[str] | None = None  # why clocks are held down (gptop.nvml.THROTTLE_REASONS names)
    sm_active_pct: float | None = None  # GPM (Hopper+): share of SMs busy over the sample period
    tensor_active_pct: float | None = None  # GPM (Hopper+): share of time the tensor pipes were busy
    power_note: str | None = None  # why power_w is None, in a few words
    uuid: str | None = None  # NVML's UUID ("GPU-..."): with pci_bus_id, which GPU a run's is (gpu_key)
    pci_bus_id: str | None = None  # NVML's PCI bus id ("00000000:17:00.0")
    ecc_uncorrected: int | None = None  # volatile uncorrected ECC errors since the driver loaded (None: no ECC)
    xids: list[int] | None = None  # critical Xid errors the driver reported since the previous sample
    lost: bool | None = None  # True: NVML says the GPU is lost (fell off the bus), nothing more is read


@dataclass(frozen=True, kw_only=True)
class CpuReading(Record):
    """The host at one instant; present in GPU mode too (data loading lives here)."""

    name: str | None = None
    util_pct: float | None = None  # whole machine, 0..100
    per_core: list[float] = field(default_factory=list)  # 0..100 per logical CPU
    mem_used: int | None = None  # bytes, total - available
    mem_total: int | None = None  # bytes
    proc_rss: int | None = None  # bytes, trainer processes and their children
    proc_cpu_pct: float | None = None  # trainer processes' share of the whole machine, 0..100
    others_cpu_pct: float | None = None  # every other process's (not the trainer's, not gptop's), 0..100
    steal_pct: float | None = None  # CPU time the hypervisor gave other guests, % of the machine (Linux)
    load_avg: float | None = None  # the 1-minute load average (runnable processes, the run's included)
    power_w: float | None = None  # CPU package power from RAPL, None when unreadable
    energy_j: float | None = None  # RAPL package energy since the sampler started (wraparound undone)
    power_note: str | None = None  # why power_w is None, in a few words


@dataclass(frozen=True, kw_only=True)
class ModelInfo(Record):
    """The model a hello event describes."""

    family: str | None = None
    size: str | None = None
    total_params: int | None = None
    active_params: int | None = None  # per token (MoE: shared + top-k routed experts + dense parts)
    embedding_params: int | None = None
    trainable_params: int | None = None  # parameters that train (LoRA: the adapters; full fine-tuning: all)
    vocab_size: int | None = None
    flops_per_token: int | None = None  # training FLOPs per token (fwd + bwd)
    objective: str | None = None  # "causal" | "llada"


@dataclass(frozen=True, kw_only=True)
class EstimateInfo(Record):
    """What the early hello says one process will need, before anything is built
    (trainer.contract.estimate.Estimate.to_info): bytes and seconds."""

    params: int | None = None
    active_params: int | None = None
    flops_per_token: int | None = None
    state_bytes: int | None = None  # weights + gradients + optimizer state
    optimizer_bytes: int | None = None  # the optimizer state alone (part of state_bytes)
    activation_bytes: int | None = None
    runtime_bytes: int | None = None
    total_bytes: int | None = None
    capacity_bytes: int | None = None  # usable bytes of the device (RAM on the CPU); None: unknown
    micro_batch: int | None = None
    step_s: float | None = None  # None without a peak to time against
    assumed_mfu: float | None = None  # the MFU the step time assumes


@dataclass(frozen=True, kw_only=True)
class MeasureProgress(Record):
    """How far the tuner's measurement of the running configuration is (a tuner event's `measure`)."""

    kind: TrialKind
    number: int | None = None  # the trial's number (None: a baseline not yet recorded)
    steps: int = 0  # step samples seen, warm-up included
    samples: int = 0  # samples the estimate uses (after warm-up)
    needed: int = 0  # samples a stable estimate needs at least
    warmed_up: bool = False
    tokens_per_s: float | None = None  # the current estimate (median)
    spread: float | None = None  # its confidence half-width, tokens/s
    target: float | None = None  # the relative half-width that counts as stable (0.03: +-3%)
    seconds: float | None = None  # measured so far
    max_seconds: float | None = None  # when it stops measuring even if still noisy


@dataclass(frozen=True, kw_only=True)
class OpTime(Record):
    """An operator (CPU) or kernel (GPU) in a profile summary: its self time over the window and its share."""

    name: str
    ms: float  # self time summed over the window's steps
    share: float  # of its phase's time (ops) or of the phase's GPU time (kernels), 0..1
    calls: int = 0


@dataclass(frozen=True, kw_only=True)
class PhaseProfile(Record):
    """One step phase of a profile window: its time and where it went."""

    phase: str  # one of trainer.contract.events.PHASES
    ms: float  # wall time of the phase, summed over the window's steps
    ops: list[OpTime] = field(default_factory=list)  # top CPU operators by self time
    op_share: float = 0.0  # share of the phase inside any operator (the rest: Python, waiting)
    kernels: list[OpTime] = field(default_factory=list)  # top GPU kernels launched in the phase (CUDA)
    gpu_ms: float | None = None  # GPU time of the kernels launched in the phase (CUDA)


@dataclass(frozen=True, kw_only=True)
class TunerBest(Record):
    """The tuner's best so far (a tuner event's `best`): the trial its decision and report would name."""

    number: int | None = None
    toggles: Toggles | None = None
    tokens_per_s: float | None = None  # as measured (on this run, or on the earlier run it comes from)
    spread: float | None = None
    speedup: float | None = None  # against the start's measurement of the same run under the same load
    speedup_lo: float | None = None  # the speed-up's interval: its lower end over the start's upper end
    speedup_hi: float | None = None  # ... its upper end over the start's lower end
    earlier: bool = False  # measured by an earlier run of the same setup, not re-measured on this one


RECORDS: tuple[type[Record], ...] = (
    GpuReading,
    CpuReading,
    ModelInfo,
    EstimateInfo,
    MeasureProgress,
    OpTime,
    PhaseProfile,
    TunerBest,
)
