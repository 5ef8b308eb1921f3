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
from typing import Any

RECOMPILE_LOGGER = "torch._dynamo.guards.__recompiles"       # the `recompiles` artifact (TORCH_LOGS=recompiles)
LIMIT_LOGGERS = ("torch._dynamo.convert_frame", "torch._dynamo.eval_frame")
LIMIT_WORDS = ("recompile_limit", "cache_size_limit")          # dynamo's warning when it gives up on a frame
MAX_REASONS = 5


@dataclass
class CompileStats:
    frames: int = 0                     # frames dynamo compiled (a recompilation is one more)
    graphs: int = 0                     # unique graphs
    graph_breaks: int = 0
    break_reasons: list[str] = field(default_factory=list)     # the first few, one line each


@dataclass
class Change:
    """What happened since the last poll."""

    recompiles: int = 0
    reasons: list[str] = field(default_factory=list)           # the guard failures, one line each
    fell_back: list[str] = field(default_factory=list)         # frames that hit the recompile limit


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lock_ = threading.Lock()
        self.reasons: list[str] = []
        self.limits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:           # a record whose arguments do not format: nothing to learn from it
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
        return CompileStats(frames=self._total(), graphs=int(self._counters["stats"].get("unique_graphs", 0)),
                            graph_breaks=int(sum(breaks.values())),
                            break_reasons=[_first_line(r) for r in list(breaks)[:MAX_REASONS]])

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
