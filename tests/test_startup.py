"""Live from the first second (issue 11 §1): a stop before the first step ends startup at once, and the
light `progress` event reaches gptop every step without being written to events.jsonl."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import pytest

from helpers import TINY, gptop_cmd, trainer_cmd
from trainer.channel import REPEAT_S, Channel, StartupStopped, honour_startup_stop
from trainer.contract import rundir
from trainer.contract.events import read_events
from helpers import wait_for


def events(run_dir):
    p = run_dir / "events.jsonl"
    return list(read_events(p)) if p.exists() else []


@pytest.fixture
def launcher(tmp_path):
    """A Unix socket listening as gptop's supervisor does; yields (uri, accept)."""
    path = str(tmp_path / "s.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    yield f"unix:{path}", lambda: srv.accept()[0]
    for s, h in saved.items():
        signal.signal(s, h)
    srv.close()


@pytest.fixture
def channel(tmp_path, launcher):
    """The trainer's channel connected to `launcher`, with its signal handlers: yields (channel, gptop's end)."""
    uri, accept = launcher
    ch = Channel(tmp_path / "events.jsonl", uri)
    conn = accept()
    ch.install_signal_handlers()
    yield ch, conn
    ch.close()
    conn.close()


def test_a_stop_command_before_the_first_step_interrupts_the_main_thread(channel):
    ch, conn = channel
    with pytest.raises(StartupStopped):
        conn.sendall(b'{"cmd": "stop", "reason": "q"}\n')
        for _ in range(600):  # "building a model": the stop cannot wait for a step boundary
            time.sleep(0.05)
    honour_startup_stop()  # as trainer.runner.main_run does when it catches it


def test_a_library_catch_all_does_not_swallow_the_startup_stop(channel):
    """The stop is raised wherever the main thread is: inside a library's `except Exception` it must pass."""
    ch, conn = channel
    with pytest.raises(StartupStopped):
        conn.sendall(b'{"cmd": "stop", "reason": "q"}\n')
        for _ in range(600):
            try:
                time.sleep(0.05)
            except Exception:  # what transformers or torch may do around a model's construction
                pass
    honour_startup_stop()


def test_a_stop_whose_raise_was_lost_is_raised_again_until_honoured(channel):
    """An asynchronous raise can land where Python swallows it (seen: the `regex` package's Group.__del__,
    run by the garbage collector while transformers built a model): it is raised again, every REPEAT_S,
    until the trainer honours it; a second signal right after the first is only queued."""
    ch, conn = channel
    swallowed = 0
    t0 = time.monotonic()
    with pytest.raises(StartupStopped):
        try:  # the send inside: the raise can land before the next line runs
            conn.sendall(b'{"cmd": "stop", "reason": "q"}\n')
            for _ in range(600):
                time.sleep(0.05)
        except StartupStopped:  # swallowed, as an "Exception ignored in __del__" would be
            swallowed += 1
        os.kill(os.getpid(), signal.SIGTERM)  # a signal right after the raise: only queued
        for _ in range(600):  # startup goes on ... and the stop comes again
            time.sleep(0.05)
    assert swallowed == 1 and time.monotonic() - t0 >= REPEAT_S
    honour_startup_stop()
    wait_for(lambda: ch.pending_commands(), 10, "the queued signal")
    time.sleep(2 * REPEAT_S)  # honoured: nothing is raised any more
    assert ch.startup_stop == "stop command"


def test_a_stop_that_never_got_raised_is_raised_at_the_next_phase(channel):
    """The synchronous fallback: startup's phases and the first step boundary raise a pending stop."""
    ch, conn = channel
    ch.startup_stop = "stop command"  # arrived, but its raise has not come (yet)
    with pytest.raises(StartupStopped):
        ch.check_startup()
    ch.check_startup()  # once: startup is over


def test_after_the_first_step_a_stop_waits_for_the_step_boundary(channel):
    ch, conn = channel
    ch.started()
    conn.sendall(b'{"cmd": "stop"}\n')
    os.kill(os.getpid(), signal.SIGTERM)
    cmds = wait_for(lambda: [c for c in ch.pending_commands()] or None, 10, "the queued commands")
    while len(cmds) < 2:
        cmds += ch.pending_commands()
    assert sorted(c.get("source", "socket") for c in cmds) == ["signal", "socket"]


def failing_build(stop_first: bool):
    """A model build that fails as transformers' lazy import does when an import inside it was interrupted:
    whatever was raised (here: the stop) comes out as its own ModuleNotFoundError."""

    def build(*args, **kwargs):
        try:
            if stop_first:
                os.kill(os.getpid(), signal.SIGINT)  # the stop, arriving while the model's classes import
                time.sleep(5)
        except BaseException:
            pass
        raise ModuleNotFoundError("Could not import module 'DeepseekV3Config'. Are this object's requirements ...")

    return build


@pytest.mark.parametrize("stopped", [True, False], ids=["after a stop", "alone"])
def test_a_stop_that_surfaces_as_a_librarys_error_is_still_a_stop(tmp_path, monkeypatch, stopped):
    """A stop before the first step whose raise a library turned into its own error ends the trainer as
    stopped (exit 0, a `done` event), not as a crash; the same error without a stop is a crash."""
    from trainer import build
    from trainer.contract.events import STOPPED_BEFORE_FIRST_STEP
    from helpers import of, train_in_process

    monkeypatch.setattr(build, "build_bundle", failing_build(stopped))
    code, evs, _ = train_in_process(tmp_path / "run", "--max-steps", "3")
    if stopped:
        assert code == 0 and not of(evs, "error"), [e for e in evs if e.type == "error"]
        assert of(evs, "done")[-1].reason == STOPPED_BEFORE_FIRST_STEP
    else:
        assert code != 0 and not of(evs, "done")
        assert of(evs, "error")[-1].kind == "crash" and "ModuleNotFoundError" in of(evs, "error")[-1].message


def test_a_stop_before_the_channel_whose_raise_was_swallowed_is_honoured_by_it(tmp_path):
    """SIGINT while torch imports (the first handlers) raised where an import caught it: the channel the
    trainer builds next still knows of the stop, and startup's next phase ends it."""
    from trainer.channel import install_startup_handlers

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        install_startup_handlers()
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except StartupStopped:  # swallowed by an import's catch-all
            pass
        ch = Channel(tmp_path / "events.jsonl")
        assert ch.pending_startup_stop() == "SIGINT"
        with pytest.raises(StartupStopped):
            ch.check_startup()
        ch.close()
        again = Channel(tmp_path / "events.jsonl")
        assert again.startup_stop is None  # adopted once, by one channel
        again.close()
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_progress_goes_on_the_socket_only(tmp_path, launcher):
    uri, accept = launcher
    ch = Channel(tmp_path / "events.jsonl", uri)
    conn = accept()
    ch.emit_live("progress", step=3, tokens=300, step_ms=12.5)
    ch.emit("log", message="x")
    ch.close()
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    assert [json.loads(line)["type"] for line in data.splitlines()] == ["progress", "log"]
    assert [e.type for e in read_events(tmp_path / "events.jsonl")] == ["log"]
    Channel(None).emit_live("progress", step=1, tokens=1)  # no launcher: nothing, no error


@pytest.mark.slow
@pytest.mark.process
def test_sigint_while_building_stops_at_once_without_a_checkpoint(tmp_path):
    run_dir = tmp_path / "r"
    # medium (344M): building takes seconds, longer than a swallowed raise takes to come again (REPEAT_S)
    proc = subprocess.Popen(
        trainer_cmd(
            "--model",
            "llama",
            "--size",
            "medium",
            "--max-steps",
            "5",
            "--micro-batch",
            "1",
            "--global-batch",
            "1",
            "--seq-len",
            "64",
            "--device",
            "cpu",
            "--run-dir",
            str(run_dir),
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: [e for e in events(run_dir) if e.type == "phase" and e.phase == "building"],
            what="the building phase",
        )
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    evs = events(run_dir)
    assert evs[0].type == "hello" and evs[0].early and evs[0].estimate.total_bytes > 0
    assert not [e for e in evs if e.type in ("step", "checkpoint")]
    assert [e for e in evs if e.type == "hello" and not e.early] == []  # stopped before it was built
    assert evs[-1].type == "done" and evs[-1].reason == "stopped before the first step"
    assert rundir.list_checkpoints(run_dir) == []


@pytest.mark.slow
@pytest.mark.process
def test_progress_events_reach_gptop_every_step_and_the_stop_during_startup_is_130(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        gptop_cmd(
            "--no-ui",
            "--json",
            "train",
            *TINY,
            "--log-every",
            "4",
            "--max-steps",
            "4",
            "--run-dir",
            str(run_dir),
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    trainer = [e for e in lines if e["type"] not in ("status", "device")]
    assert trainer[0]["type"] == "hello" and trainer[0]["early"] and "estimate" in trainer[0]
    assert [e["step"] for e in lines if e["type"] == "progress"] == [1, 2, 3, 4]
    assert [e["step"] for e in lines if e["type"] == "step"] == [4]
    assert "progress" not in {e.type for e in events(run_dir)}  # the live channel only

    run_dir = tmp_path / "stopped"
    p = subprocess.Popen(
        gptop_cmd(
            "--no-ui",
            "train",
            "--model",
            "llama",
            "--size",
            "small",
            "--max-steps",
            "5",
            "--micro-batch",
            "1",
            "--global-batch",
            "1",
            "--seq-len",
            "64",
            "--device",
            "cpu",
            "--run-dir",
            str(run_dir),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: [e for e in events(run_dir) if e.type == "phase"], what="a startup phase")
        p.send_signal(signal.SIGINT)
        stdout, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130
    lines = stdout.splitlines()
    assert any(line.startswith("startup: ") for line in lines) and not any(line.startswith("step ") for line in lines)
    *evs, end = events(run_dir)
    assert evs[-1].reason == "stopped before the first step" and end.type == "exit" and end.stopped_by == "user"


def test_cpu_auto_micro_batch_takes_the_whole_batch_when_the_estimate_has_room(tmp_path):
    from trainer.worker_cli import parse_config
    from trainer.contract.device import DeviceInfo
    from trainer.device_probe import detect
    from trainer.train import Trainer

    def setup(name, total_memory):
        cfg = parse_config([*TINY, "--micro-batch", "auto", "--run-dir", str(tmp_path / name)])
        real = detect(cfg.run.device)
        dev = DeviceInfo(type="cpu", name=real.name, total_memory=total_memory, cpu_count=real.cpu_count)
        saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
        trainer = Trainer(cfg, dev=dev)
        try:
            trainer.setup()
        finally:
            if trainer.channel is not None:
                trainer.channel.close()
            for s, h in saved.items():
                signal.signal(s, h)
        evs = events(tmp_path / name)
        # a cold token cache (a fresh checkout, or another worker building it) adds its tokenizing phases
        return trainer, [e.message for e in evs if e.type == "phase" and e.phase != "tokenizing"]

    roomy, phases = setup("roomy", 64 << 30)
    assert roomy.micro_batch == 4 and not [p for p in phases if p.startswith("probing")]
    assert phases == ["building llama tiny"]
    tight, phases = setup("tight", 1 << 30)  # fits at micro-batch 1, but the whole batch is over half
    assert [p for p in phases if p.startswith("probing")][:2] == ["probing micro-batch 1", "probing micro-batch 2"]


def test_auto_micro_batch_counts_the_optimizer_state_the_first_step_allocates(tmp_path, monkeypatch):
    """The probe runs forward and backward, but AdamW's moments (8 bytes per trained parameter) appear at the
    first optimizer step and stay: each probed peak includes them, counted by the estimate's rule (a probe
    without them picked a micro-batch that ran out of memory at step 2 on a large model)."""
    import trainer.autobatch as autobatch
    from trainer.worker_cli import parse_config
    from trainer.contract import estimate as E
    from trainer.contract.device import DeviceInfo
    from trainer.device_probe import detect
    from trainer.memory import CpuMemory
    from trainer.train import Trainer

    got = {}
    real_find = autobatch.find_micro_batch

    def spying(probe, local, capacity, **kw):
        got["peaks"] = {mb: probe(mb) for mb in (1, 2)}
        return real_find(probe, local, capacity, **kw)

    monkeypatch.setattr(autobatch, "find_micro_batch", spying)
    monkeypatch.setattr(CpuMemory, "peak", lambda self: 10**9)
    cfg = parse_config([*TINY, "--micro-batch", "auto", "--run-dir", str(tmp_path / "r")])
    real = detect(cfg.run.device)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    trainer = Trainer(cfg, dev=DeviceInfo(type="cpu", name=real.name, total_memory=1 << 30, cpu_count=1))
    try:
        trainer.setup()
    finally:
        if trainer.channel is not None:
            trainer.channel.close()
        for s, h in saved.items():
            signal.signal(s, h)
    shapes = [E.Tensor(tuple(p.shape)) for p in trainer.raw_model.parameters() if p.requires_grad]
    state = E.optimizer_state_bytes("adamw", shapes)
    assert state > 8 * 10**6 and got["peaks"] == {1: 10**9 + state, 2: 10**9 + state}


def test_setup_resolves_into_its_own_config_and_leaves_the_callers(tmp_path, monkeypatch):
    """What auto and the defaults become (size, precision, micro-batch, run directory) is a new config the
    trainer keeps and records (the hello, config.toml, the checkpointer's); the config it was given is as given."""
    import tomllib

    from helpers import restoring_signals
    from trainer.train import Trainer
    from trainer.worker_cli import parse_config

    monkeypatch.chdir(tmp_path)  # the default run directory is relative
    args = [a for a in TINY if a not in ("--size", "tiny")]
    cfg = parse_config([*args, "--size", "auto", "--micro-batch", "auto", "--precision", "auto", "--max-steps", "1"])
    given = cfg.to_dict()
    trainer = Trainer(cfg)
    with restoring_signals():
        try:
            trainer.setup()
        finally:
            if trainer.channel is not None:
                trainer.channel.close()
            if trainer.run_lock is not None:
                trainer.run_lock.release()
    assert cfg.to_dict() == given
    resolved = trainer.cfg.to_dict()
    assert "auto" not in (
        resolved["model"]["size"],
        resolved["toggles"]["precision"],
        resolved["toggles"]["micro_batch"],
    )
    assert resolved["toggles"]["micro_batch"] == trainer.micro_batch
    assert resolved["run"]["run_dir"] == str(trainer.run_dir) and given["run"]["run_dir"] is None
    assert trainer.ckpt.cfg is trainer.cfg  # every checkpoint records the resolved config
    hello = [e for e in read_events(trainer.run_dir / "events.jsonl") if e.type == "hello" and not e.early][-1]
    assert hello.config == resolved
    with open(trainer.run_dir / "config.toml", "rb") as f:
        written = tomllib.load(f)
    assert all(written[s][k] == v for s, values in resolved.items() for k, v in values.items() if v is not None)
