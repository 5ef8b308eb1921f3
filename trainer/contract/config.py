"""The one configuration object of a training run.

Every option lives here once, in a section per concern (torchtitan style). The
command lines of `python -m trainer`, `gptop train` and `gptop tune` are all
generated from these dataclasses, TOML files (`--config`, `best.toml`) use the
section names as tables, and the tuner reads and writes `Toggles` only.

A field's metadata carries its flag and help text so there is one spelling per
idea. `choices` lists the allowed values of enumerated options.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8-tensorwise", "fp8-rowwise")
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
ATTENTIONS = ("sdpa", "eager")
ALLOCATORS = ("default", "expandable_segments")
FAMILIES = ("llama", "deepseek", "llada")
SIZES = ("tiny", "small", "medium", "large", "auto")
NAN_POLICIES = ("rollback", "stop")
PARALLEL = ("ddp", "fsdp")


class ConfigError(ValueError):
    """A bad option value. `option` names the flag so the user knows what to fix."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option = option
        self.message = message


def opt(default: Any, help: str, *, flag: str | None = None, choices: tuple | None = None,
        metavar: str | None = None, hidden: bool = False) -> Any:
    """A config field with its command-line flag and help in one place (`hidden`: left out of --help)."""
    meta = {"help": help, "flag": flag, "choices": choices, "metavar": metavar, "hidden": hidden}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    model: str = opt("llama", "model family (llama, deepseek, llada) or a local Hugging Face model directory to fine-tune",
                     metavar="FAMILY|PATH")
    size: str = opt("auto", "model size; auto picks the largest that fits this device", choices=SIZES)


@dataclass
class DataConfig:
    data: str = opt("builtin", "training text: builtin (offline corpus), or a .txt/.jsonl/.parquet file or folder",
                    metavar="builtin|PATH")
    tokenizer: str | None = opt(None, "local Hugging Face tokenizer directory (default: the builtin BPE, vocab 8192)",
                                metavar="DIR")
    seq_len: int = opt(256, "tokens per sequence")
    val_fraction: float = opt(0.01, "share of the tokens held out for validation")


@dataclass
class OptimConfig:
    global_batch: int = opt(16, "sequences per optimizer step (fixed; micro-batch changes adjust accumulation)")
    max_steps: int = opt(1000, "optimizer steps to train")
    lr: float = opt(1e-3, "peak learning rate (linear warm-up, cosine decay)")
    warmup_steps: int = opt(50, "learning-rate warm-up steps")
    min_lr_ratio: float = opt(0.1, "final learning rate as a share of the peak")
    weight_decay: float = opt(0.1, "AdamW weight decay")
    grad_clip: float = opt(1.0, "gradient-norm clipping threshold (0 disables)")
    seed: int = opt(1234, "seed for initialization, data order and masking")


@dataclass
class Toggles:
    """The optimization toggles: they change speed, not what is learned (fp16/fp8 change numerics)."""

    precision: str = opt("fp32", "numeric precision", choices=PRECISIONS)
    compile: str = opt("off", "torch.compile mode", choices=COMPILE_MODES)
    micro_batch: str = opt("auto", "sequences per forward/backward (auto: largest that fits; accumulation is derived)",
                           metavar="N|auto")
    prefetch: int = opt(2, "batches prepared ahead of the step (0 disables)")
    workers: int = opt(0, "loader worker threads (0: the prefetch thread builds batches)")
    fused_adamw: bool = opt(True, "use the fused AdamW kernel (one vectorized pass; --no-fused-adamw for the foreach loop)")
    activation_checkpointing: bool = opt(False, "recompute activations in backward to save memory")
    attention: str = opt("sdpa", "attention implementation", choices=ATTENTIONS)
    cuda_allocator: str = opt("default", "CUDA caching allocator mode", choices=ALLOCATORS)

    def micro_batch_int(self) -> int | None:
        return None if self.micro_batch == "auto" else int(self.micro_batch)


@dataclass
class CheckpointConfig:
    checkpoint_every: int = opt(200, "optimizer steps between checkpoints (0: only at the end)")
    keep_checkpoints: int = opt(3, "checkpoints to keep (older ones are deleted)")
    resume: str | None = opt(None, "resume from a checkpoint file or a run directory (its newest valid checkpoint)",
                             metavar="PATH")


