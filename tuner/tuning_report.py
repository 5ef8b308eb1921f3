"""The tuning report: `tuning.json`, `tuning.md` and `best.toml` in the run directory.

The table lists every trial of the study (this run's and earlier runs' of the
same setup, marked), each as its changes against the starting configuration,
so a reader sees what was tried and why it won or lost; proposals skipped
because they could not pay in this run, repeats and withdrawn ones are only
counted. The ledger weighs what tuning cost (wall time minus the time the
kept steps would have taken at the starting speed, so slow, restarting and
rolled-back trials count, useful steps do not) and the switch that follows
it against the projected saving over the rest of the run: its net is what
the run gains or loses against not tuning. It lists the decisions that
shaped the tuning with their figures (`TuneController.report_info`).

`best.toml` holds only a `[toggles]` table: `gptop train --config best.toml`
(or `python -m trainer --config best.toml`) reproduces the best setting with
every other option from the command line. It is checked to round-trip
through `config_from_toml` before it is written. For a user's script (`gptop
tune -- CMD`) its comment says how to apply it to that script instead: the
TrainingArguments fields to set, or the same toggles through the script's
`tuned_args` (GPTOP_TOGGLES) under `gptop run`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import tempfile
from pathlib import Path
from typing import Any, Iterable

import tomli_w
from optuna.trial import TrialState

from trainer.contract import rundir
from trainer.contract.atomic import atomic_write
from trainer.contract.client import TOGGLES_ENV
from trainer.contract.config import Toggles, config_from_toml, section_from_dict
from trainer.contract.training_args import fields_in_words
from trainer.contract.events import json_safe

from .budget import format_duration
from .load import Load
from .report_words import seconds_words, budget_words, ledger_lines, net_line, realized_words
from .space import TUNABLE
from .storage import dashboard_command
from .study import TuneStudy
from .windows import ratio_words


def _fmt_val(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def toggles_diff(toggles: dict[str, Any], base: dict[str, Any]) -> str:
    """`compile=default, fused_adamw=on` (what differs from the start), or `(start)`."""
    parts = [f"{k}={_fmt_val(toggles[k])}" for k in TUNABLE if k in toggles and toggles.get(k) != base.get(k)]
    return ", ".join(parts) if parts else "(start)"


def _fmt_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)) or n <= 0:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def _fmt_tps(v: Any, spread: Any = None) -> str:
    if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        return "-"
    if isinstance(spread, (int, float)) and math.isfinite(spread):
        return f"{v:,.0f} ± {spread:,.0f}"
    return f"{v:,.0f}"


def _fmt_jpt(v: Any) -> str:
    """Energy per token in mJ (a trial's, from the session's energy readings), "-" without one."""
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        return "-"
    return f"{v * 1e3:.3g} mJ"


def trial_rows(study: TuneStudy, run_id: str | None, base: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """One row per distinct trial (duplicates and withdrawn proposals are only counted; skipped ones are
    counted by `TuneStudy.skipped`)."""
    rows, hidden = [], 0
    for t in study.trials():
        ua = t.user_attrs
        if t.state == TrialState.FAIL and ua.get("status") == "skipped":
            continue
        if "duplicate_of" in ua or t.state in (TrialState.WAITING, TrialState.FAIL) and ua.get("status") == "withdrawn":
            hidden += 1
            continue
        if t.state == TrialState.WAITING:
            continue
        toggles = dataclasses.asdict(study.toggles_of(t))
        status = ua.get("status") or t.state.name.lower()
        if t.state == TrialState.RUNNING:
            status = "running"
        remeasures = study.get_attr(f"remeasure:{t.number}", [])
        rows.append(
            {
                "number": t.number,
                "run": "this" if ua.get("run") == run_id else "earlier",
                "source": ua.get("source", "sampler"),
                "state": t.state.name,
                "status": status,
                "reason": ua.get("reason", ""),
                "kind": ua.get("kind"),
                "toggles": toggles,
                "changes": toggles_diff(toggles, base),
                "tokens_per_s": ua.get("tokens_per_s"),
                "spread": ua.get("spread"),
                "peak_mem": ua.get("peak_mem"),
                "energy_per_token": ua.get("energy_per_token"),
                "duration_s": ua.get("duration_s"),
                "overhead_s": ua.get("overhead_s"),
                # the advice it tried (source "advice"), and what the compile watchdog said while it ran
                "advice": ua.get("advice"),
                "compile": ua.get("compile"),
                "unsteady": bool(ua.get("unsteady")),
                "load": ua.get("load"),  # the background load it was measured under (tuner.load)
                "remeasures": [
                    {k: r.get(k) for k in ("run", "status", "tokens_per_s", "spread", "reason", "load")}
                    for r in remeasures
                ],
            }
        )
    return rows, hidden


def build_report(study: TuneStudy, info: dict[str, Any]) -> dict[str, Any]:
    """The report as data (what tuning.json holds) from the study and `TuneController.report_info()`."""
    base = info["base"]
    rows, hidden = trial_rows(study, info.get("run"), base)
    speedup = info.get("best_speedup")
    return {
        "study": info.get("study", study.name),
        "storage": study.storage_url,
        "key": info.get("key", study.key),
        "run": info.get("run"),
        "device": info.get("device"),
        "base": base,
        "baseline": info.get("baseline"),
        "best": info.get("best"),
        "best_number": info.get("best_number"),
        "best_tokens_per_s": info.get("best_tokens_per_s"),
        "best_spread": info.get("best_spread"),
        "speedup": speedup,
        "speedup_lo": info.get("best_speedup_lo"),
        "speedup_hi": info.get("best_speedup_hi"),
        "best_load": info.get("best_load"),
        "best_label": info.get("best_label"),
        "applied": info.get("applied"),
        "decision": info.get("decision"),
        "outcome": info.get("outcome"),
        "ledger": info.get("ledger", {}),
        "trials": rows,
        "hidden_duplicates": hidden,
        "memory": info.get("memory"),
    }


def render_markdown(report: dict[str, Any]) -> str:
    """tuning.md: the summary, the ledger and the trial table."""
    energy = any(_fmt_jpt(r.get("energy_per_token")) != "-" for r in report["trials"])
    lines = [
        "# Tuning report",
        "",
        *_summary_lines(report),
        "",
        "## Ledger",
        "",
        *_ledger_lines(report.get("ledger") or {}),
        "",
        "## Trials",
        "",
        *_trial_table(report, energy),
        "",
    ]
    return "\n".join(lines)


def _summary_lines(report: dict[str, Any]) -> list[str]:
    base = report["base"]
    baseline = report.get("baseline") or {}
    lines: list[str] = []
    key = report.get("key") or {}
    lines.append(
        f"Study `{report['study']}`: {key.get('device', '?')} x{key.get('device_count', 1)}, "
        f"{key.get('model', '?')} {key.get('size', '')}, seq_len {key.get('seq_len')}, "
        f"global batch {key.get('global_batch')}."
    )
    if report.get("storage"):
        lines += ["", f"Storage `{report['storage']}`; to browse every trial: `{dashboard_command(report['storage'])}`"]
    lines.append("")
    lines.append(f"- Outcome: {report.get('outcome') or '-'}")
    lines.append(
        f"- Starting configuration: {_fmt_tps(baseline.get('tokens_per_s'), baseline.get('spread'))} tokens/s"
        + (
            f", {_fmt_jpt(baseline.get('energy_per_token'))}/token"
            if _fmt_jpt(baseline.get("energy_per_token")) != "-"
            else ""
        )
        + _load_words(baseline.get("load"))
        + (
            " (never measured to its precision target: no speed-up is claimed against it)"
            if baseline and baseline.get("holds") is False
            else ""
        )
    )
    if report.get("best"):
        lines.append(
            f"- Best ({report.get('best_label') or 'trial ' + str(report.get('best_number'))}): "
            f"{toggles_diff(report['best'], base)} — "
            f"{_fmt_tps(report.get('best_tokens_per_s'), report.get('best_spread'))} tokens/s"
            + (f", **{speedup_words(report)}** the start" if report.get("speedup") else "")
            + (_load_words(report.get("best_load"), "both measured under ") if report.get("speedup") else "")
        )
    lines.append(f"- Applied: {toggles_diff(report['applied'], base) if report.get('applied') else 'no'}")
    real = realized_words(report.get("ledger") or {})
    if real:
        lines.append(f"- Checked on the live run after the switch: {real}")
    mem = report.get("memory")
    if isinstance(mem, dict) and mem.get("reason"):
        tried = "; ".join(
            f"{n} {', '.join(_fmt_val(v) for v in vals)}"
            for n, vals in (mem.get("choices") or {}).items()
            if isinstance(vals, list) and len(vals) > 1
        )
        lines.append(
            f"- Memory: {mem['reason']}, so the space was widened to the memory-saving choices "
            f"({tried or 'none the device supports'}); a low-bit optimizer or a quantized base is "
            f"numerics-changing: its trials had the loss check"
        )
    dec = report.get("decision")
    if dec:
        lines.append(
            f"- Decision: {dec['reason']} (saving {dec['expected_saving_s']:.0f}s, switch cost {dec['cost_s']:.0f}s)"
        )
    return lines


def _ledger_lines(led: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    lines.append(
        f"- Tuning time: {budget_words(led)}"
        + f"; {led.get('trials_run', 0)} trials run, {led.get('screened', 0)} screened out without running"
        + (f", {led['skipped']} proposals skipped (they could not pay in this run)" if led.get("skipped") else "")
    )
    for line in ledger_lines(led):
        lines.append(f"- {line}")
    lines.append(f"- Rolled back (failed trials): {format_duration(led.get('rolled_back_s', 0.0))}")
    decisions = [d for d in led.get("decisions") or [] if isinstance(d, dict) and d.get("reason")]
    if decisions:
        lines += ["", "### Decisions", ""]
        for d in decisions:
            at = f"step {d['step']}: " if isinstance(d.get("step"), int) else ""
            lines.append(
                f"- {at}{d['reason']} (saving {seconds_words(d.get('expected_saving_s'))}, cost {seconds_words(d.get('cost_s'))})"
            )
    return lines


def _trial_table(report: dict[str, Any], energy: bool) -> list[str]:
    lines = [
        "| # | run | source | changes vs start | tokens/s | peak mem |"
        + (" energy/token |" if energy else "")
        + " status | reason |",
        "|---|---|---|---|---|---|" + ("---|" if energy else "") + "---|---|",
    ]
    for r in report["trials"]:
        tps = _fmt_tps(r.get("tokens_per_s"), r.get("spread"))
        for rm in r.get("remeasures", []):
            tps += f"; re: {_fmt_tps(rm.get('tokens_per_s'), rm.get('spread'))}"
        reason = r.get("reason") or ""
        if r.get("advice"):
            reason = f"advice: {r['advice']}" + (f"; {reason}" if reason else "")
        reason = reason.replace("|", "/")
        status = r["status"] + (", kept recompiling" if r.get("unsteady") else "")
        jpt = f" {_fmt_jpt(r.get('energy_per_token'))} |" if energy else ""
        lines.append(
            f"| {r['number']} | {r['run']} | {r['source']} | {r['changes']} | {tps} | "
            f"{_fmt_bytes(r.get('peak_mem'))} |{jpt} {status} | {reason} |"
        )
    if report.get("hidden_duplicates"):
        lines += [
            "",
            f"{report['hidden_duplicates']} repeated proposals were answered from earlier trials "
            "without running (not listed).",
        ]
    lines += [
        "",
        "Tokens/s: median after warm-up ± half-width of its 95% confidence interval. Peak mem: the trial "
        "process's peak (CUDA: allocated by tensors; CPU: resident set), from its step events, or from its "
        "out-of-memory error when it failed before a step; - where none came.",
    ]
    if energy:
        lines.append(
            "Energy/token: the devices' energy over the trial's measured steps (hardware counters where "
            "the device has them, else integrated power) / the tokens of those steps."
        )
    return lines


def speedup_words(report: dict[str, Any]) -> str:
    """'1.31x (1.24-1.38x)': the best's speed-up with its interval, as the report holds them."""
    lo, hi = report.get("speedup_lo"), report.get("speedup_hi")
    num = (int, float)
    return ratio_words(report["speedup"], lo if isinstance(lo, num) else None, hi if isinstance(hi, num) else None)


