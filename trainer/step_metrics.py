"""What the training loop reports about its steps (after torchtitan's MetricsProcessor).

Every step: the light `progress` event (no synchronization). Every log interval: the `step` event, from
what the steps left on the device (the loss summed over the interval, the last gradient norm), read back
once per interval, with the timer's phases, the throughput, MFU against the device's peak and the memory
peak. `MfuCheck` keeps the peak honest: a measured CPU peak the run comes close to is measured again, one
the run exceeds is dropped.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from . import dist as D
from . import optim
from .channel import Channel
from .checkpointer import Progress
from .contract.device import DeviceInfo
from .contract.states import WarningKind
from .flops import REMEASURE_MFU, cpu_dtype, forget_cpu_peak, mfu, peak
from .memory import MemoryMeter
from .moe import MoEBalancer
from .timing import StepTimer, interval_means


class MfuCheck:
    """MFU of the run, or None. A measured (CPU) peak that the run comes within reach of (MFU above
    REMEASURE_MFU) is measured again once, the best measurement kept: a peak taken on a busy machine is too
    low. Above 1 the peak is wrong: say so once, drop that cached peak so the next run measures again, and
    report null from here on."""

    def __init__(
        self,
        dev: DeviceInfo,
        precision: str,
        *,
        peak_flops: float | None,
        procs: int,
        world: int,
        flops_per_token: float,
        emit0: Callable[..., None],
    ):
        self.dev, self.precision, self.procs, self.world = dev, precision, procs, world
        self.peak_flops, self.flops_per_token, self.emit0 = peak_flops, flops_per_token, emit0
        self.remeasured = False

    def value(self, tokens_per_s: float | None) -> float | None:
        return mfu(tokens_per_s, self.flops_per_token, self.peak_flops * self.world if self.peak_flops else None)

    def __call__(self, tokens_per_s: float | None) -> float | None:
        got = self.value(tokens_per_s)
        if got is not None and got > REMEASURE_MFU and not self.dev.is_cuda and not self.remeasured:
            self.remeasured = True
            old = self.peak_flops
            again = peak(self.dev, self.precision, procs=self.procs, remeasure=True)
            self.peak_flops = max(old or 0.0, again.flops or 0.0)
            self.emit0(
                "log",
                message=f"MFU {got:.0%} is close to the measured CPU peak "
                f"({old / 1e9:,.1f} GFLOP/s per process): measured it again, "
                f"{(again.flops or 0) / 1e9:,.1f}; using {self.peak_flops / 1e9:,.1f}",
                source="trainer",
            )
            got = self.value(tokens_per_s)
        if got is None or got <= 1.0:
            return got
        where = "the datasheet peak" if self.dev.is_cuda else "the measured CPU matmul peak"
        msg = (
            f"MFU would be {got:.2f} (> 1): {where} ({self.peak_flops / 1e9:,.1f} GFLOP/s per process) is "
            f"below what the model achieves, so it is not a peak; MFU is not reported for the rest of this run"
        )
        if not self.dev.is_cuda:
            dtypes = {cpu_dtype(self.precision), torch.float32}  # a bf16 peak is never below fp32's
            dropped = [forget_cpu_peak(d, cpu_name=self.dev.name, procs=self.procs) for d in dtypes]
            if any(dropped):
                msg += " and the cached peak is dropped (the next run measures it again, best on an idle machine)"
        self.emit0("warning", message=msg, kind=WarningKind.PEAK_FLOPS)
        self.peak_flops = None
        return None


class StepMetrics:
    """The interval's sums on the device, and the events made from them. Owned by the Trainer: `add_step`
    after each optimizer step, `progress` at each step's end, `flush` on log steps, `reset` after a
    rollback."""

    def __init__(
        self,
        channel: Channel,
        *,
        rank: int,
        world: int,
        group: D.Group | None,
        device: torch.device,
        meter: MemoryMeter,
        balancer: MoEBalancer | None,
        tokens_per_step: int,
        mfu: MfuCheck,
    ):
        self.channel, self.rank, self.world, self.group, self.device = channel, rank, world, group, device
        self.meter, self.balancer, self.tokens_per_step, self.mfu = meter, balancer, tokens_per_step, mfu
        self.reset()
        self.t_boundary = time.perf_counter()

    def reset(self) -> None:
        """A new interval: nothing summed, the memory peak from here."""
        self.loss_sum = torch.zeros((), device=self.device)
        self.grad_norm = torch.zeros((), device=self.device)
        self.comm_ms: list[float | None] = []
        self.steps = 0
        self.t0 = time.perf_counter()
        self.meter.reset_peak()

    def add_step(self, loss: torch.Tensor, grad_norm: torch.Tensor, comm_ms: float | None) -> None:
        """One optimizer step's loss (summed over its micro-batches) and gradient norm, kept on the device."""
        self.comm_ms.append(comm_ms)
        self.loss_sum += loss
        self.grad_norm = grad_norm.detach()
        self.steps += 1

    def progress(self, progress: Progress) -> None:
        """Every step: the light `progress` event on the live channel (no loss, no synchronization; the
        host's time since the last step boundary), so the counter, rate and ETA move between log steps."""
        now = time.perf_counter()
        step_ms = (now - self.t_boundary) * 1e3
        self.t_boundary = now
        if self.rank == 0:
            self.channel.emit_live("progress", step=progress.step, tokens=progress.tokens, step_ms=step_ms)

    def flush(
        self, progress: Progress, optimizer: torch.optim.Optimizer, timer: StepTimer, check_finite: Callable[[], None]
    ) -> None:
        """The interval's `step` event (the one read-back of the interval; `check_finite` runs after it,
        before anything is reported), then a new interval."""
        n = self.steps
        if n == 0:
            return
        if self.group is not None:  # the global batch's loss: mean over ranks
            self.group.sum_(self.loss_sum)
            self.loss_sum /= self.world
        loss = (self.loss_sum / n).item()  # the one sync per log interval
        grad_norm = self.grad_norm.item()
        check_finite()
        wall = time.perf_counter() - self.t0
        timed_ms, phases, idle = interval_means(timer.collect())
        tokens_per_s = n * self.tokens_per_step / wall if wall > 0 else None
        step_ms = timed_ms if timed_ms is not None else wall * 1e3 / n
        fields: dict[str, Any] = dict(
            step=progress.step,
            tokens=progress.tokens,
            loss=loss,
            lr=float(optimizer.param_groups[0]["lr"]),
            grad_norm=grad_norm,
            step_ms=step_ms,
            phases_ms=phases,
            tokens_per_s=tokens_per_s,
            mfu=self.mfu(tokens_per_s),
            mem_bytes=self.meter.peak(),
            interval_steps=n,
            wall_ms=wall * 1e3 / n,
            optim_state_bytes=optim.state_bytes(optimizer),
        )
        fields["batch"] = progress.batch_cursor - 1  # global batch index of the last step (data-order checks)
        if idle is not None:
            fields["gpu_idle_ms"] = idle
        comm = [c for c in self.comm_ms if c is not None]
        if comm:
            fields["comm_ms"] = sum(comm) / len(comm)
        if self.balancer is not None:
            fields["expert_load"] = self.balancer.load()
        self.channel.emit("step", **fields)
        self.reset()
