"""`gptop doctor`: the device paths gptop relies on, and the record a run of the doctor produces (torch-free).

`PATHS` is the one list of paths. Each names the function that exercises it, in the module that owns the
path (`owner`, "module:function": the timer checks the timer, the NVML wrapper checks NVML), so the doctor
is a list of calls, not a second implementation. Functions in `trainer.*` run in a child process each (they
need torch, and a CUDA error must not poison the next check); those in `gptop.*` run in gptop (NVML, RAPL).
A trainer-side check is called as `fn(dev, quick, **args)` with the detected `DeviceInfo` and returns an
`Outcome`; it skips (SKIP, with the reason) where the capability rules (trainer.contract.capabilities, the
same the CLI and the tuner use) or the installed libraries rule the path out.

The record (`--json`) is `DoctorReport.to_dict()`, described by `REPORT_SCHEMA` (JSON Schema) and checked
by `validate_report`; the exit code is 0 only when no path that applies failed (`exit_code`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable

from .capabilities import CUDA_GRAPH_MODES

SCHEMA_ID = "gptop-doctor/1"


class Line(enum.StrEnum):
    """The kinds of the JSON lines `python -m trainer.doctor` writes (its `kind` field), in their order."""

    DETECT = "detect"  # the device and machine, once
    CHECK = "check"  # one path's CheckResult
    DONE = "done"  # the end
    BUSY = "busy"  # `--load`: the GPU workload runs (gptop.doctor's energy check waits for it)
    IDLE = "idle"  # `--load`: it stopped


class Status(str, enum.Enum):
    """How a path fared: PASS and FAIL where it applies, SKIP (with the reason) where it does not."""

    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"


class Where(str, enum.Enum):
    """Which devices a path applies to."""

    ANY = "any"  # whichever device the doctor runs on
    CPU = "cpu"
    CUDA = "cuda"


@dataclass(frozen=True)
class DevicePath:
    """A device path gptop uses, and how the doctor proves it works."""

    name: str  # stable id ("timing", "compile.reduce-overhead")
    title: str  # in words, for the table and the README
    where: Where
    expected: str  # what passing means
    owner: str  # "module:function" that exercises it
    toggle: str | None  # the option a failure concerns (refused, slow or wrong), None: gptop itself
    on_fail: str  # what a failure means for a run, and what to do
    args: tuple[tuple[str, Any], ...] = ()  # keyword arguments of the owner's function
    quick: bool = True  # part of `--quick`
    timeout_s: float = 120.0  # the child process is killed after this (a hang is a failure)

    def applies_to(self, device_type: str) -> bool:
        return self.where is Where.ANY or self.where.value == device_type

    @property
    def in_gptop(self) -> bool:
        """Run in gptop's own process (torch-free: NVML, RAPL), not in a child process."""
        return self.owner.startswith("gptop.")


_COMPILE_ON_FAIL = (
    "--compile {mode} fails or computes another loss here: the tuner drops it after its first "
    "infeasible trial; use another --compile mode, and report the torch version"
)

