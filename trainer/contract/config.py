"""The one configuration object of a training run.

Every option lives here once, in a section per concern (torchtitan style). The
command lines of `python -m trainer`, `gptop train` and `gptop tune` are all
generated from these dataclasses, TOML files (`--config`, `best.toml`) use the
section names as tables, and the tuner reads and writes `Toggles` only.

A field's metadata carries its flag, help text and what values it accepts, so
there is one spelling per idea and one check per option: `choices` for
enumerated options, a `Range` for every number (declaring a numeric option
without one is an error at import), `words` for the few spelled-out values a
number may also take (`micro_batch = "auto"`), `check` for a format, and
`path` naming the input check of `trainer.contract.inputs` a path option gets.
Values are converted and checked where they enter (a flag, a TOML file), with
an error naming the flag or the file and key; `TrainConfig.validate` checks
every field again from the same metadata.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Literal, NoReturn, Union

from .common import MAX_STEP, ConfigError, flag_of, show
from .rundir import CONFIG as RUN_CONFIG
from .rundir import run_dir_of

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8-tensorwise", "fp8-rowwise")
# What `--precision` accepts: a precision, or auto (trainer.contract.capabilities.auto_precision decides on the
# device; the run records the resolved value, so resume and trials never see "auto").
PRECISION_CHOICES = ("auto",) + PRECISIONS
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
ATTENTIONS = ("sdpa", "eager")
ALLOCATORS = ("default", "expandable_segments")
SIZES = ("tiny", "small", "medium", "large", "auto")
NAN_POLICIES = ("rollback", "stop")
PARALLEL = ("ddp", "fsdp")
OPTIMIZERS = ("adamw", "adamw-8bit", "adamw-4bit", "adafactor")
QUANTIZE_BASE = ("none", "nf4", "int8")
# Module names that get LoRA adapters with `--lora-targets auto`, where the architecture has them (trainer.lora
# applies the rule to the built model, trainer.contract.estimate to the family's shapes).
LORA_ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj",               # llama, mistral, qwen, ...
                          "kv_a_proj_with_mqa", "kv_b_proj", "q_a_proj", "q_b_proj",   # deepseek MLA
                          "qkv_proj", "c_attn", "query_key_value", "Wqkv", "out_proj")
LORA_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj",       # SwiGLU
                    "c_fc", "fc1", "fc2", "w1", "w2", "w3", "dense_h_to_4h", "dense_4h_to_h")
LORA_DEFAULT_TARGETS = LORA_ATTENTION_TARGETS + LORA_MLP_TARGETS
MAX_LORA_RANK = 4096

AUTO = "auto"
MicroBatch = Union[int, Literal["auto"]]   # sequences per forward/backward, or "auto": the largest that fits

# Upper limits of what the code handles (or what could mean anything): steps must fit the 8-digit checkpoint
# names, a seed 63 bits (torch and numpy take it as a 64-bit integer), batches and sequences must fit memory.
MAX_SEED = 2 ** 63 - 1
MAX_SEQ_LEN = 1 << 20
MAX_BATCH = 1 << 20
MAX_THREADS = 256


@dataclass(frozen=True)
class Range:
    """The accepted values of a numeric option: finite, from `low` to `high` (inclusive unless open)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def problem(self, value: float) -> str | None:
        """Why `value` is refused, or None."""
        if isinstance(value, float) and not math.isfinite(value):
            return f"{value} is not a finite number; accepted: {self}"
        if isinstance(value, int) and value.bit_length() > 200:
            return f"{show(value)} is out of range; accepted: {self}"
        low, high = self.low, self.high
        if (low is not None and (value < low or (self.low_open and value == low))) or \
                (high is not None and (value > high or (self.high_open and value == high))):
            return f"{value} is out of range; accepted: {self}"
        return None

    def __str__(self) -> str:
        text = "x"
        if self.low is not None:
            text = f"{_num(self.low)} {'<' if self.low_open else '<='} {text}"
        if self.high is not None:
            text = f"{text} {'<' if self.high_open else '<='} {_num(self.high)}"
        return text


