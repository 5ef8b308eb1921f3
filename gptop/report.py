"""`gptop report RUN_DIR`: what a run did, from its files alone.

Reads events.jsonl (and per-rank event files), device.jsonl and the tuning
report if there is one. Everything is computed from recorded events, so a
report of a finished run on another machine gives the same numbers.
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from trainer.contract import rundir
from trainer.contract.events import (PHASES, CheckpointEvent, DeviceEvent, DoneEvent, ErrorEvent, EvalEvent, Event,
                                     HelloEvent, MalformedEvent, StepEvent, WarningEvent, read_events, to_dict)

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
    command = next((e.command for e in reversed(hellos) if e.command is not None), None)
    if command is not None:
        out["command"] = command        # `gptop run -- CMD`
    if steps:
        last = steps[-1]
        out["steps"] = last.step
        out["tokens"] = last.tokens
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
    if command is None:
        out["checkpoints_kept"] = [{"step": c.step, "path": str(c.path)} for c in rundir.list_checkpoints(run_dir)]
    else:               # the program's own checkpoints, where it said it wrote them, that are still there
        out["checkpoints_kept"] = [{"step": e.step, "path": e.path} for e in ckpts if Path(e.path).exists()]
    out["errors"] = [_error(e) for e in errors]
    out["warnings"] = len(warnings)
    out["done"] = bool(done) and done[-1].reason
    energy, why = _energy(run_dir, steps, skipped["device.jsonl"])
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


def _energy(run_dir: Path, steps: list[StepEvent], skipped: _Skipped) -> tuple[Energy | None, str]:
    """The run's energy over its step events (gptop.energy), or (None, why not): device.jsonl, or the sum over
    the nodes' device.<node>.jsonl of a multi-node run."""
    if len(steps) < 2:
        return None, "fewer than two step events"
    total: Energy | None = None
    why = "no device.jsonl (no device samples were recorded)"
    for path in [run_dir / "device.jsonl", *sorted(run_dir.glob("device.*.jsonl"))]:
        if not path.is_file():
            continue
        samples = [e for e in read_events(path, on_malformed=skipped) if isinstance(e, DeviceEvent)]
        got = measure(samples, steps[0].time, steps[-1].time) if samples else None
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
    if s.get("command"):
        lines.append(f"command   {shlex.join(s['command'])}")
    m = s.get("model")
    if m:
        name = "/".join(str(x) for x in (m.get("family"), m.get("size")) if x) or "?"
        lines.append(f"model     {name}  {(m.get('total_params') or 0) / 1e6:.1f}M params "
                     f"({(m.get('active_params') or 0) / 1e6:.1f}M active)  on {s.get('device')}")
    if s.get("toggles"):
        t = s["toggles"]
        lines.append("toggles   " + "  ".join(f"{k}={v}" for k, v in t.items()))
    if "steps" in s:
        lines.append(f"progress  {s['steps']}/{s.get('max_steps')} steps, {s['tokens']:,} tokens, "
                     f"{s['starts']} start(s), finished: {s.get('done') or 'no'}")
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
    return 0 if not s["errors"] or s.get("done") else 1
