"""Every path a user gives, checked once where it enters, before a process is started or a directory created.

`gptop` and `python -m trainer` both call these (through `config_from_args` for
the config's path options, directly for gptop's own: `--storage`, `gptop report
RUN_DIR`, the monitor's `--run-dir`), so a bad path is one clear line and exit 2
naming the option and the reason, never a traceback from deep inside a trainer
that has already made a run directory. The checks are the failure kinds a path
can have: missing; a directory where a file is expected or the reverse;
unreadable; not UTF-8 where text is expected; not what it claims to be (a
`--config` that is not TOML, a `--tokenizer` directory without tokenizer files,
a `--model` directory without config.json, a `--resume` directory with nothing
to resume, a `--data` file of an unknown type); and a directory to be created
on a read-only filesystem or under a parent that is not writable.

A config option says which check it gets in its metadata (`opt(..., path="data")`),
so `check_config_paths` covers every path option of the config. Every filesystem
question goes through the few boundary functions below (`read_head`, `list_dir`,
`writable`), which tests replace: the tests run as root, and root reads and
writes past permission bits.
"""

from __future__ import annotations

import codecs
import json
import os
import stat
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .common import FAMILIES, ConfigError, flag_of, show

if TYPE_CHECKING:
    from .config_schema import TrainConfig

DATA_EXTENSIONS = (".txt", ".jsonl", ".parquet")
DATA_KINDS = ".txt, .jsonl (one {\"text\": ...} object per line) or .parquet (a 'text' column)"
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
        "vocab.txt",
        "added_tokens.json",
        "tokenizer.model",
        "spiece.model",
        "sentencepiece.bpe.model",
        "chat_template.jinja",
    }
)
MODEL_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")  # how configs name their length
MAX_HEAD_FILES = 64  # data files of a folder looked into at the start
HEAD_BYTES = 64 << 10  # how much of a data file is checked to be what it claims (not all of a 10 GB file)
MAX_TEXT_FILE = 64 << 20  # a config or tokenizer file larger than this is not one
_SQLITE_MAGIC = b"SQLite format 3\x00"
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format
_PARQUET_MAGIC = b"PAR1"


# --- the boundary: every filesystem question goes through these ---------------------------------------------


def read_head(path: Path, n: int) -> bytes:
    """The first `n` bytes of a file (OSError if it cannot be read)."""
    with open(path, "rb") as f:
        return f.read(n)


def list_dir(path: Path) -> list[Path]:
    """The entries of a directory (OSError if it cannot be listed)."""
    return sorted(Path(path).iterdir())


def writable(path: Path) -> str | None:
    """None if this process may create and change entries in the directory (or file) `path`, else why not."""
    mode = os.W_OK | (os.X_OK if Path(path).is_dir() else 0)
    if os.access(path, mode):
        return None
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "on a read-only file system"
    except OSError:
        pass
    return "not writable (permission denied)"


# --- helpers -----------------------------------------------------------------------------------------------


def _reason(e: OSError) -> str:
    return os.strerror(e.errno) if e.errno else str(e)


def _path(value: str | Path) -> Path:
    return Path(value).expanduser()


def kind_of_path(p: Path, option: str) -> str:
    """ "missing", "dir", "file" (regular) or "other" (a device, a FIFO, a socket); ConfigError naming `option`
    for a path the system refuses to look at (too long, a NUL byte, a loop of links, no permission)."""
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        return "missing"
    except NotADirectoryError:
        return "missing"
    except (OSError, ValueError) as e:
        why = _reason(e) if isinstance(e, OSError) else str(e)
        raise ConfigError(option, f"{show(str(p))} cannot be used ({why})") from None
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def _existing(value: str | Path, option: str, what: str) -> Path:
    p = _path(value)
    if kind_of_path(p, option) == "missing":
        if p.is_symlink():
            raise ConfigError(option, f"{p} is a broken symbolic link; give {what}")
        raise ConfigError(option, f"{p} does not exist; give {what}")
    return p


def _regular_file(p: Path, option: str, what: str) -> None:
    kind = kind_of_path(p, option)
    if kind == "dir":
        raise ConfigError(option, f"{p} is a directory, not {what}")
    if kind != "file":
        raise ConfigError(option, f"{p} is not a regular file; give {what}")


def _head(p: Path, option: str, n: int = HEAD_BYTES) -> bytes:
    try:
        return read_head(p, n)
    except OSError as e:
        raise ConfigError(option, f"{p} cannot be read ({_reason(e)})") from None