def _num(v: float) -> str:
    return str(v) if isinstance(v, int) or not float(v).is_integer() or abs(v) < 1e6 else f"{v:g}"


def opt(default: Any, help: str, *, flag: str | None = None, choices: tuple | None = None,
        metavar: str | None = None, kind: type | None = None, low: float | None = None, high: float | None = None,
        low_open: bool = False, high_open: bool = False, words: tuple[str, ...] = (),
        check: Callable[[Any], str | None] | None = None, path: str | None = None, hidden: bool = False) -> Any:
    """A config field with its command-line flag, help and accepted values in one place.

    A number needs a range (`low`/`high`, inclusive unless `*_open`): a new numeric option cannot be
    declared without saying which values make sense. `kind` is the value type where the annotation
    is a union (`micro_batch`: int, or one of `words`); `check(value)` returns why a value is refused;
    `path` names the check of `trainer.contract.inputs` for a path option; `hidden` leaves it out of --help."""
    kind = kind or (type(default) if isinstance(default, (bool, int, float)) else None)
    rng = None
    if kind in (int, float):
        if low is None and high is None:
            raise TypeError(f"numeric option (default {default!r}) declared without a range: give low=/high=")
        rng = Range(low, high, low_open, high_open)
    meta = {"help": help, "flag": flag, "choices": choices, "metavar": metavar, "kind": kind, "range": rng,
            "words": tuple(words), "check": check, "path": path, "hidden": hidden}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def device_format(value: str) -> str | None:
    """Why `value` is not a device name (auto, cpu, cuda, cuda:N), or None."""
    if re.fullmatch(r"auto|cpu|cuda(:\d{1,4})?", value):
        return None
    return f"{value!r} is not auto, cpu, cuda or cuda:N"


def _step_range_format(value: str) -> str | None:
    try:
        parse_step_range(value)
    except ConfigError as e:
        return e.message
    return None


@dataclass
class ModelConfig:
    model: str = opt("llama", "model family (llama, deepseek, llada) or a local Hugging Face model directory to fine-tune",
                     metavar="FAMILY|PATH", path="model")
    size: str = opt("auto", "model size; auto picks the largest that fits this device", choices=SIZES)


@dataclass
class DataConfig:
    data: str = opt("builtin", "training text: builtin (offline corpus), or a .txt/.jsonl/.parquet file or folder",
                    metavar="builtin|PATH", path="data")
    tokenizer: str | None = opt(None, "local Hugging Face tokenizer directory (default: the builtin BPE, vocab 8192)",
                                metavar="DIR", path="tokenizer")
    seq_len: int = opt(256, "tokens per sequence", low=8, high=MAX_SEQ_LEN)
    val_fraction: float = opt(0.01, "share of the tokens held out for validation", low=0, high=0.5, high_open=True)


@dataclass
class OptimConfig:
    global_batch: int = opt(16, "sequences per optimizer step (fixed; micro-batch changes adjust accumulation)",
                            low=1, high=MAX_BATCH)
    max_steps: int = opt(1000, "optimizer steps to train", low=1, high=MAX_STEP)
    lr: float = opt(1e-3, "peak learning rate (linear warm-up, cosine decay)", low=0, low_open=True, high=1e6)
    warmup_steps: int = opt(50, "learning-rate warm-up steps", low=0, high=MAX_STEP)
    min_lr_ratio: float = opt(0.1, "final learning rate as a share of the peak", low=0, high=1)
    weight_decay: float = opt(0.1, "AdamW weight decay", low=0, high=10)
    grad_clip: float = opt(1.0, "gradient-norm clipping threshold (0 disables)", low=0, high=1e6)
    seed: int = opt(1234, "seed for initialization, data order and masking", low=0, high=MAX_SEED)


