"""`gptop report RUN_DIR`: what a run did, from its files alone.

Reads events.jsonl (and per-rank event files), device.jsonl and the tuning
report if there is one. Everything is computed from recorded events, so a
report of a finished run on another machine gives the same numbers. Where the
run stands comes from gptop.run_standing.
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
from array import array
from collections import deque
from pathlib import Path
from typing import Any

from trainer.contract import rundir
from trainer.contract.events import (
    PHASES,
    TUNER_RESTART,
    AlertEvent,
    CheckpointEvent,
    DoneEvent,
    ErrorEvent,
    EvalEvent,
    Event,
    ExitEvent,
    HelloEvent,
    MalformedEvent,
    ProfileEvent,
    StatusEvent,
    StepEvent,
    WarningEvent,
    from_dict,
    read_events,
    to_dict,
)
from trainer.contract.states import ErrorKind, WarningKind

from .alert_report import MAX_ALERTS, alert_lines, alert_rows
from .run_energy import run_energy
from .run_standing import NOT_REPORTED, RunStanding, end_words, standing_of
from .state import fmt_mfu, loss_range
from .state.counts import RunCounts, tokens_words


class _Skipped:
    """Malformed lines of one file: counted and skipped, the first reason kept for the report."""

    def __init__(self) -> None:
        self.count = 0
        self.first: str | None = None

    def __call__(self, line: bytes, error: MalformedEvent) -> None:
        self.count += 1
        if self.first is None:
            self.first = str(error)


class _Median:
    """The median of a stream of numbers in bounded memory: exact (a float array) up to EXACT values, then a
    histogram of log-spaced buckets RESOLUTION apart (its median is within RESOLUTION / 2 of the true one)."""

    EXACT = 200_000
    RESOLUTION = 1e-3

    def __init__(self) -> None:
        self.values: array | None = array("d")
        self.buckets: dict[int, int] = {}
        self.n = 0

    def add(self, x: float) -> None:
        self.n += 1
        if self.values is not None:
            self.values.append(x)
            if len(self.values) > self.EXACT:
                for v in self.values:
                    self._bucket(v)
                self.values = None
            return
        self._bucket(x)

    def _bucket(self, x: float) -> None:
        k = -(1 << 62) if x <= 0 else round(math.log(x) / math.log1p(self.RESOLUTION))
        self.buckets[k] = self.buckets.get(k, 0) + 1

    def median(self) -> float | None:
        if not self.n:
            return None
        if self.values is not None:
            return statistics.median(self.values)
        seen, half = 0, self.n / 2
        for k in sorted(self.buckets):
            seen += self.buckets[k]
            if seen >= half:
                return 0.0 if k == -(1 << 62) else math.exp(k * math.log1p(self.RESOLUTION))
        return None


class _Scan:
    """One streaming pass over a run's events: what the report needs, in memory bounded whatever the run's
    length (the newest MAX_ROWS checkpoints and errors, MAX_ALERTS alerts, medians in `_Median`)."""

    MAX_ROWS = 1000

    def __init__(self) -> None:
        self.hello: HelloEvent | None = None  # the newest full hello (else the newest hello)
        self.command: list[str] | None = None  # `gptop run -- CMD`: the newest hello's command
        self.hellos = self.early_hellos = 0
        self.run_gpus: set[str] = set()
        self.tuner_restarts = 0
        self.last_done: DoneEvent | None = None  # the last trainer process's own end and error
        self.last_error: ErrorEvent | None = None
        self.last_exit: ExitEvent | None = None  # gptop's record of its end
        self.last_stop: StatusEvent | None = None  # a stop that ended the run after it, before another started
        self.client: str | None = None  # a command's client, once one said hello
        self.first_step: StepEvent | None = None
        self.last_step: StepEvent | None = None
        self.counts = RunCounts()  # steps and tokens across the trainer processes (restarts, rollbacks)
        self.window = (0, 0)  # tokens processed at the first and the last step event (the energy's window)
        self.first_loss: float | None = None
        self.final_loss: float | None = None
        self.loss_steps = 0  # logged steps with a loss: one gives a value, not a range
        self.peak_mem = 0
        self.eval_loss: float | None = None
        self.eval_seen = False
        self.checkpoints: deque[CheckpointEvent] = deque(maxlen=self.MAX_ROWS)
        self.checkpoints_written = 0
        self.errors: deque[ErrorEvent] = deque(maxlen=self.MAX_ROWS)
        self.errors_total = 0
        self.warnings = 0
        self.alerts: list[AlertEvent] = []
        self.profile: ProfileEvent | None = None
        # steady state: the step events that are not a start's first (compilation, allocator warm-up); the
        # first ones too, in case no other comes (a run of one interval per start)
        self._first = True
        self.steady = {k: _Median() for k in ("tokens_per_s", "mfu", "step_ms")}
        self.firsts = {k: _Median() for k in ("tokens_per_s", "mfu", "step_ms")}
        # the phases' means per step over the same intervals, with the step's own mean beside them ("step_ms")
        self.phase_sum = {k: 0.0 for k in (*PHASES, "step_ms")}
        self.phase_w = 0.0
        self.first_phase_sum = {k: 0.0 for k in (*PHASES, "step_ms")}
        self.first_phase_w = 0.0

    def feed(self, e: Event) -> None:
        if isinstance(e, StepEvent):
            self._step(e)
        elif isinstance(e, HelloEvent):
            self.counts.hello(e)
            self.hellos += 1
            self.run_gpus.update(e.gpus or ())
            if e.command is not None:
                self.command = e.command
            if e.early:
                self.early_hellos += 1
            if e.early or not self.early_hellos:  # a new trainer process: its end is what counts
                self.last_done = self.last_error = self.last_exit = self.last_stop = None
            self.client = e.client or self.client
            if not e.early or self.hello is None or self.hello.early:
                self.hello = e
            self._first = True
        elif isinstance(e, DoneEvent):
            self.counts.count(e.step, e.tokens)
            self.last_done = e
            if e.reason == TUNER_RESTART:
                self.tuner_restarts += 1
        elif isinstance(e, ExitEvent):
            self.last_exit = e
        elif isinstance(e, StatusEvent) and e.stopped_by is not None:
            self.last_stop = e
        elif isinstance(e, ErrorEvent):
            self.last_error = e
            self.errors.append(e)
            self.errors_total += 1
        elif isinstance(e, EvalEvent):
            self.eval_loss, self.eval_seen = e.loss, True
        elif isinstance(e, CheckpointEvent):
            if e.tokens is not None:
                self.counts.count(e.step, e.tokens)
            self.checkpoints.append(e)
            self.checkpoints_written += 1
        elif isinstance(e, WarningEvent):
            self.warnings += 1
            if e.kind == WarningKind.NAN_ROLLBACK and e.step is not None:
                self.counts.rollback(e.step)
        elif isinstance(e, AlertEvent):
            self.alerts.append(e)
            if len(self.alerts) > 4 * MAX_ALERTS:  # keep what alert_rows keeps, and a margin
                self.alerts = [a for a in self.alerts if a.id in {r["id"] for r in alert_rows(self.alerts)}]
        elif isinstance(e, ProfileEvent) and e.rank == 0:
            self.profile = e

    def _step(self, e: StepEvent) -> None:
        self.counts.count(e.step, e.tokens)
        processed = self.counts.processed or 0
        if self.first_step is None:
            self.first_step = e
            self.window = (processed, processed)
        self.window = (self.window[0], processed)
        self.last_step = e
        if e.loss is not None:
            if self.first_loss is None:
                self.first_loss = e.loss
            self.final_loss = e.loss
            self.loss_steps += 1
        self.peak_mem = max(self.peak_mem, e.mem_bytes or 0)
        medians, sums = (self.firsts, self.first_phase_sum) if self._first else (self.steady, self.phase_sum)
        self._first = False
        if e.tokens_per_s:
            medians["tokens_per_s"].add(e.tokens_per_s)
        if e.mfu is not None:
            medians["mfu"].add(e.mfu)
        if e.step_ms is not None:
            medians["step_ms"].add(e.step_ms)
        if e.phases_ms:
            w = e.interval_steps or 1
            for k in PHASES:
                sums[k] += (e.phases_ms.get(k) or 0.0) * w
            sums["step_ms"] += (e.step_ms if e.step_ms is not None else sum(v or 0.0 for v in e.phases_ms.values())) * w
            if sums is self.phase_sum:
                self.phase_w += w
            else:
                self.first_phase_w += w


def summarize(run_dir: Path) -> dict[str, Any]:
    """The report of a run, from one streaming pass over its events and one over its device samples."""
    run_dir = Path(run_dir)
    events_path = run_dir / "events.jsonl"
    if not events_path.is_file():
        from trainer.contract.config import ConfigError

        raise ConfigError("RUN_DIR", f"{run_dir} has no events.jsonl; is it a gptop run directory?")
    skipped = {"events.jsonl": _Skipped(), "device.jsonl": _Skipped()}
    scan = _Scan()
    for e in read_events(events_path, on_malformed=skipped["events.jsonl"]):
        scan.feed(e)
    hello = scan.hello
    out: dict[str, Any] = {"run_dir": str(run_dir)}
    if hello:
        out.update(
            model=to_dict(hello.model),
            device=hello.device.name,
            toggles=hello.reported_toggles,  # as the process said them: a client's program says few
            peak_flops=hello.peak_flops,
            peak_source=hello.peak_source,
            mfu_is_estimate=hello.mfu_is_estimate,
            max_steps=hello.max_steps,
        )
    out["starts"] = scan.early_hellos or scan.hellos  # one early hello per trainer process
    out["tuner_restarts"] = scan.tuner_restarts
    kept = rundir.list_checkpoints(run_dir) if scan.command is None else []
    end = standing_of(
        run_dir,
        scan.last_done,
        scan.last_error,
        scan.last_exit,
        stop=scan.last_stop,
        newest_checkpoint=kept[-1].step if kept else None,
    )
    out["state"], out["state_words"] = end.state.value, end.words
    out["done"] = end.done is not None and end.done.reason  # the last trainer's end (a tuner's restart is not)
    if scan.last_exit is not None and end.state is not RunStanding.RUNNING:
        out["exit"] = _exit(scan.last_exit)
    command = scan.command
    if command is not None:
        out["command"] = command  # `gptop run -- CMD`
        out["client"] = scan.client  # None: nothing inside it reported steps, the model or checkpoints
    last_step, counts = scan.last_step, scan.counts
    if counts.step is not None and (last_step is not None or counts.step):
        # kept: the steps the run holds; processed: every step trained, rolled back or not (gptop.state.counts)
        out.update(steps=counts.step, tokens=counts.tokens, tokens_processed=counts.processed)
        out.update(steps_rolled_back=counts.rolled_back_steps, tokens_rolled_back=counts.rolled_back_tokens)
    if last_step is not None:
        out.update(_speed(scan))
    if scan.eval_seen:
        out["eval_loss"] = scan.eval_loss
    out["checkpoints"] = [{"step": e.step, "path": e.path, "seconds": e.seconds} for e in scan.checkpoints]
    out["checkpoints_written"] = scan.checkpoints_written
    if command is None:
        out["checkpoints_kept"] = [{"step": c.step, "path": str(c.path)} for c in kept]
    else:  # the program's own that are still there; a file saved again (ckpt.pt) once, at its newest step
        newest = {e.path: e for e in scan.checkpoints}
        out["checkpoints_kept"] = [
            {"step": e.step, "path": e.path} for e in scan.checkpoints if newest[e.path] is e and Path(e.path).exists()
        ]
    out["errors"] = [_error(e) for e in scan.errors]
    if scan.errors_total > len(scan.errors):
        out["errors_total"] = scan.errors_total
    out["warnings"] = scan.warnings
    out["alerts"] = alert_rows(scan.alerts)
    if scan.profile is not None:
        out["profile"] = to_dict(scan.profile)  # the newest window (trainer.profile_summary)
    out.update(_energy_fields(run_dir, scan, skipped["device.jsonl"]))
    tuning, problem = _tuning(run_dir / "tuning.json")
    if tuning is not None:
        out["tuning"] = tuning
    if problem is not None:
        out["tuning_skipped"] = problem
    bad = {name: {"lines": s.count, "first": s.first} for name, s in skipped.items() if s.count}
    if bad:
        out["malformed"] = bad
    return out


def _exit(e: ExitEvent) -> dict[str, Any]:
    """gptop's record of how the last process ended, every field written (null: not known), with its words."""
    keys = ("pid", "exit_code", "signal", "seconds", "stopped_by", "stderr")
    return {**{k: getattr(e, k) for k in keys}, "words": end_words(e)}


