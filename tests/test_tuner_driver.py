"""The session-side tuning driver without processes: rollback files, the test fault hook, the `t` toggler,
and the controller rules the driver relies on (budget reserve for the final switch, slow compiles screened)."""

import dataclasses
import os
import random
import shutil
from pathlib import Path

import pytest

from gptop.session import Session, SessionOptions, TuningOptions
from gptop.trial_processes import parse_test_fault
from gptop.tuning import TuningDriver
from trainer.contract import rundir
from trainer.contract.config import TrainConfig
from trainer.contract.events import make

pytestmark = pytest.mark.waits  # on real time (a failed trial's grace to end by itself): tests/conftest.py's order


class FakeSession:
    """The public side of gptop.session.Session that the driver uses, recording what it is asked."""

    def __init__(self, run_dir):
        from gptop.state import RunState

        self.cfg = TrainConfig()
        self.cfg.run.run_dir = str(run_dir)
        self.run_dir = Path(run_dir)
        self.state = RunState(run_dir=str(run_dir))
        self.controller = None
        self.supervisor = None
        self.interrupted = False
        self.finished = False
        self.command = None  # gptop's own trainer (a test of a command sets its argv)
        self.halted = None
        self.rank_errors = {}  # the running process's own error events, by rank
        self.emitted, self.logs, self.exits, self.spawns = [], [], [], []

    def set_controller(self, controller):
        self.controller = controller

    def publish(self, event):
        self.emitted.append(event)

    def log(self, message):
        self.logs.append(message)

    def handle_exit(self, code):
        self.exits.append(code)

    def halt(self, kind, message):
        if self.halted is None:
            self.halted = message
            self.emitted.append(make("error", kind=kind, message=message))

    def spawn(self, cfg=None, resume=None, start_step=None):
        self.spawns.append((resume, start_step))

    def load_between(self, t0, t1):
        return []  # no sampler: the load is not tracked


def make_ckpt(run_dir, step, tag=b"x"):
    p = rundir.path_for(run_dir, step)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(tag * 10)
    return p


def test_parse_test_fault():
    assert parse_test_fault("2:nan") == (2, (("nan", 2),))
    assert parse_test_fault("1:oom@5") == (1, (("oom", 5),))
    assert parse_test_fault("2:checkpoint@2+nan@3") == (2, (("checkpoint", 2), ("nan", 3)))
    assert parse_test_fault("2:nan@x") is None and parse_test_fault("2:+nan") is None
    assert parse_test_fault("") is None and parse_test_fault("nan") is None and parse_test_fault("x:nan") is None


def test_rollback_deletes_the_trials_checkpoints_and_keeps_the_pinned_pre_trial_one(tmp_path):
    s = FakeSession(tmp_path)
    d = TuningDriver(s, 60.0)
    d.procs.user_cfg = TrainConfig.from_dict(s.cfg.to_dict())
    (tmp_path / "events.jsonl").touch()
    make_ckpt(tmp_path, 5)
    pre = make_ckpt(tmp_path, 10, b"p")
    d.procs.guard((10, str(pre)))
    # the trial writes checkpoints 12 and 14 and prunes with --keep-checkpoints 2: the pinned one stays
    make_ckpt(tmp_path, 12)
    make_ckpt(tmp_path, 14)
    rundir.prune(tmp_path, keep=2)
    assert [c.step for c in rundir.list_checkpoints(tmp_path)] == [10, 12, 14]
    info = d.procs.rollback((10, str(pre)))
    assert [c.step for c in rundir.list_checkpoints(tmp_path)] == [10]
    assert pre.read_bytes() == b"p" * 10  # the pre-trial state
    assert info["step"] == 10 and len(info["deleted"]) == 2
    assert d.procs.last_ckpt == (10, str(pre))
    assert any("rolled back to step 10" in e.message for e in s.emitted if e.type == "log")
    d.procs.release_guard()
    assert rundir.pinned(tmp_path) == set()


