"""The one event schema shared by the trainer, gptop and the tuner.

Events are JSON objects, one per line. Every event has `v` (schema version),
`type`, `time` (unix seconds) and `rank`. Each type is one frozen dataclass
below (`StepEvent`, `DeviceEvent`, ...), the records nested in them (`GpuReading`, `ModelInfo`, ...) are
in trainer.contract.event_records, and this module is the only place that turns them into JSON lines
(`dumps`) and back (`parse`), through the codec of trainer.contract.event_codec, which derives each
field's check from its annotation:

- Parsing validates once, at the boundary: the JSON, the required fields and
  every field's type (numbers finite or None, ints as ints, nested mappings and
  lists of the declared shape). A line that fails raises `MalformedEvent`;
  every reader counts it and skips it. Consumers then read attributes and never
  re-check what they got.
- Fields this version does not know are kept in `extra` (and written back by
  `dumps`), so a newer producer's events survive a round trip through an older
  gptop; an event of an unknown type parses into `UnknownEvent`, which
  consumers ignore.
- Producers build the typed events: gptop and the tuner construct the classes,
  the trainer calls `make("step", **fields)` (through its channel), which
  validates the same way. A float that is not finite becomes None where the
  field allows None (JSON has no NaN).

The wire names are an interface: a field is added with a default (old lines
still parse), never renamed or removed without a schema version bump. To add
an event type, add a class with its `type` and list it in `EVENT_TYPES`; to add
a field, declare it (with a default) on its class. Either way a producer must
set every declared field by name: tests/test_event_contract.py scans the
producers' source and fails on a field nobody writes. Every name of the
records' module is importable from here too. Events are frozen; treat their
lists and mappings as read-only too.
"""

from __future__ import annotations

import functools
import json
import math
import time as _time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

from .codec import Form
from .client import PLAIN_PYTORCH
from .config_schema import Toggles, section_as_reported
from .device import DeviceInfo
from .event_codec import CODEC, MalformedEvent
from .event_records import (
    RECORDS as RECORDS,
    CpuReading,
    EstimateInfo,
    GpuReading,
    MeasureProgress,
    ModelInfo,
    OpTime as OpTime,
    PhaseProfile,
    Record,
    TunerBest,
)
from .states import (
    AlertKind as AlertKind,
    CompileWarning as CompileWarning,
    RunStatus,
    Severity as Severity,
    StoppedBy,
    TrialKind,
    TrialStatus,
    TunerPhase,
)

SCHEMA_VERSION = 1

PHASES = ("data", "forward", "backward", "optimizer", "other")


# --------------------------------------------------------------------------- events


@dataclass(frozen=True, kw_only=True)
class Event:
    """What every event has. `type` is the class's wire name; `extra` keeps fields this version does not know."""

    type: ClassVar[str] = ""
    v: int = SCHEMA_VERSION
    time: float = field(default_factory=_time.time)
    rank: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        CODEC.validate(self)


# `v` and `type` lead every line; an optional field left at None is not written (as producers always did)
CODEC.struct(Event, Form(first=("v", "type"), omit_none=True, label="type", noun="event"))


