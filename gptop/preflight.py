"""The preflight of a run: parsed arguments in, a resolved and checked plan out.

`plan_run` (gptop train / tune) and `plan_program` (gptop run / tune -- CMD) take the parsed command line and
do every check that needs more than one flag (the config, a resume, the world's batch split, the device's
memory, what the search space and a multi-node run allow), raising ConfigError (exit 2, the option named)
before any process starts or any file is made. What they return says what to run and how to take the run
directory; `claim_run_dir` takes it, and removes what it made when the run is refused. No torch here: the
device is what NVML and the OS say (gptop.telemetry).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, NamedTuple

from trainer.contract import inputs, protect
from trainer.contract.config import AUTO, ConfigError, TrainConfig, check_resumable, config_from_args, resume_config
from trainer.contract.rundir import default_run_dir, resumes_into
from trainer.contract.runlock import RunLock, lock_option, node_key

from .alert_options import alert_options
from .session import DEFAULT_T_BUDGET_S, SessionOptions, TuningOptions

if TYPE_CHECKING:
    from trainer.contract.estimate import Estimate

    from .supervisor import TorchrunLauncher


class DeviceMemory(NamedTuple):
    """The memory one rank of a run trains in: `kind` cuda or cpu, a name for messages, its size in bytes."""

    kind: str
    name: str
    total: int


@dataclasses.dataclass(frozen=True)
class MemoryFit:
    """The estimate a run was checked against, and the device it was checked on."""

    device: DeviceMemory
    estimate: "Estimate"


@dataclasses.dataclass(frozen=True)
class LockRequest:
    """What taking a run directory needs (RunLock.acquire's arguments): the directory, the holder's command,
    the node of a multi-node run (which shares the directory and creates nothing), whether the run is new
    there, and the option a refusal names."""

    run_dir: str | Path
    command: str
    node: str | None = None
    new_run: bool = False
    option: str = "--run-dir"


@dataclasses.dataclass
class RunPlan:
    """A `gptop train`/`tune` run, resolved and checked: what the session runs and how."""

    cfg: TrainConfig
    resume: str | None  # the checkpoint or run directory it continues from
    world_size: int  # ranks, when fixed (an elastic range: the ranks of this node)
    launcher: "TorchrunLauncher | None"  # torchrun, or None for one plain process
    fit: MemoryFit | None  # None: the trainer checks (--size auto, a model directory, other nodes)
    tuning: TuningOptions | None  # a tuning started with the run (gptop tune, --tune)
    options: SessionOptions  # the session's, less the lock (taken by claim_run_dir)
    lock: LockRequest


@dataclasses.dataclass
class ProgramPlan:
    """A `gptop run -- CMD` (or `gptop tune -- CMD`) run, checked: the command, where it runs, and how."""

    command: list[str]
    run_dir: Path
    log_every: int | None  # --log-every, else the program's own
    grace_s: float  # seconds between the stop signal and SIGKILL
    tune: bool
    tuning: TuningOptions | None
    options: SessionOptions
    lock: LockRequest
    resume: str | None = None  # a command resumes itself


# ---------------------------------------------------------------------------------------- gptop train / tune


def plan_run(ns: argparse.Namespace) -> RunPlan:
    """The checked plan of `gptop train`/`tune` from its parsed arguments; ConfigError (exit 2) for what
    cannot run, in the order a user fixes them: the config, the flags together, --wandb, the memory, the nodes."""
    if getattr(ns, "quiet", False):
        raise ConfigError("--quiet", "is for a command's output (gptop tune -- CMD); gptop's own trainer prints none")
    cfg = resolve_config(ns)
    check_run_args(ns, cfg)
    if ns.wandb:
        from .wandb_writer import require_wandb

        require_wandb()
    fit = check_fits(ns, cfg)
    launcher = launcher_of(ns)
    tuning = tuning_request(ns)
    multi_node = launcher is not None and launcher.multi_node
    if multi_node and tuning is not None:
        raise ConfigError(
            "--nnodes",
            "tuning restarts the trainer, which one gptop cannot do for other nodes; "
            "tune on one node (--nproc N) and train the nodes with its best.toml",
        )
    resume, run_dir = cfg.checkpoint.resume, cfg.run.run_dir
    assert run_dir is not None  # resolve_config names every run's directory
    # A new run (not a resume of the run there) in a directory another run left its events or checkpoints in
    # is refused when the lock is taken: one run per run directory.
    lock = LockRequest(
        run_dir,
        command=f"gptop {ns.command}",
        node=node_key(ns.node_rank) if multi_node else None,
        new_run=not resumes_into(resume, run_dir),
        option=lock_option(resume, run_dir),
    )
    options = SessionOptions(
        interval=ns.interval,
        restart_on_failure=ns.restart_on_failure,
        tensorboard=ns.tensorboard,
        wandb=ns.wandb,
        launcher=launcher,
        tuning=tuning_options(ns),  # the `t` key
        alerts=alert_options(ns),
        notify=ns.notify,
        notify_cmd=ns.notify_cmd,
    )
    return RunPlan(
        cfg=cfg,
        resume=resume,
        world_size=world_size(ns),
        launcher=launcher,
        fit=fit,
        tuning=tuning,
        options=options,
        lock=lock,
    )


def world_size(ns: argparse.Namespace) -> int:
    """The ranks of a `gptop train`/`tune` (--nproc per node, times --nnodes when fixed; an elastic range
    is left to the trainer, which knows its world when it starts)."""
    nproc = getattr(ns, "nproc", 1)
    nnodes = getattr(ns, "nnodes", "1")
    return nproc * int(nnodes) if ":" not in nnodes else nproc


def max_nodes(nnodes: str) -> int:
    """The most nodes `--nnodes N|MIN:MAX` allows."""
    return int(nnodes.split(":")[-1])


def launcher_of(ns: argparse.Namespace) -> "TorchrunLauncher | None":
    """torchrun for --nproc > 1 or several nodes; None runs the trainer as one plain process."""
    from .supervisor import TorchrunLauncher

    launcher = TorchrunLauncher(ns.nproc, ns.nnodes, ns.node_rank, ns.rdzv_endpoint, ns.rdzv_backend, ns.rdzv_id)
    if ns.nproc == 1 and not launcher.multi_node:
        return None
    return launcher


def tuning_request(ns: argparse.Namespace) -> TuningOptions | None:
    """The tuning `gptop tune` (--budget) or `gptop train --tune DURATION` starts with the run; None without."""
    budget = ns.budget if ns.command == "tune" else getattr(ns, "tune", None)
    if budget is None:
        return None
    return tuning_options(ns, float(budget))


def tuning_options(ns: argparse.Namespace, budget_s: float = DEFAULT_T_BUDGET_S) -> TuningOptions:
    """The tuning group's options (`--tune-space`, `--storage`, `--stable-within`, `--max-trials`,
    `--tune-only`); without a budget, the `t` key's default one."""
    return TuningOptions(
        budget_s=budget_s,
        space_spec=ns.tune_space,
        storage=ns.storage,
        tune_only=getattr(ns, "tune_only", False),
        stable_within=ns.stable_within,
        max_trials=ns.max_trials,
    )