@pytest.mark.parametrize(
    "reported, exits_after, killed",
    [
        (True, 0.3, False),  # its own crash: it exits by itself, and its end is recorded as its own
        (True, None, True),  # it said it failed but lingers: killed by the tuner after the grace
        (False, 0.3, True),  # a trial the tuner judged (slow, diverging): nothing to wait for, killed at once
    ],
    ids=["reported-and-exits", "reported-and-lingers", "judged-by-the-tuner"],
)
def test_a_failed_trial_that_reported_its_own_failure_ends_by_itself_before_any_kill(
    tmp_path, reported, exits_after, killed
):
    """The rollback of a trial whose process reported its own failure (an error event: a crash, an OOM) waits a
    bounded time for that process to exit, so that its `exit` record is its own (code, stderr, nobody stopped
    it), not a SIGKILL by the tuner; a process that reported nothing is killed at once."""
    import time

    from gptop.trial_processes import Inbox, TrialProcesses
    from trainer.contract.states import StoppedBy

    s = FakeSession(tmp_path)
    s.supervisor = sup = FakeSupervisor()
    kills: list[tuple[float, StoppedBy | None]] = []
    t0 = time.monotonic()
    exits_at = None if exits_after is None else t0 + exits_after

    def kill(by=None):
        nonlocal exits_at
        kills.append((time.monotonic(), by))
        exits_at = time.monotonic()  # SIGKILL: its exit comes at once

    sup.kill = kill
    (tmp_path / "events.jsonl").touch()

    def pump(timeout: float):
        """The driver's queue: the process's exit once it comes (with the driver's bookkeeping), else nothing."""
        if exits_at is not None and time.monotonic() >= exits_at and procs.alive:
            procs.alive = False
            return Inbox.EXIT, 1
        time.sleep(min(timeout, 0.05))
        return None

    procs = TrialProcesses(s, say=lambda message: None, pump=pump, trial_log_every=1)
    procs.own_end_s = 1.5
    procs.alive = True
    if reported:
        s.rank_errors[0] = make("error", kind="crash", message="RuntimeError: boom", step=7)
    procs.rollback(None)
    if killed:
        assert kills and kills[0][1] is StoppedBy.TUNER
        waited = kills[0][0] - t0
        assert (1.4 <= waited <= 5.0) if reported else waited < 1.0, waited  # after the grace, or at once
    else:
        assert kills == [] and not procs.alive  # it ended by itself within the grace


def test_rollback_without_a_checkpoint_goes_back_to_the_start(tmp_path):
    s = FakeSession(tmp_path)
    d = TuningDriver(s, 60.0)
    (tmp_path / "events.jsonl").touch()
    make_ckpt(tmp_path, 3)
    info = d.procs.rollback(None)
    assert rundir.list_checkpoints(tmp_path) == [] and info["path"] is None and d.procs.last_ckpt is None


def test_trial_configs_stop_on_nan_and_the_final_one_is_the_users(tmp_path):
    s = FakeSession(tmp_path)
    s.cfg.log.log_every = 10
    s.cfg.run.fault = "nan@3"
    d = TuningDriver(s, 60.0)
    d.procs.user_cfg = TrainConfig.from_dict(s.cfg.to_dict())
    t = dataclasses.replace(s.cfg.toggles, micro_batch=2, fused_adamw=True)
    trial = d.procs.cfg_for(t, strict=True)
    assert trial.toggles == t and trial.run.nan_policy == "stop" and trial.log.log_every == 1
    assert trial.run.fault is None  # a user's test fault is not re-injected
    final = d.procs.cfg_for(t, strict=False)
    assert final.run.nan_policy == "rollback" and final.log.log_every == 10
    d.procs.running_cfg = trial
    assert d.procs.differs(final) and not d.procs.differs(trial)


def test_keeping_the_start_on_the_users_process_restarts_nothing(tmp_path):
    """The user's process (the baseline's, never restarted) runs `--precision auto` and `--micro-batch auto` as
    its trainer resolved them (its hello): a decision to keep the start, whose toggles are the resolved ones, is
    not a different configuration, so no restart; a toggle that does differ still is."""
    from fixtures.streams import config, ev

    s = FakeSession(tmp_path)
    d = TuningDriver(s, 60.0)
    d.procs.hello = ev(
        "hello",
        0.0,
        config=config("llama", "tiny", "cpu", precision="fp32", micro_batch="auto"),
        micro_batch=8,
        device={"type": "cpu", "name": "cpu", "cpu_count": 2, "total_memory": 8 << 30},
        model={"family": "llama", "size": "tiny"},
    )
    resolved = TrainConfig.from_dict(d.procs.hello.config).toggles
    s.cfg.toggles = dataclasses.replace(resolved, precision="auto", micro_batch="auto")  # as the user typed them
    d.procs.user_cfg = TrainConfig.from_dict(s.cfg.to_dict())
    start = dataclasses.replace(resolved, micro_batch=8)  # the tuner's start (tuner.controller): resolved
    assert not d.procs.differs(d.procs.cfg_for(start, strict=False), log_every=False)
    other = dataclasses.replace(start, fused_adamw=not start.fused_adamw)
    assert d.procs.differs(d.procs.cfg_for(other, strict=False), log_every=False)
    assert d.procs.differs(d.procs.cfg_for(dataclasses.replace(start, precision="bf16"), strict=False))


