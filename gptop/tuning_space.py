"""The search space of a run's tuning as the session chooses it: the starting toggles, memory pressure, a
short CPU budget, and what a user's script can take (`gptop tune -- CMD`)."""

from __future__ import annotations

from typing import Any

from trainer.contract.config import TrainConfig
from trainer.contract.device import DeviceInfo

CPU_COMPILE_MIN_BUDGET_S = 600.0  # below this, a CPU run's tuning leaves compile alone by default


def tuning_space(
    cfg: TrainConfig,
    dev: DeviceInfo,
    fits: int | None,
    world: int,
    spec: str | None,
    budget_s: float,
    command: list[str] | None = None,
) -> tuple[Any, str]:
    """The search space of this run's tuning and what the first line says about it beyond its toggles.

    `cfg` holds the starting toggles (micro-batch as the user gave it), `fits` what `--micro-batch auto`
    found to fit (None: not probed). Memory is the constraint when the wanted micro-batch does not fit
    (tuner.space.memory_pressure): the space then includes the memory-saving toggles. On a CPU with a short
    budget, compile is left alone unless the spec names it. `command`: the run is a user's script whose
    client can take these toggles (`gptop tune -- CMD`): the space is narrowed to what its TrainingArguments
    hold (tuner.command_space) before the spec applies."""
    from trainer.contract.capabilities import parallel_mode
    from tuner.space import MEMORY_SAVING, SearchSpace, memory_pressure, quantizable

    memory = memory_pressure(cfg, fits, world)
    space = SearchSpace.for_device(
        cfg.toggles,
        dev,
        cfg.optim.global_batch,
        world_size=world,
        spec=spec if command is None else None,
        memory=memory,
        quantizable=quantizable(cfg),
        parallel=parallel_mode(cfg, world),
    )
    if command is not None:
        from tuner.command_space import command_space

        space = command_space(space, dev, command, spec)
    note = ""
    if memory:
        savers = [f"{n} {'/'.join(str(v) for v in space.choices[n])}" for n in MEMORY_SAVING if n in space.params]
        note = f"; memory is the constraint ({memory}): trying {', '.join(savers) or 'no memory saver'}"
    if (
        not dev.is_cuda
        and budget_s < CPU_COMPILE_MIN_BUDGET_S
        and "compile" in space.params
        and "compile" not in (spec or "")
    ):
        # inductor's C++ build takes from 20 s to minutes on a CPU: in a short budget a compile trial
        # costs several others and rarely finishes warming up; naming compile in --tune-space opts in
        space = space.apply_spec("-compile", dev)
        note += (
            f"; compile stays {cfg.toggles.compile} (on a CPU its warm-up does not fit a budget under "
            f"{CPU_COMPILE_MIN_BUDGET_S / 60:.0f} minutes; name it in --tune-space to try it)"
        )
    return space, note