def resolve_config(ns: argparse.Namespace) -> TrainConfig:
    """The run's config with every input checked (numbers, paths, the world's batch split), before anything
    is started or created."""
    base = resume_config(getattr(ns, "checkpoint.resume", None))
    cfg = config_from_args(ns, base, world_size=world_size(ns))
    if base is not None:
        check_resumable(base.to_dict(), cfg, f"the run in {base.run.run_dir}")
    if cfg.run.run_dir is None:
        from .telemetry import resolved_size  # a --size auto run is named by the size it resolves to

        cfg.run.run_dir = default_run_dir(cfg, size=resolved_size(cfg))
    return cfg


def check_run_args(ns: argparse.Namespace, cfg: TrainConfig) -> None:
    """The checks of `train`/`tune` flags that need more than one flag (or the config), before anything is
    created: what the trainer would refuse once it runs is refused here already where gptop can tell without
    torch (a LoRA target or rank a family cannot take, an option the device cannot run, a resume that
    changes what is learned)."""
    node_rank = getattr(ns, "node_rank", None)
    if node_rank is not None and ":" not in ns.nnodes and node_rank >= max_nodes(ns.nnodes):
        raise ConfigError("--node-rank", f"{node_rank} is not below --nnodes {ns.nnodes}")
    from trainer.contract import estimate

    from .telemetry import certain_cpu, resolved_size

    ft = cfg.finetune
    size = (resolved_size(cfg) or "tiny") if cfg.model.size == "auto" else cfg.model.size
    estimate.check_lora(cfg.model.model, size, ft.lora, ft.lora_targets)
    cpu = certain_cpu(cfg.run.device)
    if cpu is not None:
        from trainer.contract.capabilities import check_config

        check_config(cfg, cpu)
    spec = getattr(ns, "tune_space", None)
    if spec is not None:
        from tuner.space import SearchSpace, quantizable

        SearchSpace.check_spec(spec, cfg.toggles, cfg.optim.global_batch, world_size(ns), quantizable(cfg))