@dataclass
class Toggles:
    """The optimization toggles: what the tuner may change on a live run (after a checkpoint), and the one
    place the trainer reads them from.

    Most change speed, not what is learned; `precision` (away from the start), a low-bit `optimizer` and a
    quantized base (`quantize_base`) change the numbers computed, so the tuner checks the loss of a trial that
    changes them (tuner.space.NUMERICS_CHANGING). `optimizer` and `quantize_base` were options of the `optim`
    and `finetune` sections before the tuner could trade memory for them; their flags are unchanged and a TOML
    file (or a run's stored config) that has them in their old tables still reads (`MOVED`).
    """

    precision: str = opt(AUTO, "numeric precision (auto: bf16 autocast where the device runs bf16 natively, "
                         "else fp32)", choices=PRECISION_CHOICES)
    compile: str = opt("off", "torch.compile mode", choices=COMPILE_MODES)
    micro_batch: MicroBatch = opt(AUTO, "sequences per forward/backward (auto: largest that fits; accumulation is "
                                  "derived)", metavar="N|auto", kind=int, words=(AUTO,), low=1, high=MAX_BATCH)
    prefetch: int = opt(2, "batches prepared ahead of the step (0 disables)", low=0, high=MAX_THREADS)
    workers: int = opt(0, "loader worker threads (0: the prefetch thread builds batches)", low=0, high=MAX_THREADS)
    fused_adamw: bool = opt(True, "use the fused AdamW kernel (one vectorized pass; --no-fused-adamw for the foreach loop)")
    activation_checkpointing: bool = opt(False, "recompute activations in backward to save memory")
    attention: str = opt("sdpa", "attention implementation", choices=ATTENTIONS)
    cuda_allocator: str = opt("default", "CUDA caching allocator mode", choices=ALLOCATORS)
    optimizer: str = opt("adamw", "optimizer: adamw (fp32 moments), adamw-8bit / adamw-4bit (torchao's quantized "
                         "moments, 4x / 8x smaller), adafactor (factored second moment, torch.optim.Adafactor)",
                         choices=OPTIMIZERS)
    quantize_base: str = opt("none", "QLoRA: hold the frozen base quantized with bitsandbytes (nf4: 4-bit "
                             "NormalFloat with double quantization; int8); needs --lora and CUDA",
                             choices=QUANTIZE_BASE)

    def micro_batch_int(self) -> int | None:
        """The fixed micro-batch, or None for auto."""
        return self.micro_batch if isinstance(self.micro_batch, int) else None


def _lora_targets_format(value: str) -> str | None:
    if value == AUTO or re.fullmatch(r"[A-Za-z_][\w.]*(,[A-Za-z_][\w.]*)*", value):
        return None
    return f"{value!r} is not auto or a comma-separated list of module names (e.g. q_proj,v_proj)"


@dataclass
class FinetuneConfig:
    """Parameter-efficient fine-tuning: LoRA adapters (peft) on a frozen base, optionally quantized (QLoRA:
    `Toggles.quantize_base`, a toggle since the tuner may trade it for memory)."""

    lora: int = opt(0, "LoRA rank R: train rank-R adapters on a frozen base instead of every weight (0: full "
                    "fine-tuning)", metavar="R", low=0, high=MAX_LORA_RANK)
    lora_alpha: float = opt(16.0, "LoRA scaling alpha (the adapter's update is scaled by alpha / R)",
                            low=0, low_open=True, high=1e6)
    lora_dropout: float = opt(0.0, "dropout on the LoRA adapters' input", low=0, high=1, high_open=True)
    lora_targets: str = opt(AUTO, "modules that get adapters: auto (the attention and MLP projections of the "
                            "architecture) or names, e.g. q_proj,v_proj", metavar="auto|NAMES",
                            check=_lora_targets_format)

    @property
    def enabled(self) -> bool:
        """LoRA is on: only the adapters train."""
        return self.lora > 0


@dataclass
class CheckpointConfig:
    checkpoint_every: int = opt(200, "optimizer steps between checkpoints (0: only at the end)", low=0, high=MAX_STEP)
    keep_checkpoints: int = opt(3, "checkpoints to keep (older ones are deleted)", low=1, high=MAX_STEP)
    resume: str | None = opt(None, "resume from a checkpoint file or a run directory (its newest valid checkpoint)",
                             metavar="PATH", path="resume")


