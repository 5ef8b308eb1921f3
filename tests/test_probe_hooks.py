"""The Probe's hooks (gptop.integrations.loop_hooks): a plain loop's breakdown from `probe.step(n)` alone,
in-process against a fake gptop channel, on a fake clock (the client's timer and the hooks' marks) so that
every phase's time is known exactly."""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import pytest
import torch

from gptop.integrations import client as client_module
from gptop.integrations import loop_hooks
from gptop.integrations.torch import Probe
from trainer.contract.client import CHANNEL_ENV
from trainer.timing import CpuTimer

from fixtures.fake_gptop import FakeGptop
from helpers import wait_for

VOCAB, BATCH, SEQ, ACCUM = 16, 2, 5, 3
DATA, FWD, BWD, OPT, OTHER = 4.0, 8.0, 16.0, 2.0, 1.0  # ms of the fake clock: exact in binary


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, ms: float) -> None:
        self.t += ms / 1e3


class Model(torch.nn.Module):
    """A forward that takes FWD ms of the fake clock; `scale` makes its loss inf (a GradScaler skips the step)."""

    def __init__(self, clock: Clock):
        super().__init__()
        # not traced by torch.compile: the clock moves on every call, as time does
        self.advance, self.scale = torch.compiler.disable(clock.advance), 1.0
        self.emb = torch.nn.Embedding(VOCAB, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.advance(FWD)
        return self.emb(x).sum() * self.scale


class SGD(torch.optim.SGD):
    """An optimizer step of OPT ms of the fake clock."""

    def __init__(self, params, clock: Clock):
        super().__init__(params, lr=0.01)
        self.clock = clock

    def step(self, closure=None):
        self.clock.advance(OPT)
        return super().step(closure)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(client_module, "make_timer", lambda device, enabled: CpuTimer(clock=c))
    monkeypatch.setattr(loop_hooks, "time", SimpleNamespace(perf_counter=c))
    return c


@pytest.fixture
def gptop(tmp_path, monkeypatch):
    g = FakeGptop(tmp_path / "run").install(monkeypatch)
    yield g
    g.close()


def batch() -> torch.Tensor:
    return torch.randint(VOCAB, (BATCH, SEQ))


def micro_steps(model: Model, clock: Clock, backward=lambda loss: loss.backward()) -> None:
    """Gradient accumulation as nanoGPT does it: forward, then BWD ms of backward, per micro-step."""
    for _ in range(ACCUM):
        loss = model(batch())
        clock.advance(BWD)
        backward(loss)


def breakdown(e) -> dict[str, float]:
    return {k: round(v, 6) for k, v in e.phases_ms.items()}


EXPECTED = {"data": DATA, "forward": ACCUM * FWD, "backward": ACCUM * BWD, "optimizer": OPT, "other": OTHER}


def test_one_call_per_step_gives_the_breakdown_and_the_tokens(gptop, clock):
    model = Model(clock)
    opt = SGD(model.parameters(), clock)
    probe = Probe(model, optimizer=opt, log_every=2)
    for n in range(1, 5):
        probe.step(n)
        clock.advance(DATA)
        micro_steps(model, clock)
        opt.step()
        opt.zero_grad()
        clock.advance(OTHER)
    probe.close()  # step 4 ends here: it trained
    steps = gptop.file_events("step")
    assert [e.step for e in steps] == [2, 4]
    for e in steps:
        assert breakdown(e) == EXPECTED
        assert e.step_ms == pytest.approx(sum(EXPECTED.values()))
        assert e.tokens == e.step * ACCUM * BATCH * SEQ  # counted from the forwards' input
    hello = gptop.file_events("hello")[0]
    assert hello.model.family == "Model" and hello.tokens_per_step is None
    assert gptop.file_events("done")[0].step == 4


def test_explicit_phases_win_and_the_with_form_still_works(gptop, clock):
    model = Model(clock)
    opt = SGD(model.parameters(), clock)
    probe = Probe(model, optimizer=opt, log_every=1)
    # a plain call, with the data and the first micro-step's forward given explicitly
    probe.step(1)
    with probe.phase("data"):
        clock.advance(DATA)
    for i in range(ACCUM):
        if i == 0:
            with probe.phase("forward"):
                loss = model(batch())
        else:
            loss = model(batch())
        clock.advance(BWD)
        loss.backward()
    opt.step()
    clock.advance(OTHER)
    # the explicit form of issue 22, every phase given: the hooks fire inside and time nothing
    with probe.step(2):
        with probe.phase("data"):
            clock.advance(DATA)
        for _ in range(ACCUM):
            with probe.phase("forward"):
                loss = model(batch())
            with probe.phase("backward"):
                clock.advance(BWD)
                loss.backward()
        with probe.phase("optimizer"):
            opt.step()
        clock.advance(OTHER)
    probe.close()
    steps = gptop.file_events("step")
    assert [e.step for e in steps] == [1, 2]
    assert [breakdown(e) for e in steps] == [EXPECTED, EXPECTED]


def test_an_evaluation_and_a_save_are_no_part_of_a_step(gptop, clock, tmp_path):
    """nanoGPT's order: at the top of an iteration, an evaluation under no_grad and a save, then the step."""
    model = Model(clock)
    opt = SGD(model.parameters(), clock)
    probe = Probe(model, optimizer=opt, log_every=1)
    path = tmp_path / "ckpt.pt"
    for n in range(1, 4):
        probe.step(n)
        if n > 1:
            model.eval()
            with torch.no_grad():
                for _ in range(4):
                    model(batch())  # FWD ms each, and data waits between them
                    clock.advance(DATA)
            model.train()
            clock.advance(64.0)  # the save
            path.write_bytes(b"x")
            probe.checkpointed(path)
        clock.advance(DATA)
        micro_steps(model, clock)
        opt.step()
        opt.zero_grad()
        clock.advance(OTHER)
        if n == 3:  # an evaluation after the step's optimizer: its time is the step's other
            model.eval()
            with torch.no_grad():
                model(batch())
            model.train()
    probe.close()
    steps = gptop.file_events("step")
    assert [breakdown(e) for e in steps[:2]] == [EXPECTED, EXPECTED]
    assert breakdown(steps[2]) == {**EXPECTED, "other": OTHER + FWD}
    assert [e.tokens for e in steps] == [n * ACCUM * BATCH * SEQ for n in (1, 2, 3)]  # training forwards only
    ckpts = gptop.file_events("checkpoint")
    # the save only (from the evaluation's last forward and data wait), of the steps done before it
    assert [(c.step, round(c.seconds * 1e3, 6)) for c in ckpts] == [(1, DATA + 64.0), (2, DATA + 64.0)]


def test_a_step_the_grad_scaler_skips_has_no_optimizer_time(gptop, clock):
    model = Model(clock)
    opt = SGD(model.parameters(), clock)
    scaler = torch.amp.GradScaler("cpu")
    probe = Probe(model, optimizer=opt, log_every=1)
    for n in (1, 2):
        probe.step(n)
        model.scale = math.inf if n == 2 else 1.0
        clock.advance(DATA)
        micro_steps(model, clock, backward=lambda loss: scaler.scale(loss).backward())
        scaler.step(opt)  # skipped at step 2: inf gradients
        scaler.update()
        opt.zero_grad()
        clock.advance(OTHER)
    probe.close()
    first, skipped = gptop.file_events("step")
    assert breakdown(first) == EXPECTED
    # the backward runs to the step's end: nothing marks where it ended
    assert breakdown(skipped) == {**EXPECTED, "optimizer": 0.0, "backward": ACCUM * BWD + OTHER, "other": 0.0}


def test_several_optimizers_add_up(gptop, clock):
    model = Model(clock)
    opts = [SGD([p], clock) for p in model.parameters()] + [SGD([torch.nn.Parameter(torch.ones(1))], clock)]
    probe = Probe(model, optimizer=opts, log_every=1)
    probe.step(1)
    clock.advance(DATA)
    micro_steps(model, clock)
    for opt in opts:
        opt.step()
        clock.advance(OTHER)  # between the two: other
    probe.close()
    (e,) = gptop.file_events("step")
    assert breakdown(e) == {**EXPECTED, "optimizer": 2 * OPT, "other": 2 * OTHER}


@pytest.mark.parametrize("given", ["tokens_per_step", "step"])
def test_given_tokens_win_over_the_counted_ones(gptop, clock, given):
    model = Model(clock)
    opt = SGD(model.parameters(), clock)
    probe = Probe(model, optimizer=opt, log_every=1, tokens_per_step=7 if given == "tokens_per_step" else None)
    for n in (1, 2):
        probe.step(n, tokens=7 if given == "step" else None)
        micro_steps(model, clock)
        opt.step()
    probe.close()
    assert [e.tokens for e in gptop.file_events("step")] == [7, 14]


def test_a_stop_before_the_step_trains_reports_the_steps_done(gptop, clock, tmp_path):
    model = Model(clock)
    opt = SGD(model.parameters(), clock)
    probe = Probe(model, optimizer=opt, log_every=1)
    n = 0
    for n in range(1, 100):
        probe.step(n)
        if probe.should_checkpoint or probe.should_stop:
            (tmp_path / f"{n - 1}.pt").write_bytes(b"x")
            probe.checkpointed(tmp_path / f"{n - 1}.pt")
        if probe.should_stop:
            break
        micro_steps(model, clock)
        opt.step()
        if n == 3:
            gptop.send({"cmd": "stop"})
            wait_for(lambda: not probe._client.channel.commands.empty(), timeout=30, what="the command")
    probe.close()
    assert n == 4
    assert [e.step for e in gptop.file_events("step")] == [1, 2, 3]  # step 4 began, never trained: not reported
    assert [(c.step, c.reason) for c in gptop.file_events("checkpoint")] == [(3, "stop")]
    assert gptop.file_events("done")[0].step == 3


def test_a_crash_inside_a_plain_step_does_not_report_it(gptop, clock):
    model = Model(clock)
    opt = SGD(model.parameters(), clock)
    probe = Probe(model, optimizer=opt, log_every=1)
    probe.step(1)
    micro_steps(model, clock)
    opt.step()
    probe.step(2)
    model(batch())
    try:
        raise torch.OutOfMemoryError("CUDA out of memory")
    except torch.OutOfMemoryError as e:
        sys.excepthook(type(e), e, e.__traceback__)  # what Python does with an uncaught one, before exit
    probe.close()  # as at exit
    assert [e.step for e in gptop.file_events("step")] == [1]
    assert gptop.file_events("error")[0].kind == "oom" and not gptop.file_events("done")


def test_outside_gptop_no_hook_is_installed_and_close_removes_them(gptop, clock, monkeypatch):
    model = Model(clock)
    opt = SGD(model.parameters(), clock)

    def hooks() -> int:
        return sum(map(len, (model._forward_pre_hooks, model._forward_hooks, opt._optimizer_step_pre_hooks))) + len(
            opt._optimizer_step_post_hooks
        )

    monkeypatch.delenv(CHANNEL_ENV)
    off = Probe(model, optimizer=opt)
    assert not off.active and hooks() == 0
    off.step(1)
    off.close()
    monkeypatch.setenv(CHANNEL_ENV, gptop.env[CHANNEL_ENV])
    probe = Probe(model, optimizer=opt)
    assert hooks() == 4
    probe.step(1)
    micro_steps(model, clock)
    opt.step()
    probe.close()
    assert hooks() == 0
    probe.step(2)  # after close: a no-op
    assert [e.step for e in gptop.file_events("step")] == [1]


def test_a_model_the_loop_does_not_call_is_said_once(gptop, clock):
    model = Model(clock)
    opt = SGD(model.parameters(), clock)
    probe = Probe(Model(clock), optimizer=opt, log_every=1)  # another instance than the one trained
    for n in (1, 2):
        probe.step(n)
        micro_steps(model, clock)
        opt.step()
    probe.close()
    warnings = [w for w in gptop.file_events("warning") if "no training forward" in w.message]
    assert len(warnings) == 1 and "give Probe the module the loop calls" in warnings[0].message
    # what it did not see is the data wait before the optimizer's step
    expected = {"data": ACCUM * (FWD + BWD), "forward": 0.0, "backward": 0.0, "optimizer": OPT, "other": 0.0}
    assert [breakdown(e) for e in gptop.file_events("step")] == [expected, expected]


@pytest.mark.compile
@pytest.mark.parametrize("how", ["wrapper", "in place"])
def test_a_compiled_model(gptop, clock, how):
    """Hooks on torch.compile's wrapper run around the compiled call; on a module compiled in place they are
    traced, and run as plain Python (torch.compiler.disable)."""
    torch._dynamo.reset()
    model = Model(clock)
    opt = SGD(model.parameters(), clock)
    if how == "wrapper":
        called = torch.compile(model, backend="eager")
        probe = Probe(called, optimizer=opt, log_every=1)
    else:
        probe = Probe(model, optimizer=opt, log_every=1)  # before compiling: the hooks are traced with it
        model.compile(backend="eager")
        called = model
    for n in (1, 2, 3):
        probe.step(n)
        clock.advance(DATA)
        for _ in range(ACCUM):
            loss = called(batch())
            clock.advance(BWD)
            loss.backward()
        opt.step()
        clock.advance(OTHER)
        if n == 2:
            called.eval()
            with torch.no_grad():
                called(batch())  # a recompile, for eval mode: still no part of the step's forward
            called.train()
    probe.close()
    steps = gptop.file_events("step")
    assert [breakdown(e) for e in steps] == [EXPECTED, {**EXPECTED, "other": OTHER + FWD}, EXPECTED]
    assert [e.tokens for e in steps] == [n * ACCUM * BATCH * SEQ for n in (1, 2, 3)]
    assert gptop.file_events("hello")[0].model.family == "Model"  # inside the wrapper


class Event:
    """Stands in for torch.cuda.Event: record() stamps the fake clock as the GPU's timeline (every phase's
    work is done when its hook fires), elapsed_time reads two stamps."""

    clock: Clock

    def __init__(self) -> None:
        self.t: float | None = None

    def record(self, stream) -> None:
        assert stream == "compute stream"
        self.t = Event.clock()

    def elapsed_time(self, end: "Event") -> float:
        assert self.t is not None and end.t is not None
        return (end.t - self.t) * 1e3


def test_on_cuda_the_hooks_mark_the_phases_with_the_timers_events(gptop, clock, monkeypatch):
    """The hooks move phase boundaries through the client's timer only: with the CUDA timer (fake events on the
    fake clock), the same breakdown, an evaluation and a save before the step left out, nothing synchronized."""
    from trainer.timing import CudaTimer

    Event.clock = clock
    monkeypatch.setattr(
        client_module,
        "make_timer",
        lambda device, enabled: CudaTimer(make_event=Event, clock=clock, stream=lambda: "compute stream"),
    )
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("the probe synchronized"))
    model = Model(clock)
    opt = SGD(model.parameters(), clock)
    probe = Probe(model, optimizer=opt, log_every=3)
    for n in (1, 2, 3):
        probe.step(n)
        if n == 2:
            model.eval()
            with torch.no_grad():
                model(batch())
            model.train()
            clock.advance(64.0)
            probe.checkpointed("ckpt.pt")
        clock.advance(DATA)
        micro_steps(model, clock)
        opt.step()
        clock.advance(OTHER)
    probe.close()
    (e,) = gptop.file_events("step")
    assert breakdown(e) == EXPECTED and e.gpu_idle_ms == pytest.approx(DATA + OTHER)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_hooks_give_the_breakdown(gptop):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 256), torch.nn.Linear(256, VOCAB)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = Probe(model, optimizer=opt, log_every=2)
    for n in range(1, 7):
        probe.step(n)
        for _ in range(ACCUM):
            x = torch.randint(VOCAB, (BATCH, SEQ), device="cuda")
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        probe.log(loss=loss)
    probe.close()
    steps = gptop.file_events("step")
    assert [e.step for e in steps] == [2, 4, 6]
    for e in steps:
        assert all(e.phases_ms[k] > 0 for k in ("forward", "backward", "optimizer")), e.phases_ms
        assert e.gpu_idle_ms is not None and 0 <= e.gpu_idle_ms <= e.step_ms
        assert e.tokens == e.step * ACCUM * BATCH * SEQ
