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
from trainer.contract.events import CompileWarning

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
    """What the tuner tries first (tuner.controller's `advice`): each (toggle, value) of each item, best first,
    with the evidence it rests on. An item's toggles are alternatives ("--prefetch or --workers"): one each."""
    return [(name, value, a.evidence) for a in items for name, value in a.toggles]


def advise(state: RunState) -> list[Advice]:
    """The ranked list for the run as `state` sees it now (empty before the first logged step)."""
    pct = state.phase_percent()
    if not pct:
        return []
    t = state.toggles
    dev = state.device
    cuda = dev is not None and dev.is_cuda
    accumulation = state.hello.accumulation if state.hello is not None else None
    out: list[Advice] = []

    with state.lock:
        recompiles = list(state.recompiles)
        reading = next((r for k, r in state.device_latest.items() if k.startswith("gpu")), None)
        profile = state.profile
    if recompiles:
        last = recompiles[-1]
        fell = any(w.kind == CompileWarning.COMPILE_FALLBACK for w in recompiles)
        what = "fell back to eager" if fell else f"recompiled {len(recompiles)}x"
        out.append(
            Advice(
                Concern.COMPILE,
                f"torch.compile {what} (last at step {last.step})",
                "a shape or a Python value changes between steps; --compile off if it keeps on",
                (("compile", "off"),),
            )
        )
    reasons = [r for r in (getattr(reading, "clock_reasons", None) or []) if r in THROTTLE_REASONS]
    if reasons:
        out.append(
            Advice(
                Concern.THROTTLE,
                f"GPU clocks held down ({', '.join(reasons)})",
                "power or cooling, not a toggle: check nvidia-smi -q -d PERFORMANCE",
            )
        )
    data = pct.get("data", 0.0)
    if data >= DATA_PCT:
        prefetch, workers = t.get("prefetch"), t.get("workers")
        p = f" (now {prefetch})" if prefetch is not None else ""
        w = f" (now {workers})" if workers is not None else ""
        out.append(
            Advice(
                Concern.DATA,
                f"data loading is {data:.0f}% of the step",
                f"raise --prefetch{p} or --workers{w}",
                (("prefetch", max(4, 2 * (prefetch or 1))), ("workers", max(2, 2 * (workers or 1)))),
            )
        )
    opt = pct.get("optimizer", 0.0)
    if opt >= OPTIMIZER_PCT and not t.get("fused_adamw", False):
        out.append(
            Advice(
                Concern.OPTIMIZER, f"optimizer is {opt:.0f}% of the step", "try --fused-adamw", (("fused_adamw", True),)
            )
        )
    launch = None
    if profile is not None:
        share = profile.short_kernel_share if cuda else profile.short_op_share
        if share is not None and share >= SHORT_SHARE:
            launch = (
                f"{share:.0%} of the {'GPU time in kernels' if cuda else 'step in operators'} under 10 µs "
                f"(profile of steps {profile.first}-{profile.last})"
            )
    idle = state.gpu_idle_percent() if cuda else None
    graphs = (
        cuda
        and t.get("compile") in (None, "off", "default")
        and capabilities.worth_trying("compile", "reduce-overhead", dev, accumulation=accumulation or None)
    )
    if launch is not None:
        fix = "--compile reduce-overhead (CUDA graphs)" if graphs else "--compile default"
        if t.get("compile", "off") == "off" or graphs:
            out.append(
                Advice(
                    Concern.LAUNCH,
                    launch,
                    f"try {fix} or a larger --micro-batch",
                    (("compile", "reduce-overhead" if graphs else "default"),),
                )
            )
    if idle is not None and idle >= GPU_IDLE_PCT:
        if graphs:
            out.append(
                Advice(
                    Concern.HOST,
                    f"GPU idle {idle:.0f}% of the step (launch-bound)",
                    "try --compile reduce-overhead or a larger --micro-batch",
                    (("compile", "reduce-overhead"),),
                )
            )
        else:
            out.append(
                Advice(Concern.HOST, f"GPU idle {idle:.0f}% of the step (launch-bound)", "try a larger --micro-batch")
            )
    other = pct.get("other", 0.0)
    if other >= OTHER_PCT:
        out.append(
            Advice(
                Concern.OTHER,
                f"{other:.0f}% of the step is outside the phases (host overhead, syncs)",
                "try --compile default",
                (("compile", "default"),),
            )
        )
    compute = pct.get("forward", 0.0) + pct.get("backward", 0.0)
    if compute >= COMPUTE_PCT:
        tips: list[tuple[str, object]] = []
        if t.get("compile", "off") == "off" and capabilities.worth_trying("compile", "default", dev):
            tips.append(("compile", "default"))
        if t.get("precision", "fp32") in ("fp32", "tf32") and capabilities.worth_trying("precision", "bf16", dev):
            tips.append(("precision", "bf16"))
        if tips:
            out.append(
                Advice(
                    Concern.COMPUTE,
                    f"compute-bound (forward+backward {compute:.0f}%)",
                    "try " + " or ".join(f"--{k.replace('_', '-')} {v}" for k, v in tips),
                    tuple(tips),
                )
            )
        else:
            out.append(Advice(Concern.COMPUTE, f"compute-bound: forward+backward are {compute:.0f}% of the step", ""))
    if state.command:  # a user's program (gptop run) has none of gptop's toggles: only what limits the step
        out = [dataclasses.replace(a, action="", toggles=()) for a in out]
    return out