def _speed(scan: "_Scan") -> dict[str, Any]:
    """The run's speed, phases and loss, from its steady state: the first interval of each start (compilation,
    allocator warm-up) is left out where there is more."""
    steady = scan.steady if any(m.n for m in scan.steady.values()) else scan.firsts
    out: dict[str, Any] = {"tokens_per_s": steady["tokens_per_s"].median(), "mfu": steady["mfu"].median()}
    sums, w = (scan.phase_sum, scan.phase_w) if steady is scan.steady else (scan.first_phase_sum, scan.first_phase_w)
    if w:
        out["phases_ms"] = {k: sums[k] / w for k in PHASES}
        out["phases_step_ms"] = sums["step_ms"] / w  # the mean step of the same steps as phases_ms
    out["step_ms"] = steady["step_ms"].median()
    out["speed_intervals"] = max(m.n for m in steady.values())  # the log intervals the medians are of
    out.update(
        final_loss=scan.final_loss, first_loss=scan.first_loss, loss_steps=scan.loss_steps, peak_mem_bytes=scan.peak_mem
    )
    return out


def _energy_fields(run_dir: Path, scan: "_Scan", skipped: "_Skipped") -> dict[str, Any]:
    """The energy between the run's first and last step event, all its processes and the restarts between them,
    per token processed in that time (the rolled-back steps' included: the device did that work); or why there
    is none."""
    first, last = scan.first_step, scan.last_step
    if first is None or last is None or first is last:
        return {"energy_unavailable": "fewer than two step events"}
    energy, why = run_energy(run_dir, first.time, last.time, skipped, scan.run_gpus)
    if energy is None:
        return {"energy_unavailable": why}
    out: dict[str, Any] = {"energy_j": energy.joules, "energy_source": energy.source}
    tokens = scan.window[1] - scan.window[0]
    if tokens > 0:
        out["energy_j_per_token"] = energy.joules / tokens
    return out