@dataclass
class LogConfig:
    log_every: int = opt(10, "optimizer steps between step events (loss is read back only then)", low=1, high=MAX_STEP)
    eval_every: int = opt(100, "optimizer steps between validation losses (0 disables)", low=0, high=MAX_STEP)
    eval_batches: int = opt(4, "micro-batches per validation (held in memory)", low=1, high=10_000)
    timing: bool = opt(True, "time the step phases (--no-timing to measure its overhead)")
    profile_steps: str | None = opt(None, "write a torch.profiler trace of steps A-B (numbered from 1, as on the "
                                    "dashboard) into the run directory",
                                    metavar="A-B", check=_step_range_format)


@dataclass
class RunConfig:
    run_dir: str | None = opt(None, "run directory (default: runs/<time>-<model>-<size>)", metavar="DIR",
                              path="run_dir")
    device: str = opt("auto", "torch device: auto, cpu, cuda, cuda:N", check=device_format)
    nan_policy: str = opt("rollback", "on a non-finite step (loss, gradient norm or weights): roll back to the "
                          "newest checkpoint that verifies, or stop", choices=NAN_POLICIES)
    nan_retries: int = opt(3, "rollbacks allowed before stopping with an error", low=0, high=1000)
    nan_lr_factor: float = opt(0.5, "learning-rate multiplier applied at each NaN rollback", low=0, low_open=True,
                               high=1)
    parallel: str = opt("ddp", "how several ranks (torchrun, gptop --nproc) share the model: ddp replicates it, "
                        "fsdp shards it (FSDP2); ignored with one process", choices=PARALLEL)
    channel: str | None = opt(None, "event/command channel given by the launcher (unix:PATH)", metavar="URI",
                              hidden=True)
    fault: str | None = opt(None, "test-only fault injection (trainer/faults.py), e.g. nan@12 or oom@5; kill@5:1 "
                            "only on rank 1", metavar="KIND@STEP[:RANK]", hidden=True)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "toggles": Toggles,
    "finetune": FinetuneConfig,
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
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    run: RunConfig = field(default_factory=RunConfig)

    # --- conversions -------------------------------------------------------
    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @classmethod
    def from_dict(cls, d: dict[str, Any], base: "TrainConfig | None" = None, *, text: bool = False) -> "TrainConfig":
        """Overlay a nested dict (TOML tables) on `base`; unknown keys and bad values are errors naming the key.

        `text`: the values are command-line text (`"0.1"`), converted here; otherwise they must already
        have their type (TOML, JSON), except a number written as a string in a field that also takes
        words (`micro_batch = "8"`, what config.toml files held before micro_batch was a number)."""
        cfg = dataclasses.replace(base) if base else cls()
        cfg = cls(**{name: dataclasses.replace(getattr(cfg, name)) for name in SECTIONS})
        if not isinstance(d, dict):
            raise ConfigError("(top level)", f"expected tables of options, got {type(d).__name__}")
        old_places = {(home, key): sec for (sec, key), home in MOVED.items()
                      if isinstance(d.get(sec), dict) and key in d[sec]}
        d = current_layout(d)
        for section, values in d.items():
            if section not in SECTIONS:
                home = [s for s, c in SECTIONS.items() if section in {f.name for f in fields(c)}]
                hint = f"; options belong in tables: [{home[0]}] {section} = ..." if home else ""
                raise ConfigError(f"[{section}]", f"unknown section; expected one of {', '.join(SECTIONS)}{hint}")
            if not isinstance(values, dict):
                raise ConfigError(f"[{section}]", f"must be a table of options, got {type(values).__name__} "
                                                  f"{show(values)}")
            obj = getattr(cfg, section)
            known = {f.name: f for f in fields(obj)}
            for key, value in values.items():
                if key not in known:
                    raise ConfigError(f"{section}.{key}", f"unknown option; known: {', '.join(known)}")
                old = old_places.get((section, key))
                try:
                    setattr(obj, key, _coerce(known[key], value, f"{section}.{key}", text=text))
                except ConfigError as e:
                    if old is None:
                        raise
                    # named as the file has it: the user wrote [optim] optimizer, not toggles.optimizer
                    raise ConfigError(f"[{old}] {key}", f"{e.message} ({key} lives in [{section}] now; it is "
                                                        f"still read from [{old}])") from None
        return cfg

    @classmethod
    def from_toml(cls, path: str | Path, base: "TrainConfig | None" = None, *,
                  option: str = "--config") -> "TrainConfig":
        """Load a TOML file (`--config`, best.toml, a run's config.toml); errors name `option`, the file and key."""
        from .inputs import read_toml

        data = read_toml(path, option)
        try:
            return cls.from_dict(data, base)
        except ConfigError as e:
            raise ConfigError(f"{option} {path}", f"{e.option}: {e.message}") from None

    def to_toml(self) -> str:
        import tomli_w

        return tomli_w.dumps(_drop_none(self.to_dict()))

    def items(self) -> list[tuple[str, dataclasses.Field, Any]]:
        """(section, field, value) of every option."""
        return [(s, f, getattr(getattr(self, s), f.name)) for s in SECTIONS for f in fields(SECTIONS[s])]

    def validate(self, world_size: int = 1) -> None:
        """Checks that need no device, every field from its metadata (type, choices, range, format), then the
        relations between fields. Device support is checked by trainer.contract.capabilities, paths by
        trainer.contract.inputs."""
        for _, f, value in self.items():
            problem = _type_problem(f, value) or _value_problem(f, value)
            if problem:
                raise ConfigError(flag_of(f), problem)
        o, mb = self.optim, self.toggles.micro_batch
        if world_size < 1:
            raise ConfigError("--nproc", f"must be at least 1, got {world_size}")
        if o.global_batch % world_size:
            raise ConfigError("--global-batch", f"{o.global_batch} sequences cannot be split evenly over "
                                                f"{world_size} ranks; use a multiple of {world_size}")
        if self.log.profile_steps is not None and parse_step_range(self.log.profile_steps)[0] > o.max_steps:
            raise ConfigError("--profile-steps", f"{self.log.profile_steps} starts after the last step "
                                                 f"(--max-steps {o.max_steps}): no trace would be written")
        ft, qb = self.finetune, self.toggles.quantize_base
        if qb != "none" and not ft.enabled:
            raise ConfigError("--quantize-base", f"{qb} quantizes the frozen base of a LoRA run; "
                                                 f"add --lora R (e.g. --lora 8), or drop --quantize-base")
        if not ft.enabled:                # LoRA's own options mean nothing without it: never silently ignored
            for f in fields(ft):
                value = getattr(ft, f.name)
                if f.name != "lora" and value != f.default:
                    raise ConfigError(flag_of(f), f"{show(value)} sets up LoRA adapters, but this run trains every "
                                                  "weight (no --lora); add --lora R (e.g. --lora 8), or drop "
                                                  f"{flag_of(f)}")
        if ft.enabled and world_size > 1 and self.run.parallel == "fsdp":
            raise ConfigError("--parallel", "fsdp with --lora is not supported (FSDP2 would shard the frozen base "
                                            "and the adapters together); use --parallel ddp, which replicates the "
                                            "base and all-reduces only the adapters' gradients")
        if qb != "none" and world_size > 1:
            raise ConfigError("--quantize-base", f"{qb} runs on one process; drop --nproc or --quantize-base")
        per_rank = o.global_batch // world_size
        if isinstance(mb, int) and per_rank % mb:
            over = f" ({o.global_batch} over {world_size} ranks)" if world_size > 1 else ""
            raise ConfigError("--micro-batch", f"{mb} does not divide the per-rank batch {per_rank}{over}; "
                                               f"pick a divisor of {per_rank} or auto")


