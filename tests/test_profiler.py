"""Profiler traces (`--profile-steps A-B`, the `p` key): Chrome-trace JSON with a range per step and per phase.

The trainer runs in this process; the traces are read back with a JSON parser, as Perfetto would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import TINY, gptop_cmd, gptop_env, train_in_process
from gptop.log_filter import is_library_chatter
from trainer.contract.config import ConfigError, parse_step_range
from trainer.timing import CpuTimer, WallTimer
from trainer.train import EXIT_OK

PHASES = ("data", "forward", "backward", "optimizer")


def train(run_dir: Path, *args: str) -> list:
    code, events, _ = train_in_process(run_dir, *args)
    assert code == EXIT_OK
    return events


def ranges(trace: Path) -> list[dict]:
    """The trace's `record_function` ranges (complete events of the user_annotation category)."""
    events = json.loads(trace.read_text())["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"]


def within(inner: dict, outer: dict) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3


@pytest.mark.slow
def test_trace_has_a_range_per_step_and_phase(tmp_path):
    """Steps 2-3 of 4 (numbered from 1, as the step events), two micro-batches per step."""
    events = train(tmp_path / "r", "--max-steps", "4", "--micro-batch", "2", "--profile-steps", "2-3")
    trace = tmp_path / "r" / "profiles" / "steps-2-3.json"
    got = ranges(trace)
    steps = {e["name"]: e for e in got if e["name"].startswith("ProfilerStep#")}
    assert sorted(steps) == ["ProfilerStep#2", "ProfilerStep#3"]
    assert [e.step for e in events if e.type == "step"] == [1, 2, 3, 4]  # the same numbering
    for name in PHASES:
        spans = [e for e in got if e["name"] == name]
        per_step = {s: [e for e in spans if within(e, steps[s])] for s in steps}
        want = 1 if name == "optimizer" else 2  # once per micro-batch
        assert all(len(v) == want for v in per_step.values()), (name, per_step)
        assert len(spans) == 2 * want  # none outside a step
    logs = [e for e in events if e.type == "log" and "profiler trace" in e.message]
    assert len(logs) == 1 and "steps 2-3" in logs[0].message and logs[0].path == str(trace)


def test_a_run_that_ends_inside_the_window_writes_what_it_recorded(tmp_path):
    train(tmp_path / "r", "--max-steps", "3", "--profile-steps", "2-9")
    files = sorted(p.name for p in (tmp_path / "r" / "profiles").iterdir())
    assert files == ["steps-2-3.json", "steps-2-3.summary.json"]  # the trace and its summary
    trace = tmp_path / "r" / "profiles" / "steps-2-3.json"
    names = {e["name"] for e in ranges(trace)}
    assert {"ProfilerStep#2", "ProfilerStep#3", *PHASES} <= names and "ProfilerStep#1" not in names


def test_phase_ranges_only_while_recording(tmp_path):
    """The `p` key's path: request(first, n). Outside a window a phase opens no range (annotate is None)."""
    import torch

    from trainer.profiler import StepProfiler

    written = []
    timer = CpuTimer()
    prof = StepProfiler(tmp_path, 0, False, None, on_written=lambda p, a, b, summary: written.append((p.name, a, b)))
    prof.request(5, 2)
    for number in range(4, 8):
        prof.step_begin(number, timer)
        assert (timer.annotate is not None) == (number in (5, 6))
        timer.begin_step(number)
        with timer.phase("forward"):
            torch.ones(4) @ torch.ones(4)
        timer.end_step()
        prof.step_end(number)
    assert written == [("steps-5-6.json", 5, 6)] and timer.annotate is None
    names = [e["name"] for e in ranges(tmp_path / "steps-5-6.json")]
    assert sorted(names) == ["ProfilerStep#5", "ProfilerStep#6", "forward", "forward"]
    assert [t.step for t in timer.collect()] == [4, 5, 6, 7]  # timing unchanged throughout


def test_wall_timer_still_marks_phases_while_profiling(tmp_path):
    """--no-timing times no phase, yet a trace still shows them."""
    from trainer.profiler import StepProfiler

    timer = WallTimer()
    prof = StepProfiler(tmp_path, 0, False, (1, 1), on_written=lambda *a: None)
    prof.step_begin(1, timer)
    timer.begin_step(1)
    with timer.phase("data"):
        pass
    timer.end_step()
    prof.step_end(1)
    assert {"ProfilerStep#1", "data"} <= {e["name"] for e in ranges(tmp_path / "steps-1-1.json")}
    assert timer.collect()[0].phases_ms is None


@pytest.mark.parametrize("text", ["0-2", "3-1", "2", "a-b", "-1-2"])
def test_invalid_ranges_are_refused(text):
    with pytest.raises(ConfigError) as e:
        parse_step_range(text)
    assert e.value.option == "--profile-steps"
    assert parse_step_range("1-1") == (1, 1)


def test_gptop_refuses_step_zero(capsys, monkeypatch):
    from gptop import cli

    monkeypatch.setattr(cli, "Session", lambda *a, **k: pytest.fail("a session was created"))
    try:
        code = cli.main(["train", "--profile-steps", "0-2"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "--profile-steps" in err and "numbered from 1" in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "line, chatter",
    [
        ("USDT:2026-11-25 13:05:21 6702:6702 SyncActivityProfilerHandler.cpp:52] profiler_start", True),
        ("STAGE:2024-01-22 16:37:54 3419:3419 ActivityProfilerController.cpp:314] Completed Stage: Warm Up", True),
        ("[rank1]:USDT:2026-11-25 13:05:21 6702:6702 SyncActivityProfilerHandler.cpp:59] profiler_stop", True),
        ("USDT: a line of the model's own", False),
        ("Traceback (most recent call last):", False),
    ],
)
def test_kineto_lines_stay_out_of_the_log_panel(line, chatter):
    assert is_library_chatter(line) is chatter


@pytest.mark.slow
@pytest.mark.process
def test_headless_log_has_no_kineto_lines(tmp_path):
    """`gptop --no-ui train --profile-steps`: the trace is written, the trainer's stderr file keeps kineto's
    lines and the log gptop shows does not."""
    import subprocess

    from helpers import ROOT

    run_dir = tmp_path / "r"
    r = subprocess.run(
        gptop_cmd(
            "--no-ui",
            "train",
            *TINY,
            "--max-steps",
            "2",
            "--profile-steps",
            "1-1",
            "--run-dir",
            str(run_dir),
        ),
        cwd=ROOT,
        env=gptop_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run_dir / "profiles" / "steps-1-1.json").is_file()
    assert "profiler trace of steps 1-1" in r.stdout + r.stderr
    kept = (run_dir / "trainer.stderr.log").read_text()
    shown = r.stdout + r.stderr
    assert not [line for line in shown.splitlines() if "USDT:" in line or "STAGE:" in line], shown[-3000:]
    assert "USDT:" in kept or "STAGE:" in kept  # this torch's kineto does print them: the filter is what hides them
