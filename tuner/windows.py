"""This run's measurements as comparisons see them: each a window of one configuration's samples under one
background load, and the ratio of a candidate's to the start's.

A speed-up is claimed only as a ratio of two windows that both reached their precision target (`stable`: a
cut or unsteady measurement is neither numerator nor denominator) and were measured under the same load
(`tuner.load`): the candidate's newest such window, pooled with its other windows under that load, over the
start's windows under that load, pooled. Its interval counts both: the candidate's lower end over the start's
upper end, and the other way round. Without a start window under the candidate's load there is no ratio, and
the start is measured again (`standings.remeasure_plan`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

from trainer.contract.config import Toggles
from trainer.contract.states import TrialKind, TrialStatus

from .load import Load, same
from .measure import Estimate, median_ci


@dataclass(frozen=True)
class Window:
    """One finished measurement of this run: a configuration's kept samples (tokens/s) under one load."""

    kind: TrialKind
    number: int | None  # the configuration's trial in the study (the start's: its baseline trial)
    toggles: Toggles
    samples: tuple[float, ...]
    stable: bool  # it reached its precision target
    load: Load | None  # the load its samples were measured under (None: not tracked)
    earlier: bool = False  # re-measures a trial of an earlier run

    @property
    def estimate(self) -> Estimate:
        return median_ci(self.samples)


def windows_of(results: Iterable[dict[str, Any]]) -> list[Window]:
    """The measured windows among a run's finished measurements (the tuning record's `results`), oldest first:
    healthy (ok or cut), with samples, not of a compile that kept recompiling, and not the applied setting's
    check (tuner.check compares that one itself)."""
    out = []
    for r in results:
        s = r.get("summary") or {}
        if not r["status"].measured or r.get("unsteady") or not s.get("samples") or r["kind"] == TrialKind.CHECK:
            continue  # (the applied setting's check on the live run is what it realized, not a claim's window)
        # a re-measurement's row shows its trial's pooled estimate; its own samples are its summary's
        out.append(
            Window(
                TrialKind(r["kind"]),
                r.get("number"),
                r["toggles"],
                tuple(s["samples"]),
                bool(s.get("stable")) and r["status"] is TrialStatus.OK,
                Load.from_dict(s.get("load")),
                bool(r.get("earlier")),
            )
        )
    return out


@dataclass(frozen=True)
class Ratio:
    """A candidate's speed over the start's, both under `load`: the ratio of the estimates and its interval."""

    speedup: float
    lo: float
    hi: float
    cand: Estimate
    start: Estimate
    n: int  # the candidate's samples
    windows: int  # the candidate's windows pooled
    load: Load | None

    def words(self) -> str:
        """'1.31x (1.24-1.38x)'."""
        return ratio_words(self.speedup, self.lo, self.hi)


def ratio_words(speedup: float, lo: float | None, hi: float | None) -> str:
    """'1.31x (1.24-1.38x)': the ratio with its interval (the point figure alone when there is none)."""
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{speedup:.2f}x"
    return f"{speedup:.2f}x ({lo:.2f}-{hi:.2f}x)"


def ratio(cand: list[Window], start: list[Window]) -> Ratio | None:
    """The candidate (its windows, oldest first) over the start under the same load: from its newest stable
    window that has a stable start window under its load; None when none has."""
    for w in reversed(cand):
        if not w.stable:
            continue
        starts = [s for s in start if s.stable and same(w.load, s.load)]
        if not starts:
            continue
        mine = [c for c in cand if c.stable and same(w.load, c.load)]
        c = median_ci(x for m in mine for x in m.samples)
        s = median_ci(x for m in starts for x in m.samples)
        if not (c[0] > 0 and s[0] > 0 and s[1] > 0):
            continue
        return Ratio(c[0] / s[0], c[1] / s[2], c[2] / s[1], c, s, sum(len(m.samples) for m in mine), len(mine), w.load)
    return None


def pooled(windows: list[Window], stable_only: bool = True) -> Estimate | None:
    """All the windows' samples as one estimate (a pace, not a claim), None without samples."""
    xs = [x for w in windows if w.stable or not stable_only for x in w.samples]
    return median_ci(xs) if xs else None