STDERR_LINES = 5  # a failed process's last stderr lines in the report


def _error(e: ErrorEvent) -> dict[str, Any]:
    """An error for the report; a disk error with its file, errno text and free bytes."""
    out: dict[str, Any] = {"kind": e.kind, "message": e.message, "step": e.step}
    if e.kind == ErrorKind.DISK:
        out.update(path=e.path, os_error=e.os_error, free_bytes=e.free_bytes)
    return out


def _tuning(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """tuning.json as the tuner wrote it, or (None, why it was skipped): a damaged file is reported, not fatal."""
    if not path.is_file():
        return None, None
    from tuner.tuning_report import check_report

    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None, f"{path.name}: not readable JSON ({e})"
    problem = check_report(data)
    if problem is not None:
        return None, f"{path.name}: {problem}"
    return data, None


def format_report(s: dict[str, Any]) -> str:
    """The report as `gptop report` prints it: one labelled line per figure, from `summarize`'s dict."""
    lines = _run_lines(s) + _speed_lines(s) + _outcome_lines(s) + alert_lines(s) + _appendix_lines(s)
    return "\n".join(lines)


def _run_lines(s: dict[str, Any]) -> list[str]:
    """Which run, what it trains, its toggles, where it stands and how far it got."""
    lines = [f"run       {s['run_dir']}"]
    if s.get("command"):
        lines.append(f"command   {shlex.join(s['command'])}")
    m = s.get("model")
    unreported = s.get("command") is not None and s.get("client") is None
    if unreported:
        lines.append(f"model     unknown: {NOT_REPORTED}")
    elif m:
        name = "/".join(str(x) for x in (m.get("family"), m.get("size")) if x) or "?"
        lines.append(
            f"model     {name}  {(m.get('total_params') or 0) / 1e6:.1f}M params "
            f"({(m.get('active_params') or 0) / 1e6:.1f}M active)  on {s.get('device')}"
        )
    if s.get("toggles"):
        t = s["toggles"]
        lines.append("toggles   " + "  ".join(f"{k}={v}" for k, v in t.items()))
    lines.append(f"state     {s['state_words']}")
    starts = f"{s['starts']} start(s)" + (
        f" ({s['tuner_restarts']} by the tuner's restarts)" if s.get("tuner_restarts") else ""
    )
    if unreported:
        lines.append(f"progress  steps {NOT_REPORTED}; {starts}")
    elif "steps" not in s:
        lines.append(f"progress  no step done, {starts}")
    else:
        tokens = tokens_words(s["tokens"], s.get("tokens_processed"), s.get("steps_rolled_back", 0), "{:,}".format)
        lines.append(f"progress  {s['steps']}/{s.get('max_steps')} steps, {tokens}, {starts}")
    return lines


def _speed_lines(s: dict[str, Any]) -> list[str]:
    """Loss, speed, memory and the phases of the steady steps; none before a step event."""
    if "final_loss" not in s:
        return []
    lines = [
        f"loss      {loss_range(s.get('first_loss'), s.get('final_loss'), s.get('loss_steps'), '.4f')}"
        + (f"  (eval {_f(s.get('eval_loss'))})" if s.get("eval_loss") is not None else "")
    ]
    mfu = s.get("mfu")
    n = s.get("speed_intervals")
    lines.append(
        f"speed     {_f(s.get('tokens_per_s'), '.0f')} tokens/s, step {_f(s.get('step_ms'), '.1f')} ms, "
        f"MFU {fmt_mfu(mfu, bool(s.get('mfu_is_estimate')))}: medians of "
        + (f"{n} " if n else "the ")
        + "steady log intervals (a start's first left out)"
    )
    lines.append(f"memory    peak {s.get('peak_mem_bytes', 0) / 2**30:.2f} GiB")
    if s.get("peak_flops"):
        lines.append(
            f"mfu peak  {s['peak_flops'] / 1e9:,.1f} GFLOP/s per process"
            + (f" ({s['peak_source']})" if s.get("peak_source") else "")
        )
    if s.get("phases_ms"):
        step = s.get("phases_step_ms") or sum(s["phases_ms"].values()) or 1
        lines.append(
            "phases    "
            + "  ".join(f"{k} {v:.1f} ms ({v / step:.0%})" for k, v in s["phases_ms"].items())
            + f"  = step {step:.1f} ms: means per step of the same intervals"
        )
    return lines


def _outcome_lines(s: dict[str, Any]) -> list[str]:
    """The energy used, the checkpoints written and kept, and the errors."""
    lines = []
    if s.get("energy_j") is not None:
        lines.append(
            f"energy    {s['energy_j'] / 3600:.2f} Wh, {s.get('energy_j_per_token', 0) * 1e3:.3f} mJ/token processed"
            f" ({s.get('energy_source', 'measured')})"
        )
    else:
        lines.append(f"energy    n/a ({s.get('energy_unavailable') or 'no energy reading'})")
    kept = s.get("checkpoints_kept") or []  # on disk now (pruned by --keep-checkpoints, rolled back by the tuner)
    if s.get("command") is not None and s.get("client") is None:
        lines.append(f"checkpts  {NOT_REPORTED}")
    else:
        lines.append(
            f"checkpts  {s.get('checkpoints_written', len(s['checkpoints']))} written, {len(kept)} kept"
            + (f", newest {kept[-1]['path']}" if kept else "")
        )
    for e in s["errors"]:
        lines.append(f"error     step {e.get('step')}: {e['kind']}: {e['message']}")
    end = s.get("exit") or {}
    if end.get("stderr"):  # a failure's last words, whether or not the process said why
        lines.append(f"exit      {end['words']}; its last stderr lines:")
        lines += [f"            {line}" for line in end["stderr"][-STDERR_LINES:]]
    elif not s["errors"]:
        lines.append("errors    none")
    return lines


def _appendix_lines(s: dict[str, Any]) -> list[str]:
    """The newest profile window, the tuning's summary (or why it was skipped) and the malformed lines skipped."""
    lines: list[str] = []
    if s.get("profile"):
        from .profile_text import profile_lines

        profile = from_dict(s["profile"])
        if isinstance(profile, ProfileEvent):
            lines += profile_lines(profile)
    if s.get("tuning"):
        from tuner.tuning_report import format_summary

        lines.append(format_summary(s["tuning"]))
    if s.get("tuning_skipped"):
        lines.append(f"tuning    skipped: {s['tuning_skipped']}")
    for name, bad in (s.get("malformed") or {}).items():
        lines.append(f"skipped   {bad['lines']} malformed line(s) in {name} (first: {bad['first']})")
    return lines


def _f(v: float | None, spec: str = ".4f") -> str:
    return "n/a" if v is None else format(v, spec)


def print_report(run_dir: Path, json_out: bool = False) -> int:
    s = summarize(run_dir)
    if json_out:
        print(json.dumps(s, default=str))  # one line: --json's one meaning (JSON lines)
    else:
        print(format_report(s))
    if s["state"] == RunStanding.FAILED.value:
        return 1
    return 0 if not s["errors"] or s.get("done") or s["state"] == RunStanding.RUNNING.value else 1
