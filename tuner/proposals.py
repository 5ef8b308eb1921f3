"""What to try: the first guesses enqueued before the sampler, and the screening of a proposal that cannot run.

The study is warm-started (`TuneStudy.warm_start`) with, in order: the starting configuration, what the advice
says to try (each change alone on the start, best first), a known-good recipe for the device and, when memory
is the constraint, a `memory` guess (the largest micro-batch with every saver on). Then TPE proposes.

A proposal is screened before it runs, and recorded without running: infeasible when its micro-batch cannot
fit (above the largest that fits without activation checkpointing, 2x for a narrower precision; unless it
also holds less state than the start, a smaller optimizer state or a quantized base: those are tried) or the
trainer would refuse the combination; pruned when its compile mode did not finish warming up within a trial's
time earlier in this run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trainer.contract import capabilities
from trainer.contract.config import Toggles
from trainer.contract.device import DeviceInfo
from trainer.contract.states import TrialOutcome, TrialStatus

from .space import SearchSpace

# What the advice says to try (gptop.advice, through the session), best first: each one change to the start,
# the tuner's first proposals.
AdviceTry = tuple[str, Any, str]  # (toggle, value, the evidence in words)
# A warm-start entry: the toggles, their source and the trial's extra attributes.
FirstGuess = tuple[Toggles, str, dict[str, Any]]


def first_guesses(
    base: Toggles, space: SearchSpace, dev: DeviceInfo, max_mb: int | None, advice: list[AdviceTry]
) -> list[FirstGuess]:
    """What the study tries before its sampler, in order: the start, the advice's tries, the recipe, and for a
    memory-constrained space the memory guess."""
    starts: list[FirstGuess] = [(base, "current", {})]
    starts += advised(advice, base, space)
    starts.append((recipe(base, space, dev, max_mb), "recipe", {}))
    if space.memory:
        starts.append((memory_recipe(base, space), "memory", {}))
    return starts


def recipe(base: Toggles, space: SearchSpace, dev: DeviceInfo, max_mb: int | None) -> Toggles:
    """A known-good starting point for the device (clamped into the space): the largest micro-batch that fits."""
    choices = space.choices
    t = capabilities.recipe(base, dev, choices["precision"])
    mbs = [m for m in choices["micro_batch"] if isinstance(m, int) and (max_mb is None or m <= max_mb)]
    if mbs:
        t.micro_batch = max(mbs)
    return space.clamp(t)


def memory_recipe(base: Toggles, space: SearchSpace) -> Toggles:
    """A first guess for a memory-constrained run: the whole per-rank batch (or the largest micro-batch in
    the space) with every memory saver in the space on: activation checkpointing, the smallest AdamW
    variant (its moments carry over; Adafactor is left to the sampler) and the most quantized base."""
    choices = space.choices
    t = dataclasses.replace(base)
    if True in choices["activation_checkpointing"]:
        t.activation_checkpointing = True
    adam = [v for v in choices["optimizer"] if capabilities.optimizer_state_carries(base.optimizer, v)]
    if adam:
        t.optimizer = min(adam, key=lambda v: capabilities.OPTIMIZER_STATE_BYTES[v])
    t.quantize_base = min(choices["quantize_base"], key=lambda v: capabilities.BASE_BYTES[v])
    mbs = [m for m in choices["micro_batch"] if isinstance(m, int)]
    if mbs:
        t.micro_batch = max(mbs)
    return space.clamp(t)


def advised(tries: list[AdviceTry], base: Toggles, space: SearchSpace) -> list[FirstGuess]:
    """The advice's tries as warm-start entries (source "advice"): each change alone on the start, best
    first. A toggle the space holds frozen is left alone; a value the space lacks becomes the nearest one
    it has (prefetch 8 -> 4); a change that ends where the start is, or repeats an earlier one, is dropped.
    What the device cannot run is screened as any proposal is (`capabilities.unsupported`)."""
    out: list[FirstGuess] = []
    for name, value, evidence in tries:
        if name not in space.params:
            continue
        v = nearest(space.choices[name], value)
        if v is None or v == getattr(base, name):
            continue
        t = dataclasses.replace(base, **{name: v})
        if any(t == o for o, _, _ in out):
            continue
        shown = ("on" if v else "off") if isinstance(v, bool) else v
        out.append((t, "advice", {"advice": f"{evidence}: {name}={shown}"}))
    return out


def nearest(choices: tuple[Any, ...] | list[Any], value: Any) -> Any:
    """`value` if the space allows it, else the nearest allowed integer to an integer (ties: the larger), else
    None."""
    if value in choices:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        ints = [c for c in choices if isinstance(c, int) and not isinstance(c, bool)]
        if ints:
            return min(ints, key=lambda c: (abs(c - value), -c))
    return None


def predicted_oom(t: Toggles, max_mb: int | None, start: Toggles) -> str | None:
    """Why `t`'s micro-batch cannot fit, from the largest that fits with the `start`'s toggles (`max_mb`), or
    None when it may."""
    mb = t.micro_batch_int()
    if max_mb is None or mb is None or t.activation_checkpointing:
        return None
    if capabilities.saves_memory(t, start):
        return None  # less optimizer state or a quantized base: the micro-batch may fit, try it
    bytes_of = capabilities.activation_bytes
    narrower = bytes_of(t.precision) < bytes_of(start.precision)
    limit = max_mb * (2 if narrower else 1)
    if mb > limit:
        return (
            f"predicted OOM: micro-batch {mb} > {limit} (largest that fits with the starting toggles: "
            f"{max_mb}{', x2 for the narrower precision' if narrower else ''}) "
            "without activation checkpointing"
        )
    return None


@dataclass(frozen=True)
class Screened:
    """A proposal recorded without running: `status` (infeasible or pruned) and why; `failure` is the kind it
    is told infeasible with (None for pruned)."""

    status: TrialStatus
    reason: str
    failure: TrialOutcome | None = None


def screen(
    t: Toggles,
    *,
    start: Toggles,
    max_mb: int | None,
    dev: DeviceInfo,
    space: SearchSpace,
    slow_compile: set[str],
    trial_timeout_s: float,
) -> Screened | None:
    """Why proposal `t` is not run (see the module doc), or None to run it. `start` is the user's starting
    toggles, `max_mb` the largest micro-batch that fits with them, `slow_compile` the compile modes that did
    not warm up within a trial's `trial_timeout_s` earlier in this run."""
    why = predicted_oom(t, max_mb, start)
    if why:
        return Screened(TrialStatus.INFEASIBLE, why, TrialOutcome.OOM)
    bad = capabilities.unsupported(t, dev, space.per_rank, space.parallel)
    if bad:  # a combination the trainer would refuse (a CUDA-graph compile mode with accumulation)
        return Screened(
            TrialStatus.INFEASIBLE,
            f"{bad[0]}={getattr(t, bad[0])}: {bad[1]}",
            TrialOutcome.COMPILE if bad[0] == "compile" else TrialOutcome.CRASH,
        )
    if t.compile in slow_compile:
        return Screened(
            TrialStatus.PRUNED,
            f"compile={t.compile} did not finish warming up within a trial's "
            f"{trial_timeout_s:.0f} s earlier in this run: not worth this budget",
        )
    return None
