"""`--micro-batch auto`: the largest micro-batch that fits, with a safety margin.

Candidates are the powers of two (and the full per-rank batch) that divide the
per-rank batch, so gradient accumulation stays exact. Each probe is one forward
and backward; the peak memory is measured and out-of-memory is caught.

The two smallest candidates are probed first; their peaks give a line (peak
memory is close to linear in the micro-batch), and the next probe jumps straight
to the largest candidate the line predicts to fit. When it fits (the usual case:
a CPU, or a GPU with room) that is the answer after three probes instead of one
per candidate (1+2+16 sequences of work instead of 1+2+4+8+16); when it does not,
the line is refitted with the new point and the search steps down. Sizes whose
predicted peak would pass the margin are never run.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch

from .contract import capabilities
from .contract import estimate as E
from .contract.config import ConfigError, TrainConfig

if TYPE_CHECKING:
    from .dist import Group


def candidates(local_batch: int) -> list[int]:
    out = [m for m in (1 << i for i in range(20)) if m <= local_batch and local_batch % m == 0]
    if local_batch not in out:
        out.append(local_batch)
    return sorted(out)


def find_micro_batch(
    probe: Callable[[int], int],
    local_batch: int,
    capacity: int,
    margin: float = 0.1,
    log: Callable[[str], None] = lambda s: None,
    only: list[int] | None = None,
) -> int:
    """`probe(mb)` runs one training step's work at micro-batch `mb` and returns peak bytes, or raises
    torch.OutOfMemoryError. `only`: the candidates allowed (default: every divisor `candidates` gives)."""
    limit = capacity * (1.0 - margin)
    cands = sorted(only) if only else candidates(local_batch)
    points: dict[int, int] = {}  # micro-batch -> measured peak (fitting or not)
    fits: list[int] = []
    too_big: int | None = None  # smallest micro-batch known not to fit

    def attempt(mb: int) -> bool:
        nonlocal too_big
        try:
            peak = probe(mb)
        except torch.OutOfMemoryError:
            log(f"micro-batch {mb}: out of memory")
            too_big = mb if too_big is None else min(too_big, mb)
            return False
        log(f"micro-batch {mb}: peak {peak / 2**30:.2f} GiB")
        points[mb] = peak
        if peak > limit:
            too_big = mb if too_big is None else min(too_big, mb)
            return False
        fits.append(mb)
        return True

    for mb in cands[:2]:  # the line's two points
        if not attempt(mb):
            break
    while fits:
        best = max(fits)
        rest = [c for c in cands if c > best and (too_big is None or c < too_big)]
        if not rest:
            return best
        if len(points) < 2:
            nxt = rest[0]  # no line yet: one step up
        else:
            (m0, p0), (m1, p1) = sorted(points.items())[-2:]
            slope = max(0.0, (p1 - p0) / (m1 - m0))
            predicted = {c: p1 + slope * (c - m1) for c in rest}
            fitting = [c for c in rest if predicted[c] <= limit]
            if not fitting:
                log(
                    f"micro-batch {rest[0]}: predicted peak {predicted[rest[0]] / 2**30:.2f} GiB exceeds "
                    f"{limit / 2**30:.2f} GiB, stopping"
                )
                return best
            nxt = max(fitting)
        attempt(nxt)
    raise torch.OutOfMemoryError(f"even micro-batch {cands[0]} does not fit with the safety margin")


def roomy_cpu_batch(
    cfg: TrainConfig,
    family: str,
    size: str,
    *,
    local: int,
    share: int | None,
    vocab_size: int,
    log: Callable[[str], None],
) -> int | None:
    """On the CPU (`share`: this rank's share of the RAM), the whole per-rank batch `local` when its estimate
    (trainer.contract.estimate, within a factor of about 1.5 of the measured peak) takes under half of the
    share: probing would cost more than a step of work (1 + 2 + the whole batch) for an answer known in
    advance. None: probe."""
    if not share or family not in E.FAMILIES:
        return None
    est = E.estimate(
        family,
        size,
        seq_len=cfg.data.seq_len,
        global_batch=cfg.optim.global_batch,
        micro_batch=local,
        precision=cfg.toggles.precision,
        vocab_size=vocab_size,
        checkpointing=cfg.toggles.activation_checkpointing,
        **E.run_options(cfg),
    )
    if est.total_bytes > 0.5 * share:
        return None
    log(
        f"--micro-batch auto: {local}, the whole batch (estimated {est.total_bytes / E.GiB:.1f} GiB of "
        f"{share / E.GiB:.1f} GiB RAM: no probe needed)"
    )
    return local


def probe_micro_batch(
    probe_local: Callable[[int], int],
    local: int,
    *,
    capacity: int,
    group: Group | None,
    compile_mode: str,
    log: Callable[[str], None],
) -> int:
    """`find_micro_batch` for a run: `probe_local(mb)` is this rank's peak at micro-batch `mb`. Several ranks
    decide together (FSDP's forward is collective): the worst rank's peak and the smallest capacity count.
    A CUDA-graph compile mode runs without accumulation (capabilities.support): the whole batch or nothing.

    A probe's forward and backward issue collectives (FSDP's all-gathers and reduce-scatters, DDP's buffer
    broadcast): a rank that runs out of memory part-way leaves its peers' later ones unmatched, and the next
    collective anyone issues would pair with them (a hang, or another tensor's data). So after each probe the
    ranks agree, in one all-reduce on the control group and before any issues another collective, on its
    outcome and on how many collectives each issued; where those differ every rank stops with the same error."""
    margin = 0.1
    fitted: list[int] = []  # micro-batches that fitted on every rank

    def probe(mb: int) -> int:
        if group is None:
            return probe_local(mb)
        before = group.collectives()
        try:
            peak = float(probe_local(mb))
        except torch.OutOfMemoryError:
            peak = math.inf
        after = group.collectives()
        issued = float(after - before) if before is not None and after is not None else math.nan
        if math.isnan(issued):  # torch does not count them: any one-sided out-of-memory is out of step
            worst, best_neg = group.host_maxes([peak, -peak])
            out_of_step = math.isinf(worst) and math.isfinite(-best_neg)
        else:
            worst, most, fewest_neg = group.host_maxes([peak, issued, -issued])
            out_of_step = most != -fewest_neg
        if out_of_step:
            raise ConfigError(
                "--micro-batch",
                f"auto: micro-batch {mb} ran out of memory on some ranks part-way through the probe's "
                f"collectives, which leaves the ranks' collectives out of step, so no rank may issue another; "
                f"start again with {_fitted_advice(fitted)}",
            )
        if math.isinf(worst):
            raise torch.OutOfMemoryError(f"micro-batch {mb} ran out of memory on a rank")
        if worst <= capacity * (1.0 - margin):
            fitted.append(mb)
        return int(worst)

    if group is not None:
        capacity = int(group.host_min(float(capacity)))
    only = [local] if compile_mode in capabilities.CUDA_GRAPH_MODES else None
    try:
        return find_micro_batch(probe, local, capacity, margin=margin, log=log, only=only)
    except torch.OutOfMemoryError:
        if only is None:
            raise
        raise ConfigError(
            "--compile",
            f"{compile_mode} uses CUDA graphs, which run without gradient "
            f"accumulation, and the whole per-rank batch ({local}) does not fit: use "
            f"--compile default or max-autotune-no-cudagraphs, or a smaller "
            f"--global-batch",
        ) from None


def _fitted_advice(fitted: list[int]) -> str:
    if fitted:
        return f"--micro-batch {max(fitted)} (the largest that fitted on every rank before it)"
    return "a smaller --micro-batch (none fitted on every rank before it)"


def check(dev: Any, quick: bool) -> Any:
    """gptop doctor's `autobatch` path: `find_micro_batch` with a real probe (forward and backward of a
    small model at micro-batch m, the peak read by this device's memory meter), against a capacity set
    between the measured peaks of 4 and 8: it must choose 4. On CUDA, a probe that really runs out of memory
    is caught, and the device's memory is usable afterwards."""
    from .contract.doctor import Outcome
    from .memory import make_meter

    device = dev.torch_device
    if dev.is_cuda:
        torch.cuda.set_device(device)
    meter = make_meter(device)
    model = _WideActivations().to(device)
    rows = 512
    peaks: dict[int, int] = {}

    def measure(mb: int) -> int:
        if mb not in peaks:
            meter.reset_peak()
            model(torch.randn(mb * rows, model.width, device=device)).square().mean().backward()
            model.zero_grad(set_to_none=True)
            peaks[mb] = meter.peak()
        return peaks[mb]

    for mb in (1, 2, 4, 8):
        measure(mb)
    if not peaks[1] < peaks[2] < peaks[4] < peaks[8]:
        return Outcome.verdict(
            False, f"peaks {peaks} do not grow with the micro-batch", "the memory meter does not see the probe's memory"
        )
    capacity = int((peaks[4] + peaks[8]) / 2 / 0.9)
    chosen = find_micro_batch(measure, 16, capacity, margin=0.1)
    problems = [] if chosen == 4 else [f"chose {chosen}, not 4"]
    oom_note = "no real out-of-memory on the CPU (the OS would kill the process)"
    if dev.is_cuda:
        free, _ = torch.cuda.mem_get_info(device)

        def exhausting(mb: int) -> int:
            if mb >= 8:
                torch.empty(free + (8 << 30), dtype=torch.uint8, device=device)  # more than the device has
            return measure(mb)

        try:
            got = find_micro_batch(exhausting, 16, 1 << 62, margin=0.1)
        except torch.OutOfMemoryError:
            got = None
        after = torch.empty(256 << 20, dtype=torch.uint8, device=device)  # the memory is usable again
        del after
        oom_note = f"a real out-of-memory at 8 was caught and chose {got}"
        if got != 4:
            problems.append(f"with a real out-of-memory at 8 it chose {got}, not 4")
    peak_txt = ", ".join(f"{m}: {p / 2**20:.0f} MiB" for m, p in sorted(peaks.items()))
    observed = f"peaks {peak_txt}; capacity between 4 and 8 -> chose {chosen}; {oom_note}"
    return Outcome.verdict(not problems, observed, "; ".join(problems) or "", peaks=peaks, chosen=chosen)


class _WideActivations(torch.nn.Module):
    """A probe's model for the doctor: wide activations for little compute (each micro-batch of 512 rows
    keeps about 24 MiB for backward), so a CPU resident-set peak's noise does not decide the answer."""

    width, factor = 64, 64

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(self.width, self.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.nn.functional.gelu(self.inp(x).repeat(1, self.factor))
        return wide.view(x.shape[0], self.factor, self.width).mean(1)
