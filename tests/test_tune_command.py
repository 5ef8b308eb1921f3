"""`gptop tune -- CMD` end to end: a transformers.Trainer script (examples/train_transformers.py) tuned on its
live run through checkpoints and restarts, and a script that cannot take toggles refused before tuning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.contract.events import read_events, to_dict
from fixtures.cpu_share import quiet, steady
from helpers import wait_for

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


@pytest.mark.measures  # the CPU alone while the tuner measures, then shared
def test_tune_a_trainer_script_runs_trials_decides_and_ends_at_max_steps(tmp_path):
    run_dir, out, steps = tmp_path / "run", tmp_path / "out", 2400
    # The start is slow on purpose (one sequence per forward, 16 accumulation steps: ~3x slower than 16 at
    # once) and the run long enough for trials to pay for their restarts: the tuner may lose 10% of the rest of
    # the run, which must hold a trial (~12 s) with room to spare on a fast CPU too (at 1,200 steps of 0.09 s
    # an AVX-512 machine rightly decided that tuning could not pay). The budget holds the baseline and a few
    # trials (a trial is mostly the script's restart); the other worker's process tests wait while it runs.
    args = [
        "tune",
        "--budget",
        "45s",
        "--run-dir",
        str(run_dir),
        "--storage",
        f"sqlite:///{tmp_path / 's.db'}",
        "--tune-space",
        "-all micro_batch=1,4,16 fused_adamw=on,off workers=0,1",
        "--",
        sys.executable,
        str(EXAMPLE),
        "--steps",
        str(steps),
        "--batch",
        "1",
        "--accumulation",
        "16",
        "--out",
        str(out),
    ]
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gptop", "--no-ui", "--json", *args],
            stdout=stdout,
            stderr=stderr,
            env=env_one_thread(),
        )
    try:
        # The tuner measures trials: no other test's process beside it (pytest -n) until it decided; the script
        # training on to max_steps after that may run beside a measuring test.
        with quiet():
            wait_for(lambda: proc.poll() is not None or decided(run_dir), 600, "the tuner's decision", poll=1.0)
        with steady():
            proc.wait(600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    p = subprocess.CompletedProcess(
        proc.args, proc.returncode, (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    )
    assert p.returncode == 0, p.stderr[-3000:]
    for line in p.stdout.splitlines():
        json.loads(line)  # --json: every stdout line is one JSON object
    hellos = [e for e in run_events(run_dir, "hello") if not e["early"]]
    assert hellos[0]["client"] == "transformers" and hellos[0]["tunable"]
    assert hellos[0]["config"]["optim"]["global_batch"] == 16
    trials = [e for e in run_events(run_dir, "trial") if e["kind"] == "trial" and e["status"] != "running"]
    assert trials, "no trial ran"
    assert len(hellos) >= 2  # each trial (and the apply) is a restart of the script
    # every restart resumed from the checkpoint the script saved on gptop's command
    for h in hellos[1:]:
        assert h["start_step"] > 0
    for h in hellos:
        mb, acc = h["micro_batch"], h["accumulation"]
        assert mb * acc == 16  # the global batch stays the script's
    report = (run_dir / "tuning.md").read_text()
    assert "- Outcome:" in report and "Applied:" in report
    best = (run_dir / "best.toml").read_text()  # how to apply it to this script, not gptop train's flags
    assert f"# Best settings gptop tune found for: {sys.executable} {EXAMPLE}" in best, best
    assert "gptop train --config" not in best and ("GPTOP_TOGGLES=" in best or "nothing to change" in best)
    # each start of the script ended with gptop's record of its end: the tuner's restarts, then its own end
    exits = run_events(run_dir, "exit")
    assert len(exits) == len([e for e in run_events(run_dir, "hello") if e["early"]]) == len(hellos)
    assert {e.get("stopped_by") for e in exits[:-1]} <= {"tuner", None} and "tuner" in {
        e.get("stopped_by") for e in exits
    }
    assert exits[-1].get("exit_code") == 0 and "stopped_by" not in exits[-1]
    done = [e for e in run_events(run_dir, "done")]
    assert done[-1]["reason"] == "max_steps" and done[-1]["step"] == steps
    newest = max(out.glob("checkpoint-*"), key=lambda d: int(d.name.rpartition("-")[2]))
    state = json.loads((newest / "trainer_state.json").read_text())
    assert state["global_step"] == state["max_steps"] == steps


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
    assert "trained untuned" not in p.stdout + p.stderr
    assert not run_dir.exists()  # nothing kept of a refused run


def test_trainer_options_with_a_command_are_refused(tmp_path):
    p = gptop("tune", "--budget", "60s", "--model", "llama", "--", sys.executable, str(EXAMPLE), timeout=120)
    assert p.returncode == 2 and "--model" in p.stderr and "own trainer" in p.stderr
    p = gptop("tune", "--tune-space", "attention=eager", "--", sys.executable, str(EXAMPLE), timeout=120)
    assert p.returncode == 2 and "attention" in p.stderr