def test_exit_hook_and_detach_hand_an_unhandled_exit_back(tmp_path):
    s = FakeSession(tmp_path)
    d = TuningDriver(s, 60.0)
    d._attached = True
    s.set_controller(d)
    assert d.on_trainer_exit(0) is True  # attached: the driver handles it
    d._detach()  # ... and hands it back when it did not
    assert s.exits == [0] and s.controller is None
    assert d.on_trainer_exit(1) is False  # detached: the session's own handling


def test_t_starts_tuning_only_once_the_trainer_runs(tmp_path):
    cfg = TrainConfig()
    cfg.run.run_dir = str(tmp_path / "run")
    s = Session(cfg, SessionOptions(tuning=TuningOptions()))
    assert s.can_start_tuning and s.controller is None
    with pytest.raises(RuntimeError):
        s.toggle_tuning()  # nothing runs yet: the UI shows why
    assert s.state.logs and "once the trainer runs" in s.state.logs[-1][1]
    assert not (tmp_path / "run").exists()  # nothing was started or created


def test_the_session_has_one_controller_slot(tmp_path):
    cfg = TrainConfig()
    cfg.run.run_dir = str(tmp_path / "run")
    s = Session(cfg)
    assert not s.can_start_tuning  # `t` is not offered without TuningOptions
    s.toggle_tuning()  # says why, starts nothing
    assert "not available" in s.state.logs[-1][1]
    seen = []

    class Recorder:
        def on_event(self, event):
            seen.append(event)

        def on_trainer_exit(self, code):
            return True

        def stop_tuning(self):
            seen.append("stop")

    first = Recorder()
    s.set_controller(first)
    with pytest.raises(RuntimeError):
        s.set_controller(Recorder())  # two controllers would both claim every exit
    assert s.can_start_tuning
    s.toggle_tuning()  # `t` while tuning: stop it
    s.log("hello")  # a log line is not an event
    assert seen == ["stop"]
    s.set_controller(None)
    assert s.controller is None


# --- controller rules the driver relies on -----------------------------------------------


def _ctl(tmp_path, clock, **kw):
    from test_tuner_controller import make_ctl

    return make_ctl(tmp_path, clock, **kw)


def test_trials_are_cut_when_only_the_switch_reserve_is_left(tmp_path):
    from test_tuner_controller import Clock

    clock = Clock()
    ctl = _ctl(tmp_path, clock, budget_s=100.0, switch_reserve_s=30.0, rel_ci=1e-6, max_seconds=1000, max_steps=10_000)
    ctl.set_max_micro_batch(8)
    a = ctl.next_action()
    assert a.baseline
    stop, i = None, 0
    rng = random.Random(0)
    while stop is None:
        i += 1
        clock.t += 0.4
        ctl.observe(
            make(
                "step",
                step=i,
                tokens=0,
                loss=3.0,
                lr=0,
                grad_norm=0,
                step_ms=400.0 * (1 + rng.gauss(0, 0.05)),
                phases_ms={},
                tokens_per_s=0,
                mfu=0,
                mem_bytes=1,
                time=clock.t,
            )
        )
        stop = ctl.trial_should_stop()
    assert stop == "budget" and 69.0 <= ctl.budget.elapsed() <= 71.0  # 30 s kept for the final switch
    ctl.finish_trial("ok")
    done = ctl.next_action()
    ev = [e for e in ctl.drain_events() if e.type == "tuner"][-1]
    assert ev.phase == "done" and ev.outcome == done.reason and ev.applied is False


