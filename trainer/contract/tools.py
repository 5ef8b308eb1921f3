"""The one-shot tools on a run's model, `export` and `sample`: their arguments and results, torch-free.

`gptop export|sample` and `python -m trainer.export|sample` take the same arguments,
defined here once. gptop checks them here without torch (a bad RUN_DIR, a missing
--step, a non-empty OUT_DIR: exit 2 before any process starts) and runs the work in
a short-lived `python -m trainer.<tool>` process (`tool_command`), so gptop's own
process never imports torch. The dashboard can start `sample_command(...)` the same
way and read the one JSON line it prints with `--json` (`SampleResult`).

Both tools write progress lines to stderr and their result to stdout: text, or with
`--json` one JSON object on one line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from .common import ConfigError
from .config_options import number_arg
from .config_schema import MAX_SEED, MAX_SEQ_LEN, device_format
from .inputs import check_writable_dir, path_arg
from .common import MAX_STEP
from .protect import EXPORT_MARKER, check_replaceable
from .rundir import CONFIG, EVENTS, CheckpointInfo, is_run_dir, list_checkpoints
from .program_run import program_refusal, program_run
from .runlock import without_checkpoint

EXPORT_MODULE = "trainer.export"
SAMPLE_MODULE = "trainer.sample"
RESULT_VERSION = 1

# Defaults of `sample`: a short, reproducible sample that a tiny model on a CPU produces in seconds.
MAX_NEW_TOKENS = 64
TEMPERATURE = 0.8
SEED = 0
TIMEOUT_S = 120.0
# A temperature this small is greedy decoding: sampling from softmax(logits / T) is the argmax as T -> 0, and
# below this logits / T overflows float32 (3.4e38) for logits near 1e8, or T itself rounds to 0 (from 1e-46).
GREEDY_BELOW = 1e-30


# --- arguments ----------------------------------------------------------------------------------

STEP = number_arg(int, 0, MAX_STEP)


def add_export_arguments(parser: argparse.ArgumentParser, json_flag: bool = True) -> None:
    """RUN_DIR OUT_DIR [--step N] [--force] (and --json unless the caller has its own)."""
    parser.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        type=path_arg(_run_with_checkpoints, "RUN_DIR"),
        help="the run directory whose checkpoint to export",
    )
    parser.add_argument(
        "out_dir",
        metavar="OUT_DIR",
        type=path_arg(check_writable_dir, "OUT_DIR"),
        help="the Hugging Face model directory to write (new, or empty; --force replaces it)",
    )
    parser.add_argument(
        "--step",
        type=STEP,
        default=None,
        metavar="N",
        help="export the checkpoint of step N (default: the newest that loads)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace OUT_DIR if it is an earlier export (never a run, a run's checkpoints, a folder "
        "holding runs, the current directory or anything export did not write)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run (--lora): write the base with the adapters merged in, a plain model "
        "(default: the adapter alone, in peft's format)",
    )
    if json_flag:
        parser.add_argument("--json", action="store_true", help="print the result as one JSON line")


def add_sample_arguments(parser: argparse.ArgumentParser, json_flag: bool = True) -> None:
    """PATH [--prompt TEXT --max-new-tokens N --temperature T --seed S --step N --diffusion-steps N ...]."""
    parser.add_argument(
        "path",
        metavar="RUN_DIR",
        type=path_arg(_run_or_model_dir, "RUN_DIR"),
        help="a run directory (its newest checkpoint that loads, or --step N), or a model "
        "directory written by `gptop export`",
    )
    parser.add_argument(
        "--prompt", default="", metavar="TEXT", help="text to continue (default: empty, an unconditional sample)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=number_arg(int, 1, MAX_SEQ_LEN),
        default=MAX_NEW_TOKENS,
        metavar="N",
        help=f"tokens to generate (default: {MAX_NEW_TOKENS})",
    )
    parser.add_argument(
        "--temperature",
        type=number_arg(float, 0, 1e3),
        default=TEMPERATURE,
        metavar="T",
        help=f"sampling temperature; 0 (or below {GREEDY_BELOW:g}) is greedy (default: {TEMPERATURE})",
    )
    parser.add_argument(
        "--seed",
        type=number_arg(int, 0, MAX_SEED),
        default=SEED,
        metavar="S",
        help=f"random seed of the sampling (default: {SEED})",
    )
    parser.add_argument(
        "--step",
        type=STEP,
        default=None,
        metavar="N",
        help="sample from the checkpoint of step N (default: the newest that loads)",
    )
    parser.add_argument(
        "--diffusion-steps",
        type=number_arg(int, 1, MAX_SEQ_LEN),
        default=None,
        metavar="N",
        help="llada: reverse-process steps (default: --max-new-tokens, one token per step)",
    )
    parser.add_argument(
        "--timeout",
        type=number_arg(float, 0, 7 * 86400, low_open=True),
        default=TIMEOUT_S,
        metavar="S",
        help=f"stop after S seconds in all, keeping what was generated (default: {TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        metavar="DEV",
        help="torch device: cpu, cuda, cuda:N or auto (default: cpu, which leaves a training run's GPU memory alone)",
    )
    if json_flag:
        parser.add_argument("--json", action="store_true", help="print the result as one JSON line")


# --- checks (the same in gptop and in the tool's own process) -----------------------------------


def _run_with_checkpoints(value: str, option: str) -> None:
    checkpoints_to_try(value, None, option, doing="export")


def _run_or_model_dir(value: str, option: str) -> None:
    if not is_model_dir(value):
        checkpoints_to_try(value, None, option, doing="sample")


def is_model_dir(path: str | Path) -> bool:
    """A Hugging Face model directory (config.json) or a peft adapter (adapter_config.json), as `gptop export`
    writes them, rather than a run directory."""
    p = Path(path)
    return ((p / "config.json").is_file() or (p / ADAPTER_CONFIG).is_file()) and not is_run_dir(p)


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_BASE_DIR = "base"  # a built-in family's base, inside its adapter export


def adapter_base(path: str | Path) -> Path | None:
    """The base model directory of an adapter export (None for a plain model directory): the export's own
    `base/` (a copied or moved export keeps it), else the directory `base_model_name_or_path` names (a relative
    one against the export, never the working directory). The base must be the one the adapter was trained on:
    its fingerprint is checked against the one gptop-export.json recorded. ConfigError naming RUN_DIR when it
    is missing or another."""
    p = Path(path)
    if not (p / ADAPTER_CONFIG).is_file():
        return None
    try:
        ref = json.loads((p / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError("RUN_DIR", f"{p / ADAPTER_CONFIG} cannot be read ({e})") from None
    own = p / ADAPTER_BASE_DIR
    base = own if (own / "config.json").is_file() else (p / ref if isinstance(ref, str) and ref else None)
    if base is None or not (base / "config.json").is_file():
        raise ConfigError(
            "RUN_DIR",
            f"{p} is a LoRA adapter whose base ({ref!r}) is not there; put the model "
            "directory it was trained on there, or export the run again",
        )
    try:
        marker = json.loads((p / EXPORT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        marker = {}
    want = marker.get("base_fingerprint") if isinstance(marker, dict) else None
    if want and base_fingerprint(base) != want:
        raise ConfigError(
            "RUN_DIR",
            f"{p}: the base at {base} is not the one this adapter was trained on (its "
            "weights or config changed since the export); export the run again",
        )
    return base


def base_fingerprint(path: str | Path) -> str:
    """A fingerprint of a model directory's weights and config: each file's size and its first and last MiB
    (cheap for a large model, and changed by a re-export or a replacement of it)."""
    h = hashlib.sha256()
    for f in sorted(
        q
        for q in Path(path).iterdir()
        if q.is_file() and (q.suffix in (".safetensors", ".bin") or q.name == "config.json")
    ):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}\n".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(-(1 << 20), os.SEEK_END)
                h.update(fh.read())
    return h.hexdigest()[:32]


def checkpoints_to_try(
    run_dir: str | Path, step: int | None, option: str = "RUN_DIR", doing: str = "export"
) -> list[CheckpointInfo]:
    """The checkpoints to load, in order: the one of `step`, else all of them newest first.

    Raises ConfigError naming RUN_DIR (not a run, no checkpoint yet, a user's program's run, which gptop cannot
    `doing`) or --step (no such step)."""
    p = Path(run_dir)
    if not p.exists():
        raise ConfigError(option, f"{p} does not exist; give a run directory (runs/<time>-<model>-<size>)")
    if not p.is_dir():
        raise ConfigError(option, f"{p} is not a directory; give a run directory, not a checkpoint file")
    program = program_run(p)
    if program is not None:
        raise ConfigError(option, program_refusal(p, program, doing))
    found = list_checkpoints(p)
    if not found:
        if not is_run_dir(p):
            raise ConfigError(
                option,
                f"{p} is not a run directory (no {CONFIG}, {EVENTS} or checkpoints/); give "
                "a run directory (runs/<time>-<model>-<size>)",
            )
        raise ConfigError(option, f"{p} {without_checkpoint(p)}: there is no checkpoint to load")
    if step is None:
        return list(reversed(found))
    chosen = [c for c in found if c.step == step]
    if not chosen:
        raise ConfigError(
            "--step", f"{p} has no checkpoint of step {step}; it has steps {', '.join(str(c.step) for c in found)}"
        )
    return chosen


def check_export(ns: argparse.Namespace) -> list[CheckpointInfo]:
    """Every check `export` can make before loading anything; returns the checkpoints to try."""
    if ns.step is not None and ns.step < 0:
        raise ConfigError("--step", f"must be at least 0, got {ns.step}")
    candidates = checkpoints_to_try(ns.run_dir, ns.step, doing="export")
    check_replaceable(ns.out_dir, "OUT_DIR", force=ns.force)  # --force replaces an earlier export, nothing else
    return candidates


def check_sample(ns: argparse.Namespace) -> list[CheckpointInfo] | None:
    """Every check `sample` can make before loading anything; the checkpoints to try (None: a model dir)."""
    if ns.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", f"must be at least 1, got {ns.max_new_tokens}")
    if not (math.isfinite(ns.temperature) and ns.temperature >= 0):
        raise ConfigError("--temperature", f"must be 0 (greedy) or positive, got {ns.temperature}")
    check_text(ns.prompt, "--prompt")
    problem = device_format(ns.device)
    if problem:
        raise ConfigError("--device", problem)
    if ns.diffusion_steps is not None and not 1 <= ns.diffusion_steps <= ns.max_new_tokens:
        raise ConfigError(
            "--diffusion-steps",
            f"must be between 1 and --max-new-tokens ({ns.max_new_tokens}), got {ns.diffusion_steps}",
        )
    if not (math.isfinite(ns.timeout) and ns.timeout > 0):
        raise ConfigError("--timeout", f"must be a positive number of seconds, got {ns.timeout}")
    if ns.step is not None and ns.step < 0:
        raise ConfigError("--step", f"must be at least 0, got {ns.step}")
    if is_model_dir(ns.path):
        if ns.step is not None:
            raise ConfigError("--step", f"{ns.path} is an exported model, which has no checkpoints to choose from")
        adapter_base(ns.path)  # an adapter export's base is there, and is the one it was trained on
        return None
    return checkpoints_to_try(ns.path, ns.step, doing="sample")


def check_text(value: str, option: str) -> None:
    """Text from the command line must be UTF-8: Python keeps bytes that are not as lone surrogates
    (surrogateescape), which no tokenizer takes."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = value[e.start]
        what = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"character U+{ord(bad):04X}"
        raise ConfigError(
            option, f"is not valid UTF-8 text ({what} at character {e.start}); give text in UTF-8"
        ) from None