def _load_words(d: Any, lead: str = "under ") -> str:
    """' (under other processes 0.1 of 2 cores, load average 1.0)', or '' when the load was not tracked."""
    load = Load.from_dict(d)
    return f" ({lead}{load.words()})" if load is not None else ""


_NUMBER = (int, float)
# What format_summary reads from tuning.json, and the types it may hold (None allowed everywhere).
_REPORT_FIELDS: dict[str, tuple[type, ...]] = {
    "base": (dict,),
    "ledger": (dict,),
    "baseline": (dict,),
    "trials": (list,),
    "best": (dict,),
    "best_number": (int,),
    "best_tokens_per_s": _NUMBER,
    "best_spread": _NUMBER,
    "speedup": _NUMBER,
    "speedup_lo": _NUMBER,
    "speedup_hi": _NUMBER,
    "best_load": (dict,),
    "outcome": (str,),
    "applied": (dict,),
    "study": (str,),
    "storage": (str,),
    "memory": (dict,),
    "best_label": (str,),
}
_LEDGER_FIELDS = (
    "tuning_s",
    "budget_s",
    "projected_saving_s",
    "cost_s",
    "switch_s",
    "saving_s",
    "net_s",
    "saving_per_step_s",
)
_BASELINE_FIELDS = ("tokens_per_s",)


