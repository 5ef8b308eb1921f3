"""RunState: the reducer both views render from."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from fixtures.streams import GiB, T0, build_state, config, cpu_run, ev, gpu_run, step_event
from gptop.state import RunState, fmt_bytes, fmt_duration, fmt_num, fmt_toggles, model_summary, phase_label, spread_pct
from trainer.contract.events import (
    CheckpointEvent,
    ErrorEvent,
    HelloEvent,
    MalformedEvent,
    ModelInfo,
    StepEvent,
    TrialEvent,
    UnknownEvent,
)


def hello(
    device_type: str = "cuda", capability=(9, 0), max_steps: int = 1000, cpu_bf16: bool = True, **toggles
) -> HelloEvent:
    dev = {
        "type": device_type,
        "name": "NVIDIA H100" if device_type == "cuda" else "cpu",
        "capability": list(capability) if device_type == "cuda" else None,
        "cpu_bf16": cpu_bf16,
    }
    return ev(
        "hello",
        0.0,
        config=config("llama", "small", device_type, max_steps=max_steps, **toggles),
        device=dev,
        model={"family": "llama", "size": "small", "total_params": 100_000_000, "active_params": 100_000_000},
    )


def step(n: int, t: float, phases: dict[str, float] | None = None, rank: int = 0, **extra) -> StepEvent:
    phases = phases or {"data": 10.0, "forward": 30.0, "backward": 50.0, "optimizer": 8.0, "other": 2.0}
    fields = dict(tokens_per_step=1000, mfu=0.3, mem=GiB, loss=3.0 - n / 1000, lr=1e-3, grad_norm=1.0, tokens_per_s=1e4)
    fields["step_ms"] = sum(phases.values())
    return step_event(n, t, phases=phases, rank=rank, **{**fields, **extra})  # `extra` over this file's defaults


def fed(*events, **kwargs) -> RunState:
    s = RunState(**kwargs)
    for e in events:
        s.apply(e)
    return s


# --- events ----------------------------------------------------------------------


def test_hello_sets_config_device_model_and_total_steps():
    s = fed(hello(max_steps=500))
    assert s.total_steps == 500
    assert s.device.name == "NVIDIA H100" and s.device.capability == (9, 0)
    assert s.model.family == "llama"
    assert s.toggles.compile == "off"
    assert s.step is None and s.eta() is None and s.progress() is None


def test_step_updates_latest_histories_and_tokens():
    s = fed(hello(), step(10, 1.0), step(20, 2.0, loss=None))
    assert s.step == 20 and s.tokens == 20_000
    assert s.last_step.step == 20
    assert s.history("loss") == [pytest.approx(2.99)]  # null loss is not a point
    assert [x for x, _ in s.history_points("step_ms")] == [10, 20]
    assert s.history("backward") == [50.0, 50.0]
    assert s.progress() == pytest.approx(0.02)


def test_histories_are_bounded():
    s = fed(hello(), *[step(i, float(i)) for i in range(1, 50)], history=5)
    assert len(s.history("loss")) == 5
    assert len(s.history("data")) == 5
    assert s.history_points("loss")[-1][0] == 49


def test_eval_checkpoint_warning_error_done_log():
    s = fed(
        hello(),
        step(10, 1.0),
        ev("eval", 2.0, step=10, loss=2.5),
        ev("checkpoint", 3.0, step=10, path="ck/10.pt", seconds=0.5),
        ev("warning", 4.0, message="slow data"),
        ev("error", 5.0, kind="nan", message="loss is nan"),
        ev("log", 5.5, message="compiling"),
        ev("done", 6.0, step=10, tokens=10_000),
    )
    assert s.history("eval_loss") == [2.5] and s.last_eval.loss == 2.5
    assert s.checkpoints_written == 1 and list(s.checkpoints) == [
        CheckpointEvent(step=10, path="ck/10.pt", seconds=0.5, time=T0 + 3.0)
    ]
    assert list(s.warnings) == ["slow data"]
    assert s.errors[-1].kind == "nan" and s.errors[-1].message == "loss is nan"
    assert s.done.step == 10
    assert ("event", "compiling") in s.logs_tail(10)
    assert any("loss is nan" in line for _, line in s.logs_tail(10))


def test_unknown_event_type_is_ignored_but_moves_the_clock():
    future = ev("from_the_future", 9.0, whatever=1)
    assert isinstance(future, UnknownEvent) and future.extra == {"whatever": 1}
    s = fed(hello(), future)
    assert s.elapsed() == 9.0 and s.malformed == 0


def test_version_bumps_on_every_change_and_per_area():
    s = RunState()
    v0 = s.version
    s.apply(hello())
    s.apply(step(1, 1.0))
    s.apply(ev("device", 1.0, devices=[], cpu={"util_pct": 5.0}))
    s.add_log("hi")
    s.set_status("running")
    s.count_malformed("garbage")
    s.apply(ev("tuner", 2.0, phase="trials"))
    assert s.version == v0 + 7
    assert all(s.versions[a] >= 1 for a in ("run", "step", "device", "log", "tuner"))
    dev = s.versions["device"]
    s.apply(step(2, 2.0))
    assert s.versions["device"] == dev


def test_status_and_malformed_counter():
    s = RunState()
    assert s.status == "starting"
    s.set_status("failed", "exit code 1")
    assert (s.status, s.status_message) == ("failed", "exit code 1")
    s.count_malformed("{not json")
    s.count_malformed("x" * 500)
    assert s.malformed == 2 and s.last_malformed.endswith("…") and len(s.last_malformed) <= 201


def test_ill_typed_fields_are_malformed_at_the_boundary_and_never_reach_the_state():
    s = fed(hello())
    with pytest.raises(MalformedEvent, match="step.step"):
        ev(
            "step",
            1.0,
            step="ten",
            tokens=0,
            loss=None,
            lr=0,
            grad_norm=0,
            step_ms=1,
            phases_ms={},
            tokens_per_s=0,
            mfu=None,
            mem_bytes=0,
        )
    with pytest.raises(MalformedEvent, match="trial.number"):
        ev("trial", 1.0, number="x", toggles={}, status="ok")
    assert s.step is None and not s.tuner.trials
    s.apply(ev("trial", 1.0, number=None, toggles={}, status="infeasible", kind="baseline"))  # unnumbered: kept
    assert s.malformed == 0 and s.tuner.trials[-1].status == "infeasible"


def test_logs_bounded_with_streams_and_since():
    s = RunState(log_lines=3)
    for i in range(5):
        s.add_log(f"line {i}\n", "stderr" if i % 2 else "stdout")
    assert s.logs_tail(10) == [("stdout", "line 2"), ("stderr", "line 3"), ("stdout", "line 4")]
    assert s.logs_tail(10, streams=("stderr",)) == [("stderr", "line 3")]
    new, count = s.logs_since(3)
    assert count == 5 and new == [("stderr", "line 3"), ("stdout", "line 4")]
    new, count = s.logs_since(0)  # older than the buffer: what is left
    assert len(new) == 3
    assert s.logs_since(5) == ([], 5)


# --- step breakdown and hints ------------------------------------------------------


def test_phase_means_and_percent_over_last_n():
    # step 0: the process's first step event (warm-up), left out of the window while later ones exist
    s = fed(
        hello(),
        step(0, 0.5, {"data": 900.0}),
        step(1, 1.0, {"data": 100.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0, "other": 0.0}),
        *[step(i, float(i)) for i in range(2, 6)],
        phase_window=4,
    )
    means = s.phase_means()
    assert means["data"] == pytest.approx(10.0)  # the first (data-heavy) step fell out of the window
    assert s.phase_means(5)["data"] == pytest.approx(28.0)
    pct = s.phase_percent()
    assert pct == pytest.approx({"data": 10.0, "forward": 30.0, "backward": 50.0, "optimizer": 8.0, "other": 2.0})
    assert sum(pct.values()) == pytest.approx(100.0)
    assert s.mean_step_ms() == pytest.approx(100.0)


def test_gpu_idle_percent():
    s = fed(hello(), step(0, 0.5, gpu_idle_ms=90.0), step(1, 1.0, gpu_idle_ms=25.0), step(2, 2.0, gpu_idle_ms=15.0))
    assert s.mean_gpu_idle_ms() == 20.0 and s.gpu_idle_percent() == pytest.approx(20.0)
    assert fed(hello(), step(1, 1.0)).gpu_idle_percent() is None


def test_missing_phases_use_their_sum():
    s = fed(hello(), step(1, 1.0, step_ms=None, phases_ms={"forward": 30.0, "backward": 10.0}))
    assert s.phase_percent() == {"forward": 75.0, "backward": 25.0}
    assert fed(hello(), step(1, 1.0, phases_ms=None)).phase_percent() == {}


PH = {"data": 5.0, "forward": 30.0, "backward": 50.0, "optimizer": 10.0, "other": 5.0}


@pytest.mark.parametrize(
    "phases, hello_kw, extra, expect",
    [
        (
            {**PH, "data": 30.0, "forward": 25.0, "backward": 30.0},
            {},
            {},
            "raise --prefetch (now 2) or --workers (now 0)",
        ),
        (
            {**PH, "optimizer": 30.0, "forward": 20.0, "backward": 40.0, "data": 5.0, "other": 5.0},
            {},
            {},
            "try --fused-adamw",
        ),
        (PH, {}, {"gpu_idle_ms": 30.0}, "--compile reduce-overhead"),
        (PH, {"compile": "reduce-overhead"}, {"gpu_idle_ms": 30.0}, "larger --micro-batch"),
        ({**PH, "other": 30.0, "forward": 20.0, "backward": 35.0, "optimizer": 10.0}, {}, {}, "--compile default"),
        (PH, {}, {}, "try --compile default"),
        (PH, {"precision": "fp32"}, {}, "--compile default or --precision bf16"),
        (PH, {"precision": "fp32", "compile": "default"}, {}, "try --precision bf16"),
    ],
)
def test_bottleneck_hints(phases, hello_kw, extra, expect):
    s = fed(hello(**hello_kw), step(1, 1.0, phases, **extra))
    assert expect in (s.bottleneck_hint() or "")


def test_hints_only_name_toggles_that_apply():
    # fused AdamW already on: no optimizer hint
    s = fed(hello(fused_adamw=True), step(1, 1.0, {**PH, "optimizer": 30.0, "backward": 30.0}))
    assert "fused" not in (s.bottleneck_hint() or "")
    # bf16 needs compute capability 8.0: not offered on a V100
    s = fed(hello(capability=(7, 0), precision="fp32", compile="default"), step(1, 1.0, PH))
    assert s.bottleneck_hint() == "compute-bound: forward+backward are 80% of the step"
    # nor on a CPU whose bf16 is emulated (no AVX-512): only compile is suggested there
    avx2 = hello("cpu", precision="fp32", cpu_bf16=False)
    assert (
        fed(avx2, step(1, 1.0, PH)).bottleneck_hint() == "compute-bound (forward+backward 80%): try --compile default"
    )
    assert "--precision bf16" in fed(hello("cpu", precision="fp32"), step(1, 1.0, PH)).bottleneck_hint()
    # no hello yet (a second node's gptop before issue 13's fix): the device is unknown, so no bf16 or compile
    assert fed(step(1, 1.0, PH)).bottleneck_hint() == "compute-bound: forward+backward are 80% of the step"
    # GPU idle is a GPU notion: never on the CPU
    s = fed(hello("cpu"), step(1, 1.0, PH, gpu_idle_ms=50.0))
    assert "idle" not in (s.bottleneck_hint() or "")
    # balanced step: nothing to say
    s = fed(hello(), step(1, 1.0, {"data": 10.0, "forward": 20.0, "backward": 30.0, "optimizer": 15.0, "other": 20.0}))
    assert s.bottleneck_hint() is None
    assert fed(hello()).bottleneck_hint() is None


def test_applied_toggles_feed_the_hint():
    s = fed(hello(), step(1, 1.0, PH), ev("apply", 2.0, toggles={"compile": "default"}))
    assert s.toggles.compile == "default"
    assert "--compile" not in s.bottleneck_hint()
    s.apply(hello())  # the restarted trainer says what is in force
    assert s.toggles.compile == "off"


# --- time ------------------------------------------------------------------------


def test_elapsed_and_eta_from_event_times():
    s = fed(hello(max_steps=100), step(10, 10.0), step(20, 20.0))
    assert s.elapsed() == 20.0
    assert s.steps_per_s() == pytest.approx(1.0)
    assert s.eta() == pytest.approx(80.0)
    s.apply(ev("device", 25.0, devices=[]))  # time passes without steps: ETA counts down
    assert s.eta() == pytest.approx(75.0)


def test_eta_with_injected_clock():
    now = [T0 + 30.0]
    s = fed(hello(max_steps=100), step(10, 10.0), step(20, 20.0), clock=lambda: now[0])
    assert s.elapsed() == 30.0 and s.eta() == pytest.approx(70.0)
    now[0] = T0 + 500.0  # 480 s without a step event where 10 s were expected: not done, slower
    assert s.eta() == pytest.approx(80 * 48.0 - 480.0)
    assert fmt_duration(s.eta()) != "0:00"


def test_mfu_on_a_measured_peak_is_shown_as_approximate():
    from gptop.headless import event_line
    from gptop.state import fmt_mfu, fmt_peak

    assert fmt_mfu(0.123) == "12.3%" and fmt_mfu(0.123, estimate=True) == "~12%" and fmt_mfu(None) == "n/a"
    gpu = fed(hello(), step(10, 1.0))
    assert not gpu.mfu_is_estimate and "mfu 30.0%" in event_line(gpu.last_step, gpu)
    measured = ev(
        "hello",
        0.0,
        config=config("llama", "tiny", "cpu"),
        device={"type": "cpu", "name": "cpu"},
        model={"family": "llama"},
        peak_flops=96.4e9,
        peak_source="measured: best of 3 CPU matmul measurements (float32; ...)",
    )
    cpu = fed(measured, step(10, 1.0))
    assert cpu.mfu_is_estimate and "mfu ~30%" in event_line(cpu.last_step, cpu)
    assert (
        fmt_peak(measured) == "MFU peak 96.4 GFLOP/s per process (measured: best of 3 CPU matmul measurements "
        "(float32; ...))"
    )
    assert "; MFU peak 96.4 GFLOP/s" in event_line(measured, cpu)
    datasheet = ev(
        "hello",
        0.0,
        config=config("llama", "tiny", "cuda"),
        device={"type": "cuda", "name": "H100"},
        model={"family": "llama"},
        peak_flops=989.5e12,
        peak_source="datasheet: H100 SXM bf16 (url)",
    )
    assert not datasheet.mfu_is_estimate and fmt_peak(datasheet).startswith("MFU peak 989.5 TFLOP/s")


def test_eta_follows_a_tenfold_slowdown():
    """1 s/step for 100 steps, then 10 s/step: a few events later the ETA is near the slow rate's answer
    (the old window average read 4x too low), and the range, while it is unstable, contains it."""
    events = [hello(max_steps=1000)] + [step(n, float(n)) for n in range(10, 110, 10)]
    t = 100.0
    for n in range(110, 160, 10):
        t += 100.0
        events.append(step(n, t))
    s = fed(*events)
    truth = (1000 - 150) * 10.0
    assert truth / 1.5 <= s.eta() <= truth * 1.5
    lo, hi = s.eta_range()
    assert lo <= truth <= hi * 1.05
    for n in range(160, 300, 10):  # the slow rate holds: the range closes on it
        t += 100.0
        s.apply(step(n, t))
    assert s.eta_range()[0] == s.eta_range()[1] == s.eta() == pytest.approx((1000 - 290) * 10.0, rel=0.05)


def test_eta_is_a_range_when_the_rate_is_unstable():
    t, events = 0.0, [hello(max_steps=1000)]
    for i, n in enumerate(range(10, 200, 10)):
        t += 10.0 if i % 2 else 30.0  # 1 and 3 s/step, alternating
        events.append(step(n, t))
    s = fed(*events)
    lo, hi = s.eta_range()
    assert lo < s.eta() < hi
    assert 810 * 1.0 <= lo and hi <= 810 * 3.0
    steady = fed(hello(max_steps=100), step(10, 10.0), step(20, 20.0), step(30, 30.0))
    assert steady.eta_range() == (pytest.approx(70.0), pytest.approx(70.0))


def test_eta_lies_in_its_range_and_is_never_zero_while_steps_remain():
    import random

    rng = random.Random(7)
    for trial in range(20):
        now = [T0]
        s = RunState(clock=lambda: now[0])
        s.apply(hello(max_steps=200))
        t, n = 0.0, 0
        while n < 200:
            n += rng.choice((1, 5, 10))
            n = min(n, 200)
            t += rng.uniform(0.01, 20.0) * rng.choice((1, 1, 10))
            s.apply(step(n, t))
            for lag in (0.0, rng.uniform(0, 50), 1e4):
                now[0] = T0 + t + lag
                r, e = s.eta_range(), s.eta()
                if r is None:
                    continue
                assert r[0] <= e <= r[1]
                assert (e == 0.0) == (n == 200) and (n == 200 or e >= 1.0)


def test_eta_is_zero_only_after_the_last_step():
    now = [T0 + 29.0]
    s = fed(hello(max_steps=30), step(10, 10.0), step(20, 20.0), clock=lambda: now[0])
    assert s.eta() == 1.0 and fmt_duration(s.eta()) == "0:01"  # 10 steps left, 9 s into them: not 0:00
    now[0] = T0 + 29.9
    assert s.eta() >= 1.0
    s.apply(step(30, 30.0))
    assert s.eta() == 0.0 and s.eta_range() == (0.0, 0.0)


def test_rollback_and_restart_reset_the_rate():
    s = fed(hello(max_steps=100), step(10, 10.0), step(20, 20.0), step(15, 21.0))
    assert s.steps_per_s() is None and s.step == 15
    s.apply(step(25, 31.0))
    assert s.steps_per_s() == pytest.approx(1.0)
    s.apply(hello(max_steps=100))
    assert s.steps_per_s() is None and s.hellos == 2


# --- ranks, experts, devices, energy -------------------------------------------------


def test_per_rank_latest_and_spread():
    slow = {**PH, "data": 25.0}
    s = fed(hello(), step(10, 1.0, rank=0), step(10, 1.0, slow, rank=1), step(10, 1.0, rank=2))
    assert set(s.ranks) == {0, 1, 2} and s.primary_rank == 0
    sp = s.rank_spread()
    assert sp["step_ms"].max == 120.0 and sp["step_ms"].min == 100.0 and sp["step_ms"].slowest_rank == 1
    assert sp["data"].slowest_rank == 1 and sp["data"].fastest_rank == 0
    assert sp["step_ms"].imbalance == pytest.approx(120 / (320 / 3) - 1)
    assert len(s.history("loss")) == 1  # histories follow the primary rank only
    assert fed(hello(), step(10, 1.0)).rank_spread() == {}


def test_expert_load_imbalance_and_layer():
    load = [[0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]]
    s = fed(hello(), step(10, 1.0, expert_load=load))
    mx, mean = s.expert_imbalance()
    assert mx == pytest.approx(2.8) and mean == pytest.approx(1.9)
    assert s.expert_layer(1) == [0.7, 0.1, 0.1, 0.1]
    assert s.expert_layer(99) == load[-1]
    assert s.is_moe
    assert fed(hello(), step(1, 1.0)).expert_imbalance() is None


def test_device_samples_latest_history_window_and_nulls():
    s = RunState()
    for i in range(10):
        s.apply(
            ev(
                "device",
                float(i),
                devices=[{"kind": "gpu", "index": 0, "util_pct": float(i * 10), "mem_used": None, "power_w": 100.0}],
                cpu={"util_pct": 50.0, "mem_used": GiB},
            )
        )
    assert s.device_keys() == ["gpu0", "cpu"]
    assert s.device_latest["gpu0"].util_pct == 90.0 and s.device_latest["gpu0"].extra == {"kind": "gpu"}
    assert s.device_history("gpu0", "util_pct") == [i * 10.0 for i in range(10)]
    assert s.device_history("gpu0", "util_pct", window_s=3) == [60.0, 70.0, 80.0, 90.0]
    assert s.device_history("gpu0", "mem_used") == []  # null values are not points
    assert s.device_points("cpu", "util_pct", 1.0) == [(T0 + 8.0, 50.0), (T0 + 9.0, 50.0)]


def test_joules_per_token_from_energy_counters():
    s = fed(
        hello(),
        ev("device", 0.0, devices=[{"index": 0, "energy_j": 0.0}, {"index": 1, "energy_j": 0.0}]),
        step(10, 1.0),
        ev("device", 2.0, devices=[{"index": 0, "energy_j": 400.0}, {"index": 1, "energy_j": 400.0}]),
        step(20, 3.0),
    )
    # both series cover t=1..2: 400 J (of 800 J over 2 s, both GPUs) for 5k tokens
    assert s.joules_per_token() == pytest.approx(0.08)


def test_joules_per_token_integrates_power_without_counters_and_says_why_not():
    s = fed(
        hello(),
        ev("device", 0.0, devices=[{"index": 0, "power_w": 500.0, "energy_j": None}]),
        step(10, 1.0),
        ev("device", 2.0, devices=[{"index": 0, "power_w": 500.0, "energy_j": None}]),
        step(20, 3.0),
    )
    assert s.joules_per_token() == pytest.approx(500.0 / 5_000.0)  # 500 W over t=1..2, 5k tokens
    assert s.energy()[0].source == "integrated power" and s.energy_reason() is None
    one = fed(hello(), ev("device", 0.0, devices=[{"index": 0, "power_w": 500.0}]), step(10, 1.0))
    assert one.joules_per_token() is None and one.energy_reason() == "not enough step events yet"
    assert fed(hello(), step(10, 1.0)).joules_per_token() is None
    cpu = fed(
        hello("cpu"),
        ev("device", 0.0, devices=[], cpu={"power_w": None}),
        step(1, 1.0),
        ev("device", 2.0, devices=[], cpu={"power_w": None}),
        step(2, 3.0),
    )
    assert cpu.joules_per_token() is None and "RAPL" in cpu.energy_reason()
    gpu = fed(
        hello(),
        ev("device", 0.0, devices=[{"index": 0}]),
        step(10, 1.0),
        ev("device", 2.0, devices=[{"index": 0}]),
        step(20, 3.0),
    )
    assert "neither an energy counter nor a power reading for GPU 0" in gpu.energy_reason()


def test_tuner_state_from_tuner_trial_and_apply_events():
    s = fed(
        hello(),
        ev("tuner", 1.0, phase="find-micro-batch", budget_left_s=1800, trial=None, trials_run=0, trials_planned=10),
        ev(
            "trial",
            3.0,
            number=0,
            toggles={"compile": "off"},
            status="ok",
            tokens_per_s=100.0,
            spread=1.0,
            peak_mem=GiB,
            reason="baseline",
            kind="baseline",
        ),
        ev("trial", 4.0, number=1, toggles={"compile": "default"}, status="running"),
        ev("trial", 5.0, number=1, toggles={"compile": "default"}, status="cut", tokens_per_s=150.0),
        ev("trial", 6.0, number=2, toggles={"micro_batch": "64"}, status="infeasible", reason="OOM"),
        ev("trial", 6.5, number=3, toggles={"compile": "max-autotune"}, status="pruned", tokens_per_s=200.0),
        ev("tuner", 7.0, phase="trials", budget_left_s=1000.5, trial=4, trials_run=4),
    )
    tu = s.tuner
    assert tu.phase == "trials" and tu.budget_left_s == 1000.5 and tu.trial == 4 and tu.trials_planned == 10
    assert tu.trials_run == 4 and tu.active
    assert tu.trials[0].reason == "baseline" and tu.trials[0].kind == "baseline"
    assert tu.trials[1].status == "cut" and tu.trials[2].status == "infeasible"
    assert tu.best.number == 1  # pruned trials do not count, however fast they looked
    s.apply(ev("apply", 8.0, toggles={"compile": "default"}, number=1, tokens_per_s=150.0, baseline_tokens_per_s=100.0))
    assert tu.applied[-1].number == 1
    assert s.tuner_budget_left() == 999.5  # 1000.5 at t=7, and the clock is at t=8 now
    s.apply(ev("tuner", 9.0, phase="done"))
    assert not s.tuner.active


def test_tuner_budget_runs_down_between_its_events():
    clock = [T0 + 100.0]
    s = RunState(clock=lambda: clock[0])
    s.apply(ev("tuner", 100.0, phase="trials", budget_left_s=600.0))
    clock[0] = T0 + 160.0  # a trial compiling: no tuner event for a minute
    assert s.tuner_budget_left() == 540.0
    clock[0] = T0 + 1000.0
    assert s.tuner_budget_left() == 0.0
    s.apply(ev("tuner", 1000.0, phase="done", budget_left_s=12.0))
    clock[0] = T0 + 2000.0
    assert s.tuner_budget_left() == 12.0  # done: what was left stays as it was


def test_toggle_diff_is_against_what_the_run_started_with():
    s = fed(hello(), ev("apply", 1.0, toggles={"compile": "default"}), hello(compile="default"))
    assert s.initial_toggles is not None and s.toggles is not None
    assert s.initial_toggles.compile == "off" and s.toggles.compile == "default"
    full = dataclasses.replace(s.initial_toggles, compile="default", fused_adamw=True)
    assert s.toggle_diff(full) == {"compile": "default", "fused_adamw": True}
    assert s.toggle_diff(s.initial_toggles) == {}


def test_last_error():
    s = fed(hello())
    assert s.last_error() is None
    s.apply(ev("error", 1.0, kind="config", message="bad flag"))
    assert s.last_error() == ErrorEvent(kind="config", message="bad flag", time=T0 + 1.0)


# --- fixtures and formatting ---------------------------------------------------------


def test_fixture_streams_reduce_cleanly():
    gpu = build_state("gpu", failed=True)
    assert gpu.malformed == 0 and gpu.step == 300 and gpu.status == "failed"
    assert gpu.errors[-1].kind == "crash" and len(gpu.checkpoints) == 1
    assert gpu.tuner.best.number == 1 and gpu.expert_imbalance() is not None
    assert gpu.joules_per_token() is not None
    cpu = build_state("cpu")
    assert cpu.device_keys() == ["cpu"] and "data loading" in cpu.bottleneck_hint()
    assert len(gpu_run()) > 100 and len(cpu_run()) > 50


def test_concurrent_writer_and_reader():
    s = RunState(history=50, log_lines=50)
    s.apply(hello())
    stop = threading.Event()
    written: list[int] = []

    def writer():
        i = 0
        while not stop.is_set() or i == 0:
            i += 1
            s.apply(step(i, float(i)))
            s.add_log(f"line {i}")
            s.apply(ev("device", float(i), devices=[{"index": 0, "util_pct": 1.0}]))
        written.append(i)

    t = threading.Thread(target=writer)  # an exception in it fails the test (pyproject's filterwarnings)
    t.start()
    try:
        for _ in range(300):
            s.phase_percent(), s.history("loss"), s.logs_tail(20), s.device_history("gpu0", "util_pct", 10)
            s.rank_spread(), s.joules_per_token(), s.eta(), s.bottleneck_hint()
            assert len(s.logs_tail(20)) <= 20
    finally:
        stop.set()
        t.join()
    assert written, "the writer thread did not finish"
    assert s.step == written[0] and s.logs_tail(1) == [("stdout", f"line {written[0]}")]


def test_formatting_helpers():
    assert fmt_num(12345) == "12.3k" and fmt_num(None) == "n/a" and fmt_num(2.0) == "2" and fmt_num(2.5) == "2.5"
    assert fmt_bytes(1.5 * GiB) == "1.5 GB" and fmt_bytes(None) == "n/a" and fmt_bytes(10) == "10 B"
    assert fmt_duration(3725) == "1:02:05" and fmt_duration(65) == "1:05" and fmt_duration(None) == "n/a"
    assert fmt_toggles({"compile": "default", "fused_adamw": True}) == "compile=default fused_adamw=on"
    assert fmt_toggles({}) == "(as started)"
    trial = TrialEvent(number=1, toggles={}, status="ok", tokens_per_s=200.0, spread=5.0)
    assert spread_pct(trial) == 2.5
    assert spread_pct(TrialEvent(number=1, toggles={}, status="ok", tokens_per_s=1.0)) is None
    assert phase_label("find-micro-batch") == "find micro batch" and phase_label(None) == "idle"
    assert (
        model_summary(ModelInfo(family="deepseek", size="medium", total_params=400_000_000, active_params=100_000_000))
        == "deepseek medium · 400.0M params (100.0M active)"
    )
    assert model_summary(None) == ""


def test_elapsed_stops_at_the_done_event_and_a_new_hello_resumes_it():
    now = [T0 + 100.0]
    s = fed(hello(max_steps=100), step(10, 10.0), ev("done", 20.0, step=10, tokens=10_000), clock=lambda: now[0])
    s.apply(ev("device", 60.0, devices=[]))  # samples go on while the finished run stays on screen
    assert s.elapsed() == 20.0
    s.apply(hello(max_steps=100))  # restarted (tuning, resume): the clock runs again
    assert s.elapsed() == 100.0


def test_run_name_defaults_to_the_run_directory_and_subscribers_hear_every_change():
    s = RunState(run_dir="runs/20260101-llama-tiny/")
    assert s.run_name == "20260101-llama-tiny"
    calls = []
    s.subscribe(lambda: calls.append(1))
    s.apply(hello())
    s.add_log("x")
    s.set_status("running")
    assert len(calls) == 3
    s.unsubscribe(calls.append)  # not subscribed: no error


# --- issue 11: live from the first second ------------------------------------------------------------------


def test_the_early_hello_is_not_a_restart_and_carries_the_estimate():
    from fixtures.streams import startup_run

    s = fed(*startup_run("compiling"))
    assert s.hellos == 1 and s.hello is not None and not s.hello.early  # early + full = one start
    assert (
        s.estimate is not None
        and s.estimate_line() == "~14.8 GiB (optimizer 6.6 GiB), ~1.8 min per step, ~6.1 h for 200 steps (estimate)"
    )
    assert s.initial_toggles.micro_batch == 2  # from the full hello, not "auto"
    early = fed(*startup_run("building"))
    assert early.hellos == 0 and early.hello.early and early.total_steps == 200
    assert model_summary(early.model) == "deepseek medium · 887.4M params (344.8M active)"
    assert early.estimate_warning is not None and "~1.8 min per step" in early.estimate_warning.message
    assert early.estimate_line(short=True) == "est. ~14.8 GiB, ~1.8 min/step"  # the header: no room


def test_the_startup_phase_says_what_and_for_how_long():
    from fixtures.streams import startup_run

    s = fed(*startup_run("tokenizing"))
    assert s.startup_line() == "tokenizing builtin 90% · 0:02"  # since the phase began
    s = fed(*startup_run("probing"))
    assert s.startup_line() == "probing micro-batch 2 · 0:20"  # probing since mb 1
    clock = [T0 + 40.0]
    s = fed(*startup_run("compiling"), clock=lambda: clock[0])
    clock[0] = T0 + 102.0
    assert s.startup_line() == "compiling (torch.compile default) · 0:42"  # ticks
    s.apply(ev("progress", 150.0, step=1, tokens=8192, step_ms=90_000.0))
    assert s.startup_line() is None and s.step == 1 and s.tokens == 8192


def test_progress_events_move_the_counter_rate_and_eta_between_step_events():
    from fixtures.streams import startup_run

    events = startup_run("steps")
    s = fed(*[e for e in events if e.type != "progress"])
    assert s.step == 10 and s.steps_per_s() is None  # one step event: no rate yet
    s = fed(*events)
    assert s.step == 13 and s.tokens == 13 * 8192
    assert s.steps_per_s() == pytest.approx(1 / 95.0)
    assert s.eta() == pytest.approx((200 - 13) * 95.0)
    assert s.last_step.step == 10 and len(s.history("loss")) == 1  # histories stay at the log interval
    s.apply(ev("progress", 2000.0, step=4, tokens=4 * 8192))  # rolled back: the rate starts over
    assert s.step == 4 and s.steps_per_s() is None


def test_a_new_process_clears_the_startup_and_the_rate():
    from fixtures.streams import startup_run

    s = fed(*startup_run("steps"))
    s.apply(ev("error", 1500.0, kind="oom", message="x"))
    assert s.startup is None
    s.apply(startup_run("building")[0])
    assert s.steps_per_s() is None and s.hellos == 1


def test_between_the_full_hello_and_the_first_step_it_says_first_step():
    from fixtures.streams import startup_run

    events = [e for e in startup_run("compiling") if e.type != "phase" or e.phase != "compiling"]
    clock = [T0 + 59.0]
    s = fed(*events, clock=lambda: clock[0], status="running")
    clock[0] = T0 + 71.0
    assert s.startup_line() == "first step · 0:12"  # built at 59 s, no compile phase: the step runs
    s.apply(ev("progress", 80.0, step=1, tokens=1))
    assert s.startup_line() is None


def test_a_launch_bound_hint_never_names_a_cuda_graph_mode_the_run_cannot_use():
    """reduce-overhead is refused with gradient accumulation (trainer.contract.capabilities): the hint for
    an idle GPU names it only where the run does not accumulate."""
    h = hello()
    assert "--compile reduce-overhead" in fed(h, step(1, 1.0, PH, gpu_idle_ms=30.0)).bottleneck_hint()
    accumulating = dataclasses.replace(h, accumulation=4)
    hint = fed(accumulating, step(1, 1.0, PH, gpu_idle_ms=30.0)).bottleneck_hint()
    assert "reduce-overhead" not in hint and "larger --micro-batch" in hint
    assert (
        "reduce-overhead"
        in fed(dataclasses.replace(h, accumulation=1), step(1, 1.0, PH, gpu_idle_ms=30.0)).bottleneck_hint()
    )


def test_a_replay_keeps_its_own_clock_beside_todays_device_samples():
    """A monitor replaying a finished run samples the devices now; the run's ETA and elapsed time stay those of
    its own events, whichever arrives first (a device sample of today is not the run's time)."""
    from fixtures.streams import cpu_device

    events = cpu_run(steps=30)
    replayed = RunState(run_name="r", run_dir="runs/r", status="replay")
    recorded = RunState(run_name="r", run_dir="runs/r", status="replay")
    for e in events:
        recorded.apply(e)
    replayed.apply(cpu_device(1_000_000.0))  # sampled today, long after the run
    for e in events:
        replayed.apply(e)
    assert recorded.eta() is not None and replayed.eta() == recorded.eta()
    assert replayed.now() == events[-1].time
