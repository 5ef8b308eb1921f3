"""A trainer's startup, from its config to the first step (the startup phases gptop shows): the run directory
and its lock, the ranks, the checks and the early hello, the components trainer.build returns, resume, the
micro-batch and the hello. The startup half of trainer.train.Trainer, whose `__init__` holds the state."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from . import autobatch, build, optim
from . import dist as D
from .channel import Channel
from .checkpointer import Checkpointer
from .commands import Commands
from .contract import capabilities, protect, rundir
from .contract import estimate as E
from .contract.atomic import atomic_write
from .contract.config import AUTO, ConfigError, parse_step_range
from .contract.runlock import RunLock
from .contract.states import WarningKind
from .flops import peak
from .inductor_cache import OwnCache
from .memory import make_meter
from .models import import_transformers, is_pretrained_path
from .moe import MoEBalancer
from .process_costs import resume_gc
from .profiler import StepProfiler, report_written


class TrainerStartup:
    """`setup()` and its steps; the loop, the events' emitters and the step's computation are the Trainer's."""

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
            self.emit0("warning", message=msg, kind=WarningKind.ESTIMATE)
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
        import_transformers()  # the last heavy import, still without the GC's collections
        resume_gc()  # the model, the checkpoint and compiling may make garbage worth collecting
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
                start=(self.progress.step, self.progress.tokens),
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
            self.emit0("warning", message=slow, kind=WarningKind.SLOW_TOGGLE)

    def _compile(self, model: torch.nn.Module) -> torch.nn.Module:
        from .compiling import compile_model

        mode = self.cfg.toggles.compile
        if mode == "off":
            return model
        from .compile_watch import CompileReport, CompileWatch

        self.compile_report = CompileReport(CompileWatch(), emit0=self.emit0, log=self.log)
        return compile_model(model, mode)

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

    def _profile_written(self, path: Path, first: int, last: int, summary: dict[str, Any] | None) -> None:
        report_written(self.channel, path, first, last, summary)