# What a resumed run must keep of the run it continues (what is learned); toggles may change (the optimizer's
# state is converted, a quantized base rebuilt).
RESUME_MUST_MATCH = (("model", "model", "--model"), ("model", "size", "--size"), ("data", "seq_len", "--seq-len"),
                     ("optim", "global_batch", "--global-batch"), ("optim", "seed", "--seed"), ("data", "data", "--data"),
                     ("finetune", "lora", "--lora"), ("finetune", "lora_targets", "--lora-targets"))


def check_resumable(saved: dict[str, Any], now: "TrainConfig", what: str = "the checkpoint") -> None:
    """ConfigError naming the flag when `now` changes what the saved run (a checkpoint's config, or a run
    directory's config.toml) learns. A key an older config lacks has its default; one stored in its old
    section (MOVED) is read there; `--size auto` is the trainer's to resolve."""
    current, defaults = now.to_dict(), TrainConfig().to_dict()
    saved = current_layout(saved)
    for section, key, flag in RESUME_MUST_MATCH:
        was = (saved.get(section) or {}).get(key, defaults[section][key])
        want = current[section][key]
        if was == want or (key == "size" and AUTO in (was, want)):
            continue
        hint = ""
        if section == "finetune":
            hint = ("; to fine-tune its model with other LoRA options, export it (gptop export RUN_DIR OUT_DIR) and "
                    "train --model OUT_DIR with them")
        raise ConfigError(flag, f"{what} was trained with {was!r}, this run asks for {want!r}; resume needs the "
                                f"same value{hint}")


