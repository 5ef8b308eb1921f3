"""`gptop tune -- CMD` end to end: a transformers.Trainer script (tests/fixtures/hf_tune_script.py, the three
calls examples/train_transformers.py makes) tuned on its live run through checkpoints and restarts, and a script
that cannot take toggles refused before tuning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.contract.events import read_events, to_dict
from helpers import COURSE_ONLY, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.process]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_transformers.py"


def env_one_thread() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # a small shared box: several threads per process make step times swing
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def gptop(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gptop", "--no-ui", "--json", *args],
        capture_output=True,
        check=False,
        text=True,
        env=env_one_thread(),
        timeout=timeout,
    )


def run_events(run_dir: Path, kind: str | None = None) -> list[dict]:
    return [
        to_dict(e) for e in read_events(run_dir / "events.jsonl") if e.rank == 0 and (kind is None or e.type == kind)
    ]


def decided(run_dir: Path) -> bool:
    """The tuner is done: what follows is the script training on, which measures nothing."""
    path = run_dir / "events.jsonl"
    return path.exists() and any(e["phase"] == "done" for e in run_events(run_dir, "tuner"))


NO_CALLS = """
import sys
sys.path.insert(0, {examples!r})
from transformers import Trainer, TrainingArguments
from gptop.integrations.transformers import GptopCallback
from synthetic import SyntheticText, tiny_llama

args = TrainingArguments(output_dir={out!r}, max_steps=5, per_device_train_batch_size=2, report_to="none",
                         use_cpu=True, disable_tqdm=True)
Trainer(model=tiny_llama(16), args=args, train_dataset=SyntheticText(10, 16), callbacks=[GptopCallback()]).train()
print("trained untuned")
"""


def test_a_script_without_the_two_calls_is_refused_in_one_line(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(NO_CALLS.format(examples=str(ROOT / "examples"), out=str(tmp_path / "out")))
    run_dir = tmp_path / "runs" / "r"
    p = gptop("tune", "--budget", "60s", "--run-dir", str(run_dir), "--", sys.executable, str(script), timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("gptop: error:")]
    assert len(errors) == 1 and "tuned_args" in errors[0] and "resume_checkpoint" in errors[0], p.stderr
    assert not run_dir.exists()  # nothing kept of a refused run


def test_trainer_options_with_a_command_are_refused(tmp_path):
    p = gptop("tune", "--budget", "60s", "--model", "llama", "--", sys.executable, str(EXAMPLE), timeout=120)
    assert p.returncode == 2 and "--model" in p.stderr and "own trainer" in p.stderr
    p = gptop("tune", "--tune-space", "attention=eager", "--", sys.executable, str(EXAMPLE), timeout=120)
    assert p.returncode == 2 and "attention" in p.stderr


HF_TUNE = ROOT / "tests" / "fixtures" / "hf_tune_script.py"


def client_processes(run_dir: Path) -> list[dict]:
    """Each start of the script, in order: its client's hello and the events up to the next start."""
    procs: list[dict] = []
    for e in run_events(run_dir):
        if e["type"] == "hello" and not e["early"]:
            procs.append({"hello": e, "steps": [], "checkpoints": [], "done": None, "error": None})
        elif procs and e["type"] in ("step", "checkpoint"):
            procs[-1][e["type"] + "s"].append(e)
        elif procs and e["type"] in ("done", "error"):
            procs[-1][e["type"]] = e
    return procs


def trained_on_after_tuning(run_dir: Path) -> bool:
    """The tuning is over (its report is written after the last start it makes) and the script trains on."""
    events = run_events(run_dir)
    end = next(
        (i for i, e in enumerate(events) if e["type"] == "log" and e["message"].startswith("tuner: report")), None
    )
    return end is not None and sum(1 for e in events[end:] if e["type"] == "step") >= 2


