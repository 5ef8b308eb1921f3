"""Several ranks, one run: the torch.distributed pieces the training loop uses.

A run launched by torchrun (WORLD_SIZE > 1) gets a process group (NCCL on
CUDA, gloo on the CPU), the model wrapped for data parallelism (DDP, or FSDP2
`fully_shard` with the precision toggle mapped to its MixedPrecisionPolicy),
and a small control plane: `agree`, the element-wise MAX of a few host integers
over the ranks that trainer.commands uses to act on every command on the same step
everywhere. It is one tiny collective per step, on a CPU tensor over gloo (a
separate gloo group when the training backend is NCCL, so it never synchronizes
the GPU); about a millisecond on this 2-core machine's loopback, negligible next
to a step that is worth spreading over several devices.

comm time. With DDP on gloo a communication hook times the gradient
all-reduces: `comm_ms` is the wall time during which at least one of them
was in flight. It overlaps `backward` (it is part of it, not an extra phase);
a rank that waits for a slower peer shows a long `comm_ms`. With NCCL the
host cannot see when a collective finishes without synchronizing, and FSDP2's
all-gathers and reduce-scatters have no hook: there `comm_ms` is not reported.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from .contract.config import ConfigError

PARALLEL_MODES = ("ddp", "fsdp")
DEFAULT_TIMEOUT_S = 600.0  # a collective's timeout in a run: a stalled rank fails the run after this


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) for one process."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)))


def rank_device(requested: str, world: int, local_rank: int) -> str:
    """The device string a rank trains on: cuda:LOCAL_RANK when several ranks use CUDA."""
    if world <= 1:
        return requested
    if requested.startswith("cuda:"):
        raise ConfigError(
            "--device",
            f"{requested}: with several ranks each one uses cuda:LOCAL_RANK; "
            f"pass --device cuda (or auto) and pick GPUs with CUDA_VISIBLE_DEVICES",
        )
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return f"cuda:{local_rank}"
    return requested


def die_with_parent() -> None:
    """Linux: SIGTERM this rank (a graceful, agreed stop) if its launcher (torchrun) dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def host_max(values: list[int], ctrl: Any = None) -> list[int]:
    """Element-wise MAX of a few host integers over the ranks, on the gloo group `ctrl` (None: the default
    group, when it is gloo): the per-step agreement of trainer.commands."""
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctrl)
    return [int(v) for v in t.tolist()]


def group_timeout(group: Any = None) -> datetime.timedelta | None:
    """The timeout `group`'s collectives run under (None: the default group, as init_process_group set it);
    None where torch does not say. torch has no public getter: each backend's options hold it."""
    pg = group if group is not None else dist.group.WORLD
    for device in ("cuda", "cpu"):  # the backend that runs the program's collectives first
        try:
            backend = pg._get_backend(torch.device(device))
        except RuntimeError:  # no backend for that device type in this group
            continue
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


def control_group() -> Any:
    """A gloo group for host integers beside a default group that someone else initialized (the user's
    program, for gptop.integrations); None when the default group is gloo already. Collective: every rank
    calls it once, at the same point. It times out with the program's own group (torch would give a gloo
    group 30 minutes, holding every rank that long when one stalls)."""
    if dist.get_backend() == "gloo":
        return None
    timeout = group_timeout() or datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    return dist.new_group(backend="gloo", timeout=timeout)


class Group:
    """The process group of a multi-rank run and its control plane."""

    def __init__(self, rank: int, world: int, local_rank: int, device: torch.device):
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.ctrl: Any = None  # gloo group for CPU control tensors (None: the default group is gloo)

    def init(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """The process group, and over NCCL the gloo control group, both timing out after `timeout_s`."""
        if dist.is_initialized():
            return
        timeout = datetime.timedelta(seconds=timeout_s)
        kwargs: dict[str, Any] = {"backend": self.backend, "timeout": timeout}
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            kwargs["device_id"] = self.device
        dist.init_process_group(**kwargs)
        if self.backend != "gloo":
            self.ctrl = dist.new_group(backend="gloo", timeout=timeout)

    def destroy(self) -> None:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass

    # ------------------------------------------------------------ collectives
    def agree(self, values: list[int]) -> list[int]:
        """Element-wise MAX over the ranks of a few host integers (the per-step command agreement)."""
        return host_max(values, self.ctrl)

    def host_max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctrl)
        return float(t.item())

    def host_maxes(self, values: list[float]) -> list[float]:
        """Element-wise MAX over the ranks of a few host floats, on the control group (MIN: negate)."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctrl)
        return [float(v) for v in t.tolist()]

    def collectives(self) -> int | None:
        """How many collectives this rank has issued on the training group (torch's sequence number of the
        group); ranks whose counts differ are out of step. None where torch does not count them."""
        try:
            return int(dist.group.WORLD._get_sequence_number_for_group())
        except (AttributeError, RuntimeError):
            return None

    def host_min(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.ctrl)
        return float(t.item())

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place SUM over ranks of a device tensor (gloo has no AVG)."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def barrier(self) -> None:
        dist.barrier(group=self.ctrl)


def is_comm_error(e: BaseException) -> bool:
    """A failed collective: usually because another rank died (its own error tells why)."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return any(
        s in text
        for s in (
            "Connection closed by peer",
            "Connection reset by peer",
            "remote worker",
            "Broken pipe",
            "NCCL communicator was aborted",
            "ProcessGroupNCCL",
            "ProcessGroupGloo",
            "gloo/transport",
        )
    )


