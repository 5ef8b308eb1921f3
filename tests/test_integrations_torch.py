"""gptop.integrations.torch.Probe (and the Client under it), in-process against a fake gptop channel."""

from __future__ import annotations

import math
import signal
import sys

import pytest
import torch
import torch.nn.functional as F

from gptop.integrations.client import describe_model
from gptop.integrations.torch import Probe
from trainer.contract import events as ev
from trainer.contract.client import CHANNEL_ENV, LOG_EVERY_ENV, RESUME_ENV, RUN_DIR_ENV, ClientEnv
from trainer.contract.config import ConfigError

from helpers import wait_for

VOCAB, BATCH, SEQ = 32, 4, 8


def tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train(probe: Probe, model, opt, steps: int, start: int = 1, on_step=None, ckpt_dir=None, device="cpu") -> int:
    """The issue's loop, as a user writes it; returns the last step taken."""
    step = start - 1
    for step in range(start, steps + 1):
        with probe.step(step):
            with probe.phase("data"):
                x = torch.randint(VOCAB, (BATCH, SEQ)).to(device)
            with probe.phase("forward"):
                loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
            with probe.phase("backward"):
                loss.backward()
            with probe.phase("optimizer"):
                opt.step()
                opt.zero_grad()
            probe.log(loss=loss)
        if on_step is not None:
            on_step(step)
        if probe.should_checkpoint or probe.should_stop:
            path = ckpt_dir / f"step-{step}.pt"
            torch.save(model.state_dict(), path)
            probe.checkpointed(path)
        if probe.should_stop:
            break
    return step


def test_outside_gptop_every_call_is_a_no_op(monkeypatch):
    monkeypatch.delenv(CHANNEL_ENV, raising=False)
    model, opt = tiny()
    probe = Probe(model, tokens_per_step=BATCH * SEQ)
    assert not probe.active
    assert probe.step(1) is probe.step(2) is probe.phase("forward")  # one shared null context
    assert train(probe, model, opt, 3) == 3
    assert not probe.should_checkpoint and not probe.should_stop
    probe.checkpointed("nowhere")
    probe.close()
    with pytest.raises(ValueError, match="forwrd"):
        probe.phase("forwrd")  # a typo fails without gptop too, not only under it
    for bad in (dict(tokens_per_step=0), dict(log_every=-1), dict(max_steps=1.5), dict(precision="fp64")):
        with pytest.raises(ValueError):
            Probe(model, **bad)


def test_the_same_events_as_the_trainer(gptop, tmp_path):
    model, opt = tiny()
    probe = Probe(model, tokens_per_step=BATCH * SEQ, optimizer=opt, log_every=2, max_steps=6)
    assert probe.active
    assert train(probe, model, opt, 6) == 6
    probe.close()
    hello = gptop.file_events("hello")[0]
    assert hello.client == "probe" and hello.start_step == 0 and hello.tokens_per_step == BATCH * SEQ
    assert hello.max_steps == 6 and hello.config["log"]["log_every"] == 2
    assert hello.model.family == "Sequential" and hello.model.total_params == sum(p.numel() for p in model.parameters())
    assert hello.model.flops_per_token == 6 * (16 * VOCAB + VOCAB)  # the Linear; the lookup is free
    steps = gptop.file_events("step")
    assert [e.step for e in steps] == [2, 4, 6] and all(e.interval_steps == 2 for e in steps)
    for e in steps:
        assert list(e.phases_ms) == list(ev.PHASES)
        timed = sum(v for k, v in e.phases_ms.items() if k != "other")
        assert math.isclose(e.phases_ms["other"], e.step_ms - timed, rel_tol=1e-6, abs_tol=1e-6)
        assert e.phases_ms["forward"] > 0 and e.phases_ms["backward"] > 0
        assert e.tokens == e.step * BATCH * SEQ and e.tokens_per_s > 0 and e.loss > 0 and e.lr == 0.1
        assert e.mem_bytes > 0
    live = [e.step for e in gptop.events("progress")]  # live only, at most every PROGRESS_MIN_S
    assert live[0] == 1 and live == sorted(set(live)) and set(live) <= set(range(1, 7))
    assert not gptop.file_events("progress")
    done = gptop.file_events("done")
    assert len(done) == 1 and done[0].reason == "max_steps" and done[0].step == 6


