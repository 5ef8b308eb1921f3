"""The end-of-run summary (gptop.summary): built from the reduced state and the run directory."""

from __future__ import annotations

import io

import pytest

from fixtures.streams import cpu_run, ev, gpu_run, loss_at
from gptop.state import RunState
from gptop.summary import outcome, print_summary, summary_lines
from trainer.contract import rundir
from trainer.contract.states import ERROR_KINDS, ERROR_WORDS


def state_of(events, run_dir, status="running", message=None) -> RunState:
    state = RunState(run_dir=str(run_dir), status="running")
    for e in events:
        state.apply(e)
    state.set_status(status, message)
    return state


def checkpoint(run_dir, step: int) -> None:
    p = rundir.path_for(run_dir, step)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"x")


def line(lines: list[str], label: str) -> str:
    hits = [l for l in lines if l.strip().startswith(label)]
    assert hits, f"no {label!r} line in:\n" + "\n".join(lines)
    return hits[0]


def test_a_finished_run_says_where_what_and_how_fast(tmp_path):
    events = gpu_run(tuning_done=True)
    events.append(ev("done", 80.0, step=300, tokens=300 * 32 * 256, reason="max_steps"))
    checkpoint(tmp_path, 200)
    checkpoint(tmp_path, 300)
    (tmp_path / rundir.BEST_TOML).write_text("")
    state = state_of(events, tmp_path, "done")
    lines = summary_lines(state, 0)
    assert lines[0].startswith("gptop: run finished: 300 steps after ")
    assert line(lines, "run dir").endswith(str(tmp_path))
    assert "300/1000 steps, 2.5M tokens" in line(lines, "progress")
    # the first logged loss (step 10) to the last (step 300), and the last eval
    assert line(lines, "loss").endswith(
        f"{loss_at(10):.3f} -> {loss_at(300):.3f} (last eval {loss_at(300) + 0.05:.3f} at step 300)"
    )
    speed = line(lines, "speed")
    assert "tokens/s (median)" in speed and "MFU 3" in speed
    energy = line(lines, "energy")  # the fake H100's counter: 450 J/s, as the dashboard shows it
    assert energy.endswith("mJ/token over the last steps (NVML energy counter)")
    ckpt = line(lines, "checkpoint")
    assert "step-00000300.pt (step 300; 1 written, 2 kept)" in ckpt
    assert "applied trial 1; its settings are in" in line(lines, "tuning")
    assert line(lines, "export").endswith(f"gptop export {tmp_path} OUT_DIR")  # nothing left to resume
    assert not [l for l in lines if "--resume" in l]
    assert line(lines, "report").endswith(f"gptop report {tmp_path}")
    assert outcome(state, 0) == "finished"


def test_the_tuning_line_says_what_tuning_gained_or_lost(tmp_path):
    """The end summary carries the tuning ledger's net (tuning.json): what the run gained or lost against not
    tuning, the trials' own cost included; a damaged tuning.json costs only that part."""
    import json

    events = gpu_run(tuning_done=True)
    events.append(ev("done", 80.0, step=300, tokens=300 * 32 * 256, reason="max_steps"))
    ledger = {"tuning_s": 60.0, "budget_s": 600.0, "cost_s": 20.0, "switch_s": 6.0, "saving_s": 90.0, "net_s": 64.0}
    (tmp_path / rundir.TUNING_JSON).write_text(json.dumps({"ledger": ledger}))
    lines = summary_lines(state_of(events, tmp_path, "done"), 0)
    assert line(lines, "tuning").endswith(
        "applied trial 1; net +1m04s against not tuning (saves 1m30s; tuning cost 20s; switch 6s)"
    )
    kept = [e for e in events if e.type != "apply"]  # tuning that kept the start: a net loss
    (tmp_path / rundir.TUNING_JSON).write_text(
        json.dumps({"ledger": {**ledger, "saving_s": 0.0, "switch_s": 0.0, "net_s": -20.0}})
    )
    assert line(summary_lines(state_of(kept, tmp_path, "done"), 0), "tuning").endswith(
        "kept the starting configuration; net -20s against not tuning (tuning cost 20s)"
    )
    (tmp_path / rundir.TUNING_JSON).write_text('{"ledger": {"net_s": "a lot"}}')
    assert not [l for l in summary_lines(state_of(kept, tmp_path, "done"), 0) if l.strip().startswith("tuning")]