@dataclass
class LogConfig:
    log_every: int = opt(10, "optimizer steps between step events (loss is read back only then)")
    eval_every: int = opt(100, "optimizer steps between validation losses (0 disables)")
    eval_batches: int = opt(4, "micro-batches per validation")
    timing: bool = opt(True, "time the step phases (--no-timing to measure its overhead)")
    profile_steps: str | None = opt(None, "write a torch.profiler trace of steps A-B into the run directory",
                                    metavar="A-B")


@dataclass
class RunConfig:
    run_dir: str | None = opt(None, "run directory (default: runs/<time>-<model>-<size>)", metavar="DIR")
    device: str = opt("auto", "torch device: auto, cpu, cuda, cuda:N")
    nan_policy: str = opt("rollback", "on a non-finite step (loss, gradient norm or weights): roll back to the "
                          "newest checkpoint that verifies, or stop", choices=NAN_POLICIES)
    nan_retries: int = opt(3, "rollbacks allowed before stopping with an error")
    nan_lr_factor: float = opt(0.5, "learning-rate multiplier applied at each NaN rollback")
    parallel: str = opt("ddp", "how several ranks (torchrun, gptop --nproc) share the model: ddp replicates it, "
                        "fsdp shards it (FSDP2); ignored with one process", choices=PARALLEL)
    channel: str | None = opt(None, "event/command channel given by the launcher (unix:PATH)", metavar="URI")
    fault: str | None = opt(None, "test-only fault injection (trainer/faults.py), e.g. nan@12 or oom@5; kill@5:1 "
                            "only on rank 1", metavar="KIND@STEP[:RANK]", hidden=True)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "toggles": Toggles,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
    "run": RunConfig,
}


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    toggles: Toggles = field(default_factory=Toggles)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    run: RunConfig = field(default_factory=RunConfig)

    # --- conversions -------------------------------------------------------
    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @classmethod
    def from_dict(cls, d: dict[str, Any], base: "TrainConfig | None" = None) -> "TrainConfig":
        """Overlay a nested dict (TOML tables) on `base`; unknown keys are errors naming the key."""
        cfg = dataclasses.replace(base) if base else cls()
        cfg = cls(**{name: dataclasses.replace(getattr(cfg, name)) for name in SECTIONS})
        for section, values in d.items():
            if section not in SECTIONS:
                raise ConfigError(f"[{section}]", f"unknown section; expected one of {', '.join(SECTIONS)}")
            if not isinstance(values, dict):
                raise ConfigError(f"[{section}]", "must be a table")
            obj = getattr(cfg, section)
            known = {f.name: f for f in fields(obj)}
            for key, value in values.items():
                if key not in known:
                    raise ConfigError(f"{section}.{key}", f"unknown option; known: {', '.join(known)}")
                setattr(obj, key, _coerce(known[key], value, f"{section}.{key}"))
        return cfg

    @classmethod
    def from_toml(cls, path: str | Path, base: "TrainConfig | None" = None) -> "TrainConfig":
        p = Path(path)
        try:
            with p.open("rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError("--config", f"{p} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("--config", f"{p} is not valid TOML: {e}") from None
        return cls.from_dict(data, base)

    def to_toml(self) -> str:
        import tomli_w

        return tomli_w.dumps(_drop_none(self.to_dict()))

    def validate(self) -> None:
        """Checks that need no device. Device support is checked by trainer.contract.capabilities."""
        for section in SECTIONS:
            obj = getattr(self, section)
            for f in fields(obj):
                choices = f.metadata.get("choices")
                value = getattr(obj, f.name)
                if choices and value not in choices:
                    raise ConfigError(flag_of(f), f"{value!r} is not one of {', '.join(choices)}")
        t, o, d, c, lg = self.toggles, self.optim, self.data, self.checkpoint, self.log
        if t.micro_batch != "auto":
            try:
                mb = int(t.micro_batch)
            except ValueError:
                raise ConfigError("--micro-batch", f"{t.micro_batch!r} is neither an integer nor 'auto'") from None
            if mb < 1:
                raise ConfigError("--micro-batch", "must be at least 1")
        for flag, value, low in (("--seq-len", d.seq_len, 8), ("--global-batch", o.global_batch, 1),
                                 ("--max-steps", o.max_steps, 1), ("--log-every", lg.log_every, 1),
                                 ("--keep-checkpoints", c.keep_checkpoints, 1), ("--prefetch", t.prefetch, 0),
                                 ("--workers", t.workers, 0), ("--checkpoint-every", c.checkpoint_every, 0),
                                 ("--eval-every", lg.eval_every, 0), ("--warmup-steps", o.warmup_steps, 0),
                                 ("--eval-batches", lg.eval_batches, 1), ("--nan-retries", self.run.nan_retries, 0)):
            if value < low:
                raise ConfigError(flag, f"must be at least {low}, got {value}")
        if not o.lr > 0:
            raise ConfigError("--lr", f"must be positive, got {o.lr}")
        if not 0 <= d.val_fraction < 0.5:
            raise ConfigError("--val-fraction", f"must be in [0, 0.5), got {d.val_fraction}")
        if lg.profile_steps is not None:
            parse_step_range(lg.profile_steps)


def parse_step_range(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split("-"))
    except ValueError:
        raise ConfigError("--profile-steps", f"{text!r} is not A-B, e.g. 10-12") from None
    if not 0 <= a <= b:
        raise ConfigError("--profile-steps", f"{text!r}: need 0 <= A <= B")
    return a, b


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _drop_none(d: dict) -> dict:
    return {k: (_drop_none(v) if isinstance(v, dict) else v) for k, v in d.items() if v is not None}


def _coerce(f: dataclasses.Field, value: Any, where: str) -> Any:
    kind = _kind(f)
    if value is None:
        return None
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(where, f"{value!r} is not a valid {kind.__name__}") from None


def _kind(f: dataclasses.Field) -> type:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if t.startswith(name):
            return kind
    return str


# --- command line ----------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser, sections: tuple[str, ...] = tuple(SECTIONS)) -> None:
    """Add every option of the given sections to `parser`, with its default shown in --help.

    Defaults on the parser are SUPPRESS so that `config_from_args` can tell which
    options the user typed (those override `--config`).
    """
    parser.add_argument("--config", metavar="TOML", default=argparse.SUPPRESS,
                        help="load options from a TOML file (tables per section); flags override it")
    defaults = TrainConfig()
    for section in sections:
        group = parser.add_argument_group(section)
        obj = getattr(defaults, section)
        for f in fields(obj):
            flag = flag_of(f)
            default = getattr(obj, f.name)
            kind = _kind(f)
            help_text = f.metadata["help"]
            if "default" not in help_text:
                help_text += f" (default: {default})"
            if f.metadata.get("hidden"):
                help_text = argparse.SUPPRESS
            if kind is bool:
                group.add_argument(flag, dest=f"{section}.{f.name}", action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=help_text)
            else:
                group.add_argument(flag, dest=f"{section}.{f.name}", default=argparse.SUPPRESS,
                                   type=str, choices=f.metadata.get("choices"),
                                   metavar=f.metadata.get("metavar") or (None if f.metadata.get("choices")
                                                                          else _METAVARS.get(kind)),
                                   help=help_text)


_METAVARS = {int: "N", float: "X", str: "VALUE"}


def config_from_args(ns: argparse.Namespace, base: TrainConfig | None = None) -> TrainConfig:
    """Build a TrainConfig: `base` (defaults, or a resumed run's config), then `--config` TOML, then typed flags.

    Raises ConfigError naming the flag."""
    cfg = base or TrainConfig()
    path = getattr(ns, "config", None)
    if path:
        cfg = TrainConfig.from_toml(path, cfg)
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in vars(ns).items():
        if "." in key:
            section, name = key.split(".", 1)
            overrides.setdefault(section, {})[name] = value
    flags = {f"{s}.{f.name}": flag_of(f) for s in SECTIONS for f in fields(SECTIONS[s])}
    try:
        cfg = TrainConfig.from_dict(overrides, cfg)
    except ConfigError as e:
        raise ConfigError(flags.get(e.option, e.option), e.message) from None
    cfg.validate()
    return cfg


def cli_args(cfg: TrainConfig, base: TrainConfig | None = None, *, full: bool = False) -> list[str]:
    """The flags that turn `base` (defaults) into `cfg`: how gptop passes a config to a trainer process.

    `full` emits every set option, so the result does not depend on what the
    trainer starts from (a resumed run starts from its config.toml)."""
    base = base or TrainConfig()
    args: list[str] = []
    for section in SECTIONS:
        a, b = getattr(cfg, section), getattr(base, section)
        for f in fields(a):
            va, vb = getattr(a, f.name), getattr(b, f.name)
            if va is None or (va == vb and not full):
                continue
            flag = flag_of(f)
            if _kind(f) is bool:
                args.append(flag if va else "--no-" + flag[2:])
            else:
                args += [flag, str(va)]
    return args
