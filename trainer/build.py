"""The run's components, each built by a function that returns it (after torchtitan's `Trainer.__init__`,
which assigns what each component's builder returns): the resolved config, the data and its sampler, the
model, its precision and parallel wrapping, and the content of the hello events.

Nothing here changes the config it is given. What `auto` and the defaults become on this device is a new
config that the trainer keeps (`resolve_config`, `replaced`); the run records it (config.toml, the hello,
every checkpoint), so a resume or a tuner trial runs the same.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from . import dist as D
from .contract import capabilities, rundir
from .contract import estimate as E
from .contract.config import AUTO, TrainConfig
from .contract.device import DeviceInfo, gpu_key
from .batches import BatchSampler
from .data import TokenData, load_data
from .device_probe import gpu_identity
from .models import ModelBundle, build_model, is_pretrained_path, resolve_size
from .tf32 import allow_tf32


# --------------------------------------------------------------------- config
def replaced(cfg: TrainConfig, section: str, **values: Any) -> TrainConfig:
    """A copy of `cfg` with `values` set in `section`; every section is copied, so the two share nothing."""
    copy = TrainConfig(**{f.name: dataclasses.replace(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)})
    setattr(copy, section, dataclasses.replace(getattr(copy, section), **values))
    return copy


def resolve_config(cfg: TrainConfig, dev: DeviceInfo) -> TrainConfig:
    """`cfg` with what its defaults become on `dev`: a pretrained model's own tokenizer, `--size auto`,
    `--precision auto` and the default run directory (named by the resolved size). The micro-batch is
    resolved later, by probing the built model (`Trainer.resolve_micro_batch`)."""
    if is_pretrained_path(cfg.model.model):
        if cfg.data.tokenizer is None:
            cfg = replaced(cfg, "data", tokenizer=cfg.model.model)
    elif cfg.model.size == AUTO:
        cfg = replaced(cfg, "model", size=resolve_size(AUTO, cfg.model.model, dev, **E.run_options(cfg)))
    cfg = replaced(cfg, "toggles", precision=capabilities.resolve_precision(cfg.toggles.precision, dev))
    return replaced(cfg, "run", run_dir=str(Path(cfg.run.run_dir or rundir.default_run_dir(cfg))))


# --------------------------------------------------------------------- device
def select_device(dev: DeviceInfo) -> None:
    """Make `dev` the process's device before anything is allocated."""
    if dev.is_cuda:
        # One process on cuda:N too (several ranks set it in dist.Group.init): whatever uses the current
        # device (an event or a stream without one named, a library's allocation) then uses the run's GPU.
        torch.cuda.set_device(dev.torch_device)
    else:
        from .hostalloc import keep_freed_memory

        keep_freed_memory()  # reuse freed tensors instead of page-faulting them in every step


def local_procs() -> int:
    """The ranks sharing this node's CPU and RAM."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)


def rank_memory(dev: DeviceInfo, procs: int) -> int | None:
    """The memory one rank trains in: its GPU's, or its share of the RAM (the node's `procs` ranks share it)."""
    if not dev.total_memory:
        return None
    return dev.total_memory if dev.is_cuda else dev.total_memory // procs


def node_gpus(dev: DeviceInfo, world: int, procs: int) -> list[str] | None:
    """gpu_key of each GPU this node's ranks train on (rank i on cuda:LOCAL_RANK, dist.rank_device)."""
    if not dev.is_cuda:
        return None
    if world == 1:
        keys = dev.keys
    else:
        ids = [gpu_identity(i) for i in range(procs)]
        keys = [k for uuid, pci in ids for k in (gpu_key(uuid), gpu_key(None, pci)) if k]
    return keys or None


# ----------------------------------------------------------------------- data
def build_data(
    cfg: TrainConfig, *, rank: int, world: int, log: Callable[[str], None], phase: Callable[[str, float | None], None]
) -> tuple[TokenData, BatchSampler]:
    """The tokenized corpus (cached) and this rank's sampler over its training split."""
    data = load_data(cfg.data, log=log, phase=phase)
    sampler = BatchSampler(
        data.train, cfg.data.seq_len, cfg.optim.global_batch, cfg.optim.seed, rank=rank, world_size=world
    )
    return data, sampler


# ---------------------------------------------------------------------- model
def model_name(cfg: TrainConfig) -> str:
    """The model as the building phase names it: a pretrained path, or the family and size."""
    return cfg.model.model if is_pretrained_path(cfg.model.model) else f"{cfg.model.model} {cfg.model.size}"


def build_bundle(cfg: TrainConfig, data: TokenData, dev: DeviceInfo) -> ModelBundle:
    """The run's model, freshly initialized from the seed, on the CPU in fp32 (trainer.models)."""
    return build_model(
        cfg.model,
        vocab_size=data.vocab_size,
        seq_len=cfg.data.seq_len,
        toggles=cfg.toggles,
        dev=dev,
        mask_id=data.mask_id,
        seed=cfg.optim.seed,
        finetune=cfg.finetune,
    )


@dataclass
class Precision:
    """How the run computes: the autocast dtype (None: none) and the grad scaler (enabled for fp16)."""

    autocast_dtype: torch.dtype | None
    scaler: torch.amp.GradScaler