def test_a_stopped_run_says_how_to_resume(tmp_path):
    events = cpu_run(steps=60)
    events.append(ev("done", 40.0, step=60, tokens=60 * 1024, reason="stop requested"))
    checkpoint(tmp_path, 60)
    state = state_of(events, tmp_path / "", "stopped")
    lines = summary_lines(state, 130)
    assert lines[0].startswith("gptop: run stopped at step 60")
    assert "60/200 steps" in line(lines, "progress")
    assert line(lines, "resume").endswith(f"gptop train --resume {tmp_path}")
    assert "0 written, 1 kept" in line(lines, "checkpoint")


def test_a_run_stopped_before_any_step(tmp_path):
    state = state_of(cpu_run(steps=0), tmp_path, "stopped")
    lines = summary_lines(state, 130)
    assert lines[0].startswith("gptop: run stopped before the first step")
    assert "no step was completed" in line(lines, "progress")
    assert line(lines, "checkpoint").endswith("none: the run stopped before its first step (nothing to checkpoint)")
    assert not [l for l in lines if l.strip().startswith(("resume", "loss", "speed", "energy"))]
    assert line(lines, "report")


def test_the_summary_says_why_there_is_no_checkpoint(tmp_path):
    forced = (
        "a second stop (Ctrl-C or q twice) ended the trainer (signal 9) before its first checkpoint: steps "
        "1-20 are lost"
    )
    state = state_of(cpu_run(steps=20), tmp_path, "stopped", forced)
    assert line(summary_lines(state, 130), "checkpoint").endswith(f"none: {forced}")
    events = cpu_run(steps=20) + [ev("error", 12.0, kind="oom", message="out of memory", step=20)]
    state = state_of(events, tmp_path, "failed")
    assert line(summary_lines(state, 1), "checkpoint").endswith(
        "none: the run failed at step 20, before its first checkpoint (--checkpoint-every 200)"
    )
    kept = (
        "a second stop (Ctrl-C or q twice) ended the trainer (signal 9) after its checkpoint of step 20: nothing "
        "is lost"
    )
    checkpoint(tmp_path, 20)
    state = state_of(cpu_run(steps=20), tmp_path, "stopped", kept)
    lines = summary_lines(state, 130)
    assert line(lines, "stopped").endswith(kept) and "step-00000020.pt" in line(lines, "checkpoint")


def test_no_energy_reading_says_why(tmp_path):
    state = state_of(cpu_run(), tmp_path, "stopped")  # the telemetry said why
    assert "n/a: no CPU package energy: RAPL" in line(summary_lines(state, 130), "energy")
    no_samples = [e for e in cpu_run() if e.type != "device"]  # nothing said why (no samples, an older gptop)
    state = state_of(no_samples, tmp_path, "stopped")
    assert "n/a: not enough device samples yet" in line(summary_lines(state, 130), "energy")
    assert "MFU n/a" in line(summary_lines(state, 130), "speed")


@pytest.mark.parametrize("kind", ERROR_KINDS + ("disk_full",))
def test_a_failed_run_names_the_error_in_words_and_the_log(tmp_path, kind):
    events = cpu_run(steps=30)
    events.append(ev("error", 20.0, kind=kind, message="what the trainer said", step=30))
    state = state_of(events, tmp_path, "failed", f"trainer failed (exit code 1): {kind}: what the trainer said")
    lines = summary_lines(state, 1)
    assert lines[0].startswith("gptop: run failed at step 30")
    words = ERROR_WORDS.get(kind, "disk full")
    assert line(lines, "error").endswith(f"{words}: what the trainer said")
    assert line(lines, "log").endswith(str(tmp_path / "trainer.stderr.log"))
    assert outcome(state, 1) == "failed"


