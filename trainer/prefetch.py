"""Prepare the micro-batches of upcoming steps while the current step computes.

`Prefetcher` hands the training loop (batch_index, micro_index, x, y) in exact order, already on the
training device. With `depth` > 0 a background thread (and optionally a small pool of `workers`)
builds them ahead, so data loading overlaps compute instead of adding to the step.

Moving a batch to the device is the one hardware-specific part and sits behind `BatchCopier`:
`CpuCopier` is a plain `.to(device)`; `CudaCopier` pins host memory, issues the copy on a side
stream from the prefetch thread, and in the consumer makes the compute stream wait on that copy's
event and `record_stream`s the tensors so the caching allocator never reuses them early. Its CUDA
calls go through `CudaOps`, so tests drive the same logic with a fake.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from .contract.config import ConfigError
from .batches import BatchSampler


# --- moving batches to the device ---------------------------------------------------------------


class BatchCopier:
    """Moves a CPU micro-batch to the device: `prepare` in the producer thread, `finish` in the consumer."""

    def prepare(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        """Start moving (x, y) to the device; may return before the copy is done."""
        raise NotImplementedError

    def finish(self, prepared: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Make (x, y) safe to use on the consumer's current stream and return them."""
        raise NotImplementedError


class CpuCopier(BatchCopier):
    """Synchronous `.to(device)`; a no-op on the CPU."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def prepare(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.to(self.device), y.to(self.device)

    def finish(self, prepared: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return prepared


class CudaOps:
    """The CUDA calls `CudaCopier` makes: the only torch.cuda code in the data path."""

    def __init__(self, device: torch.device):
        self.device = device

    def set_device(self, device: torch.device) -> None:
        """Make `device` the calling thread's current CUDA device (a new thread's is device 0)."""
        torch.cuda.set_device(device)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory()

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)


@dataclass
class _InFlight:
    x: torch.Tensor
    y: torch.Tensor
    done: Any  # event recorded on the copy stream after the copies
    host: tuple[torch.Tensor, ...]  # the pinned sources, kept alive until the consumer has the batch


class CudaCopier(BatchCopier):
    """Pinned host memory, asynchronous copy on a side stream, event-ordered hand-over to the compute stream."""

    def __init__(self, device: torch.device | str, ops: CudaOps | None = None):
        self.device = torch.device(device)
        self.ops = ops if ops is not None else CudaOps(self.device)
        self.stream = self.ops.new_stream()
        self._bound = threading.local()

    def prepare(self, x: torch.Tensor, y: torch.Tensor) -> _InFlight:
        # Producer threads (the prefetch thread, the workers) start on device 0: pinning, a stream context or
        # an event there first would create a CUDA context on GPU 0 for every other rank and --device cuda:N.
        if getattr(self._bound, "device", None) != self.device:
            self.ops.set_device(self.device)
            self._bound.device = self.device
        xh, yh = self.ops.pin(x), self.ops.pin(y)
        with self.ops.use_stream(self.stream):
            xd, yd = self.ops.copy(xh), self.ops.copy(yh)
            done = self.ops.new_event()
            done.record(self.stream)
        return _InFlight(xd, yd, done, (xh, yh))

    def finish(self, prepared: _InFlight) -> tuple[torch.Tensor, torch.Tensor]:
        consumer = self.ops.current_stream()
        consumer.wait_event(prepared.done)  # kernels queued after this see the copied data
        self.ops.record_stream(prepared.x, consumer)  # memory allocated on the side stream, used on this one
        self.ops.record_stream(prepared.y, consumer)
        return prepared.x, prepared.y


def choose_copier(device: torch.device | str) -> BatchCopier:
    """CudaCopier for CUDA devices, CpuCopier otherwise."""
    device = torch.device(device)
    return CudaCopier(device) if device.type == "cuda" else CpuCopier(device)


# --- the prefetcher ------------------------------------------------------------------------------


@dataclass
class _Failure:
    error: BaseException


class Prefetcher:
    """Prepares the micro-batches of upcoming steps ahead of the training loop.

    `get()` returns (batch_index, micro_index, x, y) for batch_index = start, start+1, ... and
    micro_index 0 .. accum-1, on `device`. `depth` counts optimizer steps: up to `depth` steps'
    worth of micro-batches wait ready (0: build synchronously inside `get()`). With `workers` > 0
    a pool of that many threads builds batches in parallel (up to `workers` more in flight);
    results are still delivered in order.

    To continue from another step (e.g. after a rollback), close this one and make a new one:
    `close()` is prompt, idempotent and never blocks on a full queue; the threads are daemons.
    """

    _POLL_S = 0.05

    def __init__(
        self,
        sampler: BatchSampler,
        micro_batch: int,
        start_batch_index: int,
        device: torch.device | str,
        depth: int,
        workers: int = 0,
        copier: BatchCopier | None = None,
    ):
        if depth < 0:
            raise ConfigError("--prefetch", f"must be at least 0, got {depth}")
        if workers < 0:
            raise ConfigError("--workers", f"must be at least 0, got {workers}")
        self.sampler = sampler
        self.micro_batch = micro_batch
        self.accum = sampler.accumulation_steps(micro_batch)
        self.device = torch.device(device)
        self.depth = depth
        self.workers = workers
        self.copier = copier if copier is not None else choose_copier(self.device)
        self._order = self._indices(start_batch_index)
        self._closed = False
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth * self.accum))
        self._pool: ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        if depth > 0:
            if workers > 0:
                self._pool = ThreadPoolExecutor(workers, thread_name_prefix="gptop-batch")
            self._thread = threading.Thread(target=self._produce, name="gptop-prefetch", daemon=True)
            self._thread.start()

    def _indices(self, start: int) -> Iterator[tuple[int, int]]:
        for b in itertools.count(start):
            for k in range(self.accum):
                yield b, k

    def _build(self, b: int, k: int) -> Any:
        x, y = self.sampler.micro_batch(b, k, self.micro_batch)
        return self.copier.prepare(x, y)

    def _produce(self) -> None:
        try:
            if self._pool is None:
                for b, k in self._order:
                    if self._stop.is_set() or not self._put((b, k, self._build(b, k))):
                        return
            else:
                pending: collections.deque[tuple[int, int, Future]] = collections.deque()
                while not self._stop.is_set():
                    while len(pending) < self.workers:
                        b, k = next(self._order)
                        pending.append((b, k, self._pool.submit(self._build, b, k)))
                    b, k, fut = pending.popleft()
                    if not self._put((b, k, fut.result())):
                        return
        except BaseException as e:  # delivered to the consumer by get()
            if not self._stop.is_set():
                self._put(_Failure(e))

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=self._POLL_S)
                return True
            except queue.Full:
                pass
        return False

    def get(self) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """The next (batch_index, micro_index, x, y), on the device, in order."""
        if self._closed:
            raise RuntimeError("Prefetcher is closed")
        if self._thread is None:
            b, k = next(self._order)
            prepared = self._build(b, k)
        else:
            while True:
                try:
                    item = self._queue.get(timeout=self._POLL_S)
                    break
                except queue.Empty:
                    if self._closed:
                        raise RuntimeError("Prefetcher is closed") from None
                    if not self._thread.is_alive() and self._queue.empty():
                        raise RuntimeError("the prefetch thread stopped without a batch") from None
            if isinstance(item, _Failure):
                self.close()
                raise item.error
            b, k, prepared = item
        x, y = self.copier.finish(prepared)
        return b, k, x, y

    def __iter__(self) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        while True:
            yield self.get()

    def close(self) -> None:
        """Stop the threads and drop prepared batches; prompt and idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def check(dev: Any, quick: bool, *, copier_factory: Any = None, device: Any = None) -> Any:
    """gptop doctor's `prefetch` path: micro-batches through the prefetcher this device uses (CudaCopier:
    pinned memory, a side stream; CpuCopier on the CPU), from a thread and from workers, must equal the
    synchronous path's, in order, and still read back intact after later batches were copied (on CUDA each
    is checksummed on the compute stream behind a long kernel: memory the allocator reused too early would
    change it)."""
    import numpy as np

    from .contract.doctor import Outcome

    device = torch.device(device) if device is not None else dev.torch_device  # tests: fake CUDA ops on CPU
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    make_copier = copier_factory or (lambda: choose_copier(device))
    tokens = np.random.default_rng(0).integers(0, 50_000, size=200_000).astype(np.int64)
    sampler = BatchSampler(tokens, 256, 16, seed=3)
    n = 24 if quick else 64
    reference = Prefetcher(sampler, 4, 0, "cpu", depth=0)
    want = [reference.get() for _ in range(n)]
    reference.close()
    weights = torch.arange(1, 257, dtype=torch.float64, device=device)
    load = torch.randn(1024, 1024, device=device) if cuda else None
    problems = []
    for depth, workers in ((2, 0), (2, 2)):
        sums = []
        copier = make_copier()
        with Prefetcher(sampler, 4, 0, device, depth=depth, workers=workers, copier=copier) as p:
            for i in range(n):
                b, k, x, y = p.get()
                if (b, k) != want[i][:2]:
                    problems.append(f"depth {depth} workers {workers}: batch {i} came as {b}/{k}")
                    break
                if x.device != device:
                    problems.append(f"batch on {x.device}, not {device}")
                    break
                if load is not None:  # keep the compute stream busy while later copies land
                    for _ in range(4):
                        load = (load @ load) * (1.0 / 1024)
                sums.append(((x.double() * weights).sum(), (y.double() * weights).sum()))
                del x, y  # freed on the consumer side: reuse must wait for it
        got = torch.stack([torch.stack(s) for s in sums]).cpu() if sums else torch.zeros(0, 2)
        host = weights.cpu()
        expect = torch.tensor(
            [[float((w[2].double() * host).sum()), float((w[3].double() * host).sum())] for w in want[: len(sums)]],
            dtype=torch.float64,
        )
        if not torch.equal(got, expect):
            bad = int((got != expect).any(dim=1).nonzero()[0]) if got.shape == expect.shape else -1
            problems.append(f"depth {depth} workers {workers}: batch {bad} differs from the synchronous path")
    kind = type(copier).__name__
    observed = (
        f"{n} micro-batches x 2 ways ({kind}) equal to the synchronous path" if not problems else "; ".join(problems)
    )
    return Outcome.verdict(
        not problems, observed, "prefetched data differs from the synchronous path", batches=n, copier=kind
    )