def test_commands_reach_the_loop(gptop, tmp_path):
    model, opt = tiny()
    probe = Probe(model, tokens_per_step=BATCH * SEQ, log_every=100)

    def on_step(step: int) -> None:
        command = {2: {"cmd": "checkpoint"}, 3: {"cmd": "log_every", "steps": 1}, 5: {"cmd": "stop"}}.get(step)
        if command is not None:
            gptop.send(command)
            wait_for(lambda: not probe._client.channel.commands.empty(), timeout=30, what="the command")

    assert train(probe, model, opt, 100, on_step=on_step, ckpt_dir=tmp_path) == 6  # acted on at the next step
    probe.close()
    ckpts = gptop.file_events("checkpoint")
    assert [(c.step, c.reason) for c in ckpts] == [(3, "requested"), (6, "stop")]
    assert all((tmp_path / f"step-{c.step}.pt").exists() for c in ckpts)
    assert [e.step for e in gptop.file_events("step")] == [4, 5, 6]  # every step from step 4
    assert gptop.file_events("done")[0].reason == "stop requested"


def test_a_stop_signal_is_a_graceful_stop_and_the_handlers_come_back(gptop, tmp_path):
    before = signal.getsignal(signal.SIGINT)
    model, opt = tiny()
    probe = Probe(model, tokens_per_step=BATCH * SEQ)
    on_step = lambda step: signal.raise_signal(signal.SIGINT) if step == 2 else None  # noqa: E731
    assert train(probe, model, opt, 100, on_step=on_step, ckpt_dir=tmp_path) == 3
    probe.close()
    assert gptop.file_events("done")[0].reason == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is before


def test_tensors_are_read_back_only_at_log_steps(gptop, monkeypatch):
    reads: list[int] = []
    current = {"step": 0}
    for name in ("item", "tolist"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, **k):
            reads.append(current["step"])
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    model, opt = tiny()
    probe = Probe(model, tokens_per_step=BATCH * SEQ, log_every=3)
    for step in range(1, 7):
        current["step"] = step
        with probe.step(step):
            loss = F.cross_entropy(
                model(torch.randint(VOCAB, (BATCH, SEQ))).flatten(0, 1), torch.randint(VOCAB, (BATCH * SEQ,))
            )
            loss.backward()
            probe.log(loss=loss, grad_norm=loss.detach() * 0 + 1)
    assert sorted(set(reads)) == [3, 6]
    probe.close()


def test_a_resumed_loop_reports_from_its_step(gptop):
    model, opt = tiny()
    probe = Probe(model, tokens_per_step=BATCH * SEQ, log_every=1)
    train(probe, model, opt, 12, start=11)
    probe.close()
    assert gptop.file_events("hello")[0].start_step == 10
    assert [(e.step, e.tokens) for e in gptop.file_events("step")] == [(11, 11 * BATCH * SEQ), (12, 12 * BATCH * SEQ)]


def test_an_uncaught_exception_is_an_error_event(gptop):
    model, opt = tiny()
    probe = Probe(model, tokens_per_step=BATCH * SEQ)
    train(probe, model, opt, 1)
    hook = sys.excepthook
    assert hook is not sys.__excepthook__
    try:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
    except torch.OutOfMemoryError as e:
        sys.excepthook(type(e), e, e.__traceback__)  # what Python does with an uncaught one
    probe.close()
    err = gptop.file_events("error")
    assert len(err) == 1 and err[0].kind == "oom" and "Tried to allocate" in err[0].message
    assert not gptop.file_events("done")  # a failed run is not done
    assert sys.excepthook is not hook


def test_client_env_round_trip_and_refusals(tmp_path):
    env = ClientEnv(channel="unix:/tmp/x.sock", run_dir=tmp_path, log_every=5, resume="ckpt/checkpoint-4")
    assert ClientEnv.from_environ(env.to_environ()) == env
    assert ClientEnv.from_environ({}) is None
    base = env.to_environ()
    for key, value in (
        (CHANNEL_ENV, "tcp:1.2.3.4"),
        (RUN_DIR_ENV, str(tmp_path / "missing")),
        (LOG_EVERY_ENV, "0"),
        (LOG_EVERY_ENV, "ten"),
    ):
        with pytest.raises(ConfigError) as e:
            ClientEnv.from_environ({**base, key: value})
        assert e.value.option == key
    assert ClientEnv.from_environ({k: v for k, v in base.items() if k != RESUME_ENV}).resume is None