def test_a_compile_mode_that_never_warms_up_is_screened_for_the_run(tmp_path):
    from test_tuner_controller import Clock
    from tuner.controller import RunTrial

    clock = Clock()
    ctl = _ctl(
        tmp_path,
        clock,
        spec="-all compile=off,default fused_adamw=on,off prefetch=0,2",
        trial_timeout_s=50.0,
        max_trials=8,
    )
    ctl.set_max_micro_batch(8)
    a = ctl.next_action()
    for i in range(40):
        clock.t += 0.4
        ctl.observe(
            make(
                "step",
                step=i + 1,
                tokens=0,
                loss=3.0,
                lr=0,
                grad_norm=0,
                step_ms=400.0,
                phases_ms={},
                tokens_per_s=0,
                mfu=0,
                mem_bytes=1,
                time=clock.t,
            )
        )
    ctl.finish_trial("ok")
    seen_compile = 0
    for _ in range(8):
        a = ctl.next_action()
        if not isinstance(a, RunTrial):
            break
        if a.toggles.compile == "default":
            seen_compile += 1
            clock.t += 60.0  # compiling, no step: cut by the timeout
            assert ctl.trial_should_stop() == "done" and ctl.trial_stop == "timeout"
            ev = ctl.finish_trial("ok")
            assert ev.status == "pruned"
            continue
        for i in range(30):
            clock.t += 0.3
            ctl.observe(
                make(
                    "step",
                    step=100 + i,
                    tokens=0,
                    loss=3.0,
                    lr=0,
                    grad_norm=0,
                    step_ms=300.0,
                    phases_ms={},
                    tokens_per_s=0,
                    mfu=0,
                    mem_bytes=1,
                    time=clock.t,
                )
            )
        ctl.trial_should_stop()
        ctl.finish_trial("ok")
    assert seen_compile == 1  # the others were screened, not run
    screened = [e for e in ctl.drain_events() if e.type == "trial" and "not worth this budget" in e.reason]
    assert screened and all(e.toggles.compile == "default" for e in screened)


def test_stop_early_decides_on_what_was_measured(tmp_path):
    from test_tuner_controller import Clock
    from tuner.controller import Apply, Done, RunTrial

    clock = Clock()
    ctl = _ctl(tmp_path, clock, spec="-all fused_adamw=on,off prefetch=0,2", max_trials=8)
    ctl.set_max_micro_batch(8)
    assert isinstance(ctl.stop_early(), Done)  # nothing measured yet: keep the start
    assert ctl.next_action().reason.startswith("stopped by the user")

    clock = Clock()
    ctl = _ctl(tmp_path / "b", clock, spec="-all fused_adamw=on,off prefetch=0,2", max_trials=8)
    ctl.set_max_micro_batch(8)
    rng = random.Random(0)

    def steps(ms, start, n=40):
        for i in range(n):
            clock.t += ms / 1000
            ctl.observe(
                make(
                    "step",
                    step=start + i,
                    tokens=0,
                    loss=3.0,
                    lr=0,
                    grad_norm=0,
                    step_ms=ms * (1 + rng.gauss(0, 0.01)),
                    phases_ms={},
                    tokens_per_s=0,
                    mfu=0,
                    mem_bytes=1,
                    time=clock.t,
                )
            )

    ctl.next_action()
    steps(400.0, 1)  # the start: 400 ms a step
    ctl.finish_trial("ok")
    a = ctl.next_action()
    assert isinstance(a, RunTrial) and not a.baseline
    steps(200.0, 100)  # twice as fast
    ctl.trial_should_stop()
    ctl.finish_trial("ok")
    b = ctl.next_action()  # a third trial is running when `t` comes
    steps(390.0, 200, n=5)
    action = ctl.stop_early()
    assert isinstance(action, Apply) and action.toggles == a.toggles
    assert ctl.study.trials()[b.number].state.name == "FAIL"  # abandoned: teaches the sampler nothing
    assert ctl.next_action().reason.startswith("stopped by the user: applied trial")


def test_train_tune_is_tune_budget():
    from gptop.cli import build_parser
    from gptop.preflight import tuning_request
    from gptop.session import TuningOptions

    p = build_parser()
    a = tuning_request(p.parse_args(["train", "--tune", "10m", "--tune-space=-compile"]))  # = : a leading -
    b = tuning_request(p.parse_args(["tune", "--budget", "10m", "--tune-space=-compile"]))
    assert a == b == TuningOptions(budget_s=600.0, space_spec="-compile", storage=None, tune_only=False)
    assert tuning_request(p.parse_args(["train"])) is None
    assert tuning_request(p.parse_args(["tune", "--tune-only"])).tune_only is True


