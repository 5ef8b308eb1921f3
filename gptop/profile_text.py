"""A profile window's summary (the trainer's `profile` event) in words: the same lines for the headless mode,
`gptop report` and the dashboard's profile screen."""

from __future__ import annotations

from trainer.contract.events import PhaseProfile, ProfileEvent

# Below these shares a sign is not worth a line.
LAUNCH_BOUND_SHARE = 0.2
GPU_IDLE_SHARE = 0.1


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if x >= 0.01 else "<1%"


def _phase_line(p: PhaseProfile, step_total_ms: float, top: int) -> str:
    share = p.ms / step_total_ms if step_total_ms > 0 else 0.0
    head = f"{p.phase:<9} {p.ms:8.1f} ms {_pct(share):>4}"
    ops = " · ".join(f"{o.name} {_pct(o.share)}" for o in p.ops[:top])
    line = f"{head}  {ops}" if ops else head
    if p.ops:
        line += f" (in operators {_pct(p.op_share)})"
    if p.kernels:
        line += " | GPU " + " · ".join(f"{k.name} {_pct(k.share)}" for k in p.kernels[:top])
    return line


def profile_lines(p: ProfileEvent, *, top: int = 3) -> list[str]:
    """The summary: a head line, one line per phase with its top operators (and kernels on a GPU) by self time
    and their share of the phase, then the launch-bound and GPU-idle signs with what they suggest."""
    total = sum(ph.ms for ph in p.phases)
    out = [f"profile of steps {p.first}-{p.last}: mean step {p.step_ms:.1f} ms; trace {p.path}"]
    out += ["  " + _phase_line(ph, total, top) for ph in p.phases]
    if p.short_op_share is not None:
        line = f"  operators under 10 µs: {_pct(p.short_op_share)} of the step"
        if p.short_op_share >= LAUNCH_BOUND_SHARE:
            line += " (launch-bound: --compile fuses them)"
        out.append(line)
    if p.short_kernel_share is not None:
        line = f"  kernels under 10 µs: {_pct(p.short_kernel_share)} of the GPU time"
        if p.short_kernel_share >= LAUNCH_BOUND_SHARE:
            line += " (launch-bound: --compile, or CUDA graphs with --compile reduce-overhead)"
        out.append(line)
    if p.gpu_idle_share is not None:
        host = p.gpu_idle_host_share or 0.0
        line = (
            f"  GPU idle {_pct(p.gpu_idle_share)} of the step, {_pct(host)} while the host was in forward, "
            f"backward or the optimizer"
        )
        if p.gpu_idle_share >= GPU_IDLE_SHARE:
            line += (
                " (host-bound: the GPU waits for launches)"
                if host >= p.gpu_idle_share / 2
                else " (waiting on data or between phases: --prefetch, --workers)"
            )
        out.append(line)
    if p.comm_overlap is not None:
        out.append(f"  communication overlapped with compute: {_pct(p.comm_overlap)}")
    return out