# Options that moved to another section: (old section, key) -> the section that holds them now. A TOML file,
# a run's config.toml or a checkpoint's stored config that has them at the old place still reads.
MOVED: dict[tuple[str, str], str] = {("optim", "optimizer"): "toggles", ("finetune", "quantize_base"): "toggles"}


def current_layout(d: dict[str, Any]) -> dict[str, Any]:
    """`d` (tables of options) with every moved option (`MOVED`) in its current section; ConfigError naming both
    places when a file gives one option twice with different values."""
    if not any(isinstance(d.get(sec), dict) and key in d[sec] for sec, key in MOVED):
        return d
    out = {sec: (dict(v) if isinstance(v, dict) else v) for sec, v in d.items()}
    for (sec, key), home in MOVED.items():
        table = out.get(sec)
        if not isinstance(table, dict) or key not in table:
            continue
        value = table.pop(key)
        target = out.setdefault(home, {})
        if not isinstance(target, dict):
            continue                      # from_dict names the bad table
        if key in target and target[key] != value:
            raise ConfigError(f"{sec}.{key}", f"{show(value)} conflicts with {home}.{key} = {show(target[key])}; "
                                              f"{key} belongs in [{home}] now: keep that one")
        target.setdefault(key, value)
    return out


def section_from_dict(cls: type, values: dict[str, Any]) -> Any:
    """One section (e.g. `Toggles`) from stored values (a study's record, a report's JSON), each converted and
    checked as in a TOML file, so a value stored by an older version (`micro_batch: "8"`) reads as today's."""
    name = next(n for n, c in SECTIONS.items() if c is cls)
    return getattr(TrainConfig.from_dict({name: values}), name)


def parse_step_range(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split("-"))
    except ValueError:
        raise ConfigError("--profile-steps", f"{text!r} is not A-B, e.g. 10-12") from None
    if not 1 <= a <= b <= MAX_STEP:
        raise ConfigError("--profile-steps", f"{text!r}: steps are numbered from 1 (the first step is 1, as on the "
                                             f"dashboard); need 1 <= A <= B <= {MAX_STEP}, e.g. 10-12")
    return a, b


def range_of(f: dataclasses.Field) -> Range | None:
    """The accepted range of a numeric field (None for the others)."""
    return f.metadata.get("range")


def _drop_none(d: dict) -> dict:
    return {k: (_drop_none(v) if isinstance(v, dict) else v) for k, v in d.items() if v is not None}


_TYPE_NAMES = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}


def kind_of(f: dataclasses.Field) -> type:
    """The value type of a field: bool, int, float or str."""
    if f.metadata.get("kind"):
        return f.metadata["kind"]
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if t.startswith(name):
            return kind
    return str


