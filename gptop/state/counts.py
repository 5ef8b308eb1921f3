"""The run's step and token counts across its trainer processes (`RunCounts`), for every reader of events.

A run is trained by one process after another: a tuner's trial or switch, `--restart-on-failure`, `gptop train
--resume`, a user's script started again under `gptop run`. Each process counts its own `tokens` (the step,
progress, checkpoint and done events' "cumulative" count) from where it starts: gptop's trainer restores the
count its checkpoint holds, but a client in a user's script cannot (a transformers Trainer or a Lightning
module restores its step, not a token count), so its count starts from `start_step` x tokens per step where it
knows them, else from 0. Its hello says where it starts (`start_step`, `start_tokens`). A reader that took
the latest event's `tokens` would lose every earlier process's tokens at such a restart; `RunCounts` reads
each process's counts relative to its start instead, continued from the run's own count at that step.

Two token figures, never to be confused:

- kept (`tokens`): the tokens of the steps the run holds now, steps 1 to `step`: what the model was trained
  on. A rollback lowers it: a tuner's failed trial, a restart from an older checkpoint, a NaN rollback throw
  their later steps away.
- processed: every token the run trained on, the rolled-back steps' included (kept + `rolled_back_tokens`):
  the work the device did, which energy per token is divided by.

The steps are the producers' own (each restores its step), so `step` is the run's step reached. Memory is
bounded: the points a rollback may go back to are the newest MAX_POINTS counts of the kept steps.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Callable

from trainer.contract.events import HelloEvent

MAX_POINTS = 4096  # (step, kept tokens) of the newest count events: where a later process may start from


@dataclass
class _Process:
    """One trainer process's counting: where it started, and how its counts map onto the run's."""

    start_step: int
    start_tokens: int | None  # its own count at start_step; None: its count is the run's (an older gptop trainer)
    tokens_per_step: int | None  # its hello's, for an estimate
    pid: int | None
    base: int | None = None  # the run's kept tokens at start_step (None: found at its first count)
    offset: int | None = None  # run's kept tokens = offset + its count


def start_tokens(hello: HelloEvent) -> int | None:
    """The count the process of `hello` starts from: what it says, else what an older producer started from
    (a client: start_step x tokens per step where it knew them, else 0; gptop's trainer: its restored count,
    which is the run's, None)."""
    if hello.start_tokens is not None:
        return hello.start_tokens
    if hello.client is None:
        return None
    return hello.start_step * hello.tokens_per_step if hello.tokens_per_step else 0


class RunCounts:
    """The run's step reached, its kept and processed tokens and its rolled-back steps (module doc), from
    the events of one rank (the reader picks it): hellos, and each count (`count`) in order."""

    def __init__(self) -> None:
        self.step: int | None = None  # the run's step reached (its latest count's)
        self.tokens: int | None = None  # kept tokens at `step`
        self.rolled_back_steps = 0  # steps trained and then thrown away by a rollback
        self.rolled_back_tokens = 0  # their tokens
        self.processes = 0  # trainer processes seen starting (their full hellos)
        self._points: deque[tuple[int, int]] = deque(maxlen=MAX_POINTS)  # (step, kept), steps increasing
        self._process: _Process | None = None
        self._rank: int | None = None  # the rank whose full hellos start processes (the run's first one's)
        self._starting = False  # an early hello came: the next full one starts a process

    @property
    def processed(self) -> int | None:
        """Tokens of every step trained, the rolled-back steps' included."""
        return None if self.tokens is None else self.tokens + self.rolled_back_tokens

    @property
    def processed_steps(self) -> int | None:
        """Steps trained, the rolled-back ones included."""
        return None if self.step is None else self.step + self.rolled_back_steps

    def hello(self, e: HelloEvent) -> None:
        """A hello: an early one says a process starts, the full one (or one of another pid) where it starts.
        Another node's full hellos (another first rank) are the same process's."""
        if e.early:
            self._starting = True
            return
        if self._rank is None:
            self._rank = e.rank
        if e.rank != self._rank:
            return
        p = self._process
        if p is not None and not self._starting and (e.pid is None or e.pid == p.pid):
            return  # the same process said it again
        self._starting = False
        self.processes += 1
        s = e.start_step
        if self.step is not None and s < self.step:
            self.rollback(s)
        self._process = q = _Process(s, start_tokens(e), e.tokens_per_step, e.pid)
        q.base = self._known_at(s, q.start_tokens)

    def count(self, step: int, tokens: int, point: bool = True) -> int:
        """A count of the current process (`tokens` at `step`, as its event says): the run's kept tokens at
        `step`. `point`: keep it as a place a rollback may go back to (not every progress event)."""
        p = self._process
        if p is None:  # no hello (a bare stream): its counts are the run's
            p = self._process = _Process(0, None, None, None, base=0, offset=0)
        if p.offset is None:
            p.offset = self._offset(p, step, tokens)
        kept = p.offset + tokens
        if self.step is not None and step < self.step:  # the process went back on its own (a NaN rollback)
            self.rollback(step, kept)
        self.step, self.tokens = step, kept
        if point and (not self._points or step > self._points[-1][0]):
            self._points.append((step, kept))
        return kept

    def rollback(self, step: int, tokens: int | None = None) -> None:
        """The run goes back to `step` (its kept tokens there, `tokens`, where known): the steps after it were
        trained and are thrown away."""
        if self.step is None or self.tokens is None or step >= self.step:
            return
        to = tokens if tokens is not None else self._kept_at(step)
        if to is None:
            to = round(self.tokens * step / self.step)
        self.rolled_back_steps += self.step - step
        self.rolled_back_tokens += max(0, self.tokens - to)
        while self._points and self._points[-1][0] >= step:
            self._points.pop()
        self._points.append((step, to))
        self.step, self.tokens = step, to

    # ------------------------------------------------------------------ where a process starts
    def _offset(self, p: _Process, step: int, tokens: int) -> int:
        """What to add to the process's counts: the run's count at its start less its own count there."""
        if p.start_tokens is None:
            return 0  # it restored the run's count (an older gptop trainer)
        base = p.base
        if base is None:  # nothing of the run before it is known: its start step at its own rate
            per = (tokens - p.start_tokens) / (step - p.start_step) if step > p.start_step else p.tokens_per_step
            base = round(p.start_step * (per or 0))
        return base - p.start_tokens

    def _known_at(self, step: int, own: int | None) -> int | None:
        """The run's kept tokens at `step` where a process starts whose own count there is `own`: a count of
        the run at that step, else the process's own (restored) count, else the run's counts around it."""
        exact = self._exact_at(step)
        if exact is not None:
            return exact
        if own is None or own > 0 or step <= 0:  # (a loop that numbers its steps from 0 starts at -1)
            return own
        return self._kept_at(step)

    def _exact_at(self, step: int) -> int | None:
        if self.step == step:
            return self.tokens
        i = bisect.bisect_left(self._points, (step, -1))
        if i < len(self._points) and self._points[i][0] == step:
            return self._points[i][1]
        return None

    def _kept_at(self, step: int) -> int | None:
        """The run's kept tokens at `step`, interpolated in its counts (extrapolated past them at their mean
        per step); None before any."""
        pts = list(self._points)
        if self.step is not None and self.tokens is not None and (not pts or self.step > pts[-1][0]):
            pts.append((self.step, self.tokens))
        if not pts:
            return None
        i = bisect.bisect_left(pts, (step, -1))
        if i < len(pts) and pts[i][0] == step:
            return pts[i][1]
        if 0 < i < len(pts):
            (s0, k0), (s1, k1) = pts[i - 1], pts[i]
            return round(k0 + (k1 - k0) * (step - s0) / (s1 - s0))
        (s0, k0), (s1, k1) = pts[0], pts[-1]
        per = (k1 - k0) / (s1 - s0) if s1 > s0 else (k1 / s1 if s1 else 0.0)
        ref_s, ref_k = (s1, k1) if i else (s0, k0)
        return max(0, round(ref_k + per * (step - ref_s)))


def tokens_words(kept: int | None, processed: int | None, rolled_back_steps: int, num: Callable[[int], str]) -> str:
    """The run's tokens in words, `num` formatting a number: '120,000 tokens', or where a rollback threw steps
    away, the kept ones and the processed ones told apart ('102,400 tokens kept, 122,880 processed incl. 20
    rolled-back steps')."""
    if kept is None:
        return "? tokens"
    if not rolled_back_steps or processed is None or processed == kept:
        return f"{num(kept)} tokens"
    steps = f"{rolled_back_steps} rolled-back step{'s' if rolled_back_steps != 1 else ''}"
    return f"{num(kept)} tokens kept, {num(processed)} processed incl. {steps}"