class FakeSupervisor:
    def __init__(self):
        self.sent, self.stops = [], 0
        self.started_at = None

    def alive(self):
        return True

    def send(self, cmd):
        self.sent.append(cmd)

    def request_stop(self, reason="stop requested", by=None):
        self.stops += 1

    def kill(self, by=None):
        pass


@pytest.mark.parametrize("stable_within, jitter_ms", [(None, 2), (0.10, 60)], ids=["default", "stable-within-10%"])
def test_the_baseline_on_the_running_trainer_logs_every_step_then_gives_the_interval_back(
    tmp_path, stable_within, jitter_ms
):
    """`t` on a run that logs every 10 steps: the baseline is measured on that process, which is asked (a
    command, not a restart) to log every step meanwhile, and to log every 10 again after; the views get
    the measurement's progress (samples collected of those needed, the estimate and its spread). With
    `--stable-within 10%`, steps spread over 30% settle within the wider target in a few samples
    (tests/test_tuner_measure.py: within 3% they need several times more), and the reason says which target."""
    import time

    from fixtures.streams import T0, config, ev

    s = FakeSession(tmp_path)
    s.cfg.log.log_every = 10
    s.supervisor = sup = FakeSupervisor()
    s.energy_between = lambda t0, t1: None  # no energy reading
    (tmp_path / "events.jsonl").touch()
    hello = ev(
        "hello",
        0.0,
        config=config("llama", "tiny", "cpu", micro_batch=8),
        micro_batch=8,
        device={"type": "cpu", "name": "cpu", "cpu_count": 2, "total_memory": 8 << 30},
        model={"family": "llama", "size": "tiny"},
    )
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    target = {} if stable_within is None else {"stable_within": stable_within, "max_trials": 2}
    d = TuningDriver(s, 600.0, storage=storage, hello=hello, **target).attach()
    try:
        deadline = time.time() + 30
        while not sup.sent and time.time() < deadline:
            time.sleep(0.02)
        assert sup.sent[0]["cmd"] == "log_every" and sup.sent[0]["steps"] == 1
        step = 10
        while len(sup.sent) < 2 and time.time() < deadline:  # steady 200 ms steps until it is measured
            step += 1
            d.on_event(
                make(
                    "step",
                    step=step,
                    tokens=step * 64,
                    loss=3.0,
                    lr=1e-3,
                    grad_norm=1.0,
                    step_ms=200.0 + jitter_ms * ((step * 37) % 10) / 9,  # spread over [200, 200 + jitter]
                    phases_ms={},
                    tokens_per_s=320.0,
                    mfu=None,
                    mem_bytes=1,
                    time=T0 + step * 0.2,
                )
            )
            time.sleep(0.01)
        assert sup.sent[1] == {"cmd": "log_every", "steps": 10}
        assert d.ctl is not None and d.ctl.settings.max_trials == (2 if stable_within else 16)  # --max-trials
    finally:
        d.stop_tuning()
        d.on_trainer_exit(0)
        d.finished.wait(30)
    progress = [
        e.measure for e in s.emitted if e.type == "tuner" and e.measure is not None and e.measure.kind == "baseline"
    ]
    assert progress and progress[0].samples == 0 and progress[0].needed >= 1
    assert len(progress) < 40  # about one a second, not one per step
    last = progress[-1]
    assert last.warmed_up and last.samples >= 1 and last.tokens_per_s and last.spread is not None
    trial = next(e for e in s.emitted if e.type == "trial" and e.kind == "baseline")
    assert trial.status == "ok" and "stable after" in trial.reason
    assert trial.reason.endswith(f"(within ±{(stable_within or 0.03) * 100:g}%)"), trial.reason
    if stable_within:
        assert int(trial.reason.split()[2]) <= 25, trial.reason  # "stable after N samples: ..."


