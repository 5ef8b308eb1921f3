"""The dashboard in a real terminal (a pty): how a user or a process manager ends it.

`q` and SIGTERM/SIGINT stop the run with a checkpoint and close the dashboard (exit 130); after the run
ended they close the dashboard with the run's own exit code; SIGHUP (the terminal went away) leaves no
trainer behind. Each case ends with the summary printed under the closed dashboard."""

from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest

from helpers import TINY, gptop_cmd
from fixtures.terminal import Terminal
from helpers import wait_for
from trainer.contract import rundir
from trainer.contract.events import read_events

pytestmark = [pytest.mark.slow, pytest.mark.process]

ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>]")


def events(run_dir):
    p = run_dir / "events.jsonl"
    return list(read_events(p)) if p.exists() else []


def dashboard(run_dir, *args: str) -> Terminal:
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="120", LINES="40")
    return Terminal(gptop_cmd("train", *TINY, "--run-dir", str(run_dir), *args), cols=120, rows=40, env=env)


def trainer_pids(run_dir) -> list[int]:
    return [e.pid for e in events(run_dir) if e.type == "hello" and not e.early]


def screen_text(term: Terminal) -> str:
    return ANSI.sub("", term.output())


@pytest.mark.parametrize("how", ["q", "ctrl+c", "SIGTERM", "SIGINT"])
def test_a_stop_during_the_run_checkpoints_and_closes_the_dashboard(tmp_path, how):
    """Ctrl-C in the terminal is a key to the dashboard (raw mode: no SIGINT): the reflex key stops with a
    checkpoint, as q does."""
    run_dir = tmp_path / "run"
    term = dashboard(run_dir, "--max-steps", "100000")
    try:
        wait_for(lambda: [e for e in events(run_dir) if e.type == "step"], what="a step event")
        if how in ("q", "ctrl+c"):
            term.send(b"q" if how == "q" else b"\x03")
        else:
            term.proc.send_signal(getattr(signal, how))
        assert term.proc.wait(120) == 130
    finally:
        term.close()
    *evs, end = events(run_dir)
    assert end.type == "exit" and end.stopped_by == "user"  # gptop's record of the trainer's end, last
    assert evs[-1].type == "done" and evs[-1].checkpoint
    assert rundir.list_checkpoints(run_dir)
    for pid in trainer_pids(run_dir):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert "gptop: run stopped by you at step" in screen_text(term)


def test_two_ctrl_c_stop_at_once_and_the_summary_says_what_was_kept(tmp_path):
    run_dir = tmp_path / "run"
    term = dashboard(run_dir, "--max-steps", "100000")
    try:
        wait_for(lambda: [e for e in events(run_dir) if e.type == "step"], what="a step event")
        term.send(b"\x03")
        time.sleep(0.2)
        term.send(b"\x03")
        assert term.proc.wait(120) == 130
    finally:
        term.close()
    text = screen_text(term)
    kept = rundir.list_checkpoints(run_dir)
    assert "gptop: run stopped by you at step" in text
    if events(run_dir)[-2].type == "done":  # the trainer finished its stop before the second Ctrl-C landed
        assert kept
    elif kept:
        assert "a second stop (Ctrl-C or q twice) ended the trainer" in text and f"step {kept[-1].step}" in text
    else:
        assert "checkpoint none: a second stop (Ctrl-C or q twice) ended the trainer" in " ".join(text.split())
    for pid in trainer_pids(run_dir):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("how", ["q", "SIGTERM"])
def test_after_the_run_ended_a_stop_closes_the_dashboard_with_the_runs_code(tmp_path, how):
    """The dashboard stays open on a finished run until the user leaves it; a SIGTERM then (a process
    manager, `timeout`) must close it too, not stop the already-finished session and wait forever."""
    run_dir = tmp_path / "run"
    term = dashboard(run_dir, "--max-steps", "3")
    try:
        wait_for(lambda: [e for e in events(run_dir) if e.type == "done"], what="the end of the run")
        wait_for(lambda: "done" in screen_text(term)[-4000:], 30, what="the finished dashboard")
        if how == "q":
            term.send(b"q")
        else:
            term.proc.send_signal(signal.SIGTERM)
        assert term.proc.wait(60) == 0
    finally:
        term.close()
    assert "gptop: run finished: 3 steps" in screen_text(term)


def test_a_closed_terminal_leaves_no_trainer_behind(tmp_path):
    run_dir = tmp_path / "run"
    term = dashboard(run_dir, "--max-steps", "100000")
    try:
        wait_for(lambda: [e for e in events(run_dir) if e.type == "step"], what="a step event")
        pids = trainer_pids(run_dir)
        term.proc.send_signal(signal.SIGHUP)
        term.proc.wait(120)
        for pid in pids:
            try:
                psutil.Process(pid).wait(120)
            except psutil.NoSuchProcess:
                pass
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        term.close()
    assert events(run_dir)[-1].type == "done"  # the trainer stopped by itself, with a checkpoint
    assert rundir.list_checkpoints(run_dir)