def check_report(report: Any) -> str | None:
    """Why a tuning.json (read back from disk) cannot be summarized, or None when it can: the report
    is data written by another run, perhaps damaged or edited, and must never crash `gptop report`."""
    if not isinstance(report, dict):
        return f"not a JSON object but {type(report).__name__}"
    for key, types in _REPORT_FIELDS.items():
        v = report.get(key)
        if v is not None and (not isinstance(v, types) or isinstance(v, bool) and bool not in types):
            return f"{key!r} is {type(v).__name__}, expected {' or '.join(t.__name__ for t in types)}"
    real = (report.get("ledger") or {}).get("realized") if isinstance(report.get("ledger"), dict) else None
    if real is not None and not isinstance(real, dict):
        return f"'ledger.realized' is {type(real).__name__}, expected an object"
    for section, keys in (("ledger", _LEDGER_FIELDS), ("baseline", _BASELINE_FIELDS)):
        for key in keys:
            v = (report.get(section) or {}).get(key)
            if v is not None and (not isinstance(v, _NUMBER) or isinstance(v, bool)):
                return f"'{section}.{key}' is {type(v).__name__}, expected a number"
    for i, t in enumerate(report.get("trials") or []):
        if not isinstance(t, dict):
            return f"trials[{i}] is {type(t).__name__}, expected an object"
        for key in ("run", "status"):
            if t.get(key) is not None and not isinstance(t[key], str):
                return f"trials[{i}].{key} is {type(t[key]).__name__}, expected a string"
    return None


