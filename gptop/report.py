"""`gptop report RUN_DIR`: what a run did, from its files alone.

Reads events.jsonl (and per-rank event files), device.jsonl and the tuning
report if there is one. Everything is computed from recorded events, so a
report of a finished run on another machine gives the same numbers. Where the
run stands comes from its lock (held: running now, whatever its events say) and
the events of its last trainer process (a tuner's restart ends a trainer, not
the run).
"""

from __future__ import annotations

import enum
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.contract import rundir
from trainer.contract.events import (MAX_STEPS, PHASES, STOPPED_BEFORE_FIRST_STEP, TUNER_RESTART, AlertEvent,
                                     CheckpointEvent,
                                     DeviceEvent, DoneEvent, ErrorEvent, EvalEvent, Event, HelloEvent, MalformedEvent,
                                     ProfileEvent, StepEvent, WarningEvent, from_dict, read_events, to_dict)
from trainer.contract.runlock import holder_words, lock_holders

from .energy import Energy, measure, unavailable_reason
from .state import fmt_mfu


class _Skipped:
    """Malformed lines of one file: counted and skipped, the first reason kept for the report."""

    def __init__(self) -> None:
        self.count = 0
        self.first: str | None = None

    def __call__(self, line: bytes, error: MalformedEvent) -> None:
        self.count += 1
        if self.first is None:
            self.first = str(error)


def summarize(run_dir: Path) -> dict[str, Any]:
    run_dir = Path(run_dir)
    events_path = run_dir / "events.jsonl"
    if not events_path.is_file():
        from trainer.contract.config import ConfigError

        raise ConfigError("RUN_DIR", f"{run_dir} has no events.jsonl; is it a gptop run directory?")
    skipped = {"events.jsonl": _Skipped(), "device.jsonl": _Skipped()}
    events = list(read_events(events_path, on_malformed=skipped["events.jsonl"]))
    hellos = [e for e in events if isinstance(e, HelloEvent)]
    hello = next((e for e in reversed(hellos) if not e.early), hellos[-1] if hellos else None)
    steps = [e for e in events if isinstance(e, StepEvent)]
    evals = [e for e in events if isinstance(e, EvalEvent)]
    ckpts = [e for e in events if isinstance(e, CheckpointEvent)]
    errors = [e for e in events if isinstance(e, ErrorEvent)]
    warnings = [e for e in events if isinstance(e, WarningEvent)]
    done = [e for e in events if isinstance(e, DoneEvent)]
    out: dict[str, Any] = {"run_dir": str(run_dir)}
    if hello:
        out["model"] = to_dict(hello.model)
        out["device"] = hello.device.name
        out["toggles"] = hello.toggles
        out["peak_flops"] = hello.peak_flops
        out["peak_source"] = hello.peak_source
        out["mfu_is_estimate"] = hello.mfu_is_estimate
        out["max_steps"] = hello.max_steps
    out["starts"] = sum(1 for e in hellos if e.early) or len(hellos)   # one early hello per trainer process
    out["tuner_restarts"] = sum(1 for e in done if e.reason == TUNER_RESTART)
    end = standing(run_dir, events)
    out["state"], out["state_words"] = end.state.value, end.words
    out["done"] = end.done is not None and end.done.reason       # the last trainer's end (a tuner's restart is not)
    if steps or (end.done is not None and end.done.step):
        last = max((*steps[-1:], *([end.done] if end.done is not None else [])), key=lambda e: e.step)
        out["steps"] = last.step
        out["tokens"] = last.tokens
    if steps:
        # steady state: drop the first interval of each start (compilation, allocator warm-up)
        steady = _steady(events)
        tps = [e.tokens_per_s for e in steady if e.tokens_per_s]
        out["tokens_per_s"] = statistics.median(tps) if tps else None
        mfus = [e.mfu for e in steady if e.mfu is not None]
        out["mfu"] = statistics.median(mfus) if mfus else None
        timed = [(e.phases_ms, e.interval_steps or 1) for e in steady if e.phases_ms]
        if timed:
            total_w = sum(w for _, w in timed)
            out["phases_ms"] = {k: sum((p.get(k) or 0.0) * w for p, w in timed) / total_w for k in PHASES}
        step_ms = [e.step_ms for e in steady if e.step_ms is not None]
        out["step_ms"] = statistics.median(step_ms) if step_ms else None
        out["final_loss"] = next((e.loss for e in reversed(steps) if e.loss is not None), None)
        out["first_loss"] = next((e.loss for e in steps if e.loss is not None), None)
        out["peak_mem_bytes"] = max((e.mem_bytes or 0) for e in steps)
    if evals:
        out["eval_loss"] = evals[-1].loss
    out["checkpoints"] = [{"step": e.step, "path": e.path, "seconds": e.seconds} for e in ckpts]
    out["checkpoints_kept"] = [{"step": c.step, "path": str(c.path)} for c in rundir.list_checkpoints(run_dir)]
    out["errors"] = [_error(e) for e in errors]
    out["warnings"] = len(warnings)
    out["alerts"] = alert_rows(e for e in events if isinstance(e, AlertEvent))
    profiles = [e for e in events if isinstance(e, ProfileEvent) and e.rank == 0]
    if profiles:
        out["profile"] = to_dict(profiles[-1])         # the newest window (trainer.profile_summary)
    run_gpus = {k for e in hellos for k in (e.gpus or ())}
    energy, why = _energy(run_dir, steps, skipped["device.jsonl"], run_gpus)
    if energy is not None:
        out["energy_j"] = energy.joules
        out["energy_source"] = energy.source
        if out.get("tokens"):
            out["energy_j_per_token"] = energy.joules / max(1, _tokens_in_window(steps))
    else:
        out["energy_unavailable"] = why
    tuning, problem = _tuning(run_dir / "tuning.json")
    if tuning is not None:
        out["tuning"] = tuning
    if problem is not None:
        out["tuning_skipped"] = problem
    bad = {name: {"lines": s.count, "first": s.first} for name, s in skipped.items() if s.count}
    if bad:
        out["malformed"] = bad
    return out


