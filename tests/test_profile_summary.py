"""A profile window summarized where it was captured (trainer.profile_summary): per phase the top operators
and kernels with their shares, the launch-bound and host-bound signs; the `profile` event and its JSON file."""

from __future__ import annotations

import json

import pytest

from helpers import train_in_process
from trainer.contract.events import PHASES, ProfileEvent, dumps, parse
from trainer.profile_summary import SHORT_OP_US, Span, SpanKind, summarize


def ann(name, a, b):
    return Span(name, a, b, SpanKind.ANNOTATION)


def op(name, a, b, self_us=None, kernels=()):
    return Span(name, a, b, SpanKind.OP, self_us=self_us, kernels=list(kernels))


def kernel(name, a, b):
    return Span(name, a, b, SpanKind.KERNEL)


def _phase(out, name):
    return next(p for p in out["phases"] if p.phase == name)


def test_operators_are_attributed_to_the_phase_they_start_in_by_self_time():
    spans = [
        ann("ProfilerStep#1", 0, 1000),
        ann("data", 0, 100),
        op("aten::randn", 10, 60),
        ann("forward", 100, 500),
        op("aten::linear", 110, 400, self_us=20),
        op("aten::addmm", 120, 390),
        op("aten::relu", 400, 480),
        ann("backward", 500, 900),
        op("aten::mm", 510, 890),  # on another thread: time decides
        ann("optimizer", 900, 980),
        op("Optimizer.step#AdamW.step", 905, 975),
        op("aten::zeros", 985, 990),  # in the step, in no phase: other
        op("aten::outside", 2000, 2100),
    ]  # outside every step: not counted
    out = summarize(spans)
    assert out["step_ms"] == pytest.approx(1.0)
    fwd = _phase(out, "forward")
    assert fwd.ms == pytest.approx(0.4)
    assert [o.name for o in fwd.ops] == ["aten::addmm", "aten::relu", "aten::linear"]
    assert fwd.ops[0].share == pytest.approx(270 / 400) and fwd.ops[2].ms == pytest.approx(0.02)
    # self times: nested operators are not counted twice, the shares add up within the phase
    assert sum(o.share for o in fwd.ops) == pytest.approx(fwd.op_share) and fwd.op_share <= 1
    assert _phase(out, "backward").ops[0].name == "aten::mm"
    other = _phase(out, "other")
    assert other.ms == pytest.approx(0.02) and other.ops[0].name == "aten::zeros"
    # the phases add up to the step
    assert sum(p.ms for p in out["phases"]) == pytest.approx(1.0)
    assert all(p.kernels == [] and p.gpu_ms is None for p in out["phases"])  # no GPU
    assert "gpu_idle_share" not in out and {p.phase for p in out["phases"]} == set(PHASES)


def test_short_operators_make_the_launch_bound_share():
    spans = [ann("ProfilerStep#1", 0, 100), ann("forward", 0, 100)]
    spans += [op("aten::view", 2 * i, 2 * i + 1) for i in range(30)]  # 30 x 1 µs, short
    spans += [op("aten::mm", 60, 60 + 2 * SHORT_OP_US)]  # one long
    out = summarize(spans)
    assert out["short_op_share"] == pytest.approx(30 / 100)


def test_kernels_follow_their_launch_and_the_gpu_idle_time_is_split():
    # forward launches two kernels (they run later, during backward's time); backward one; the GPU idles
    # 0-300 (while the host is in data, then forward: waiting on launches), and after 700
    spans = [
        ann("ProfilerStep#1", 0, 1000),
        ann("data", 0, 200),
        ann("forward", 200, 500),
        ann("backward", 500, 800),
        ann("optimizer", 800, 1000),
        op("aten::mm", 210, 260, kernels=[("sm90_gemm", 200.0)]),
        op("aten::add", 270, 280, kernels=[("add_kernel", 5.0)]),
        op("aten::mm_bw", 510, 560, kernels=[("sm90_gemm", 195.0)]),
        kernel("sm90_gemm", 300, 500),
        kernel("add_kernel", 500, 505),
        kernel("sm90_gemm", 505, 700),
    ]
    out = summarize(spans)
    fwd, bwd = _phase(out, "forward"), _phase(out, "backward")
    assert fwd.gpu_ms == pytest.approx(0.205) and bwd.gpu_ms == pytest.approx(0.195)
    assert [k.name for k in fwd.kernels] == ["sm90_gemm", "add_kernel"]
    assert fwd.kernels[0].share == pytest.approx(200 / 205)
    assert out["gpu_idle_share"] == pytest.approx(0.6)  # 0-300 and 700-1000
    # idle while the host was in forward/backward/optimizer: 200-300 and 700-1000 (data's 0-200 is not)
    assert out["gpu_idle_host_share"] == pytest.approx(0.4)
    assert out["short_kernel_share"] == pytest.approx(5 / 400)
    assert "comm_overlap" not in out