def in_parens(items: Iterable[str], sep: str = ", ") -> str:
    """' (a, b)' for a list shown after a phrase, '' for an empty one: a report never prints '()'."""
    items = [i for i in items if i]
    return f" ({sep.join(items)})" if items else ""


def format_summary(report: dict[str, Any]) -> str:
    """A few lines for `gptop report` from a tuning.json dict (labels padded to 10 like its other lines)."""
    base = report.get("base") or {}
    led = report.get("ledger") or {}
    baseline = report.get("baseline") or {}
    trials = report.get("trials") or []
    counts: dict[str, int] = {}
    for t in trials:
        if t.get("run") == "this":
            counts[t.get("status", "?")] = counts.get(t.get("status", "?"), 0) + 1
    lines = []
    best = report.get("best")
    if best:
        line = (
            f"tuning    best ({report.get('best_label') or 'trial ' + str(report.get('best_number'))}): "
            f"{toggles_diff(best, base)}, "
            f"{_fmt_tps(report.get('best_tokens_per_s'), report.get('best_spread'))} tokens/s"
        )
        best_row = next(
            (t for t in trials if isinstance(t, dict) and t.get("number") == report.get("best_number")), None
        )
        if best_row is not None and _fmt_jpt(best_row.get("energy_per_token")) != "-":
            line += f", {_fmt_jpt(best_row.get('energy_per_token'))}/token"
        if report.get("speedup"):
            line += f", {speedup_words(report)} the start"
            if "own baseline" not in (report.get("best_label") or ""):  # else against that run's start
                line += f" ({_fmt_tps(baseline.get('tokens_per_s'))})"
        lines.append(line)
    elif baseline.get("tokens_per_s"):
        lines.append(
            f"tuning    best: the start ({_fmt_tps(baseline.get('tokens_per_s'), baseline.get('spread'))} "
            "tokens/s); no other configuration measured holds against it"
        )
    else:
        lines.append("tuning    no feasible configuration measured")
    outcome = report.get("outcome") or "-"
    lines.append(f"          {outcome}" if report.get("applied") else f"          not applied: {outcome}")
    real = realized_words(led)
    if real:
        lines.append(f"          {real}")
    lines.append(
        f"          {sum(counts.values())} trials this run"
        + in_parens(f"{n} {k}" for k, n in sorted(counts.items()))
        + f" in {budget_words(led)}"
        + (
            f"; projected saving {format_duration(led['projected_saving_s'])}"
            if isinstance(led.get("projected_saving_s"), (int, float))
            else ""
        )
    )
    net = net_line(led)
    if net:
        lines.append(f"          {net}")
    mem = report.get("memory")
    if isinstance(mem, dict) and isinstance(mem.get("reason"), str):
        lines.append(f"          memory-constrained: {mem['reason']}")
    if report.get("storage"):
        lines.append(f"          study {report.get('study') or '?'} in {report['storage']}")
        lines.append(f"          browse it: {dashboard_command(report['storage'])}")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class TunedCommand:
    """The script `gptop tune -- CMD` tuned, as best.toml tells how to apply its best setting: the command, the
    toggles it started with and its per-device batch of an optimizer step (None: its hello did not say)."""

    argv: list[str]
    start: Toggles
    per_device: int | None