def optional(f: dataclasses.Field) -> bool:
    return "None" in (f.type if isinstance(f.type, str) else str(f.type))


def _expected(f: dataclasses.Field) -> str:
    words = " or ".join(repr(w) for w in f.metadata.get("words", ()))
    return f"{_TYPE_NAMES[kind_of(f)]}" + (f" or {words}" if words else "")


def _type_problem(f: dataclasses.Field, value: Any) -> str | None:
    """Why `value` does not have the field's type (for configs built in code), or None."""
    kind = kind_of(f)
    if value is None:
        return None if optional(f) else f"must be given ({_expected(f)})"
    if isinstance(value, str) and value in f.metadata.get("words", ()):
        return None
    ok = isinstance(value, bool) if kind is bool else (
        isinstance(value, kind) and not isinstance(value, bool) if kind is not float else
        isinstance(value, (int, float)) and not isinstance(value, bool))
    return None if ok else f"{show(value)} is not {_expected(f)}"


def _value_problem(f: dataclasses.Field, value: Any) -> str | None:
    """Why a value of the right type is refused (choices, range, format), or None."""
    if value is None or (isinstance(value, str) and value in f.metadata.get("words", ())):
        return None
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        return f"{show(value)} is not one of {', '.join(choices)}"
    rng = range_of(f)
    if rng is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        problem = rng.problem(value)
        if problem:
            return problem
    if f.metadata.get("path") and isinstance(value, str) and not value.strip():
        return "is empty; give a path"
    check = f.metadata.get("check")
    if check is not None and isinstance(value, str):
        return check(value)
    return None