@dataclass(frozen=True, kw_only=True)
class HelloEvent(Event):
    """A trainer process started: its configuration, device and model (rank 0)."""

    type: ClassVar[str] = "hello"
    config: dict[str, dict[str, Any]]  # TrainConfig.to_dict()
    device: DeviceInfo
    model: ModelInfo
    pid: int | None = None
    world_size: int = 1
    parallel: str | None = None
    data: dict[str, Any] | None = None  # train_tokens, val_tokens, fingerprint
    accumulation: int | None = None
    micro_batch: int | None = None
    tokens_per_step: int | None = None
    peak_flops: float | None = None  # the MFU denominator per process, FLOP/s
    peak_source: str | None = None  # "datasheet: <GPU> ..." or "measured: ..." (MFU is then approximate)
    resumed_from: str | None = None
    start_step: int = 0
    # The count of `tokens` this process's events start from at start_step: the run's count where the process
    # restored it (gptop's trainer), else its own (a client: start_step x tokens per step, or 0). Readers
    # continue the run's count from it (gptop.state.counts). None: not said (an older producer).
    start_tokens: int | None = None
    torch: str | None = None
    # The first hello comes before anything is built (early=True): the config, the device, the model as
    # configured and what it will cost (EstimateInfo: bytes, seconds); the full
    # hello follows once the model is built. Consumers that need the built run (micro-batch, parameters)
    # wait for a hello that is not early.
    early: bool = False
    estimate: EstimateInfo | None = None
    # trainer.contract.device.gpu_key of every GPU this node's ranks train on: which NVML devices are the run's
    # (energy per token counts those, not idle neighbours), also where a container hides the PIDs.
    gpus: list[str] | None = None
    # Options given as auto (size, micro_batch, precision): the config holds what each became, so views can
    # say "precision auto -> bf16".
    auto: list[str] = field(default_factory=list)
    # A process gptop did not build (`gptop run -- CMD`): the integration speaking for it
    # (trainer.contract.client.ClientKind) and, on the hello gptop records when it starts CMD, the command.
    # None on gptop's own trainer.
    client: str | None = None
    command: list[str] | None = None
    # What a client can take from `gptop tune -- CMD` (trainer.contract.training_args.tunable): the toggles
    # it can change through its script's arguments. None: it takes no toggles (gptop's own trainer takes them
    # all through its config; a probe or Lightning client none).
    tunable: list[str] | None = None

    @functools.cached_property
    def toggles(self) -> Toggles | None:
        """The toggles this process runs with, decoded once; None where its hello reports none (gptop's record
        of a command's start, before its client's hello). What it did not report is what it ran at:
        `Toggles()`'s for gptop's own trainer (an older trainer names fewer), PyTorch's own for a client's
        program (trainer.contract.client.PLAIN_PYTORCH)."""
        reported = self.config.get("toggles")
        if reported is None:
            return None
        return section_as_reported(PLAIN_PYTORCH if self.client is not None else Toggles(), reported)

    @property
    def reported_toggles(self) -> dict[str, Any]:
        """The toggles as the process reported them (a client's program: only what it knows), for a record."""
        return dict(self.config.get("toggles") or {})

    @property
    def mfu_is_estimate(self) -> bool:
        """MFU rests on a measured peak (the CPU), not a datasheet's: views show it as approximate ("~")."""
        if self.peak_source is not None:
            return self.peak_source.startswith("measured")
        return self.device.type == "cpu"

    @property
    def max_steps(self) -> int | None:
        """The step the run ends at, as the process reported it (None: not said, e.g. a script without one)."""
        return self._reported_int("optim", "max_steps")

    @property
    def log_every(self) -> int | None:
        """The interval of the process's step events (None: not said)."""
        return self._reported_int("log", "log_every")

    @property
    def checkpoint_every(self) -> int | None:
        """The process's checkpoint interval in steps (None: not said; a client's program saves on its own)."""
        return self._reported_int("checkpoint", "checkpoint_every")

    def _reported_int(self, section: str, key: str) -> int | None:
        # `config` is what the process reported (a client's program sends a few sections): the one place its
        # numbers are read and checked, so no consumer re-checks them
        v = (self.config.get(section) or {}).get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else None


@dataclass(frozen=True, kw_only=True)
class StepEvent(Event):
    """One log interval of training, per rank. Times are means over the interval's steps."""

    type: ClassVar[str] = "step"
    step: int
    tokens: int  # cumulative, global: this process's count, from its hello's start_tokens
    loss: float | None
    lr: float | None
    grad_norm: float | None
    step_ms: float | None
    phases_ms: dict[str, float | None] | None
    tokens_per_s: float | None
    mfu: float | None
    mem_bytes: int | None
    interval_steps: int | None = None
    wall_ms: float | None = None
    batch: int | None = None  # global batch index of the last step (data-order checks)
    gpu_idle_ms: float | None = None
    comm_ms: float | None = None
    expert_load: list[list[float]] | None = None  # MoE: per layer, per expert share of the tokens
    optim_state_bytes: int | None = None  # bytes the optimizer state occupies (quantized moments: as stored)


@dataclass(frozen=True, kw_only=True)
class ProgressEvent(Event):
    """One optimizer step done (every step, between the log interval's step events): the step counter, rate
    and ETA move with it. Light: no loss and no device synchronization, so on a GPU `step_ms` is the host's
    time between step boundaries. Sent on the live channel only, never written to events.jsonl."""

    type: ClassVar[str] = "progress"
    step: int
    tokens: int  # cumulative, global
    step_ms: float | None = None


