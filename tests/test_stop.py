"""A stop the user asked for (q, Ctrl-C, SIGTERM to gptop) is "stopped" with exit 130, at any moment:
also while the trainer is still starting and dies of the signal before it said hello."""

import signal
import subprocess
import time

import psutil
import pytest

from helpers import TINY, gptop_cmd, wait_for
from gptop.session import EXIT_INTERRUPTED, Session
from trainer.contract.config import TrainConfig
from trainer.contract import rundir
from trainer.contract.events import DoneEvent, ErrorEvent, StepEvent, read_events
from trainer.contract.states import StoppedBy


def session(tmp_path):
    cfg = TrainConfig()
    cfg.run.run_dir = str(tmp_path / "run")
    s = Session(cfg)
    s.interrupted = True  # what Session.stop sets: the user asked
    return s


@pytest.mark.parametrize("code", [-signal.SIGTERM, -signal.SIGKILL, 1])
def test_a_trainer_that_dies_of_the_stop_before_its_first_step_is_stopped(tmp_path, code):
    s = session(tmp_path)
    s.handle_exit(code)
    assert s.wait(0) == EXIT_INTERRUPTED
    assert s.state.status == "stopped" and "before its first step" in s.state.status_message


def test_a_graceful_stop_is_stopped_and_an_error_while_stopping_is_shown(tmp_path):
    s = session(tmp_path)
    s.handle_exit(0)
    assert (s.state.status, s.state.status_message, s.wait(0)) == ("stopped", None, EXIT_INTERRUPTED)

    s = session(tmp_path)
    s.state.apply(
        StepEvent(
            step=3,
            tokens=0,
            loss=1.0,
            lr=0.0,
            grad_norm=None,
            step_ms=1.0,
            phases_ms={},
            tokens_per_s=0.0,
            mfu=0.0,
            mem_bytes=0,
            time=1.0,
        )
    )
    s.handle_exit(-signal.SIGKILL)  # killed after its steps, before it checkpointed
    assert s.state.status == "stopped" and "before its first checkpoint: steps 1-3 are lost" in s.state.status_message

    s = session(tmp_path)
    err = ErrorEvent(kind="disk", message="No space left on device", time=2.0)
    s.rank_errors[0] = err  # the trainer reported a failure of its own while stopping
    s.state.apply(err)
    s.handle_exit(1)
    assert s.state.status == "failed" and s.state.status_message.startswith("stopped: ")
    assert "No space left on device" in s.state.status_message and s.wait(0) == EXIT_INTERRUPTED


@pytest.mark.parametrize(
    "reached, on_disk, words",
    [
        (14, (14,), "after its checkpoint of step 14: nothing is lost"),  # the second Ctrl-C came after the save
        (14, (10, 15), "after its checkpoint of step 15: nothing is lost"),
        (14, (10,), "before it checkpointed step 14: steps 11-14 are lost, --resume continues from step 10"),
        (14, (), "before its first checkpoint: steps 1-14 are lost"),
    ],
)
def test_a_forced_stop_says_from_the_disk_what_it_kept(tmp_path, reached, on_disk, words):
    """Two Ctrl-C 0.2 s apart: the first one's checkpoint may be on disk before the second one's kill (its
    event perhaps not read yet); what is said comes from the checkpoints there, never a false 'lost'."""
    from trainer.contract import rundir

    s = session(tmp_path)
    s.forced = True  # what Session.stop sets on the second stop
    s.state.apply(
        StepEvent(
            step=reached,
            tokens=0,
            loss=1.0,
            lr=0.0,
            grad_norm=None,
            step_ms=1.0,
            phases_ms={},
            tokens_per_s=0.0,
            mfu=0.0,
            mem_bytes=0,
            time=1.0,
        )
    )
    for step in on_disk:
        rundir.path_for(s.run_dir, step).parent.mkdir(parents=True, exist_ok=True)
        rundir.path_for(s.run_dir, step).write_bytes(b"x")
    s.handle_exit(-signal.SIGKILL)
    msg = s.state.status_message
    assert (
        s.state.status == "stopped"
        and msg.startswith("a second stop (Ctrl-C or q twice) ended the trainer (signal 9) ")
        and msg.endswith(words)
    ), msg


def test_stop_before_the_trainer_was_started_is_stopped(tmp_path):
    cfg = TrainConfig()
    cfg.run.run_dir = str(tmp_path / "run")
    s = Session(cfg)
    s.stop()
    assert s.wait(0) == EXIT_INTERRUPTED and s.state.status == "stopped"


# --- real processes ----------------------------------------------------------------------


