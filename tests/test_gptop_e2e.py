"""End to end: gptop supervising real trainer processes on the CPU."""

import json
import os
import shutil
import signal
from pathlib import Path

import psutil
import pytest

from helpers import TINY, TINY_TOKENS_PER_STEP, run_gptop, start_gptop, wait_for
from trainer.contract import rundir
from trainer.contract.events import parse, read_events, to_dict

pytestmark = [pytest.mark.slow, pytest.mark.process]


def events_of(run_dir, kind=None):
    p = Path(run_dir) / "events.jsonl"
    if not p.exists():
        return []
    return [
        to_dict(e)
        for e in read_events(p)
        if kind is None or e.type == kind  # validated, as on the wire
        if not (kind == "hello" and e.early)
    ]  # "hello": the full ones (an early one comes first)


def trainer_pid(run_dir):
    hello = events_of(run_dir, "hello")
    return hello[-1]["pid"] if hello else None


def gone(pid, timeout=60):
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        pass
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


STEPS, LOG_EVERY = 30, 5


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One `gptop --json train` run (deepseek, MoE) to its end: test_json_run_prints_step_and_device_events reads
    what it printed; the report, the replay and the resume below read its run directory (a test that changes it
    works on a copy). (run dir, stdout, stderr)"""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    p = start_gptop(
        "--no-ui",
        "--json",
        "train",
        "--model",
        "deepseek",
        *TINY,
        "--max-steps",
        str(STEPS),
        "--log-every",
        str(LOG_EVERY),
        "--run-dir",
        str(run_dir),
    )
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    return run_dir, out, err


def test_json_run_prints_step_and_device_events(finished):
    run_dir, out, err = finished
    events = [parse(line) for line in out.splitlines()]  # every line is a valid event
    kinds = [e.type for e in events]
    assert "step" in kinds and "device" in kinds and "hello" in kinds and kinds.count("done") == 1
    steps = [e for e in events if e.type == "step"]
    assert steps[-1].step == STEPS and steps[-1].expert_load
    assert (run_dir / "device.jsonl").stat().st_size > 0 and (run_dir / "trainer.log").stat().st_size > 0
    # the closing summary goes to stderr: stdout stayed JSON lines (parsed above)
    assert f"gptop: run finished: {STEPS} steps" in err and f"gptop report {run_dir}" in err


def test_ctrl_c_stops_gracefully_and_leaves_no_process(tmp_path):
    run_dir = tmp_path / "run"
    p = start_gptop("--no-ui", "train", *TINY, "--max-steps", "100000", "--run-dir", str(run_dir))
    wait_for(lambda: events_of(run_dir, "step"), what="first step")
    pid = trainer_pid(run_dir)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    done = events_of(run_dir, "done")[-1]
    assert rundir.list_checkpoints(run_dir)[-1].step == done["step"]
    assert gone(pid)
    summary = out[out.index("gptop: run stopped by you at step") :]  # the summary ends the output
    assert f"run dir    {run_dir}" in summary and f"gptop train --resume {run_dir}" in summary


def test_kill_of_gptop_leaves_no_orphan(tmp_path):
    run_dir = tmp_path / "run"
    p = start_gptop("--no-ui", "train", *TINY, "--max-steps", "100000", "--run-dir", str(run_dir))
    wait_for(lambda: events_of(run_dir, "step"), what="first step")
    pid = trainer_pid(run_dir)
    p.kill()  # SIGKILL: gptop gets no chance to clean up
    p.wait()
    assert gone(pid, timeout=120), "trainer outlived gptop"
    done = events_of(run_dir, "done")[-1]  # it noticed, checkpointed and exited
    assert done["reason"] == "launcher went away"
    assert rundir.list_checkpoints(run_dir)[-1].step == done["step"]


def test_kill9_of_trainer_fails_then_restarts_from_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    p = start_gptop(
        "--no-ui", "train", *TINY, "--max-steps", "100000", "--checkpoint-every", "3", "--run-dir", str(run_dir)
    )
    wait_for(lambda: rundir.list_checkpoints(run_dir), what="a checkpoint")
    os.kill(trainer_pid(run_dir), signal.SIGKILL)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1
    assert "signal 9" in err
    (end,) = events_of(run_dir, "exit")  # gptop's record of the trainer's end, whoever killed it
    assert end["signal"] == signal.SIGKILL and "stopped_by" not in end and end["seconds"] > 0

    # the same failure with --restart-on-failure: it resumes from the last checkpoint and finishes
    run2 = tmp_path / "run2"
    p = start_gptop(
        "--no-ui",
        "--json",
        "train",
        *TINY,
        "--max-steps",
        "30",
        "--checkpoint-every",
        "3",
        "--restart-on-failure",
        "1",
        "--fault",
        "kill@7",
        "--run-dir",
        str(run2),
    )
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    hellos = events_of(run2, "hello")
    assert len(hellos) == 2 and hellos[1]["start_step"] == 6 and hellos[1]["resumed_from"]
    assert hellos[1]["start_tokens"] == 6 * TINY_TOKENS_PER_STEP  # the count its checkpoint held
    assert events_of(run2, "done")[-1]["step"] == 30
    # the report continues the count: 30 steps kept; step 7, trained before the kill, was thrown away
    r = run_gptop("--json", "report", str(run2))
    s = json.loads(r.stdout)
    assert (s["steps"], s["tokens"], s["steps_rolled_back"]) == (30, 30 * TINY_TOKENS_PER_STEP, 1), s
    assert s["tokens_processed"] == 31 * TINY_TOKENS_PER_STEP
    # each process's end, the killed one's before the restart's start
    assert [(e.get("signal"), e.get("exit_code")) for e in events_of(run2, "exit")] == [
        (signal.SIGKILL, None),
        (None, 0),
    ]
    kinds = [e["type"] for e in events_of(run2) if e["type"] in ("hello", "exit") and not e.get("early")]
    assert kinds == ["hello", "exit", "hello", "exit"]


def test_bad_usage_exit_2(tmp_path):
    p = start_gptop("--no-ui", "train", *TINY, "--precision", "fp8-rowwise", "--run-dir", str(tmp_path / "r"))
    out, err = p.communicate(timeout=300)
    assert p.returncode == 2 and "--precision" in err
    p = start_gptop("--no-ui", "train", "--micro-batch", "zero")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "--micro-batch" in err


def test_resume_continues_a_run(finished, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished[0], run_dir)
    p = start_gptop("--no-ui", "train", "--resume", str(run_dir), "--max-steps", str(STEPS + 4))
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    hello = events_of(run_dir, "hello")[-1]
    assert hello["start_step"] == STEPS and hello["config"]["model"]["size"] == "tiny"
    assert hello["config"]["model"]["model"] == "deepseek"
    assert events_of(run_dir, "done")[-1]["step"] == STEPS + 4
    assert f"step {STEPS + 4}/{STEPS + 4}" in out


def test_report_of_a_finished_run(finished):
    run_dir = finished[0]
    p = run_gptop("report", str(run_dir))
    assert p.returncode == 0, p.stderr
    assert f"{STEPS}/{STEPS} steps" in p.stdout and "tokens/s" in p.stdout and "forward" in p.stdout
    p = run_gptop("--json", "report", str(run_dir))
    assert len(p.stdout.splitlines()) == 1, p.stdout  # --json: one JSON line, as everywhere
    s = json.loads(p.stdout)
    assert s["steps"] == STEPS and s["tokens"] == STEPS * TINY_TOKENS_PER_STEP and len(s["checkpoints"]) == 1


def test_monitor_replays_a_finished_run(finished):
    p = run_gptop("--no-ui", "--json", "--run-dir", str(finished[0]), timeout=120)
    assert p.returncode == 0, p.stderr
    kinds = [parse(l).type for l in p.stdout.splitlines()]
    assert kinds.count("step") == STEPS // LOG_EVERY and "done" in kinds
