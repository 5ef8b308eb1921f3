"""End to end: `gptop tune` while another process takes the cores in bursts (on and off every few seconds), with
real trainer processes. The tuner must not claim what it did not deliver (issue 41): no setting stays applied
whose realized speed is below the start's, and every ratio it prints rests on measurements of the same load.

The burners (tests/fixtures/burner.py, one per core) follow a schedule the test knows, so it can also check the
tuner's claims against what the steps show: the steps of the process that trains on with the applied setting
against the start's own steps, each side counted only in the quiet between bursts. The run is stopped (Ctrl-C)
once the tuner is done and the process that trains on has made steps: what follows is plain training.
"""

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures.burner import busy
from helpers import wait_for
from test_tuner_budget_words import seconds
from test_tuning_e2e import SETUP, SLOW_START, after_the_decision, events, gptop_env, processes
from tuner.load import Load

pytestmark = [pytest.mark.slow, pytest.mark.process, pytest.mark.solo]

BURNER = Path(__file__).parent / "fixtures" / "burner.py"
ON_S, OFF_S = 3.0, 3.0
SPACE = "-all micro_batch=1,4,8 activation_checkpointing=on,off"


def quiet_rate(steps: list[dict], start: float, tokens_per_step: int) -> float | None:
    """The median tokens/s of the steps that ran wholly between bursts (None with fewer than 5)."""
    rates = [
        tokens_per_step / (e["step_ms"] / 1000.0)
        for e in steps
        if e["step_ms"]
        and not busy(e["time"], start, ON_S, OFF_S)
        and not busy(e["time"] - e["step_ms"] / 1000.0, start, ON_S, OFF_S)
    ]
    return statistics.median(rates) if len(rates) >= 5 else None


def stable_loads(row: dict) -> list[Load | None]:
    """The loads of a report row's measurements that reached their target: its own and its re-measurements'."""
    out = [Load.from_dict(row.get("load"))] if row.get("status") == "ok" else []
    return out + [Load.from_dict(r.get("load")) for r in row.get("remeasures") or [] if r.get("status") == "ok"]


def test_a_tuning_under_bursts_of_load_claims_only_what_holds(tmp_path):
    run_dir, storage = tmp_path / "run", f"sqlite:///{tmp_path / 'study.sqlite3'}"
    start = time.time() + 2.0
    burners = [
        subprocess.Popen([sys.executable, str(BURNER), str(start), str(ON_S), str(OFF_S)])
        for _ in range(os.cpu_count() or 1)
    ]
    out_path, err_path = tmp_path / "gptop.out", tmp_path / "gptop.err"
    try:
        with open(out_path, "w") as out, open(err_path, "w") as err:
            p = subprocess.Popen(
                [sys.executable, "-m", "gptop", "--no-ui", "tune", "--budget", "60s", *SETUP, *SLOW_START,
                 "--max-steps", "800", "--checkpoint-every", "0", "--tune-space", SPACE, "--storage", storage,
                 "--run-dir", str(run_dir)],
                stdout=out, stderr=err, text=True, env=gptop_env(),
            )  # fmt: skip
            try:
                wait_for(
                    lambda: (
                        p.poll() is not None
                        or len([e for e in after_the_decision(run_dir) or [] if e["type"] == "step"]) >= 10
                    ),
                    420,
                    "the tuner's end and steps of the process that trains on",
                    poll=1.0,
                )
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
                rc = p.wait(120)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    finally:
        for b in burners:
            b.kill()
            b.wait()
    text = out_path.read_text()
    assert rc in (0, 130), f"exit {rc}\n" + err_path.read_text()[-3000:] + text[-3000:]
    assert "tuning stopped by an internal error" not in text, err_path.read_text()[-3000:]
    report = json.loads((run_dir / "tuning.json").read_text())
    led = report["ledger"]
    rows = {r["number"]: r for r in report["trials"] if r["run"] == "this"}
    base = report["base"]
    start_rows = [r for r in rows.values() if r["toggles"] == base]
    start_loads = [x for r in start_rows for x in stable_loads(r)]

    # every ratio shown rests on measurements that reached their target under the same load
    if report.get("speedup") is not None:
        claim = Load.from_dict(report.get("best_load"))
        best = rows.get(report["best_number"])
        assert best is not None and any(claim is None or claim.same_as(x) for x in stable_loads(best)), best
        assert any(claim is None or claim.same_as(x) for x in start_loads), (claim, start_rows)
    real = led.get("realized")
    if real and real.get("ratio"):
        at = Load.from_dict(real.get("load"))
        assert any(at is None or at.same_as(x) for x in start_loads), (at, start_rows)
    for e in events(run_dir, "trial"):  # a measurement that did not reach its target is no claim
        if e["status"] == "cut" and e.get("kind") == "check":  # the applied setting's check (its trial's number)
            assert "not verified" in e["reason"] and not (real or {}).get("ratio"), (e, real)
        elif e["status"] == "cut":
            assert (
                report.get("best_number") != e["number"]
                or report.get("speedup") is None
                or any(r.get("status") == "ok" for r in rows[e["number"]]["remeasures"])
            )

    # no setting stays applied whose realized speed is below the start's
    applied = events(run_dir, "apply")
    procs = processes(run_dir)
    final = procs[-1]["hello"]["config"]["toggles"]
    if applied:
        assert real is not None, led
        if real.get("ratio") and real["ratio"][2] < 1.0:
            assert final == base and real["switch_back"]
        else:
            assert final == applied[-1]["toggles"]
            assert real.get("ratio") is None or real.get("switch_s") is not None  # the switch's cost, measured
            tokens = 8 * 64  # --global-batch 8 of --seq-len 64
            applied_rate = quiet_rate(procs[-1]["steps"], start, tokens)
            start_rate = quiet_rate(procs[0]["steps"], start, tokens)  # the baseline runs on the first process
            if applied_rate is not None and start_rate is not None:
                assert applied_rate >= 0.97 * start_rate, (applied_rate, start_rate)
    else:
        assert final == base
    # the words: an interval beside every ratio, budgets that add up
    for line in text.splitlines():
        for ratio in re.findall(r"\d+\.\d\dx(?! over)(.{0,14})", line):
            assert re.match(r" \(\d+\.\d\d-\d+\.\d\dx\)", ratio), line
    md = (run_dir / "tuning.md").read_text()
    for x, y in re.findall(r"(\S+) of a (\S+) budget", md):
        assert seconds(x) <= seconds(y), md
