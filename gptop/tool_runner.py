"""`gptop export` and `gptop sample`: checked here without torch, run in a `python -m trainer.<tool>` process.

The tool's progress lines (stderr) and result (stdout) pass straight through. gptop
forwards a stop (SIGTERM, SIGHUP) to the tool, waits for it, and ends a tool that
overruns its time limit, so no tool outlives the command; the tool itself also dies
with its parent (PR_SET_PDEATHSIG).

`sample_newest` is the dashboard's `s` key without the dashboard: one sample from a run's
newest checkpoint, in a short-lived `python -m trainer.sample --json` process started
with asyncio (the caller's event loop keeps running), at a lower CPU priority than the
training, ended at its time limit or when the caller cancels it. gptop's process never
imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.contract import tools
from trainer.contract.config import ConfigError
from .controls import handled

EXIT_FAILED, EXIT_INTERRUPTED = 1, 130
GRACE_S = 15.0  # past a tool's own --timeout before gptop ends it (it stops itself at the deadline)


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has ended since boot (/proc/vmstat, Linux 4.13+)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def killed_words(what: str, signum: int, oom_before: int | None) -> str:
    """`the export was killed by signal 9 (SIGKILL): ...`, saying when it was most likely the OOM killer."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    after = oom_kills()
    if oom_before is not None and after is not None and after > oom_before:
        why = "the kernel's out-of-memory killer ended it: the model did not fit in the memory left"
    elif signum == signal.SIGKILL:
        why = "most likely out of memory (the kernel's OOM killer sends it; so does kill -9)"
    else:
        why = "not by gptop"
    return f"{what} was killed by signal {signum} ({name}): {why}"


TOOL_NAMES = {tools.EXPORT_MODULE: "the export", tools.SAMPLE_MODULE: "the sampler"}
AFTER_KILL = {
    tools.EXPORT_MODULE: "OUT_DIR is as it was; free some memory and run it again (the next export "
    "removes what this one left)",
    tools.SAMPLE_MODULE: "free some memory and run it again",
}


def run_tool(module: str, argv: list[str], *, timeout: float | None = None) -> int:
    """Run `python -m module argv` to the end; its exit code (0 done, 1 failed, 2 bad input, 130 stopped)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    oom_before = oom_kills()
    proc = subprocess.Popen(tools.tool_command(module, argv), stdin=subprocess.DEVNULL, env=env)
    stopped = {"signal": None}

    def forward(signum, frame):
        if stopped["signal"] is not None:  # asked a second time: now
            proc.kill()
        elif signum != signal.SIGINT:  # Ctrl-C reaches the tool itself (the terminal's process group)
            proc.send_signal(signal.SIGTERM)
        stopped["signal"] = signum

    old = {s: signal.signal(s, forward) for s in handled((signal.SIGINT, signal.SIGTERM, signal.SIGHUP))}
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
    if code < 0:  # killed by a signal
        if stopped["signal"] is not None:
            return EXIT_INTERRUPTED
        what = TOOL_NAMES.get(module, module)
        print(
            f"gptop: {killed_words(what, -code, oom_before)}; {AFTER_KILL.get(module, 'run it again')}", file=sys.stderr
        )
        return EXIT_FAILED
    return code


def _end(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cmd_export(ns: argparse.Namespace) -> int:
    tools.check_export(ns)  # bad input: ConfigError, exit 2, before any process starts
    return run_tool(tools.EXPORT_MODULE, tools.export_argv(ns))


def cmd_sample(ns: argparse.Namespace) -> int:
    tools.check_sample(ns)
    return run_tool(tools.SAMPLE_MODULE, tools.sample_argv(ns), timeout=ns.timeout + GRACE_S)


# --- the dashboard's sample (the `s` key) ---------------------------------------------------------

# A short sample that a tiny model on a CPU makes in seconds; the panel has room for a few lines.
PANEL_MAX_NEW_TOKENS = 48
PANEL_TEMPERATURE = 0.8
PANEL_TIMEOUT_S = 60.0
NICE = 10  # the sampler yields the CPU to the training run


@dataclass
class SampleOutcome:
    """One panel sample: the result, or why there is none (in words), and how long it took in all."""

    result: tools.SampleResult | None
    error: str | None
    seconds: float


async def sample_newest(
    run_dir: str | Path,
    *,
    prompt: str = "",
    max_new_tokens: int = PANEL_MAX_NEW_TOKENS,
    temperature: float = PANEL_TEMPERATURE,
    seed: int | None = None,
    timeout: float = PANEL_TIMEOUT_S,
) -> SampleOutcome:
    """Sample the newest checkpoint of `run_dir` that loads, on the CPU, in a process of its own.

    Bounded in time: the tool stops itself at `timeout` (keeping what it generated), and is killed
    GRACE_S later if it has not. Cancelling the awaiting task kills the process too. Never raises for
    a run without a checkpoint or a failed tool: the outcome says what happened."""
    t0 = time.monotonic()
    seed = int(time.time()) % 100_000 if seed is None else seed  # each press: another sample
    try:
        cmd = tools.sample_command(
            run_dir,
            prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            timeout=timeout,
            device="cpu",
        )
    except ConfigError as e:
        return SampleOutcome(None, e.message, time.monotonic() - t0)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    oom_before = oom_kills()
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True
    )
    try:
        os.setpriority(os.PRIO_PROCESS, proc.pid, NICE)
    except OSError:
        pass
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout + GRACE_S)
    except asyncio.TimeoutError:
        await _end_async(proc)
        return SampleOutcome(None, f"no sample within {timeout + GRACE_S:.0f} s; stopped it", time.monotonic() - t0)
    finally:
        if proc.returncode is None:  # cancelled (the app quit, another sample asked for)
            await _end_async(proc)
    return _outcome(
        proc.returncode,
        out.decode("utf-8", "replace"),
        err.decode("utf-8", "replace"),
        time.monotonic() - t0,
        oom_before,
    )


def _outcome(code: int | None, out: str, err: str, seconds: float, oom_before: int | None = None) -> SampleOutcome:
    lines = [line for line in out.splitlines() if line.strip()]
    if code == 0 and lines:
        try:
            return SampleOutcome(tools.SampleResult.from_json(lines[-1]), None, seconds)
        except (ValueError, TypeError) as e:
            return SampleOutcome(None, f"unreadable result from the sampler: {e}", seconds)
    if code is not None and code < 0:
        return SampleOutcome(None, killed_words("the sampler", -code, oom_before), seconds)
    said = [line.strip() for line in err.splitlines() if line.strip() and not line.startswith((" ", "Traceback"))]
    why = said[-1] if said else f"exit code {code}"
    return SampleOutcome(None, f"the sampler failed: {why}", seconds)


async def _end_async(proc: asyncio.subprocess.Process, grace_s: float = 5.0) -> None:
    """Terminate, then kill; always reaps the process."""
    try:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), grace_s)
    except ProcessLookupError:
        pass
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