class RunStanding(enum.Enum):
    """Where a run stands, from its lock and the events of its last trainer process."""

    RUNNING = "running"            # its lock is held: gptop (or a trainer) is at it now
    FINISHED = "finished"          # trained to --max-steps
    STOPPED = "stopped"            # stopped on request (a user, a signal, a planned end)
    FAILED = "failed"              # its last trainer reported an error and ended
    CUT_SHORT = "cut short"        # its last trainer ended without a word (killed), or gptop ended mid-restart


@dataclass(frozen=True)
class Standing:
    state: RunStanding
    words: str                     # in words, for the report's `state` line
    done: DoneEvent | None         # the last trainer's own end, if it said one


def standing(run_dir: Path, events: list[Event]) -> Standing:
    """How the run stands. A live run (its lock held) is running whatever its events say; else the last trainer
    process's events say how it ended (an earlier process's `done`, a tuner's restart, is not the run's end)."""
    holders = lock_holders(run_dir)
    starts = [i for i, e in enumerate(events) if isinstance(e, HelloEvent) and e.early] or \
        [i for i, e in enumerate(events) if isinstance(e, HelloEvent)][-1:] or [0]
    last = events[starts[-1]:]
    done = next((e for e in reversed(last) if isinstance(e, DoneEvent)), None)
    error = next((e for e in reversed(last) if isinstance(e, ErrorEvent)), None)
    if holders is not None:
        return Standing(RunStanding.RUNNING, f"running now ({'; '.join(holder_words(h) for h in holders)})", None)
    if done is not None and done.reason == MAX_STEPS:
        return Standing(RunStanding.FINISHED, f"finished at step {done.step} (--max-steps)", done)
    if done is not None and done.reason == TUNER_RESTART:
        return Standing(RunStanding.CUT_SHORT, f"ended during a restart by the tuner at step {done.step} (gptop ended "
                                            "before the next trainer started)", done)
    if done is not None and done.reason == STOPPED_BEFORE_FIRST_STEP:
        return Standing(RunStanding.STOPPED, "stopped before its first step: a run that made no checkpoint", done)
    if done is not None:
        return Standing(RunStanding.STOPPED, f"stopped at step {done.step} ({done.reason or 'no reason given'})", done)
    if error is not None:
        return Standing(RunStanding.FAILED, f"failed at step {error.step}: {error.kind}: {error.message}", None)
    return Standing(RunStanding.CUT_SHORT, "ended without a word from its last trainer (killed, or gptop and the trainer "
                                        f"died); see {rundir.RunDir(run_dir).trainer_stderr}", None)


