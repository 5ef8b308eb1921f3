"""gptop.preflight: parsed arguments in, a checked plan out, nothing created; the run directory taken and, for a
run refused once it holds it, left as it was."""

from __future__ import annotations

import pytest

from gptop import cli, preflight
from trainer.contract.config import ConfigError
from trainer.contract.runlock import RunDirBusy, RunLock


def test_a_train_plan_says_what_runs_and_creates_nothing(tmp_path):
    run_dir = tmp_path / "runs" / "a"
    ns = cli.parse_args(
        [
            "--no-ui",
            "train",
            "--size",
            "tiny",
            "--device",
            "cpu",
            "--nproc",
            "2",
            "--tune",
            "90s",
            "--tune-space",
            "compile=off",
            "--stable-within",
            "12.5%",
            "--max-trials",
            "5",
            "--run-dir",
            str(run_dir),
        ]
    )
    plan = preflight.plan_run(ns)
    assert plan.cfg.model.size == "tiny" and plan.cfg.run.run_dir == str(run_dir)
    assert plan.world_size == 2 and plan.launcher is not None and plan.launcher.nproc == 2
    assert plan.tuning is not None and plan.tuning.budget_s == 90.0 and plan.tuning.space_spec == "compile=off"
    assert plan.options.launcher is plan.launcher and plan.options.run_lock is None
    assert plan.options.tuning is not None and plan.options.tuning.space_spec == "compile=off"  # the `t` key
    assert plan.tuning.stable_within == plan.options.tuning.stable_within == pytest.approx(0.125)
    assert plan.tuning.max_trials == plan.options.tuning.max_trials == 5
    assert plan.fit is not None and plan.fit.device.kind == "cpu" and plan.fit.estimate.fits
    assert plan.resume is None
    assert plan.lock == preflight.LockRequest(
        str(run_dir), command="gptop train", node=None, new_run=True, option="--run-dir"
    )
    assert not (tmp_path / "runs").exists()


def test_a_tune_plan_tunes_and_a_plain_train_does_not(tmp_path):
    tune = preflight.plan_run(
        cli.parse_args(["tune", "--budget", "2m", "--tune-only", "--size", "tiny", "--run-dir", str(tmp_path / "t")])
    )
    assert tune.tuning is not None and tune.tuning.budget_s == 120.0 and tune.tuning.tune_only
    assert tune.tuning.stable_within == 0.03  # the tuner's default precision target
    assert tune.tuning.max_trials == 16
    assert tune.lock.command == "gptop tune" and tune.launcher is None and tune.world_size == 1
    train = preflight.plan_run(cli.parse_args(["train", "--size", "tiny", "--run-dir", str(tmp_path / "p")]))
    assert train.tuning is None


@pytest.mark.parametrize(
    "argv, option",
    [
        (["train", "--nnodes", "2", "--node-rank", "2"], "--node-rank"),
        (["train", "--nnodes", "2", "--rdzv-endpoint", "host:29500", "--tune", "1m"], "--nnodes"),
        (["train", "--tune-space", "nosuch=1"], "--tune-space"),
        (["train", "--lora", "8", "--lora-targets", "nosuch"], "--lora-targets"),
        (
            [
                "train",
                "--model",
                "llama",
                "--size",
                "large",
                "--seq-len",
                "4096",
                "--global-batch",
                "64",
                "--device",
                "cpu",
                "--tensorboard",
            ],
            "--size",
        ),
    ],
)
def test_a_plan_that_cannot_run_is_refused_naming_the_option(tmp_path, argv, option, monkeypatch):
    monkeypatch.setattr(preflight, "device_memory", lambda cfg: preflight.DeviceMemory("cpu", "this CPU", 2 << 30))
    with pytest.raises(ConfigError) as e:
        preflight.plan_run(cli.parse_args([*argv, "--run-dir", str(tmp_path / "r")]))
    assert e.value.option == option
    assert not (tmp_path / "r").exists()


def test_a_program_plan(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    plan = preflight.plan_program(
        cli.parse_args(["run", "--grace", "5", "--run-dir", str(tmp_path / "r"), "--", "python", str(script)])
    )
    assert plan.command == ["python", str(script)] and plan.run_dir == tmp_path / "r" and plan.grace_s == 5.0
    assert plan.tuning is None and plan.lock == preflight.LockRequest(tmp_path / "r", command="gptop run", new_run=True)
    tuned = preflight.plan_program(
        cli.parse_args(
            ["tune", "--budget", "1m", "--log-every", "3", "--stable-within", "8%", "--max-trials", "2"]
            + ["--", "python", str(script)]
        ),
        tune=True,
    )
    assert tuned.tune and tuned.tuning is not None and tuned.tuning.budget_s == 60.0 and tuned.log_every == 3
    assert tuned.tuning.stable_within == pytest.approx(0.08) and tuned.tuning.max_trials == 2
    assert tuned.run_dir.parts[0] == "runs" and tuned.run_dir.name.endswith("train")
    with pytest.raises(ConfigError) as e:
        preflight.plan_program(cli.parse_args(["tune", "--model", "llama", "--", "python", str(script)]), tune=True)
    assert e.value.option == "--model"


def test_quiet_is_for_a_commands_output_only(tmp_path):
    """`--quiet` leaves a command's own lines out of --no-ui; gptop's own trainer prints none, so `gptop tune
    --quiet` without a command is refused (exit 2) rather than taken and ignored."""
    assert cli.parse_args(["run", "--quiet", "--", "python", "x.py"]).quiet
    assert cli.parse_args(["tune", "--quiet", "--", "python", "x.py"]).quiet
    with pytest.raises(ConfigError) as e:
        preflight.plan_run(cli.parse_args(["tune", "--quiet", "--size", "tiny", "--run-dir", str(tmp_path / "t")]))
    assert e.value.option == "--quiet" and "-- CMD" in e.value.message
    with pytest.raises(SystemExit):
        cli.parse_args(["train", "--quiet"])  # not an option of gptop train


def test_claiming_a_run_dir_holds_it_and_a_refusal_inside_leaves_nothing(tmp_path):
    request = preflight.LockRequest(tmp_path / "made" / "run", command="gptop train", new_run=True)
    with preflight.claim_run_dir(request) as lock:
        assert lock.held and (tmp_path / "made" / "run").is_dir()
        with pytest.raises(RunDirBusy):
            RunLock.acquire(tmp_path / "made" / "run", command="another")
    RunLock.acquire(tmp_path / "made" / "run", command="again").release()  # released when the block ends

    request = preflight.LockRequest(tmp_path / "new" / "run", command="gptop train", new_run=True)
    with pytest.raises(ConfigError):
        with preflight.claim_run_dir(request):
            raise ConfigError("--wandb", "refused once the directory was made")
    assert not (tmp_path / "new").exists()  # the run directory and the parent it made are gone

    with pytest.raises(RuntimeError):
        with preflight.claim_run_dir(request):
            raise RuntimeError("not a refusal")
    assert (tmp_path / "new" / "run").is_dir()  # a crash keeps what is there, for the user to look at