def test_every_error_kind_has_words():
    assert set(ERROR_WORDS) == set(ERROR_KINDS)


def test_a_failure_without_an_error_event_shows_the_session_message(tmp_path):
    state = state_of(cpu_run(steps=20), tmp_path, "failed", "trainer died (killed by signal 9) without reporting")
    assert "trainer died (killed by signal 9)" in line(summary_lines(state, 1), "error")


def test_a_stop_reads_as_stopped_and_an_error_while_stopping_as_failed(tmp_path):
    state = state_of(cpu_run(steps=20), tmp_path, "stopped", "the trainer ended (signal 9) before it checkpointed")
    assert summary_lines(state, 130)[0].startswith("gptop: run stopped at step 20")
    events = cpu_run(steps=20) + [ev("error", 12.0, kind="disk", message="no space left", step=20)]
    state = state_of(events, tmp_path, "failed", "stopped: trainer failed (exit code 1): disk: no space left")
    lines = summary_lines(state, 130)
    assert lines[0].startswith("gptop: run failed at step 20") and "disk full or read-only" in line(lines, "error")


def test_a_run_dir_with_spaces_is_quoted_in_the_commands(tmp_path):
    run_dir = tmp_path / "my run"
    checkpoint(run_dir, 10)
    state = state_of(cpu_run(steps=20), run_dir, "stopped")
    assert line(summary_lines(state, 130), "resume").endswith(f"gptop train --resume '{run_dir}'")


def test_print_summary_writes_the_lines_and_survives_a_closed_stream(tmp_path):
    state = state_of(cpu_run(steps=20), tmp_path, "stopped")
    out = io.StringIO()
    print_summary(state, 130, out)
    assert out.getvalue().splitlines() == summary_lines(state, 130)
    closed = io.StringIO()
    closed.close()
    print_summary(state, 130, closed)  # no exception


def test_the_dashboard_path_prints_the_summary_after_the_app_closes(tmp_path, monkeypatch, capsys):
    """`gptop train` (the TUI): the summary comes on stdout once the app has given the terminal back."""
    import gptop.ui.app as app
    from gptop import cli

    def closed_app(session, resume=None, **kw):
        for e in cpu_run(steps=20):
            session.state.apply(e)
        session.state.set_status("stopped")
        return 130

    monkeypatch.setattr(app, "run_app", closed_app)
    monkeypatch.setattr(cli, "has_terminal", lambda: True)
    run_dir = tmp_path / "run"
    assert cli.main(["train", "--model", "llama", "--size", "tiny", "--run-dir", str(run_dir)]) == 130
    out = capsys.readouterr().out
    assert out.startswith("gptop: run stopped at step 20") and f"gptop report {run_dir}" in out


def test_report_says_checkpoints_written_and_kept(tmp_path):
    """`gptop report`: written (events) vs kept (on disk now, after --keep-checkpoints pruning)."""
    from gptop.report import format_report, summarize
    from trainer.contract.events import dumps

    events = cpu_run(steps=30) + [
        ev("checkpoint", 20.0 + s, step=s, path=str(rundir.path_for(tmp_path, s)), seconds=0.1) for s in (10, 20, 30)
    ]
    (tmp_path / "events.jsonl").write_text("".join(dumps(e) + "\n" for e in events))
    checkpoint(tmp_path, 30)
    text = format_report(summarize(tmp_path))
    assert f"checkpts  3 written, 1 kept, newest {rundir.path_for(tmp_path, 30)}" in text


def test_steps_after_the_last_logged_one_count(tmp_path):
    """A stop between log steps: the done event's step and tokens, not the last step event's."""
    events = cpu_run(steps=50) + [ev("done", 30.0, step=55, tokens=55 * 1024, reason="stop requested")]
    lines = summary_lines(state_of(events, tmp_path, "stopped"), 130)
    assert lines[0].startswith("gptop: run stopped at step 55") and "55/200 steps" in line(lines, "progress")
    early = [e for e in cpu_run(steps=0)] + [ev("done", 3.0, step=0, tokens=0, reason="stop requested")]
    assert "before the first step" in summary_lines(state_of(early, tmp_path, "stopped"), 130)[0]


