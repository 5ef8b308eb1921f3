"""Inductor's on-disk cache: the one module that reaches into where torch.compile keeps its artefacts.

Why a retry, and why not a private cache for every run (torch 2.13, torch/_inductor/codecache.py and
cpp_builder.py): inductor writes its Python artefacts atomically (`write_atomic`) and builds each C++ library
under a per-key file lock, skipping the build when the output exists. Two live processes sharing the cache
therefore never see each other's half-written files. What does leave one is a process killed while its
compiler writes the `.so` in place (gptop kills a trial that fails or does not stop within its grace while
compiling): the next process, in this run or another, finds the file, trusts it, and fails to load it
(`ImportError: ...main.so: invalid ELF header`). A private cache per run would avoid that at the price of a
cold compile in every run; instead the shared cache stays (the default, per user:
`$TORCHINDUCTOR_CACHE_DIR` or `/tmp/torchinductor_<user>`), and a process that fails to load an artefact
(`artefact_failure`) removes it if it is not a loadable library (nobody writes over an existing file, so the
removal races with no writer; the next build makes it again) and compiles again once in the run's own cache
(`OwnCache.recover`). A second failure is the setting's: the trainer reports a compile error.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ENV = "TORCHINDUCTOR_CACHE_DIR"
TRITON_ENV = "TRITON_CACHE_DIR"
# the loader's words for a library file that is not one (truncated, half-written, zeroed)
_LOAD = re.compile(
    r"(/\S+?\.so)\S*:\s*(invalid ELF header|file too short|ELF load command[^\n]*|"
    r"cannot read file data[^\n]*|unexpected reloc type[^\n]*|ELF file[^\n]*)"
)
_ELF = b"\x7fELF"


@dataclass(frozen=True)
class Artefact:
    """A compiled artefact that failed to load: its path and the loader's words."""

    path: Path
    reason: str


def artefact_failure(exc: BaseException) -> Artefact | None:
    """The artefact behind `exc` when it is a library of the compile cache that does not load (anywhere in its
    chain of causes: inductor wraps the ImportError/OSError), else None: a failure of the setting itself."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (ImportError, OSError)):
            m = _LOAD.search(str(e))
            if m:
                return Artefact(Path(m.group(1)), m.group(2))
        m = _LOAD.search(str(e)) if type(e).__name__ == "InductorError" else None
        if m:
            return Artefact(Path(m.group(1)), m.group(2))
        e = e.__cause__ or e.__context__
    return None


def is_library(path: Path) -> bool:
    """Whether `path` starts as an ELF file does (a half-written one usually does not)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == _ELF and os.path.getsize(path) > 64
    except OSError:
        return False


def _clear_in_memory() -> None:
    """Forget what this process compiled and loaded, so the next call compiles again in the new cache."""
    import torch
    from torch._inductor.utils import clear_caches

    clear_caches()  # inductor's in-memory code caches (what `fresh_cache` clears)
    torch.compiler.reset()  # dynamo's compiled frames


class OwnCache:
    """Once per process: after an artefact failure, go on in `own_dir` (the run's own cache)."""

    def __init__(self, own_dir: Path, clear: Callable[[], None] = _clear_in_memory):
        self.own_dir = Path(own_dir)
        self.clear = clear
        self.used = False

    def recover(self, exc: BaseException) -> Artefact | None:
        """If `exc` is an artefact failure and this process still uses the shared cache: remove the artefact when
        it is not a library, switch to the run's own cache and clear what was compiled in memory; returns the
        artefact (the caller retries once). None: not a failure to retry (the caller re-raises)."""
        art = artefact_failure(exc)
        if art is None or self.used:
            return None
        shared = os.environ.get(ENV)
        if shared and Path(shared) in art.path.parents and art.path.exists() and not is_library(art.path):
            try:
                art.path.unlink()
            except OSError:
                pass
        self.own_dir.mkdir(parents=True, exist_ok=True)
        os.environ[ENV] = str(self.own_dir)
        os.environ[TRITON_ENV] = str(self.own_dir / "triton")
        self.clear()
        self.used = True
        return art
