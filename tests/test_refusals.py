"""A refusal is one line, exit 2, and creates nothing (issue 28 §4, §5).

Every case runs `gptop train` as typed, with and without `--run-dir`, in an empty working directory: no
run directory, no `./runs/<time>-...`, no lock file is left, and stderr holds one `gptop: error:` line
naming the option. The checks gptop can make without torch come before anything is created; what only
the trainer can see (a model directory's layers) is refused by it, and gptop removes the directory it made.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import TINY, gptop_cmd, gptop_env, tiny_model_dir
from trainer.contract import rundir


def old_run(path):
    """A finished full-training (non-LoRA) run: its config.toml and a checkpoint."""
    from trainer.worker_cli import parse_config

    (path / "checkpoints").mkdir(parents=True)
    cfg = parse_config([*TINY, "--run-dir", str(path)])  # what the run was started with
    (path / "config.toml").write_text(cfg.to_toml())
    (path / "events.jsonl").write_text("")
    rundir.path_for(path, 4).write_bytes(b"PK\x03\x04")
    return path


def fake_wandb(monkeypatch, tmp_path, body: str) -> None:
    """A `wandb` package on sys.path whose module runs `body` (raise at import, or an init that raises)."""
    pkg = tmp_path / "site" / "wandb"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(sys.modules, "wandb", None)  # recorded, so the fake is gone after the test ...
    del sys.modules["wandb"]  # ... and imported from the path meanwhile


CASES = {
    "lora targets": (["--lora", "8", "--lora-targets", "nonexistent"], "--lora-targets"),
    "lm_head target": (["--lora", "8", "--lora-targets", "q_proj,lm_head"], "--lora-targets"),
    "rank above the layers": (["--lora", "4096"], "--lora"),
    "targets without --lora": (["--lora-targets", "q_proj"], "--lora-targets"),
    "alpha without --lora": (["--lora-alpha", "32"], "--lora-alpha"),
    "dropout without --lora": (["--lora-dropout", "0.1"], "--lora-dropout"),
    "quantized base on the CPU": (["--lora", "8", "--quantize-base", "nf4"], "--quantize-base"),
    "lora on a full run's resume": (["--lora", "8", "--resume", "{old}"], "--lora"),
    "wandb.init fails": (["--wandb"], "--wandb"),
    "wandb raises at import": (["--wandb"], "--wandb"),
}


@pytest.mark.parametrize("with_run_dir", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_a_refusal_is_one_line_and_creates_nothing(tmp_path, monkeypatch, capsys, case, with_run_dir):
    from gptop import cli

    args, option = CASES[case]
    old = old_run(tmp_path / "old")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("WANDB_MODE", "offline")
    if case == "wandb.init fails":
        fake_wandb(
            monkeypatch,
            tmp_path,
            "class Settings:\n    def __init__(self, **kw): pass\n"
            "def init(**kw):\n    raise RuntimeError('No API key configured')\n",
        )
    elif case == "wandb raises at import":
        fake_wandb(monkeypatch, tmp_path, "raise AttributeError('module protobuf has no attribute x')\n")
    argv = ["--no-ui", "train", *TINY, "--max-steps", "3", *[a.format(old=old) for a in args]]
    if with_run_dir:
        argv += ["--run-dir", str(work / "new")]
    before = sorted(p.name for p in old.rglob("*"))
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    said = [line for line in err.splitlines() if line.strip()]
    assert len(said) == 1 and said[0].startswith(f"gptop: error: {option}"), err
    assert "Traceback" not in err
    assert list(work.iterdir()) == [], list(work.rglob("*"))  # no run directory, no ./runs
    assert sorted(p.name for p in old.rglob("*")) == before


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("with_run_dir", [True, False])
def test_a_refusal_only_the_trainer_can_make_leaves_nothing_either(tmp_path, with_run_dir):
    """A model directory's layers are known once the trainer has built it: the trainer refuses, and gptop
    removes the run directory it made for the run (and ./runs, when it made that too)."""
    model = tiny_model_dir(tmp_path / "model")
    work = tmp_path / "work"
    work.mkdir()
    args = gptop_cmd(
        "--no-ui",
        "train",
        *TINY,
        "--model",
        str(model),
        "--max-steps",
        "2",
        "--lora",
        "8",
        "--lora-targets",
        "nonexistent",
    )
    if with_run_dir:
        args += ["--run-dir", str(work / "new")]
    env = gptop_env()
    r = subprocess.run(args, cwd=work, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    said = r.stderr.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("gptop: error: --lora-targets: nonexistent"), r.stderr
    assert "what can be targeted: " in said[0] and "lm_head" not in said[0]
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("with_run_dir", [True, False])
def test_a_standalone_trainers_refusal_leaves_nothing(tmp_path, monkeypatch, capsys, with_run_dir):
    """`python -m trainer` refusing what it sees once it knows its device (fp8 on a CPU): exit 2, the error on
    stderr, and the run directory it made for the run (and ./runs) removed again."""
    import signal

    from trainer import worker_cli as tcli

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        code = tcli.main(
            [*TINY, "--precision", "fp8-rowwise", "--max-steps", "2"]
            + (["--run-dir", str(work / "new")] if with_run_dir else [])
        )
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    assert code == 2 and "error (config): --precision" in capsys.readouterr().err
    assert list(work.iterdir()) == []
