"""What torch.compile did to a run: graphs, graph breaks, recompilations and a fallback to eager.

The one module that reads torch.compile's own bookkeeping: dynamo's counters (`torch._dynamo.utils.counters`:
frames compiled, unique graphs, graph-break reasons) and its log records (the `recompiles` artifact that
`TORCH_LOGS=recompiles` shows, with the guard that failed; the warning dynamo gives when a frame hits
`recompile_limit` and runs eagerly from then on). The trainer asks `poll()` at each step's end: a few dict
lookups, nothing synchronizes.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from .contract.events import CompileWarning

RECOMPILE_LOGGER = "torch._dynamo.guards.__recompiles"  # the `recompiles` artifact (TORCH_LOGS=recompiles)
LIMIT_LOGGERS = ("torch._dynamo.convert_frame", "torch._dynamo.eval_frame")
LIMIT_WORDS = ("recompile_limit", "cache_size_limit")  # dynamo's warning when it gives up on a frame
MAX_REASONS = 5


@dataclass
class CompileStats:
    frames: int = 0  # frames dynamo compiled (a recompilation is one more)
    graphs: int = 0  # unique graphs
    graph_breaks: int = 0
    break_reasons: list[str] = field(default_factory=list)  # the first few, one line each


@dataclass
class Change:
    """What happened since the last poll."""

    recompiles: int = 0
    reasons: list[str] = field(default_factory=list)  # the guard failures, one line each
    fell_back: list[str] = field(default_factory=list)  # frames that hit the recompile limit


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lock_ = threading.Lock()
        self.reasons: list[str] = []
        self.limits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # a record whose arguments do not format: nothing to learn from it
            return
        with self.lock_:
            if record.name == RECOMPILE_LOGGER:
                # "Recompiling function f in file.py:9 / triggered by ... / - 0/0: tensor 'x' size mismatch ..."
                lines = [x.strip() for x in text.splitlines() if x.strip()]
                what = lines[0].removeprefix("Recompiling function ") if lines else ""
                guards = [x.lstrip("- ") for x in lines if x.startswith("- ")]
                self.reasons.append(f"{what}: {guards[0]}" if guards else what)
            elif any(w in text for w in LIMIT_WORDS):
                self.limits.append(text.splitlines()[0][:300])


def _first_line(reason: str) -> str:
    return next((x.strip() for x in reason.splitlines() if x.strip()), reason)[:200]


class CompileWatch:
    """Attached to one compiled run; `stats()` for the first step's summary, `poll()` after each step."""

    def __init__(self) -> None:
        import torch._dynamo.utils as dynamo_utils
        import torch._logging

        self._counters = dynamo_utils.counters
        self._handler = _Collect()
        # Enable the recompiles artifact for our handler only: torch's own handler would print every guard
        # failure on stderr as well.
        torch._logging.set_logs(recompiles=True)
        rec = logging.getLogger(RECOMPILE_LOGGER)
        rec.addHandler(self._handler)
        rec.propagate = False
        self._limit_loggers = [logging.getLogger(n) for n in LIMIT_LOGGERS]
        for lg in self._limit_loggers:
            lg.addHandler(self._handler)
        self._frames = self._total()

    def _total(self) -> int:
        return int(self._counters["frames"].get("total", 0))

    def stats(self) -> CompileStats:
        breaks = self._counters["graph_break"]
        return CompileStats(
            frames=self._total(),
            graphs=int(self._counters["stats"].get("unique_graphs", 0)),
            graph_breaks=int(sum(breaks.values())),
            break_reasons=[_first_line(r) for r in list(breaks)[:MAX_REASONS]],
        )

    def poll(self) -> Change | None:
        """Recompilations and fallbacks since the last call; None when nothing happened."""
        total = self._total()
        with self._handler.lock_:
            reasons, self._handler.reasons = self._handler.reasons, []
            limits, self._handler.limits = self._handler.limits, []
        grew = total - self._frames
        self._frames = total
        if grew <= 0 and not reasons and not limits:
            return None
        return Change(recompiles=max(grew, len(reasons)), reasons=reasons[:MAX_REASONS], fell_back=limits)

    def close(self) -> None:
        logging.getLogger(RECOMPILE_LOGGER).removeHandler(self._handler)
        for lg in self._limit_loggers:
            lg.removeHandler(self._handler)

    @staticmethod
    def describe(stats: CompileStats) -> dict[str, Any]:
        return {"frames": stats.frames, "graphs": stats.graphs, "graph_breaks": stats.graph_breaks}


class CompileReport:
    """What a compiled run says about torch.compile, from a `CompileWatch`: after the first step, what the
    compile built; after later steps (and after an eval), a recompilation (a guard that failed: a new shape,
    eval after train) or a fallback to eager, tied to the step where it happened. `emit0` sends an event,
    `log` writes the trainer's log line."""

    def __init__(self, watch: CompileWatch, *, emit0: Callable[..., None], log: Callable[[str], None]):
        self.watch, self.emit0, self.log = watch, emit0, log
        self.compiled_once = False
        self.last_step_ms: float | None = None  # the host's time of the step before

    def after_step(self, step: int, step_ms: float) -> None:
        self.report(step, step_ms)
        self.last_step_ms = step_ms

    def after_eval(self, step: int) -> None:
        if self.compiled_once:
            self.report(step, None, eval_=True)

    def report(self, step: int, step_ms: float | None, *, eval_: bool = False) -> None:
        if not self.compiled_once:
            self.compiled_once = True
            self.first_compile(step)
            return
        change = self.watch.poll()
        if change is None:
            return
        where = f"in the eval after step {step}" if eval_ else f"at step {step}"
        before = f"; the step before took {self.last_step_ms:.0f} ms" if self.last_step_ms and not eval_ else ""
        took = f", this one {step_ms:.0f} ms" if step_ms is not None else ""
        if change.fell_back:
            self.warn(
                f"torch.compile gave up {where} and runs a frame eagerly from now on (recompile limit): "
                f"{change.fell_back[0]}",
                CompileWarning.COMPILE_FALLBACK,
                step,
            )
        if change.recompiles:
            why = "; ".join(change.reasons[:2]) or "a new frame or guard"
            self.warn(
                f"torch.compile recompiled {change.recompiles}x {where} ({why}){before}{took}",
                CompileWarning.RECOMPILE,
                step,
            )

    def first_compile(self, step: int) -> None:
        """The first step's compilations are the compile itself: its graphs, and its graph breaks as a
        warning event (the log line has no `warning:` prefix: a graph break is not a failure)."""
        self.watch.poll()
        st = self.watch.stats()
        msg = f"torch.compile: {st.graphs} graph(s)"
        if st.graph_breaks:
            msg += f", {st.graph_breaks} graph break(s): " + "; ".join(st.break_reasons[:3])
            self.emit0("warning", message=msg, kind=CompileWarning.GRAPH_BREAK, step=step)
        else:
            self.emit0("log", message=msg, source="compile")
        self.log(msg)

    def warn(self, message: str, kind: CompileWarning, step: int) -> None:
        self.emit0("warning", message=message, kind=kind, step=step)
        self.log(f"warning: {message}")
