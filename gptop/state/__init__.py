"""What the views render: a pure reducer over the run's events.

The Session feeds every event (trainer events, device samples, tuner events) into one `RunState` with `apply`,
and the trainer's stdout/stderr lines with `add_log`. Both views only read it: the Textual app polls `version`
(and the per-area `versions`) and re-renders what changed; the headless view formats lines from it.
Everything a view needs to *compute* (phase means, the bottleneck hint, ETA, rank spread, energy per token)
lives here, so the TUI and `--no-ui` say the same thing.

Times come from the events, never from the wall clock, unless a `clock` is injected: replays and snapshot
tests are then deterministic, and a live session passes `clock=time.time` so elapsed time keeps ticking
between events.

One concern per module:

- reducer: `RunState` and how each event changes it;
- counts: the run's steps and tokens across its trainer processes (restarts, rollbacks), kept and processed;
- figures: the step and device figures `RunState` answers views with (`StepFigures`), computed on read by statistics;
- histories: the bounded step and device series, device samples, log lines, alerts it keeps;
- autotuner: the tuner's events folded together (`TunerState`), and toggles against the run's start;
- statistics: the computations (step window, pace and ETA, rank spread, MoE imbalance, energy's span);
- hints: advice in words that names what to try (`gpu_verdict`, the bottleneck hint);
- formatting: numbers, durations, toggles, the model and the run in the views' short forms.
"""

from .autotuner import TunerState, toggle_diff
from .formatting import (
    fmt_bytes,
    fmt_duration,
    fmt_eta,
    fmt_mfu,
    fmt_num,
    fmt_peak,
    fmt_toggles,
    loss_range,
    measure_line,
    measure_parts,
    model_summary,
    phase_label,
    spread_pct,
)
from .hints import BUSY_UTIL_PCT, LOW_CLOCK_SHARE, LOW_SM_SHARE, SLOWING_REASONS, gpu_verdict
from .histories import CPU_METRICS, GPU_METRICS, STEP_SERIES, Series
from .reducer import AREAS, RunState
from .statistics import ETA_FLOOR_S, Pace, Spread, StepWindow

__all__ = [
    "AREAS",
    "BUSY_UTIL_PCT",
    "CPU_METRICS",
    "ETA_FLOOR_S",
    "GPU_METRICS",
    "LOW_CLOCK_SHARE",
    "LOW_SM_SHARE",
    "SLOWING_REASONS",
    "STEP_SERIES",
    "Pace",
    "RunState",
    "Series",
    "Spread",
    "StepWindow",
    "TunerState",
    "fmt_bytes",
    "fmt_duration",
    "fmt_eta",
    "fmt_mfu",
    "fmt_num",
    "fmt_peak",
    "fmt_toggles",
    "gpu_verdict",
    "loss_range",
    "measure_line",
    "measure_parts",
    "model_summary",
    "phase_label",
    "spread_pct",
    "toggle_diff",
]
