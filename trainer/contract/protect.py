"""What gptop may delete: the one rule every path it removes or replaces on a user's word goes through.

`gptop export RUN_DIR OUT_DIR --force` replaces OUT_DIR; any later `--force` goes through here too.
`--force` replaces an earlier export and nothing else. Refused, whatever the flags, naming what the
path is (`classify`):

- a run directory (config.toml, events.jsonl or a rank's, checkpoints/, a lock), live (its lock held)
  or finished;
- a directory that holds a run directory at any depth (a parent of runs);
- a run's checkpoints/ (or profiles/, tensorboard/, wandb/), or anything inside them;
- the current directory or one that holds it (replacing it would leave the shell in a deleted one);
- a file, and a non-empty directory that is not an export: an export is recognized by what export
  writes (its `gptop-export.json` lists every file it wrote; an older export by its files and the
  `gptop` provenance in config.json), so an export with a file added by hand is not replaced either.

Paths are resolved first (symlinks, `..`, `.`, a trailing slash), so a link to a run is the run.
The one other deletion is a refused run's own new directory (`remove_created`): a refusal creates nothing.
`replace_dir` checks again just before it swaps a finished temporary directory into place (a run may
have started in OUT_DIR while the export worked), and the old directory is removed only after the new
one is in place. Temporary directories carry their writer's host and pid (`make_temp_dir`), so the
next export into the same OUT_DIR removes what a killed one left (`remove_stale`), never a live one's.
"""

from __future__ import annotations

import enum
import json
import os
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .common import ConfigError
from .rundir import has_checkpoint, pid_alive, run_markers, run_part
from .runlock import holder_words, lock_holders

EXPORT_MARKER = "gptop-export.json"  # written by `gptop export`: what it wrote, so a later --force knows it
MARKER_VERSION = 1
MAX_EXPORT_ENTRIES = 10_000  # an export holds a dozen files; past this it is not one
SEARCH_DEPTH = 4  # how deep a refused directory is searched for a run (to name it)
SEARCH_ENTRIES = 5_000
# What `save_pretrained` (transformers, peft, tokenizers) writes: an export without a marker (an older gptop)
# is recognized by holding only these, with the `gptop` provenance in its config.json or a peft adapter.
_EXPORT_NAMES = re.compile(
    r"^(config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors|"
    r"model\.safetensors\.index\.json|tokenizer\.json|tokenizer_config\.json|"
    r"special_tokens_map\.json|chat_template\.jinja|added_tokens\.json|adapter_config\.json|"
    r"adapter_model\.safetensors|README\.md|base)$"
)


class Kind(enum.Enum):
    """What a path given to be replaced is."""

    MISSING = "missing"
    EMPTY = "empty"
    EXPORT = "export"  # replaceable with --force
    LIVE_RUN = "live run"
    RUN = "run"
    RUN_PART = "part of a run"
    HOLDS_RUN = "holds a run"
    CURRENT_DIR = "current directory"
    FILE = "file"
    OTHER = "other"


@dataclass(frozen=True)
class Finding:
    kind: Kind
    path: Path  # resolved
    what: str  # in words, for a refusal ("is the run directory of a live run (...)")
    run: Path | None = None  # the run whose part it is (RUN_PART)


