"""The few lines printed when a run ends: what it did, where it is, what to type next.

Both views end with them (the TUI after it closes, `--no-ui` after the last
line; on stderr with `--json`, so stdout stays JSON lines). They are built from
the one reduced `RunState` and the run directory on disk (the checkpoints that
are there now: a rolled-back trial's are gone), never from a view.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import IO

from trainer.contract import rundir
from trainer.contract.events import ErrorEvent, ExitEvent
from trainer.contract.states import ERROR_WORDS, RunStatus, StoppedBy

from .run_standing import NOT_REPORTED, RunStanding, status_words
from .state import RunState, fmt_duration, fmt_mfu, fmt_num, loss_range
from .state.counts import tokens_words

EXIT_INTERRUPTED = 130
STDERR_LINES = 5  # a failed command's last stderr lines in the summary


def outcome(state: RunState, exit_code: int | None = None) -> RunStanding:
    """How the run in `state` ended, with the exit code gptop ends with: FINISHED (reached --max-steps, or a
    command exited 0), STOPPED (by the user, or a planned end before it) or FAILED (an error, also one the
    trainer reported while it was being stopped)."""
    with state.lock:
        status, done, completed = state.status, state.done, state.completed
    if status is RunStatus.FAILED:
        return RunStanding.FAILED
    if status is RunStatus.STOPPED or exit_code == EXIT_INTERRUPTED:
        return RunStanding.STOPPED
    if completed:
        return RunStanding.FINISHED
    if done is not None:
        return RunStanding.STOPPED
    if exit_code not in (None, 0):
        return RunStanding.FAILED
    # done without a `done` event: a command exited 0
    return RunStanding.FINISHED if status is RunStatus.DONE else RunStanding.STOPPED


def summary_lines(state: RunState, exit_code: int | None = None) -> list[str]:
    """The end-of-run summary: run directory, steps and tokens, loss, speed, energy, checkpoint, commands."""
    how = outcome(state, exit_code)
    with state.lock:
        run_dir = state.run_dir or ""
        step = state.step
        err = state.errors[-1] if state.errors else None
        message = state.status_message
        tuner = state.tuner
        applied = tuner.applied[-1] if tuner.applied else None
        tuned = tuner.phase is not None
        elapsed = state.elapsed()
        done = state.done
        ended = state.exit
        reported = state.reported
        command = state.command_line()
        stderr = (
            [line for stream, line in state.logs if stream == "stderr"][-STDERR_LINES:]
            if how is RunStanding.FAILED
            else []
        )
    if done is not None and done.step > (step or 0):  # steps after the last logged one
        step = done.step
    quoted = shlex.quote(run_dir) if run_dir else "RUN_DIR"
    head = _head(how, step if reported else None, ended, reported, exit_code == EXIT_INTERRUPTED)
    out = _Lines(f"gptop: {head}" + (f" after {fmt_duration(elapsed)}" if elapsed is not None else ""))
    out.add("run dir", run_dir or "n/a")
    if command:
        out.add("command", command)
    if how is RunStanding.FAILED:
        _failure(out, err, message, run_dir, stderr if command else [])
    if not reported:
        out.add("progress", f"steps {NOT_REPORTED}")
    elif step is not None:
        _progress(out, state, step)
    else:
        out.add("progress", "no step was completed")
    kept = _checkpoints(out, state, how, step, run_dir, command, message)
    _alerts(out, state, run_dir, quoted)
    net = tuning_net(run_dir, step) if tuned and run_dir else None
    if applied is not None:
        best = Path(run_dir) / rundir.BEST_TOML if run_dir else None
        out.add(
            "tuning",
            f"applied trial {applied.number}"
            + (f"; its settings are in {best}" if best is not None and best.is_file() else "")
            + (f"; {net}" if net else ""),
        )
    elif net:
        out.add("tuning", f"kept the starting configuration; {net}")
    if kept and how is not RunStanding.FINISHED:  # (a program's own checkpoints: resuming is its own business)
        out.add("resume", f"gptop train --resume {quoted}")
    elif kept:
        out.add("export", f"gptop export {quoted} OUT_DIR")
    if run_dir:
        out.add("report", f"gptop report {quoted}")
    return out.lines


def _head(how: RunStanding, step: int | None, ended: ExitEvent | None, reported: bool, by_you: bool = False) -> str:
    """The summary's first words: how the run ended ('run failed (exit 3) at step 40', 'run stopped by you',
    'run killed by signal 9 (SIGKILL)'); a step only where the run reports its steps. `by_you`: gptop ends with
    your stop's status (130): yours also where the last process's `exit` is the tuner's restart."""
    at = f" at step {step}" if step is not None else " before the first step" if reported else ""
    if how is RunStanding.FINISHED:
        return "run finished" + (f": {step} steps" if step is not None else "")
    if how is RunStanding.STOPPED:
        by = ended.stopped_by if ended is not None else None
        if by_you and by is StoppedBy.TUNER:
            by = StoppedBy.USER
        return (
            "run stopped" + (" by you" if by is StoppedBy.USER else " by gptop" if by is StoppedBy.GPTOP else "") + at
        )
    if ended is not None and ended.failed:
        words = status_words(ended)
        return (f"run killed by {words}" if ended.signal is not None else f"run failed ({words})") + at
    return f"run failed{at}"


class _Lines:
    """The summary's lines: a head, then labelled rows."""

    def __init__(self, head: str) -> None:
        self.lines = [head]

    def add(self, label: str, text: str) -> None:
        self.lines.append(f"  {label:<11}{text}")


