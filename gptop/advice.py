"""Why a step is slow, in a short ranked list: each item names the figure it rests on and what to try.

The evidence is what gptop already has: the step breakdown (recent step events), the GPU's idle time, the
newest profile window (trainer.profile_summary: short operators and kernels), the torch.compile watchdog's
recompilations, the device's clock reasons. What to try is always a toggle the device can run at full speed
(trainer.contract.capabilities decides), so the tuner can take the same list as its first proposals
(`Advice.toggles`). Items come in a fixed order of precedence: what is broken (recompiling, throttled),
then what one toggle fixes (data, optimizer, launch overhead), then the general compute-bound case, which a
healthy run always is.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.contract import capabilities
from trainer.contract.config import Toggles
from trainer.contract.device import DeviceInfo
from trainer.contract.events import CompileWarning, CpuReading, GpuReading, ProfileEvent, WarningEvent

if TYPE_CHECKING:
    from .state import RunState

DATA_PCT = 15.0  # data loading at or above this share of the step is worth a line
OPTIMIZER_PCT = 20.0
GPU_IDLE_PCT = 20.0
OTHER_PCT = 25.0
COMPUTE_PCT = 60.0
SHORT_SHARE = 0.2  # a profile's share in operators / kernels under 10 µs that is launch-bound
THROTTLE_REASONS = ("power cap", "power brake", "hw slowdown", "sw thermal", "hw thermal")


class Concern(enum.StrEnum):
    COMPILE = "compile"  # recompilations or a fallback to eager
    THROTTLE = "throttle"  # clocks held down by power or heat
    DATA = "data"
    OPTIMIZER = "optimizer"
    LAUNCH = "launch"  # many short operators / kernels: dispatch and launch overhead
    HOST = "host"  # the GPU waits for the host
    OTHER = "other"  # time outside the phases
    COMPUTE = "compute"


@dataclass(frozen=True)
class Advice:
    concern: Concern
    evidence: str  # the figure it rests on, in words: "data loading is 23% of the step"
    action: str  # what to try: "raise --prefetch (now 2) or --workers (now 0)"; "" if nothing
    toggles: tuple[tuple[str, object], ...] = ()  # (toggle, value) the tuner would try first

    @property
    def line(self) -> str:
        return f"{self.evidence}: {self.action}" if self.action else self.evidence


def tries(items: list[Advice]) -> list[tuple[str, object, str]]:
    """What the tuner tries first (`TunerSettings.advice`, tuner.settings): each (toggle, value) of each item, best first,
    with the evidence it rests on. An item's toggles are alternatives ("--prefetch or --workers"): one each."""
    return [(name, value, a.evidence) for a in items for name, value in a.toggles]


def advise(state: RunState) -> list[Advice]:
    """The ranked list for the run as `state` sees it now (empty before the first logged step)."""
    pct = state.phase_percent()
    if not pct:
        return []
    seen = _evidence(state, pct)
    graphs = _graphs_worth_trying(seen)
    items = (
        _compile(seen),
        _throttle(seen),
        _data(seen),
        _optimizer(seen),
        _launch(seen, graphs),
        _host(seen, graphs),
        _other(seen),
        _compute(seen),
    )
    out = [a for a in items if a is not None]
    if state.command:  # a user's program (gptop run) has none of gptop's toggles: only what limits the step
        out = [dataclasses.replace(a, action="", toggles=()) for a in out]
    return out


@dataclass(frozen=True)
class _Evidence:
    """What the advice rests on, read off the state once."""

    pct: dict[str, float]  # each phase's share of the step
    toggles: Toggles | None  # None before a hello that says them: nothing known to be in use
    device: DeviceInfo | None
    cuda: bool
    accumulation: int | None
    parallel: str | None  # how the ranks share the model (None: one process)
    recompiles: list[WarningEvent]
    reading: GpuReading | CpuReading | None  # the first GPU's latest reading
    profile: ProfileEvent | None
    idle: float | None  # GPU idle % of the step (CUDA only)


def _evidence(state: RunState, pct: dict[str, float]) -> _Evidence:
    t = state.toggles
    dev = state.device
    cuda = dev is not None and dev.is_cuda
    accumulation = state.hello.accumulation if state.hello is not None else None
    parallel = state.hello.parallel if state.hello is not None and state.hello.world_size > 1 else None
    with state.lock:
        recompiles = list(state.recompiles)
        reading = next((r for k, r in state.device_latest.items() if k.startswith("gpu")), None)
        profile = state.profile
    idle = state.gpu_idle_percent() if cuda else None
    return _Evidence(pct, t, dev, cuda, accumulation, parallel, recompiles, reading, profile, idle)


def _graphs_worth_trying(e: _Evidence) -> bool:
    """CUDA graphs (--compile reduce-overhead) are not in use and the device runs them well."""
    return bool(
        e.cuda
        and (e.toggles is None or e.toggles.compile in ("off", "default"))
        and capabilities.worth_trying(
            "compile", "reduce-overhead", e.device, accumulation=e.accumulation or None, parallel=e.parallel
        )
    )