# Startup phases a PhaseEvent names, in the order they come (a phase may be skipped).
STARTUP_PHASES = ("tokenizing", "building", "loading", "probing", "compiling")


@dataclass(frozen=True, kw_only=True)
class PhaseEvent(Event):
    """A startup phase began or moved (tokenizing 40%): what the run is doing before its first step."""

    type: ClassVar[str] = "phase"
    phase: str  # one of STARTUP_PHASES (newer trainers may add phases)
    message: str  # in words: "probing micro-batch 4"
    pct: float | None = None  # progress of the phase, 0..100, when known


@dataclass(frozen=True, kw_only=True)
class EvalEvent(Event):
    type: ClassVar[str] = "eval"
    step: int
    loss: float | None
    seconds: float | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointEvent(Event):
    type: ClassVar[str] = "checkpoint"
    step: int
    path: str
    seconds: float | None
    reason: str | None = None
    tokens: int | None = None


@dataclass(frozen=True, kw_only=True)
class LogEvent(Event):
    """A line for the log panel (the trainer's profiler, the tuner's decisions and rollbacks)."""

    type: ClassVar[str] = "log"
    message: str
    source: str | None = None
    path: str | None = None
    study: str | None = None
    decision: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class WarningEvent(Event):
    type: ClassVar[str] = "warning"
    message: str
    kind: str | None = None  # a WarningKind or a CompileWarning (a newer trainer may send others)
    step: int | None = None
    batch: int | None = None
    skip_batches: list[int] | None = None
    lr_scale: float | None = None


@dataclass(frozen=True, kw_only=True)
class ErrorEvent(Event):
    type: ClassVar[str] = "error"
    kind: str  # an ErrorKind (newer trainers may add kinds)
    message: str
    step: int | None = None
    exit_code: int | None = None
    toggles: dict[str, Any] | None = None  # oom: what ran out of memory
    memory: dict[str, Any] | None = None
    lost_peer: bool = False  # several ranks: this rank lost contact with another
    path: str | None = None  # disk: the file a write failed on
    os_error: str | None = None  # disk: the errno text ("No space left on device", "Read-only file system")
    free_bytes: int | None = None  # disk: bytes free on that filesystem when it failed


# What a `done` event's reason may say besides the stop's own words (trainer.commands): the ends a reader
# tells apart. A tuner's restart is a trainer's end, not the run's: another start follows it.
MAX_STEPS = "max_steps"
STOPPED_BEFORE_FIRST_STEP = "stopped before the first step"
TUNER_RESTART = "restart by the tuner"


@dataclass(frozen=True, kw_only=True)
class DoneEvent(Event):
    type: ClassVar[str] = "done"
    step: int
    tokens: int
    seconds: float | None = None
    reason: str | None = None  # "max_steps" or why it stopped
    checkpoint: str | None = None


EXIT_STDERR_LINES = 20  # the most stderr lines an `exit` event keeps of a failed process


@dataclass(frozen=True, kw_only=True)
class ExitEvent(Event):
    """A process gptop supervised ended: written by gptop (never by the process) for each one it starts (its
    own trainer, each tuner restart, each --restart-on-failure start, a `gptop run` command), after the
    process's last event, so a reader always knows how the last one ended, with a client or without."""

    type: ClassVar[str] = "exit"
    pid: int | None = None
    exit_code: int | None = None  # its exit status; None when a signal ended it
    signal: int | None = None  # the signal that ended it (SIGKILL: 9)
    seconds: float | None = None  # from its start to its end
    stopped_by: StoppedBy | None = None  # who ended it; None: it ended by itself
    stderr: list[str] | None = None  # a failure's last stderr lines (at most EXIT_STDERR_LINES)

    @property
    def failed(self) -> bool:
        """It ended by itself, and not cleanly: a non-zero exit, or a signal from outside gptop."""
        return self.stopped_by is None and self.exit_code != 0


@dataclass(frozen=True, kw_only=True)
class DeviceEvent(Event):
    """A device sample (gptop's telemetry): every GPU, and the host."""

    type: ClassVar[str] = "device"
    devices: list[GpuReading]
    cpu: CpuReading | None = None
    mode: str | None = None  # "gpu" or "cpu"