def test_flops_per_token_are_counted_as_for_the_built_in_families():
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainer.models import training_flops_per_token

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    got = describe_model(model, seq_len=32)
    assert got["flops_per_token"] == training_flops_per_token(model, model.config, 32)
    assert got["family"] == "GPT2LMHeadModel" and got["embedding_params"] == 64 * 32  # wte; the head is tied
    generic = describe_model(torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10)))
    assert generic["flops_per_token"] == 6 * (4 * 10 + 10)
    assert describe_model(None, flops_per_token=123.0)["flops_per_token"] == 123


def test_progress_events_are_spaced_in_a_fast_loop(gptop, monkeypatch):
    """A step of microseconds does not send a progress event each: at most one per PROGRESS_MIN_S."""
    from gptop.integrations import client

    model, opt = tiny()
    probe = Probe(model, tokens_per_step=BATCH * SEQ, log_every=1000)
    clock = {"t": 0.0}
    monkeypatch.setattr(client.time, "perf_counter", lambda: clock["t"])
    for step in range(1, 101):
        clock["t"] += 1 / 64  # exact in binary: 3 steps are under PROGRESS_MIN_S, 4 over
        with probe.step(step):
            pass
    probe.close()
    # the channel is read by another thread: wait for what was sent before judging it
    wait_for(lambda: len(gptop.events("progress")) >= 25, timeout=30, what="25 progress events")
    live = [e.step for e in gptop.events("progress")]
    assert live[:3] == [1, 5, 9] and len(live) == 25


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_phases_are_cuda_events_read_back_with_the_loss(gptop):
    model, opt = tiny()
    model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = Probe(model, tokens_per_step=BATCH * SEQ, optimizer=opt, log_every=2)
    train(probe, model, opt, 6, device="cuda")
    probe.close()
    hello = gptop.file_events("hello")[0]
    assert hello.device.type == "cuda" and hello.config["toggles"]["precision"] in ("fp32", "tf32")
    for e in gptop.file_events("step"):
        assert e.gpu_idle_ms is not None and 0 <= e.gpu_idle_ms <= e.step_ms  # the CUDA timer's
        assert e.phases_ms["forward"] > 0 and e.phases_ms["backward"] > 0 and e.mem_bytes > 0
        assert e.mfu is None or 0 < e.mfu < 1


def test_a_channel_that_cannot_be_reached_never_ends_the_training(tmp_path, monkeypatch, capsys):
    env = ClientEnv(channel=f"unix:{tmp_path / 'nobody-listens.sock'}", run_dir=tmp_path)
    for k, v in env.to_environ().items():
        monkeypatch.setenv(k, v)
    model, opt = tiny()
    probe = Probe(model, tokens_per_step=BATCH * SEQ)
    assert train(probe, model, opt, 3) == 3
    assert not probe.active and "training on without it" in capsys.readouterr().err


def test_the_profile_command_writes_a_trace_of_the_next_steps(gptop):
    model, opt = tiny()
    probe = Probe(model, tokens_per_step=BATCH * SEQ)

    def on_step(step: int) -> None:
        if step == 1:
            gptop.send({"cmd": "profile", "steps": 2})
            wait_for(lambda: not probe._client.channel.commands.empty(), timeout=30, what="the command")

    train(probe, model, opt, 5, on_step=on_step)
    probe.close()
    trace = gptop.run_dir / "profiles" / "steps-3-4.json"  # seen at step 2's end: steps 3 and 4
    assert trace.exists() and "ProfilerStep#3" in trace.read_text()
    assert any(e.path == str(trace) for e in gptop.file_events("log"))