# ----------------------------------------------------------------- wrapping
def find_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks: the largest ModuleList of modules with parameters."""
    best: list[torch.nn.Module] = []
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList):
            blocks = [b for b in m if any(True for _ in b.parameters())]
            if len(blocks) > len(best):
                best = blocks
    return best


def fsdp2() -> tuple[Any, Any]:
    """FSDP2's (fully_shard, MixedPrecisionPolicy) on every torch pyproject.toml allows: public in
    torch.distributed.fsdp since 2.6, in torch.distributed._composable.fsdp in 2.5."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def fsdp_precision(precision: str):
    """(MixedPrecisionPolicy or None, autocast dtype): FSDP2 casts at module boundaries instead of autocast."""
    _, MixedPrecisionPolicy = fsdp2()

    if precision in ("bf16", "fp8-tensorwise", "fp8-rowwise"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), None
    if precision == "fp16":
        raise ConfigError(
            "--precision",
            "fp16 with --parallel fsdp is not supported (its loss scaler would "
            "need sharded inf checks); use bf16, or --parallel ddp",
        )
    return None, None  # fp32 / tf32: full precision


def apply_fsdp(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """FSDP2: shard each transformer block, then the root (embeddings, final norm, head)."""
    fully_shard, _ = fsdp2()
    mp, _ = fsdp_precision(precision)
    kwargs: dict[str, Any] = {} if mp is None else {"mp_policy": mp}
    for block in find_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


class CommTimer:
    """DDP communication hook (gloo): times the gradient all-reduces of each step.

    Same arithmetic as DDP's default (`allreduce_hook`: divide by the world size,
    all-reduce SUM). `take_ms()` returns the wall time during which at least one
    bucket was in flight since the last call (the union of the intervals).
    """

    def __init__(self, world: int):
        self.world = world
        self._spans: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def register(self, ddp: torch.nn.Module) -> None:
        def hook(state, bucket):
            return self._hook(state, bucket)

        # DDP checks the annotations; this module's are strings (postponed evaluation), so set real ones.
        hook.__annotations__ = {
            "state": object,
            "bucket": dist.GradBucket,
            "return": torch.futures.Future[torch.Tensor],
        }
        ddp.register_comm_hook(None, hook)

    def _hook(self, state: Any, bucket: Any) -> torch.futures.Future:
        t0 = time.perf_counter()
        buf = bucket.buffer()
        buf.div_(self.world)
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            with self._lock:
                self._spans.append((t0, time.perf_counter()))
            return f.value()[0]

        return fut.then(done)

    def take_ms(self) -> float | None:
        with self._lock:
            spans, self._spans = sorted(self._spans), []
        if not spans:
            return None
        total, (a, b) = 0.0, spans[0]
        for s, e in spans[1:]:
            if s > b:
                total += b - a
                a, b = s, e
            else:
                b = max(b, e)
        return (total + b - a) * 1e3


def _nccl_rank(rank: int, world: int, port: int) -> None:
    """One rank of check_nccl: the process group as Group.init forms it, one all-reduce, checked."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    group = Group(rank, world, rank, torch.device(f"cuda:{rank}"))
    group.init(timeout_s=60.0)
    try:
        t = torch.full((1 << 20,), float(rank + 1), device=group.device)
        group.sum_(t)
        want = world * (world + 1) / 2
        if not bool((t == want).all()):
            raise AssertionError(f"rank {rank}: all-reduce gave {float(t[0])}, not {want}")
        if group.agree([rank]) != [world - 1]:
            raise AssertionError(f"rank {rank}: the control plane's agreement is wrong")
    finally:
        group.destroy()


def check_nccl(dev: Any, quick: bool) -> Any:
    """gptop doctor's `nccl` path: two ranks on two GPUs form the group the trainer forms (NCCL, with the
    gloo control plane) and all-reduce to the right sum."""
    import socket

    import torch.multiprocessing as mp

    from .contract.doctor import Outcome

    if not dev.is_cuda:
        return Outcome.skip("NCCL is for CUDA devices")
    count = torch.cuda.device_count()
    if count < 2:
        return Outcome.skip(f"{count} GPU visible: two NCCL ranks need two GPUs")
    if not dist.is_available() or not dist.is_nccl_available():
        return Outcome.verdict(False, "torch.distributed has no NCCL", "this torch build lacks NCCL")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(_nccl_rank, args=(2, port), nprocs=2, join=True)
    except Exception as e:
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        return Outcome.verdict(False, f"two ranks failed: {first}"[:300], "the NCCL all-reduce failed")
    return Outcome.verdict(True, "2 ranks (cuda:0, cuda:1) all-reduced 1M floats to the right sum", "")
