"""A checkpoint never holds non-finite state (issue 10 section 1), and known ends of a resume.

A non-finite loss or gradient norm is a non-finite step: its optimizer update is not taken and the NaN
policy applies. A state that turned non-finite after a finite step is caught before it is checkpointed.
Rollback and resume go to the newest checkpoint that loads and is finite. The 2-rank cases are in
test_distributed.py.
"""

import math

import pytest
import torch

from helpers import TINY, of, restoring_signals, train_in_process
from trainer import checkpoint_files as ckpt
from trainer import optim
from trainer.checkpointer import all_finite
from trainer.worker_cli import parse_config
from trainer.contract import rundir
from trainer.contract.config import ConfigError
from trainer.contract.events import read_events
from trainer.contract.states import ERROR_KINDS
from trainer.train import EXIT_CORRUPT_CHECKPOINT, EXIT_NAN, EXIT_NO_CHECKPOINT, EXIT_OK, Stop, Trainer


def run(tmp_path, *args, name="run", base=TINY):
    return train_in_process(tmp_path / name, *args, base=base)


def state_tensors(state):
    out = list(state["model"].values())
    for per_param in state["optimizer"]["state"].values():
        out += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return [t for t in out if t.is_floating_point()]


def assert_all_checkpoints_finite(run_dir):
    found = rundir.list_checkpoints(run_dir)
    for info in found:
        tensors = state_tensors(ckpt.load(info.path))
        assert tensors and all(torch.isfinite(t).all() for t in tensors), f"{info.path} holds non-finite values"
    return found