# --- gptop report: where a run stands ----------------------------------------------------------------------


def write_events(run_dir, events) -> None:
    from trainer.contract.events import dumps

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "events.jsonl").write_text("".join(dumps(e) + "\n" for e in events))


def early_hello(t: float):
    """The hello each trainer process sends before it builds anything (one per start)."""
    from trainer.contract.events import to_dict

    fields = {k: v for k, v in to_dict(cpu_run(steps=0)[0]).items() if k not in ("v", "type", "time", "rank")}
    return ev("hello", t, **{**fields, "early": True})


def tuned_run(t_end: float = 80.0) -> list:
    """A run being tuned: its first trainer ended by the tuner's restart (SIGTERM to the trainer), a second
    one training since."""
    from trainer.contract.events import TUNER_RESTART

    first = [early_hello(0.0)] + cpu_run(steps=40)
    second = [early_hello(t_end - 20)] + [e for e in cpu_run(steps=60) if e.type == "step" and e.step > 40]
    return first + [ev("done", 25.0, step=40, tokens=40 * 1024, reason=TUNER_RESTART)] + second


def test_report_of_a_run_whose_lock_is_held_says_running(tmp_path):
    """`gptop report` while `gptop tune` works on the run: running, not `finished: SIGTERM` (the tuner's
    restart of the trainer is not the run's end)."""
    from gptop.report import format_report, summarize
    from trainer.contract.runlock import RunLock

    run = tmp_path / "run"
    write_events(run, tuned_run())
    with RunLock.acquire(run, command="gptop tune"):
        s = summarize(run)
        text = format_report(s)
    assert s["state"] == "running" and not s["done"]
    assert "state     running now (pid" in text and "gptop tune" in text
    assert "finished" not in text and "SIGTERM" not in text
    assert "2 start(s) (1 by the tuner's restarts)" in text and "60/200 steps" in text


@pytest.mark.parametrize(
    "tail, state, words",
    [
        ([], "cut short", "ended without a word from its last process"),
        ([("done", {"step": 60, "tokens": 60 * 1024, "reason": "max_steps"})], "finished", "finished at step 60"),
        (
            [("done", {"step": 60, "tokens": 60 * 1024, "reason": "stop requested"})],
            "stopped",
            "stopped at step 60 (stop requested)",
        ),
        ([("error", {"kind": "oom", "message": "out of memory", "step": 60})], "failed", "failed at step 60: oom"),
        (
            [("done", {"step": 60, "tokens": 60 * 1024, "reason": "restart by the tuner"})],
            "cut short",
            "ended during a restart by the tuner",
        ),
    ],
)
def test_report_of_an_ended_run_says_how_its_last_trainer_ended(tmp_path, tail, state, words):
    from gptop.report import format_report, summarize

    run = tmp_path / "run"
    write_events(run, tuned_run() + [ev(kind, 90.0, **fields) for kind, fields in tail])
    s = summarize(run)
    assert s["state"] == state and words in format_report(s), format_report(s)


DONE_60 = {"step": 60, "tokens": 60 * 1024}