PATHS: tuple[DevicePath, ...] = (
    DevicePath(
        "timing",
        "phase timing",
        Where.ANY,
        "phases add up to each step; the steps to the synchronized wall clock within 10%; on CUDA (events "
        "on the run's stream) a phase of twice the work measures 1.5-2.6x as long",
        "trainer.timing:check",
        "--no-timing",
        "the step breakdown (data / forward / backward / optimizer / other) is wrong here: read step "
        "times only, or run with --no-timing",
    ),
    DevicePath(
        "prefetch",
        "prefetch: pinned memory and side-stream copies",
        Where.ANY,
        "prefetched micro-batches equal the synchronous path's, in order, read back intact after "
        "later copies (no allocator reuse race) on the run's device",
        "trainer.prefetch:check",
        "--prefetch",
        "prefetched data could be wrong: use --prefetch 0 (and --workers 0) until it passes",
    ),
    DevicePath(
        "checkpoint",
        "checkpoint save and restore on the device",
        Where.ANY,
        "a checkpoint of a model and AdamW state on the device restores weights, moments, step counts "
        "(where the kernel wants them) and RNG states exactly",
        "trainer.checkpointer:check",
        "--resume",
        "resume, NaN rollback and every tuner trial (they restart from a checkpoint) fail here",
    ),
    DevicePath(
        "bf16",
        "bf16 autocast",
        Where.ANY,
        "matmuls under bf16 autocast compute in bf16 within 2% of fp32; says whether bf16 is native",
        "trainer.device_probe:check_bf16",
        "--precision bf16",
        "--precision bf16 computes wrong values here: use fp32",
    ),
    DevicePath(
        "tf32",
        "TF32 matmuls",
        Where.CUDA,
        "with TF32 allowed an fp32 matmul rounds as TF32 (error vs fp64 at least 4x fp32's); off, it is exact fp32",
        "trainer.device_probe:check_tf32",
        "--precision tf32",
        "TF32 does not take effect: --precision tf32 (and auto's TF32) runs at fp32 speed",
    ),
    DevicePath(
        "fp16",
        "fp16 autocast with GradScaler",
        Where.CUDA,
        "an fp16 step trains; a forced overflow is skipped (weights unchanged) and the scale halves",
        "trainer.optim:check_grad_scaler",
        "--precision fp16",
        "--precision fp16 would apply overflowing steps or never recover its scale: use bf16 or fp32",
    ),
    DevicePath(
        "fp8.tensorwise",
        "fp8 training (torchao, tensorwise)",
        Where.CUDA,
        "eligible Linear layers become Float8Linear and one bf16-autocast training step is finite and "
        "changes the weights",
        "trainer.fp8:check",
        "--precision fp8-tensorwise",
        "--precision fp8-tensorwise fails here: use bf16; check torchao's version against torch's",
        args=(("recipe", "tensorwise"),),
    ),
    DevicePath(
        "fp8.rowwise",
        "fp8 training (torchao, rowwise)",
        Where.CUDA,
        "as tensorwise, with the rowwise recipe",
        "trainer.fp8:check",
        "--precision fp8-rowwise",
        "--precision fp8-rowwise fails here: use bf16 or fp8-tensorwise",
        args=(("recipe", "rowwise"),),
    ),
    DevicePath(
        "fused_adamw",
        "fused AdamW",
        Where.ANY,
        "fused AdamW's updates equal foreach AdamW's; a step flagged non-finite on the device leaves "
        "weights and moments untouched",
        "trainer.optim:check_fused_adamw",
        "--fused-adamw",
        "--fused-adamw (the default) computes other updates or applies non-finite steps: use --no-fused-adamw",
    ),
    *(
        DevicePath(
            f"compile.{mode}",
            f"torch.compile {mode}",
            Where.CUDA if mode in CUDA_GRAPH_MODES else Where.ANY,
            "a few training steps compiled give the eager loss within 1e-3 (relative), and the compiled model "
            "runs its later steps without recompiling",
            "trainer.compiling:check",
            "--compile",
            _COMPILE_ON_FAIL.format(mode=mode),
            args=(("mode", mode),),
            quick=False,
            timeout_s=300.0,
        )
        for mode in ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
    ),
    DevicePath(
        "expandable_segments",
        "CUDA allocator expandable segments",
        Where.CUDA,
        "with --cuda-allocator expandable_segments the allocator's segments are expandable (merged into "
        "a PYTORCH_CUDA_ALLOC_CONF the user set)",
        "trainer.memory:check_expandable_segments",
        "--cuda-allocator",
        "--cuda-allocator expandable_segments has no effect here: set "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True yourself before starting",
    ),
    DevicePath(
        "autobatch",
        "--micro-batch auto probe",
        Where.ANY,
        "the probe finds the largest candidate whose measured peak fits the capacity; on CUDA a real "
        "out-of-memory error is caught and the memory is usable afterwards",
        "trainer.autobatch:check",
        "--micro-batch auto",
        "--micro-batch auto may pick a micro-batch that does not fit: give --micro-batch N",
    ),
    DevicePath(
        "nvml",
        "NVML telemetry",
        Where.CUDA,
        "utilization, memory, power, SM clock and its maximum and the clock-event reasons read for the "
        "run's GPU; utilization above 0 under a workload; GPM SM and tensor activity on Hopper and later",
        "gptop.nvml:check",
        None,
        "the dashboard shows n/a for what does not read: update the NVIDIA driver (GPM needs 520+), "
        "or run where NVML is not restricted",
    ),
    DevicePath(
        "energy",
        "NVML energy counter",
        Where.CUDA,
        "the GPU's energy counter moves across a workload, consistent with its power readings",
        "gptop.nvml:check_energy",
        None,
        "energy per token falls back to integrated power (or n/a): the counter needs Volta or newer "
        "and a driver that exposes it",
    ),
    DevicePath(
        "rapl",
        "RAPL CPU energy",
        Where.CPU,
        "the RAPL package counter reads and moves (the CPU run's energy per token)",
        "gptop.energy:check_rapl",
        None,
        "energy per token on a CPU run is n/a: RAPL is root-only since Linux 5.10 (run as root, or "
        "make /sys/class/powercap/intel-rapl:*/energy_uj readable)",
    ),
    DevicePath(
        "nccl",
        "NCCL between two ranks",
        Where.CUDA,
        "two ranks on two GPUs all-reduce a tensor over NCCL to the right sum",
        "trainer.dist:check_nccl",
        "--nproc",
        "several-GPU runs (--nproc N) fail here: check the NCCL install and the GPUs' peer access",
        quick=False,
        timeout_s=180.0,
    ),
    DevicePath(
        "qlora",
        "QLoRA nf4 base (bitsandbytes)",
        Where.CUDA,
        "a tiny transformers model with an nf4 base and LoRA adapters trains one step; only the adapters change",
        "trainer.models:check_qlora",
        "--quantize-base nf4",
        "--quantize-base nf4 fails here: check the bitsandbytes install against the CUDA version",
        quick=False,
        timeout_s=240.0,
    ),
)