def test_t_near_the_end_of_a_run_says_tuning_cannot_pay_and_leaves_the_trainer_alone(tmp_path):
    """`t` at step 43 of 200, 0.45 s a step, a trainer that took 8 s to start: ~71 s left, a trial would cost
    ~18 s (its restart, the switch back, a quarter of the 9 s its measurement takes at least), as much as the most
    it could save over the 54 s after it (and more than the 7 s tuning may lose). One line, no trial, no restart,
    no command to the trainer; the report's ledger has the decision and its figures."""
    import json

    from fixtures.streams import T0, config, ev

    s = FakeSession(tmp_path)
    s.supervisor = sup = FakeSupervisor()
    sup.started_at = T0 - 8.0
    s.energy_between = lambda t0, t1: None
    (tmp_path / "events.jsonl").touch()
    hello = ev(
        "hello",
        0.0,
        config=config("llama", "tiny", "cpu", max_steps=200, micro_batch=8),
        micro_batch=8,
        device={"type": "cpu", "name": "cpu", "cpu_count": 2, "total_memory": 8 << 30},
        model={"family": "llama", "size": "tiny"},
    )
    s.cfg = TrainConfig.from_dict(hello.config)  # the session runs what the trainer says it runs
    s.cfg.run.run_dir = str(tmp_path)
    tokens_per_step = s.cfg.optim.global_batch * s.cfg.data.seq_len
    s.state.apply(hello)
    for step in range(1, 44):
        s.state.apply(
            make(
                "step",
                step=step,
                tokens=step * tokens_per_step,
                loss=3.0,
                lr=1e-3,
                grad_norm=1.0,
                step_ms=450.0,
                phases_ms={},
                tokens_per_s=tokens_per_step / 0.45,
                mfu=None,
                mem_bytes=1,
                time=T0 + 8 + step * 0.45,
            )
        )
    d = TuningDriver(s, 600.0, storage=f"sqlite:///{tmp_path / 'study.db'}", hello=hello).attach()
    assert d.finished.wait(60) and d.error is None
    lines = [e.message for e in s.emitted if e.type == "log"]
    decided = [m for m in lines if "cannot pay" in m]
    assert decided == [
        "tuner: keeping the starting configuration: tuning cannot pay: the run ends in 1:11 "
        "(157 steps at 0.45 s); a trial costs ~18 s here, more than the 18 s it could save (at 1.50x "
        "over the 0:54 after it)"
    ], lines
    assert sup.sent == [] and sup.stops == 0 and not [e for e in s.emitted if e.type == "trial"]
    led = json.loads((tmp_path / "tuning.json").read_text())["ledger"]
    assert led["decisions"][0]["choice"] == "plan" and led["decisions"][0]["cost_s"] == 16.0 + 0.25 * 20 * 0.45
    assert led["switch_s"] == 0.0 and led["trials_run"] == 0


# --- a command's checkpoints (gptop tune -- CMD): held in the run directory, never a silent restart ----------


def hf_checkpoint(out: Path, step: int, tag: str = "w") -> Path:
    """A Trainer-like checkpoint directory: output_dir/checkpoint-N with a few files."""
    d = out / f"checkpoint-{step}"
    d.mkdir(parents=True)
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.json"):
        (d / name).write_text(f"{tag}{step}:{name}")
    return d


def command_driver(tmp_path):
    s = FakeSession(tmp_path / "run")
    s.run_dir.mkdir(parents=True)
    s.command = ["python", "train.py"]
    d = TuningDriver(s, 60.0)
    d.procs.user_cfg = TrainConfig.from_dict(s.cfg.to_dict())
    d.procs.command = True
    return s, d


def report(d, step, path, reason):
    d.procs.saw_checkpoint(make("checkpoint", step=step, path=str(path), seconds=0.1, reason=reason))