def resolve(value: str | Path) -> Path:
    """The path a name leads to: `~`, symlinks, `.` and `..` resolved, as the kernel would."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(value))))


def _cwd() -> Path | None:
    try:
        return resolve(os.getcwd())
    except OSError:  # the working directory was deleted
        return None


def _run_words(path: Path) -> str:
    holders = lock_holders(path)
    if holders is not None:
        return f"the run directory of a live run ({'; '.join(holder_words(h) for h in holders)})"
    return f"a run directory ({', '.join(run_markers(path))})"


def classify(value: str | Path) -> Finding:
    """What `value` is, from the rule in the module docstring (looks only; changes nothing)."""
    p = resolve(value)
    cwd = _cwd()
    if cwd is not None and (p == cwd or p in cwd.parents):
        return Finding(
            Kind.CURRENT_DIR, p, "is the current directory" if p == cwd else f"holds the current directory {cwd}"
        )
    part = run_part(p)
    if part is not None:
        run, folder = part
        where = f"the {folder}/ of the run {run}"
        return Finding(Kind.RUN_PART, p, f"is {where}" if p == run / folder else f"lies inside {where}", run=run)
    if not os.path.lexists(p):
        return Finding(Kind.MISSING, p, "does not exist")
    if not p.is_dir():
        return Finding(Kind.FILE, p, "exists and is not a directory")
    if run_markers(p):
        kind = Kind.LIVE_RUN if lock_holders(p) is not None else Kind.RUN
        return Finding(kind, p, f"is {_run_words(p)}")
    try:
        entries = sorted(e.name for e in p.iterdir())
    except OSError as e:
        return Finding(Kind.OTHER, p, f"cannot be listed ({e.strerror or e})")
    if not entries:
        return Finding(Kind.EMPTY, p, "is empty")
    found = find_run(p)
    if found is not None:
        return Finding(Kind.HOLDS_RUN, p, f"holds {_run_words(found)} at {found}")
    extra = _not_written_by_export(p, entries)
    if extra is None:
        return Finding(Kind.EXPORT, p, "is an earlier export")
    return Finding(Kind.OTHER, p, extra)


def find_run(top: Path, depth: int = SEARCH_DEPTH, budget: int = SEARCH_ENTRIES) -> Path | None:
    """A run directory under `top` (not following symlinks), searched breadth first to `depth` levels and
    `budget` entries; None if none was found within them."""
    level = [top]
    for _ in range(depth):
        below = []
        for d in level:
            try:
                children = sorted(e for e in d.iterdir() if e.is_dir() and not e.is_symlink())
            except OSError:
                continue
            for c in children:
                if run_markers(c):
                    return c
                below.append(c)
                budget -= 1
                if budget <= 0:
                    return None
        level = below
    return None


def _walk(top: Path) -> list[str] | None:
    """Every file and directory under `top`, relative (None past MAX_EXPORT_ENTRIES: not an export)."""
    out: list[str] = []
    for root, dirs, files in os.walk(top):
        rel = Path(root).relative_to(top)
        for name in dirs + files:
            out.append((rel / name).as_posix())
        if len(out) > MAX_EXPORT_ENTRIES:
            return None
    return sorted(out)


def _not_written_by_export(p: Path, entries: list[str]) -> str | None:
    """None if `p` holds an export and nothing else; else why it is not one, in words."""
    listed = _marker_files(p)
    if listed is not None:
        found = _walk(p)
        if found is None:
            return f"holds more than {MAX_EXPORT_ENTRIES} entries: not an export"
        extra = [f for f in found if f not in listed and f != EXPORT_MARKER]
        if extra:
            return f"is an earlier export with files added that export did not write ({_names(extra)})"
        return None
    if all(_EXPORT_NAMES.match(e) for e in entries) and _legacy_export(p, entries):
        return None
    return f"is not empty and is not an export (it holds {_names(entries)})"


def _names(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _marker_files(p: Path) -> set[str] | None:
    """The files the export's marker lists (with the folders they are in), or None without a valid marker."""
    try:
        data = json.loads((p / EXPORT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("type") != "export" or not isinstance(data.get("files"), list):
        return None
    files = {f for f in data["files"] if isinstance(f, str)}
    return files | {parent.as_posix() for f in files for parent in Path(f).parents if parent != Path(".")}


def _legacy_export(p: Path, entries: list[str]) -> bool:
    """An export written before the marker: a model whose config.json has gptop's provenance, or a peft
    adapter (with the base it wrote, itself only model files)."""
    if "config.json" in entries:
        try:
            config = json.loads((p / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return isinstance(config, dict) and isinstance(config.get("gptop"), dict)
    if "adapter_config.json" not in entries:
        return False
    base = p / "base"
    if not base.exists():
        return True
    try:
        return (
            base.is_dir()
            and not base.is_symlink()
            and all(_EXPORT_NAMES.match(e.name) and e.is_file() for e in base.iterdir())
        )
    except OSError:
        return False


def check_replaceable(value: str | Path, option: str, *, force: bool) -> Path:
    """The resolved path, if an export may be written there: new, empty, or (with `force`) an earlier
    export. Anything else is a ConfigError naming `option` and what the path is, before anything is done."""
    f = classify(value)
    if f.kind in (Kind.MISSING, Kind.EMPTY):
        return f.path
    if f.kind is Kind.EXPORT:
        if force:
            return f.path
        raise ConfigError(
            option,
            f"{value} exists and is not empty (an earlier export); give a new directory, or add --force to replace it",
        )
    if f.kind is Kind.FILE:
        raise ConfigError(option, f"{value} exists and is not a directory; give a new directory")
    why = {
        Kind.LIVE_RUN: "--force never replaces a run",
        Kind.RUN: "--force never replaces a run",
        Kind.HOLDS_RUN: "--force never replaces a run",
        Kind.RUN_PART: "an export never goes there",
        Kind.CURRENT_DIR: "an export replaces OUT_DIR as a whole",
        Kind.OTHER: "--force replaces only a directory that `gptop export` wrote",
    }[f.kind]
    where = os.path.join(os.fspath(f.run), "export") if f.run is not None else os.path.join(os.fspath(value), "export")
    raise ConfigError(option, f"{value} {f.what}; {why}: give a new directory (e.g. {where})")


# --- temporaries and the swap ------------------------------------------------------------------------------


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())


def _temp_pattern(out: Path) -> re.Pattern[str]:
    return re.compile(rf"^\.{re.escape(out.name)}\.(export|replaced)-{re.escape(_host())}-(\d+)(-[a-z0-9_]+)?$")


def make_temp_dir(out: Path) -> Path:
    """A new hidden directory next to `out` to write into, named by this host and pid (see remove_stale)."""
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.export-{_host()}-{os.getpid()}-", dir=out.parent))


def remove_stale(out: Path) -> list[Path]:
    """Remove what an export into `out` that was killed left next to it: its temporary directory, or the
    previous export it had moved aside (put back when `out` itself is missing). Only this host's, and only
    of processes that are gone. Returns what was removed or put back."""
    pattern = _temp_pattern(out)
    done: list[Path] = []
    try:
        entries = sorted(out.parent.iterdir())
    except OSError:
        return done
    for e in entries:
        m = pattern.match(e.name)
        if m is None or pid_alive(int(m.group(2))) or e.is_symlink() or not e.is_dir() or run_markers(e):
            continue
        if m.group(1) == "replaced" and not os.path.lexists(out):
            os.rename(e, out)  # killed between its two renames: the previous export goes back
        else:
            shutil.rmtree(e, ignore_errors=True)
        done.append(e)
    return done


def replace_dir(tmp: Path, out: Path, option: str, *, force: bool) -> None:
    """Put the finished directory `tmp` in the place of `out`, checking `out` once more first; an earlier
    export there (with `force`) is moved aside and removed only once the new one is in place."""
    out = check_replaceable(out, option, force=force)
    if not os.path.lexists(out) or not any(out.iterdir()):
        os.replace(tmp, out)  # new, or an empty directory that the rename replaces
        return
    old = out.with_name(f".{out.name}.replaced-{_host()}-{os.getpid()}")
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_marker(directory: Path, **fields: object) -> None:
    """Record in `directory` every file an export wrote (walked now), so a later --force recognizes it."""
    files = [f for f in (_walk(directory) or []) if (directory / f).is_file() and f != EXPORT_MARKER]
    (directory / EXPORT_MARKER).write_text(
        json.dumps({"v": MARKER_VERSION, "type": "export", **fields, "files": files}, indent=1, default=str) + "\n"
    )


# --- a refused run leaves nothing ----------------------------------------------------------------------------


def dirs_to_create(path: str | Path) -> list[Path]:
    """`path` and each of its parents that does not exist yet, deepest first: what making `path` creates."""
    p = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    out = []
    while not os.path.lexists(p) and p != p.parent:
        out.append(p)
        p = p.parent
    return out


def remove_created(created: list[Path]) -> list[Path]:
    """Remove what a refused run made (`created` from `dirs_to_create` before it made them): its run directory,
    only while it holds no checkpoint, then each parent it made that is empty now. Returns what was removed."""
    done: list[Path] = []
    if not created:
        return done
    run = created[0]
    if os.path.lexists(run):
        if run.is_symlink() or not run.is_dir() or has_checkpoint(run):
            return done
        shutil.rmtree(run, ignore_errors=True)
        done.append(run)
    for d in created[1:]:
        try:
            d.rmdir()  # only if empty: another process may have put something there since
        except OSError:
            break
        done.append(d)
    return done
