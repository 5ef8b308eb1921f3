"""The `gptop` command: `python -m gptop` and the console script both run `run`."""

import signal
import sys
from typing import NoReturn

from .cli import main

# Signals a session takes as "stop" (gptop.controls) and that gptop answers as stopped outside one too.
LATE_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _interrupted(signum: int, frame: object) -> None:
    """A stop signal while no session holds them (before one starts, or after it ended and gave them back: the
    second of two quick Ctrl-Cs): gptop exits as stopped, 128 + the signal, rather than by a KeyboardInterrupt
    or the signal's default action, either of which ends the process by the signal instead of its exit status."""
    raise SystemExit(128 + signum)


def run() -> NoReturn:
    """`gptop ARGS` to its exit status. Once `main` returned, a late stop signal is ignored: the process is ending
    with its status already decided, and Python's finalization puts the default action back on every signal it
    handled (a Ctrl-C then would end gptop by the signal, exit -2, in the last moments of its exit)."""
    previous = {s: signal.signal(s, _interrupted) for s in LATE_STOP_SIGNALS}
    try:
        code = main()
    except BaseException:
        for s, h in previous.items():
            signal.signal(s, h)
        raise
    for s in LATE_STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    run()