def test_a_held_checkpoint_is_moved_or_linked_and_survives_the_scripts_rotation(tmp_path):
    from gptop import held_checkpoints as held

    out, run = tmp_path / "out", tmp_path / "run"
    run.mkdir()
    switch = hf_checkpoint(out, 9)
    path = held.hold(run, 9, switch, move=True)  # a switch's own: gone from output_dir
    assert not switch.exists() and path == run / "tuner-checkpoints" / "step-9" / "checkpoint-9"
    assert (path / "model.safetensors").read_text() == "w9:model.safetensors"
    own = hf_checkpoint(out, 12)
    path = held.hold(run, 12, own, move=False)  # the script keeps it: linked, and the older one released
    assert own.is_dir() and [p.name for p in held.held_dir(run).iterdir()] == ["step-12"]
    assert os.path.samefile(own / "optimizer.pt", path / "optimizer.pt")  # a hard link, no copy
    shutil.rmtree(own)  # the script's rotation (save_total_limit) deletes its checkpoint-12
    assert (path / "optimizer.pt").read_text() == "w12:optimizer.pt" and held.held_step(run) == 12
    assert held.hold(run, 12, path, move=False) == path  # already held: as it is
    assert held.is_held(run, path) and not held.is_held(run, out)
    held.release(run)
    assert not held.held_dir(run).exists() and held.held_step(run) is None
    single = out / "step-20.pt"  # a plain loop's checkpoint is one file
    single.write_text("s")
    assert held.hold(run, 20, single, move=True).read_text() == "s" and not single.exists()


def test_a_commands_restart_resumes_from_the_held_checkpoint_and_a_rollback_too(tmp_path):
    """The incident of issue 40: save_total_limit=3, a failed trial's own saves rotate the pre-trial
    checkpoint out of output_dir. The next start resumes from gptop's copy at the pre-trial step."""
    s, d = command_driver(tmp_path)
    out = tmp_path / "out"
    for step in (8, 12, 16):
        report(d, step, hf_checkpoint(out, step), "interval")
        d.procs.saw_step(step)
    d.procs.saw_step(20)
    report(d, 20, hf_checkpoint(out, 20), "stop")  # the tuner's stop before trial 1
    pre = d.procs.start(TrainConfig().toggles, None, strict=True)
    held_path = tmp_path / "run" / "tuner-checkpoints" / "step-20" / "checkpoint-20"
    assert pre == (20, str(held_path)) and s.spawns[-1] == (str(held_path), 20)
    assert not (out / "checkpoint-20").exists()  # a switch checkpoint is not left beside the script's own
    for step in (24, 28, 32):  # the trial saves on its interval; the rotation deletes the oldest ones
        d.procs.saw_step(step)
        report(d, step, hf_checkpoint(out, step), "interval")
    for step in (8, 12, 16):
        shutil.rmtree(out / f"checkpoint-{step}")
    info = d.procs.rollback(pre)
    assert info["step"] == 20 and info["path"] == str(held_path) and len(info["deleted"]) == 3
    assert sorted(p.name for p in out.iterdir()) == [] and s.halted is None
    assert any("rolled back to step 20" in e.message for e in s.emitted if e.type == "log")
    assert d.procs.start(TrainConfig().toggles, None, strict=True) == (20, str(held_path))
    assert s.spawns[-1] == (str(held_path), 20)
    # the script's own checkpoint at a switch step stays where it is (linked, not moved)
    d.procs.saw_step(24)
    report(d, 24, hf_checkpoint(out, 24), "interval")
    pre = d.procs.start(TrainConfig().toggles, None, strict=True)
    assert (out / "checkpoint-24").is_dir() and pre[1].endswith("step-24/checkpoint-24")
    assert not held_path.exists()  # the older held one is released


def test_a_start_that_would_lose_steps_halts_the_run(tmp_path):
    s, d = command_driver(tmp_path)
    out = tmp_path / "out"
    d.procs.saw_step(20)
    pre = (20, str(hf_checkpoint(out, 20)))
    d.procs.last_ckpt = pre
    shutil.rmtree(pre[1])  # gone before gptop could hold it
    assert d.procs.start(TrainConfig().toggles, None, strict=True) is None and s.spawns == []
    err = [e for e in s.emitted if e.type == "error"]
    assert len(err) == 1 and err[0].kind == "lost_steps" and "checkpoint of step 20" in err[0].message

    s, d = command_driver(tmp_path / "b")
    d.procs.saw_step(5)  # steps trained, no checkpoint at all
    assert d.procs.start(TrainConfig().toggles, None, strict=True) is None and s.spawns == []
    assert "no checkpoint to resume from after step 5" in s.halted

    s, d = command_driver(tmp_path / "c")
    d.procs.saw_step(30)
    report(d, 30, hf_checkpoint(tmp_path / "c" / "out", 30), "stop")
    pre = d.procs.start(TrainConfig().toggles, None, strict=True)
    shutil.rmtree(tmp_path / "c" / "run" / "tuner-checkpoints")  # someone deleted gptop's copy
    info = d.procs.rollback(pre)
    assert info["path"] is None and "rolls back to is gone" in s.halted
    assert not any("(the start)" in e.message for e in s.emitted if e.type == "log")

    s, d = command_driver(tmp_path / "d")  # a trial that started at step 0 rolls back to the start: no loss
    d.procs.saw_step(3)
    assert d.procs.rollback(None)["step"] == 0 and s.halted is None
    assert d.procs.start(TrainConfig().toggles, None, strict=True) == (0, "") and s.spawns == [(None, 0)]


