"""The optimizer is a toggle: one config field (with its old TOML place still read), and a run resumed with
another optimizer than its checkpoint's keeps the AdamW moments (converted) or, for Adafactor, says it
starts fresh; once switched, resume is exact."""

import pytest
import torch

from helpers import TINY
from test_lora import of, run
from trainer import optim
from trainer.worker_cli import parse_config
from trainer.contract import capabilities
from trainer.contract.config import ConfigError, TrainConfig, config_from_toml, current_layout
from trainer.train import EXIT_OK


# --- one config field ----------------------------------------------------------------------------


def test_optimizer_and_quantized_base_are_toggles_with_their_flags():
    cfg = parse_config([*TINY, "--optimizer", "adafactor"])
    assert cfg.toggles.optimizer == "adafactor"
    assert not hasattr(cfg.optim, "optimizer") and not hasattr(cfg.finetune, "quantize_base")
    assert "--optimizer" in " ".join(cfg_args(cfg))


def cfg_args(cfg):
    from trainer.contract.config import cli_args

    return cli_args(cfg)


def test_old_toml_places_still_read(tmp_path):
    old = tmp_path / "old.toml"
    old.write_text('[optim]\noptimizer = "adamw-8bit"\nlr = 0.01\n[finetune]\nlora = 8\nquantize_base = "nf4"\n')
    cfg = config_from_toml(old)
    assert (cfg.toggles.optimizer, cfg.toggles.quantize_base, cfg.optim.lr) == ("adamw-8bit", "nf4", 0.01)
    # written back, it is in its current place, and reads the same
    again = TrainConfig.from_dict(__import__("tomllib").loads(cfg.to_toml()))
    assert again.toggles == cfg.toggles
    assert "optimizer" not in again.to_dict()["optim"]


def test_an_option_given_in_both_places_must_agree(tmp_path):
    both = tmp_path / "both.toml"
    both.write_text('[optim]\noptimizer = "adafactor"\n[toggles]\noptimizer = "adamw"\n')
    with pytest.raises(ConfigError) as e:
        config_from_toml(both)
    assert "optim.optimizer" in str(e.value) and "[toggles]" in e.value.message
    same = {"optim": {"optimizer": "adafactor"}, "toggles": {"optimizer": "adafactor"}}
    assert TrainConfig.from_dict(same).toggles.optimizer == "adafactor"
    assert current_layout({"optim": {"lr": 1.0}}) == {"optim": {"lr": 1.0}}


def test_switch_words():
    assert capabilities.optimizer_switch("adamw", "adamw") is None
    assert "carry over" in capabilities.optimizer_switch("adamw", "adamw-8bit")
    assert "fresh state" in capabilities.optimizer_switch("adamw", "adafactor")
    assert "fresh state" in capabilities.optimizer_switch("adafactor", "adamw-4bit")
    assert capabilities.optimizer_state_carries("adamw-4bit", "adamw-8bit")
    assert not capabilities.optimizer_state_carries("adamw-8bit", "adafactor")


# --- converting the state ----------------------------------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 128x64 = 8192 values: quantized by torchao (>= 4096, a multiple of the block); the bias (64) stays fp32
    return torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 8))


def _trained_adamw(model: torch.nn.Module, steps: int = 3) -> torch.optim.AdamW:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=optim.BETAS, eps=optim.EPS)
    for _ in range(steps):
        model(torch.randn(16, 128)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def _low_bit(name: str, params) -> torch.optim.Optimizer:
    from torchao.optim import AdamW4bit, AdamW8bit

    return (AdamW8bit if name == "adamw-8bit" else AdamW4bit)(params, lr=1e-3, betas=optim.BETAS, eps=optim.EPS)


@pytest.mark.parametrize("name,tol", [("adamw-8bit", 0.02), ("adamw-4bit", 0.15)])
def test_adam_moments_round_trip_through_a_low_bit_optimizer(name, tol):
    model = _model()
    src = _trained_adamw(model)
    saved = src.state_dict()
    low = _low_bit(name, model.parameters())
    assert optim.convert_state(low, saved, "adamw", name)
    big = low.state[model[0].weight]
    assert type(big["exp_avg"]) is not torch.Tensor  # stored quantized, as torchao allocates it
    assert type(low.state[model[0].bias]["exp_avg"]) is torch.Tensor  # small tensors keep fp32
    assert optim.state_bytes(low) < optim.state_bytes(src) / 2
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            want, got = src.state[p][key], optim.dense(low.state[p][key])
            assert got.shape == want.shape
            assert (got - want).abs().max() <= tol * want.abs().max()
        assert float(low.state[p]["step"]) == float(src.state[p]["step"]) == 3.0

    back = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=optim.BETAS, eps=optim.EPS, fused=True)
    assert optim.convert_state(back, low.state_dict(), name, "adamw")
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            got = back.state[p][key]
            assert type(got) is torch.Tensor and got.dtype == torch.float32
            assert torch.equal(got, optim.dense(low.state[p][key]))  # fp32 holds the codes' values exactly
        assert back.state[p]["step"].device == p.device
    # and AdamW goes on from there (fused: the step count on the parameter's device)
    model(torch.randn(4, 128)).sum().backward()
    back.step()
    assert float(back.state[model[0].weight]["step"]) == 4.0


