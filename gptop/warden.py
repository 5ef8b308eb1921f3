"""The warden of a `gptop run` command: nothing of the command outlives gptop, `kill -9` of gptop included.

gptop's own trainer stops by itself when gptop dies (its channel reaches end of file); an arbitrary command
does not listen to gptop. So beside the command (started in a process group of its own) gptop starts this
small process, `python -m gptop.warden FD PID GRACE`, holding the read end of a pipe whose write end only
gptop holds. However gptop ends, the kernel closes that end; the warden then does what gptop's stop would
have done: SIGTERM to the command's main process (a client in it, gptop.integrations, takes it as a graceful
stop and checkpoints; so does the end of its channel), and once that process is gone, or after GRACE
seconds, SIGKILL to the command's whole process group. When the command ends while gptop lives, gptop
writes into the pipe and the warden leaves. It imports nothing but the standard library.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

from trainer.contract.rundir import pid_alive

POLL_S = 5.0  # how often the warden looks whether the command is still there, while gptop lives


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_for_gptop(fd: int, pid: int) -> bool:
    """Block until gptop says the command ended (False) or gptop is gone (True: end of file)."""
    while True:
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if ready:
            return os.read(fd, 64) == b""
        if not pid_alive(pid) and not group_alive(pid):
            return False


def end_command(pid: int, grace_s: float) -> None:
    """gptop is gone: stop the command gracefully, then make sure nothing of its group is left."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str]) -> int:
    fd, pid, grace_s = int(argv[0]), int(argv[1]), float(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is gptop's to handle
    if wait_for_gptop(fd, pid):
        end_command(pid, grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