def _steps(run_dir):
    p = run_dir / "events.jsonl"
    return [e for e in read_events(p) if e.type == "step"] if p.exists() else []


def _hello(run_dir):
    p = run_dir / "events.jsonl"
    return p.exists() and any(e.type == "hello" for e in read_events(p))


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize(
    "moment,sig", [("spawned", signal.SIGTERM), ("1.5s", signal.SIGINT), ("first step", signal.SIGTERM)]
)
def test_stop_at_any_moment_is_stopped_with_130(tmp_path, moment, sig):
    run_dir = tmp_path / "run"
    p = subprocess.Popen(
        gptop_cmd("--no-ui", "train", *TINY, "--max-steps", "100000", "--run-dir", str(run_dir)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    me = psutil.Process(p.pid)
    deadline = time.monotonic() + 180
    try:
        if moment == "spawned":
            while not me.children() and time.monotonic() < deadline:
                time.sleep(0.02)
        elif moment == "1.5s":
            time.sleep(1.5)
        else:
            while not _steps(run_dir) and time.monotonic() < deadline:
                time.sleep(0.05)
        assert time.monotonic() < deadline, f"gptop did not reach the moment {moment!r}"
        kids = me.children(recursive=True)
        p.send_signal(sig)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    statuses = [line for line in out.splitlines() if line.startswith("status: ")]
    assert p.returncode == 130, (out, err)
    assert statuses[-1].startswith("status: stopped"), statuses
    assert not any(s.startswith("status: failed") for s in statuses), statuses
    assert "failed" not in err
    for k in kids:
        try:
            k.wait(30)
        except psutil.NoSuchProcess:
            pass
        assert not k.is_running() or k.status() == psutil.STATUS_ZOMBIE
    if moment == "first step":
        assert _hello(run_dir)  # it ran, and stopped gracefully (a checkpoint and a done event)
        assert any(e.type == "done" for e in read_events(run_dir / "events.jsonl"))


@pytest.mark.slow
@pytest.mark.process
def test_two_ctrl_c_in_no_ui_say_truly_what_was_kept(tmp_path):
    """Ctrl-C twice, 0.2 s apart, during a run: the second one ends the trainer at once; the status says from the
    checkpoints on disk whether that lost anything (never 'before it checkpointed' beside a written checkpoint)."""
    run_dir = tmp_path / "run"
    p = subprocess.Popen(
        gptop_cmd("--no-ui", "train", *TINY, "--max-steps", "100000", "--run-dir", str(run_dir)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: _steps(run_dir), 180, "the first step", proc=p)
        p.send_signal(signal.SIGINT)
        time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    from trainer.contract import rundir

    assert p.returncode == 130, err
    last = [line for line in out.splitlines() if line.startswith("status: ")][-1]
    kept = rundir.list_checkpoints(run_dir)
    done = [e for e in read_events(run_dir / "events.jsonl") if e.type == "done"]
    if done:  # the trainer's own stop was complete (its checkpoint written) before the kill
        assert kept and kept[-1].step == done[-1].step
        assert last == "status: stopped" or last.endswith("nothing is lost"), last
    elif kept:
        assert f"after its checkpoint of step {kept[-1].step}" in last or "--resume continues" in last, last
    else:
        assert "before its first checkpoint" in last, last


# A command that ended with `code` while stop signals keep coming until its process is gone: SIGINT or SIGTERM
# from a shell loop started in the command's last moments (atexit), through Python's finalization; the loop ends
# once the process is reaped.
LATE_SIGNALS = """
import atexit, os, subprocess, sys
import gptop.__main__ as entry

entry.main = lambda: int(sys.argv[1])
loop = "while kill -{sig} {pid} 2>/dev/null; do sleep 0.001; done"
quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # not the test's pipes
atexit.register(lambda: subprocess.Popen(["sh", "-c", loop.format(sig=sys.argv[2], pid=os.getpid())], **quiet))
entry.run()
"""


@pytest.mark.process
@pytest.mark.parametrize("sig", ["INT", "TERM"])
@pytest.mark.parametrize("code", [0, 130])
def test_a_stop_signal_in_gptops_last_moments_leaves_its_exit_status(code, sig):
    """The second of two quick Ctrl-Cs can come while gptop's process is ending, with its status decided: Python's
    finalization puts every signal's default action back, so it once ended gptop by the signal (exit -2). The
    `gptop` entry point (`python -m gptop` and the console script) keeps the status whatever comes after."""
    import os
    import sys

    from helpers import ROOT

    for _ in range(3):  # the window is milliseconds: three tries, each must keep the status
        r = subprocess.run(
            [sys.executable, "-c", LATE_SIGNALS, str(code), sig],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == code, (r.returncode, r.stderr[-2000:])


def test_the_console_script_is_the_same_entry_as_python_m_gptop():
    import tomllib

    from helpers import ROOT

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["gptop"] == "gptop.__main__:run"


def test_a_stop_signal_before_the_session_runs_starts_nothing(tmp_path):
    """Ctrl-C or SIGTERM right after `gptop train` started, before its session ran: counted, acted on as
    soon as the session runs, and nothing is started or created."""
    import os

    from gptop.controls import StopSignals

    class View:
        statuses: list = []

        def on_event(self, e):
            pass

        def on_log(self, line, stream):
            pass

        def on_status(self, status, message):
            self.statuses.append(status)

        def close(self):
            pass

    class NoSampler:
        def subscribe(self, fn):
            pass

        def start(self):
            pass

        def stop(self):
            pass

    cfg = TrainConfig()
    cfg.run.run_dir = str(tmp_path / "run")
    s = Session(cfg, sampler=NoSampler())
    before = signal.getsignal(signal.SIGTERM)
    signals = StopSignals().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to this (main) thread: counted, nothing to stop
        assert signals.count == 1
        view = View()
        assert s.run_headless(view, signals=signals) == EXIT_INTERRUPTED
    finally:
        signals.restore()
    assert view.statuses == ["stopped"] and s.supervisor is None and not (tmp_path / "run").exists()
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are given back


class AliveTrainer:
    """The supervisor of a trainer that said `done` and is still tearing down, or (`out`) that has exited and
    whose exit is on its way to the session (its last events still draining)."""

    def __init__(self, out: bool = False):
        self.calls: list[str] = []
        self.exiting = out

    def alive(self) -> bool:
        return not self.exiting

    def request_stop(self, reason: str = "stop requested", by: StoppedBy | None = None) -> None:
        self.calls.append("stop")

    def kill(self, by: StoppedBy | None = None) -> None:
        self.calls.append("kill")


@pytest.mark.parametrize("out", [False, True], ids=["tearing-down", "exit-in-flight"])
@pytest.mark.parametrize("force", [False, True])
def test_a_stop_after_the_trainer_finished_its_last_step_is_a_finished_run(tmp_path, force, out):
    """q or SIGTERM between the trainer's `done` and the session's handling of its exit: the run is complete,
    exit 0, not 130 -- while the trainer tears down, and after it exited but before its exit was handled."""
    cfg = TrainConfig()
    cfg.run.run_dir = str(tmp_path / "run")
    s = Session(cfg)
    s.supervisor = AliveTrainer(out)
    s.state.apply(DoneEvent(step=3, tokens=768, seconds=1.0, reason="max_steps", checkpoint="c", time=1.0))
    s.stop(force=force)
    assert s.supervisor.calls == (["kill"] if force and not out else []) and not s.interrupted
    s.handle_exit(-signal.SIGKILL if force and not out else 0)
    assert (s.state.status, s.wait(0)) == ("done", 0)


def test_a_stop_after_a_trial_trainer_stopped_still_stops_the_run(tmp_path):
    """Only a `done` at max_steps completes the run; one of a stopped trainer does not."""
    cfg = TrainConfig()
    cfg.run.run_dir = str(tmp_path / "run")
    s = Session(cfg)
    s.supervisor = AliveTrainer()
    s.state.apply(DoneEvent(step=3, tokens=768, seconds=1.0, reason="stop requested", checkpoint="c", time=1.0))
    s.stop()
    assert s.supervisor.calls == ["stop"] and s.interrupted


class EndedTrainer(AliveTrainer):
    """The supervisor of a trainer process that has ended and whose exit the session (or the tuner) handled."""

    def alive(self) -> bool:
        return False


@pytest.mark.parametrize("moment", ["exit-in-flight", "exit-handled", "own-stop"])
def test_a_stop_between_the_tuners_two_processes_is_recorded_as_yours(tmp_path, moment):
    """Your stop after the tuner's restart ended a process and before the next one started (its exit on its way to
    the session, or handled and the next start not made): the process's `exit` is the tuner's, so gptop records
    whose stop ended the run, and the report says it was yours and what was kept. A stop that reached its process
    has that process's own record, and no second one."""
    from gptop.report import summarize
    from trainer.contract.events import ExitEvent, StatusEvent, TUNER_RESTART

    cfg = TrainConfig()
    cfg.run.run_dir = str(tmp_path / "run")
    (tmp_path / "run").mkdir()
    s = Session(cfg)
    s.supervisor = AliveTrainer(out=True) if moment == "exit-in-flight" else EndedTrainer()
    by = StoppedBy.USER if moment == "own-stop" else StoppedBy.TUNER
    s.publish(DoneEvent(step=30, tokens=7680, seconds=1.0, reason=TUNER_RESTART, checkpoint="c", time=1.0))
    s.publish(ExitEvent(pid=42, exit_code=0, seconds=4.0, stopped_by=by, time=2.0))
    s.stop()
    if moment != "exit-handled":
        s.handle_exit(0)  # what the tuner hands back when it sees the run interrupted
    assert s.wait(0) == EXIT_INTERRUPTED and s.state.status == "stopped"
    records = [e for e in read_events(tmp_path / "run" / "events.jsonl") if isinstance(e, StatusEvent)]
    report = summarize(tmp_path / "run")
    if moment == "own-stop":
        assert records == [] and report["state_words"].startswith("stopped by you (exit 0) at step 30")
        return
    assert [(r.status, r.stopped_by) for r in records] == [("stopped", StoppedBy.USER)]
    assert report["state"] == "stopped", report["state_words"]
    assert report["state_words"].startswith("stopped by you during a restart by the tuner at step 30, after its ")


@pytest.mark.process
@pytest.mark.parametrize(
    "first, then, recorded",
    [
        (StoppedBy.TUNER, StoppedBy.USER, StoppedBy.USER),  # the run ends: the process is not replaced
        (StoppedBy.TUNER, StoppedBy.GPTOP, StoppedBy.GPTOP),
        (StoppedBy.USER, StoppedBy.TUNER, StoppedBy.USER),
        (StoppedBy.GPTOP, StoppedBy.USER, StoppedBy.GPTOP),  # gptop's planned end was first: still its own
    ],
)
def test_a_stop_that_ends_the_run_takes_over_the_tuners_restart(tmp_path, first, then, recorded):
    """Who ended a process is the first to ask, except that a stop of the run (yours, gptop's planned end) asked
    while the tuner's restart stops the process makes that process's end the run's: its `exit` says so."""
    import sys
    import threading

    from gptop.supervisor import Supervisor

    up, ended = threading.Event(), threading.Event()
    sup = Supervisor(
        [],
        tmp_path,
        on_event=lambda e: None,
        on_log=lambda line, stream: up.set() if "up" in line else None,
        on_exit=lambda code: ended.set(),
        on_malformed=lambda line, why: None,
    )
    # a process that outlives both stops' SIGTERMs, so that the second reaches a live process
    script = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    )
    sup.argv = [sys.executable, "-c", script]
    sup.start()
    try:
        assert up.wait(60), "the process did not start"
        sup.request_stop(by=first)
        sup.request_stop(by=then)
        assert sup.stopped_by is recorded
    finally:
        sup.kill()  # it ignores the stops' SIGTERM
        sup.close()
    assert ended.wait(30)


@pytest.mark.process  # a gptop started as `nohup` starts it
def test_nohup_keeps_a_no_ui_run_through_a_hangup(tmp_path):
    """A hangup ignored when gptop starts stays ignored (the user asked for a run that outlives its terminal);
    SIGTERM still stops it with a checkpoint."""
    run_dir = tmp_path / "run"
    p = subprocess.Popen(
        gptop_cmd("--no-ui", "train", *TINY, "--max-steps", "100000", "--run-dir", str(run_dir)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),
    )
    try:
        step = lambda: (
            [e for e in read_events(run_dir / "events.jsonl") if e.type == "step"]
            if (run_dir / "events.jsonl").exists()
            else []
        )
        wait_for(step, proc=p, what="a step event")
        p.send_signal(signal.SIGHUP)
        seen = len(step())
        wait_for(lambda: len(step()) > seen + 2, proc=p, what="steps after the hangup")
        assert p.poll() is None
        p.send_signal(signal.SIGTERM)
        assert p.wait(120) == EXIT_INTERRUPTED
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert rundir.list_checkpoints(run_dir)


def test_stop_signals_leave_an_ignored_hangup_ignored():
    from gptop.controls import STOP_SIGNALS, StopSignals, handled

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert signal.SIGHUP not in handled(STOP_SIGNALS) and signal.SIGTERM in handled(STOP_SIGNALS)
        signals = StopSignals().install()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and signal.getsignal(signal.SIGTERM) != before
        signals.restore()
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signals = StopSignals().install()
        assert signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, signal.SIG_IGN)
        signals.restore()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, before)