def sampling_temperature(temperature: float) -> float:
    """The temperature sampling uses: 0 (greedy) below GREEDY_BELOW."""
    return 0.0 if temperature < GREEDY_BELOW else float(temperature)


# --- command lines ------------------------------------------------------------------------------


def tool_command(module: str, argv: list[str]) -> list[str]:
    """The process that runs a tool: the same interpreter as the caller (its packages, its venv)."""
    return [sys.executable, "-m", module, *argv]


def export_argv(ns: argparse.Namespace) -> list[str]:
    """`ns` (parsed by `add_export_arguments`) as the arguments of `python -m trainer.export`."""
    argv = [os.fspath(ns.run_dir), os.fspath(ns.out_dir)]
    if ns.step is not None:
        argv += ["--step", str(ns.step)]
    if ns.force:
        argv.append("--force")
    if getattr(ns, "merge", False):
        argv.append("--merge")
    if getattr(ns, "json", False):
        argv.append("--json")
    return argv


def sample_argv(ns: argparse.Namespace) -> list[str]:
    """`ns` (parsed by `add_sample_arguments`) as the arguments of `python -m trainer.sample`."""
    argv = [
        os.fspath(ns.path),
        "--prompt",
        ns.prompt,
        "--max-new-tokens",
        str(ns.max_new_tokens),
        "--temperature",
        repr(float(ns.temperature)),
        "--seed",
        str(ns.seed),
        "--timeout",
        repr(float(ns.timeout)),
        "--device",
        ns.device,
    ]
    if ns.step is not None:
        argv += ["--step", str(ns.step)]
    if ns.diffusion_steps is not None:
        argv += ["--diffusion-steps", str(ns.diffusion_steps)]
    if getattr(ns, "json", False):
        argv.append("--json")
    return argv