@dataclass(frozen=True, kw_only=True)
class TrialEvent(Event):
    """A tuning trial started (status running) or ended; a remeasure updates its trial's row."""

    type: ClassVar[str] = "trial"
    number: int | None
    toggles: Toggles
    status: TrialStatus
    tokens_per_s: float | None = None
    spread: float | None = None  # tokens/s
    peak_mem: int | None = None
    energy_per_token: float | None = None
    reason: str | None = None
    kind: TrialKind | None = None
    source: str | None = None
    duration_s: float | None = None
    remeasure_tokens_per_s: float | None = None
    remeasure_spread: float | None = None
    rollback: dict[str, Any] | None = None
    earlier: bool = False  # the trial ran in an earlier run of the same setup (a re-measurement)
    advice: str | None = None  # source advice: the evidence of the advice it tries (gptop.advice)
    # CompileWarning kind -> how many came during the trial; None: none came
    compile: dict[str, int] | None = None
    unsteady: bool = False  # its compile kept recompiling: never applied however fast it measured


@dataclass(frozen=True, kw_only=True)
class ApplyEvent(Event):
    type: ClassVar[str] = "apply"
    toggles: Toggles
    decision: dict[str, Any] | None = None
    number: int | None = None
    tokens_per_s: float | None = None
    baseline_tokens_per_s: float | None = None
    step: int | None = None
    earlier: bool = False  # the applied trial ran in an earlier run of the same setup
    # the claim: its speed-up over the start under the same load, with the interval counting both measurements
    speedup: float | None = None
    speedup_lo: float | None = None
    speedup_hi: float | None = None


@dataclass(frozen=True, kw_only=True)
class TunerEvent(Event):
    type: ClassVar[str] = "tuner"
    phase: TunerPhase
    budget_left_s: float | None = None
    trial: int | None = None
    trials_run: int | None = None
    trials_planned: int | None = None
    study: str | None = None
    outcome: str | None = None  # phase done: the decision, or why tuning ended
    applied: bool | None = None
    measure: MeasureProgress | None = None  # while a configuration is measured
    budget_s: float | None = None  # the budget in effect: the one asked for, or the share the run affords
    best: TunerBest | None = None  # the best so far, as the decision and the report see it


@dataclass(frozen=True, kw_only=True)
class ProfileEvent(Event):
    """A torch.profiler window was captured and summarized where it ran (trainer.profile_summary): per phase
    the top operators and kernels, and the signs of a launch-bound or host-bound step."""

    type: ClassVar[str] = "profile"
    first: int  # the window's steps, numbered from 1
    last: int
    path: str  # the Chrome trace
    summary_path: str | None = None  # this summary as JSON, next to the trace
    step_ms: float  # mean wall time of a step in the window
    phases: list[PhaseProfile] = field(default_factory=list)
    # share of the steps' time spent in operators (CPU) or kernels (GPU) shorter than SHORT_OP_US: launch-bound
    short_op_share: float | None = None
    short_kernel_share: float | None = None
    gpu_idle_share: float | None = None  # CUDA: share of the step the GPU ran no kernel ...
    gpu_idle_host_share: float | None = None  # ... of it while the host was in a compute phase (launching)
    comm_overlap: float | None = None  # several ranks on CUDA: share of NCCL kernel time overlapping compute


@dataclass(frozen=True, kw_only=True)
class StatusEvent(Event):
    """The session's status (starting, running, done, failed, ...): gptop's --json output. In events.jsonl only
    when a stop ended the run between two processes (the last `exit` is the tuner's restart; `stopped_by`: whose
    stop it was), so that a reader knows who ended the run."""

    type: ClassVar[str] = "status"
    status: RunStatus
    message: str | None = None
    stopped_by: StoppedBy | None = None


@dataclass(frozen=True, kw_only=True)
class AlertEvent(Event):
    """Something went wrong with a run (gptop.alerts), or stopped going wrong (`resolved`, same `id`).

    `figures` are the numbers behind it (seconds without progress, the median it was judged against, ...);
    `ranks` and `node`/`device` say where it applies when it is not the whole run."""

    type: ClassVar[str] = "alert"
    id: str  # one alert's raise and its resolution share it
    kind: AlertKind
    severity: Severity
    message: str
    resolved: bool = False
    step: int | None = None  # the run's latest step when it was raised (or resolved)
    figures: dict[str, Any] = field(default_factory=dict)
    ranks: list[int] | None = None  # the ranks it concerns (a stall: the ranks behind)
    node: str | None = None  # the node whose device it concerns
    device: str | None = None  # "gpu0": the device it concerns