class AnnouncingSupervisor(FakeSupervisor):
    def __init__(self, announced: bool):
        super().__init__()
        self.client_connected = announced


@pytest.mark.parametrize("command", [["python", "train.py"], None])
def test_a_command_without_a_client_is_refused_when_it_exits_or_after_a_while(tmp_path, command):
    s = FakeSession(tmp_path)
    s.command = command
    d = TuningDriver(s, 60.0)
    s.supervisor = AnnouncingSupervisor(announced=True)
    d.procs.check_client(1e6, exit_code=0)  # a client announced itself: its hello may take long
    assert s.halted is None
    s.supervisor = AnnouncingSupervisor(announced=False)
    d.procs.check_client(d.procs.client_wait_s - 1)
    assert s.halted is None
    d.procs.check_client(d.procs.client_wait_s + 1)
    if command is None:  # gptop's own trainer: always a client
        assert s.halted is None
        return
    err = [e for e in s.emitted if e.type == "error"]
    assert len(err) == 1 and err[0].kind == "config" and "no gptop client" in err[0].message
    for words in ("GptopCallback", "tuned_args", "resume_checkpoint", "gptop run"):
        assert words in err[0].message
    s2 = FakeSession(tmp_path / "b")
    s2.command, s2.supervisor = command, AnnouncingSupervisor(announced=False)
    TuningDriver(s2, 60.0).procs.check_client(2.0, exit_code=0)  # it exited: refused at once
    assert "it exited (code 0) without one" in s2.halted


@pytest.mark.parametrize("ended_by", ["gptop", "tuner"])
def test_a_process_that_starts_below_its_checkpoint_halts_the_run(tmp_path, ended_by):
    """A start below the step gptop resumed it from (the run's steps lost) is an error of its own kind, said
    in the summary and the report (whoever ended the process: gptop at its hello, or the tuner's rollback before
    the checkpoint to go back to was found gone), and ends the run as failed: no restart-on-failure repeats it."""
    import contextlib
    import io

    from fixtures.streams import config, ev

    from gptop.report import print_report
    from gptop.summary import print_summary

    cfg = TrainConfig()
    cfg.run.run_dir = str(tmp_path)
    s = Session(cfg, SessionOptions(restart_on_failure=3))
    s.expect_start = (20, str(tmp_path / "held" / "checkpoint-20"))
    built = dict(device={"type": "cpu", "name": "cpu"}, model={"family": "llama", "size": "tiny"})
    hello = ev("hello", 0.0, config=config("llama", "tiny", "cpu"), start_step=0, **built)
    s.publish(hello)
    s.check_start(hello)
    assert s.halted and "started at step 0, not at step 20" in s.halted and "held/checkpoint-20" in s.halted
    s.publish(make("exit", pid=42, signal=9, seconds=3.0, stopped_by=ended_by))  # as Session.record_exit writes it
    s.handle_exit(-9)
    assert s.wait(1) == 1 and s.state.status == "failed"
    err = s.state.last_error()
    assert err is not None and err.kind == "lost_steps"
    out = io.StringIO()
    print_summary(s.state, 1, out)
    assert "gptop stopped the run rather than lose trained steps" in out.getvalue()
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = print_report(tmp_path)
    state = next(line for line in text.getvalue().splitlines() if line.startswith("state"))
    assert code == 1 and "lost_steps" in state and "started at step 0" in state, text.getvalue()
    s2 = Session(cfg)
    s2.expect_start = (20, "ckpt")
    s2.check_start(ev("hello", 0.0, config=config("llama", "tiny", "cpu"), start_step=20, **built))
    early = ev("hello", 0.0, config={}, early=True, start_step=0, **built)  # gptop's own record of a start
    s2.check_start(early)
    assert s2.halted is None