def device_memory(cfg: TrainConfig) -> DeviceMemory | None:
    """The memory one rank of this run will train in, without torch: the GPU's for cuda, else the machine's
    RAM (gptop.telemetry.training_device, the guess that also names `--size auto` run directories); None for
    an explicit cuda device gptop cannot see: the trainer checks again once it knows its device."""
    from .telemetry import training_device

    dev = training_device(cfg.run.device)
    if dev.is_cuda:
        return DeviceMemory("cuda", dev.name or f"cuda:{dev.index}", int(dev.total_memory))
    if cfg.run.device not in ("auto", "cpu"):
        return None
    return DeviceMemory("cpu", "this CPU", int(dev.total_memory))


def check_fits(ns: argparse.Namespace, cfg: TrainConfig) -> MemoryFit | None:
    """Refuse a run whose estimated memory (trainer.contract.estimate) exceeds the device's, before a
    trainer is started: exit 2 with the estimate and the largest size that fits. `--size auto` and a
    model directory are left to the trainer (it resolves them), and so are other nodes' devices (None)."""
    from trainer.contract import estimate as E

    launcher = launcher_of(ns)
    if (
        cfg.model.size not in E.SIZES
        or inputs.is_model_path(cfg.model.model)
        or (launcher is not None and launcher.multi_node)
    ):
        return None
    found = device_memory(cfg)
    if found is None:
        return None
    device = DeviceMemory(*found)
    world, nproc = world_size(ns), getattr(ns, "nproc", 1)
    capacity = device.total // nproc if device.kind == "cpu" else device.total  # ranks on one CPU share its RAM
    precision = cfg.toggles.precision
    if precision == AUTO:  # what the trainer will resolve it to there
        from trainer.contract.capabilities import auto_precision

        from .telemetry import training_device

        precision = auto_precision(training_device(cfg.run.device))
    kw = dict(
        seq_len=cfg.data.seq_len,
        global_batch=cfg.optim.global_batch,
        micro_batch=cfg.toggles.micro_batch_int(),
        precision=precision,
        device=device.kind,
        capacity=capacity,
        world_size=world,
        fsdp=world > 1 and cfg.run.parallel == "fsdp",
        checkpointing=cfg.toggles.activation_checkpointing,
        **E.run_options(cfg),
    )
    est = E.estimate(cfg.model.model, cfg.model.size, **kw)
    if not est.fits:
        raise ConfigError("--size", E.refusal(est, device.name, E.largest_fitting(cfg.model.model, **kw)))
    return MemoryFit(device, est)


# ------------------------------------------------------------------------------ gptop run / tune -- CMD

COMMAND_TUNE_OPTIONS = ("run.run_dir", "log.log_every")  # trainer options that mean something for a command
MAX_GRAMMAR_BATCH = 2**20  # a per-device batch every power-of-two micro-batch divides: --tune-space's grammar