def best_toml(toggles: Toggles | dict[str, Any], command: TunedCommand | None = None) -> str:
    """best.toml text: a comment (how to use it: gptop train's --config, or for a script its own arguments) and
    a [toggles] table, nothing else."""
    d = dataclasses.asdict(toggles) if isinstance(toggles, Toggles) else dict(toggles)
    table = {k: d[k] for k in (f.name for f in dataclasses.fields(Toggles)) if k in d}
    body = tomli_w.dumps({"toggles": table})
    if command is None:
        return "# Best toggles found by gptop tune. Use: gptop train --config best.toml\n" + body
    return "".join(f"# {line}\n" for line in command_use(section_from_dict(Toggles, table), command)) + body


def command_use(toggles: Toggles, command: TunedCommand) -> list[str]:
    """best.toml's comment for a script: not gptop train flags, but its TrainingArguments, or its tuned_args."""
    cmd = shlex.join(command.argv)
    words = fields_in_words(toggles, command.start, command.per_device) if command.per_device else None
    env = json.dumps(dataclasses.asdict(toggles), sort_keys=True, separators=(",", ":"))
    lines = [f"Best settings gptop tune found for: {cmd}"]
    if words == "":
        return lines + ["They are the script's own settings: nothing to change."]
    lines.append("They are not gptop train flags. To train with them:")
    if words:
        lines += ["  set these TrainingArguments in the script:", f"    {words}", "  or"]
    lines += [
        "  keep the script as it is: its tuned_args(args) applies them under gptop run, given as",
        f"    {TOGGLES_ENV}={shlex.quote(env)} gptop run -- {cmd}",
    ]
    return lines


def check_best_toml(text: str, expected: Toggles | dict[str, Any]) -> None:
    """Raise if `text` does not load through config_from_toml to exactly `expected` and validate."""
    exp = expected if isinstance(expected, Toggles) else section_from_dict(Toggles, expected)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "best.toml"
        p.write_text(text)
        cfg = config_from_toml(p)
    if cfg.toggles.quantize_base != "none":
        cfg.finetune.lora = 8  # a quantized base is a LoRA run's: best.toml is used beside the run's --lora R
    cfg.validate()
    if cfg.toggles != exp:
        raise ValueError(f"best.toml does not round-trip: {cfg.toggles} != {exp}")


def write_report(
    out_dir: str | Path, study: TuneStudy, info: dict[str, Any], command: TunedCommand | None = None
) -> dict[str, Path]:
    """Write tuning.json, tuning.md and best.toml (the best measured toggles, or the start) into `out_dir`;
    `command`: the script tuned, whose best.toml says how to apply it to that script."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(study, info)
    paths = {"json": out / rundir.TUNING_JSON, "md": out / rundir.TUNING_MD, "toml": out / rundir.BEST_TOML}
    atomic_write(paths["json"], json.dumps(json_safe(report), indent=2, default=str, allow_nan=False) + "\n")
    atomic_write(paths["md"], render_markdown(report))
    best = report.get("best") or report["base"]
    text = best_toml(best, command)
    check_best_toml(text, best)
    atomic_write(paths["toml"], text)
    return paths