def _listing(p: Path, option: str) -> list[Path]:
    try:
        return list_dir(p)
    except OSError as e:
        raise ConfigError(option, f"{p} cannot be read ({_reason(e)})") from None


def _utf8_problem(data: bytes, complete: bool) -> str | None:
    """Why `data` is not UTF-8 text, or None; a head cut inside a character is still text."""
    if b"\x00" in data:
        return "is binary (or UTF-16), not UTF-8 text: it holds NUL bytes"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=complete)
    except UnicodeDecodeError as e:
        return f"is not UTF-8 text (invalid byte 0x{data[e.start]:02x} at offset {e.start})"
    return None


def read_text(value: str | Path, option: str, what: str = "a text file") -> str:
    """The whole text of a small UTF-8 file; ConfigError naming `option` for every way it can fail."""
    p = _existing(value, option, what)
    _regular_file(p, option, what)
    data = _head(p, option, MAX_TEXT_FILE + 1)
    if len(data) > MAX_TEXT_FILE:
        raise ConfigError(option, f"{p} is larger than {MAX_TEXT_FILE >> 20} MiB; it is not {what}")
    problem = _utf8_problem(data, complete=True)
    if problem:
        raise ConfigError(option, f"{p} {problem}; give {what}")
    return data.decode("utf-8")


def read_toml(value: str | Path, option: str = "--config") -> dict[str, Any]:
    """A TOML file's tables (`--config`, best.toml, a run's config.toml)."""
    text = read_text(value, option, "a TOML file")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(option, f"{_path(value)} is not valid TOML: {e}") from None


def _json_object(p: Path, option: str, what: str) -> dict[str, Any]:
    text = read_text(p, option, what)
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ConfigError(option, f"{p} is not valid JSON ({e}); it is not {what}") from None
    if not isinstance(obj, dict):
        raise ConfigError(option, f"{p} holds a JSON {type(obj).__name__}, not an object; it is not {what}")
    return obj


# --- directories to create or write into ---------------------------------------------------------------------


def check_writable_dir(value: str | Path, option: str) -> Path:
    """A directory this run will write into: an existing writable directory, or one that can be created (its
    nearest existing ancestor is a writable directory). Nothing is created here."""
    p = _path(value)
    kind = kind_of_path(p, option)
    if kind != "missing":
        if kind != "dir":
            raise ConfigError(option, f"{p} is a file, not a directory")
        why = writable(p)
        if why:
            raise ConfigError(option, f"{p} is {why}")
        return p
    ancestor = p.absolute().parent
    while kind_of_path(ancestor, option) == "missing" and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if kind_of_path(ancestor, option) != "dir":
        raise ConfigError(option, f"{p} cannot be created: {ancestor} is a file, not a directory")
    why = writable(ancestor)
    if why:
        raise ConfigError(option, f"{p} cannot be created: {ancestor} is {why}")
    return p


def _writable_file(p: Path, option: str, what: str) -> None:
    """A file that will be written (an existing one, or one to create): its directory must take new files."""
    if kind_of_path(p, option) != "missing":
        _regular_file(p, option, what)
        why = writable(p)
        if why:
            raise ConfigError(option, f"{p} is {why}")
        parent = p.absolute().parent
        why = writable(parent)
        if why:
            raise ConfigError(option, f"{p}: its directory {parent} is {why} (the database writes files beside it)")
        return
    check_writable_dir(p.absolute().parent, option)


# --- the config's path options ---------------------------------------------------------------------------------


