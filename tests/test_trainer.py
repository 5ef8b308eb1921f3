"""The training loop on the CPU: families, phases, exact resume, NaN rollback, faults, toggles."""

import json
import signal
import subprocess

import pytest
import torch

from helpers import TINY, TINY_TOKENS_PER_STEP, of, train_in_process, trainer_cmd, wait_for
from trainer import checkpoint_files as ckpt
from trainer.contract import rundir
from trainer.worker_cli import parse_config
from trainer.contract.events import EVENT_TYPES, PHASES, read_events
from trainer.train import EXIT_CONFIG, EXIT_NAN, EXIT_OK, EXIT_OOM


def run(tmp_path, *args, name="run"):
    """Run the trainer in this process; returns (exit code, events, run dir)."""
    return train_in_process(tmp_path / name, *args)


@pytest.mark.parametrize(
    "family", ["llama", pytest.param("deepseek", marks=pytest.mark.slow), pytest.param("llada", marks=pytest.mark.slow)]
)
def test_each_family_trains_and_reports(tmp_path, family):
    code, events, run_dir = run(
        tmp_path, "--model", family, "--max-steps", "12", "--eval-every", "6", "--checkpoint-every", "6", "--lr", "3e-3"
    )
    assert code == EXIT_OK
    kinds = {e.type for e in events}
    assert {"hello", "step", "eval", "checkpoint", "done"} <= kinds
    for e in events:  # every line parsed (strictly) into its own class
        assert type(e) is EVENT_TYPES[e.type]
    hello = of(events, "hello")[0]
    assert hello.model.family == family and hello.model.flops_per_token > 0
    steps = of(events, "step")
    assert [s.step for s in steps] == list(range(1, 13))
    losses = [s.loss for s in steps]
    assert all(l == l and l < 20 for l in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, f"loss did not fall: {losses}"
    last = steps[-1]
    assert last.tokens == 12 * TINY_TOKENS_PER_STEP
    assert last.tokens_per_s > 0 and last.mem_bytes > 0 and last.grad_norm > 0
    assert last.mfu is None or 0 < last.mfu < 1
    if family == "deepseek":
        load = last.expert_load
        assert load and all(abs(sum(layer) - 1) < 1e-3 for layer in load)
    assert (run_dir / "config.toml").is_file()
    assert [c.step for c in rundir.list_checkpoints(run_dir)] == [6, 12]


@pytest.mark.slow
def test_a_peak_below_the_achieved_rate_is_dropped_not_reported(tmp_path, monkeypatch):
    # A CPU peak measured while another process held the cores is too low; the MFU it gives is
    # above 1, which is never reported: null from then on, a warning, and the cache entry dropped.
    from trainer import flops

    monkeypatch.setattr(flops, "_cache_file", lambda cache_dir: tmp_path / "cpu_peak.json")
    monkeypatch.setattr(flops, "measure_cpu_matmul_flops", lambda *a, **k: 1e6)  # 1 MFLOP/s: far too low
    code, events, _ = run(tmp_path, "--model", "llama", "--max-steps", "4", "--micro-batch", "4")
    assert code == EXIT_OK
    assert of(events, "hello")[0].peak_flops == 1e6
    assert [s.mfu for s in of(events, "step")] == [None] * 4
    (warning,) = [w for w in of(events, "warning") if w.kind == "peak_flops"]
    assert "not a peak" in warning.message and "dropped" in warning.message
    assert json.loads((tmp_path / "cpu_peak.json").read_text()) == {}


def test_mfu_close_to_a_measured_peak_measures_it_again_and_keeps_the_best(tmp_path, monkeypatch):
    from trainer import flops

    monkeypatch.setattr(flops, "_cache_file", lambda cache_dir: tmp_path / "cpu_peak.json")
    rates = iter([1e6, 1e15])  # the first taken on a "busy" machine, the second as it should be
    monkeypatch.setattr(flops, "measure_cpu_matmul_flops", lambda *a, **k: next(rates))
    # fp32: one dtype measured at the start (auto becomes bf16 on a CPU with native bf16, which measures fp32 too)
    code, events, _ = run(tmp_path, "--model", "llama", "--max-steps", "4", "--micro-batch", "4", "--precision", "fp32")
    assert code == EXIT_OK
    hello = of(events, "hello")[0]
    assert hello.peak_flops == 1e6 and hello.peak_source.startswith("measured: best of 1 ")
    assert hello.mfu_is_estimate
    mfus = [s.mfu for s in of(events, "step")]
    assert all(m is not None and 0 < m < 0.8 for m in mfus)
    assert any("measured it again" in e.message for e in of(events, "log"))
    assert not [w for w in of(events, "warning") if w.kind == "peak_flops"]
    (entry,) = json.loads((tmp_path / "cpu_peak.json").read_text()).values()
    assert entry["best"] == 1e15 and entry["n"] == 2


def test_phases_add_up_to_step_time(tmp_path):
    code, events, _ = run(tmp_path, "--max-steps", "6", "--micro-batch", "2")
    assert code == EXIT_OK
    for s in of(events, "step"):
        phases = s.phases_ms
        assert set(phases) == set(PHASES)
        assert all(v >= 0 for v in phases.values())
        assert sum(phases.values()) == pytest.approx(s.step_ms, rel=1e-6, abs=1e-3)
        assert phases["forward"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0


def test_no_timing_still_reports_throughput(tmp_path):
    code, events, _ = run(tmp_path, "--max-steps", "3", "--no-timing")
    assert code == EXIT_OK
    s = of(events, "step")[-1]
    assert s.phases_ms is None and s.tokens_per_s > 0 and s.step_ms > 0


@pytest.mark.parametrize("family", ["llama", pytest.param("llada", marks=pytest.mark.slow)])
def test_exact_resume(tmp_path, family):
    """N steps, resume, N more == 2N uninterrupted (CPU, fp32)."""
    common = ["--model", family, "--lr", "3e-3", "--micro-batch", "2"]
    code, full, _ = run(tmp_path, *common, "--max-steps", "8", name="full")
    assert code == EXIT_OK
    code, first, part = run(tmp_path, *common, "--max-steps", "8", "--fault", "stop@4", name="part")
    assert code == EXIT_OK and of(first, "done")[0].step == 4
    code, _, _ = run(tmp_path, "--resume", str(part), "--max-steps", "8", name="part")
    assert code == EXIT_OK
    resumed = list(read_events(part / "events.jsonl"))
    assert of(resumed, "hello")[-1].start_step == 4
    want = [s.loss for s in of(full, "step")]
    got = [s.loss for s in of(resumed, "step")]
    assert got == want  # bit-identical
    a = ckpt.load(rundir.path_for(tmp_path / "full", 8))["model"]
    b = ckpt.load(rundir.path_for(part, 8))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_micro_batch_does_not_change_what_is_learned(tmp_path):
    _, one, _ = run(tmp_path, "--max-steps", "4", "--micro-batch", "1", name="mb1")
    _, four, _ = run(tmp_path, "--max-steps", "4", "--micro-batch", "4", name="mb4")
    assert of(one, "hello")[0].accumulation == 4 and of(four, "hello")[0].accumulation == 1
    for a, b in zip(of(one, "step"), of(four, "step")):
        assert a.loss == pytest.approx(b.loss, rel=1e-4)


@pytest.mark.slow
def test_nan_rollback_skips_the_batch_and_continues(tmp_path):
    code, events, run_dir = run(tmp_path, "--max-steps", "10", "--checkpoint-every", "4", "--fault", "nan@6")
    assert code == EXIT_OK
    warnings = of(events, "warning")
    rb = [w for w in warnings if w.kind == "nan_rollback"]
    assert len(rb) == 1 and rb[0].step == 4 and rb[0].skip_batches == [6] and rb[0].lr_scale == 0.5
    assert of(events, "done")[0].step == 10
    losses = [s.loss for s in of(events, "step")]
    assert all(l is not None and l == l for l in losses)  # a poisoned interval is never reported as a step
    final = ckpt.load(rundir.path_for(run_dir, 10))
    assert final["skip_batches"] == [6] and final["batch_cursor"] == 11
    assert all(torch.isfinite(v).all() for v in final["model"].values() if v.is_floating_point())


@pytest.mark.slow
def test_nan_before_any_checkpoint_restarts_from_init(tmp_path):
    code, events, _ = run(tmp_path, "--max-steps", "5", "--fault", "nan@2")
    assert code == EXIT_OK
    rb = [w for w in of(events, "warning") if w.kind == "nan_rollback"]
    assert rb and "initialization" in rb[0].message


@pytest.mark.slow
def test_nan_after_resume_rolls_back_to_the_resumed_checkpoint(tmp_path):
    code, _, run_dir = run(tmp_path, "--max-steps", "8", "--fault", "stop@4")
    assert code == EXIT_OK
    code, _, _ = run(tmp_path, "--resume", str(run_dir), "--max-steps", "8", "--fault", "nan@5")
    assert code == EXIT_OK
    events = list(read_events(run_dir / "events.jsonl"))
    rb = [w for w in of(events, "warning") if w.kind == "nan_rollback"]
    assert len(rb) == 1 and rb[0].step == 4 and "step-00000004.pt" in rb[0].message
    assert of(events, "done")[-1].step == 8


@pytest.mark.slow
def test_a_checkpoint_fault_saves_at_that_boundary(tmp_path):
    """The test-only `checkpoint@N` (used to make a tuning trial's checkpoint certain) saves after step N."""
    code, events, run_dir = run(tmp_path, "--max-steps", "5", "--checkpoint-every", "0", "--fault", "checkpoint@2")
    assert code == EXIT_OK
    assert [(e.step, e.reason) for e in of(events, "checkpoint")] == [(2, "requested"), (5, "final")]


def test_nan_policy_stop(tmp_path):
    code, events, _ = run(tmp_path, "--max-steps", "5", "--fault", "nan@2", "--nan-policy", "stop")
    assert code == EXIT_NAN
    (err,) = of(events, "error")
    assert err.kind == "nan" and "non-finite" in err.message


def test_oom_is_reported_with_toggles_and_memory(tmp_path):
    code, events, _ = run(tmp_path, "--max-steps", "5", "--fault", "oom@1")
    assert code == EXIT_OOM
    (err,) = of(events, "error")
    assert err.kind == "oom" and err.toggles["micro_batch"] and "rss" in err.memory


def test_unsupported_toggle_is_a_config_error(tmp_path, capsys):
    """Refused once the device is known: the error says why, and the run directory the trainer made for it
    is gone again (a refusal creates nothing)."""
    code, events, run_dir = run(tmp_path, "--precision", "fp8-rowwise")
    assert code == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "error (config): --precision" in err and "8.9" in err
    assert not run_dir.exists()


@pytest.mark.process
def test_bad_usage_exits_2_naming_the_option(tmp_path):
    proc = subprocess.run(
        trainer_cmd(
            "--micro-batch",
            "3",
            "--global-batch",
            "4",
            "--size",
            "tiny",
            "--run-dir",
            str(tmp_path / "r"),
            "--device",
            "cpu",
        ),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "--micro-batch" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "toggle",
    [
        ["--precision", "bf16"],
        ["--no-fused-adamw"],
        ["--activation-checkpointing"],
        ["--attention", "eager"],
        ["--prefetch", "0"],
        ["--workers", "2"],
        ["--micro-batch", "1"],
    ],
)
def test_cpu_toggles_train(tmp_path, toggle):
    code, events, _ = run(tmp_path, "--max-steps", "3", *toggle)
    assert code == EXIT_OK
    assert all(s.loss == s.loss for s in of(events, "step"))


@pytest.mark.slow
def test_a_slow_toggle_runs_with_a_warning(tmp_path, monkeypatch):
    from trainer import device_probe as device

    monkeypatch.setattr(device, "_cpu_has_bf16_kernels", lambda: False)  # as on an AVX2-only CPU
    code, events, _ = run(tmp_path, "--max-steps", "2", "--precision", "bf16", "--micro-batch", "4")
    assert code == EXIT_OK and len(of(events, "step")) == 2
    (w,) = [w for w in of(events, "warning") if w.kind == "slow_toggle"]
    assert w.message.startswith("--precision bf16: ") and "emulated" in w.message
    assert of(events, "hello")[0].device.cpu_bf16 is False


@pytest.mark.slow
def test_profile_trace_written(tmp_path):
    code, events, run_dir = run(tmp_path, "--max-steps", "4", "--profile-steps", "1-2")
    assert code == EXIT_OK
    trace = run_dir / "profiles" / "steps-1-2.json"
    assert trace.is_file() and json.loads(trace.read_text())["traceEvents"]


@pytest.mark.process
def test_sigterm_is_a_graceful_stop(tmp_path):
    run_dir = tmp_path / "r"
    proc = subprocess.Popen(
        trainer_cmd(*TINY, "--max-steps", "100000", "--run-dir", str(run_dir)), stdout=subprocess.PIPE, text=True
    )
    for line in proc.stdout:
        if "micro-batch" in line and "x" in line and "accumulation" in line:
            break
    wait_for(
        lambda: (run_dir / "events.jsonl").exists() and of(list(read_events(run_dir / "events.jsonl")), "step"),
        60,
        "the first step event",
        poll=0.1,
        proc=proc,
    )
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    events = list(read_events(run_dir / "events.jsonl"))
    done = of(events, "done")[-1]
    assert done.reason == "SIGTERM"
    assert rundir.list_checkpoints(run_dir)[-1].step == done.step


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.process  # inductor builds its C++ kernels in worker processes
def test_compile_default_trains_and_the_watchdog_reports_a_recompilation_where_it_happened(tmp_path):
    """Eval after training changes the guards (no_grad, eval mode): one recompilation in the first eval,
    tied to it; the training steps after it (and the second eval, cached) recompile nothing."""
    code, events, _ = run(
        tmp_path, "--max-steps", "5", "--compile", "default", "--eval-every", "2", "--eval-batches", "1"
    )
    assert code == EXIT_OK
    assert len(of(events, "step")) == 5
    built = [e for e in events if e.type in ("log", "warning") and "torch.compile:" in e.message]
    assert len(built) == 1 and "graph(s)" in built[0].message
    recompiles = [e for e in events if e.type == "warning" and e.kind == "recompile"]
    assert len(recompiles) == 1, [e.message for e in recompiles]
    assert recompiles[0].step == 2 and "in the eval after step 2" in recompiles[0].message
    assert not [e for e in events if e.type == "warning" and e.kind == "compile_fallback"]


@pytest.mark.parametrize("extra", [[], ["--optimizer", "adafactor"], ["--lora", "4"]])
def test_size_auto_resolves_in_the_trainer(tmp_path, extra):
    """`--size auto` is the default the README's first command relies on: the trainer resolves it (with the
    run's own optimizer and LoRA) and names the run by the size it picked, as gptop does."""
    from gptop.telemetry import resolved_size

    args = [a for a in TINY if a not in ("--size", "tiny")] + ["--size", "auto", "--max-steps", "1", *extra]
    cfg = parse_config(args)
    assert cfg.model.size == "auto"
    expected = resolved_size(cfg)  # gptop's torch-free answer, before the trainer starts
    cfg.run.run_dir = str(tmp_path / "run")
    assert train_in_process(tmp_path / "run", cfg=cfg)[0] == EXIT_OK
    hello = [e for e in read_events(tmp_path / "run" / "events.jsonl") if e.type == "hello" and not e.early]
    assert hello[-1].model.size == expected == "tiny"  # this CPU: 2 cores
    assert parse_config(["--size", "auto"]).model.size == "auto"


def test_a_cuda_graph_replay_error_is_a_compile_error():
    """The overwritten-output error of a CUDA-graph compile mode is raised where the storage is next touched
    (autograd, the optimizer), as a plain RuntimeError: it is a compile error (exit 5), not a crash."""
    from trainer.runner import _is_compile_error

    assert _is_compile_error(
        RuntimeError("Error: accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run.")
    )
    assert not _is_compile_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    scope = {"__name__": "torch._inductor.codecache"}
    exec("def compile_something():\n    raise ValueError('bad kernel')", scope)
    try:
        scope["compile_something"]()
    except ValueError as e:
        assert _is_compile_error(e)  # raised inside the compiler's code