def plan_program(ns: argparse.Namespace, tune: bool = False) -> ProgramPlan:
    """The checked plan of `gptop run -- CMD` (and, with `tune`, `gptop tune -- CMD`): the options, then the
    command, then --wandb; ConfigError (exit 2, naming what was wrong) before anything is created."""
    from .program import check_command
    from .program import default_run_dir as program_run_dir

    if tune:
        given_dir, log_every = check_command_tune(ns)
        grace = 30.0
    else:
        given_dir, log_every, grace = (Path(ns.run_dir) if ns.run_dir else None), ns.log_every, ns.grace
    command = check_command(ns.cmd)
    if ns.wandb:
        from .wandb_writer import require_wandb

        require_wandb()
    run_dir = Path(given_dir or program_run_dir(command))
    tuning = tuning_options(ns, float(ns.budget)) if tune else None
    options = SessionOptions(
        interval=ns.interval,
        restart_on_failure=ns.restart_on_failure,
        tensorboard=ns.tensorboard,
        wandb=ns.wandb,
        alerts=alert_options(ns),
        notify=ns.notify,
        notify_cmd=ns.notify_cmd,
    )
    return ProgramPlan(
        command=command,
        run_dir=run_dir,
        log_every=log_every,
        grace_s=grace,
        tune=tune,
        tuning=tuning,
        options=options,
        lock=LockRequest(run_dir, command=f"gptop {ns.command}", new_run=True),  # a command never resumes here
    )


def check_command_tune(ns: argparse.Namespace) -> tuple[Path | None, int | None]:
    """`gptop tune [options] -- CMD`: the options of gptop's own trainer (the model, the data, the toggles, ...)
    are CMD's business, so giving one is an error naming it (exit 2); --run-dir and --log-every keep their
    meaning. Returns them, checked. The --tune-space grammar and names are checked here too (the values a
    script's batch allows once its client says hello)."""
    from trainer.contract.config import SECTIONS, flag_of

    from tuner.command_space import check_spec

    typed = [k for k in vars(ns) if "." in k and k not in COMMAND_TUNE_OPTIONS] + (
        ["config"] if "config" in vars(ns) else []
    )
    if typed:
        flags = {f"{sec}.{f.name}": flag_of(f) for sec, c in SECTIONS.items() for f in dataclasses.fields(c)}
        flag = flags.get(typed[0], "--" + typed[0].rpartition(".")[2])
        raise ConfigError(
            flag,
            "is an option of gptop's own trainer; with a command, what trains is the "
            "command's (set it in your script); gptop tune -- CMD takes --run-dir, --log-every "
            "and the tuning and session options",
        )
    if ns.nproc != 1 or ns.nnodes != "1":
        raise ConfigError(
            "--nproc" if ns.nproc != 1 else "--nnodes",
            "tuning a command runs it as one process (put torchrun in CMD for gptop run, untuned)",
        )
    if ns.tune_space:
        from tuner.space import SearchSpace
        from trainer.contract.config import Toggles

        check_spec(ns.tune_space)
        # grammar, names and values; which micro-batches divide the script's batch is known at its hello
        SearchSpace.check_spec(ns.tune_space, Toggles(micro_batch=1), global_batch=MAX_GRAMMAR_BATCH)
    run_dir = getattr(ns, "run.run_dir", None)
    log_every = getattr(ns, "log.log_every", None)
    cfg = TrainConfig.from_dict({"log": {"log_every": log_every}} if log_every is not None else {}, text=True)
    return (
        inputs.check_run_dir(run_dir) if run_dir is not None else None,
        cfg.log.log_every if log_every is not None else None,
    )


# ------------------------------------------------------------------------------------------ the run directory


@contextlib.contextmanager
def claim_run_dir(request: LockRequest) -> Iterator[RunLock]:
    """Hold the run directory's lock for the block: one writer per run directory, held until gptop exits (and
    by the trainer it starts); a second gptop or trainer on it is refused (RunDirBusy, exit 2) before anything
    starts. A run refused inside the block (a ConfigError: W&B's login, a check only the trainer can make)
    leaves nothing behind: the directories taking the lock made are removed (one node of a multi-node run
    shares the directory and removes nothing)."""
    created = [] if request.node is not None else protect.dirs_to_create(request.run_dir)
    lock = RunLock.acquire(
        request.run_dir, command=request.command, node=request.node, new_run=request.new_run, option=request.option
    )
    try:
        yield lock
    except ConfigError:
        lock.release()
        protect.remove_created(created)
        raise
    finally:
        lock.release()