def data_files(spec: str, option: str = "--data") -> list[Path]:
    """The text files of `--data PATH` (a file, or every data file under a folder, hidden ones left out), in a
    fixed order. The one place that says which files are data."""
    p = _existing(spec, option, f"a {DATA_KINDS} file, a folder of them, or 'builtin'")
    if kind_of_path(p, option) == "dir":
        try:
            files = sorted(
                (
                    f
                    for f in p.rglob("*")
                    if f.suffix.lower() in DATA_EXTENSIONS
                    and f.is_file()
                    and not any(part.startswith(".") for part in f.relative_to(p).parts)
                ),
                key=lambda f: f.relative_to(p).as_posix(),
            )
        except OSError as e:
            raise ConfigError(option, f"{p} cannot be read ({_reason(e)})") from None
        if not files:
            raise ConfigError(
                option,
                f"{p} holds no {', '.join(DATA_EXTENSIONS)} files (searched recursively); put {DATA_KINDS} files there",
            )
        return files
    if p.suffix.lower() not in DATA_EXTENSIONS:
        raise ConfigError(option, f"{p}: unsupported file type {p.suffix or '(no extension)'!r}; use {DATA_KINDS}")
    _regular_file(p, option, f"a {DATA_KINDS} file")
    return [p]


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def check_data(spec: str, option: str = "--data") -> list[Path]:
    """`--data`: 'builtin', or files that are readable and look like what their extension says (the first
    64 KiB: UTF-8 text, a JSON object with "text" on the first line of a .jsonl, parquet's magic bytes).
    In a folder of many files the first MAX_HEAD_FILES are looked into, so a start never reads gigabytes;
    files further on are read as the trainer reads every file (a bad JSON line or parquet file is an error
    naming it, stray invalid UTF-8 bytes are replaced)."""
    if spec == "builtin":
        return []
    files = data_files(spec, option)
    if not any(_size(f) for f in files):
        raise ConfigError(
            option,
            f"{_path(spec)} is empty: no text to train on"
            if len(files) == 1
            else f"{_path(spec)}: every data file in it is empty; no text to train on",
        )
    for f in files[:MAX_HEAD_FILES]:
        head = _head(f, option)
        kind = f.suffix.lower()
        if kind == ".parquet":
            if not head.startswith(_PARQUET_MAGIC):
                raise ConfigError(option, f"{f} is not a parquet file (no PAR1 header)")
            continue
        problem = _utf8_problem(head, complete=len(head) < HEAD_BYTES)
        if problem:
            raise ConfigError(option, f"{f} {problem}; {kind} data must be UTF-8")
        if kind == ".jsonl":
            _check_first_jsonl_line(f, head, option)
    return files


def _check_first_jsonl_line(f: Path, head: bytes, option: str) -> None:
    lines = head.split(b"\n")
    complete = lines[:-1] if len(head) >= HEAD_BYTES else lines
    first = next((line for line in complete if line.strip()), None)
    if first is None:
        return
    try:
        obj = json.loads(first)
    except ValueError as e:
        raise ConfigError(
            option,
            f'{f}: the first line is not valid JSON ({e}); each line must be a JSON object like {{"text": "..."}}',
        ) from None
    if not isinstance(obj, dict) or "text" not in obj:
        raise ConfigError(
            option, f'{f}: the first line has no "text" field; each line must be a JSON object like {{"text": "..."}}'
        )


def check_tokenizer(value: str, option: str = "--tokenizer") -> Path:
    """`--tokenizer`: a tokenizer.json, or a directory holding tokenizer files (nothing is downloaded)."""
    what = "a local Hugging Face tokenizer directory (with tokenizer.json); nothing is downloaded"
    p = _existing(value, option, what)
    if kind_of_path(p, option) != "dir":
        _regular_file(p, option, what)
        tok = _json_object(p, option, "a tokenizer.json")
        if "model" not in tok:
            raise ConfigError(option, f'{p} is JSON but not a tokenizers file (no "model"); give {what}')
        return p
    names = {e.name for e in _listing(p, option)}
    if not names & TOKENIZER_FILES and not any(n.endswith(".tiktoken") for n in names):
        raise ConfigError(
            option,
            f"{p} holds no tokenizer files (tokenizer.json, tokenizer_config.json, vocab.json, "
            "tokenizer.model, ...); give a directory saved with save_pretrained()",
        )
    if "tokenizer.json" in names:
        check_tokenizer(str(p / "tokenizer.json"), option)
    for name in sorted(names & {"tokenizer_config.json", "special_tokens_map.json"}):
        _json_object(p / name, option, f"a {name}")
    return p


def is_model_path(model: str) -> bool:
    """Whether `--model` names a directory rather than a family: a family name wins over a directory of the same
    name in the working directory (write ./llama for the directory)."""
    return not (model in FAMILIES and "/" not in model)