def test_adafactor_state_does_not_convert():
    model = _model()
    saved = _trained_adamw(model).state_dict()
    ada = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    assert not optim.convert_state(ada, saved, "adamw", "adafactor")
    assert len(ada.state) == 0  # fresh: what optimizer_switch says


# --- on a run: the switch, then an exact resume ------------------------------------------------------------


def _switch_then_resume(tmp_path, new: str, *extra: str) -> tuple[list, list]:
    """adamw to step 3, then `new` from that checkpoint to step 7 straight (a) and with a stop at 5 and a
    resume (b): the losses of (a) and (b) are the same when resume after the switch is exact."""
    base = ["--model", "llama", "--micro-batch", "2", "--lr", "3e-3", "--checkpoint-every", "1", *extra]
    for name in ("a", "b"):
        code, _, _ = run(tmp_path, *base, "--max-steps", "7", "--fault", "stop@3", name=name)
        assert code == EXIT_OK
    code, a_events, a = run(tmp_path, "--resume", str(tmp_path / "a"), "--optimizer", new, "--max-steps", "7", name="a")
    assert code == EXIT_OK
    code, _, b = run(
        tmp_path, "--resume", str(tmp_path / "b"), "--optimizer", new, "--max-steps", "7", "--fault", "stop@5", name="b"
    )
    assert code == EXIT_OK
    code, b_events, _ = run(tmp_path, "--resume", str(b), "--max-steps", "7", name="b")
    assert code == EXIT_OK
    return a_events, b_events


def _after(events, step):
    return [(s.step, s.loss) for s in of(events, "step") if s.step > step]


@pytest.mark.slow
def test_switch_to_adafactor_says_it_starts_fresh_and_resumes_exactly(tmp_path):
    a, b = _switch_then_resume(tmp_path, "adafactor")
    assert _after(a, 3) and _after(a, 3) == _after(b, 3)
    warned = [e.message for e in a if e.type == "warning"] + [e.message for e in a if e.type == "log"]
    assert any("starts with fresh state" in m for m in warned), warned


@pytest.mark.process  # torch.compile's workers are processes
@pytest.mark.compile  # torchao's low-bit AdamW compiles its update
def test_switch_to_8bit_carries_the_moments_and_resumes_exactly(tmp_path):
    a, b = _switch_then_resume(tmp_path, "adamw-8bit")
    assert _after(a, 3) and _after(a, 3) == _after(b, 3)
    steps = of(a, "step")
    before, after = [s for s in steps if s.step <= 3], [s for s in steps if s.step > 3]
    assert after[-1].optim_state_bytes < before[-1].optim_state_bytes / 3  # really stored in 8 bits
    assert any("carry over" in getattr(e, "message", "") for e in a)


def test_several_ranks_resume_only_with_the_checkpoints_optimizer(tmp_path):
    """The conversion runs on one process: a sharded or multi-rank resume with another optimizer is refused
    with what to do, before any collective."""
    from types import SimpleNamespace

    from trainer.checkpointer import Checkpointer
    from trainer.contract.device import DeviceInfo

    cfg = TrainConfig()
    cfg.toggles.optimizer = "adafactor"
    group = SimpleNamespace(rank=0, world=2)
    c = Checkpointer(cfg, DeviceInfo(type="cpu", name="cpu"), tmp_path, group, warn=lambda s: None)
    model = _model()
    c.bind(model, torch.optim.Adafactor(model.parameters()), torch.amp.GradScaler("cpu", enabled=False))
    saved = TrainConfig().to_dict()
    saved["optim"]["optimizer"] = saved["toggles"].pop("optimizer")  # stored by an older version
    with pytest.raises(ConfigError) as e:
        c.load_state({"config": saved, "model": {}, "optimizer": {}, "step": 3})
    assert e.value.option == "--optimizer" and "resume with --optimizer adamw" in e.value.message