@dataclass(frozen=True, kw_only=True)
class UnknownEvent(Event):
    """An event of a type this version does not know (a newer producer): kept, ignored by consumers."""

    type: str  # type: ignore[misc]


EVENT_TYPES: dict[str, type[Event]] = {
    c.type: c
    for c in (
        HelloEvent,
        StepEvent,
        EvalEvent,
        CheckpointEvent,
        LogEvent,
        WarningEvent,
        ErrorEvent,
        DoneEvent,
        ExitEvent,
        DeviceEvent,
        TrialEvent,
        ApplyEvent,
        TunerEvent,
        StatusEvent,
        ProgressEvent,
        PhaseEvent,
        ProfileEvent,
        AlertEvent,
    )
}
_BASE = ("v", "type", "time", "rank")


# --------------------------------------------------------------------------- producing and writing


def make(type: str, **fields: Any) -> Event:
    """Build the event `type` from fields by name (the trainer's channel). Raises MalformedEvent (a
    ValueError) for a wrong type or an undeclared field: a producer bug, caught by the tests."""
    cls = EVENT_TYPES.get(type)
    if cls is None:
        raise MalformedEvent(f"unknown event type {type!r}; declare it in trainer.contract.events")
    spec = CODEC.spec(cls)
    unknown = [k for k in fields if k not in spec.names]
    if unknown:
        raise MalformedEvent(
            f"{type} event has no field {', '.join(map(repr, unknown))}; declare it in "
            f"trainer.contract.events.{cls.__name__}"
        )
    missing = [k for k in spec.required if k not in fields]
    if missing:
        raise MalformedEvent(f"{type} event missing {', '.join(missing)}")
    return cls(**fields)


def to_dict(event: Event | Record) -> dict[str, Any]:
    """The wire form of an event: plain JSON-able values, `extra` merged back in. An event's optional
    field that is None is left out (absent and null mean the same to a reader)."""
    return CODEC.encode(event)


def json_safe(obj: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite floats become null, so every line parses everywhere."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def finite_or_none(x: Any, scale: float = 1.0) -> float | None:
    """`x * scale` as a finite float, or None (a driver's or a statistic's value that cannot be a number)."""
    if x is None or isinstance(x, bool):
        return None
    try:
        f = float(x) * scale
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def dumps(event: Event) -> str:
    """One JSON line (without the newline). Validated fields are already finite; free-form mappings
    (`config`, `extra`, ...) are made JSON-safe only when they need it."""
    d = CODEC.encode(event)
    try:
        return json.dumps(d, separators=(",", ":"), allow_nan=False, default=str)
    except ValueError:
        return json.dumps(json_safe(d), separators=(",", ":"), allow_nan=False, default=str)


# --------------------------------------------------------------------------- parsing and reading


def parse(line: str | bytes) -> Event:
    """Parse and validate one line. Raises MalformedEvent; an unknown type gives an UnknownEvent."""
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        raise MalformedEvent(f"not JSON: {e}") from None
    return from_dict(obj)


def from_dict(obj: Any) -> Event:
    """Validate a decoded JSON object into its event class (see `parse`)."""
    if not isinstance(obj, dict):
        raise MalformedEvent("not a JSON object")
    for key in _BASE:
        if key not in obj:
            raise MalformedEvent(f"missing {key!r}")
    v, kind = obj["v"], obj["type"]
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= SCHEMA_VERSION:
        raise MalformedEvent(f"unsupported schema version {v!r}")
    if not isinstance(kind, str):
        raise MalformedEvent(f"'type' is {type(kind).__name__}, not a string")
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        return UnknownEvent(
            type=kind, v=v, time=obj["time"], rank=obj["rank"], extra={k: x for k, x in obj.items() if k not in _BASE}
        )
    return CODEC.decode(cls, obj)


def read_events(
    path: str | Path, *, strict: bool = False, on_malformed: Callable[[bytes, MalformedEvent], None] | None = None
) -> Iterator[Event]:
    """Events of a JSONL file. A malformed line is skipped (and passed to `on_malformed`, to be
    counted), or raised with `strict`."""
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield parse(line)
            except MalformedEvent as e:
                if strict:
                    raise
                if on_malformed is not None:
                    on_malformed(line.rstrip(b"\r\n"), e)