def check_model(model: str, option: str = "--model") -> dict[str, Any] | None:
    """`--model`: a family, or a local Hugging Face model directory (config.json and weights). Returns the
    directory's config.json, None for a family."""
    if not is_model_path(model):
        return None
    what = (
        f"a model family ({', '.join(FAMILIES)}) or a local Hugging Face model directory with config.json; "
        "nothing is downloaded"
    )
    p = _path(model)
    kind = kind_of_path(p, option)
    if kind == "missing":
        raise ConfigError(
            option,
            f"{show(model)} is neither a model family ({', '.join(FAMILIES)}) nor an "
            "existing directory (a local Hugging Face model; nothing is downloaded)",
        )
    if kind != "dir":
        raise ConfigError(option, f"{p} is a file; give the model directory (with config.json)")
    names = {e.name for e in _listing(p, option)}
    if "config.json" not in names:
        raise ConfigError(option, f"{p} has no config.json: not a Hugging Face model directory; give {what}")
    config = _json_object(p / "config.json", option, "a model config.json")
    if not isinstance(config.get("model_type"), str):
        raise ConfigError(
            option,
            f'{p / "config.json"} is not a transformers model config (no "model_type"); '
            "give a directory saved with save_pretrained()",
        )
    if not names & set(MODEL_WEIGHTS) and not any(n.endswith(".safetensors") for n in names):
        raise ConfigError(
            option,
            f"{p} has no weights ({', '.join(MODEL_WEIGHTS[::2])}); a model saved with save_pretrained() has them",
        )
    return config


def check_resume(value: str, option: str = "--resume") -> Path:
    """`--resume`: a checkpoint file, a sharded checkpoint directory, or a run directory with a checkpoint."""
    from . import rundir
    from .runlock import without_checkpoint

    what = "a run directory or one of its checkpoints/step-NNNNNNNN.pt files"
    p = _existing(value, option, what)
    if kind_of_path(p, option) == "dir":
        if rundir.is_sharded(p):
            _listing(p, option)
            return p
        _listing(p, option)
        try:
            found = rundir.list_checkpoints(p)
        except OSError as e:
            raise ConfigError(option, f"{rundir.checkpoint_dir(p)} cannot be read ({_reason(e)})") from None
        if found:
            return p
        from .program_run import program_refusal, program_run

        program = program_run(p)
        if program is not None:
            raise ConfigError(option, program_refusal(p, program, "resume"))
        if rundir.is_run_dir(p):
            again = f"--config {rundir.RunDir(p).config} " if rundir.RunDir(p).config.is_file() else ""
            raise ConfigError(
                option, f"nothing to resume: {p} {without_checkpoint(p)}; start it again with {again}--run-dir NEW_DIR"
            )
        raise ConfigError(
            option,
            f"nothing to resume: {p} is not a run directory (no checkpoints, no "
            f"{rundir.CONFIG}, no {rundir.EVENTS}); give {what}",
        )
    _regular_file(p, option, what)
    if not _head(p, option, len(_ZIP_MAGIC)).startswith(_ZIP_MAGIC):
        raise ConfigError(option, f"{p} is not a checkpoint (not a torch.save file); give {what}")
    return p


def check_run_dir(value: str | None, option: str = "--run-dir") -> Path:
    """`--run-dir`: where the run writes (None: the default under ./runs)."""
    return check_writable_dir(value if value is not None else "runs", option)


# --- gptop's own inputs -----------------------------------------------------------------------------------------


def check_run_to_read(value: str | Path, option: str) -> Path:
    """A finished or running run to read (`gptop report RUN_DIR`): a directory with a readable events.jsonl."""
    from . import rundir

    p = _existing(value, option, "a run directory (with events.jsonl)")
    if kind_of_path(p, option) != "dir":
        raise ConfigError(option, f"{p} is a file, not a run directory")
    events = rundir.RunDir(p).events()
    if kind_of_path(events, option) == "missing":
        raise ConfigError(option, f"{p} has no {rundir.EVENTS}; is it a gptop run directory?")
    _regular_file(events, option, "a run's event file")
    _head(events, option, 1)
    return p


def check_file_to_write(value: str | Path, option: str) -> Path:
    """A file gptop writes (`gptop doctor --log FILE`): a regular file it may write over, or a new one in a
    directory that exists or can be created and takes files. Nothing is created here."""
    p = _path(value)
    if kind_of_path(p, option) == "missing":
        check_writable_dir(p.absolute().parent, option)
        return p
    _regular_file(p, option, "a file to write")
    why = writable(p)
    if why:
        raise ConfigError(option, f"{p} is {why}")
    return p


def check_runs_folder(value: str | Path, option: str) -> Path:
    """The monitor's `--run-dir`: a run directory, or a folder holding runs."""
    from . import rundir

    p = _existing(value, option, "a run directory or a folder of runs")
    if kind_of_path(p, option) != "dir":
        raise ConfigError(option, f"{p} is a file, not a run directory or a folder of runs")
    if kind_of_path(rundir.RunDir(p).events(), option) != "missing":
        return check_run_to_read(p, option)
    if not any(rundir.RunDir(e).events().is_file() for e in _listing(p, option) if e.is_dir()):
        raise ConfigError(option, f"{p} holds no run (no {rundir.EVENTS} in it or in a folder inside it)")
    return p