@pytest.mark.parametrize(
    "tail, state, words, code",
    [
        (
            [("done", {**DONE_60, "reason": "stop requested"}), ("exit", {"exit_code": 0, "stopped_by": "user"})],
            "stopped",
            "state     stopped by you (exit 0) at step 60 after 0:12",
            0,
        ),
        ([("exit", {"signal": 9, "seconds": 12.0})], "failed", "state     killed by signal 9 (SIGKILL) after 0:12", 1),
        ([("exit", {"exit_code": 2, "stderr": ["boom"]})], "failed", "state     failed (exit 2) after 0:12: boom", 1),
        (
            [("error", {"kind": "oom", "message": "out of memory", "step": 60}), ("exit", {"exit_code": 1})],
            "failed",
            "state     failed (exit 1) at step 60 after 0:12: oom: out of memory",
            1,
        ),
        (
            [
                ("done", {**DONE_60, "reason": "restart by the tuner"}),
                ("exit", {"exit_code": 0, "stopped_by": "tuner"}),
            ],
            "cut short",
            "ended during a restart by the tuner at step 60",
            0,
        ),
        (
            [
                ("done", {**DONE_60, "reason": "tuning done (--tune-only)"}),
                ("exit", {"exit_code": 0, "stopped_by": "gptop"}),
            ],
            "stopped",
            "state     stopped by gptop (exit 0) at step 60",
            0,
        ),
        (  # a forced stop after the last step: still a finished run
            [("done", {**DONE_60, "reason": "max_steps"}), ("exit", {"signal": 9, "stopped_by": "user"})],
            "finished",
            "state     finished at step 60 (--max-steps)",
            0,
        ),
        (  # a SIGTERM sent to the trainer itself: its own graceful stop
            [("done", {**DONE_60, "reason": "SIGTERM"}), ("exit", {"exit_code": 0})],
            "stopped",
            "state     stopped at step 60 (SIGTERM), exit 0",
            0,
        ),
        (  # your stop between the tuner's restart's two processes: gptop's record of it after the `exit`
            [
                ("done", {**DONE_60, "reason": "restart by the tuner", "checkpoint": "step-00000060.pt"}),
                ("exit", {"exit_code": 0, "stopped_by": "tuner"}),
                ("status", {"status": "stopped", "stopped_by": "user"}),
            ],
            "stopped",
            "state     stopped by you during a restart by the tuner at step 60, after its checkpoint of step 60 "
            "(the next process was not started)",
            0,
        ),
        (  # gptop's own planned end there, and no checkpoint said
            [
                ("done", {**DONE_60, "reason": "restart by the tuner"}),
                ("exit", {"exit_code": 0, "stopped_by": "tuner"}),
                ("status", {"status": "stopped", "stopped_by": "gptop"}),
            ],
            "stopped",
            "state     stopped by gptop during a restart by the tuner at step 60 (the next process",
            0,
        ),
        (  # a status without whose stop (a --json line copied in): not a record of a stop
            [
                ("done", {**DONE_60, "reason": "restart by the tuner"}),
                ("exit", {"exit_code": 0, "stopped_by": "tuner"}),
                ("status", {"status": "stopped"}),
            ],
            "cut short",
            "ended during a restart by the tuner at step 60",
            0,
        ),
    ],
)
def test_report_says_how_the_last_process_ended_from_gptops_record_of_its_end(tmp_path, tail, state, words, code):
    """gptop's `exit` event, with what the process itself said: who ended it and how (a run without the event
    reads as before: the test above)."""
    from gptop.report import format_report, print_report, summarize

    run = tmp_path / "run"
    tail = [(k, {"seconds": 12.0, **f} if k == "exit" else f) for k, f in tail]
    write_events(run, tuned_run() + [ev(kind, 90.0, **fields) for kind, fields in tail])
    s = summarize(run)
    assert s["state"] == state and words in format_report(s), format_report(s)
    assert print_report(run) == code


def test_a_stop_record_before_a_later_process_is_not_the_runs_end(tmp_path):
    """gptop's record of a stop between two processes belongs to that gap: a later process (a `--resume`) ends
    the run its own way."""
    from gptop.report import summarize

    run = tmp_path / "run"
    first = tuned_run()
    restart = first.index(next(e for e in first[1:] if e.type == "hello" and e.early))
    gap = [ev("exit", 25.0, exit_code=0, stopped_by="tuner"), ev("status", 25.5, status="stopped", stopped_by="user")]
    write_events(run, first[:restart] + gap + first[restart:] + [ev("exit", 90.0, exit_code=1, stderr=["boom"])])
    s = summarize(run)
    assert s["state"] == "failed" and "boom" in s["state_words"], s["state_words"]


