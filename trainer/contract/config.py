"""The one configuration object of a training run, and everything that reads and writes it: import it from here.

The parts live in modules of their own, each importing only the ones above it in this list:

- `config_options`: an option's metadata (`opt`: flag, help, accepted values), its conversion and checks,
  and `number_arg` for gptop's own numeric flags.
- `config_layouts`: old layouts of a stored config (`MOVED` options), read as today's.
- `config_schema`: the sections (`Toggles`, ...), `TrainConfig` and the checks between options; what the
  event schema decodes toggles with, so it imports no input check, run directory or event.
- `config_files`: a config read from a TOML file (`--config`, best.toml, a run's config.toml), and the
  config a resumed run starts from.
- `config_args`: the command line: argparse options generated from the schema, parsed back, written out.

Code outside the contract imports these names from here; the contract's own modules import the module that
defines a name, so the contract's import graph stays one-way.
"""

from __future__ import annotations

from .common import MAX_STEP, ConfigError, flag_of, show
from .config_args import EXIT_USAGE, OneLineParser, add_arguments, cli_args, config_from_args, shown_default
from .config_files import config_from_toml, resume_config
from .config_layouts import MOVED, current_layout
from .config_options import Range, kind_of, number_arg, opt, optional, parse_number, range_of
from .config_schema import (
    ALLOCATORS,
    ATTENTIONS,
    AUTO,
    COMPILE_MODES,
    LORA_ATTENTION_TARGETS,
    LORA_DEFAULT_TARGETS,
    LORA_MLP_TARGETS,
    MAX_BATCH,
    MAX_LORA_RANK,
    MAX_SEED,
    MAX_SEQ_LEN,
    MAX_THREADS,
    NAN_POLICIES,
    OPTIMIZERS,
    PARALLEL,
    PRECISION_CHOICES,
    PRECISIONS,
    QUANTIZE_BASE,
    RESUME_MUST_MATCH,
    SECTIONS,
    SIZES,
    CheckpointConfig,
    DataConfig,
    FinetuneConfig,
    LogConfig,
    MicroBatch,
    ModelConfig,
    OptimConfig,
    RunConfig,
    Toggles,
    TrainConfig,
    check_resumable,
    device_format,
    parse_step_range,
    section_from_dict,
)

__all__ = [
    # trainer.contract.common
    "MAX_STEP",
    "ConfigError",
    "flag_of",
    "show",
    # config_schema
    "ALLOCATORS",
    "ATTENTIONS",
    "AUTO",
    "COMPILE_MODES",
    "LORA_ATTENTION_TARGETS",
    "LORA_DEFAULT_TARGETS",
    "LORA_MLP_TARGETS",
    "MAX_BATCH",
    "MAX_LORA_RANK",
    "MAX_SEED",
    "MAX_SEQ_LEN",
    "MAX_THREADS",
    "NAN_POLICIES",
    "OPTIMIZERS",
    "PARALLEL",
    "PRECISION_CHOICES",
    "PRECISIONS",
    "QUANTIZE_BASE",
    "RESUME_MUST_MATCH",
    "SECTIONS",
    "SIZES",
    "CheckpointConfig",
    "DataConfig",
    "FinetuneConfig",
    "LogConfig",
    "MicroBatch",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "Toggles",
    "TrainConfig",
    "check_resumable",
    "device_format",
    "parse_step_range",
    "section_from_dict",
    # config_options
    "Range",
    "kind_of",
    "number_arg",
    "opt",
    "optional",
    "parse_number",
    "range_of",
    # config_layouts
    "MOVED",
    "current_layout",
    # config_files
    "config_from_toml",
    "resume_config",
    # config_args
    "EXIT_USAGE",
    "OneLineParser",
    "add_arguments",
    "cli_args",
    "config_from_args",
    "shown_default",
]