@pytest.fixture
def fp32_precision_root():
    """torch.backends.fp32_precision as a test found it, put back after (process-wide state)."""
    if not hasattr(torch.backends, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision API (torch < 2.9)")
    # the settings trainer.tf32 reads inherit from the root while the test runs (another test in this process may
    # have set them through the old flags, which write them explicitly)
    leaves = (torch.backends.cuda.matmul, torch.backends.cudnn.conv)
    before = torch.backends.fp32_precision, [leaf.fp32_precision for leaf in leaves]
    for leaf in leaves:
        leaf.fp32_precision = "none"
    yield
    torch.backends.fp32_precision = before[0]
    for leaf, value in zip(leaves, before[1]):
        leaf.fp32_precision = value
    assert isinstance(torch.backends.cuda.matmul.allow_tf32, bool)  # the old flags read again


@pytest.mark.parametrize("root, on_cuda", [("tf32", "tf32"), ("ieee", "fp32")])
def test_the_precision_read_goes_through_torchs_fp32_precision_api(fp32_precision_root, root, on_cuda):
    """transformers' TrainingArguments sets torch.backends.fp32_precision = "tf32" (tf32=True, bf16, or
    torch_compile with fp32 weights); on torch >= 2.9 reading the old allow_tf32 flag then raises, which crashed
    every client's start. Every read of the TF32 state (the clients' MFU column, the doctor's check, the
    trainer's) goes through the new API, and fp32 weights with TF32 matmuls on CUDA are labelled tf32."""
    from gptop.integrations.client import model_precision
    from trainer import tf32

    torch.backends.fp32_precision = root
    model, _ = tiny()
    assert model_precision(model, torch.device("cuda")) == on_cuda  # the device is only named: no CUDA needed
    assert model_precision(model, torch.device("cpu")) == "fp32"  # the CPU has no TF32
    assert tf32.matmul_tf32() is (root == "tf32") and tf32.conv_tf32() is (root == "tf32")
    assert model_precision(model.to(torch.bfloat16), torch.device("cuda")) == "bf16"


@pytest.mark.parametrize("where", ["in the forward phase", "around the loop", "none", "stated"])
def test_the_probes_default_precision_is_the_autocast_its_forward_runs_in(gptop, monkeypatch, where):
    """A plain loop's parameters stay fp32 under autocast: the precision (the MFU peak's column) from their dtype
    measured a bf16 loop against the fp32 peak. Without `precision=`, the probe takes the autocast its model's
    first forward runs under (entered inside the step, as torch's AMP recipe does, or around the loop); the
    hello, with the peak for that column, comes once it is known."""
    from contextlib import nullcontext

    import trainer.flops as flops

    asked: list[str] = []

    def fake_peak(dev, precision, **kw):
        asked.append(precision)
        return flops.Peak({"bf16": 2e12, "fp32": 1e12}[precision], f"test: {precision}")

    monkeypatch.setattr(flops, "peak", fake_peak)
    model, opt = tiny()
    probe = Probe(model, tokens_per_step=BATCH * SEQ, log_every=2, precision="fp32" if where == "stated" else None)
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    outer = bf16() if where == "around the loop" else nullcontext()
    with outer:
        for step in range(1, 5):
            with probe.step(step):
                with probe.phase("forward"):
                    with bf16() if where in ("in the forward phase", "stated") else nullcontext():
                        x = torch.randint(VOCAB, (BATCH, SEQ))
                        loss = F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
                with probe.phase("backward"):
                    loss.backward()
                opt.step()
                opt.zero_grad()
                probe.log(loss=loss)
    probe.close()
    want = "fp32" if where in ("none", "stated") else "bf16"
    (hello,) = gptop.file_events("hello")
    assert hello.config["toggles"]["precision"] == want and hello.peak_source == f"test: {want}"
    assert hello.peak_flops == {"bf16": 2e12, "fp32": 1e12}[want]
    assert asked[-1] == want
    assert not model._forward_pre_hooks  # the watch is gone after the first forward
    assert gptop.file_events()[0].type == "hello"  # before anything of the first step


def vm_hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def test_a_client_never_resets_the_programs_own_peak_memory(gptop, monkeypatch):
    """The client read each log interval's peak by resetting the process's peak statistics (CUDA's
    reset_peak_memory_stats, the CPU's VmHWM), which corrupted the program's own readings (transformers'
    skip_memory_metrics=False reads torch.cuda.max_memory_allocated). A client reports the peak the program's own
    reading gives, and resets nothing."""
    import os

    from trainer.memory import CudaMemory, make_meter

    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("this process cannot reset its VmHWM, so a reset would not show")
    big = bytearray(256 << 20)  # a peak the program made before the loop
    big[:: 1 << 12] = b"x" * len(big[:: 1 << 12])
    del big
    before = vm_hwm()
    model, opt = tiny()
    probe = Probe(model, tokens_per_step=BATCH * SEQ, optimizer=opt, log_every=2)
    train(probe, model, opt, 6)
    probe.close()
    assert vm_hwm() >= before
    assert all(e.mem_bytes >= before for e in gptop.file_events("step"))  # the process's peak, as it reads it

    class Cuda:  # torch.cuda's memory functions
        peak = 5 << 30

        def reset_peak_memory_stats(self, device):
            raise AssertionError("the program's peak statistics were reset")

        def max_memory_allocated(self, device):
            return self.peak

    meter = CudaMemory(torch.device("cuda"), cuda=Cuda(), reset_process_peak=False)
    meter.reset_peak()
    assert meter.peak() == 5 << 30
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", Cuda().reset_peak_memory_stats)
    make_meter(torch.device("cuda"), reset_process_peak=False).reset_peak()