# ------------------------------------------------------------------------------------------ the pieces
@pytest.mark.parametrize("fused", [True, False])
def test_a_non_finite_step_takes_no_optimizer_update(fused):
    """Parameters, moments and step counts stay as they were (fused: decided on the device)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, **optim.adamw_flags(fused))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        optim.step(opt, scaler, finite=torch.tensor(True))
        opt.zero_grad()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
    model(torch.randn(2, 4)).sum().backward()
    model.weight.grad[0, 0] = float("nan")
    optim.step(opt, scaler, finite=torch.tensor(False))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    for was, now in zip(moments, opt.state.values()):
        assert all(torch.equal(was[k], now[k]) for k in was)
    assert not hasattr(opt, "found_inf")
    model(torch.randn(2, 4)).sum().backward()
    optim.step(opt, scaler, finite=torch.tensor(True))  # the next finite step is taken
    assert not torch.equal(model.weight, before["weight"])


def test_the_finiteness_check_is_exact_and_cannot_overflow():
    big = torch.full((3,), 3e38)  # a sum of squares would overflow; the max-abs norm does not
    assert all_finite([big, torch.ones(2, dtype=torch.bfloat16)])
    assert not all_finite([big, torch.tensor([1.0, float("nan")])])
    assert not all_finite([torch.tensor([-math.inf]), torch.zeros(2)])
    assert not all_finite([torch.zeros(2), torch.tensor([float("nan")], dtype=torch.bfloat16)])
    assert all_finite([torch.arange(3)]) and all_finite([])  # integer tensors cannot be non-finite


def test_the_param_groups_rule_is_one():
    model = torch.nn.ModuleDict(
        {"embed": torch.nn.Embedding(5, 4), "proj": torch.nn.Linear(4, 4), "norm": torch.nn.LayerNorm(4)}
    )
    decay, no_decay = optim.param_groups(model, 0.1)
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])] and decay["weight_decay"] == 0.1
    assert len(no_decay["params"]) == 4 and no_decay["weight_decay"] == 0.0
    assert optim.param_names(model) == ["proj.weight", "embed.weight", "proj.bias", "norm.weight", "norm.bias"]


# ------------------------------------------------------------------------------------------ the loop
@pytest.mark.slow
@pytest.mark.parametrize("fused", [True, False])
def test_a_non_finite_gradient_norm_skips_the_update_and_applies_the_nan_policy(tmp_path, fused):
    """`nan-grad@2`: the loss is finite, a gradient is NaN. With --nan-policy stop the run ends with the
    nan error and the live weights are exactly those after step 2 (the update of step 3 was not taken)."""
    flag = [] if fused else ["--no-fused-adamw"]
    code, _, ref = run(tmp_path, "--max-steps", "2", "--micro-batch", "2", *flag, name="ref")
    assert code == EXIT_OK
    cfg = parse_config(
        [
            *TINY,
            "--run-dir",
            str(tmp_path / "t"),
            "--max-steps",
            "6",
            "--micro-batch",
            "2",
            "--fault",
            "nan-grad@2",
            "--nan-policy",
            "stop",
            *flag,
        ]
    )
    trainer = Trainer(cfg)

    try:
        with restoring_signals():
            trainer.setup()
            with pytest.raises(Stop) as stop:
                trainer.run()
        assert stop.value.code == EXIT_NAN
    finally:
        trainer.channel.close()
    events = list(read_events(tmp_path / "t" / "events.jsonl"))
    (err,) = of(events, "error")
    assert err.kind == "nan" and "non-finite gradient norm at step 2" in err.message
    assert [s.step for s in of(events, "step")] == [1, 2]  # the poisoned step is never reported
    want = ckpt.load(rundir.path_for(ref, 2))
    got = trainer.raw_model.state_dict()
    assert all(torch.equal(got[k], want["model"][k]) for k in want["model"])
    assert {float(s["step"]) for s in trainer.optimizer.state.values()} == {2.0}


@pytest.mark.slow
def test_a_non_finite_gradient_norm_rolls_back(tmp_path):
    code, events, run_dir = run(tmp_path, "--max-steps", "8", "--checkpoint-every", "2", "--fault", "nan-grad@4")
    assert code == EXIT_OK
    (rb,) = [w for w in of(events, "warning") if w.kind == "nan_rollback"]
    assert rb.step == 4 and rb.skip_batches == [4] and "step-00000004.pt" in rb.message
    assert any("non-finite gradient norm at step 4" in w.message for w in of(events, "warning"))
    assert of(events, "done")[0].step == 8
    assert [c.step for c in assert_all_checkpoints_finite(run_dir)] == [4, 6, 8]


@pytest.mark.slow
def test_weights_that_turn_non_finite_after_a_finite_step_are_not_checkpointed(tmp_path):
    """`nan-weights@3`: loss and gradients of the step were finite, its result is not. The checkpoint of
    step 4 is not written; the run rolls back to step 2 and goes on."""
    code, events, run_dir = run(tmp_path, "--max-steps", "8", "--checkpoint-every", "2", "--fault", "nan-weights@3")
    assert code == EXIT_OK
    warnings = [w.message for w in of(events, "warning")]
    assert any("non-finite weights or optimizer state" in w for w in warnings), warnings
    (rb,) = [w for w in of(events, "warning") if w.kind == "nan_rollback"]
    assert rb.step == 2 and "step-00000002.pt" in rb.message
    assert [c.step for c in of(events, "checkpoint")] == [2, 4, 6, 8]  # 4 only after the rollback
    assert_all_checkpoints_finite(run_dir)


def test_the_issue_command_never_checkpoints_a_non_finite_state(tmp_path):
    """`--lr 1e4 --warmup-steps 0 --checkpoint-every 1` (issue 10): every checkpoint finite; recovered or nan."""
    code, events, run_dir = run(
        tmp_path, "--max-steps", "30", "--lr", "1e4", "--warmup-steps", "0", "--checkpoint-every", "1"
    )
    assert code in (EXIT_OK, EXIT_NAN)
    if code == EXIT_NAN:
        assert [e.kind for e in of(events, "error")] == ["nan"]
    assert assert_all_checkpoints_finite(run_dir)
    written: set[int] = set()  # a rollback goes to a checkpoint written before it (which step diverges first
    for e in events:  # depends on the CPU's precision and kernels), or to the initialization
        if e.type == "checkpoint":
            written.add(e.step)
        elif e.type == "warning" and e.kind == "nan_rollback":
            assert "initialization" in e.message or (
                e.step in written and rundir.path_for(run_dir, e.step).name in e.message
            ), (e.message, sorted(written))


@pytest.mark.slow
def test_rollback_skips_a_corrupt_or_non_finite_newest_checkpoint(tmp_path, monkeypatch):
    """Checkpoints 2 (good), 4 (truncated on disk), 6 (written non-finite, as an older gptop did): a NaN
    at step 7 rolls back to 2, naming what it skipped."""
    real_save = ckpt.save

    def damaging_save(state, path):
        if state["step"] == 6:
            state = dict(
                state, model={k: v * float("nan") if v.is_floating_point() else v for k, v in state["model"].items()}
            )
        real_save(state, path)
        if state["step"] == 4:
            path.write_bytes(path.read_bytes()[:1000])

    monkeypatch.setattr(ckpt, "save", damaging_save)
    code, events, run_dir = run(tmp_path, "--max-steps", "8", "--checkpoint-every", "2", "--fault", "nan@6")
    assert code == EXIT_OK
    skipped = [w.message for w in of(events, "warning") if "checkpoint skipped" in w.message]
    assert len(skipped) == 2 and "step-00000006.pt" in skipped[0] and "non-finite" in skipped[0]
    assert "step-00000004.pt" in skipped[1]
    (rb,) = [w for w in of(events, "warning") if w.kind == "nan_rollback"]
    assert rb.step == 2 and "step-00000002.pt" in rb.message
    assert of(events, "done")[0].step == 8
    final = ckpt.load(rundir.path_for(run_dir, 8))
    assert all(torch.isfinite(t).all() for t in state_tensors(final))


# ------------------------------------------------------------------------------- resume: known ends
@pytest.mark.slow
def test_resume_skips_a_non_finite_newest_checkpoint(tmp_path):
    code, _, run_dir = run(tmp_path, "--max-steps", "8", "--checkpoint-every", "2", "--fault", "stop@6")
    assert code == EXIT_OK
    newest = rundir.path_for(run_dir, 6)
    state = ckpt.load(newest)
    state["optimizer"]["state"][0]["exp_avg_sq"].fill_(float("inf"))  # the optimizer state counts too
    ckpt.save(state, newest)
    code, _, _ = run(tmp_path, "--resume", str(run_dir), "--max-steps", "8")
    assert code == EXIT_OK
    events = list(read_events(run_dir / "events.jsonl"))
    hello = of(events, "hello")[-1]
    assert hello.start_step == 4 and hello.resumed_from.endswith("step-00000004.pt")
    assert any("step-00000006.pt" in w.message and "non-finite" in w.message for w in of(events, "warning"))


def test_nothing_to_resume_is_an_error_of_its_kind(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    # Where the input enters, it is a usage error naming --resume (nothing is started or created) ...
    with pytest.raises(ConfigError, match="^--resume: nothing to resume: "):
        parse_config([*TINY, "--run-dir", str(tmp_path / "run"), "--resume", str(empty)])
    assert not (tmp_path / "run").exists()
    # ... and if the checkpoints vanish after that check (deleted by hand while the trainer starts), the
    # trainer reports the known end as an error event of its kind.
    cfg = parse_config([*TINY, "--run-dir", str(tmp_path / "run")])
    cfg.checkpoint.resume = str(empty)
    code, events, run_dir = train_in_process(tmp_path / "run", cfg=cfg)
    assert code == EXIT_NO_CHECKPOINT
    (err,) = of(events, "error")
    assert err.kind == "no_checkpoint" in ERROR_KINDS and err.exit_code == EXIT_NO_CHECKPOINT
    assert err.message.startswith("nothing to resume: ") and "\n" not in err.message
    assert "Traceback" not in err.message and "traceback" not in err.extra


def test_every_checkpoint_corrupt_is_an_error_of_its_kind(tmp_path):
    code, _, run_dir = run(tmp_path, "--max-steps", "4", "--checkpoint-every", "2")
    assert code == EXIT_OK
    for info in rundir.list_checkpoints(run_dir):
        info.path.write_bytes(b"not a checkpoint")
    code, _, _ = run(tmp_path, "--resume", str(run_dir), "--max-steps", "6")
    assert code == EXIT_CORRUPT_CHECKPOINT
    events = list(read_events(run_dir / "events.jsonl"))
    (err,) = of(events, "error")
    assert err.kind == "corrupt_checkpoint" in ERROR_KINDS and err.exit_code == EXIT_CORRUPT_CHECKPOINT
    assert "every checkpoint" in err.message and "\n" not in err.message
    assert sum("corrupt checkpoint skipped" in w.message for w in of(events, "warning")) == 2


# ------------------------------------------------------------------ restoring on a device (issue 27, bug 1)
def test_rng_states_are_restored_as_cpu_byte_tensors_and_garbage_is_corrupt():
    """torch.set_rng_state / torch.cuda.set_rng_state accept only a CPU ByteTensor: whatever device a state
    was loaded to, the checkpointer hands them one; a value that is no byte tensor is the file's fault."""
    from trainer.checkpointer import rng_state

    state = torch.get_rng_state()
    got = rng_state(state, "rng.torch")
    assert got.device.type == "cpu" and got.dtype == torch.uint8 and torch.equal(got, state)
    torch.set_rng_state(got)
    for bad in (state.float(), [1, 2, 3], None):
        with pytest.raises(ckpt.CorruptCheckpoint, match="rng.torch is not a byte tensor"):
            rng_state(bad, "rng.torch")