def path(name: str) -> DevicePath:
    return next(p for p in PATHS if p.name == name)


@dataclass
class Outcome:
    """What a check function returns: PASS/FAIL/SKIP, what it observed, why (for FAIL and SKIP), the numbers."""

    status: Status
    observed: str
    reason: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def skip(cls, reason: str) -> "Outcome":
        return cls(Status.SKIP, "not run", reason)

    @classmethod
    def verdict(cls, ok: bool, observed: str, why: str, **data: Any) -> "Outcome":
        """PASS, or FAIL with `why`."""
        return cls(Status.PASS if ok else Status.FAIL, observed, None if ok else why, data)


@dataclass
class CheckResult:
    """One row of the doctor's table."""

    name: str
    title: str
    status: Status
    expected: str
    observed: str
    reason: str | None = None  # why it failed or was skipped (a failure adds what it means: on_fail)
    toggle: str | None = None
    seconds: float | None = None
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, p: DevicePath, outcome: Outcome, seconds: float | None) -> "CheckResult":
        reason = outcome.reason
        if outcome.status is Status.FAIL:
            reason = f"{reason or 'failed'}. {p.on_fail}"
        return cls(
            p.name, p.title, outcome.status, p.expected, outcome.observed, reason, p.toggle, seconds, dict(outcome.data)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "status": self.status.value,
            "expected": self.expected,
            "observed": self.observed,
            "reason": self.reason,
            "toggle": self.toggle,
            "seconds": self.seconds,
            "data": self.data,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CheckResult":
        return cls(
            d["name"],
            d["title"],
            Status(d["status"]),
            d["expected"],
            d["observed"],
            d.get("reason"),
            d.get("toggle"),
            d.get("seconds"),
            dict(d.get("data") or {}),
        )


@dataclass
class DoctorReport:
    """Everything `gptop doctor --json` writes: the machine, what gptop will use there, and every path."""

    requested: str  # --device as given
    time: float
    machine: dict[str, Any]  # torch, CUDA/cuDNN/NCCL, driver/NVML versions, host, libraries
    device: dict[str, Any] | None  # the DeviceInfo detected (None: detection failed)
    precision_auto: str | None  # what --precision auto resolves to there
    capabilities: dict[str, dict[str, dict[str, str | None]]]  # toggle -> value -> {"unsupported", "slow"}
    checks: list[CheckResult]
    quick: bool = False

    @property
    def counts(self) -> dict[str, int]:
        return {s.value: sum(1 for c in self.checks if c.status is s) for s in Status}

    @property
    def ok(self) -> bool:
        return exit_code(self.checks) == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_ID,
            "requested": self.requested,
            "time": self.time,
            "quick": self.quick,
            "machine": self.machine,
            "device": self.device,
            "precision_auto": self.precision_auto,
            "capabilities": self.capabilities,
            "checks": [c.to_dict() for c in self.checks],
            "counts": self.counts,
            "ok": self.ok,
        }


