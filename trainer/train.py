"""The instrumented, resumable training loop, assembled from components (after torchtitan's trainer):

    trainer.build         builders that return the resolved config, the data, the model and its precision and
                          parallel wrapping, and the hello's fields (`Trainer.setup` composes them)
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
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch

from . import autobatch, build, faults, optim
from . import dist as D
from .channel import Channel
from .contract import estimate as E
from .checkpointer import Checkpointer, NonFiniteState, Progress
from .commands import Commands
from .contract import capabilities, protect, rundir
from .contract.atomic import atomic_write
from .contract.config import AUTO, ConfigError, TrainConfig, parse_step_range
from .contract.device import DeviceInfo
from .contract.events import MAX_STEPS, CompileWarning
from .contract.runlock import RunLock
from .device_probe import detect
from .flops import peak
from .inductor_cache import OwnCache
from .memory import make_meter
from .models import is_pretrained_path
from .moe import MoEBalancer
from .nonfinite import NonFiniteGuard, NonFiniteStep, step_flags
from .profiler import StepProfiler, report_written
from .step_metrics import MfuCheck, StepMetrics
from .timing import make_timer

EXIT_OK, EXIT_CRASH, EXIT_CONFIG, EXIT_OOM, EXIT_NAN, EXIT_COMPILE = 0, 1, 2, 3, 4, 5
EXIT_NO_CHECKPOINT, EXIT_CORRUPT_CHECKPOINT = 6, 7  # --resume found nothing / nothing that verifies
EXIT_DISK = 8  # a write failed: filesystem full or read-only


class Stop(Exception):
    """Raised to end the run early with an exit code after the error was reported."""

    def __init__(self, code: int):
        self.code = code


class Trainer:
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

    # ------------------------------------------------------------------ setup
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

    def phase(self, phase: str, message: str, pct: float | None = None) -> None:
        """A startup phase (tokenizing, building, loading, probing, compiling): an event and a log line."""
        self.channel.check_startup()
        self.emit0("phase", phase=phase, message=message, pct=pct)
        if pct is None:
            self.log(message)

    def _tokenizing(self, message: str, pct: float | None) -> None:
        self.phase("tokenizing", message, pct)

    def _early_hello(self) -> None:
        """The first event, before anything is built: the run as configured and what it will cost. A run
        that cannot fit in the device's memory stops here (exit 2) with the estimate and the largest size
        that fits; a step longer than a minute is a warning before it is taken."""
        cfg = self.cfg
        est, kw = build.run_estimate(
            cfg,
            self.dev,
            capacity=build.rank_memory(self.dev, self.local_procs),
            peak_flops=self.peak_flops,
            world=self.world,
            parallel=self.parallel,
        )
        self.emit0(
            "hello",
            **build.early_hello(cfg, self.dev, est, world=self.world, parallel=self.parallel, auto=self.auto_options),
        )
        if est is None:
            return
        where = "this CPU" if not self.dev.is_cuda else self.dev.name
        if not est.fits:
            raise ConfigError("--size", E.refusal(est, where, E.largest_fitting(cfg.model.model, **kw)))
        self.log(f"estimate: {est.summary(where)}")
        if est.slow:
            steps = cfg.optim.max_steps - (self.progress.step or 0)
            msg = (
                f"{est.summary(where, steps)} (estimated at {E.ASSUMED_MFU:.0%} MFU); for faster steps use a smaller "
                f"--size, --seq-len or --global-batch" + (", or a GPU" if not self.dev.is_cuda else "")
            )
            self.emit0("warning", message=msg, kind="estimate")
            self.log(f"warning: {msg}")

    @property
    def parallel(self) -> str | None:
        return self.cfg.run.parallel if self.world > 1 else None

    def setup(self) -> None:
        """Build the run's components in order, each from a builder that returns it (trainer.build); what
        `auto` and the defaults become is a new config the trainer keeps (`self.cfg`), never the caller's."""
        build.select_device(self.dev)
        self.cfg = build.resolve_config(self.cfg, self.dev)
        self._open_run_dir()
        self._join_ranks()
        self._check_config()
        self._early_hello()
        self._build_components()
        if self.cfg.checkpoint.resume:
            self._resume()
        self.model = self._compile(self.ddp if self.ddp is not None else self.raw_model)
        self._resolve_micro_batch()
        self._announce()

    def _open_run_dir(self) -> None:
        """The run directory, its lock (one writer, before anything is written into it) and the event channel."""
        cfg = self.cfg
        self.run_dir = Path(cfg.run.run_dir)
        self.own_cache = OwnCache(self.run_dir / "inductor-cache")
        if not self.created_dirs:  # what a refusal before the first step removes
            self.created_dirs = protect.dirs_to_create(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # RunDirBusy: exit 2
        if self.run_lock is None or self.run_lock.run_dir.resolve() != self.run_dir.resolve():
            self.run_lock = RunLock.for_trainer(
                self.run_dir, new_run=not rundir.resumes_into(cfg.checkpoint.resume, self.run_dir)
            )
        if self.run_lock.warning:
            self.log(f"warning: {self.run_lock.warning}")
        self.channel = Channel(rundir.RunDir(self.run_dir).events(self.rank), cfg.run.channel, rank=self.rank)
        self.channel.install_signal_handlers()
        for notice in self.notices:
            self._warn(notice)

    def _join_ranks(self) -> None:
        """Several ranks: the process group and its control plane."""
        if self.world == 1:
            return
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            D.die_with_parent()
        if self.parallel == "fsdp":
            D.fsdp_precision(self.cfg.toggles.precision)  # unsupported combinations fail before the group forms
        self.group = D.Group(self.rank, self.world, self.local_rank, self.device)
        self.group.init()

    def _check_config(self) -> None:
        """What the device, the model family and the number of ranks allow; then the peak MFU is measured against."""
        cfg = self.cfg
        capabilities.check_config(cfg, self.dev, self.world)
        if not is_pretrained_path(cfg.model.model):  # a family's LoRA targets and rank, from its dimensions
            E.check_lora(cfg.model.model, cfg.model.size, cfg.finetune.lora, cfg.finetune.lora_targets)
        cfg.validate(world_size=self.world)  # the per-rank batch and micro-batch, now that the world is known
        self.local_procs = build.local_procs()
        p = peak(self.dev, cfg.toggles.precision, procs=self.local_procs)
        self.peak_flops, self.peak_source = p.flops, p.source

    def _build_components(self) -> None:
        """The data, the model (on the device, in its precision, wrapped for several ranks), the optimizer and
        what works on them: the checkpointer, the commands, the profiler."""
        cfg = self.cfg
        torch.manual_seed(cfg.optim.seed)
        self.data, self.sampler = build.build_data(
            cfg, rank=self.rank, world=self.world, log=self.log, phase=self._tokenizing
        )
        self.phase("building", f"building {build.model_name(cfg)}")
        self.bundle = build.build_bundle(cfg, self.data, self.dev)
        self.raw_model = self.bundle.model.to(self.device)
        precision = build.build_precision(self.raw_model, cfg.toggles.precision, self.dev, self.parallel)
        self.autocast_dtype, self.scaler = precision.autocast_dtype, precision.scaler
        wrapped = build.wrap_parallel(
            self.raw_model, self.group, self.parallel, cfg.toggles.precision, self.dev, is_moe=self.bundle.is_moe
        )
        self.ddp, self.comm = wrapped.ddp, wrapped.comm
        self.optimizer = optim.build_optimizer(self.raw_model, cfg)
        self.meter = make_meter(self.device)
        self.balancer = MoEBalancer(self.raw_model) if self.bundle.is_moe else None
        self.ckpt = Checkpointer(cfg, self.dev, self.run_dir, self.group, warn=self._warn)
        self.ckpt.bind(self.raw_model, self.optimizer, self.scaler)
        self.commands = Commands(self.channel, self.rank, self.group.agree if self.group is not None else None)
        self.profiler = StepProfiler(
            rundir.RunDir(self.run_dir).profiles,
            self.rank,
            self.dev.is_cuda,
            parse_step_range(cfg.log.profile_steps) if cfg.log.profile_steps else None,
            on_written=self._profile_written,
        )

    def _resume(self) -> None:
        self.phase("loading", "loading the checkpoint to resume from")
        path, self.progress = self.ckpt.resume(self.cfg.checkpoint.resume)
        self.resumed_from = str(path)
        self.log(f"resumed from {path} at step {self.progress.step}")
        w = self.profiler.window
        if w and w[1] <= self.progress.step:
            self.emit0(
                "warning",
                message=f"--profile-steps {w[0]}-{w[1]}: this run resumes after step "
                f"{self.progress.step}, so no trace is written",
            )

    def _resolve_micro_batch(self) -> None:
        """`--micro-batch auto` becomes the probed number, in a new config the trainer and its checkpointer
        keep; then the step's batching."""
        if self.cfg.toggles.micro_batch == AUTO:
            self.cfg = build.replaced(self.cfg, "toggles", micro_batch=self._auto_micro_batch())
            self.ckpt.use_config(self.cfg)
            capabilities.check_config(self.cfg, self.dev, self.world)  # what depends on the accumulation
        b = build.batching(self.cfg, self.sampler)
        self.micro_batch, self.accum, self.tokens_per_step = b.micro_batch, b.accumulation, b.tokens_per_step

    def _announce(self) -> None:
        """The resolved config into the run directory, the hello, a summary line and the slow choices."""
        cfg = self.cfg
        if self.rank == 0:
            atomic_write(rundir.RunDir(self.run_dir).config, cfg.to_toml())
        self.emit_node(
            "hello",
            **build.hello(
                cfg,
                self.dev,
                self.bundle,
                self.data,
                build.Batching(self.micro_batch, self.accum, self.tokens_per_step),
                world=self.world,
                parallel=self.parallel,
                peak_flops=self.peak_flops,
                peak_source=self.peak_source,
                resumed_from=self.resumed_from,
                start_step=self.progress.step,
                gpus=build.node_gpus(self.dev, self.world, self.local_procs),
                auto=self.auto_options,
            ),
        )
        ranks = f"; {self.world} ranks ({self.parallel}, {self.group.backend})" if self.group else ""
        self.log(
            f"{self.bundle.family}/{self.bundle.size}: {self.bundle.total_params / 1e6:.1f}M params "
            f"({self.bundle.active_params / 1e6:.1f}M active, {self.bundle.trainable_params / 1e6:.2f}M trained) "
            f"on {self.dev.name}; micro-batch {self.micro_batch} "
            f"x {self.accum} accumulation{ranks}; run dir {self.run_dir}"
        )
        for slow in capabilities.slow_config(cfg, self.dev):  # runs, but the user should know
            self.log(f"warning: {slow}")
            self.emit0("warning", message=slow, kind="slow_toggle")

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

    def _compile(self, model: torch.nn.Module) -> torch.nn.Module:
        from .compiling import compile_model

        mode = self.cfg.toggles.compile
        if mode == "off":
            return model
        from .compile_watch import CompileReport, CompileWatch

        self.compile_report = CompileReport(CompileWatch(), emit0=self.emit0, log=self.log)
        return compile_model(model, mode)

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

    # --------------------------------------------------------------- micro-batch
    def _auto_micro_batch(self) -> int:
        """The largest micro-batch that fits (trainer.autobatch): known in advance on a roomy CPU, else probed
        with a forward and backward per candidate."""
        local = self.cfg.optim.global_batch // self.world
        if not self.dev.is_cuda:
            roomy = autobatch.roomy_cpu_batch(
                self.cfg,
                self.bundle.family,
                self.bundle.size,
                local=local,
                share=build.rank_memory(self.dev, self.local_procs),
                vocab_size=self.data.vocab_size,
                log=self.log,
            )
            if roomy is not None:
                return roomy
        x_all, y_all = self.sampler.micro_batch(0, 0, local)
        # The probe runs forward and backward only; the optimizer's state (AdamW's moments: 8 bytes per
        # trained parameter) appears at the first step and stays through every later forward and backward.
        pending = optim.pending_state_bytes(self.optimizer, self.cfg.toggles.optimizer)
        if pending and self.rank == 0:
            self.log(
                f"--micro-batch auto: counting {pending / 2**30:.2f} GiB of optimizer state the first step allocates"
            )

        def probe_local(mb: int) -> int:
            return self._probe_peak(x_all[:mb], y_all[:mb]) + pending

        mb = autobatch.probe_micro_batch(
            probe_local,
            local,
            capacity=self.meter.capacity(),
            group=self.group,
            compile_mode=self.cfg.toggles.compile,
            log=self.log if self.rank == 0 else lambda s: None,
        )
        self.log(f"--micro-batch auto: {mb}")
        return mb

    def _probe_peak(self, x: torch.Tensor, y: torch.Tensor) -> int:
        """The peak memory of one forward and backward on `x`, leaving no gradient behind."""
        self.phase("probing", f"probing micro-batch {len(x)}")
        # Probe without torch.compile: compiling once per probed size would cost minutes and leave the run
        # with a dynamic-shape graph; eager's peak is usually above the compiled one (a safe estimate).
        eager = getattr(self.model, "_orig_mod", self.model)
        self.meter.reset_peak()
        try:
            # DDP: no gradient all-reduce. FSDP2 keeps its reduce-scatter (the ranks probe in lockstep), so
            # no unsharded gradient is left accumulated for the first real step.
            with self._sync_grads(last_micro=self.parallel == "fsdp"), self._autocast():
                loss = self._loss(x.to(self.device), y.to(self.device), 0, 0, model=eager)
                self.scaler.scale(loss).backward()
            return self.meter.peak()
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            if self.balancer is not None:
                self.balancer.reset()

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

    def _profile_written(self, path: Path, first: int, last: int, summary: dict[str, Any] | None) -> None:
        report_written(self.channel, path, first, last, summary)

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

    def _fail(self, kind: str, message: str, **extra: Any) -> NoReturn:
        code = {
            "oom": EXIT_OOM,
            "nan": EXIT_NAN,
            "config": EXIT_CONFIG,
            "compile": EXIT_COMPILE,
            "disk": EXIT_DISK,
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