def build_precision(model: torch.nn.Module, precision: str, dev: DeviceInfo, parallel: str | None) -> Precision:
    """The run's precision on `model` (on its device): fp8 converts its linear layers in place, and on a GPU
    the TF32 matmul setting is process-wide."""
    autocast_dtype = {
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "fp8-tensorwise": torch.bfloat16,
        "fp8-rowwise": torch.bfloat16,
    }.get(precision)
    if parallel == "fsdp":
        autocast_dtype = D.fsdp_precision(precision)[1]  # FSDP2's MixedPrecisionPolicy casts instead
    if dev.is_cuda:
        # A mixed-precision run lets the fp32 matmuls left outside autocast use TF32 too; fp32 means fp32.
        allow_tf32(precision != "fp32" and dev.at_least(8, 0))
    if precision.startswith("fp8"):
        from .fp8 import convert_to_fp8

        convert_to_fp8(model, precision.split("-", 1)[1])
    return Precision(autocast_dtype, torch.amp.GradScaler(dev.torch_device.type, enabled=(precision == "fp16")))


@dataclass
class Wrapped:
    """The parallel wrapping of a model: DDP's wrapper and, over gloo, its communication timer."""

    ddp: torch.nn.Module | None = None
    comm: D.CommTimer | None = None


def wrap_parallel(
    model: torch.nn.Module,
    group: D.Group | None,
    parallel: str | None,
    precision: str,
    dev: DeviceInfo,
    *,
    is_moe: bool,
) -> Wrapped:
    """Several ranks: DDP (gradient all-reduce overlapping backward) or FSDP2 (sharded parameters, in place)."""
    if group is None:
        return Wrapped()
    if parallel == "fsdp":
        D.apply_fsdp(model, precision)
        return Wrapped()
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(
        model, device_ids=[dev.torch_device.index] if dev.is_cuda else None, find_unused_parameters=is_moe
    )  # experts a batch did not route to
    if group.backend != "gloo":
        return Wrapped(ddp)
    comm = D.CommTimer(group.world)
    comm.register(ddp)
    return Wrapped(ddp, comm)


# ------------------------------------------------------------------- batching
@dataclass
class Batching:
    """How a step is cut: micro-batch x accumulation sequences per rank, and the global tokens per step."""

    micro_batch: int
    accumulation: int
    tokens_per_step: int


def batching(cfg: TrainConfig, sampler: BatchSampler) -> Batching:
    """The batching of a config whose micro-batch is resolved (a number)."""
    mb = cfg.toggles.micro_batch
    return Batching(mb, sampler.accumulation_steps(mb), cfg.optim.global_batch * cfg.data.seq_len)


# ---------------------------------------------------------------------- hello
def run_estimate(
    cfg: TrainConfig,
    dev: DeviceInfo,
    *,
    capacity: int | None,
    peak_flops: float | None,
    world: int,
    parallel: str | None,
) -> tuple[E.Estimate | None, dict[str, Any]]:
    """What the run will cost before anything is built (None for a pretrained model or an unknown size),
    and the estimate's arguments (for the largest size that fits, when it does not)."""
    if is_pretrained_path(cfg.model.model) or cfg.model.size not in E.SIZES:
        return None, {}
    kw = dict(
        seq_len=cfg.data.seq_len,
        global_batch=cfg.optim.global_batch,
        micro_batch=cfg.toggles.micro_batch_int(),
        precision=cfg.toggles.precision,
        device=dev.type,
        capacity=capacity,
        peak_flops=peak_flops,
        world_size=world,
        fsdp=parallel == "fsdp",
        checkpointing=cfg.toggles.activation_checkpointing,
        **E.run_options(cfg),
    )
    return E.estimate(cfg.model.model, cfg.model.size, **kw), kw


def early_hello(
    cfg: TrainConfig, dev: DeviceInfo, est: E.Estimate | None, *, world: int, parallel: str | None, auto: list[str]
) -> dict[str, Any]:
    """The first event's fields: the run as configured and what it will cost."""
    model: dict[str, Any] = {"family": cfg.model.model, "size": cfg.model.size}
    if est is not None:
        model.update(
            total_params=est.total_params, active_params=est.active_params, flops_per_token=est.flops_per_token
        )
    return dict(
        pid=os.getpid(),
        world_size=world,
        parallel=parallel,
        config=cfg.to_dict(),
        device=dev.to_dict(),
        model=model,
        early=True,
        auto=auto,
        estimate=est.to_info() if est is not None else None,
        torch=torch.__version__,
    )


def hello(
    cfg: TrainConfig,
    dev: DeviceInfo,
    bundle: ModelBundle,
    data: TokenData,
    batching: Batching,
    *,
    world: int,
    parallel: str | None,
    peak_flops: float | None,
    peak_source: str | None,
    resumed_from: str | None,
    start: tuple[int, int],
    gpus: list[str] | None,
    auto: list[str],
) -> dict[str, Any]:
    """The hello's fields once the run is built: the model, the data, the batching, the peak it is measured
    against and where it starts (`start`: the step and the token count it resumed at)."""
    b = bundle
    return dict(
        pid=os.getpid(),
        world_size=world,
        parallel=parallel,
        config=cfg.to_dict(),
        device=dev.to_dict(),
        model={
            "family": b.family,
            "size": b.size,
            "total_params": b.total_params,
            "active_params": b.active_params,
            "embedding_params": b.embedding_params,
            "trainable_params": b.trainable_params,
            "vocab_size": b.vocab_size,
            "flops_per_token": b.flops_per_token,
            "objective": b.objective,
        },
        data={"train_tokens": int(len(data.train)), "val_tokens": int(len(data.val)), "fingerprint": data.fingerprint},
        accumulation=batching.accumulation,
        micro_batch=batching.micro_batch,
        tokens_per_step=batching.tokens_per_step,
        peak_flops=peak_flops,
        peak_source=peak_source,
        resumed_from=resumed_from,
        start_step=start[0],
        start_tokens=start[1],
        torch=torch.__version__,
        gpus=gpus,
        auto=auto,
    )
