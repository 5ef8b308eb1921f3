"""The search space of `gptop tune -- CMD`: gptop's own space narrowed to what a script's TrainingArguments
hold (trainer.contract.training_args), and the `--tune-space` items a command cannot take refused."""

from __future__ import annotations

import dataclasses

from trainer.contract.config import ConfigError
from trainer.contract.device import DeviceInfo
from trainer.contract.training_args import COMMAND_PREFETCH, FROZEN, PRECISIONS, TUNED

from .space import OPTION, SearchSpace


def check_spec(spec: str | None) -> None:
    """A `--tune-space` for a command names only toggles it can change (ConfigError naming the item)."""
    for item in (spec or "").replace(";", " ").split():
        name = item[1:] if item.startswith("-") else item.partition("+=")[0].partition("=")[0]
        name = name.strip().replace("-", "_")
        if name in FROZEN:
            raise ConfigError(
                OPTION,
                f"{item!r}: {name} is not a TrainingArguments field gptop changes; a "
                f"command's tuning changes {', '.join(TUNED)}",
            )
        if name == "prefetch" and "=" in item:
            values = item.partition("=")[2].split(",")
            if "0" in [v.strip() for v in values]:
                raise ConfigError(
                    OPTION,
                    f"{item!r}: dataloader_prefetch_factor 0 means nothing to a DataLoader "
                    f"(prefetching needs workers); use {','.join(map(str, COMMAND_PREFETCH))}",
                )


def command_space(
    space: SearchSpace, dev: DeviceInfo, tunable_names: list[str] | None, spec: str | None
) -> SearchSpace:
    """`space` (the default space of gptop's own trainer for this device and batch: every value the device
    supports and runs at speed) narrowed to what a script's TrainingArguments can take, then the user's
    `--tune-space` applied: precisions a field holds, prefetch factors a DataLoader takes, the toggles the
    client said it can change (`tunable_names`, from its hello), the others frozen at the start."""
    check_spec(spec)
    allowed = set(tunable_names if tunable_names is not None else TUNED)
    choices = dict(space.choices)
    for name, values in space.choices.items():
        start = getattr(space.base, name)
        if name not in allowed:
            choices[name] = (start,)
        elif name == "precision":
            choices[name] = tuple(v for v in values if v in PRECISIONS) or (start,)
        elif name == "prefetch":
            choices[name] = tuple(dict.fromkeys(sorted({*(v for v in values if v > 0), *COMMAND_PREFETCH, start})))
        if start not in choices[name]:
            choices[name] = (start,) + choices[name]
    # a prefetch factor acts only with workers: trials that differ only in it while workers=0 are one
    out = dataclasses.replace(space, choices=choices, needs=(("prefetch", "workers"),))
    return out.apply_spec(spec, dev) if spec else out