@pytest.mark.parametrize("kept", [False, True])
def test_a_process_stopped_before_its_first_step_says_whether_the_run_has_a_checkpoint(tmp_path, kept):
    """A run's first process stopped in its startup made no checkpoint; a restart stopped in its startup (the
    tuner's next trial, a --resume) loses nothing: the report says which, from the checkpoints on disk."""
    from gptop.report import format_report, summarize
    from trainer.contract.events import STOPPED_BEFORE_FIRST_STEP

    run = tmp_path / "run"
    stop = [
        ev("done", 91.0, step=0, tokens=0, reason=STOPPED_BEFORE_FIRST_STEP),
        ev("exit", 92.0, exit_code=0, stopped_by="user"),
    ]
    write_events(run, tuned_run() + [early_hello(90.0)] + stop)
    if kept:
        (run / "checkpoints").mkdir()
        (run / "checkpoints" / "step-00000040.pt").write_bytes(b"x")
    text = format_report(summarize(run))
    if kept:
        assert (
            "stopped by you (exit 0) before its process's first step: nothing lost, the newest checkpoint is "
            "step 40" in text
        ), text
    else:
        assert "stopped by you (exit 0) before its first step: a run that made no checkpoint" in text, text


def test_an_earlier_processs_exit_is_not_the_runs_end(tmp_path):
    """A failed process that gptop restarted (--restart-on-failure): the run is how its last process ended;
    gptop killed with its last process (no record, no word) is cut short, whatever the earlier ones did."""
    from gptop.report import format_report, summarize

    run = tmp_path / "run"
    failed = [ev("exit", 25.0, exit_code=1, stderr=["boom"])]
    first = tuned_run()
    restart = first.index(next(e for e in first[1:] if e.type == "hello" and e.early))
    write_events(run, first[:restart] + failed + first[restart:])
    s = summarize(run)
    assert s["state"] == "cut short" and "ended without a word" in format_report(s) and "exit" not in s
    write_events(run, first[:restart] + failed + first[restart:] + [ev("exit", 90.0, exit_code=0)])
    assert summarize(run)["state"] == "finished"


@pytest.mark.parametrize(
    "status, code, exit_fields, head",
    [
        ("failed", 1, {"signal": 9}, "gptop: run killed by signal 9 (SIGKILL) at step 60"),
        ("failed", 1, {"exit_code": 3, "stderr": ["boom"]}, "gptop: run failed (exit 3) at step 60"),
        ("stopped", 130, {"exit_code": 0, "stopped_by": "user"}, "gptop: run stopped by you at step 60"),
        # your stop after the tuner's restart ended the process, before the next one started
        ("stopped", 130, {"exit_code": 0, "stopped_by": "tuner"}, "gptop: run stopped by you at step 60"),
        ("done", 0, {"exit_code": 0}, "gptop: run finished: 60 steps"),
    ],
)
def test_the_summary_head_says_how_the_process_ended(tmp_path, status, code, exit_fields, head):
    events = cpu_run(steps=60) + [ev("exit", 70.0, **exit_fields)]
    state = state_of(events, tmp_path, status)
    assert summary_lines(state, code)[0].startswith(head), summary_lines(state, code)[0]


def test_report_of_a_run_stopped_before_its_first_step(tmp_path):
    """What gptop made for a run stopped before its first step (events and lock, no config.toml, no
    checkpoints): report, export, sample and --resume all say what it is, not 'not a run directory'."""
    from gptop.report import format_report, summarize
    from trainer.contract import inputs, tools
    from trainer.contract.config import ConfigError
    from trainer.contract.events import STOPPED_BEFORE_FIRST_STEP

    run = tmp_path / "run"
    write_events(run, [early_hello(0.0), ev("done", 1.0, step=0, tokens=0, reason=STOPPED_BEFORE_FIRST_STEP)])
    (run / ".gptop.lock").write_text("")
    (run / "device.jsonl").write_text("")
    text = format_report(summarize(run))
    assert "state     stopped before its first step: a run that made no checkpoint" in text
    assert "progress  no step done, 1 start(s)" in text
    for check in (lambda: tools.checkpoints_to_try(run, None), lambda: inputs.check_resume(str(run))):
        with pytest.raises(ConfigError) as e:
            check()
        assert "not a run directory" not in e.value.message
        assert "stopped before its first step" in e.value.message and "no checkpoint" in e.value.message