def exit_code(checks: Iterable[CheckResult]) -> int:
    """0 when every path that applies passed (skips are fine), else 1."""
    return 1 if any(c.status is Status.FAIL for c in checks) else 0


# --- the record's schema ---------------------------------------------------------------------------

_STR_OR_NULL = {"type": ["string", "null"]}
REPORT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": SCHEMA_ID,
    "title": "gptop doctor record",
    "type": "object",
    "required": [
        "schema",
        "requested",
        "time",
        "quick",
        "machine",
        "device",
        "precision_auto",
        "capabilities",
        "checks",
        "counts",
        "ok",
    ],
    "properties": {
        "schema": {"const": SCHEMA_ID},
        "requested": {"type": "string"},
        "time": {"type": "number"},
        "quick": {"type": "boolean"},
        "machine": {"type": "object"},
        "device": {
            "type": ["object", "null"],
            "required": ["type", "name", "total_memory"],
            "properties": {
                "type": {"enum": [w.value for w in Where if w is not Where.ANY]},
                "name": {"type": "string"},
                "total_memory": {"type": "integer"},
            },
        },
        "precision_auto": _STR_OR_NULL,
        "capabilities": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "additionalProperties": {
                    "type": "object",
                    "required": ["unsupported", "slow"],
                    "properties": {"unsupported": _STR_OR_NULL, "slow": _STR_OR_NULL},
                },
            },
        },
        "checks": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "title", "status", "expected", "observed", "reason", "toggle", "seconds", "data"],
                "additionalProperties": False,
                "properties": {
                    "name": {"enum": [p.name for p in PATHS]},
                    "title": {"type": "string"},
                    "status": {"enum": [s.value for s in Status]},
                    "expected": {"type": "string"},
                    "observed": {"type": "string"},
                    "reason": _STR_OR_NULL,
                    "toggle": _STR_OR_NULL,
                    "seconds": {"type": ["number", "null"], "minimum": 0},
                    "data": {"type": "object"},
                },
            },
        },
        "counts": {
            "type": "object",
            "required": [s.value for s in Status],
            "additionalProperties": {"type": "integer", "minimum": 0},
        },
        "ok": {"type": "boolean"},
    },
}

_TYPES: dict[str, Any] = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
    "integer": int,
    "number": (int, float),
}


def validate_report(obj: Any, schema: dict[str, Any] = REPORT_SCHEMA, where: str = "$") -> list[str]:
    """The ways `obj` breaks `schema` (empty: valid). Covers the keywords REPORT_SCHEMA uses (type, const,
    enum, required, properties, additionalProperties, items, minimum); any JSON Schema validator reads the
    same schema."""
    errors: list[str] = []
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        ok = any(
            isinstance(obj, _TYPES[n]) and not (n in ("integer", "number") and isinstance(obj, bool)) for n in names
        )
        if not ok:
            return [f"{where}: expected {' or '.join(names)}, got {type(obj).__name__}"]
    if "const" in schema and obj != schema["const"]:
        errors.append(f"{where}: expected {schema['const']!r}, got {obj!r}")
    if "enum" in schema and obj not in schema["enum"]:
        errors.append(f"{where}: {obj!r} is not one of {schema['enum']}")
    if "minimum" in schema and isinstance(obj, (int, float)) and obj < schema["minimum"]:
        errors.append(f"{where}: {obj} is below {schema['minimum']}")
    if isinstance(obj, dict):
        for key in schema.get("required", ()):
            if key not in obj:
                errors.append(f"{where}: missing {key!r}")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, value in obj.items():
            if key in props:
                errors += validate_report(value, props[key], f"{where}.{key}")
            elif extra is False:
                errors.append(f"{where}: unexpected {key!r}")
            elif isinstance(extra, dict):
                errors += validate_report(value, extra, f"{where}.{key}")
    if isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            errors += validate_report(item, schema["items"], f"{where}[{i}]")
    return errors
