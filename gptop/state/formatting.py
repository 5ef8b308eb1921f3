"""Formatting shared by both views: numbers, durations, toggles, the model, the tuner's measurement, in the
short forms the dashboard and `--no-ui` print. Pure functions of values and events."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gptop.energy import unavailable_reason
from trainer.contract.config import Toggles
from trainer.contract.events import DeviceEvent, EstimateInfo, HelloEvent, MeasureProgress, ModelInfo, TrialEvent
from trainer.contract.states import RunStatus, TrialKind

if TYPE_CHECKING:
    from .reducer import RunState


def spread_pct(trial: TrialEvent) -> float | None:
    """A trial's spread (tokens/s, as the tuner reports it) as % of its throughput."""
    spread, tps = trial.spread, trial.tokens_per_s
    return 100.0 * spread / tps if spread is not None and tps else None


def measure_parts(m: MeasureProgress) -> tuple[str, str, str]:
    """(what and how far, the estimate so far, time measured of the most it may take), e.g.
    ('trial 5: 5/8 samples', '41.2k tok/s ±4.1% (goal ±3%)', '0:31/2:30'); empty parts are ''."""
    what = m.kind if m.kind is not TrialKind.TRIAL or m.number is None else f"trial {m.number}"
    if m.kind is TrialKind.REMEASURE and m.number is not None:
        what = f"trial {m.number} again"
    if not m.warmed_up:
        head = f"{what}: warming up, {m.steps} steps"
    else:
        head = f"{what}: {m.samples}/{m.needed} samples" if m.samples < m.needed else f"{what}: {m.samples} samples"
    est = ""
    if m.tokens_per_s is not None:
        est = f"{fmt_num(m.tokens_per_s)} tok/s"
        if m.spread is not None and m.tokens_per_s > 0:
            est += f" ±{100 * m.spread / m.tokens_per_s:.1f}%"
            if m.target is not None:
                est += f" (goal ±{m.target * 100:g}%)"
    when = ""
    if m.seconds is not None:
        when = fmt_duration(m.seconds) + (f"/{fmt_duration(m.max_seconds)}" if m.max_seconds else "")
    return head, est, when


def measure_line(m: MeasureProgress) -> str:
    """'trial 5: 5/8 samples · 41.2k tok/s ±4.1% (goal ±3%) · 0:31/2:30': what the tuner is measuring, how
    far it is, its estimate so far, and the time measured of the most a measurement may take."""
    return " · ".join(p for p in measure_parts(m) if p)


def phase_label(phase: str | None) -> str:
    """'find-micro-batch' -> 'find micro batch': the tuner's phase codes, readable."""
    return (phase or "idle").replace("-", " ").replace("_", " ")


def claim_words(speedup: float | None, lo: float | None, hi: float | None) -> str:
    """'1.31x (1.24-1.38x)': a claimed speed-up with its interval (the tuner's; the point alone without one)."""
    if speedup is None:
        return ""
    if lo is None or hi is None:
        return f"{speedup:.2f}x"
    return f"{speedup:.2f}x ({lo:.2f}-{hi:.2f}x)"


def fmt_num(x: float | None, unit: str = "", digits: int = 1) -> str:
    """12345 -> '12.3k'; None -> 'n/a'."""
    if x is None:
        return "n/a"
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.{digits}f}{suffix}{unit}"
    return f"{x:.{digits}f}{unit}" if not float(x).is_integer() or digits == 0 else f"{x:.0f}{unit}"


def fmt_bytes(x: float | None) -> str:
    """Bytes in binary units: 1.2 GB means GiB, as nvidia-smi does."""
    if x is None:
        return "n/a"
    for div, suffix in ((1 << 40, "TB"), (1 << 30, "GB"), (1 << 20, "MB"), (1 << 10, "KB")):
        if abs(x) >= div:
            return f"{x / div:.1f} {suffix}"
    return f"{x:.0f} B"


def fmt_duration(s: float | None) -> str:
    """Seconds -> 'h:mm:ss' (or 'm:ss')."""
    if s is None:
        return "n/a"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def fmt_mfu(mfu: float | None, estimate: bool = False) -> str:
    """'31.2%', or '~31%' when the peak under it was measured (a CPU) rather than a datasheet's."""
    if mfu is None:
        return "n/a"
    return f"~{mfu * 100:.0f}%" if estimate else f"{mfu * 100:.1f}%"


def fmt_peak(hello: HelloEvent | None) -> str | None:
    """'MFU peak 96.4 GFLOP/s per process (measured: ...)' from a hello event; None without a peak."""
    if hello is None or hello.peak_flops is None:
        return None
    v = hello.peak_flops
    value = f"{v / 1e12:,.1f} TFLOP/s" if v >= 1e12 else f"{v / 1e9:,.1f} GFLOP/s"
    return f"MFU peak {value} per process" + (f" ({hello.peak_source})" if hello.peak_source else "")