def test_communication_overlap_of_several_ranks():
    spans = [
        ann("ProfilerStep#1", 0, 1000),
        ann("backward", 0, 1000),
        kernel("sm90_gemm", 0, 400),
        kernel("ncclDevKernel_AllReduce_Sum_f32", 300, 500),
    ]
    assert summarize(spans)["comm_overlap"] == pytest.approx(0.5)


def test_a_window_without_a_step_has_no_summary():
    assert summarize([op("aten::mm", 0, 10)]) is None


def test_the_event_round_trips_with_its_nested_records():
    out = summarize([ann("ProfilerStep#1", 0, 100), ann("forward", 0, 100), op("aten::mm", 0, 50)])
    e = ProfileEvent(first=1, last=1, path="p.json", **out)
    back = parse(dumps(e))
    assert back == e and back.phases[0].ops[0].name == "aten::mm"


@pytest.mark.slow
def test_a_profiled_run_emits_the_summary_and_writes_it_next_to_the_trace(tmp_path):
    from trainer.train import EXIT_OK

    code, events, run_dir = train_in_process(tmp_path / "r", "--max-steps", "5", "--profile-steps", "3-5")
    assert code == EXIT_OK
    (prof,) = [e for e in events if e.type == "profile"]
    assert (prof.first, prof.last) == (3, 5)
    assert prof.path.endswith("steps-3-5.json") and prof.summary_path.endswith("steps-3-5.summary.json")
    assert json.loads(open(prof.summary_path).read())["step_ms"] == pytest.approx(prof.step_ms)
    by = {p.phase: p for p in prof.phases}
    assert {"data", "forward", "backward", "optimizer"} <= set(by)
    for p in prof.phases:
        assert 0 <= p.op_share <= 1 and sum(o.share for o in p.ops) <= p.op_share + 1e-9
    assert by["forward"].ops and by["forward"].ops[0].ms > 0
    # the window's mean step is about what the step events said for those steps
    steps = [e for e in events if e.type == "step" and 3 <= e.step <= 5]
    mean = sum(s.step_ms for s in steps) / len(steps)
    assert 0.5 * mean < prof.step_ms < 2 * mean


def test_headless_and_report_show_the_newest_window(tmp_path):
    from fixtures.streams import gpu_profile
    from gptop.headless import event_line
    from gptop.profile_text import profile_lines
    from gptop.report import format_report, summarize as report_summary
    from gptop.state import RunState
    from trainer.contract.events import dumps as dump

    p = gpu_profile()
    lines = profile_lines(p)
    assert lines[0].startswith("profile of steps 101-103: mean step 249.0 ms")
    fwd = next(line for line in lines if line.strip().startswith("forward"))
    assert "aten::mm 25%" in fwd and "GPU sm90_xmma_gemm_bf16bf16_bf16f32 68%" in fwd
    assert any("GPU idle 6% of the step" in line for line in lines)
    state = RunState()
    assert event_line(p, state) == "\n".join(lines)
    state.apply(p)
    assert state.profile == p
    # gptop report keeps the newest window of the run
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text(dump(gpu_profile(first=5, last=7)) + "\n" + dump(p) + "\n")
    s = report_summary(run)
    assert s["profile"]["first"] == 101
    assert "profile of steps 101-103" in format_report(s)


def test_the_gpu_timelines_copies_of_the_phase_ranges_are_not_kernels():
    """Seen on an H100: kineto lists each record_function range again on the GPU's timeline; taken for
    kernels they covered the whole step and a launch-bound run showed 1% GPU idle instead of ~75%."""
    from types import SimpleNamespace as NS

    from trainer.profile_summary import spans_from_profiler

    def fe(name, a, b, device, kernels=(), self_us=None, annotation=False):
        return NS(
            name=name,
            time_range=NS(start=a, end=b),
            device_type=f"DeviceType.{device}",
            kernels=list(kernels),
            self_cpu_time_total=self_us if self_us is not None else b - a,
            is_user_annotation=annotation,
        )

    events = [
        fe("ProfilerStep#1", 0, 1000, "CPU", annotation=True),
        fe("forward", 0, 1000, "CPU", annotation=True),
        fe("aten::mm", 10, 20, "CPU", kernels=[NS(name="gemm", duration=250.0)]),
        fe("ProfilerStep#1", 5, 1000, "CUDA", annotation=True),
        fe("forward", 5, 990, "CUDA", annotation=True),
        fe("gemm", 20, 270, "CUDA"),
    ]
    spans = spans_from_profiler(events)
    assert [s.name for s in spans if s.kind is SpanKind.KERNEL] == ["gemm"]
    out = summarize(spans)
    assert out["gpu_idle_share"] == pytest.approx(0.75)
    assert out["phases"][0].kernels[0].name == "gemm"