def _failure(out: _Lines, err: ErrorEvent | None, message: str | None, run_dir: str, stderr: list[str]) -> None:
    """Why the run failed, where its log is, and a program's own last words on it."""
    if err is not None:
        words = ERROR_WORDS.get(err.kind, err.kind.replace("_", " "))
        out.add("error", f"{words}: {err.message}")
    elif message:
        out.add("error", message)
    if run_dir:
        out.add("log", str(rundir.RunDir(run_dir).trainer_stderr))
    if stderr:
        out.add("stderr", f"last {len(stderr)} line{'s' if len(stderr) > 1 else ''}:")
        out.lines.extend(f"    {line}" for line in stderr)


def _progress(out: _Lines, state: RunState, step: int) -> None:
    """Steps and tokens (the kept ones, and the processed ones where a rollback made them differ: gptop.state.
    counts), loss, speed and energy."""
    with state.lock:
        total, first_loss, last_eval = state.total_steps, state.first_loss, state.last_eval
        c = state.counts
        tokens = tokens_words(c.tokens, c.processed, c.rolled_back_steps, fmt_num)
        losses = state.history("loss")
        last_loss = next((v for v in reversed(losses)), None)
        precision = state.precision_label(of_steps=True)  # the precision of the steps the speed is of
    out.add("progress", f"{step}/{total if total is not None else '?'} steps, {tokens}")
    loss = loss_range(first_loss, last_loss, len(losses)) if first_loss is not None else "n/a"
    if last_eval is not None and last_eval.loss is not None:
        loss += f" (last eval {last_eval.loss:.3f} at step {last_eval.step})"
    out.add("loss", loss)
    tps, mfu = state.steady_medians()
    out.add(
        "speed",
        f"{fmt_num(tps)} tokens/s (median) · MFU {fmt_mfu(mfu, state.mfu_is_estimate)}"
        + (f" · precision {precision}" if precision else ""),
    )
    energy, trained = state.energy()  # gptop.energy over the recent steps, as the dashboard shows it
    per_token = energy.per_token(trained) if energy is not None else None
    if per_token is not None:
        out.add("energy", f"{per_token * 1000:.2f} mJ/token over the last steps ({energy.source})")  # type: ignore[union-attr]
    else:
        out.add("energy", f"n/a: {state.energy_reason() or 'no energy reading'}")


def _checkpoints(
    out: _Lines,
    state: RunState,
    how: RunStanding,
    step: int | None,
    run_dir: str,
    command: str | None,
    message: str | None,
) -> list[rundir.CheckpointInfo]:
    """The newest checkpoint there is now (or why there is none); returns gptop's own that are kept."""
    with state.lock:
        written = state.checkpoints_written
        every = state.hello.checkpoint_every if state.hello is not None else None
        ckpts = list(state.checkpoints)
    kept = rundir.list_checkpoints(run_dir) if run_dir and not command else []
    cut_short = message if how is RunStanding.STOPPED else None  # what a stop that cut the trainer short kept and lost
    if command and not state.reported:  # nothing inside it says what it saved
        out.add("checkpoint", NOT_REPORTED)
    elif command:  # the program's own checkpoints, where it said it wrote them
        there = [c for c in ckpts if Path(c.path).exists()]
        out.add(
            "checkpoint",
            f"{there[-1].path} (step {there[-1].step}; {written} written)"
            if there
            else "none" + (f" ({written} written, none left)" if written else ""),
        )
    elif kept:
        if cut_short:
            out.add("stopped", cut_short)
        out.add("checkpoint", f"{kept[-1].path} (step {kept[-1].step}; {written} written, {len(kept)} kept)")
    else:
        out.add(
            "checkpoint",
            "none"
            + (f" ({written} written, none kept)" if written else "")
            + f": {cut_short or _why_none(how, step, every)}",
        )
    return kept


def _alerts(out: _Lines, state: RunState, run_dir: str, quoted: str) -> None:
    alerts = state.alert_summary()
    if alerts:
        active = sum(1 for a in alerts if ", active)" in a)
        out.add(
            "alerts",
            f"{len(alerts)} raised"
            + (f", {active} still active" if active else ", all resolved")
            + (f" (see gptop report {quoted})" if run_dir and len(alerts) > 3 else ""),
        )
        for line in alerts[-3:]:
            out.add("", line if len(line) <= 160 else line[:159] + "…")


def _why_none(how: RunStanding, step: int | None, every: int | None) -> str:
    """Why a run ends without a checkpoint, in words."""
    if step is None:
        return f"the run {how} before its first step (nothing to checkpoint)"
    when = f" (--checkpoint-every {every})" if every else " (--checkpoint-every 0: only at the end)"
    return f"the run {how} at step {step}, before its first checkpoint{when}"


def tuning_net(run_dir: str, final_step: int | None = None) -> str | None:
    """What the applied setting realized and the tuning ledger's net, from the run's tuning.json ('claimed
    1.31x (1.24-1.38x), realized 1.28x (1.22-1.33x) ...; net +1m02s against not tuning (...)', the saving
    counted over the steps the run made after the switch, up to `final_step`), None without one that reads (a
    damaged file never costs the summary)."""
    path = Path(run_dir) / rundir.TUNING_JSON
    if not path.is_file():
        return None
    import json

    from tuner.report_words import net_line, realized_words
    from tuner.tuning_report import check_report

    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if check_report(report) is not None:
        return None
    led = report.get("ledger") or {}
    parts = [realized_words(led), net_line(led, final_step)]
    return "; ".join(p for p in parts if p) or None


def print_summary(state: RunState, exit_code: int | None, stream: IO[str]) -> None:
    """Write the summary lines to `stream` (never fails the exit: a closed terminal loses only these)."""
    try:
        stream.write("\n".join(summary_lines(state, exit_code)) + "\n")
        stream.flush()
    except (OSError, ValueError):
        pass