def fmt_eta(state: RunState) -> str:
    """'4:10', or '3:50-6:20' while the step rate is unstable; 'n/a' when unknown."""
    r = state.eta_range()
    if r is None:
        return "n/a"
    lo, hi = fmt_duration(r[0]), fmt_duration(r[1])
    return lo if lo == hi else f"{lo}-{hi}"


def fmt_toggles(toggles: dict[str, Any] | None) -> str:
    """{'compile': 'default', 'fused_adamw': True} -> 'compile=default fused_adamw=on'."""
    if not toggles:
        return "(as started)"
    parts = []
    for k, v in toggles.items():
        if isinstance(v, bool):
            v = "on" if v else "off"
        parts.append(f"{k}={v}")
    return " ".join(parts)


def model_summary(model: ModelInfo | None) -> str:
    """'deepseek medium · 124.5M params (31.2M active)'; a LoRA run adds '· 1.2M trainable (0.98%)'."""
    if model is None:
        return ""
    name = " ".join(x for x in (model.family, model.size) if x)
    total, active = model.total_params, model.active_params
    params = ""
    if total:
        params = f"{fmt_num(total)} params"
        if active and active < total:
            params += f" ({fmt_num(active)} active)"
        trainable = model.trainable_params
        if trainable is not None and trainable < total:  # LoRA: only the adapters train
            params += f" · {fmt_num(trainable)} trainable ({100 * trainable / total:.2g}%)"
    return " · ".join(x for x in (name, params) if x)


def estimate_line(est: EstimateInfo | None, total_steps: int | None, short: bool = False) -> str | None:
    """The early hello's estimate in words: '~0.8 GiB (optimizer 24 MiB), ~1 s per step (estimate)' ('est.
    ~0.8 GiB, ~1 s/step' with `short`, for the header)."""
    from trainer.contract.estimate import GiB, fmt_seconds, fmt_size

    if est is None:
        return None
    parts = []
    if est.total_bytes is not None:
        opt = est.optimizer_bytes
        parts.append(
            f"~{est.total_bytes / GiB:.1f} GiB"
            + (f" (optimizer {fmt_size(opt)})" if opt is not None and not short else "")
        )
    if est.step_s is not None:
        parts.append(f"~{fmt_seconds(est.step_s)}{'/step' if short else ' per step'}")
        if total_steps and not short:
            parts.append(f"~{fmt_seconds(est.step_s * total_steps)} for {total_steps} steps")
    if not parts:
        return None
    return "est. " + ", ".join(parts) if short else ", ".join(parts) + " (estimate)"


def estimate_is_slow(est: EstimateInfo | None) -> bool:
    """The early hello's estimate says a step will be slow: the trainer's `estimate` warning follows and says
    the whole estimate (a view shows it there, once)."""
    from trainer.contract.estimate import SLOW_STEP_S

    return est is not None and est.step_s is not None and est.step_s > SLOW_STEP_S


def startup_line(state: RunState) -> str | None:
    """What the run does before its first step: 'compiling the model (...) · 0:42', 'tokenizing ... 40%'."""
    with state.lock:
        p = state.startup
        if p is None:
            if (
                state.stepped
                or state.hello is None
                or state.hello.early
                or not (state.status.launching or state.status is RunStatus.RUNNING)
            ):
                return None
            line = "first step"  # built; the first step (data, warm-up) is running
        else:
            line = p.message
        if p is not None and p.pct is not None:
            line += f" {p.pct:.0f}%"
        now = state.now()
        if state.startup_since is not None and now is not None:
            line += f" · {fmt_duration(max(0.0, now - state.startup_since))}"
        return line


def precision_label(hello: HelloEvent | None, toggles: Toggles | None) -> str | None:
    """What the run computes in, given the `toggles` in force: 'auto -> bf16' while the precision the trainer
    resolved from auto is in force, else the precision ('fp16' after the tuner applied it); None before a
    hello that says it."""
    if hello is None or toggles is None:
        return None
    precision = toggles.precision
    auto = "precision" in hello.auto and hello.toggles is not None and precision == hello.toggles.precision
    return f"auto -> {precision}" if auto else precision


def energy_reason(steps: int, samples: list[DeviceEvent]) -> str:
    """Why there is no energy per token, in words, with `steps` recent step points and the latest device
    `samples`."""
    if steps < 2:
        return "not enough step events yet"
    return unavailable_reason(samples)


def loss_range(first: float | None, last: float | None, logged: int | None, spec: str = ".3f") -> str:
    """'9.512 -> 4.203', the first logged loss to the last; from one logged step a value, not a range."""

    def f(v: float | None) -> str:
        return "n/a" if v is None else format(v, spec)

    if logged == 1:
        return f"{f(last)} (one logged step)"
    return f"{f(first)} -> {f(last)}"
