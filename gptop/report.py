"""`gptop report RUN_DIR`: what a run did, from its files alone.

Reads events.jsonl (and per-rank event files), device.jsonl and the tuning
report if there is one. Everything is computed from recorded events, so a
report of a finished run on another machine gives the same numbers.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from trainer.contract.events import PHASES, read_events

from .telemetry import DeviceSample, energy_between


def summarize(run_dir: Path) -> dict[str, Any]:
    run_dir = Path(run_dir)
    events_path = run_dir / "events.jsonl"
    if not events_path.is_file():
        from trainer.contract.config import ConfigError

        raise ConfigError("RUN_DIR", f"{run_dir} has no events.jsonl; is it a gptop run directory?")
    events = list(read_events(events_path))
    hello = next((e for e in reversed(events) if e["type"] == "hello"), None)
    steps = [e for e in events if e["type"] == "step"]
    evals = [e for e in events if e["type"] == "eval"]
    ckpts = [e for e in events if e["type"] == "checkpoint"]
    errors = [e for e in events if e["type"] == "error"]
    warnings = [e for e in events if e["type"] == "warning"]
    done = [e for e in events if e["type"] == "done"]
    out: dict[str, Any] = {"run_dir": str(run_dir)}
    if hello:
        out["model"] = hello.get("model")
        out["device"] = hello.get("device", {}).get("name")
        out["toggles"] = hello.get("config", {}).get("toggles")
        out["max_steps"] = hello.get("config", {}).get("optim", {}).get("max_steps")
    out["starts"] = sum(1 for e in events if e["type"] == "hello")
    if steps:
        last = steps[-1]
        out["steps"] = last["step"]
        out["tokens"] = last["tokens"]
        # steady state: drop the first interval of each start (compilation, allocator warm-up)
        steady = _steady(events)
        weights = [e.get("interval_steps", 1) for e in steady]
        tps = [e["tokens_per_s"] for e in steady if e.get("tokens_per_s")]
        out["tokens_per_s"] = statistics.median(tps) if tps else None
        mfus = [e["mfu"] for e in steady if e.get("mfu") is not None]
        out["mfu"] = statistics.median(mfus) if mfus else None
        timed = [(e["phases_ms"], w) for e, w in zip(steady, weights) if e.get("phases_ms")]
        if timed:
            total_w = sum(w for _, w in timed)
            out["phases_ms"] = {k: sum(p.get(k, 0.0) * w for p, w in timed) / total_w for k in PHASES}
        out["step_ms"] = statistics.median([e["step_ms"] for e in steady]) if steady else None
        out["final_loss"] = next((e["loss"] for e in reversed(steps) if e.get("loss") is not None), None)
        out["first_loss"] = next((e["loss"] for e in steps if e.get("loss") is not None), None)
        out["peak_mem_bytes"] = max((e.get("mem_bytes") or 0) for e in steps)
    if evals:
        out["eval_loss"] = evals[-1]["loss"]
    out["checkpoints"] = [{"step": e["step"], "path": e["path"], "seconds": e["seconds"]} for e in ckpts]
    out["errors"] = [{"kind": e["kind"], "message": e["message"], "step": e.get("step")} for e in errors]
    out["warnings"] = len(warnings)
    out["done"] = bool(done) and done[-1].get("reason")
    energy = _energy(run_dir, steps)
    if energy is not None:
        out["energy_j"] = energy
        if out.get("tokens"):
            out["energy_j_per_token"] = energy / max(1, _tokens_in_window(steps))
    tuning = run_dir / "tuning.json"
    if tuning.is_file():
        out["tuning"] = json.loads(tuning.read_text())
    return out


def _steady(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out, first = [], True
    for e in events:
        if e["type"] == "hello":
            first = True
        elif e["type"] == "step":
            if not first:
                out.append(e)
            first = False
    return out or [e for e in events if e["type"] == "step"]


def _tokens_in_window(steps: list[dict[str, Any]]) -> int:
    return steps[-1]["tokens"] - steps[0]["tokens"] if len(steps) > 1 else steps[-1]["tokens"]


def _energy(run_dir: Path, steps: list[dict[str, Any]]) -> float | None:
    path = run_dir / "device.jsonl"
    if not path.is_file() or len(steps) < 2:
        return None
    samples = [DeviceSample.from_event(e) for e in read_events(path) if e["type"] == "device"]
    if not samples:
        return None
    return energy_between(samples, steps[0]["time"], steps[-1]["time"])


def format_report(s: dict[str, Any]) -> str:
    lines = [f"run       {s['run_dir']}"]
    m = s.get("model")
    if m:
        lines.append(f"model     {m.get('family')}/{m.get('size')}  {m.get('total_params', 0) / 1e6:.1f}M params "
                     f"({m.get('active_params', 0) / 1e6:.1f}M active)  on {s.get('device')}")
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
                     f"step {_f(s.get('step_ms'), '.1f')} ms, MFU {f'{mfu:.1%}' if mfu is not None else 'n/a'}, "
                     f"peak memory {s.get('peak_mem_bytes', 0) / 2**30:.2f} GiB")
        if s.get("phases_ms"):
            total = sum(s["phases_ms"].values()) or 1
            lines.append("phases    " + "  ".join(f"{k} {v:.1f} ms ({v / total:.0%})" for k, v in s["phases_ms"].items()))
    if s.get("energy_j") is not None:
        lines.append(f"energy    {s['energy_j'] / 3600:.2f} Wh, {s.get('energy_j_per_token', 0) * 1e3:.3f} mJ/token")
    else:
        lines.append("energy    n/a (no energy counter or power readings on this device)")
    lines.append(f"checkpts  {len(s['checkpoints'])}" + (f", last {s['checkpoints'][-1]['path']}"
                                                       if s["checkpoints"] else ""))
    if s["errors"]:
        for e in s["errors"]:
            lines.append(f"error     step {e.get('step')}: {e['kind']}: {e['message']}")
    else:
        lines.append("errors    none")
    if s.get("tuning"):
        from tuner.report import format_summary

        lines.append(format_summary(s["tuning"]))
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
