"""The trainer's protocol for a training process gptop did not build: what `gptop run -- CMD` hands down.

gptop starts CMD with the variables below in its environment. A client inside CMD (gptop.integrations: the
probe of a plain loop, the callbacks for transformers.Trainer and Lightning) reads them with
`ClientEnv.from_environ` and speaks the same protocol as gptop's own trainer: typed events
(trainer.contract.events) into RUN_DIR/events.jsonl (events.rankN.jsonl for the other ranks) and over the
channel, commands (checkpoint, stop, profile, log every N steps) back over the channel. Without
GPTOP_CHANNEL in the environment a client is off, and each of its calls is a no-op.

The lock of the run directory stays gptop's (trainer.contract.runlock): CMD runs with its token and
descriptor, as the built-in trainer does, and a client takes no lock of its own.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from .common import MAX_STEP, ConfigError
from .config_schema import Toggles, TrainConfig

CHANNEL_ENV = "GPTOP_CHANNEL"  # unix:PATH of the supervisor's socket
RUN_DIR_ENV = "GPTOP_RUN_DIR"  # where events.jsonl, profiles/ and the logs go
LOG_EVERY_ENV = "GPTOP_LOG_EVERY"  # `gptop run --log-every N`: overrides the client's own interval
RESUME_ENV = "GPTOP_RESUME"  # a checkpoint of the program's own to continue from (gptop restarting it)
TUNE_ENV = "GPTOP_TUNE"  # "1": `gptop tune -- CMD` tunes this program (it must take toggles)
TOGGLES_ENV = "GPTOP_TOGGLES"  # the toggles this process runs with (JSON of Toggles); unset: its own


# What gptop takes a client's program to run with where its hello does not say (a probe or Lightning client
# reports only its precision): PyTorch's own defaults, none of gptop's speed-ups. The transformers callback
# reports every toggle; gptop's own trainer too, and a toggle an older trainer did not name ran at Toggles()'s.
PLAIN_PYTORCH = Toggles(
    precision="fp32", compile="off", prefetch=0, workers=0, fused_adamw=False, activation_checkpointing=False
)


class ClientKind(str, enum.Enum):
    """The integration that speaks for a process (a hello event's `client`); gptop's own trainer has none."""

    PROBE = "probe"  # gptop.integrations.torch.Probe in a plain loop
    TRANSFORMERS = "transformers"  # gptop.integrations.transformers.GptopCallback
    LIGHTNING = "lightning"  # gptop.integrations.lightning.GptopCallback


@dataclass(frozen=True)
class ClientEnv:
    """What a client needs from gptop, read from (and written into) a process environment."""

    channel: str  # unix:PATH
    run_dir: Path
    log_every: int | None = None  # None: the client's own interval
    resume: str | None = None  # a checkpoint path of the program's own format, or None
    tune: bool = False  # gptop tunes this program: it must be able to take toggles
    toggles: Toggles | None = None  # the toggles to run with (a trial's, the decision's); None: its own

    def to_environ(self) -> dict[str, str]:
        env = {CHANNEL_ENV: self.channel, RUN_DIR_ENV: str(self.run_dir)}
        if self.log_every is not None:
            env[LOG_EVERY_ENV] = str(self.log_every)
        if self.resume is not None:
            env[RESUME_ENV] = self.resume
        if self.tune:
            env[TUNE_ENV] = "1"
        if self.toggles is not None:
            env[TOGGLES_ENV] = json.dumps(dataclasses.asdict(self.toggles), sort_keys=True)
        return env

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> "ClientEnv | None":
        """The environment gptop gave this process, or None outside gptop (no GPTOP_CHANNEL). A variable that
        is set but wrong (someone set it by hand) is a ConfigError naming it, never a silent fallback."""
        env = os.environ if env is None else env
        channel = env.get(CHANNEL_ENV)
        if not channel:
            return None
        if not channel.startswith("unix:") or len(channel) == len("unix:"):
            raise ConfigError(
                CHANNEL_ENV, f"{channel!r} is not unix:PATH (gptop run sets it; unset it to run without gptop)"
            )
        run_dir = env.get(RUN_DIR_ENV)
        if not run_dir or not Path(run_dir).is_dir():
            raise ConfigError(RUN_DIR_ENV, f"{run_dir!r} is not a directory (gptop run sets it with {CHANNEL_ENV})")
        log_every = env.get(LOG_EVERY_ENV) or None
        every: int | None = None
        if log_every is not None:
            try:
                every = int(log_every)
            except ValueError:
                every = 0
            if not 1 <= every <= MAX_STEP:
                raise ConfigError(LOG_EVERY_ENV, f"{log_every!r} is not a whole number of steps from 1 to {MAX_STEP}")
        tune = env.get(TUNE_ENV) or ""
        if tune not in ("", "0", "1"):
            raise ConfigError(TUNE_ENV, f"{tune!r} is not 1 or 0 (gptop tune sets it)")
        return cls(
            channel=channel,
            run_dir=Path(run_dir),
            log_every=every,
            resume=env.get(RESUME_ENV) or None,
            tune=tune == "1",
            toggles=parse_toggles(env.get(TOGGLES_ENV)),
        )


def parse_toggles(text: str | None) -> Toggles | None:
    """GPTOP_TOGGLES read back: a JSON object of Toggles fields, checked as a config file's [toggles] table is
    (ConfigError naming the variable)."""
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ConfigError(TOGGLES_ENV, f"not JSON ({e}); gptop tune sets it") from None
    if not isinstance(data, dict):
        raise ConfigError(TOGGLES_ENV, f"expected a JSON object of toggles, got {type(data).__name__}")
    try:
        return TrainConfig.from_dict({"toggles": data}).toggles
    except ConfigError as e:
        raise ConfigError(TOGGLES_ENV, str(e)) from None
