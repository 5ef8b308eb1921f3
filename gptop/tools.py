"""`gptop export` and `gptop sample`: checked here without torch, run in a `python -m trainer.<tool>` process.

The tool's progress lines (stderr) and result (stdout) pass straight through. gptop
forwards a stop (SIGTERM, SIGHUP) to the tool, waits for it, and ends a tool that
overruns its time limit, so no tool outlives the command; the tool itself also dies
with its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

from trainer.contract import tools

EXIT_FAILED, EXIT_INTERRUPTED = 1, 130
GRACE_S = 15.0            # past a tool's own --timeout before gptop ends it (it stops itself at the deadline)


def run_tool(module: str, argv: list[str], *, timeout: float | None = None) -> int:
    """Run `python -m module argv` to the end; its exit code (0 done, 1 failed, 2 bad input, 130 stopped)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(tools.tool_command(module, argv), stdin=subprocess.DEVNULL, env=env)
    stopped = {"signal": None}

    def forward(signum, frame):
        if stopped["signal"] is not None:   # asked a second time: now
            proc.kill()
        elif signum != signal.SIGINT:       # Ctrl-C reaches the tool itself (the terminal's process group)
            proc.send_signal(signal.SIGTERM)
        stopped["signal"] = signum

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"gptop: {module} gave no result within {timeout:.0f} s; stopping it", file=sys.stderr)
            _end(proc)
            return EXIT_FAILED
    finally:
        if proc.poll() is None:
            _end(proc)
        for s, h in old.items():
            signal.signal(s, h)
    if code < 0:                            # killed by a signal
        return EXIT_INTERRUPTED if stopped["signal"] is not None else EXIT_FAILED
    return code


def _end(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cmd_export(ns: argparse.Namespace) -> int:
    tools.check_export(ns)                  # bad input: ConfigError, exit 2, before any process starts
    return run_tool(tools.EXPORT_MODULE, tools.export_argv(ns))


def cmd_sample(ns: argparse.Namespace) -> int:
    tools.check_sample(ns)
    return run_tool(tools.SAMPLE_MODULE, tools.sample_argv(ns), timeout=ns.timeout + GRACE_S)