# --- in a real tuning: processes switch optimizers from each other's checkpoints ---------------------------


# Not solo: what it checks (the switches, the warnings, the rollbacks, each trial's peak memory) holds whatever the
# measurements say, and `--tune-only` needs no trial to pay, so it may run beside other tests' processes.
@pytest.mark.slow
@pytest.mark.process
def test_a_tuning_over_the_optimizer_switches_live_and_reports_every_trials_peak(tmp_path):
    from helpers import COURSE_ONLY, gptop_env, run_gptop
    from test_tuning_e2e import SETUP, events, finished_trials

    run_dir = tmp_path / "run"
    # the optimizer alone: the sampler's first pick in a wider space depends on its seed, and a loaded machine's
    # budget may hold one trial only; 120 s hold it after a start measured to its cap beside other tests
    r = run_gptop(
        "--no-ui",
        "tune",
        "--tune-only",
        "--budget",
        "120s",
        *COURSE_ONLY,
        *SETUP,
        "--max-steps",
        "300",
        "--checkpoint-every",
        "5",
        "--tune-space",
        "-all optimizer=adamw,adafactor",
        "--storage",
        f"sqlite:///{tmp_path / 'study.sqlite3'}",
        "--run-dir",
        str(run_dir),
        env=gptop_env(OMP_NUM_THREADS="1"),  # one thread per trainer: trials' step times steady on a small box
        timeout=540,
    )
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    trials = [t for t in finished_trials(run_dir) if t["kind"] == "trial"]
    ada = [t for t in trials if t["toggles"]["optimizer"] == "adafactor"]
    assert ada, trials
    # the first switch away from the start's adamw says that Adafactor's state starts fresh
    assert "adamw -> adafactor" in ada[0]["reason"] and "starts with fresh state" in ada[0]["reason"]
    # every process that resumed with another optimizer than its checkpoint's said what it kept
    warnings = [e["message"] for e in events(run_dir, "warning")]
    assert any("--optimizer adafactor resumes a checkpoint of adamw" in w for w in warnings), warnings
    # a measured Adafactor trial was rolled back, so AdamW never had to start fresh from an Adafactor checkpoint
    measured = [t for t in ada if t["status"] != "infeasible"]
    assert all(t["rollback"] and "so the run keeps its adamw state" in t["reason"] for t in measured)
    assert not any("resumes a checkpoint of adafactor" in w for w in warnings), warnings
    # each measured trial has its peak memory, and the report shows it
    ran = [t for t in trials if t["status"] in ("ok", "cut", "pruned") and t["tokens_per_s"]]
    assert ran and all(t["peak_mem"] for t in ran)
    md = (run_dir / "tuning.md").read_text()
    assert "| peak mem |" in md and (" MiB |" in md or " GiB |" in md)


class StepOnAnotherDevice:
    """An AdamW step count as a checkpoint of fused AdamW leaves it after a load: on the GPU (`meta` here)."""

    device = torch.device("meta")
    dtype = torch.float32

    def __init__(self, value):
        self.value = value

    def to(self, device, dtype):
        return torch.tensor(self.value, dtype=dtype, device=device)


def test_adamw_step_counts_go_where_this_runs_kernel_expects_them():
    """torch's load_state_dict places step counts by the saved groups' flags; the kernel is this run's toggle:
    foreach/for-loop AdamW wants them on the CPU (on a GPU each would be read back every step), the fused and
    capturable kernels on the parameter's device."""
    from trainer.optim import place_step_counts, step_count_device

    on_gpu = torch.nn.Parameter(torch.zeros(2, device="meta"))
    assert step_count_device({"fused": None, "foreach": True}, on_gpu) == torch.device("cpu")
    assert step_count_device({"fused": True}, on_gpu) == torch.device("meta")
    assert step_count_device({"capturable": True}, on_gpu) == torch.device("meta")

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    for p in model.parameters():
        opt.state[p]["step"] = StepOnAnotherDevice(1.0)
    assert place_step_counts(opt) == 2
    steps = [opt.state[p]["step"] for p in model.parameters()]
    assert all(isinstance(s, torch.Tensor) and s.device.type == "cpu" and float(s) == 1.0 for s in steps)
    assert place_step_counts(opt) == 0  # already where they belong

    fused = torch.optim.AdamW([on_gpu], fused=None)
    fused.param_groups[0]["fused"] = True  # as resuming with fused AdamW sets it
    fused.state[on_gpu]["step"] = torch.tensor(3.0)  # saved by foreach AdamW: on the CPU
    assert place_step_counts(fused) == 1 and fused.state[on_gpu]["step"].device.type == "meta"