def test_a_checkpoint_restores_on_a_device_that_is_not_the_cpu(tmp_path):
    """The live model and optimizer copy from the loaded state, so it is read onto the CPU whatever the
    training device: read onto the device, the RNG states land where torch.set_rng_state refuses them
    (every resume, rollback and tuner trial failed on a GPU, each checkpoint called corrupt) and the device
    holds a second copy of the whole state. `meta` stands in for the GPU: a device that is not the CPU."""
    from trainer.checkpointer import Checkpointer, Progress
    from trainer.contract.config import TrainConfig
    from trainer.contract.device import DeviceInfo

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    warnings = []
    cp = Checkpointer(TrainConfig(), DeviceInfo(type="meta", name="not the cpu"), tmp_path, None, warnings.append)
    cp.bind(model, opt, torch.amp.GradScaler("cpu", enabled=False))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    cp.save(Progress(step=3, tokens=30, batch_cursor=3))
    with torch.no_grad():
        model.weight.zero_()
    torch.rand(5)
    path, progress = cp.resume(tmp_path)
    assert not warnings and progress.step == 3 and path == rundir.path_for(tmp_path, 3)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.slow
def test_a_restore_failure_that_is_not_the_files_fault_is_not_called_corrupt(tmp_path, monkeypatch):
    """A bug or a device error while restoring ends the run with that error (a crash), instead of skipping
    every checkpoint as corrupt and exiting 7; a file whose content does not fit stays a corrupt one."""
    from trainer.train import EXIT_CRASH

    code, _, run_dir = run(tmp_path, "--max-steps", "4", "--checkpoint-every", "2")
    assert code == EXIT_OK

    def refusing(state):
        raise TypeError("RNG state must be a torch.ByteTensor")

    with monkeypatch.context() as m:
        m.setattr(torch, "set_rng_state", refusing)
        code, _, _ = run(tmp_path, "--resume", str(run_dir), "--max-steps", "6")
    assert code == EXIT_CRASH
    events = list(read_events(run_dir / "events.jsonl"))
    (err,) = of(events, "error")
    assert err.kind == "crash" and "RNG state must be a torch.ByteTensor" in err.message
    assert not any("corrupt checkpoint skipped" in w.message for w in of(events, "warning"))

    newest = rundir.path_for(run_dir, 4)
    state = ckpt.load(newest)
    state["model"]["not.a.parameter"] = torch.zeros(1)
    ckpt.save(state, newest)
    code, _, _ = run(tmp_path, "--resume", str(run_dir), "--max-steps", "6", name="run")
    assert code == EXIT_OK
    events = list(read_events(run_dir / "events.jsonl"))
    assert of(events, "hello")[-1].start_step == 2
    assert any(
        "step-00000004.pt" in w.message and "corrupt checkpoint skipped" in w.message for w in of(events, "warning")
    )
