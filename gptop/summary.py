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
from trainer.contract.events import ERROR_WORDS
from trainer.contract.states import RunStatus

from .state import RunState, fmt_duration, fmt_mfu, fmt_num

EXIT_INTERRUPTED = 130
STDERR_LINES = 5          # a failed command's last stderr lines in the summary


def outcome(state: RunState, exit_code: int | None = None) -> str:
    """"finished" (reached --max-steps), "stopped" (by the user, or a planned end before it) or "failed" (an
    error, also one the trainer reported while it was being stopped)."""
    with state.lock:
        status, done, completed = state.status, state.done, state.completed
    if status is RunStatus.FAILED:
        return "failed"
    if status is RunStatus.STOPPED or exit_code == EXIT_INTERRUPTED:
        return "stopped"
    if completed:
        return "finished"
    if done is not None:
        return "stopped"
    if exit_code not in (None, 0):
        return "failed"
    return "finished" if status is RunStatus.DONE else "stopped"     # done without a `done` event: a command exited 0


def summary_lines(state: RunState, exit_code: int | None = None) -> list[str]:
    """The end-of-run summary: run directory, steps and tokens, loss, speed, energy, checkpoint, commands."""
    how = outcome(state, exit_code)
    with state.lock:
        run_dir = state.run_dir or ""
        step, total, tokens = state.step, state.total_steps, state.tokens
        first_loss = state.first_loss
        last_loss = next((v for v in reversed(state.history("loss"))), None)
        last_eval = state.last_eval
        err = state.errors[-1] if state.errors else None
        message = state.status_message
        written = state.checkpoints_written
        tuner = state.tuner
        applied = tuner.applied[-1] if tuner.applied else None
        tuned = tuner.phase is not None
        elapsed = state.elapsed()
        done = state.done
        precision = state.precision_label()
        every = (state.config.get("checkpoint") or {}).get("checkpoint_every")
        command = state.command_line()
        stderr = [line for stream, line in state.logs if stream == "stderr"][-STDERR_LINES:] if how == "failed" else []
    if done is not None and done.step > (step or 0):   # steps after the last logged one
        step, tokens = done.step, done.tokens
    quoted = shlex.quote(run_dir) if run_dir else "RUN_DIR"
    at = f" at step {step}" if step is not None else " before the first step"
    head = {"finished": "run finished" + (f": {step} steps" if step is not None else ""), "stopped": f"run stopped{at}",
            "failed": f"run failed{at}"}[how]
    lines = [f"gptop: {head}" + (f" after {fmt_duration(elapsed)}" if elapsed is not None else "")]

    def add(label: str, text: str) -> None:
        lines.append(f"  {label:<11}{text}")

    add("run dir", run_dir or "n/a")
    if command:
        add("command", command)
    if how == "failed":
        if err is not None:
            words = ERROR_WORDS.get(err.kind, err.kind.replace("_", " "))
            add("error", f"{words}: {err.message}")
        elif message:
            add("error", message)
        if run_dir:
            add("log", str(rundir.RunDir(run_dir).trainer_stderr))
        if command and stderr:          # a program's own words on why it failed
            add("stderr", f"last {len(stderr)} line{'s' if len(stderr) > 1 else ''}:")
            lines.extend(f"    {line}" for line in stderr)
    if step is not None:
        add("progress", f"{step}/{total if total is not None else '?'} steps, {fmt_num(tokens)} tokens")
        loss = f"{_f(first_loss)} -> {_f(last_loss)}" if first_loss is not None else "n/a"
        if last_eval is not None and last_eval.loss is not None:
            loss += f" (last eval {last_eval.loss:.3f} at step {last_eval.step})"
        add("loss", loss)
        tps, mfu = state.steady_medians()
        add("speed", f"{fmt_num(tps)} tokens/s (median) · MFU {fmt_mfu(mfu, state.mfu_is_estimate)}"
            + (f" · precision {precision}" if precision else ""))
        energy, trained = state.energy()          # gptop.energy over the recent steps, as the dashboard shows it
        per_token = energy.per_token(trained) if energy is not None else None
        if per_token is not None:
            add("energy", f"{per_token * 1000:.2f} mJ/token over the last steps ({energy.source})")  # type: ignore[union-attr]
        else:
            add("energy", f"n/a: {state.energy_reason() or 'no energy reading'}")
    else:
        add("progress", "no step was completed")
    kept = rundir.list_checkpoints(run_dir) if run_dir and not command else []
    cut_short = message if how == "stopped" else None      # what a stop that cut the trainer short kept and lost
    if command:      # the program's own checkpoints, where it said it wrote them
        with state.lock:
            ckpts = list(state.checkpoints)
        there = [c for c in ckpts if Path(c.path).exists()]
        add("checkpoint", f"{there[-1].path} (step {there[-1].step}; {written} written)" if there else
            "none" + (f" ({written} written, none left)" if written else ""))
    elif kept:
        if cut_short:
            add("stopped", cut_short)
        add("checkpoint", f"{kept[-1].path} (step {kept[-1].step}; {written} written, {len(kept)} kept)")
    else:
        add("checkpoint", "none" + (f" ({written} written, none kept)" if written else "")
            + f": {cut_short or _why_none(how, step, every)}")
    alerts = state.alert_summary()
    if alerts:
        active = sum(1 for a in alerts if ", active)" in a)
        add("alerts", f"{len(alerts)} raised" + (f", {active} still active" if active else ", all resolved")
            + (f" (see gptop report {quoted})" if run_dir and len(alerts) > 3 else ""))
        for line in alerts[-3:]:
            add("", line if len(line) <= 160 else line[:159] + "…")
    net = tuning_net(run_dir) if tuned and run_dir else None
    if applied is not None:
        best = Path(run_dir) / rundir.BEST_TOML if run_dir else None
        add("tuning", f"applied trial {applied.number}"
            + (f"; its settings are in {best}" if best is not None and best.is_file() else "")
            + (f"; {net}" if net else ""))
    elif net:
        add("tuning", f"kept the starting configuration; {net}")
    if kept and how != "finished":           # (a program's own checkpoints: resuming is its own business)
        add("resume", f"gptop train --resume {quoted}")
    elif kept:
        add("export", f"gptop export {quoted} OUT_DIR")
    if run_dir:
        add("report", f"gptop report {quoted}")
    return lines


def _why_none(how: str, step: int | None, every: int | None) -> str:
    """Why a run ends without a checkpoint, in words."""
    if step is None:
        return f"the run {how} before its first step (nothing to checkpoint)"
    when = f" (--checkpoint-every {every})" if every else " (--checkpoint-every 0: only at the end)"
    return f"the run {how} at step {step}, before its first checkpoint{when}"


def tuning_net(run_dir: str) -> str | None:
    """The tuning ledger's net from the run's tuning.json ('net +1m02s against not tuning (...)'), None without
    one that reads (a damaged file never costs the summary)."""
    path = Path(run_dir) / rundir.TUNING_JSON
    if not path.is_file():
        return None
    import json

    from tuner.tuning_report import check_report, net_line

    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if check_report(report) is not None:
        return None
    return net_line(report.get("ledger") or {})


def print_summary(state: RunState, exit_code: int | None, stream: IO[str]) -> None:
    """Write the summary lines to `stream` (never fails the exit: a closed terminal loses only these)."""
    try:
        stream.write("\n".join(summary_lines(state, exit_code)) + "\n")
        stream.flush()
    except (OSError, ValueError):
        pass


def _f(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"