def sample_command(
    path: str | Path,
    prompt: str = "",
    *,
    max_new_tokens: int = MAX_NEW_TOKENS,
    temperature: float = TEMPERATURE,
    seed: int = SEED,
    step: int | None = None,
    timeout: float = TIMEOUT_S,
    device: str = "cpu",
) -> list[str]:
    """The command line of one sample as a JSON line (for a view that runs it in the background)."""
    ns = argparse.Namespace(
        path=path,
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        step=step,
        diffusion_steps=None,
        timeout=timeout,
        device=device,
        json=True,
    )
    check_sample(ns)
    return tool_command(SAMPLE_MODULE, sample_argv(ns))


# --- results ------------------------------------------------------------------------------------


@dataclass
class SampleResult:
    """What `sample --json` prints: one JSON object on one line."""

    source: str  # the checkpoint (or model directory) sampled
    step: int | None  # its training step (None for a model directory)
    family: str  # llama | deepseek | llada | pretrained
    objective: str  # causal | llada
    prompt: str
    completion: str  # the generated text only
    new_tokens: int
    stopped: str  # "max_new_tokens" | "eos" | "timeout"
    temperature: float
    seed: int
    seconds: float  # generation time (after loading)
    load_seconds: float  # process start to model ready
    diffusion_steps: int | None = None  # llada's reverse-process steps
    v: int = RESULT_VERSION
    type: str = "sample"

    @property
    def text(self) -> str:
        return self.prompt + self.completion

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> "SampleResult":
        """Parse a `sample --json` line; unknown fields are ignored (a newer writer may add some)."""
        d = json.loads(line)
        if not isinstance(d, dict) or d.get("type") != "sample":
            raise ValueError(f"not a sample result: {line[:200]!r}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def result_line(kind: str, **fields_: Any) -> str:
    """Any other tool's `--json` result (export): one versioned JSON object."""
    return json.dumps({"v": RESULT_VERSION, "type": kind, **fields_}, ensure_ascii=False, default=str)