MAX_ALERTS = 100     # alert rows a report keeps (the newest): a flapping alert on a week-long run stays readable


def alert_rows(alerts: Any) -> list[dict[str, Any]]:
    """Alerts as the report lists them: one row per alert (its latest raise), with when it was resolved."""
    rows: dict[str, dict[str, Any]] = {}
    for a in alerts:
        row = rows.get(a.id)
        if a.resolved:
            if row is not None:
                row.update(resolved_time=a.time, resolved=a.message)
            continue
        if row is None:
            if len(rows) >= MAX_ALERTS:
                rows.pop(next(iter(rows)))
            row = rows[a.id] = {"id": a.id, "time": a.time, "resolved_time": None, "resolved": None}
        row.update(kind=a.kind.value, severity=a.severity.value, message=a.message, step=a.step, figures=a.figures,
                   ranks=a.ranks, node=a.node, device=a.device)
    return list(rows.values())


def _error(e: ErrorEvent) -> dict[str, Any]:
    """An error for the report; a disk error with its file, errno text and free bytes."""
    out: dict[str, Any] = {"kind": e.kind, "message": e.message, "step": e.step}
    if e.kind == "disk":
        out.update(path=e.path, os_error=e.os_error, free_bytes=e.free_bytes)
    return out


def _steady(events: list[Event]) -> list[StepEvent]:
    out, first = [], True
    for e in events:
        if isinstance(e, HelloEvent):
            first = True
        elif isinstance(e, StepEvent):
            if not first:
                out.append(e)
            first = False
    return out or [e for e in events if isinstance(e, StepEvent)]


def _tokens_in_window(steps: list[StepEvent]) -> int:
    return steps[-1].tokens - steps[0].tokens if len(steps) > 1 else steps[-1].tokens


def _energy(run_dir: Path, steps: list[StepEvent], skipped: _Skipped,
            run_gpus: set[str] | None = None) -> tuple[Energy | None, str]:
    """The run's energy over its step events (gptop.energy), or (None, why not): device.jsonl, or the sum over
    the nodes' device.<node>.jsonl of a multi-node run; `run_gpus`: the hellos' GPU identities."""
    if len(steps) < 2:
        return None, "fewer than two step events"
    total: Energy | None = None
    why = "no device.jsonl (no device samples were recorded)"
    for path in [run_dir / "device.jsonl", *sorted(run_dir.glob("device.*.jsonl"))]:
        if not path.is_file():
            continue
        samples = [e for e in read_events(path, on_malformed=skipped) if isinstance(e, DeviceEvent)]
        got = measure(samples, steps[0].time, steps[-1].time, run_gpus=run_gpus) if samples else None
        if got is None:
            why = unavailable_reason(samples)
        elif total is None:
            total = got
        else:
            total = Energy(joules=total.joules + got.joules, source=total.source)
    return total, ("" if total is not None else why)


