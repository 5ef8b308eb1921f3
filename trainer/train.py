"""The instrumented, resumable training loop, assembled from components (after torchtitan's trainer):

    trainer.startup       `Trainer.setup`: from the config to the first step, composing trainer.build's
                          builders (the resolved config, the data, the model and its precision and parallel
                          wrapping, and the hello's fields)
    trainer.autobatch     what `--micro-batch auto` becomes
    trainer.checkpointer  the state a checkpoint holds, verified finite; resume and rollback targets
    trainer.compile_watch what torch.compile built, recompiled or gave up on, at the step where it happened
    trainer.commands      commands at step boundaries, one path (the agreement is a no-op for one rank)
    trainer.nonfinite     a step's non-finite flags on the device, read back before a state is used; the NaN policy
    trainer.optim         AdamW's groups, the learning-rate schedule, a step a non-finite step skips
    trainer.profiler      torch.profiler windows
    trainer.step_metrics  the per-step progress event and the per-interval step event (loss, timing, MFU)
    trainer.faults        test-only fault injection (the hidden --fault flag)
    trainer.runner        main_run: one run, every failure an error event and an exit code

One optimizer step = `accum` micro-steps of forward+backward, then the optimizer. Everything the loop
needs per step stays on the device: the loss, the gradient norm and the step's non-finite flags are
device tensors, read back only on log steps and before an eval or a checkpoint (one synchronization per
log interval, which the CUDA timer piggybacks on). A non-finite loss or gradient norm is a non-finite
step: its optimizer update is not taken (trainer.optim, on the device), and at the next read-back the
NaN policy rolls the run back to the newest checkpoint that verifies, or stops it. A checkpoint never
holds a non-finite state: the checkpointer verifies it before writing, and a state that fails is a
non-finite step too.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch

from . import build, faults, optim
from . import dist as D
from .channel import Channel
from .checkpointer import NonFiniteState, Progress
from .contract.config import AUTO, TrainConfig
from .contract.device import DeviceInfo
from .contract.events import MAX_STEPS, CompileWarning
from .contract.runlock import RunLock
from .contract.states import ErrorKind
from .device_probe import detect
from .inductor_cache import OwnCache
from .memory import make_meter
from .nonfinite import NonFiniteGuard, NonFiniteStep, step_flags
from .startup import TrainerStartup
from .step_metrics import MfuCheck, StepMetrics
from .timing import make_timer

EXIT_OK, EXIT_CRASH, EXIT_CONFIG, EXIT_OOM, EXIT_NAN, EXIT_COMPILE = 0, 1, 2, 3, 4, 5
EXIT_NO_CHECKPOINT, EXIT_CORRUPT_CHECKPOINT = 6, 7  # --resume found nothing / nothing that verifies
EXIT_DISK = 8  # a write failed: filesystem full or read-only


class Stop(Exception):
    """Raised to end the run early with an exit code after the error was reported."""

    def __init__(self, code: int):
        self.code = code


class Trainer(TrainerStartup):
    def __init__(self, cfg: TrainConfig, dev: DeviceInfo | None = None):
        self.cfg = cfg
        self.rank, self.world, self.local_rank = D.env_world()
        self.dev = dev or detect(D.rank_device(cfg.run.device, self.world, self.local_rank))
        self.device = self.dev.torch_device
        self.progress = Progress()
        self.channel: Channel | None = None
        self.group: D.Group | None = None  # several ranks: the process group and control plane
        self.ddp: torch.nn.Module | None = None  # the DDP wrapper (--parallel ddp, several ranks)
        self.comm: D.CommTimer | None = None
        self.faults = faults.Faults(cfg.run.fault, self.rank)
        self.resumed_from: str | None = None
        self.run_lock: RunLock | None = None
        self.compile_report = None  # trainer.compile_watch.CompileReport of a compiled run
        self.own_cache: OwnCache | None = None  # the run's own inductor cache, after a corrupt shared artefact
        self.notices: list[str] = []  # warnings found before the channel exists
        self.auto_options = [
            name
            for name, value in (
                ("size", cfg.model.size),
                ("micro_batch", cfg.toggles.micro_batch),
                ("precision", cfg.toggles.precision),
            )
            if value == AUTO
        ]
        self.created_dirs: list[Path] = []  # the run directory and parents this trainer made (setup)

    # ------------------------------------------------------------------ events and logs
    def log(self, msg: str) -> None:
        who = f"trainer rank {self.rank}" if self.world > 1 else "trainer"
        print(f"[{who}] {msg}", flush=True)

    def emit0(self, type: str, **fields: Any) -> None:
        """Events that describe the whole run (hello, checkpoint, eval, done) come from rank 0 only."""
        if self.rank == 0 and self.channel is not None:
            self.channel.emit(type, **fields)

    def emit_node(self, type: str, **fields: Any) -> None:
        """Events every node's gptop needs (hello: max steps, the device, the model) come from the first rank
        of each node: a second node's gptop only hears its own ranks."""
        if self.local_rank == 0 and self.channel is not None:
            self.channel.emit(type, **fields)

    def _warn(self, message: str) -> None:
        """A warning of this rank (a skipped checkpoint is seen by every rank that read it)."""
        self.channel.emit("warning", message=message)
        self.log(f"warning: {message}")

    # ------------------------------------------------------------ the model's computation
    def _sync_grads(self, last_micro: bool) -> contextlib.AbstractContextManager:
        """Gradient accumulation without communication until the last micro-batch (used with `with`)."""
        if self.ddp is not None and not last_micro:
            return self.ddp.no_sync()
        if self.parallel == "fsdp":
            self.raw_model.set_requires_gradient_sync(last_micro)
        return contextlib.nullcontext()

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, reason: str = "interval") -> Path:
        """Collective with several ranks. A state that is not finite is not written: a non-finite step."""
        self.nonfinite.check()
        t = time.perf_counter()
        p = self.progress
        try:
            path = self.ckpt.save(p)
        except NonFiniteState:
            raise NonFiniteStep(max(p.step - 1, 0), p.batch_cursor - 1, "weights or optimizer state") from None
        seconds = time.perf_counter() - t
        self.emit0("checkpoint", step=p.step, path=str(path), seconds=seconds, reason=reason, tokens=p.tokens)
        if self.rank == 0:
            self.log(f"checkpoint {path.name} ({seconds:.2f} s, {reason})")
        return path

    # --------------------------------------------------------------------- loop
    def _loss(
        self, x: torch.Tensor, y: torch.Tensor, batch_index: int, micro_index: int, model: torch.nn.Module | None = None
    ) -> torch.Tensor:
        from .objectives import loss_fn

        gen = None
        if self.bundle.objective == "llada":
            gen = torch.Generator().manual_seed(hash_seed(self.cfg.optim.seed, batch_index, micro_index, self.rank))
        return loss_fn(self.bundle, self.model if model is None else model, x, y, generator=gen)

    def _new_prefetcher(self):
        from .prefetch import Prefetcher

        t = self.cfg.toggles
        return Prefetcher(
            self.sampler, self.micro_batch, self.progress.batch_cursor, self.device, depth=t.prefetch, workers=t.workers
        )

    def run(self) -> int:
        cfg = self.cfg
        self.timer = make_timer(self.device, cfg.log.timing)
        self.prefetcher = self._new_prefetcher()
        mfu = MfuCheck(
            self.dev,
            cfg.toggles.precision,
            peak_flops=self.peak_flops,
            procs=self.local_procs,
            world=self.world,
            flops_per_token=self.bundle.flops_per_token,
            emit0=self.emit0,
        )
        self.metrics = StepMetrics(
            self.channel,
            rank=self.rank,
            world=self.world,
            group=self.group,
            device=self.device,
            meter=self.meter,
            balancer=self.balancer,
            tokens_per_step=self.tokens_per_step,
            mfu=mfu,
        )
        self.nonfinite = NonFiniteGuard(cfg.run, group=self.group, emit0=self.emit0, log=self.log, fail=self._fail)
        t_run = time.perf_counter()
        stop_reason = None
        if self.cfg.toggles.compile != "off" and self.progress.step < cfg.optim.max_steps:
            self.phase("compiling", f"compiling (torch.compile {self.cfg.toggles.compile})")
        try:
            while True:
                try:
                    if stop_reason is None:  # a stop asked for is kept through a rollback
                        stop_reason = self._train_until_done()
                    self.save_checkpoint("stop" if stop_reason else "final")
                    break
                except NonFiniteStep as e:
                    self._rollback(e)
        finally:
            self.prefetcher.close()
            self.profiler.close()
        elapsed = time.perf_counter() - t_run
        self.emit0(
            "done",
            step=self.progress.step,
            tokens=self.progress.tokens,
            seconds=elapsed,
            reason=stop_reason or MAX_STEPS,
            checkpoint=str(self.ckpt.newest),
        )
        self.log(f"done at step {self.progress.step} ({stop_reason or 'max_steps'}) in {elapsed:.1f} s")
        return EXIT_OK

    def _train_until_done(self) -> str | None:
        """Train to max_steps or a stop command (returns its reason). NonFiniteStep propagates to run()."""
        cfg = self.cfg
        while self.progress.step < cfg.optim.max_steps:
            stop_reason = self._step_boundary()
            if stop_reason:
                return stop_reason
            self._own_cache_retry(self._train_step, self._restart_step)
            step = self.progress.step
            if self.channel.starting:
                self.channel.started()  # from here a stop finishes the step and checkpoints
            self.metrics.progress(self.progress)
            if self._is_log_step() or step == cfg.optim.max_steps:
                self.metrics.flush(self.progress, self.optimizer, self.timer, self.nonfinite.check)
            if cfg.log.eval_every and step % cfg.log.eval_every == 0:
                self._own_cache_retry(self._evaluate, lambda: None)
            if (
                cfg.checkpoint.checkpoint_every
                and step % cfg.checkpoint.checkpoint_every == 0
                and step < cfg.optim.max_steps
            ):
                self.save_checkpoint()
        return None

    def _step_boundary(self) -> str | None:
        """Act on what the ranks agreed (trainer.commands); returns a stop reason."""
        self.channel.check_startup()  # a stop during startup never waits for a first step
        if self.channel.write_error is not None:  # events.jsonl could not be written: stop, exit 8
            raise self.channel.write_error
        step = self.progress.step
        decision = self.commands.poll(
            stop_fault=self.faults.at_boundary(step, "stop"),
            checkpoint_fault=self.faults.at_boundary(step, "checkpoint"),
        )
        if decision.checkpoint:
            self.save_checkpoint("requested")
        if decision.profile_steps:
            self.profiler.request(self.progress.step + 1, decision.profile_steps)  # from the next step
        if decision.log_every:  # the tuner measures every step, then gives the interval back
            self.cfg.log.log_every = decision.log_every
        return decision.stop

    def _is_log_step(self) -> bool:
        return self.progress.step % self.cfg.log.log_every == 0

    def _train_step(self) -> None:
        p, cfg = self.progress, self.cfg
        while p.batch_cursor in p.skip_batches:  # batches that poisoned the run before
            for _ in range(self.accum):
                self.prefetcher.get()
            p.batch_cursor += 1
        step, bi = p.step, p.batch_cursor
        t0 = time.perf_counter()
        self.profiler.step_begin(step + 1, self.timer)  # numbered from 1, as the step events
        fault = self.faults.take(step)
        optim.set_lr(self.optimizer, optim.lr_at(step, cfg) * p.lr_scale)
        timer = self.timer
        timer.begin_step(step)
        step_loss = torch.zeros((), device=self.device)
        for micro in range(self.accum):
            with timer.phase("data"):
                got_bi, got_mi, x, y = self.prefetcher.get()
            assert got_bi == bi and got_mi == micro, f"data order broken: got {got_bi}/{got_mi}, want {bi}/{micro}"
            with self._sync_grads(last_micro=micro == self.accum - 1):
                with timer.phase("forward"):
                    with self._autocast():
                        loss = self._loss(x, y, bi, micro) / self.accum
                    if micro == 0:
                        loss = faults.on_loss(fault, loss, step)
                with timer.phase("backward"):
                    self.scaler.scale(loss).backward()
            step_loss += loss.detach()
        with timer.phase("optimizer"):
            self.scaler.unscale_(self.optimizer)
            faults.on_grads(fault, self.raw_model)
            norm = self._grad_norm_now()
            bad = step_flags(step_loss, norm, scaled=self.scaler.is_enabled())
            optim.step(self.optimizer, self.scaler, finite=bad == 0)
            self.optimizer.zero_grad(set_to_none=True)
            if self.balancer is not None:
                self.balancer.update()
            faults.on_weights(fault, self.raw_model)
        timer.end_step()
        self.metrics.add_step(step_loss, norm, self.comm.take_ms() if self.comm is not None else None)
        self.nonfinite.record(step, bi, bad)
        p.step += 1
        p.batch_cursor += 1
        p.tokens += self.tokens_per_step
        self.profiler.step_end(step + 1)
        if self.compile_report is not None:  # the host's time: a compile is host work
            self.compile_report.after_step(step + 1, (time.perf_counter() - t0) * 1e3)

    def _own_cache_retry(self, fn: Callable[[], Any], reset: Callable[[], None]) -> Any:
        """`fn()`; when it fails to load a compiled artefact of the shared inductor cache (a file a killed process
        left half-written), once per process: `reset()` and `fn()` again in the run's own cache
        (trainer.inductor_cache). Any other failure, or a second one, is raised."""
        try:
            return fn()
        except Exception as e:
            art = self.own_cache.recover(e) if self.own_cache is not None else None
            if art is None:
                raise
            msg = (
                f"torch.compile could not load {art.path} from the shared inductor cache ({art.reason}); "
                f"compiling again in the run's own cache {self.own_cache.own_dir}"
            )
            self.emit0("warning", message=msg, kind=CompileWarning.COMPILE_CACHE, step=self.progress.step + 1)
            self.log(f"warning: {msg}")
        reset()
        return fn()

    def _restart_step(self) -> None:
        """Undo a step that failed before it changed anything but gradients and the data position: no
        gradients, and the data from the step's first micro-batch again."""
        self.optimizer.zero_grad(set_to_none=True)
        self.prefetcher.close()
        self.prefetcher = self._new_prefetcher()

    def _grad_norm_now(self) -> torch.Tensor:
        """The global gradient norm (clipping when --grad-clip is set); NaN or inf when a gradient is."""
        params = self.raw_model.parameters()
        if self.cfg.optim.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.grad_clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([g.grad.detach().norm() for g in params if g.grad is not None]))
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor; the norm over all shards
            norm = norm.full_tensor()
        return norm

    def _evaluate(self) -> None:
        from .batches import val_batches

        self.nonfinite.check()  # never evaluate a model that a non-finite step has touched
        if not hasattr(self, "_val"):
            self._val = val_batches(
                self.data, self.cfg.data.seq_len, self.micro_batch, self.cfg.log.eval_batches, self.cfg.optim.seed
            )
        t = time.perf_counter()
        self.model.eval()
        total = torch.zeros((), device=self.device)
        with torch.no_grad():
            for i, (x, y) in enumerate(self._val):
                with self._autocast():
                    total += self._loss(x.to(self.device), y.to(self.device), -1, i).float()
        self.model.train()
        if self.balancer is not None:
            self.balancer.reset()
        loss = (total / len(self._val)).item()
        self.emit0("eval", step=self.progress.step, loss=loss, seconds=time.perf_counter() - t)
        if self.compile_report is not None:
            self.compile_report.after_eval(self.progress.step)

    def _rollback(self, e: NonFiniteStep) -> None:
        """The NaN policy (trainer.nonfinite): on from the restored progress with fresh data and metrics."""
        self.prefetcher.close()
        self.progress = self.nonfinite.roll_back(
            e, self.progress, self.ckpt, resumed_from=self.resumed_from, reinitialize=self._reinitialize
        )
        self.optimizer.zero_grad(set_to_none=True)
        if self.balancer is not None:
            self.balancer.reset()
        self.timer.collect()
        self.metrics.reset()
        self.prefetcher = self._new_prefetcher()

    def _reinitialize(self) -> None:
        """The model and optimizer as a fresh run starts them (a rollback with no checkpoint to go to)."""
        torch.manual_seed(self.cfg.optim.seed)
        fresh = build.build_bundle(self.cfg, self.data, self.dev)
        if self.group is not None:
            self.ckpt.load_full(fresh.model.state_dict(), None)
        else:
            self.raw_model.load_state_dict(fresh.model.state_dict())
        self.optimizer = optim.build_optimizer(self.raw_model, self.cfg)
        self.ckpt.bind(self.raw_model, self.optimizer, self.scaler)

    def _fail(self, kind: ErrorKind, message: str, **extra: Any) -> NoReturn:
        code = {
            ErrorKind.OOM: EXIT_OOM,
            ErrorKind.NAN: EXIT_NAN,
            ErrorKind.CONFIG: EXIT_CONFIG,
            ErrorKind.COMPILE: EXIT_COMPILE,
            ErrorKind.DISK: EXIT_DISK,
        }.get(kind, EXIT_CRASH)
        if self.channel:
            self.channel.emit("error", kind=kind, message=message, step=self.progress.step, exit_code=code, **extra)
        print(f"[trainer] error ({kind}): {message}", file=sys.stderr, flush=True)
        raise Stop(code)

    def memory_figures(self) -> dict[str, Any]:
        try:
            return make_meter(self.device).figures()
        except Exception:
            return {}


def hash_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (Python's hash() is salted per process for str, not int, but be explicit)."""
    h = 1469598103934665603
    for x in parts:
        h = ((h ^ (x & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0x7FFFFFFFFFFFFFFF
    return h