def parse_number(kind: type, value: Any, *, text: bool = True) -> int | float:
    """`value` as an int or float; ValueError if it is not one. Integral floats are whole numbers (`1e3`).

    `text`: `value` may be command-line text; otherwise it must already be a number (TOML, JSON)."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, str) and text:
        s = value.strip()
        try:
            return int(s) if kind is int else float(s)
        except ValueError:
            value = float(s)          # `1e3` for a whole number; raises ValueError for words
    if not isinstance(value, (int, float)):
        raise ValueError(value)
    if kind is float:
        return float(value)
    if isinstance(value, float):
        if not value.is_integer():   # nan and inf are not integers either
            raise ValueError(value)
        return int(value)
    return value


def _coerce(f: dataclasses.Field, value: Any, where: str, *, text: bool = False) -> Any:
    """Convert and check one value where it enters; ConfigError naming `where` (a flag or `section.key`)."""
    kind = kind_of(f)
    words = f.metadata.get("words", ())
    if value is None:
        if optional(f):
            return None
        raise ConfigError(where, f"must be given ({_expected(f)})")
    if isinstance(value, str) and value.strip() in words:
        return value.strip()
    try:
        if kind is bool:
            if isinstance(value, bool):
                converted: Any = value
            elif text and str(value).lower() in ("1", "true", "yes", "on"):
                converted = True
            elif text and str(value).lower() in ("0", "false", "no", "off"):
                converted = False
            else:
                raise ValueError
        elif kind in (int, float):
            converted = parse_number(kind, value, text=text or bool(words))
        elif isinstance(value, str):
            # a path is read once here: `~` expanded (a TOML file has no shell to do it), so what the input
            # checks look at is what the run uses
            converted = os.path.expanduser(value) if f.metadata.get("path") else value
        else:
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        if kind is int and isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
            raise ConfigError(where, f"{show(value)} has too many digits; accepted: {range_of(f)}") from None
        accepted = f"; accepted: {range_of(f)}" if range_of(f) else ""
        raise ConfigError(where, f"{show(value)} is not {_expected(f)}{accepted}") from None
    problem = _value_problem(f, converted)
    if problem:
        raise ConfigError(where, problem)
    return converted


def number_arg(kind: type, low: float | None = None, high: float | None = None, *, low_open: bool = False,
               high_open: bool = False) -> Callable[[str], int | float]:
    """An argparse `type=` for a numeric flag that is not a config option (gptop's own: --interval, --nproc),
    converted and range-checked like the config's numbers; a refusal names the value and the range."""
    rng = Range(low, high, low_open, high_open)

    def convert(text: str) -> int | float:
        try:
            value = parse_number(kind, text)
        except (TypeError, ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{show(text)} is not {_TYPE_NAMES[kind]}; accepted: {rng}") from None
        problem = rng.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    convert.__name__ = kind.__name__
    convert.range = rng              # type: ignore[attr-defined]  # what --help and the tests read
    return convert


# --- command line ----------------------------------------------------------------

EXIT_USAGE = 2          # a bad command line: the exit status of every refusal of an input


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors in one line, as every other refusal: the option, the value and what is
    accepted (argparse's own messages say all three), then where to read more; exit 2. argparse prints the
    whole usage first. `gptop` and `python -m trainer` both parse with it."""

    def error(self, message: str) -> "NoReturn":
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_arguments(parser: argparse.ArgumentParser, sections: tuple[str, ...] = tuple(SECTIONS)) -> None:
    """Add every option of the given sections to `parser`, with its default and range shown in --help.

    Defaults on the parser are SUPPRESS so that `config_from_args` can tell which
    options the user typed (those override `--config`); values are converted and
    checked there, so a flag and the same key in a TOML file get the same checks.
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
            kind = kind_of(f)
            help_text = f.metadata["help"]
            if "default" not in help_text:
                help_text += f" (default: {shown_default(default)}" + (f"; {range_of(f)}" if range_of(f) else "") + ")"
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
                                   help=help_text.replace("%", "%%"))


_METAVARS = {int: "N", float: "X", str: "VALUE"}


def shown_default(value: Any) -> str:
    """A default as every --help writes it: on/off for a switch, none for nothing set."""
    if value is True:
        return "on"
    if value is False:
        return "off"
    return "none" if value is None else str(value)


def config_from_args(ns: argparse.Namespace, base: TrainConfig | None = None, *, world_size: int = 1,
                     check_paths: bool = True) -> TrainConfig:
    """Build a TrainConfig: `base` (defaults, or a resumed run's config), then `--config` TOML, then typed flags.

    Every value is checked where it enters, the whole config by `validate`, and every path option by
    `trainer.contract.inputs` (`check_paths`) before anything is started or created.
    Raises ConfigError naming the flag, or the file and key."""
    cfg = base or TrainConfig()
    path = getattr(ns, "config", None)
    if path is not None:
        cfg = TrainConfig.from_toml(path, cfg)
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in vars(ns).items():
        if "." in key:
            section, name = key.split(".", 1)
            overrides.setdefault(section, {})[name] = value
    flags = {f"{s}.{f.name}": flag_of(f) for s in SECTIONS for f in fields(SECTIONS[s])}
    try:
        cfg = TrainConfig.from_dict(overrides, cfg, text=True)
    except ConfigError as e:
        raise ConfigError(flags.get(e.option, e.option), e.message) from None
    cfg.validate(world_size)
    if check_paths:
        from .inputs import check_config_paths

        check_config_paths(cfg)
    return cfg


def resume_config(target: str | None) -> TrainConfig | None:
    """The configuration a resumed run starts from: its run directory's config.toml (flags override it).

    `target` is a run directory or a checkpoint in one (checked by trainer.contract.inputs: a ConfigError
    if there is nothing to resume); None when its run directory has no config.toml."""
    from .inputs import check_resume

    if not target:
        return None
    run_dir = run_dir_of(check_resume(target))
    toml = run_dir / RUN_CONFIG
    if not toml.exists():
        return None
    cfg = TrainConfig.from_toml(toml, option="--resume")
    cfg.run.run_dir = str(run_dir)
    cfg.checkpoint.resume = None
    cfg.run.channel = None
    cfg.run.fault = None
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
            if kind_of(f) is bool:
                args.append(flag if va else "--no-" + flag[2:])
            else:
                args += [flag, str(va)]
    return args