# Not measuring alone: what it checks (the crash, the resume, the script's own end) holds whatever the measurements
# say, and `--max-trials 2` in a budget that holds them under the other worker's tests ends the search.
def test_a_tuned_trainer_script_keeps_every_step_through_a_failed_trial_and_ends_as_it_would_alone(tmp_path):
    """`gptop tune -- CMD` on a Trainer script saving every 2 steps with save_total_limit=3 (issue 40): its first
    trial crashes after writing 3 checkpoints of its own, which rotate the pre-trial checkpoint out of
    output_dir. The next start resumes at the pre-trial step from gptop's copy (never from step 0), its loss goes
    on from the run's, the global batch stays the script's in every start, the switch checkpoints are not left in
    output_dir. Once the tuner decided and the script trains on, the script ends on its own (its stop file, as
    an early-stopping callback would): exit 0, recorded as its end; its work after train() ran once."""
    run_dir, out, after, stop = tmp_path / "run", tmp_path / "out", tmp_path / "after.txt", tmp_path / "STOP"
    args = ["tune", "--budget", "90s", "--run-dir", str(run_dir), "--storage", f"sqlite:///{tmp_path / 's.db'}"]
    args += COURSE_ONLY  # the failed trial and the resume are checked here, not the figures' precision
    args += ["--max-trials", "2"]  # the crash and one trial after it, then the decision, however fast the machine
    args += ["--tune-space", "-all micro_batch=1,16 fused_adamw=on,off", "--", sys.executable, str(HF_TUNE)]
    # a long run, so that tuning pays on any CPU; the test ends it once the tuner decided and the script trains on
    args += ["--steps", "20000", "--accumulation", "16", "--save-steps", "2", "--out", str(out), "--after", str(after)]
    args += ["--stop-file", str(stop)]
    env = env_one_thread()
    env["GPTOP_TEST_TRIAL_FAULT"] = "1:crash@7"  # the first trial crashes 7 steps in (tests/fixtures/hf_tune_script)
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gptop", "--no-ui", "--json", *args], stdout=stdout, stderr=stderr, env=env
        )
    try:
        wait_for(lambda: proc.poll() is not None or decided(run_dir), 600, "the tuner's decision", poll=1.0)
        wait_for(lambda: proc.poll() is not None or trained_on_after_tuning(run_dir), 300, "training on", poll=1.0)
        trained_on = proc.poll() is None
        stop.touch()
        proc.wait(300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = (tmp_path / "stderr").read_text()
    assert trained_on and proc.returncode == 0, err[-3000:]
    for line in (tmp_path / "stdout").read_text().splitlines():
        json.loads(line)  # --json: every stdout line is one JSON object
    procs = client_processes(run_dir)
    first = procs[0]["hello"]
    assert first["client"] == "transformers" and first["tunable"] and first["config"]["optim"]["global_batch"] == 16
    assert all(p["hello"]["micro_batch"] * p["hello"]["accumulation"] == 16 for p in procs)  # the script's batch
    crashed = next(i for i, p in enumerate(procs) if p["error"] and "injected crash" in p["error"]["message"])
    failed = next(e for e in run_events(run_dir, "trial") if e["status"] == "infeasible")
    pre, rb = procs[crashed]["hello"]["start_step"], failed["rollback"]
    assert rb["step"] == pre > 0 and Path(rb["path"]).is_relative_to(run_dir / "tuner-checkpoints")
    assert len(procs[crashed]["checkpoints"]) >= 3  # enough for save_total_limit=3 to rotate the pre-trial one out
    assert not (out / f"checkpoint-{pre}").exists() or pre % 2 == 0  # moved (a switch's) or the script's own
    nxt = procs[crashed + 1]["hello"]
    assert nxt["start_step"] == pre and nxt["resumed_from"] == rb["path"]  # where it rolled back to: no step lost
    for a, b in zip(procs, procs[1:]):  # every start resumes where the one before it stopped, or rolled back to
        assert b["hello"]["start_step"] == (pre if a is procs[crashed] else a["done"]["step"]), (a["done"], b["hello"])
    losses = [s["loss"] for p in procs for s in p["steps"] if s["loss"] is not None]
    resumed = next(s["loss"] for s in procs[crashed + 1]["steps"] if s["loss"] is not None)
    assert resumed < losses[0] - 1.0  # the loss goes on from the run's, not from a fresh model's
    assert [e for e in run_events(run_dir, "error") if e["kind"] == "lost_steps"] == []
    # the tuning's record, and how to apply its outcome to this script (not gptop train's flags)
    assert "- Outcome:" in (run_dir / "tuning.md").read_text()
    best = (run_dir / "best.toml").read_text()
    assert f"# Best settings gptop tune found for: {sys.executable} {HF_TUNE}" in best, best
    assert "gptop train --config" not in best and ("GPTOP_TOGGLES=" in best or "nothing to change" in best)
    # each start ended with gptop's record of its end: the tuner's restarts, the crashed trial's own end (nobody
    # stopped it: its exit code and its traceback's last line, not a kill by the tuner), then the script's own end
    exits = run_events(run_dir, "exit")
    assert len(exits) == len([e for e in run_events(run_dir, "hello") if e["early"]]) == len(procs)
    assert all(e.get("stopped_by") == "tuner" for i, e in enumerate(exits[:-1]) if i != crashed), exits
    own = exits[crashed]
    assert "stopped_by" not in own and own.get("exit_code") not in (0, None), own
    assert any("injected crash" in line for line in own.get("stderr") or []), own
    assert "tuner" in {e.get("stopped_by") for e in exits}
    final = procs[-1]["done"]["step"]
    assert exits[-1].get("exit_code") == 0 and "stopped_by" not in exits[-1], exits[-1]
    assert procs[-1]["done"]["reason"] == "the Trainer stopped (control.should_training_stop)"
    # the script's work after train() ran once: at the end, not at each switch
    assert after.read_text().splitlines() == [f"after train() at step {final} in {procs[-1]['hello']['pid']}"]
    # output_dir holds what the script saves (every 2 steps, the newest 3): a switch checkpoint (at an odd step:
    # one the script does not save itself) was moved into the run directory and released once the run had newer
    switches = [c for p in procs[:-1] for c in p["checkpoints"] if c["reason"] == "stop"]
    assert all(c["step"] % 2 for c in switches) and not any(Path(c["path"]).exists() for c in switches)
    kept = sorted(int(d.name.rpartition("-")[2]) for d in out.glob("checkpoint-*"))
    assert len(kept) <= 3 and all(s % 2 == 0 or s == final for s in kept), kept
    assert not (run_dir / "tuner-checkpoints").exists()


NO_CLIENT = """
import time
for step in range(1, 4):
    print(f"step {step} loss {4.0 - step / 10}", flush=True)
    time.sleep(0.2)
print("trained untuned")
"""


@pytest.mark.parametrize("client", ["none", "probe"])
def test_a_script_without_a_client_that_takes_toggles_is_refused_in_one_line(tmp_path, client):
    """No gptop client (it exits without one saying hello), or the plain loop's Probe (which takes no toggles):
    exit 2 and one line naming what gptop tune needs, rather than a run trained untuned that exits 0."""
    if client == "none":
        script = tmp_path / "plain.py"
        script.write_text(NO_CLIENT)
        cmd, said = [sys.executable, str(script)], "has no gptop client"
    else:
        cmd = [sys.executable, str(ROOT / "examples" / "train_loop.py"), "--steps", "5", "--out", str(tmp_path / "o")]
        said = "client (probe) takes no toggles"
    run_dir = tmp_path / "runs" / "r"
    p = gptop("tune", "--budget", "60s", "--run-dir", str(run_dir), "--", *cmd, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("gptop: error:")]
    assert len(errors) == 1 and said in errors[0], p.stderr
    for words in ("GptopCallback", "tuned_args", "resume_checkpoint", "gptop run"):
        assert words in errors[0]
    assert not run_dir.exists()  # nothing kept of a refused run


def test_save_total_limit_1_is_refused_before_a_step(tmp_path):
    run_dir, after = tmp_path / "runs" / "r", tmp_path / "after.txt"
    script = [sys.executable, str(HF_TUNE), "--out", str(tmp_path / "out"), "--after", str(after)]
    p = gptop("tune", "--budget", "60s", "--run-dir", str(run_dir), "--", *script, "--save-total-limit", "1")
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("gptop: error:")]
    assert len(errors) == 1 and "save_total_limit=1" in errors[0], p.stderr
    assert not run_dir.exists() and not after.exists() and not list((tmp_path / "out").glob("checkpoint-*"))