@pytest.mark.slow
@pytest.mark.process
def test_report_of_a_live_tuned_run_says_running_then_how_it_ended(tmp_path):
    """`gptop report` while `gptop tune` restarts the trainer between trials: running (the tuner's restarts are
    not the run's end, whatever their `done` says); after a stop: stopped."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from helpers import COURSE_ONLY, ROOT, TINY
    from trainer.contract.events import TUNER_RESTART, read_events

    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    gptop = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gptop",
            "--no-ui",
            "tune",
            "--budget",
            "10m",
            *COURSE_ONLY,  # the baseline settles, and the first trial's restart comes, sooner on a loaded machine
            *TINY,
            "--global-batch",
            "8",
            "--max-steps",
            "100000",
            "--tune-space",
            "-all micro_batch=1,2,4,8",
            "--storage",
            f"sqlite:///{tmp_path / 's.db'}",
            "--run-dir",
            str(run),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )

    def restarted() -> bool:
        evs = list(read_events(run / "events.jsonl")) if (run / "events.jsonl").exists() else []
        ends = [i for i, e in enumerate(evs) if e.type == "done" and e.reason == TUNER_RESTART]
        return bool(ends) and any(e.type == "step" for e in evs[ends[0] :])

    try:
        deadline = time.monotonic() + 400
        while not restarted():
            assert gptop.poll() is None and time.monotonic() < deadline, gptop.stderr.read()[-2000:]
            time.sleep(0.5)
        report = subprocess.run(
            [sys.executable, "-m", "gptop", "report", str(run)], capture_output=True, text=True, env=env, timeout=120
        )
        assert report.returncode == 0, report.stderr
        assert "state     running now (pid" in report.stdout and "gptop tune" in report.stdout, report.stdout
        assert "finished" not in report.stdout and "by the tuner's restarts" in report.stdout
        gptop.send_signal(signal.SIGTERM)
        assert gptop.wait(300) == 130
    finally:
        if gptop.poll() is None:
            gptop.kill()
            gptop.wait()
    after = subprocess.run(
        [sys.executable, "-m", "gptop", "report", str(run)], capture_output=True, text=True, env=env, timeout=120
    )
    # the stop may reach a trainer that is training, starting, or stopping for the tuner's next restart, or come
    # between two processes: each is recorded as yours
    assert "state     stopped by you " in after.stdout and "running" not in after.stdout, after.stdout


def test_one_logged_step_is_a_loss_value_not_a_range(tmp_path):
    """A run shorter than its log interval logs one step: its loss is one value, not 'x -> x' (which reads as
    nothing learned); the report says the same from the files."""
    from gptop.state import loss_range

    events = cpu_run(steps=10)  # one step event, at step 10
    events.append(ev("done", 9.0, step=10, tokens=10 * 8 * 128, reason="max_steps"))
    lines = summary_lines(state_of(events, tmp_path, "done"), 0)
    assert line(lines, "loss").endswith(f"{loss_at(10):.3f} (one logged step)")
    assert loss_range(9.5, 4.25, 2) == "9.500 -> 4.250" and loss_range(None, None, 0) == "n/a -> n/a"
    assert loss_range(9.5, 9.5, 1, ".4f") == "9.5000 (one logged step)"


def test_the_report_of_one_logged_step_gives_its_loss_as_a_value(tmp_path):
    from gptop.report import format_report, summarize
    from trainer.contract.events import dumps

    run = tmp_path / "run"
    run.mkdir()
    events = cpu_run(steps=10) + [ev("done", 9.0, step=10, tokens=10 * 8 * 128, reason="max_steps")]
    (run / "events.jsonl").write_text("".join(dumps(e) + "\n" for e in events))
    s = summarize(run)
    assert s["loss_steps"] == 1
    assert f"{loss_at(10):.4f} (one logged step)" in format_report(s)
