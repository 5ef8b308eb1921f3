"""`gptop run -- CMD` without starting anything: the command's checks, the run's name, and what the state,
the summary, the headless lines and the report make of a command's run."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from gptop import cli, warden
from gptop.controls import StopSignals
from gptop.headless import event_line
from gptop.program import ProgramSession, check_command, default_run_dir, program_name
from gptop.report import format_report, summarize
from gptop.state import RunState
from gptop.summary import outcome, summary_lines
from trainer.contract import events as ev
from trainer.contract.config import ConfigError
from trainer.contract.device import DeviceInfo

CPU = DeviceInfo(type="cpu", name="test cpu")


def refusal(words: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        check_command(words)
    assert e.value.option == "CMD"
    return e.value.message


def test_the_command_is_checked_before_anything_starts(tmp_path, monkeypatch):
    assert check_command(["--", sys.executable, "-c", "pass"]) == [sys.executable, "-c", "pass"]
    assert "no command given" in refusal(["--"]) and "no command given" in refusal([])
    assert "command not found" in refusal(["no-such-program-xyz"])
    assert "is a directory" in refusal([str(tmp_path)])
    assert "no such file" in refusal([str(tmp_path / "missing")])
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\n")
    assert "not executable" in refusal([str(script)]) and f"python {script}" in refusal([str(script)])
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "on PATH but not executable" in refusal(["train.sh"])
    monkeypatch.undo()
    assert "no such Python script" in refusal([sys.executable, str(tmp_path / "nope.py")])
    assert check_command([sys.executable, "-u", "-c", "pass"])[1] == "-u"


def test_cli_refuses_a_missing_command_with_exit_2_and_creates_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--no-ui", "run", "--", "no-such-program-xyz", "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "CMD: no-such-program-xyz: command not found" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_run_is_named_after_its_script():
    assert program_name(["python", "examples/train_loop.py", "--steps", "3"]) == "train_loop"
    assert program_name(["torchrun", "--nproc-per-node", "2", "train.py"]) == "train"
    assert program_name(["./launch me.sh"]) == "launch_me"
    assert default_run_dir(["python", "x/y.py"], when=0).startswith(os.path.join("runs", "19"))
    assert default_run_dir(["python", "x/y.py"]).endswith("-y")


def test_a_graceful_stop_passes_on_sigterm_else_sends_sigint(tmp_path):
    signals = StopSignals()
    session = ProgramSession(["true"], tmp_path / "r", signals=signals)
    assert session.stop_signal() == signal.SIGINT  # q, or Ctrl-C
    for got, sent in (
        (signal.SIGINT, signal.SIGINT),
        (signal.SIGTERM, signal.SIGTERM),
        (signal.SIGHUP, signal.SIGTERM),
    ):
        signals.last_signal = got
        assert session.stop_signal() == sent
    assert session.run_config() == {"command": {"argv": ["true"], "log_every": None}}


def command_state(tmp_path: Path, *, client: bool = True) -> RunState:
    state = RunState(run_dir=str(tmp_path / "run"))
    state.apply(
        ev.HelloEvent(
            early=True,
            pid=42,
            config={},
            device=CPU,
            model=ev.ModelInfo(),
            time=1.0,
            command=["python", "train.py", "--lr", "1e-3"],
        )
    )
    if client:
        state.apply(
            ev.HelloEvent(
                pid=43,
                config={"optim": {"max_steps": 4}, "toggles": {"precision": "fp32"}},
                device=CPU,
                model=ev.ModelInfo(family="LlamaForCausalLM", total_params=1000),
                client="probe",
                time=2.0,
            )
        )
        for step in (2, 4):
            state.apply(
                ev.StepEvent(
                    step=step,
                    tokens=step * 10,
                    loss=3.0 / step,
                    lr=1e-3,
                    grad_norm=1.0,
                    step_ms=100,
                    phases_ms={"data": 1, "forward": 80, "backward": 10, "optimizer": 5, "other": 4},
                    tokens_per_s=100.0,
                    mfu=None,
                    mem_bytes=1,
                    time=2.0 + step,
                )
            )
    return state


def test_summary_of_a_command_run(tmp_path):
    state = command_state(tmp_path)
    ckpt = tmp_path / "mine" / "step-4.pt"
    ckpt.parent.mkdir()
    ckpt.write_bytes(b"x")
    state.apply(ev.CheckpointEvent(step=4, path=str(ckpt), seconds=0.1, time=7.0))
    state.apply(ev.DoneEvent(step=4, tokens=40, reason="max_steps", time=8.0))
    state.set_status("done")
    text = "\n".join(summary_lines(state, 0))
    assert "gptop: run finished: 4 steps" in text and "command    python train.py --lr 1e-3" in text
    assert f"checkpoint {ckpt} (step 4; 1 written)" in text
    assert "resume" not in text and "export" not in text  # the program's own business
    assert state.bottleneck_hint() == "compute-bound (forward+backward 90%)"  # no gptop flags to try


def test_a_command_without_a_client_that_exits_0_finished(tmp_path):
    state = command_state(tmp_path, client=False)
    state.set_status("done")
    assert outcome(state, 0) == "finished"
    assert summary_lines(state, 0)[0].startswith("gptop: run finished after")
    assert event_line(state.hello, state) == f"starting: python train.py --lr 1e-3 (pid 42), run dir {tmp_path / 'run'}"


def test_a_failed_command_shows_its_last_stderr_lines(tmp_path):
    state = command_state(tmp_path, client=False)
    for i in range(8):
        state.add_log(f"line {i}", "stderr")
    state.add_log("not this one", "stdout")
    state.set_status("failed", "python train.py failed (exit code 1)")
    lines = summary_lines(state, 1)
    i = next(i for i, line in enumerate(lines) if line.strip().startswith("stderr"))
    assert lines[i].endswith("last 5 lines:")
    assert [x.strip() for x in lines[i + 1 : i + 6]] == [f"line {k}" for k in range(3, 8)]


def test_report_of_a_command_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    ckpt = tmp_path / "c.pt"
    ckpt.write_bytes(b"x")
    state_events = [
        ev.HelloEvent(early=True, pid=1, config={}, device=CPU, model=ev.ModelInfo(), command=["python", "t.py"]),
        ev.HelloEvent(
            pid=2, config={"optim": {"max_steps": 2}}, device=CPU, model=ev.ModelInfo(family="M"), client="probe"
        ),
        ev.StepEvent(
            step=2,
            tokens=20,
            loss=1.0,
            lr=None,
            grad_norm=None,
            step_ms=10.0,
            phases_ms=None,
            tokens_per_s=2.0,
            mfu=None,
            mem_bytes=None,
        ),
        ev.CheckpointEvent(step=1, path=str(ckpt), seconds=None),
        ev.CheckpointEvent(step=1, path=str(tmp_path / "gone.pt"), seconds=None),
        ev.CheckpointEvent(step=2, path=str(ckpt), seconds=None),  # the same file, overwritten: kept once
        ev.DoneEvent(step=2, tokens=20, reason="max_steps"),
    ]
    (run / "events.jsonl").write_text("".join(ev.dumps(e) + "\n" for e in state_events))
    s = summarize(run)
    assert s["command"] == ["python", "t.py"] and s["steps"] == 2 and s["starts"] == 1
    assert s["checkpoints_kept"] == [{"step": 2, "path": str(ckpt)}]
    text = format_report(s)
    assert "command   python t.py" in text and "model     M " in text and "3 written, 1 kept" in text


def program_run_dir(tmp_path: Path, client: str | None) -> Path:
    """What `gptop run -- python t.py` leaves: gptop's record of the command, its client's hello and checkpoint
    (a Trainer's output_dir/checkpoint-N, still there) when it has one, gptop's record of its end."""
    run = tmp_path / "run"
    run.mkdir()
    ckpt = tmp_path / "out" / "checkpoint-12"
    ckpt.mkdir(parents=True)
    events = [ev.HelloEvent(early=True, pid=1, config={}, device=CPU, model=ev.ModelInfo(), command=["python", "t.py"])]
    if client is not None:
        events += [
            ev.HelloEvent(pid=1, config={}, device=CPU, model=ev.ModelInfo(family="M"), client=client),
            ev.CheckpointEvent(step=12, path=str(ckpt), seconds=0.1),
        ]
    events.append(ev.ExitEvent(pid=1, exit_code=0, seconds=3.0))
    (run / "events.jsonl").write_text("".join(ev.dumps(e) + "\n" for e in events))
    return run


@pytest.mark.parametrize("client", [None, "probe", "transformers"])
def test_export_sample_and_resume_refuse_a_programs_run_saying_what_loads_it(tmp_path, capsys, client):
    """A program's checkpoints are its own format: gptop export, sample and --resume say so in one line, exit 2,
    naming what loads them instead (from_pretrained for a Trainer's, else the script's own code; the program
    resumes itself), not 'a run that made no checkpoint', and create nothing."""
    run = program_run_dir(tmp_path, client)
    before = sorted(tmp_path.rglob("*"))
    for argv in (["export", str(run), str(tmp_path / "exported")], ["sample", str(run), "--prompt", "hi"]):
        with pytest.raises(SystemExit) as e:  # RUN_DIR is checked as it is parsed
            cli.main(argv)
        assert e.value.code == 2
    assert cli.main(["--no-ui", "train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all("is a run of your own program (python t.py): gptop cannot" in x for x in err), err
    assert "cannot export it" in err[0] and "cannot sample it" in err[1] and "cannot resume it" in err[2]
    assert not any("made no checkpoint" in x for x in err)
    newest = str(tmp_path / "out" / "checkpoint-12")
    if client == "transformers":
        assert f"from_pretrained: the newest, {newest}, or what the script saves to its output_dir" in err[0]
    else:
        assert "the script's own code" in err[0] and "from_pretrained:" not in err[0]
    assert "gptop run --run-dir NEW_DIR -- python t.py" in err[2]
    assert sorted(tmp_path.rglob("*")) == before


def test_the_warden_tells_a_running_process_from_a_gone_one():
    assert warden.pid_alive(os.getpid()) and warden.group_alive(os.getpgid(0))
    assert not warden.pid_alive(2**22 + 12345) and not warden.group_alive(2**22 + 12345)  # above pid_max


def test_the_checkpoint_held_for_a_tunings_restarts_goes_once_the_run_no_longer_needs_it(tmp_path):
    """gptop.held_checkpoints: after tuning, a newer checkpoint of the script's own releases it; so does the
    run's end at its last step; a run that ended otherwise keeps it (it may be its newest state)."""
    from gptop import held_checkpoints as held

    def session_holding(name: str, step: int) -> ProgramSession:
        s = ProgramSession(["true"], tmp_path / name, tune=True)
        s.run_dir.mkdir()
        src = tmp_path / f"{name}-out" / f"checkpoint-{step}"
        src.mkdir(parents=True)
        (src / "model.safetensors").write_text("w")
        held.hold(s.run_dir, step, src, move=True)
        return s

    s = session_holding("a", 20)
    own = tmp_path / "a-out" / "checkpoint-20"
    s._on_event(ev.CheckpointEvent(step=20, path=str(own), seconds=0.1))  # not newer: kept
    assert held.held_step(s.run_dir) == 20
    (tmp_path / "a-out" / "checkpoint-24").mkdir()
    s._on_event(ev.CheckpointEvent(step=24, path=str(tmp_path / "a-out" / "checkpoint-24"), seconds=0.1))
    assert held.held_step(s.run_dir) is None and not held.held_dir(s.run_dir).exists()
    assert any("no longer needed" in line for _, line in s.state.logs)

    s = session_holding("b", 20)
    s.handle_exit(0)  # finished at its last step
    assert held.held_step(s.run_dir) is None

    s = session_holding("c", 20)
    s.handle_exit(1)  # failed: the held one may be its newest state
    assert held.held_step(s.run_dir) == 20
