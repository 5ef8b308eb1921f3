import signal
import sys

from .cli import main


def _interrupted(signum: int, frame: object) -> None:
    """A stop signal while no session holds them (before one starts, or after it ended and gave them back: the
    second of two quick Ctrl-Cs): gptop exits as stopped, 128 + the signal, rather than by a KeyboardInterrupt
    that ends the process by the signal itself instead of its exit status."""
    raise SystemExit(128 + signum)


signal.signal(signal.SIGINT, _interrupted)
sys.exit(main())
