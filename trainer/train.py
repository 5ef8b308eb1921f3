"""The instrumented, resumable training loop.

One optimizer step = `accum` micro-steps of forward+backward, then the
optimizer. Everything the loop needs per step stays on the device: the loss
and gradient norm are summed into device tensors and read back only on log
steps (one synchronization per log interval, which the CUDA timer piggybacks
on). Checkpoints are taken at step boundaries and never hold a state that has
seen a non-finite loss.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import checkpoint as ckpt
from . import dist as D
from .channel import Channel
from .contract import capabilities, rundir
from .contract.atomic import atomic_write
from .contract.config import AUTO, ConfigError, TrainConfig, parse_step_range
from .contract.device import DeviceInfo
from .device import detect
from .memory import make_meter
from .timing import StepTiming, make_timer

EXIT_OK, EXIT_CRASH, EXIT_CONFIG, EXIT_OOM, EXIT_NAN, EXIT_COMPILE = 0, 1, 2, 3, 4, 5


class NonFiniteLoss(RuntimeError):
    def __init__(self, step: int, batch_index: int):
        super().__init__(f"non-finite loss at step {step} (batch {batch_index})")
        self.step, self.batch_index = step, batch_index


class Stop(Exception):
    """Raised to end the run early with an exit code after the error was reported."""

    def __init__(self, code: int):
        self.code = code


@dataclass
class Progress:
    """Everything about where the run is that a checkpoint must restore."""

    step: int = 0
    tokens: int = 0
    batch_cursor: int = 0                 # next global batch index to train on
    skip_batches: list[int] = field(default_factory=list)
    lr_scale: float = 1.0
    nan_rollbacks: int = 0


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up then cosine decay to min_lr_ratio * lr; a pure function of the step, so resume is exact."""
    o = cfg.optim
    if o.warmup_steps and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(1, o.max_steps - o.warmup_steps)
    frac = min(1.0, (step - o.warmup_steps) / span)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


class Faults:
    """Test-only fault injection (`--fault nan@12,oom@5`): each fires once per process.

    `KIND@STEP:RANK` fires on that rank only (`kill@5:1`); without `:RANK`, on every rank."""

    KINDS = ("nan", "oom", "crash", "kill", "compile", "stop")

    def __init__(self, spec: str | None, rank: int = 0):
        self.at: dict[int, str] = {}
        for part in (spec or "").split(","):
            if not part:
                continue
            kind, _, where = part.partition("@")
            step, _, only = where.partition(":")
            if kind not in self.KINDS or not step.isdigit() or (only and not only.isdigit()):
                raise ConfigError("--fault", f"{part!r}: expected KIND@STEP[:RANK] with KIND in "
                                             f"{', '.join(self.KINDS)}")
            if not only or int(only) == rank:
                self.at[int(step)] = kind

    def take(self, step: int) -> str | None:
        return self.at.pop(step, None)


