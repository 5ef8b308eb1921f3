"""The one configuration object of a training run: its sections, their options and the checks between them.

Every option lives here once, in a section per concern (torchtitan style). The
command lines of `python -m trainer`, `gptop train` and `gptop tune` are all
generated from these dataclasses (trainer.contract.config_args), TOML files
(`--config`, `best.toml`; trainer.contract.config_files) use the section names as
tables, and the tuner reads and writes `Toggles` only.

Each field is declared with `opt` (trainer.contract.config_options): its flag, help
text and accepted values sit with it, so there is one spelling per idea and one
check per option. `TrainConfig.from_dict` converts and checks values where they
enter; `TrainConfig.validate` checks every field again from the same metadata,
then the relations between fields. This module imports no input check, no run
directory and no event, so the event schema can decode toggles with it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Union

from .common import MAX_STEP, ConfigError, flag_of, show
from .config_layouts import MOVED, current_layout
from .config_options import coerce, opt, type_problem, value_problem

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
LORA_ATTENTION_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",  # llama, mistral, qwen, ...
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "q_a_proj",
    "q_b_proj",  # deepseek MLA
    "qkv_proj",
    "c_attn",
    "query_key_value",
    "Wqkv",
    "out_proj",
)
LORA_MLP_TARGETS = (
    "gate_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj",  # SwiGLU
    "c_fc",
    "fc1",
    "fc2",
    "w1",
    "w2",
    "w3",
    "dense_h_to_4h",
    "dense_4h_to_h",
)
LORA_DEFAULT_TARGETS = LORA_ATTENTION_TARGETS + LORA_MLP_TARGETS
MAX_LORA_RANK = 4096

AUTO = "auto"
MicroBatch = Union[int, Literal["auto"]]  # sequences per forward/backward, or "auto": the largest that fits

# Upper limits of what the code handles (or what could mean anything): steps must fit the 8-digit checkpoint
# names, a seed 63 bits (torch and numpy take it as a 64-bit integer), batches and sequences must fit memory.
MAX_SEED = 2**63 - 1
MAX_SEQ_LEN = 1 << 20
MAX_BATCH = 1 << 20
MAX_THREADS = 256


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
    model: str = opt(
        "llama",
        "model family (llama, deepseek, llada) or a local Hugging Face model directory to fine-tune",
        metavar="FAMILY|PATH",
        path="model",
    )
    size: str = opt("auto", "model size; auto picks the largest that fits this device", choices=SIZES)


@dataclass
class DataConfig:
    data: str = opt(
        "builtin",
        "training text: builtin (offline corpus), or a .txt/.jsonl/.parquet file or folder",
        metavar="builtin|PATH",
        path="data",
    )
    tokenizer: str | None = opt(
        None,
        "local Hugging Face tokenizer directory (default: the builtin BPE, vocab 8192)",
        metavar="DIR",
        path="tokenizer",
    )
    seq_len: int = opt(256, "tokens per sequence", low=8, high=MAX_SEQ_LEN)
    val_fraction: float = opt(0.01, "share of the tokens held out for validation", low=0, high=0.5, high_open=True)


@dataclass
class OptimConfig:
    global_batch: int = opt(
        16, "sequences per optimizer step (fixed; micro-batch changes adjust accumulation)", low=1, high=MAX_BATCH
    )
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

    precision: str = opt(
        AUTO,
        "numeric precision (auto: bf16 autocast where the device runs bf16 natively, else fp32)",
        choices=PRECISION_CHOICES,
    )
    compile: str = opt("off", "torch.compile mode", choices=COMPILE_MODES)
    micro_batch: MicroBatch = opt(
        AUTO,
        "sequences per forward/backward (auto: largest that fits; accumulation is derived)",
        metavar="N|auto",
        kind=int,
        words=(AUTO,),
        low=1,
        high=MAX_BATCH,
    )
    prefetch: int = opt(2, "batches prepared ahead of the step (0 disables)", low=0, high=MAX_THREADS)
    workers: int = opt(0, "loader worker threads (0: the prefetch thread builds batches)", low=0, high=MAX_THREADS)
    fused_adamw: bool = opt(
        True, "use the fused AdamW kernel (one vectorized pass; --no-fused-adamw for the foreach loop)"
    )
    activation_checkpointing: bool = opt(False, "recompute activations in backward to save memory")
    attention: str = opt("sdpa", "attention implementation", choices=ATTENTIONS)
    cuda_allocator: str = opt("default", "CUDA caching allocator mode", choices=ALLOCATORS)
    optimizer: str = opt(
        "adamw",
        "optimizer: adamw (fp32 moments), adamw-8bit / adamw-4bit (torchao's quantized "
        "moments, 4x / 8x smaller), adafactor (factored second moment, torch.optim.Adafactor)",
        choices=OPTIMIZERS,
    )
    quantize_base: str = opt(
        "none",
        "QLoRA: hold the frozen base quantized with bitsandbytes (nf4: 4-bit "
        "NormalFloat with double quantization; int8); needs --lora and CUDA",
        choices=QUANTIZE_BASE,
    )

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

    lora: int = opt(
        0,
        "LoRA rank R: train rank-R adapters on a frozen base instead of every weight (0: full fine-tuning)",
        metavar="R",
        low=0,
        high=MAX_LORA_RANK,
    )
    lora_alpha: float = opt(
        16.0, "LoRA scaling alpha (the adapter's update is scaled by alpha / R)", low=0, low_open=True, high=1e6
    )
    lora_dropout: float = opt(0.0, "dropout on the LoRA adapters' input", low=0, high=1, high_open=True)
    lora_targets: str = opt(
        AUTO,
        "modules that get adapters: auto (the attention and MLP projections of the "
        "architecture) or names, e.g. q_proj,v_proj",
        metavar="auto|NAMES",
        check=_lora_targets_format,
    )

    @property
    def enabled(self) -> bool:
        """LoRA is on: only the adapters train."""
        return self.lora > 0


@dataclass
class CheckpointConfig:
    checkpoint_every: int = opt(200, "optimizer steps between checkpoints (0: only at the end)", low=0, high=MAX_STEP)
    keep_checkpoints: int = opt(3, "checkpoints to keep (older ones are deleted)", low=1, high=MAX_STEP)
    resume: str | None = opt(
        None,
        "resume from a checkpoint file or a run directory (its newest valid checkpoint)",
        metavar="PATH",
        path="resume",
    )


@dataclass
class LogConfig:
    log_every: int = opt(10, "optimizer steps between step events (loss is read back only then)", low=1, high=MAX_STEP)
    eval_every: int = opt(100, "optimizer steps between validation losses (0 disables)", low=0, high=MAX_STEP)
    eval_batches: int = opt(4, "micro-batches per validation (held in memory)", low=1, high=10_000)
    timing: bool = opt(True, "time the step phases (--no-timing to measure its overhead)")
    profile_steps: str | None = opt(
        None,
        "write a torch.profiler trace of steps A-B (numbered from 1, as on the dashboard) into the run directory",
        metavar="A-B",
        check=_step_range_format,
    )


@dataclass
class RunConfig:
    run_dir: str | None = opt(
        None, "run directory (default: runs/<time>-<model>-<size>)", metavar="DIR", path="run_dir"
    )
    device: str = opt("auto", "torch device: auto, cpu, cuda, cuda:N", check=device_format)
    nan_policy: str = opt(
        "rollback",
        "on a non-finite step (loss, gradient norm or weights): roll back to the "
        "newest checkpoint that verifies, or stop",
        choices=NAN_POLICIES,
    )
    nan_retries: int = opt(3, "rollbacks allowed before stopping with an error", low=0, high=1000)
    nan_lr_factor: float = opt(
        0.5, "learning-rate multiplier applied at each NaN rollback", low=0, low_open=True, high=1
    )
    parallel: str = opt(
        "ddp",
        "how several ranks (torchrun, gptop --nproc) share the model: ddp replicates it, "
        "fsdp shards it (FSDP2); ignored with one process",
        choices=PARALLEL,
    )
    channel: str | None = opt(
        None, "event/command channel given by the launcher (unix:PATH)", metavar="URI", hidden=True
    )
    fault: str | None = opt(
        None,
        "test-only fault injection (trainer/faults.py), e.g. nan@12 or oom@5; kill@5:1 only on rank 1",
        metavar="KIND@STEP[:RANK]",
        hidden=True,
    )


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
        old_places = {
            (home, key): sec for (sec, key), home in MOVED.items() if isinstance(d.get(sec), dict) and key in d[sec]
        }
        d = current_layout(d)
        for section, values in d.items():
            if section not in SECTIONS:
                home = [s for s, c in SECTIONS.items() if section in {f.name for f in fields(c)}]
                hint = f"; options belong in tables: [{home[0]}] {section} = ..." if home else ""
                raise ConfigError(f"[{section}]", f"unknown section; expected one of {', '.join(SECTIONS)}{hint}")
            if not isinstance(values, dict):
                raise ConfigError(
                    f"[{section}]", f"must be a table of options, got {type(values).__name__} {show(values)}"
                )
            obj = getattr(cfg, section)
            known = {f.name: f for f in fields(obj)}
            for key, value in values.items():
                if key not in known:
                    raise ConfigError(f"{section}.{key}", f"unknown option; known: {', '.join(known)}")
                old = old_places.get((section, key))
                try:
                    setattr(obj, key, coerce(known[key], value, f"{section}.{key}", text=text))
                except ConfigError as e:
                    if old is None:
                        raise
                    # named as the file has it: the user wrote [optim] optimizer, not toggles.optimizer
                    raise ConfigError(
                        f"[{old}] {key}", f"{e.message} ({key} lives in [{section}] now; it is still read from [{old}])"
                    ) from None
        return cfg

    def to_toml(self) -> str:
        """The config as TOML text, tables per section (a run's config.toml); `config_files.config_from_toml`
        reads a file back, checking the path first."""
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
            problem = type_problem(f, value) or value_problem(f, value)
            if problem:
                raise ConfigError(flag_of(f), problem)
        o, mb = self.optim, self.toggles.micro_batch
        if world_size < 1:
            raise ConfigError("--nproc", f"must be at least 1, got {world_size}")
        if o.global_batch % world_size:
            raise ConfigError(
                "--global-batch",
                f"{o.global_batch} sequences cannot be split evenly over "
                f"{world_size} ranks; use a multiple of {world_size}",
            )
        if self.log.profile_steps is not None and parse_step_range(self.log.profile_steps)[0] > o.max_steps:
            raise ConfigError(
                "--profile-steps",
                f"{self.log.profile_steps} starts after the last step "
                f"(--max-steps {o.max_steps}): no trace would be written",
            )
        ft, qb = self.finetune, self.toggles.quantize_base
        if qb != "none" and not ft.enabled:
            raise ConfigError(
                "--quantize-base",
                f"{qb} quantizes the frozen base of a LoRA run; add --lora R (e.g. --lora 8), or drop --quantize-base",
            )
        if not ft.enabled:  # LoRA's own options mean nothing without it: never silently ignored
            for f in fields(ft):
                value = getattr(ft, f.name)
                if f.name != "lora" and value != f.default:
                    raise ConfigError(
                        flag_of(f),
                        f"{show(value)} sets up LoRA adapters, but this run trains every "
                        "weight (no --lora); add --lora R (e.g. --lora 8), or drop "
                        f"{flag_of(f)}",
                    )
        if ft.enabled and world_size > 1 and self.run.parallel == "fsdp":
            raise ConfigError(
                "--parallel",
                "fsdp with --lora is not supported (FSDP2 would shard the frozen base "
                "and the adapters together); use --parallel ddp, which replicates the "
                "base and all-reduces only the adapters' gradients",
            )
        if qb != "none" and world_size > 1:
            raise ConfigError("--quantize-base", f"{qb} runs on one process; drop --nproc or --quantize-base")
        per_rank = o.global_batch // world_size
        if isinstance(mb, int) and per_rank % mb:
            over = f" ({o.global_batch} over {world_size} ranks)" if world_size > 1 else ""
            raise ConfigError(
                "--micro-batch",
                f"{mb} does not divide the per-rank batch {per_rank}{over}; pick a divisor of {per_rank} or auto",
            )


# What a resumed run must keep of the run it continues (what is learned); toggles may change (the optimizer's
# state is converted, a quantized base rebuilt).
RESUME_MUST_MATCH = (
    ("model", "model", "--model"),
    ("model", "size", "--size"),
    ("data", "seq_len", "--seq-len"),
    ("optim", "global_batch", "--global-batch"),
    ("optim", "seed", "--seed"),
    ("data", "data", "--data"),
    ("finetune", "lora", "--lora"),
    ("finetune", "lora_targets", "--lora-targets"),
)


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
            hint = (
                "; to fine-tune its model with other LoRA options, export it (gptop export RUN_DIR OUT_DIR) and "
                "train --model OUT_DIR with them"
            )
        raise ConfigError(
            flag, f"{what} was trained with {was!r}, this run asks for {want!r}; resume needs the same value{hint}"
        )


def section_from_dict(cls: type, values: dict[str, Any]) -> Any:
    """One section (e.g. `Toggles`) from stored values (a study's record, a report's JSON), each converted and
    checked as in a TOML file, so a value stored by an older version (`micro_batch: "8"`) reads as today's."""
    name = next(n for n, c in SECTIONS.items() if c is cls)
    return getattr(TrainConfig.from_dict({name: values}), name)


def section_as_reported(base: Any, values: dict[str, Any]) -> Any:
    """`base` (a section, e.g. `Toggles`) with the values a process reported over it, each converted and checked
    as `section_from_dict` does; a key this version does not know, or a value it cannot take, keeps `base`'s
    (a newer trainer's or a foreign program's record is read, never refused)."""
    name = next(n for n, c in SECTIONS.items() if c is type(base))
    out = dataclasses.replace(base)
    for key, value in values.items():
        try:
            setattr(out, key, getattr(getattr(TrainConfig.from_dict({name: {key: value}}), name), key))
        except ConfigError:
            continue
    return out


def parse_step_range(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split("-"))
    except ValueError:
        raise ConfigError("--profile-steps", f"{text!r} is not A-B, e.g. 10-12") from None
    if not 1 <= a <= b <= MAX_STEP:
        raise ConfigError(
            "--profile-steps",
            f"{text!r}: steps are numbered from 1 (the first step is 1, as on the "
            f"dashboard); need 1 <= A <= B <= {MAX_STEP}, e.g. 10-12",
        )
    return a, b


def _drop_none(d: dict) -> dict:
    return {k: (_drop_none(v) if isinstance(v, dict) else v) for k, v in d.items() if v is not None}
