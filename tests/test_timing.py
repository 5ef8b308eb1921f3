import pytest

from trainer.timing import CpuTimer, CudaTimer, WallTimer


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def advance(self, ms):
        self.t += ms / 1e3


def test_cpu_phases_add_up_to_step():
    clock = FakeClock()
    timer = CpuTimer(clock)
    timer.begin_step(0)
    for _ in range(2):  # two accumulation micro-steps
        with timer.phase("data"):
            clock.advance(1)
        with timer.phase("forward"):
            clock.advance(10)
        with timer.phase("backward"):
            clock.advance(20)
    clock.advance(3)  # unaccounted
    with timer.phase("optimizer"):
        clock.advance(5)
    timer.end_step()
    (t,) = timer.collect()
    assert t.phases_ms == pytest.approx({"data": 2, "forward": 20, "backward": 40, "optimizer": 5, "other": 3})
    assert abs(sum(t.phases_ms.values()) - t.step_ms) < 1e-9
    assert timer.collect() == []


def test_wall_timer_has_no_phases():
    clock = FakeClock()
    timer = WallTimer(clock)
    timer.begin_step(3)
    with timer.phase("forward"):
        clock.advance(7)
    timer.end_step()
    (t,) = timer.collect()
    assert t.step == 3 and t.step_ms == pytest.approx(7) and t.phases_ms is None


class FakeEvent:
    """Stands in for torch.cuda.Event: record() stamps the fake GPU timeline."""

    gpu = FakeClock()
    records = 0
    stream = "compute stream of cuda:0"

    def __init__(self):
        self.t = None

    def record(self, stream):
        assert stream == FakeEvent.stream, f"recorded on {stream}, not the run's compute stream"
        FakeEvent.records += 1
        self.t = FakeEvent.gpu.t

    def elapsed_time(self, end):
        assert self.t is not None and end.t is not None, "elapsed_time on an unrecorded event"
        return (end.t - self.t) * 1e3


def test_cuda_timer_reads_events_only_on_collect():
    FakeEvent.gpu = gpu = FakeClock()
    host = FakeClock()
    timer = CudaTimer(make_event=FakeEvent, clock=host, stream=lambda: FakeEvent.stream)
    for step in range(3):
        timer.begin_step(step)
        with timer.phase("data"):
            host.advance(2)  # host waits for the batch; GPU timeline idles
            gpu.advance(2)
        with timer.phase("forward"):
            gpu.advance(30)
        with timer.phase("backward"):
            gpu.advance(60)
        gpu.advance(4)  # idle gap between phases
        with timer.phase("optimizer"):
            gpu.advance(10)
        timer.end_step()
    out = timer.collect()
    assert [t.step for t in out] == [0, 1, 2]
    for t in out:
        assert t.step_ms == pytest.approx(106)
        assert t.phases_ms == pytest.approx({"data": 2, "forward": 30, "backward": 60, "optimizer": 10, "other": 4})
        assert t.gpu_idle_ms == pytest.approx(6)
    # events are pooled and reused: the next step does not allocate new ones
    created = FakeEvent.records
    timer.begin_step(3)
    timer.end_step()
    assert len(timer._pool) > 0 or FakeEvent.records == created + 2


def test_cuda_events_are_recorded_on_the_runs_device_stream(monkeypatch):
    """On cuda:N an event recorded without a stream lands on the current device's (GPU 0 unless set): the
    timer records on the compute stream of the run's device, whatever the current device is."""
    import torch

    import trainer.timing as timing

    asked = []
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: (asked.append(device), f"stream of {device}")[1]
    )
    FakeEvent.stream = "stream of cuda:2"
    FakeEvent.gpu = FakeClock()
    try:
        timer = CudaTimer(make_event=FakeEvent, device=torch.device("cuda:2"))
        timer.begin_step(0)
        with timer.phase("forward"):
            FakeEvent.gpu.advance(5)
        timer.end_step()
        assert timer.collect()[0].phases_ms["forward"] == pytest.approx(5)
        assert asked and all(d == torch.device("cuda:2") for d in asked)
    finally:
        FakeEvent.stream = "compute stream of cuda:0"
    assert isinstance(timing.make_timer(torch.device("cpu"), True), CpuTimer)
    assert isinstance(timing.make_timer(torch.device("cpu"), False), WallTimer)
