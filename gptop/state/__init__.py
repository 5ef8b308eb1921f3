"""What the views render: a pure reducer over the run's events (gptop.state.reducer)."""

from .reducer import (AREAS, BUSY_UTIL_PCT, CPU_METRICS, ETA_FLOOR_S, GPU_METRICS, LOW_CLOCK_SHARE, LOW_SM_SHARE,
                      SLOWING_REASONS, STEP_SERIES, TOGGLE_DEFAULTS, Pace, RunState, Series, Spread, StepWindow,
                      TunerState, fmt_bytes, fmt_duration, fmt_eta, fmt_mfu, fmt_num, fmt_peak, fmt_toggles,
                      gpu_verdict, measure_line, measure_parts, model_summary, phase_label, spread_pct)

__all__ = [
    "AREAS", "BUSY_UTIL_PCT", "CPU_METRICS", "ETA_FLOOR_S", "GPU_METRICS", "LOW_CLOCK_SHARE", "LOW_SM_SHARE",
    "SLOWING_REASONS", "STEP_SERIES", "TOGGLE_DEFAULTS", "Pace", "RunState", "Series", "Spread", "StepWindow",
    "TunerState", "fmt_bytes", "fmt_duration", "fmt_eta", "fmt_mfu", "fmt_num", "fmt_peak", "fmt_toggles",
    "gpu_verdict", "measure_line", "measure_parts", "model_summary", "phase_label", "spread_pct",
]