def check_storage(url: str | None, option: str = "--storage") -> None:
    """`--storage`: an Optuna storage URL (a file for sqlite:/// and journal: must be usable; a server URL is
    checked when tuning connects to it). None is the default SQLite file."""
    if url is None:
        return
    if url.startswith("journal:"):
        path = url[len("journal:") :]
        if not path:
            raise ConfigError(option, f"{url!r}: journal:PATH needs a file path")
        p = _path(path)
        _writable_file(p, option, "an Optuna journal file")
        if kind_of_path(p, option) == "file":
            head = _head(p, option)
            first = head.split(b"\n", 1)[0]
            if first.strip():
                try:
                    json.loads(first)
                except ValueError:
                    raise ConfigError(
                        option, f"{p} is not an Optuna journal file (its first line is not JSON)"
                    ) from None
        return
    if url.startswith("sqlite:"):
        if not url.startswith("sqlite:///"):
            if url == "sqlite://":
                return  # in memory
            raise ConfigError(option, f"{url!r}: write sqlite:///RELATIVE/PATH or sqlite:////ABSOLUTE/PATH")
        path = url[len("sqlite:///") :].split("?", 1)[0]
        if path in ("", ":memory:"):
            return
        p = _path(path)
        _writable_file(p, option, "an SQLite database")
        if kind_of_path(p, option) == "file":
            head = _head(p, option, len(_SQLITE_MAGIC))
            if head and not head.startswith(_SQLITE_MAGIC):
                raise ConfigError(option, f"{p} is not an SQLite database")
        return
    scheme, sep, rest = url.partition("://")
    if sep and scheme and rest and all(c.isalnum() or c in "+-." for c in scheme):
        return
    raise ConfigError(
        option,
        f"{show(url)} is neither an Optuna storage URL (sqlite:///FILE, postgresql://..., "
        "mysql://...) nor journal:PATH",
    )


def path_arg(check: Callable[[str, str], Any], option: str = "") -> Callable[[str], str]:
    """An argparse `type=` running an input check on an argument of gptop's own (a path: `--storage`, `RUN_DIR`;
    a URL or a command: `--notify`, `--notify-cmd`), so it gets the same checks as the config's, at parse
    time; the value stays the text."""
    import argparse

    def convert(text: str) -> str:
        try:
            check(text, option)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(e.message) from None
        return text

    convert.__name__ = "path"
    convert.check = check  # type: ignore[attr-defined]  # the input tests find path flags by it
    return convert


# --- every path option of a config -------------------------------------------------------------------------------


def _check_model_option(value: str, option: str, cfg: "TrainConfig") -> None:
    config = check_model(value, option)
    if config is None:
        return
    positions = next((config[k] for k in POSITION_KEYS if k in config), None)
    if isinstance(positions, int) and not isinstance(positions, bool) and cfg.data.seq_len > positions:
        raise ConfigError(
            "--seq-len",
            f"{cfg.data.seq_len} is more than the {positions} positions of --model "
            f"{value} ({next(k for k in POSITION_KEYS if k in config)} in its config.json)",
        )
    if cfg.data.tokenizer is None:
        try:
            check_tokenizer(value, option)
        except ConfigError as e:
            raise ConfigError(
                option, f"{e.message} (a model directory is also its tokenizer unless --tokenizer DIR is given)"
            ) from None


PATH_CHECKS: dict[str, Callable[[Any, str, "TrainConfig"], Any]] = {
    "data": lambda v, o, cfg: check_data(v, o),
    "tokenizer": lambda v, o, cfg: check_tokenizer(v, o),
    "model": _check_model_option,
    "resume": lambda v, o, cfg: check_resume(v, o),
    "run_dir": lambda v, o, cfg: check_run_dir(v, o),
}
NONE_CHECKED = frozenset({"run_dir"})  # options whose default (None) names a path too


def check_config_paths(cfg: "TrainConfig") -> None:
    """Check every path option of `cfg` (the fields whose metadata names a check)."""
    for _, f, value in cfg.items():
        name = f.metadata.get("path")
        if name is None or (value is None and name not in NONE_CHECKED):
            continue
        if name not in PATH_CHECKS:
            raise KeyError(f"{f.name}: no input check named {name!r}")
        PATH_CHECKS[name](value, flag_of(f), cfg)