def _compile(e: _Evidence) -> Advice | None:
    if not e.recompiles:
        return None
    last = e.recompiles[-1]
    fell = any(w.kind == CompileWarning.COMPILE_FALLBACK for w in e.recompiles)
    what = "fell back to eager" if fell else f"recompiled {len(e.recompiles)}x"
    return Advice(
        Concern.COMPILE,
        f"torch.compile {what} (last at step {last.step})",
        "a shape or a Python value changes between steps; --compile off if it keeps on",
        (("compile", "off"),),
    )


def _throttle(e: _Evidence) -> Advice | None:
    reasons = [r for r in (getattr(e.reading, "clock_reasons", None) or []) if r in THROTTLE_REASONS]
    if not reasons:
        return None
    return Advice(
        Concern.THROTTLE,
        f"GPU clocks held down ({', '.join(reasons)})",
        "power or cooling, not a toggle: check nvidia-smi -q -d PERFORMANCE",
    )


def _data(e: _Evidence) -> Advice | None:
    data = e.pct.get("data", 0.0)
    if data < DATA_PCT:
        return None
    prefetch, workers = (e.toggles.prefetch, e.toggles.workers) if e.toggles is not None else (None, None)
    p = f" (now {prefetch})" if prefetch is not None else ""
    w = f" (now {workers})" if workers is not None else ""
    return Advice(
        Concern.DATA,
        f"data loading is {data:.0f}% of the step",
        f"raise --prefetch{p} or --workers{w}",
        (("prefetch", max(4, 2 * (prefetch or 1))), ("workers", max(2, 2 * (workers or 1)))),
    )


def _optimizer(e: _Evidence) -> Advice | None:
    opt = e.pct.get("optimizer", 0.0)
    if opt < OPTIMIZER_PCT or (e.toggles is not None and e.toggles.fused_adamw):
        return None
    return Advice(
        Concern.OPTIMIZER, f"optimizer is {opt:.0f}% of the step", "try --fused-adamw", (("fused_adamw", True),)
    )


def _launch(e: _Evidence, graphs: bool) -> Advice | None:
    """Many short operators or kernels in the newest profile window: dispatch and launch overhead."""
    if e.profile is None:
        return None
    share = e.profile.short_kernel_share if e.cuda else e.profile.short_op_share
    if share is None or share < SHORT_SHARE:
        return None
    if e.toggles is not None and e.toggles.compile != "off" and not graphs:
        return None
    launch = (
        f"{share:.0%} of the {'GPU time in kernels' if e.cuda else 'step in operators'} under 10 µs "
        f"(profile of steps {e.profile.first}-{e.profile.last})"
    )
    fix = "--compile reduce-overhead (CUDA graphs)" if graphs else "--compile default"
    return Advice(
        Concern.LAUNCH,
        launch,
        f"try {fix} or a larger --micro-batch",
        (("compile", "reduce-overhead" if graphs else "default"),),
    )


def _host(e: _Evidence, graphs: bool) -> Advice | None:
    if e.idle is None or e.idle < GPU_IDLE_PCT:
        return None
    evidence = f"GPU idle {e.idle:.0f}% of the step (launch-bound)"
    if graphs:
        return Advice(
            Concern.HOST,
            evidence,
            "try --compile reduce-overhead or a larger --micro-batch",
            (("compile", "reduce-overhead"),),
        )
    return Advice(Concern.HOST, evidence, "try a larger --micro-batch")


def _other(e: _Evidence) -> Advice | None:
    other = e.pct.get("other", 0.0)
    if other < OTHER_PCT:
        return None
    return Advice(
        Concern.OTHER,
        f"{other:.0f}% of the step is outside the phases (host overhead, syncs)",
        "try --compile default",
        (("compile", "default"),),
    )


def _compute(e: _Evidence) -> Advice | None:
    compute = e.pct.get("forward", 0.0) + e.pct.get("backward", 0.0)
    if compute < COMPUTE_PCT:
        return None
    t, dev = e.toggles, e.device
    tips: list[tuple[str, object]] = []
    if (t is None or t.compile == "off") and capabilities.worth_trying("compile", "default", dev):
        tips.append(("compile", "default"))
    if (t is None or t.precision in ("fp32", "tf32")) and capabilities.worth_trying("precision", "bf16", dev):
        tips.append(("precision", "bf16"))
    if not tips:
        return Advice(Concern.COMPUTE, f"compute-bound: forward+backward are {compute:.0f}% of the step", "")
    return Advice(
        Concern.COMPUTE,
        f"compute-bound (forward+backward {compute:.0f}%)",
        "try " + " or ".join(f"--{k.replace('_', '-')} {v}" for k, v in tips),
        tuple(tips),
    )
