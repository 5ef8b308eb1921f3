"""The search space over `Toggles`: which values a trial may take on this device.

Only values the device supports are offered (`trainer.contract.capabilities`), so the
sampler never proposes what the trainer would refuse. Values known to be slow
on the device (bf16 on a CPU without native bf16) are left out of the default
space. `--tune-space` narrows or widens the default space (and so can add a
slow value back: `precision+=bf16`) with a small grammar (items separated by
spaces or `;`, names accept `-` or `_`):

    -NAME            freeze NAME at the starting configuration's value
    -all             freeze everything (then re-open some with NAME=...)
    NAME=V1,V2,...   restrict NAME to these values (one value freezes it there)
    NAME+=V1,V2,...  widen: add these values to NAME's default choices

e.g. `--tune-space "precision=bf16 compile=off,default -cuda_allocator"` or
`"-all compile+=max-autotune-no-cudagraphs micro_batch=4,8"`. Booleans take
on/off (true/false, yes/no, 1/0). Items apply left to right; an error names
the item and what is wrong with it.

Numerics. Compile, fused AdamW, micro-batch (accumulation keeps the global
batch), prefetch, workers, activation checkpointing, attention kernel and
allocator change at most the order of floating-point sums (last-bit
differences), never what is computed. Three toggles are numerics-changing
(`NUMERICS_CHANGING`): any change of `precision` away from the starting one,
tf32 and bf16 included (they round matmul inputs to fewer mantissa bits:
usually harmless, but not the same numbers; fp16 can overflow and fp8 scales
tensors); any change of `optimizer` (torchao's 8-bit / 4-bit AdamW round the
moments block-wise, Adafactor is another algorithm, and a switch to or from it
starts its state fresh: trainer.contract.capabilities.optimizer_switch; such a
trial is rolled back once measured, so the run keeps its own state); and
any change of `quantize_base` (a 4-bit / 8-bit frozen base computes other
activations). The guard for numerics-changing trials (a loss check against
the run's own trend, `tuner.measure.LossTrend`) costs nothing, so it is
applied to all of them rather than trusting bf16 or 8-bit moments by
reputation.

Memory. The tuner treats memory as a constraint it can trade. Usually the
space leaves the optimizer and the base's storage as the run has them (a
low-bit optimizer saves memory, not time: on the CPU torchao's 8-bit AdamW ran
at 0.15x AdamW's speed). When the wanted micro-batch does not fit
(`memory_pressure`: with `--micro-batch auto`, the default, the whole
per-rank batch is above the largest micro-batch the trainer found to fit), the
space widens to the memory-saving values (`MEMORY_SAVING`): activation
checkpointing on, every supported optimizer with a smaller state than the
run's, and for a LoRA run of a model directory a quantized base where the
device supports one (never on the CPU: trainer.contract.capabilities gates
it). `SearchSpace.memory` then says why, and the report says it too.
`--tune-space optimizer+=adamw-8bit` adds a value by hand either way. Both
are tuned on one process only: the optimizer-state conversion and a quantized
base run on one.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import random
from dataclasses import dataclass
from typing import Any, Iterator

from trainer.contract.capabilities import CHOICES, default_values, memory_saving, resolve_precision, support
from trainer.contract.common import FAMILIES
from trainer.contract.config import AUTO, MAX_BATCH, MAX_THREADS, ConfigError, Toggles, TrainConfig
from trainer.contract.device import DeviceInfo

OPTION = "--tune-space"

# Tuned toggles, in the order they are suggested and shown.
TUNABLE: tuple[str, ...] = (
    "precision",
    "compile",
    "micro_batch",
    "prefetch",
    "workers",
    "fused_adamw",
    "activation_checkpointing",
    "attention",
    "cuda_allocator",
    "optimizer",
    "quantize_base",
)
NUMERICS_CHANGING: frozenset[str] = frozenset({"precision", "optimizer", "quantize_base"})
# What a memory-constrained space widens (see the module doc); one process only for the last two.
MEMORY_SAVING: tuple[str, ...] = ("activation_checkpointing", "optimizer", "quantize_base")
ONE_PROCESS: frozenset[str] = frozenset({"optimizer", "quantize_base"})
NUMERICS_NEUTRAL: frozenset[str] = frozenset(TUNABLE) - NUMERICS_CHANGING
DEFAULT_PREFETCH: tuple[int, ...] = (0, 1, 2, 4)
DEFAULT_WORKERS: tuple[int, ...] = (0, 1, 2)
_INTS = ("micro_batch", "prefetch", "workers")
_BOOLS = ("fused_adamw", "activation_checkpointing")
_TRUE = ("on", "true", "yes", "1")
_FALSE = ("off", "false", "no", "0")


def _canon(name: str) -> str:
    return name.strip().replace("-", "_")


def _order(name: str, values: Any) -> tuple:
    """Canonical order (so the same set always gives the same Optuna distribution and study key)."""
    vals = list(dict.fromkeys(values))
    if name in CHOICES:
        ref = list(CHOICES[name])
        return tuple(sorted(vals, key=lambda v: ref.index(v) if v in ref else len(ref)))
    return tuple(sorted(vals, key=lambda v: (isinstance(v, str), v)))


def per_rank_batch(global_batch: int, world_size: int = 1) -> int:
    """Sequences per optimizer step on one rank: what a micro-batch must divide."""
    if world_size < 1:
        raise ConfigError("--nproc", f"must be at least 1, got {world_size}")
    if global_batch % world_size:
        raise ConfigError("--global-batch", f"{global_batch} is not divisible by the {world_size} ranks")
    return global_batch // world_size


def micro_batch_choices(per_rank: int) -> tuple[int, ...]:
    """Powers of two dividing the per-rank batch: each keeps the global batch exact via accumulation."""
    out, mb = [], 1
    while mb <= per_rank:
        if per_rank % mb == 0:
            out.append(mb)
        mb *= 2
    return tuple(out)


@dataclass(frozen=True)
class SearchSpace:
    """Allowed values per tuned toggle; a toggle with one value is frozen (not suggested).

    `base` is the starting configuration: frozen toggles take their values from
    the space, everything not tuned (none today) from `base`. `memory` says why
    the space was widened to the memory-saving values (None: it was not);
    `quantizable`: the run is LoRA on a model directory, whose frozen base may be
    quantized; `world_size`: the ranks (the optimizer and the base are tuned on one); `parallel`: how they
    share the model (capabilities.support's; None: one process).
    """

    base: Toggles
    choices: dict[str, tuple]
    per_rank: int
    memory: str | None = None
    quantizable: bool = False
    world_size: int = 1
    parallel: str | None = None
    spec: str | None = None  # the --tune-space items applied, in order (replayed by `for_memory`)
    # (toggle, the toggle it needs): the first acts only while the second is non-zero (a DataLoader's
    # prefetch factor needs workers); configurations that differ only in an idle toggle are one configuration
    needs: tuple[tuple[str, str], ...] = ()

    # --- construction ------------------------------------------------------------
    @classmethod
    def for_device(
        cls,
        base: Toggles,
        dev: DeviceInfo,
        global_batch: int,
        world_size: int = 1,
        spec: str | None = None,
        *,
        memory: str | None = None,
        quantizable: bool = False,
        parallel: str | None = None,
    ) -> "SearchSpace":
        """The default space for `dev` (every supported value not known to be slow, and the start's own),
        widened to the memory-saving values when `memory` (why; see `memory_pressure`), then
        narrowed/widened by a `--tune-space` spec."""
        # a trial runs a concrete precision: the start is what auto resolves to on `dev`
        base = dataclasses.replace(base, precision=resolve_precision(base.precision, dev))
        per_rank = per_rank_batch(global_batch, world_size)
        choices: dict[str, tuple] = {}
        for name in TUNABLE:
            vals: list[Any]
            if name in ONE_PROCESS:
                # as the run has them; a memory-constrained run of one process may trade them for memory
                vals = [getattr(base, name)]
                if memory and world_size == 1 and (name != "quantize_base" or quantizable):
                    vals += [v for v in memory_saving(name, getattr(base, name)) if support(name, v, dev) is None]
            elif name == "activation_checkpointing" and memory:
                vals = [base.activation_checkpointing, True]
            elif name == "micro_batch":
                vals = list(micro_batch_choices(per_rank))
                b = base.micro_batch
                if isinstance(b, int) and per_rank % b == 0:
                    vals.append(b)
            elif name == "prefetch":
                vals = list(DEFAULT_PREFETCH) + [base.prefetch]
            elif name == "workers":
                vals = list(DEFAULT_WORKERS) + [base.workers]
            else:
                vals = default_values(name, dev, parallel)
                if (
                    getattr(base, name) not in vals
                    and support(name, getattr(base, name), dev, parallel=parallel) is None
                ):
                    vals.append(getattr(base, name))  # the start is always in the space, even when slow
            choices[name] = _order(name, vals)
        space = cls(
            base=base,
            choices=choices,
            per_rank=per_rank,
            memory=memory,
            quantizable=quantizable,
            world_size=world_size,
            parallel=parallel,
        )
        if spec:
            space = space.apply_spec(spec, dev)
        return space

    @classmethod
    def check_spec(
        cls, spec: str, base: Toggles, global_batch: int, world_size: int = 1, quantizable: bool = False
    ) -> None:
        """Check a `--tune-space` spec where it enters, before the device is known (ConfigError naming it):
        its grammar, names and values; what the device supports is checked when tuning starts."""
        per_rank = per_rank_batch(global_batch, world_size)
        choices: dict[str, tuple] = {n: tuple(CHOICES[n]) for n in TUNABLE if n in CHOICES}
        choices.update(micro_batch=micro_batch_choices(per_rank), prefetch=DEFAULT_PREFETCH, workers=DEFAULT_WORKERS)
        cls(base=base, choices=choices, per_rank=per_rank, quantizable=quantizable, world_size=world_size).apply_spec(
            spec, None
        )

    def apply_spec(self, spec: str, dev: DeviceInfo | None) -> "SearchSpace":
        """A new space with the `--tune-space` items applied left to right (`dev` None: support not checked)."""
        choices = dict(self.choices)
        items = [p for p in spec.replace(";", " ").split() if p]
        if not items:
            raise ConfigError(OPTION, 'empty; e.g. "precision=bf16 compile=off,default -cuda_allocator"')
        for item in items:
            if item.startswith("-"):
                name = _canon(item[1:])
                if name == "all":
                    for n in TUNABLE:
                        choices[n] = (getattr(self.base, n),)
                    continue
                self._check_name(item, name)
                choices[name] = (getattr(self.base, name),)
                continue
            if "+=" in item:
                name, _, raw = item.partition("+=")
                widen = True
            elif "=" in item:
                name, _, raw = item.partition("=")
                widen = False
            else:
                raise ConfigError(
                    OPTION, f"{item!r}: expected NAME=V1,V2 (restrict), NAME+=V (widen) or -NAME (freeze)"
                )
            name = _canon(name)
            self._check_name(item, name)
            parts = [p for p in raw.split(",")]
            if not raw or any(not p.strip() for p in parts):
                raise ConfigError(OPTION, f"{item!r}: empty value; list values separated by commas")
            values = [self._parse_value(item, name, p.strip(), dev) for p in parts]
            choices[name] = _order(name, (list(self.choices[name]) if widen else []) + values)
        return dataclasses.replace(self, choices=choices, spec=f"{self.spec} {spec}" if self.spec else spec)

    def for_memory(self, reason: str, dev: DeviceInfo) -> "SearchSpace":
        """This space widened to the memory-saving values because of `reason` (the starting configuration ran
        out of memory), with the same `--tune-space` items applied after, so the user's word stays last."""
        return SearchSpace.for_device(
            self.base,
            dev,
            self.per_rank * self.world_size,
            self.world_size,
            self.spec,
            memory=reason,
            quantizable=self.quantizable,
            parallel=self.parallel,
        )

    @staticmethod
    def _check_name(item: str, name: str) -> None:
        if name not in TUNABLE:
            raise ConfigError(OPTION, f"{item!r}: unknown toggle {name!r}; known: {', '.join(TUNABLE)} (or -all)")

    def _parse_value(self, item: str, name: str, raw: str, dev: DeviceInfo | None) -> Any:
        if name in _BOOLS:
            word = raw.lower()
            if word in _TRUE:
                return True
            if word in _FALSE:
                return False
            raise ConfigError(OPTION, f"{item!r}: {raw!r} is not on/off")
        if name in _INTS:
            if name == "micro_batch" and raw == AUTO:
                return AUTO
            try:
                v = int(raw)
            except ValueError:
                raise ConfigError(OPTION, f"{item!r}: {raw!r} is not a whole number") from None
            low = 1 if name == "micro_batch" else 0
            high = MAX_BATCH if name == "micro_batch" else MAX_THREADS
            if v < low:
                raise ConfigError(OPTION, f"{item!r}: {v} must be at least {low}")
            if v > high:
                raise ConfigError(OPTION, f"{item!r}: {v} must be at most {high}")
            if name == "micro_batch" and self.per_rank % v:
                raise ConfigError(
                    OPTION,
                    f"{item!r}: micro-batch {v} does not divide the per-rank batch "
                    f"{self.per_rank} (the global batch stays fixed)",
                )
            return v
        if raw not in CHOICES[name]:
            raise ConfigError(OPTION, f"{item!r}: {raw!r} is not one of {', '.join(map(str, CHOICES[name]))}")
        if name in ONE_PROCESS and self.world_size > 1 and raw != getattr(self.base, name):
            raise ConfigError(
                OPTION,
                f"{item!r}: {name} is tuned on one process only (the optimizer-state "
                f"conversion and a quantized base run on one); drop it or --nproc",
            )
        if name == "quantize_base" and raw != "none" and not self.quantizable:
            raise ConfigError(
                OPTION,
                f"{item!r}: a quantized base is for a LoRA run of a model directory "
                f"(--lora R --model DIR); drop quantize_base from --tune-space",
            )
        reason = support(name, raw, dev, parallel=self.parallel) if dev is not None else None
        if reason and dev is not None:
            raise ConfigError(OPTION, f"{item!r}: {raw} is not supported on {dev.name}: {reason}")
        return raw

    # --- queries ----------------------------------------------------------------
    @property
    def params(self) -> tuple[str, ...]:
        """Toggles the sampler chooses (two or more values)."""
        return tuple(n for n in TUNABLE if len(self.choices[n]) > 1)

    @property
    def frozen(self) -> dict[str, Any]:
        return {n: self.choices[n][0] for n in TUNABLE if len(self.choices[n]) == 1}

    def size(self) -> int:
        """How many distinct configurations the space holds (those equal but for an idle toggle count once)."""
        return self._distinct

    @functools.cached_property
    def _distinct(self) -> int:
        # counted once: the views ask for it with every tuner event, and the space never changes
        raw = math.prod(len(self.choices[n]) for n in TUNABLE)
        if not self.needs or raw > 20000:
            return raw
        return len({self.config_key(p) for p in self.all_params()})

    def canonical(self, params: dict[str, Any]) -> dict[str, Any]:
        """`params` with every idle toggle (see `needs`) at the start's value: the configuration it runs."""
        if not self.needs:
            return params
        out = dict(params)
        for name, needed in self.needs:
            if name in out and not out.get(needed, getattr(self.base, needed)):
                start = getattr(self.base, name)
                out[name] = start if start in self.choices[name] else self.choices[name][0]
        return out

    def config_key(self, params: dict[str, Any]) -> tuple:
        """The identity of the configuration `params` run, for duplicate detection (`params_key` of the
        canonical parameters)."""
        return params_key(self.canonical(params))

    def key(self) -> str:
        """Canonical text of the space, part of the study name: a different space is a different study."""
        return ";".join(f"{n}={'|'.join(str(v) for v in self.choices[n])}" for n in TUNABLE)

    def describe(self) -> list[str]:
        return [
            f"{n}: {', '.join(str(v) for v in self.choices[n])}" + ("" if n in self.params else " (frozen)")
            for n in TUNABLE
        ]

    def distributions(self) -> dict[str, Any]:
        from optuna.distributions import CategoricalDistribution

        return {n: CategoricalDistribution(self.choices[n]) for n in self.params}

    def to_toggles(self, params: dict[str, Any]) -> Toggles:
        """The Toggles for sampled `params` (frozen toggles filled in)."""
        values = dict(self.frozen)
        values.update({k: v for k, v in params.items() if k in self.choices})
        t = dataclasses.replace(self.base)
        for name, v in values.items():
            setattr(t, name, v)
        return t

    def to_params(self, toggles: Toggles) -> dict[str, Any]:
        """The sampler's view of `toggles` (only non-frozen toggles). ValueError if outside the space."""
        if not self.contains(toggles):
            raise ValueError(f"{toggles} is outside the search space")
        return {n: getattr(toggles, n) for n in self.params}

    def contains(self, toggles: Toggles) -> bool:
        return all(getattr(toggles, n) in self.choices[n] for n in TUNABLE)

    def clamp(self, toggles: Toggles) -> Toggles:
        """Nearest point in the space: values outside it are replaced by the base's or the first allowed."""
        t = dataclasses.replace(toggles)
        for n in TUNABLE:
            v = getattr(t, n)
            if v not in self.choices[n]:
                b = getattr(self.base, n)
                v = b if b in self.choices[n] else self.choices[n][0]
                setattr(t, n, v)
        return t

    def suggest(self, trial: Any) -> Toggles:
        """Ask an Optuna trial for every non-frozen toggle (categorical, since the values have no useful order)."""
        params = {n: trial.suggest_categorical(n, list(self.choices[n])) for n in self.params}
        return self.to_toggles(params)

    def numerics_changing(self, toggles: Toggles) -> bool:
        """Whether `toggles` may change the numbers computed compared with the start (see module doc)."""
        return any(getattr(toggles, n) != getattr(self.base, n) for n in NUMERICS_CHANGING)

    def all_params(self) -> Iterator[dict[str, Any]]:
        names = self.params
        for combo in itertools.product(*(self.choices[n] for n in names)):
            yield dict(zip(names, combo))

    def random_params(self, rng: random.Random) -> dict[str, Any]:
        return {n: rng.choice(self.choices[n]) for n in self.params}


def quantizable(cfg: TrainConfig) -> bool:
    """Whether a run's frozen base could be quantized: LoRA on a model directory (a family starts from random
    weights, which trainer.models refuses to quantize)."""
    return cfg.finetune.enabled and cfg.model.model not in FAMILIES


def memory_pressure(cfg: TrainConfig, fits: int | None, world_size: int = 1) -> str | None:
    """Why memory constrains this run (the space then widens to the memory-saving values), or None.

    The wanted micro-batch is the one asked for, or with `--micro-batch auto` the whole per-rank batch (one
    forward/backward per step: no accumulation). It does not fit when it is above `fits`, the largest the
    trainer's `--micro-batch auto` found to fit (its probe, or on a roomy CPU the estimate against the RAM;
    None: not probed). An explicit micro-batch whose estimate does not fit is refused before the run starts
    (gptop.preflight.check_fits, the trainer's early hello), so it never reaches the tuner."""
    per_rank = per_rank_batch(cfg.optim.global_batch, world_size)
    t = cfg.toggles
    wanted = t.micro_batch if isinstance(t.micro_batch, int) else per_rank  # else AUTO
    if fits is None or fits >= wanted:
        return None
    what = f"--micro-batch {wanted}" if t.micro_batch != AUTO else f"the whole per-rank batch ({wanted})"
    return (
        f"{what} does not fit: {fits} is the largest micro-batch that fits with the starting toggles "
        f"({wanted // fits} accumulation steps)"
    )


def params_key(params: dict[str, Any]) -> tuple:
    """Hashable identity of a parameter dict (order-free), for duplicate detection."""
    return tuple(sorted((k, (type(v).__name__, v)) for k, v in params.items()))
