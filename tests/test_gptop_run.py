"""End to end: `gptop run -- CMD` supervising real commands on the CPU (the examples, a transformers.Trainer
script the examples did not write, plain commands without a client)."""

from __future__ import annotations

import dataclasses
import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from helpers import ROOT, gone, gptop_env, run_events, start_gptop, wait_for
from trainer.contract.events import parse, read_events

pytestmark = [pytest.mark.slow, pytest.mark.process]

EXAMPLES = ROOT / "examples"
HF_SCRIPT = ROOT / "tests" / "fixtures" / "hf_script.py"


def client_hello(run_dir: Path):
    return next((e for e in run_events(run_dir, "hello") if e.client is not None), None)


def test_a_transformers_script_as_json_lines_and_the_same_script_without_gptop(tmp_path):
    p = start_gptop(
        "--no-ui",
        "--json",
        "run",
        "--run-dir",
        "run",
        "--",
        sys.executable,
        str(HF_SCRIPT),
        "--out",
        "hf",
        cwd=tmp_path,
    )
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    evs = [parse(line) for line in out.splitlines()]  # every stdout line is an event of the one schema
    kinds = {e.type for e in evs}
    assert {"hello", "step", "device", "status", "done", "checkpoint"} <= kinds
    hello = next(e for e in evs if e.type == "hello" and e.client == "transformers")
    assert hello.max_steps == 12 and hello.model.family == "GPTNeoXForCausalLM"
    steps = [e for e in evs if e.type == "step"]
    assert [e.step for e in steps] == [3, 6, 9, 12]  # the script's logging_steps
    assert all(e.loss is not None and e.phases_ms["forward"] > 0 and e.phases_ms["backward"] > 0 for e in steps)
    assert steps[-1].tokens == 12 * 4 * 2 * 20
    assert any(e.type == "device" and e.cpu is not None and e.cpu.proc_rss for e in evs)  # its process tree
    assert [e.step for e in evs if e.type == "checkpoint"] == [6, 12] and (tmp_path / "hf" / "checkpoint-12").is_dir()
    assert "gptop: run finished: 12 steps" in err and "command" in err  # the summary, on stderr with --json
    with_gptop = json.loads((tmp_path / "run" / "trainer.log").read_text().strip().splitlines()[-1])

    plain = subprocess.run(
        [sys.executable, str(HF_SCRIPT), "--out", "hf2"],
        cwd=tmp_path,
        env=gptop_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout.strip().splitlines()[-1]) == with_gptop  # trains as before, bit for bit

    r = subprocess.run(
        [sys.executable, "-m", "gptop", "report", "run"],
        cwd=tmp_path,
        env=gptop_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "12/12 steps" in r.stdout and f"command   {sys.executable} {HF_SCRIPT}" in r.stdout
    assert "phases    data" in r.stdout and "2 written, 2 kept" in r.stdout
    export = start_gptop("export", "run", "exported", cwd=tmp_path)  # a Trainer's checkpoints: from_pretrained
    _, err = export.communicate(timeout=120)
    assert export.returncode == 2 and "from_pretrained: the newest, " in err and "checkpoint-12" in err, err

    # best.toml of a tune of this script says how to apply it: its GPTOP_TOGGLES line, given to gptop run as it
    # says, reaches the script's tuned_args (micro-batch 2: the Trainer's own batch of 8 kept with 4 steps)
    from tuner.tuning_report import TunedCommand, best_toml

    best = dataclasses.replace(hello.toggles, micro_batch=2)
    argv = [sys.executable, str(HF_SCRIPT), "--out", "hf3"]
    text = best_toml(best, TunedCommand(argv, hello.toggles, hello.micro_batch * hello.accumulation))
    assert "per_device_train_batch_size=2, gradient_accumulation_steps=4" in text
    assignment, *command = shlex.split(next(x for x in text.splitlines() if "GPTOP_TOGGLES=" in x)[1:])
    name, _, value = assignment.partition("=")
    assert command == ["gptop", "run", "--", *argv]
    tuned = subprocess.run(
        [sys.executable, "-m", "gptop", "--no-ui", "run", "--run-dir", "run3", *command[2:]],
        cwd=tmp_path,
        env={**gptop_env(), name: value},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert tuned.returncode == 0, tuned.stderr
    applied = client_hello(tmp_path / "run3")
    assert (applied.micro_batch, applied.accumulation, applied.toggles) == (2, 4, best)


def test_ctrl_c_stops_a_plain_loop_with_its_own_checkpoint(tmp_path):
    run = tmp_path / "run"
    p = start_gptop(
        "--no-ui",
        "run",
        "--run-dir",
        "run",
        "--log-every",
        "2",
        "--",
        sys.executable,
        str(EXAMPLES / "train_loop.py"),
        "--steps",
        "100000",
        "--step-sleep",
        "0.02",
        "--out",
        "ckpt",
        cwd=tmp_path,
    )
    wait_for(lambda: run_events(run, "step"), timeout=300, what="the first step event")
    pid = client_hello(run).pid
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130, err
    assert gone(pid)
    done = run_events(run, "done")[-1]
    ckpt = run_events(run, "checkpoint")[-1]
    # the stop gptop asked for (its reason wins over the signal that also reached the program's main process)
    assert done.reason in ("stop requested", "SIGINT") and ckpt.reason == "stop" and ckpt.step == done.step
    assert Path(ckpt.path) == tmp_path / "ckpt" / f"step-{done.step}.pt" and Path(ckpt.path).exists()
    assert "gptop: run stopped by you at step" in out and f"checkpoint {ckpt.path}" in out
    r = subprocess.run(
        [sys.executable, "-m", "gptop", "--json", "report", "run"],
        cwd=tmp_path,
        env=gptop_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert len(r.stdout.splitlines()) == 1, r.stdout  # --json: one JSON line, as everywhere
    s = json.loads(r.stdout)
    assert s["steps"] >= 2 and s["checkpoints_kept"] == [{"step": ckpt.step, "path": ckpt.path}]
    assert s["done"] == done.reason and s["command"][1] == str(EXAMPLES / "train_loop.py")


def test_kill_9_of_gptop_leaves_nothing_running(tmp_path):
    # a loop with the probe: it sees its channel close, checkpoints and exits
    run = tmp_path / "run"
    p = start_gptop(
        "--no-ui",
        "run",
        "--run-dir",
        "run",
        "--",
        sys.executable,
        str(EXAMPLES / "train_loop.py"),
        "--steps",
        "100000",
        "--step-sleep",
        "0.02",
        "--out",
        "ckpt",
        cwd=tmp_path,
    )
    wait_for(lambda: client_hello(run) and run_events(run, "step"), timeout=300, what="a step")
    pid = client_hello(run).pid
    # a command without a client: the warden ends it
    run2 = tmp_path / "run2"
    p2 = start_gptop(
        "--no-ui", "run", "--run-dir", "run2", "--", sys.executable, "-c", "import time; time.sleep(600)", cwd=tmp_path
    )
    wait_for(lambda: run_events(run2, "hello"), timeout=120, what="the command's start")
    pid2 = run_events(run2, "hello")[0].pid
    for gp in (p, p2):
        gp.kill()
        gp.wait()
    assert gone(pid, timeout=120), "the loop outlived gptop"
    assert gone(pid2, timeout=120), "the plain command outlived gptop"
    done = run_events(run, "done")[-1]
    # The loop's client sees both ends of gptop: its channel's end of file and the warden's SIGTERM, whichever
    # comes first (on a loaded machine the warden's can); either is the graceful stop, with its checkpoint.
    assert done.reason in ("launcher went away", "SIGTERM"), done.reason
    assert run_events(run, "checkpoint")[-1].step == done.step
    wardens = [
        q
        for q in psutil.process_iter(["cmdline"])  # [python, -m, gptop.warden, FD, PID, GRACE]
        if (q.info["cmdline"] or [])[2:3] == ["gptop.warden"] and q.info["cmdline"][4] in (str(pid), str(pid2))
    ]
    assert all(gone(q.pid, timeout=60) for q in wardens)


def test_exit_codes_of_plain_commands(tmp_path):
    # exits 0: finished; fails: exit 1 with its stderr in the summary
    p = start_gptop("--no-ui", "run", "--run-dir", "ok", "--", sys.executable, "-c", "print('hi')", cwd=tmp_path)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and "gptop: run finished after" in out, out + err
    fail = "import sys; print('something broke', file=sys.stderr); sys.exit(3)"
    p = start_gptop("--no-ui", "run", "--run-dir", "bad", "--", sys.executable, "-c", fail, cwd=tmp_path)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1, out + err
    assert "failed (exit code 3)" in err and "    something broke" in out  # the summary's stderr lines
    # stopped, but it ignores SIGINT: killed after --grace, exit 130, nothing left
    ignore = (
        "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
    )
    p = start_gptop(
        "--no-ui", "run", "--run-dir", "stuck", "--grace", "1", "--", sys.executable, "-c", ignore, cwd=tmp_path
    )
    # its output and gptop's record of the start (the hello, with its pid) are written by two threads
    wait_for(
        lambda: (
            "up" in (tmp_path / "stuck" / "trainer.log").read_text()
            if (tmp_path / "stuck" / "trainer.log").exists()
            else False
        ),
        timeout=120,
        what="the command to start",
    )
    wait_for(lambda: run_events(tmp_path / "stuck", "hello"), timeout=60, what="gptop's record of the start")
    pid = run_events(tmp_path / "stuck", "hello")[0].pid
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130 and gone(pid, timeout=30)
    assert "the command ended (signal 9)" in out


def test_a_missing_command_is_exit_2_and_creates_nothing(tmp_path):
    for cmd in (["no-such-program-here"], [sys.executable, "missing.py"], [str(tmp_path)]):
        p = start_gptop("--no-ui", "run", "--", *cmd, cwd=tmp_path)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2 and "CMD:" in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_lightning_script(tmp_path):
    probe = subprocess.run([sys.executable, "-c", "import lightning"], env=gptop_env(), capture_output=True)
    if probe.returncode != 0:
        pytest.skip("Lightning is an optional extra: pip install 'gptop[lightning]'")
    p = start_gptop(
        "--no-ui",
        "--json",
        "run",
        "--run-dir",
        "run",
        "--log-every",
        "5",
        "--",
        sys.executable,
        str(EXAMPLES / "train_lightning.py"),
        "--steps",
        "10",
        "--out",
        "pl",
        cwd=tmp_path,
    )
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    steps = [e for e in map(parse, out.splitlines()) if e.type == "step"]
    assert [e.step for e in steps] == [5, 10] and all(e.loss is not None and e.phases_ms for e in steps)


def test_two_ranks_stop_on_the_same_step(tmp_path):
    """torchrun as the command: each rank's probe reports with its rank, and a stop lands on one step."""
    run = tmp_path / "run"
    p = start_gptop(
        "--no-ui",
        "run",
        "--run-dir",
        "run",
        "--",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        str(ROOT / "tests" / "fixtures" / "ddp_loop.py"),
        "--out",
        "ckpt",
        cwd=tmp_path,
    )
    rank1 = run / "events.rank1.jsonl"
    wait_for(
        lambda: run_events(run, "step") and rank1.exists() and rank1.stat().st_size,
        timeout=300,
        what="step events of both ranks",
    )
    pids = [e.pid for e in run_events(run, "hello") if e.client is not None]
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130, out + err
    done = run_events(run, "done")[-1]
    last = {0: run_events(run, "step")[-1].step, 1: [e for e in read_events(rank1) if e.type == "step"][-1].step}
    assert last == {0: done.step, 1: done.step}, (last, done)  # both ranks stopped after the same step
    ckpt = run_events(run, "checkpoint")[-1]
    assert ckpt.reason == "stop" and ckpt.step == done.step and Path(ckpt.path).exists()
    steps = run_events(run, "step")
    assert steps[-1].tokens == steps[-1].step * 2 * 4 * 16 and {e.rank for e in read_events(rank1)} == {1}
    assert all(gone(pid) for pid in pids)


def test_the_dashboard_shows_a_loop_and_q_stops_it(tmp_path):
    from fixtures.terminal import Terminal
    from test_tui_terminal import screen_text

    run = tmp_path / "run"
    term = Terminal(
        [
            sys.executable,
            "-m",
            "gptop",
            "run",
            "--run-dir",
            str(run),
            "--log-every",
            "2",
            "--",
            sys.executable,
            str(EXAMPLES / "train_loop.py"),
            "--steps",
            "100000",
            "--step-sleep",
            "0.02",
            "--out",
            str(tmp_path / "ckpt"),
        ],
        cols=120,
        rows=40,
        env=dict(gptop_env(), TERM="xterm-256color", COLUMNS="120", LINES="40"),
    )
    try:
        wait_for(lambda: run_events(run, "step"), timeout=300, what="a step event")
        wait_for(lambda: "LlamaForCausalLM" in screen_text(term)[-20000:], timeout=60, what="the client's hello")
        pid = client_hello(run).pid
        term.send(b"q")
        assert term.proc.wait(120) == 130
    finally:
        term.close()
    assert gone(pid) and run_events(run, "checkpoint")[-1].reason == "stop"
    text = screen_text(term)
    assert "gptop: run stopped by you at step" in text and "command" in text
