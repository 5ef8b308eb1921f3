"""Long runs (issue 21 §1): gptop report reads a run in one streaming pass with bounded memory, and the
monitor attaches to a long run by reading its head and tail."""

from __future__ import annotations

import random
import statistics
import sys
import tracemalloc
from pathlib import Path

import pytest

from helpers import ROOT
from fixtures.streams import gpu_run
from gptop import report, run_energy
from gptop.energy import measure
from trainer.contract.events import DeviceEvent, StepEvent, dumps

sys.path.insert(0, str(ROOT / "bench"))
import longrun  # noqa: E402  (bench/longrun.py: the long-run builder the bench and these tests share)


def write(run: Path, events) -> None:
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "events.jsonl", "w") as f, open(run / "device.jsonl", "w") as d:
        for e in events:
            (d if isinstance(e, DeviceEvent) else f).write(dumps(e) + "\n")


def test_the_median_is_exact_then_within_its_resolution():
    rng = random.Random(1)
    xs = [rng.lognormvariate(8, 0.3) for _ in range(5001)]
    m = report._Median()
    for x in xs:
        m.add(x)
    assert m.median() == statistics.median(xs) and m.values is not None
    small = type("M", (report._Median,), {"EXACT": 100})()
    for x in xs:
        small.add(x)
    assert small.values is None and len(small.buckets) < 2000  # switched to buckets, bounded
    assert small.median() == pytest.approx(statistics.median(xs), rel=report._Median.RESOLUTION)
    zeros = type("M", (report._Median,), {"EXACT": 1})()
    for x in (0.0, 0.0, 0.0, 5.0):
        zeros.add(x)
    assert zeros.median() == 0.0


@pytest.mark.parametrize("chunk", [3, 7, 50, 100_000])
def test_energy_in_chunks_equals_one_measure_over_all_samples(tmp_path, chunk, monkeypatch):
    events = gpu_run(300)
    run = tmp_path / "run"
    write(run, events)
    samples = [e for e in events if isinstance(e, DeviceEvent)]
    steps = [e for e in events if isinstance(e, StepEvent)]
    whole = measure(samples, steps[0].time, steps[-1].time)
    monkeypatch.setattr(run_energy, "ENERGY_CHUNK", chunk)
    s = report.summarize(run)
    assert whole is not None and s["energy_j"] == pytest.approx(whole.joules, rel=1e-9)
    assert s["energy_source"] == whole.source


def test_the_report_of_a_run_with_several_starts_is_what_the_events_say(tmp_path):
    """The streaming pass against a computation over the whole list (the way the report used to work)."""
    events = gpu_run(300, tuning_done=True)
    run = tmp_path / "run"
    write(run, events)
    s = report.summarize(run)
    steps = [e for e in events if isinstance(e, StepEvent)]
    steady, first = [], True
    for e in events:
        if e.type == "hello":
            first = True
        elif isinstance(e, StepEvent):
            if not first:
                steady.append(e)
            first = False
    assert s["tokens_per_s"] == statistics.median(e.tokens_per_s for e in steady if e.tokens_per_s)
    assert s["step_ms"] == statistics.median(e.step_ms for e in steady if e.step_ms is not None)
    assert s["steps"] == steps[-1].step and s["first_loss"] == steps[0].loss and s["final_loss"] == steps[-1].loss
    assert s["loss_steps"] == sum(e.loss is not None for e in steps)
    assert s["checkpoints_written"] == sum(e.type == "checkpoint" for e in events)


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
def test_report_memory_does_not_grow_with_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(run_energy, "ENERGY_CHUNK", 256)  # the device samples held at a time: both runs fill it
    tpl = longrun.template_lines(_template())
    small, large = tmp_path / "small", tmp_path / "large"
    longrun.write_run(small, 2_000, tpl)
    longrun.write_run(large, 16_000, tpl)
    peak_small = _peak(lambda: report.summarize(small))
    peak_large = _peak(lambda: report.summarize(large))
    # 8x the events: the peak grows only by the exact medians' float arrays (3 x 8 bytes per step event)
    assert peak_large < peak_small + 16_000 * 3 * 8 * 2 + 200_000, (peak_small, peak_large)


def _template() -> Path:
    """A run directory shaped like a real tiny run's (tests/fixtures), to clone lines from."""
    run = ROOT / "tests" / "fixtures" / "longrun-template"
    return run


def test_attaching_to_a_long_run_reads_its_head_newest_hello_and_tail(tmp_path, monkeypatch):
    from gptop import monitor

    monkeypatch.setattr(monitor, "TAIL_BYTES", 200_000)
    monkeypatch.setattr(monitor, "HEAD_BYTES", 50_000)
    monkeypatch.setattr(monitor, "SCAN_CHUNK", 4096)
    tpl = longrun.template_lines(_template())
    counts = {}
    for n in (4_000, 16_000):
        run = tmp_path / f"run{n}"
        longrun.write_run(run, n, tpl)
        session = monitor.MonitorSession(run, sampler=_NoSampler())
        seen = []
        session.add_view(
            type(
                "V",
                (),
                {"on_event": lambda self, e: seen.append(e), "on_log": lambda *a: None, "on_status": lambda *a: None},
            )()
        )
        session.start()
        assert session.replayed.wait(60)
        session.close()
        s = session.state
        counts[n] = len(seen)
        assert s.step == n and s.done is not None  # the tail: the run's end
        assert s.first_loss is not None and s.start_time == seen[0].time  # the head: the first start
        assert s.hello is not None and not s.hello.early and s.total_steps == n  # the newest full hello
        assert any("a long run" in line for _, line in s.logs)
        assert s.malformed == 0  # the tail starts at a whole line
    assert counts[16_000] < counts[4_000] * 1.2  # the same work, 4x the run


def test_the_newest_hello_is_found_across_chunk_boundaries(tmp_path, monkeypatch):
    from gptop import monitor

    path = tmp_path / "events.jsonl"
    lines = (
        [b'{"type":"hello","early":true,"n":0}']
        + [b'{"type":"step","n":%d}' % i for i in range(50)]
        + [b'{"type":"hello","n":1,"pad":"' + b"x" * 300 + b'"}', b'{"type":"hello","early":true,"n":2}']
        + [b'{"type":"step","n":%d}' % i for i in range(500)]
    )
    path.write_bytes(b"\n".join(lines) + b"\n")
    with open(path, "rb") as f:
        for chunk in (7, 64, 100, 4096):
            monkeypatch.setattr(monitor, "SCAN_CHUNK", chunk)
            assert monitor._newest_hello(f, 0, path.stat().st_size - 2000) == lines[51]


class _NoSampler:
    def subscribe(self, fn):
        pass

    def start(self):
        pass

    def stop(self):
        pass