def _tuning(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """tuning.json as the tuner wrote it, or (None, why it was skipped): a damaged file is reported, not fatal."""
    if not path.is_file():
        return None, None
    from tuner.report import check_report

    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:     # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None, f"{path.name}: not readable JSON ({e})"
    problem = check_report(data)
    if problem is not None:
        return None, f"{path.name}: {problem}"
    return data, None


def format_report(s: dict[str, Any]) -> str:
    lines = [f"run       {s['run_dir']}"]
    m = s.get("model")
    if m:
        lines.append(f"model     {m.get('family')}/{m.get('size')}  {(m.get('total_params') or 0) / 1e6:.1f}M params "
                     f"({(m.get('active_params') or 0) / 1e6:.1f}M active)  on {s.get('device')}")
    if s.get("toggles"):
        t = s["toggles"]
        lines.append("toggles   " + "  ".join(f"{k}={v}" for k, v in t.items()))
    lines.append(f"state     {s['state_words']}")
    starts = f"{s['starts']} start(s)" + (f" ({s['tuner_restarts']} by the tuner's restarts)"
                                         if s.get("tuner_restarts") else "")
    if "steps" not in s:
        lines.append(f"progress  no step done, {starts}")
    else:
        lines.append(f"progress  {s['steps']}/{s.get('max_steps')} steps, {s['tokens']:,} tokens, {starts}")
    if "final_loss" in s:
        lines.append(f"loss      {_f(s.get('first_loss'))} -> {_f(s.get('final_loss'))}"
                     + (f"  (eval {_f(s.get('eval_loss'))})" if s.get("eval_loss") is not None else ""))
        mfu = s.get("mfu")
        lines.append(f"speed     {_f(s.get('tokens_per_s'), '.0f')} tokens/s (median, steady state), "
                     f"step {_f(s.get('step_ms'), '.1f')} ms, MFU {fmt_mfu(mfu, bool(s.get('mfu_is_estimate')))}, "
                     f"peak memory {s.get('peak_mem_bytes', 0) / 2**30:.2f} GiB")
        if s.get("peak_flops"):
            lines.append(f"mfu peak  {s['peak_flops'] / 1e9:,.1f} GFLOP/s per process"
                         + (f" ({s['peak_source']})" if s.get("peak_source") else ""))
        if s.get("phases_ms"):
            total = sum(s["phases_ms"].values()) or 1
            lines.append("phases    " + "  ".join(f"{k} {v:.1f} ms ({v / total:.0%})" for k, v in s["phases_ms"].items()))
    if s.get("energy_j") is not None:
        lines.append(f"energy    {s['energy_j'] / 3600:.2f} Wh, {s.get('energy_j_per_token', 0) * 1e3:.3f} mJ/token"
                     f" ({s.get('energy_source', 'measured')})")
    else:
        lines.append(f"energy    n/a ({s.get('energy_unavailable') or 'no energy reading'})")
    kept = s.get("checkpoints_kept") or []    # on disk now (pruned by --keep-checkpoints, rolled back by the tuner)
    lines.append(f"checkpts  {len(s['checkpoints'])} written, {len(kept)} kept"
                 + (f", newest {kept[-1]['path']}" if kept else ""))
    if s["errors"]:
        for e in s["errors"]:
            lines.append(f"error     step {e.get('step')}: {e['kind']}: {e['message']}")
    else:
        lines.append("errors    none")
    alerts = s.get("alerts") or []
    if alerts:
        active = sum(1 for a in alerts if a["resolved_time"] is None)
        lines.append(f"alerts    {len(alerts)} raised, " + (f"{active} not resolved" if active else "all resolved"))
        for a in alerts:
            where = " ".join(x for x in (a.get("node"), a.get("device")) if x)
            when = (f"resolved after {a['resolved_time'] - a['time']:.0f} s" if a["resolved_time"] is not None
                    else "not resolved")
            lines.append(f"  {a['kind']} [{a['severity']}]" + (f" ({where})" if where else "")
                         + f" at step {a.get('step')}, {when}: {a['message']}")
    else:
        lines.append("alerts    none")
    if s.get("profile"):
        from .profile_text import profile_lines

        lines += profile_lines(from_dict(s["profile"]))
    if s.get("tuning"):
        from tuner.report import format_summary

        lines.append(format_summary(s["tuning"]))
    if s.get("tuning_skipped"):
        lines.append(f"tuning    skipped: {s['tuning_skipped']}")
    for name, bad in (s.get("malformed") or {}).items():
        lines.append(f"skipped   {bad['lines']} malformed line(s) in {name} (first: {bad['first']})")
    return "\n".join(lines)


def _f(v: float | None, spec: str = ".4f") -> str:
    return "n/a" if v is None else format(v, spec)


def print_report(run_dir: Path, json_out: bool = False) -> int:
    s = summarize(run_dir)
    if json_out:
        print(json.dumps(s, indent=2, default=str))
    else:
        print(format_report(s))
    return 0 if not s["errors"] or s.get("done") or s["state"] == RunStanding.RUNNING.value else 1