class Trainer:
    def __init__(self, cfg: TrainConfig, dev: DeviceInfo | None = None):
        self.cfg = cfg
        self.rank, self.world, self.local_rank = D.env_world()
        self.dev = dev or detect(D.rank_device(cfg.run.device, self.world, self.local_rank))
        self.device = self.dev.torch_device
        self.progress = Progress()
        self.channel: Channel | None = None
        self.group: D.Group | None = None            # several ranks: the process group and control plane
        self.ddp: torch.nn.Module | None = None      # the DDP wrapper (--parallel ddp, several ranks)
        self.comm: D.CommTimer | None = None
        self.faults = Faults(cfg.run.fault, self.rank)
        self._done_seq = {"checkpoint": 0, "profile": 0}   # command sequence numbers already acted on
        self.profile_window: tuple[int, int] | None = (
            parse_step_range(cfg.log.profile_steps) if cfg.log.profile_steps else None)
        self._profiler = None

    # ------------------------------------------------------------------ setup
    def log(self, msg: str) -> None:
        who = f"trainer rank {self.rank}" if self.world > 1 else "trainer"
        print(f"[{who}] {msg}", flush=True)

    def emit0(self, type: str, **fields: Any) -> None:
        """Events that describe the whole run (hello, checkpoint, eval, done) come from rank 0 only."""
        if self.rank == 0 and self.channel is not None:
            self.channel.emit(type, **fields)

    @property
    def parallel(self) -> str | None:
        return self.cfg.run.parallel if self.world > 1 else None

    def setup(self) -> None:
        from .data import BatchSampler, load_data
        from .models import build_model, is_pretrained_path, resolve_size

        cfg = self.cfg
        if not self.dev.is_cuda:
            from .hostalloc import keep_freed_memory

            keep_freed_memory()        # reuse freed tensors instead of page-faulting them in every step
        if is_pretrained_path(cfg.model.model):
            if cfg.data.tokenizer is None:
                cfg.data.tokenizer = cfg.model.model
        elif cfg.model.size == "auto":
            cfg.model.size = resolve_size("auto", cfg.model.model, self.dev)

        self.run_dir = Path(cfg.run.run_dir or rundir.default_run_dir(cfg))
        cfg.run.run_dir = str(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.channel = Channel(rundir.RunDir(self.run_dir).events(self.rank), cfg.run.channel, rank=self.rank)
        self.channel.install_signal_handlers()
        if self.world > 1:
            if os.environ.get("TORCHELASTIC_RUN_ID"):
                D.die_with_parent()
            if self.parallel == "fsdp":
                D.fsdp_precision(cfg.toggles.precision)      # unsupported combinations fail before the group forms
            self.group = D.Group(self.rank, self.world, self.local_rank, self.device)
            self.group.init()

        capabilities.check(cfg.toggles, self.dev)
        cfg.validate(world_size=self.world)     # the per-rank batch and micro-batch, now that the world is known
        torch.manual_seed(cfg.optim.seed)
        self.data = load_data(cfg.data, log=self.log)
        self.sampler = BatchSampler(self.data.train, cfg.data.seq_len, cfg.optim.global_batch, cfg.optim.seed,
                                    rank=self.rank, world_size=self.world)
        self.bundle = build_model(cfg.model, vocab_size=self.data.vocab_size, seq_len=cfg.data.seq_len,
                                  toggles=cfg.toggles, dev=self.dev, mask_id=self.data.mask_id, seed=cfg.optim.seed)
        self.raw_model = self.bundle.model.to(self.device)
        self._setup_precision()
        self._wrap_parallel()
        self.optimizer = self._make_optimizer()
        self.meter = make_meter(self.device)
        from .moe import MoEBalancer

        self.balancer = MoEBalancer(self.raw_model) if self.bundle.is_moe else None

        self.resumed_from = None
        if cfg.checkpoint.resume:
            self._resume(cfg.checkpoint.resume)
        self.model = self._compile(self.ddp if self.ddp is not None else self.raw_model)

        if cfg.toggles.micro_batch == AUTO:
            cfg.toggles.micro_batch = self._auto_micro_batch()
        self.micro_batch = cfg.toggles.micro_batch
        self.accum = self.sampler.accumulation_steps(self.micro_batch)
        self.tokens_per_step = cfg.optim.global_batch * cfg.data.seq_len

        from .flops import peak_flops

        self._local_procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)   # ranks sharing this node's CPU
        self.peak_flops = peak_flops(self.dev, cfg.toggles.precision, procs=self._local_procs)
        if self.rank == 0:
            atomic_write(rundir.RunDir(self.run_dir).config, cfg.to_toml())
        self.emit0(
            "hello", pid=os.getpid(), world_size=self.world, parallel=self.parallel, config=cfg.to_dict(), device=self.dev.to_dict(),
            model={"family": self.bundle.family, "size": self.bundle.size, "total_params": self.bundle.total_params,
                   "active_params": self.bundle.active_params, "embedding_params": self.bundle.embedding_params,
                   "vocab_size": self.bundle.vocab_size, "flops_per_token": self.bundle.flops_per_token,
                   "objective": self.bundle.objective},
            data={"train_tokens": int(len(self.data.train)), "val_tokens": int(len(self.data.val)),
                  "fingerprint": self.data.fingerprint},
            accumulation=self.accum, micro_batch=self.micro_batch, tokens_per_step=self.tokens_per_step,
            peak_flops=self.peak_flops, resumed_from=self.resumed_from, start_step=self.progress.step,
            torch=torch.__version__)
        ranks = f"; {self.world} ranks ({self.parallel}, {self.group.backend})" if self.group else ""
        self.log(f"{self.bundle.family}/{self.bundle.size}: {self.bundle.total_params / 1e6:.1f}M params "
                 f"({self.bundle.active_params / 1e6:.1f}M active) on {self.dev.name}; micro-batch {self.micro_batch} "
                 f"x {self.accum} accumulation{ranks}; run dir {self.run_dir}")
        for slow in capabilities.slow_choices(cfg.toggles, self.dev):   # runs, but the user should know
            self.log(f"warning: {slow}")
            self.emit0("warning", message=slow, kind="slow_toggle")

    def _setup_precision(self) -> None:
        p = self.cfg.toggles.precision
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16,
                               "fp8-tensorwise": torch.bfloat16, "fp8-rowwise": torch.bfloat16}.get(p)
        if self.parallel == "fsdp":
            self.autocast_dtype = D.fsdp_precision(p)[1]     # FSDP2's MixedPrecisionPolicy casts instead
        if self.dev.is_cuda:
            torch.backends.cuda.matmul.allow_tf32 = p == "tf32"
            torch.backends.cudnn.allow_tf32 = p == "tf32"
        if p.startswith("fp8"):
            from .fp8 import convert_to_fp8

            convert_to_fp8(self.raw_model, p.split("-", 1)[1])
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=(p == "fp16"))

    def _wrap_parallel(self) -> None:
        """Several ranks: DDP (gradient all-reduce overlapping backward) or FSDP2 (sharded parameters)."""
        if self.group is None:
            return
        if self.parallel == "fsdp":
            D.apply_fsdp(self.raw_model, self.cfg.toggles.precision)
            return
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.ddp = DDP(self.raw_model, device_ids=[self.device.index] if self.dev.is_cuda else None,
                       find_unused_parameters=self.bundle.is_moe)   # experts a batch did not route to
        if self.group.backend == "gloo":
            self.comm = D.CommTimer(self.world)
            self.comm.register(self.ddp)

    def _sync_grads(self, last_micro: bool):
        """Gradient accumulation without communication until the last micro-batch."""
        if self.ddp is not None and not last_micro:
            return self.ddp.no_sync()
        if self.parallel == "fsdp":
            self.raw_model.set_requires_gradient_sync(last_micro)
        return contextlib.nullcontext()

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        decay, no_decay = [], []
        for name, p in self.raw_model.named_parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": self.cfg.optim.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        kwargs: dict[str, Any] = {"lr": lr_at(0, self.cfg), "betas": (0.9, 0.95), "eps": 1e-8}
        kwargs.update(self._adamw_flags())
        return torch.optim.AdamW(groups, **kwargs)

    def _adamw_flags(self) -> dict[str, Any]:
        return {"fused": True, "foreach": None} if self.cfg.toggles.fused_adamw else {"fused": None, "foreach": True}

    def _param_names(self) -> list[str]:
        """Parameter names in the optimizer's id order (how a one-file checkpoint's optimizer state is keyed)."""
        decay, no_decay = [], []
        for name, p in self.raw_model.named_parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(name)
        return decay + no_decay

    def _compile(self, model: torch.nn.Module) -> torch.nn.Module:
        mode = self.cfg.toggles.compile
        if mode == "off":
            return model
        return torch.compile(model, mode=None if mode == "default" else mode)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        p = self.progress
        state = {"step": p.step, "tokens": p.tokens, "batch_cursor": p.batch_cursor,
                 "skip_batches": list(p.skip_batches), "lr_scale": p.lr_scale, "nan_rollbacks": p.nan_rollbacks,
                 "model": self.raw_model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "config": self.cfg.to_dict(), "rng": {"torch": torch.get_rng_state()}}
        if self.scaler.is_enabled():
            state["scaler"] = self.scaler.state_dict()
        if self.dev.is_cuda:
            state["rng"]["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint: a one-file state, or a sharded checkpoint's gptop.json (then read with DCP)."""
        self._check_compatible(state["config"])
        if state.get("format") == ckpt.DCP_FORMAT:
            self._load_sharded(state)
        elif self.group is not None:
            self._load_full(state["model"], state["optimizer"])
        else:
            self.raw_model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:   # the kernel is a toggle of this run, not of the checkpoint
            group.update(self._adamw_flags())
        if state.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        rng = state.get("rng", {})
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        if "cuda" in rng and self.dev.is_cuda:
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        self.progress = Progress(step=state["step"], tokens=state.get("tokens", 0),
                                 batch_cursor=state.get("batch_cursor", state["step"]),
                                 skip_batches=list(state.get("skip_batches", [])),
                                 lr_scale=state.get("lr_scale", 1.0), nan_rollbacks=state.get("nan_rollbacks", 0))

    # Several ranks (or a sharded checkpoint): torch.distributed.checkpoint and its state-dict helpers, which
    # turn DDP's replicated tensors and FSDP2's DTensor shards into one format and reshard on load.
    def _sharded_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.raw_model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def _meta(self) -> dict[str, Any]:
        p = self.progress
        return {"step": p.step, "tokens": p.tokens, "batch_cursor": p.batch_cursor,
                "skip_batches": list(p.skip_batches), "lr_scale": p.lr_scale, "nan_rollbacks": p.nan_rollbacks,
                "config": self.cfg.to_dict(), "world_size": self.world, "parallel": self.parallel,
                "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None}

    def _rank_state(self) -> dict[str, Any]:
        rng = {"torch": torch.get_rng_state()}
        if self.dev.is_cuda:
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {"rng": rng, "step": self.progress.step, "rank": self.rank}

    def _load_sharded(self, meta: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        path, saved_world = meta["path"], int(meta.get("world_size", 1))
        state = self._sharded_state()
        try:
            ckpt.load_sharded(state, path)
        except Exception as e:
            if saved_world != self.world:
                raise ConfigError("--nproc", f"{path} was saved by {saved_world} ranks and this run has "
                                             f"{self.world}; resharding it failed ({type(e).__name__}: {e}). "
                                             f"Resume with {saved_world} ranks") from e
            raise
        set_state_dict(self.raw_model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        mine = ckpt.load_rank_state(path, self.rank) if saved_world == self.world else None
        meta.setdefault("rng", (mine or {}).get("rng", {}))

    def _load_full(self, model_sd: dict[str, Any], optim_sd: dict[str, Any] | None) -> None:
        """A full (unsharded) state into a DDP replica or FSDP2 shards: every rank holds the whole state."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.raw_model, model_sd, options=full)
        if optim_sd is not None:
            names = self._param_names()           # one-file optimizer states are keyed by position
            by_name = {"state": {names[int(i)]: v for i, v in optim_sd["state"].items()},
                       "param_groups": [dict(g, params=[names[int(i)] for i in g["params"]])
                                        for g in optim_sd["param_groups"]]}
            set_optimizer_state_dict(self.raw_model, self.optimizer, by_name, options=full)

    def _check_compatible(self, saved: dict[str, Any]) -> None:
        """What is learned must match: model, data, sequence length, global batch, seed. Toggles may differ."""
        now = self.cfg.to_dict()
        for section, key, flag in (("model", "model", "--model"), ("model", "size", "--size"),
                                   ("data", "seq_len", "--seq-len"), ("optim", "global_batch", "--global-batch"),
                                   ("optim", "seed", "--seed"), ("data", "data", "--data")):
            if saved.get(section, {}).get(key) != now[section][key]:
                raise ConfigError(flag, f"the checkpoint was trained with {saved.get(section, {}).get(key)!r}, "
                                        f"this run asks for {now[section][key]!r}; resume needs the same value")

    def _resume(self, target: str) -> None:
        def corrupt(msg: str) -> None:
            self.channel.emit("warning", message=f"corrupt checkpoint skipped: {msg}")
            self.log(f"warning: corrupt checkpoint skipped: {msg}")

        path, state = ckpt.resolve_resume(target, on_corrupt=corrupt, map_location=self.device)
        self.load_state(state)
        self.resumed_from = str(path)
        self.log(f"resumed from {path} at step {self.progress.step}")

    def save_checkpoint(self, reason: str = "interval") -> Path:
        """Collective with several ranks: every rank writes its shards (DCP); one file otherwise."""
        self._check_finite_now()
        t = time.perf_counter()
        if self.group is not None:
            path = rundir.dcp_path_for(self.run_dir, self.progress.step)
            ckpt.save_sharded(self._sharded_state(), self._meta(), self._rank_state(), path, rank=self.rank,
                              barrier=self.group.barrier)
        else:
            path = rundir.path_for(self.run_dir, self.progress.step)
            ckpt.save(self.state_dict(), path)
        if self.rank == 0:
            rundir.prune(self.run_dir, self.cfg.checkpoint.keep_checkpoints)
        seconds = time.perf_counter() - t
        self.last_good = path
        self.emit0("checkpoint", step=self.progress.step, path=str(path), seconds=seconds, reason=reason,
                   tokens=self.progress.tokens)
        if self.rank == 0:
            self.log(f"checkpoint {path.name} ({seconds:.2f} s, {reason})")
        return path

    # --------------------------------------------------------------- micro-batch
    def _auto_micro_batch(self) -> int:
        from .autobatch import find_micro_batch

        local = self.cfg.optim.global_batch // self.world
        x_all, y_all = self.sampler.micro_batch(0, 0, local)
        # Probe without torch.compile: compiling once per probed size would cost minutes and leave the run
        # with a dynamic-shape graph; eager's peak is usually above the compiled one (a safe estimate).
        eager = getattr(self.model, "_orig_mod", self.model)

        def probe_local(mb: int) -> int:
            self.meter.reset_peak()
            try:
                # DDP: no gradient all-reduce. FSDP2 keeps its reduce-scatter (the ranks probe in lockstep), so
                # no unsharded gradient is left accumulated for the first real step.
                with self._sync_grads(last_micro=self.parallel == "fsdp"), self._autocast():
                    loss = self._loss(x_all[:mb].to(self.device), y_all[:mb].to(self.device), 0, 0, model=eager)
                    self.scaler.scale(loss).backward()
                return self.meter.peak()
            finally:
                self.optimizer.zero_grad(set_to_none=True)
                if self.balancer is not None:
                    self.balancer.reset()

        def probe(mb: int) -> int:
            """Several ranks decide together (FSDP's forward is collective): the worst rank's peak counts."""
            if self.group is None:
                return probe_local(mb)
            try:
                peak = float(probe_local(mb))
            except torch.OutOfMemoryError:
                peak = math.inf
            peak = self.group.host_max(peak)
            if math.isinf(peak):
                raise torch.OutOfMemoryError(f"micro-batch {mb} ran out of memory on a rank")
            return int(peak)

        capacity = self.meter.capacity()
        if self.group is not None:
            capacity = int(self.group.host_min(float(capacity)))
        mb = find_micro_batch(probe, local, capacity, margin=0.1, log=self.log if self.rank == 0 else lambda s: None)
        self.log(f"--micro-batch auto: {mb}")
        return mb

    # --------------------------------------------------------------------- loop
    def _loss(self, x: torch.Tensor, y: torch.Tensor, batch_index: int, micro_index: int,
              model: torch.nn.Module | None = None) -> torch.Tensor:
        from .objectives import loss_fn

        gen = None
        if self.bundle.objective == "llada":
            gen = torch.Generator().manual_seed(hash_seed(self.cfg.optim.seed, batch_index, micro_index, self.rank))
        return loss_fn(self.bundle, self.model if model is None else model, x, y, generator=gen)

    def _new_prefetcher(self):
        from .prefetch import Prefetcher

        t = self.cfg.toggles
        return Prefetcher(self.sampler, self.micro_batch, self.progress.batch_cursor, self.device,
                          depth=t.prefetch, workers=t.workers)

    def run(self) -> int:
        cfg = self.cfg
        # A resumed run's checkpoint is already a good state to roll back to (not the initialization).
        resumed = Path(self.resumed_from) if self.resumed_from else None
        self.last_good: Path | None = resumed if resumed is not None and resumed.is_file() else None
        self.timer = make_timer(self.device.type, cfg.log.timing)
        self.prefetcher = self._new_prefetcher()
        self._interval_reset()
        self._t_run = time.perf_counter()
        stop_reason = None
        try:
            while True:
                try:
                    stop_reason = self._train_until_done()
                    self.save_checkpoint("stop" if stop_reason else "final")
                    break
                except NonFiniteLoss as e:
                    self._rollback(e)
        finally:
            self.prefetcher.close()
            self._stop_profiler()
        elapsed = time.perf_counter() - self._t_run
        self.emit0("done", step=self.progress.step, tokens=self.progress.tokens, seconds=elapsed,
                   reason=stop_reason or "max_steps", checkpoint=str(self.last_good))
        self.log(f"done at step {self.progress.step} ({stop_reason or 'max_steps'}) in {elapsed:.1f} s")
        return EXIT_OK

    def _train_until_done(self) -> str | None:
        """Train to max_steps or a stop command (returns its reason). NonFiniteLoss propagates to run()."""
        cfg = self.cfg
        while self.progress.step < cfg.optim.max_steps:
            stop_reason = self._handle_commands()
            if stop_reason:
                return stop_reason
            self._train_step()
            step = self.progress.step
            if self._is_log_step() or step == cfg.optim.max_steps:
                self._flush_interval()
            if cfg.log.eval_every and step % cfg.log.eval_every == 0:
                self._evaluate()
            if cfg.checkpoint.checkpoint_every and step % cfg.checkpoint.checkpoint_every == 0 \
                    and step < cfg.optim.max_steps:
                self.save_checkpoint()
        return None

    def _handle_commands(self) -> str | None:
        if self.group is not None:
            return self._handle_commands_agreed()
        if self.faults.at.get(self.progress.step) == "stop":
            self.faults.take(self.progress.step)
            return "stop (--fault)"
        for cmd in self.channel.pending_commands():
            name = cmd.get("cmd")
            if name == "stop":
                return cmd.get("reason", "stop requested")
            if name == "checkpoint":
                self.save_checkpoint("requested")
            elif name == "profile":
                s = self.progress.step
                self.profile_window = (s, s + int(cmd.get("steps", 3)) - 1)
            else:
                self.channel.emit("warning", message=f"unknown command {name!r} ignored")
        return None

    def _handle_commands_agreed(self) -> str | None:
        """Several ranks: what any rank has pending is all-reduced (MAX), so all act on the same step.

        Vector: [stop code, newest checkpoint request, newest profile request, its steps]. Requests
        are numbered by the sender (ms timestamps); one reaching two ranks on different steps is acted
        on once. A command without a number counts on rank 0 only (every rank got the same one)."""
        stop_code, stop_reason, want = 0, None, {"checkpoint": 0, "profile": 0}
        profile_steps = 0
        if self.faults.at.get(self.progress.step) == "stop":
            self.faults.take(self.progress.step)
            stop_code, stop_reason = D.STOP_FAULT, "stop (--fault)"
        for cmd in self.channel.pending_commands():
            name, source = cmd.get("cmd"), cmd.get("source", "socket")
            seq = cmd.get("seq")
            if name == "stop":
                code = {"signal": D.STOP_SIGNAL, "eof": D.STOP_LAUNCHER_GONE}.get(source, D.STOP_REQUESTED)
                if code > stop_code:
                    stop_code, stop_reason = code, cmd.get("reason", D.STOP_TEXT[code])
                continue
            if not isinstance(seq, int):
                if source == "socket" and self.rank != 0:
                    continue
                seq = time.time_ns() // 1_000_000
            if name in want:
                want[name] = max(want[name], seq)
                if name == "profile":
                    profile_steps = max(profile_steps, int(cmd.get("steps", 3)))
            elif self.rank == 0:
                self.channel.emit("warning", message=f"unknown command {name!r} ignored")
        stop_code, ckpt_seq, prof_seq, prof_steps = self.group.agree(
            [stop_code, want["checkpoint"], want["profile"], profile_steps])
        if ckpt_seq > self._done_seq["checkpoint"]:
            self._done_seq["checkpoint"] = ckpt_seq
            self.save_checkpoint("requested")
        if prof_seq > self._done_seq["profile"]:
            self._done_seq["profile"] = prof_seq
            s = self.progress.step
            self.profile_window = (s, s + max(1, prof_steps) - 1)
        if stop_code:
            return stop_reason or f"{D.STOP_TEXT.get(stop_code, 'stop')} (another rank)"
        return None

    def _is_log_step(self) -> bool:
        return self.progress.step % self.cfg.log.log_every == 0

    def _interval_reset(self) -> None:
        self._loss_sum = torch.zeros((), device=self.device)
        self._grad_norm = torch.zeros((), device=self.device)
        self._bad = []      # (step, batch_index, device bool tensor)
        self._comm_ms: list[float | None] = []
        self._interval_steps = 0
        self._interval_t0 = time.perf_counter()
        self.meter.reset_peak()

    def _maybe_profile(self, step: int) -> None:
        w = self.profile_window
        if w and step == w[0] and self._profiler is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.dev.is_cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=acts)
            self._profiler.__enter__()
            self._profile_span = w

    def _stop_profiler(self) -> None:
        if self._profiler is None:
            return
        self._profiler.__exit__(None, None, None)
        a, b = self._profile_span
        suffix = f".rank{self.rank}" if self.rank else ""
        out = rundir.RunDir(self.run_dir).profiles / f"steps-{a}-{b}{suffix}.json"
        out.parent.mkdir(exist_ok=True)
        self._profiler.export_chrome_trace(str(out))
        self._profiler = None
        self.profile_window = None
        self.channel.emit("log", message=f"profiler trace of steps {a}-{b} written to {out}", path=str(out))

    def _train_step(self) -> None:
        p, cfg = self.progress, self.cfg
        while p.batch_cursor in p.skip_batches:     # batches that poisoned the run before
            for _ in range(self.accum):
                self.prefetcher.get()
            p.batch_cursor += 1
        step, bi = p.step, p.batch_cursor
        self._maybe_profile(step)
        fault = self.faults.take(step)
        lr = lr_at(step, cfg) * p.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        timer = self.timer
        timer.begin_step(step)
        step_loss = torch.zeros((), device=self.device)
        for micro in range(self.accum):
            with timer.phase("data"):
                got_bi, got_mi, x, y = self.prefetcher.get()
            assert got_bi == bi and got_mi == micro, f"data order broken: got {got_bi}/{got_mi}, want {bi}/{micro}"
            sync = self._sync_grads(last_micro=micro == self.accum - 1)
            sync.__enter__()
            with timer.phase("forward"):
                with self._autocast():
                    loss = self._loss(x, y, bi, micro) / self.accum
                if fault == "nan":
                    loss = loss * float("nan")
                elif fault == "oom":
                    raise torch.OutOfMemoryError(f"injected out-of-memory at step {step} (--fault)")
                elif fault == "crash":
                    raise RuntimeError(f"injected crash at step {step} (--fault)")
                elif fault == "kill":
                    os.kill(os.getpid(), 9)
                elif fault == "compile":
                    from torch._dynamo.exc import BackendCompilerFailed

                    raise BackendCompilerFailed(lambda *a: None, RuntimeError("injected compile error (--fault)"))
                fault = None
            with timer.phase("backward"):
                self.scaler.scale(loss).backward()
            sync.__exit__(None, None, None)
            step_loss += loss.detach()
        with timer.phase("optimizer"):
            self.scaler.unscale_(self.optimizer)
            if cfg.optim.grad_clip > 0:
                norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), cfg.optim.grad_clip)
            else:
                norm = torch.linalg.vector_norm(torch.stack(
                    [g.grad.detach().norm() for g in self.raw_model.parameters() if g.grad is not None]))
            if hasattr(norm, "full_tensor"):       # FSDP2: a DTensor; the norm over all shards
                norm = norm.full_tensor()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            if self.balancer is not None:
                self.balancer.update()
        timer.end_step()
        if self.comm is not None:
            self._comm_ms.append(self.comm.take_ms())
        self._bad.append((step, bi, ~torch.isfinite(step_loss)))
        self._loss_sum += step_loss
        self._grad_norm = norm.detach()
        self._interval_steps += 1
        p.step += 1
        p.batch_cursor += 1
        p.tokens += self.tokens_per_step
        if self._profiler is not None and step >= self._profile_span[1]:
            self._stop_profiler()

    def _check_finite_now(self) -> None:
        """Read back the interval's non-finite flags (one sync); raise before a poisoned state is used."""
        if not self._bad:
            return
        stacked = torch.stack([b for _, _, b in self._bad]).to(torch.int32)
        if self.group is not None:       # a non-finite loss on any rank rolls every rank back
            self.group.max_(stacked)
        flags = stacked.cpu().tolist()
        for (step, bi, _), bad in zip(self._bad, flags):
            if bad:
                raise NonFiniteLoss(step, bi)
        self._bad = []

    def _flush_interval(self) -> None:
        n = self._interval_steps
        if n == 0:
            return
        if self.group is not None:                  # the global batch's loss: mean over ranks
            self.group.sum_(self._loss_sum)
            self._loss_sum /= self.world
        loss = (self._loss_sum / n).item()          # the one sync per log interval
        grad_norm = self._grad_norm.item()
        self._check_finite_now()
        now = time.perf_counter()
        wall = now - self._interval_t0
        timings: list[StepTiming] = self.timer.collect()
        tokens_per_s = n * self.tokens_per_step / wall if wall > 0 else None
        step_ms = sum(t.step_ms for t in timings) / len(timings) if timings else wall * 1e3 / n
        phases = None
        if timings and timings[0].phases_ms is not None:
            phases = {k: sum(t.phases_ms[k] for t in timings) / len(timings) for k in timings[0].phases_ms}
        idle = [t.gpu_idle_ms for t in timings if t.gpu_idle_ms is not None]
        fields: dict[str, Any] = dict(
            step=self.progress.step, tokens=self.progress.tokens, loss=loss,
            lr=self.optimizer.param_groups[0]["lr"], grad_norm=grad_norm, step_ms=step_ms, phases_ms=phases,
            tokens_per_s=tokens_per_s, mfu=self._checked_mfu(tokens_per_s),
            mem_bytes=self.meter.peak(), interval_steps=n, wall_ms=wall * 1e3 / n)
        fields["batch"] = self.progress.batch_cursor - 1   # global batch index of the last step (data-order checks)
        if idle:
            fields["gpu_idle_ms"] = sum(idle) / len(idle)
        comm = [c for c in self._comm_ms if c is not None]
        if comm:
            fields["comm_ms"] = sum(comm) / len(comm)
        if self.balancer is not None:
            fields["expert_load"] = self.balancer.load()
        self.channel.emit("step", **fields)
        self._interval_reset()

    def _checked_mfu(self, tokens_per_s: float | None) -> float | None:
        """MFU of the run, or None. Above 1 the peak is wrong (a CPU peak measured on a busy machine):
        say so once, drop that cached peak so the next run measures again, and report null from here on."""
        from .flops import cpu_dtype, forget_cpu_peak, mfu

        value = mfu(tokens_per_s, self.bundle.flops_per_token, self.peak_flops * self.world if self.peak_flops else None)
        if value is None or value <= 1.0:
            return value
        where = "the datasheet peak" if self.dev.is_cuda else "the measured CPU matmul peak"
        msg = (f"MFU would be {value:.2f} (> 1): {where} ({self.peak_flops / 1e9:,.1f} GFLOP/s per process) is "
               f"below what the model achieves, so it is not a peak; MFU is not reported for the rest of this run")
        if not self.dev.is_cuda:
            dtypes = {cpu_dtype(self.cfg.toggles.precision), torch.float32}   # a bf16 peak is never below fp32's
            dropped = [forget_cpu_peak(d, cpu_name=self.dev.name, procs=self._local_procs) for d in dtypes]
            if any(dropped):
                msg += " and the cached peak is dropped (the next run measures it again, best on an idle machine)"
        self.emit0("warning", message=msg, kind="peak_flops")
        self.peak_flops = None
        return None

    def _evaluate(self) -> None:
        from .data import val_batches

        if not hasattr(self, "_val"):
            self._val = val_batches(self.data, self.cfg.data.seq_len, self.micro_batch, self.cfg.log.eval_batches,
                                    self.cfg.optim.seed)
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

    def _rollback(self, e: NonFiniteLoss) -> None:
        cfg = self.cfg
        p = self.progress
        self.emit0("warning", message=str(e), step=e.step, batch=e.batch_index)
        if cfg.run.nan_policy == "stop" or p.nan_rollbacks >= cfg.run.nan_retries:
            why = "--nan-policy stop" if cfg.run.nan_policy == "stop" else f"{p.nan_rollbacks} rollbacks already"
            self._fail("nan", f"{e}; giving up ({why}). Try a lower --lr or another --precision.")
        skips = sorted(set(p.skip_batches) | {e.batch_index})
        rollbacks, scale = p.nan_rollbacks + 1, p.lr_scale * cfg.run.nan_lr_factor
        self.prefetcher.close()
        if self.last_good is not None:
            self.load_state(ckpt.load(self.last_good, map_location=self.device))
            source = self.last_good.name
        else:
            self._reinitialize()
            source = "initialization (no checkpoint yet)"
        self.optimizer.zero_grad(set_to_none=True)
        if self.balancer is not None:
            self.balancer.reset()
        p = self.progress
        p.skip_batches, p.nan_rollbacks, p.lr_scale = skips, rollbacks, scale
        msg = (f"rolled back to {source} at step {p.step}; skipping batch {e.batch_index}; "
               f"learning rate x{scale:g} (rollback {rollbacks}/{cfg.run.nan_retries})")
        self.emit0("warning", message=msg, kind="nan_rollback", step=p.step, skip_batches=skips, lr_scale=scale)
        self.log(msg)
        self.timer.collect()
        self._interval_reset()
        self.prefetcher = self._new_prefetcher()

    def _reinitialize(self) -> None:
        from .models import build_model

        torch.manual_seed(self.cfg.optim.seed)
        fresh = build_model(self.cfg.model, vocab_size=self.data.vocab_size, seq_len=self.cfg.data.seq_len,
                            toggles=self.cfg.toggles, dev=self.dev, mask_id=self.data.mask_id, seed=self.cfg.optim.seed)
        if self.group is not None:
            self._load_full(fresh.model.state_dict(), None)
        else:
            self.raw_model.load_state_dict(fresh.model.state_dict())
        self.optimizer = self._make_optimizer()
        self.progress = Progress()

    def _fail(self, kind: str, message: str, **extra: Any) -> None:
        code = {"oom": EXIT_OOM, "nan": EXIT_NAN, "config": EXIT_CONFIG, "compile": EXIT_COMPILE}.get(kind, EXIT_CRASH)
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


def main_run(cfg: TrainConfig) -> int:
    """Run a configured trainer, turning every failure into an `error` event and a distinct exit code."""
    if cfg.toggles.cuda_allocator == "expandable_segments":
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    trainer = None
    try:
        trainer = Trainer(cfg)
        trainer.setup()
        return trainer.run()
    except Stop as s:
        return s.code
    except ConfigError as e:
        return _report(trainer, "config", str(e), EXIT_CONFIG)
    except torch.OutOfMemoryError as e:
        extra = {"toggles": cfg.to_dict()["toggles"], "memory": trainer.memory_figures() if trainer else {}}
        return _report(trainer, "oom", f"out of memory: {str(e).splitlines()[0] if str(e) else ''} -- try a smaller "
                                       f"--micro-batch, --activation-checkpointing or bf16", EXIT_OOM, **extra)
    except Exception as e:
        if trainer is not None and trainer.world > 1 and D.is_comm_error(e):
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            return _report(trainer, "crash", f"lost contact with another rank, which probably failed (see its "
                                             f"error): {first}", EXIT_CRASH, lost_peer=True)
        if _is_compile_error(e):
            return _report(trainer, "compile", f"torch.compile failed ({cfg.toggles.compile}): "
                                               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                           EXIT_COMPILE, traceback=traceback.format_exc())
        return _report(trainer, "crash", f"{type(e).__name__}: {e}", EXIT_CRASH, traceback=traceback.format_exc())
    finally:
        if trainer is not None and trainer.channel is not None:
            trainer.channel.close()
        if trainer is not None and trainer.group is not None:
            trainer.group.destroy()


def _is_compile_error(e: BaseException) -> bool:
    mod = type(e).__module__
    return mod.startswith("torch._dynamo") or mod.startswith("torch._inductor")


def _report(trainer: Trainer | None, kind: str, message: str, code: int, **extra: Any) -> int:
    tb = extra.pop("traceback", None)
    if tb:
        print(tb, file=sys.stderr, flush=True)
    print(f"[trainer] error ({kind}): {message}", file=sys.stderr, flush=True)
    if trainer is not None and trainer.channel is not None:
        step = trainer.progress.step
        trainer.channel.emit("error", kind=kind, message=message, step=step, exit_code=code, **extra)
    return code
