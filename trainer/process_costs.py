"""A trainer process's fixed costs, paid at every start and every exit whatever the run: the imports of torch
and transformers, and the interpreter's teardown of what they made. Both grow with the number of Python objects
those imports create (millions), not with the run, so a short process (a tuner's trial, a resume, `gptop
sample`) spends much of its time on them.

Only a process's entry point pauses and exits this way (`python -m trainer` and the tools `python -m
trainer.export` and `.sample` both; `.doctor`, whose checks import torch one by one, the exit); a trainer built
inside another program (the tests, a notebook) leaves that program's garbage collector and exit alone.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys

_paused = False  # the cyclic GC is paused for this process's startup (pause_gc_for_startup)
_exit_code: int | None = None  # what the entry point returned, for the last exit handler

# The entry points whose startup pauses the collector: each resumes it once its heavy imports are done
# (trainer.startup before the model is built; trainer.model_loading before a tool loads its model).
PAUSING_ENTRY_POINTS = frozenset({"trainer", "trainer.export", "trainer.sample"})
_OPTIONS_WITH_A_VALUE = frozenset({"-X", "-W", "--check-hash-based-pycs"})


def started_as(modules: frozenset[str], argv: list[str] | None = None) -> bool:
    """Was this process started as `python [options] -m MODULE` for one of `modules`? Read from the command
    line as given (`sys.orig_argv`), so it is known when the package is imported, before the module runs; a
    spelling it does not follow (`-mtrainer`, combined flags) only means no pause."""
    argv = list(sys.orig_argv) if argv is None else argv
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return i + 1 < len(argv) and argv[i + 1] in modules
        if arg in _OPTIONS_WITH_A_VALUE:
            i += 2
            continue
        if not arg.startswith("-") or arg in ("-c", "-"):
            return False  # a script, a command or stdin: not a module of ours
        i += 1
    return False


def pause_gc_for_startup() -> None:
    """Pause the cyclic garbage collector until `resume_gc` (after the imports of torch and transformers: the
    trainer resumes before it builds its model, a tool before it loads one). The imports make objects that live
    as long as the process and little garbage, yet each collection their allocations trigger walks all of them
    again. Called when the package is imported, for the entry points in PAUSING_ENTRY_POINTS."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume_gc() -> None:
    """End the startup pause: what startup made is frozen (the loop's full collections no longer walk it; a
    frozen object is still freed when its last reference goes), then collection resumes. Only the garbage cycles
    made before this are never freed: the imports' small objects, a few megabytes once per process and no tensor
    (BENCHMARKS.md §17). The model, a checkpoint and compiling come after it. A no-op where the pause was not
    taken (a trainer inside another program)."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()


def exit_without_teardown() -> None:
    """Make this process end right after its exit handlers, skipping the interpreter's teardown (freeing
    every module's objects one by one), once `set_exit_code` has recorded what the entry point returned.

    Registered when the package is imported, before torch, so it runs last: after every other exit handler
    (multiprocessing's joins, logging's flush, temporary directories' removal) and after Python has joined the
    non-daemon threads. A process whose entry point recorded no code (a program that imports the trainer, an
    entry that ended by an exception) tears down as usual, its traceback and buffered output kept."""
    atexit.register(_end_now)


def set_exit_code(code: int) -> int:
    """What the entry point returns, recorded for the last exit handler; returned for `sys.exit`."""
    global _exit_code
    _exit_code = code
    return code


def _end_now() -> None:
    if _exit_code is None:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or full pipe: nothing more can be said on it
            pass
    os._exit(_exit_code)
